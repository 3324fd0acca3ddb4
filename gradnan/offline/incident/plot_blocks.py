"""The incident picture's measured pieces: the figure's geometry (inches, DPI, the text metrics), plain
text made safe and wrapped to a width (``clean``, ``shortened``, ``wrapped``), and the ``Block``s the
columns stack: text and log-scale bar charts whose height is known before they are placed.

Apart from ``plot`` because every panel (the grid, the evidence, the legend) is built from these, and the
promise that no text overlaps another or leaves the figure rests on the measures kept here alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple

from ...formats.magnitude import magnitude_text
from ...formats.text import printable, wrap

WIDTH_IN = 16.0
DPI = 100
MARGIN_IN = 0.3
GRID_LEFT_IN, GRID_WIDTH_IN = 1.0, 8.2  # the grid's axes; its tick labels in the margin to its left
COLLECTIVE_LABEL_IN = 0.15  # gap between the grid and the label of the collective's row
EVIDENCE_LEFT_IN = 10.6
EVIDENCE_WIDTH_IN = WIDTH_IN - EVIDENCE_LEFT_IN - MARGIN_IN
TICK_SPACE_IN = 0.5  # below an axes: its tick labels and axis label
BAR_SLOT_IN = 0.42  # one bar and its name above it
LINE_HEIGHT = 1.45  # a text line's height in font sizes (with the gap to the next), conservative
CHAR_WIDTH = 0.62  # DejaVu Sans' widest common glyphs in font sizes (the wrapping's budget per character)


# a text's line length in characters, for a width in inches at a font size in points
def _chars(width_in: float, size: float) -> int:
    return max(8, int(width_in * 72 / (size * CHAR_WIDTH)))


def clean(text: Any) -> str:
    """One line of plain text: whitespace (newlines, line separators) collapsed, then escaped."""
    return printable(" ".join(str(text).split()))


def shortened(text: str, limit: int) -> str:
    """``text`` cut in the middle to ``limit`` characters: a parameter's name keeps its start and its end."""
    if len(text) <= limit:
        return text
    keep = limit - 1
    return text[:keep // 2] + "…" + text[len(text) - (keep - keep // 2):]


def wrapped(text: str, width_in: float, size: float, indent: str = "") -> List[str]:
    """``text`` as lines of plain text (``clean``), never broken inside a value from a file."""
    lines = wrap(" ".join(str(text).split()), _chars(width_in, size), subsequent_indent=indent)
    return [printable(line) for line in lines] or [""]


@dataclass
class Block:
    """Something stacked in a column: its height in inches and how to draw it at (left, top) in inches."""

    height: float
    draw: Callable[[Any, float, float], None]


def _line_height(size: float) -> float:
    return size * LINE_HEIGHT / 72


def text_block(lines: Sequence[str], size: float, width_in: float, **style: Any) -> Block:
    """Lines already wrapped to ``width_in``; ``style``: matplotlib text properties."""
    def draw(figure, left: float, top: float) -> None:
        figure.text(left / WIDTH_IN, 1 - top / figure.get_figheight(), "\n".join(lines), fontsize=size,
                    va="top", ha="left", linespacing=1.2, **style)
    return Block(len(lines) * _line_height(size) + 0.05, draw)


def _inches_to_figure(figure, left: float, top: float, width: float, height: float) -> List[float]:
    figure_height = figure.get_figheight()
    return [left / WIDTH_IN, 1 - (top + height) / figure_height, width / WIDTH_IN, height / figure_height]


def _log_axis(axes, values: Sequence[float], limits: Sequence[float]) -> None:
    """A log x axis spanning ``values`` and ``limits``, ticks written as the headline writes magnitudes."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    shown = [v for v in (*values, *limits) if 0 < v < math.inf]
    low, high = min(shown, default=1e-3), max(shown, default=1.0)
    axes.set_xscale("log")
    lowest, highest = math.floor(math.log10(low) - 0.5), math.ceil(math.log10(high) + 0.5)
    lowest, highest = max(-300, lowest), min(307, max(highest, lowest + 1))
    axes.set_xlim(10.0 ** lowest, 10.0 ** highest)
    step = max(1, math.ceil((highest - lowest) / 6))
    axes.xaxis.set_major_locator(FixedLocator([10.0 ** power for power in range(lowest, highest + 1, step)]))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: magnitude_text(value)))
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.tick_params(axis="x", labelsize=8)


def bar_block(bars: Sequence[Tuple[str, float]], limits: Sequence[float], width_in: float) -> Block:
    """Horizontal bars on a log scale, each named above its bar, its value at its end; a non-finite value
    reaches the edge and says so; each of ``limits`` a red dashed line."""
    height = len(bars) * BAR_SLOT_IN

    def draw(figure, left: float, top: float) -> None:
        axes = figure.add_axes(_inches_to_figure(figure, left, top, width_in, height))
        finite = [value for _, value in bars if math.isfinite(value)]
        _log_axis(axes, finite, limits)
        edge = axes.get_xlim()[1]
        axes.set_ylim(len(bars), 0)
        axes.set_yticks([])
        name_chars = _chars(width_in - 0.1, 8)
        for slot, (name, value) in enumerate(bars):
            drawn = min(value, edge) if value > 0 else axes.get_xlim()[0]
            colour = "#34495e" if math.isfinite(value) else "#c0392b"
            axes.barh(slot + 0.68, drawn, height=0.45, color=colour, left=axes.get_xlim()[0])
            axes.text(0.01, slot + 0.05, shortened(clean(name), name_chars),
                      transform=axes.get_yaxis_transform(), fontsize=8, va="top", ha="left")
            label = "non-finite" if not math.isfinite(value) else magnitude_text(value)
            inside = math.log(drawn) > math.log(axes.get_xlim()[0]) + 0.75 * (
                math.log(edge) - math.log(axes.get_xlim()[0]))
            axes.text(drawn, slot + 0.68, f" {label} " if not inside else f"{label} ", fontsize=8,
                      va="center", ha="right" if inside else "left", color="white" if inside else "black")
        for limit in limits:
            axes.axvline(limit, color="#c0392b", linestyle="--", linewidth=1.2)
    return Block(height + TICK_SPACE_IN - 0.15, draw)
