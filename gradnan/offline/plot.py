"""``gradnan report RUN_DIR --plot incident.png``: the first failing step as a picture (needs matplotlib).

It renders the ``Report`` that ``analysis.analyze`` decided and nothing else: the title is the text report's
headline (``plot_title``: the cause, its first clause and the origin), the roles are the analysis'
(origin, received, silent).

Left: every rank, laid out by the job's parallel layout rather than by rank number: a row per pipeline
stage, a column per data-parallel replica, and inside each cell that replica's tensor-parallel peers
(across) and its context/expert-parallel peers (down, where those axes tell a cell's ranks apart). Each
rank is coloured origin / received (holds the NaN/Inf) / own gradients finite / no record; the origin is
ringed and named (rank, coordinates, host, device), and the ranks that received it through the
data-parallel all-reduce are outlined. Where a cell's peers would be narrower than ``MIN_PIXELS``, a cell
shows the strongest state among its ranks (origin over received over finite), so the origin and the
collective's path stay visible at 16,384 ranks.

Right: the evidence that decides the verdict: the rerun's forward origin and the magnitude path up to it
(where the step was run again in place), the largest finite gradient of each offending parameter against
its dtype's limit, and the verdict's evidence lines.

Below it, the run-up (where ranks wrote one): the largest |gradient| of the culprit's bucket before the
data-parallel collective, step by step up to the failing one, on a log scale: the ranks where it grew first
(else the origin) in red, every other rank in grey (past ``MAX_RUNUP_LINES`` of them, the band between
their smallest and largest value at each step); a non-finite value is a red mark at the top edge.

Every text drawn is escaped like the terminal's text (``gradnan.formats.text.printable``) with its
whitespace collapsed (a name from a file is one
line of plain text), math text is off, and matplotlib's warnings (a glyph missing from the font) are
dropped, so nothing from a file reaches the terminal raw; every text's size is known before it is placed,
so none overlaps another or leaves the figure at any world size (tests/test_plot.py measures them).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import InputError, UsageError
from ..formats.incident import OriginBasis, RecordKind
from ..formats.layout import AXES, rank_label
from ..formats.magnitude import DTYPE_MAX, magnitude_text
from ..formats.schema import write_atomic
from ..formats.text import printable, wrap
from .report import ROLE_TEXT, rank_ranges, rank_role, rerun_lines, step_headline
from .runup import RankRunUp, RunUp
from .verdict import Incident, Report, View

NO_RANK, NO_RECORD, FINITE, RECEIVED, ORIGIN = range(5)  # a cell's state; a pooled cell shows the largest
COLOURS = ("#ffffff", "#7f7f7f", "#dddddd", "#f39c12", "#c0392b")
ORIGIN_RING = "#000000"
OUTLINE = "#7a3e00"

WIDTH_IN = 16.0
DPI = 100
MARGIN_IN = 0.3
GRID_LEFT_IN, GRID_WIDTH_IN = 1.0, 8.2  # the grid's axes; its tick labels in the margin to its left
COLLECTIVE_LABEL_IN = 0.15  # gap between the grid and the label of the collective's row
EVIDENCE_LEFT_IN = 10.6
EVIDENCE_WIDTH_IN = WIDTH_IN - EVIDENCE_LEFT_IN - MARGIN_IN
TICK_SPACE_IN = 0.5  # below an axes: its tick labels and axis label
MIN_PIXELS = 3  # a tensor-parallel peer narrower than this: cells show their strongest state
MAX_BARS = 8
MAX_EVIDENCE_LINES = 12
BAR_SLOT_IN = 0.42  # one bar and its name above it
RUNUP_HEIGHT_IN = 1.9
MAX_RUNUP_LINES = 8  # other ranks drawn one by one; more are drawn as one band
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


# --- the layout: where each rank sits ---------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Where each rank is drawn: ``places`` maps a global rank to (row, column, row in the cell, column in
    the cell). By the parallel layout (``axes``: row, column, in-cell column, in-cell rows) where every
    rank has its coordinates; else by rank number (``axes`` empty)."""

    axes: Tuple[str, ...]
    rows: int
    cols: int
    inner_rows: int
    inner_cols: int
    places: Dict[int, Tuple[int, int, int, int]]

    @property
    def by_number(self) -> bool:
        return not self.axes


def _coordinate(view: View, axis: str) -> Optional[int]:
    value = view.get(axis, 0 if axis in ("cp", "ep") else None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _varying_inside_cells(views: Sequence[View]) -> Tuple[str, ...]:
    """The context/expert-parallel axes that tell apart ranks of one (pp, dp, tp) position: they get rows
    inside a cell; an axis that follows from the others (expert parallelism within data parallelism) none."""
    varying = []
    for axis in ("cp", "ep"):
        seen: Dict[Tuple[int, ...], int] = {}
        for view in views:
            key = tuple(_coordinate(view, other) for other in ("pp", "dp", "tp"))
            if seen.setdefault(key, _coordinate(view, axis)) != _coordinate(view, axis):
                varying.append(axis)
                break
    return tuple(varying)


def _by_number(ranks: Sequence[int]) -> Layout:
    """Rows of ranks in number order, about twice as wide as tall."""
    count = len(ranks)
    cols = max(1, min(count, math.ceil(math.sqrt(2 * count))))
    return Layout((), math.ceil(count / cols), cols, 1, 1,
                  {rank: (index // cols, index % cols, 0, 0) for index, rank in enumerate(ranks)})


def parallel_layout(views: Sequence[View]) -> Layout:
    """The grid of pipeline stages x data-parallel replicas, tensor-parallel peers across a cell (and
    context/expert-parallel ones down it where they vary within it); by rank number where a rank lacks a
    coordinate, two ranks share one place, or the coordinates would spread them over far more cells than
    there are ranks (coordinates from a file are not trusted)."""
    ranks = [view["global_rank"] for view in views]
    if any(_coordinate(view, axis) is None for view in views for axis in ("tp", "pp", "dp", "cp", "ep")):
        return _by_number(ranks)
    inner = _varying_inside_cells(views)
    sizes = {axis: 1 + max(_coordinate(view, axis) for view in views) for axis in ("tp", "pp", "dp", *inner)}
    inner_rows = math.prod(sizes[axis] for axis in inner)
    if sizes["pp"] * sizes["dp"] * sizes["tp"] * inner_rows > 4 * len(views) + 64:
        return _by_number(ranks)
    places = {}
    for view in views:
        inner_row = 0
        for axis in inner:
            inner_row = inner_row * sizes[axis] + _coordinate(view, axis)
        places[view["global_rank"]] = (_coordinate(view, "pp"), _coordinate(view, "dp"), inner_row,
                                       _coordinate(view, "tp"))
    if len(set(places.values())) < len(places):
        return _by_number(ranks)
    return Layout(("pp", "dp", "tp", *inner), sizes["pp"], sizes["dp"], inner_rows, sizes["tp"], places)


def rank_states(incident: Incident) -> Dict[int, int]:
    """Each known rank's state at the failing step, as the analysis decided it."""
    states = {view["global_rank"]: NO_RECORD for view in incident.silent}
    states.update((view["global_rank"], RECEIVED if view.get("holds_nonfinite") else FINITE)
                  for view in incident.receivers)
    states.update((entry["global_rank"], ORIGIN) for entry in incident.origin)
    return states


def _views(incident: Incident) -> List[View]:
    """Every known rank once (an origin rank with several bucket groups appears once per group)."""
    unique: Dict[int, View] = {}
    for view in (*incident.origin, *incident.receivers, *incident.silent):
        unique.setdefault(view["global_rank"], view)
    return list(unique.values())


# --- text and panels, measured before they are placed ------------------------------------------------------

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


def _dtype_name(dtype: str) -> str:
    return dtype.removeprefix("torch.")


def gradient_bars(incident: Incident) -> Tuple[str, List[Tuple[str, float]], List[float]]:
    """The origin's offending parameters with their largest finite gradient and the limit of their dtype
    (where the map gives it), or, for a norm overflow, the largest gradient and the magnitude whose square
    passes float32. The first origin entry of the rank the pattern names. (heading, bars, limits)"""
    first_rank = incident.pattern.first_rank
    gradients = [e for e in incident.origin if e.get("kind") != RecordKind.STATE]  # not bad weights
    shown = [e for e in gradients if e["global_rank"] == first_rank] or gradients[:1]
    if not shown:
        return "", [], []
    entry = shown[0]
    where = f"rank {entry['global_rank']}"
    largest = entry.get("largest_grad")
    if incident.origin_basis is OriginBasis.NORM_OVERFLOW and largest:
        value = largest["value"]
        limit = math.sqrt(DTYPE_MAX["torch.float32"])
        return (f"Largest gradient on {where} (finite); its square passes float32's range beyond the red"
                f" line ({magnitude_text(limit)})",
                [(largest["name"], abs(value) if isinstance(value, (int, float)) else math.inf)], [limit])
    params = [p for e in shown for p in e["params"]]
    bars = [(p["name"], float(p["abs_max_finite"])) for p in params
            if isinstance(p.get("abs_max_finite"), (int, float)) and p["abs_max_finite"] > 0]
    dtypes = sorted({p["dtype"] for p in params if p.get("dtype") in DTYPE_MAX})
    limits = [DTYPE_MAX[dtype] for dtype in dtypes]
    against = (", against the " + " and ".join(f"{_dtype_name(d)} limit ({magnitude_text(DTYPE_MAX[d])})"
                                               for d in dtypes) + " (red line)" if dtypes
               else " (the parameters' dtype is not in the maps: no limit drawn)")
    more = f", the first {MAX_BARS} of {len(bars)}" if len(bars) > MAX_BARS else ""
    return (f"Largest finite |gradient| per offending parameter on {where} in backward order{more}{against}",
            bars[:MAX_BARS], limits)


def magnitude_bars(incident: Incident) -> Tuple[List[Tuple[str, float]], List[float]]:
    """The magnitude path where the rerun has one: the inputs and the output of the call where a value grew
    out of line, then the module where it went non-finite. (bars, the grown output's dtype limit)"""
    rerun = incident.rerun
    grew_in = rerun.grew_in if rerun is not None else None
    if not grew_in:
        return [], []
    bars = []
    if isinstance(grew_in.get("inputs_abs_max"), (int, float)) and grew_in["inputs_abs_max"] > 0:
        bars.append((f"into {grew_in['module']} ({grew_in['class']}): inputs and weights",
                     float(grew_in["inputs_abs_max"])))
    bars.append((f"out of {grew_in['module']} ({grew_in['class']})", float(grew_in["output_abs_max"])))
    if rerun.module:
        bars.append((f"out of {rerun.module} ({rerun.module_class})", math.inf))
    dtype = grew_in.get("dtype")
    return bars, [DTYPE_MAX[dtype]] if dtype in DTYPE_MAX else []


def evidence_blocks(incident: Incident) -> List[Block]:
    """The right column: the forward origin and its magnitude path, the gradients against their limit,
    the verdict's evidence."""
    width, blocks = EVIDENCE_WIDTH_IN, []

    def heading(text: str) -> None:
        blocks.append(text_block(wrapped(text, width, 10), 10, width, fontweight="bold"))

    def body(lines: Sequence[str], limit: int = 6) -> None:
        shown = [line for text in lines for line in wrapped(text, width, 8.5, "    ")]
        if len(shown) > limit:
            shown = shown[:limit - 1] + ["... (the rest: gradnan report RUN_DIR)"]
        blocks.append(text_block(shown, 8.5, width))

    if incident.rerun is None:
        heading("Forward origin: not known (the step was not run again in place)")
    else:
        first, *rest = rerun_lines(incident.rerun)[:3]
        heading(first)
        body([line.strip() for line in rest], limit=6)
        bars, limits = magnitude_bars(incident)
        if bars:
            limit = f" (red line: the {_dtype_name(incident.rerun.grew_in['dtype'])} limit)" if limits else ""
            path = ("The magnitude path: the largest |value| into and out of the call where it grew, then"
                    f" where it went non-finite{limit}")
            blocks.append(text_block(wrapped(path, width, 8.5), 8.5, width))
            blocks.append(bar_block(bars, limits, width))
    title, bars, limits = gradient_bars(incident)
    if title and bars:  # a panel with no finite value in it draws nothing
        heading(title)
        blocks.append(bar_block(bars, limits, width))
    if incident.runup is not None:
        heading(f"Run-up: {incident.runup.finding.headline}")
        body([incident.runup.summary], limit=5)
        if any(rank.steps for rank in incident.runup.ranks):
            blocks.append(runup_block(incident.runup, highlighted_ranks(incident), width))
    if incident.verdict.evidence:
        heading("Why")
        body([f"- {item}" for item in incident.verdict.evidence], limit=MAX_EVIDENCE_LINES)
    return blocks


def plot_title(incident: Incident) -> str:
    """The verdict in one line: the cause, what made it (the summary's first clause) and the origin ranks;
    the whole summary is the text report's."""
    origin = sorted({entry["global_rank"] for entry in incident.origin})
    where = f" (origin: rank {rank_ranges(origin, 40)})" if origin else ""
    clause = incident.verdict.summary.split(": ")[0].replace("`", "")
    return f"Verdict: {incident.verdict.cause.value}: {clause}{where}"


def highlighted_ranks(incident: Incident) -> Tuple[int, ...]:
    """The run-up's ranks drawn in red: where it grew first, else the origin's."""
    runup = incident.runup
    if runup is not None and runup.first_ranks:
        return runup.first_ranks
    return tuple(sorted({entry["global_rank"] for entry in incident.origin}))


def _series(rank: RankRunUp, step: int) -> Tuple[List[int], List[float], List[int]]:
    """A rank's finite values by steps before the failing ``step`` (x <= 0), and where it was not finite."""
    xs, ys, bad = [], [], []
    for at, value in zip(rank.steps, rank.values):
        number = float(value)
        if math.isfinite(number) and number > 0:
            xs.append(at - step)
            ys.append(number)
        elif not math.isfinite(number):
            bad.append(at - step)
    return xs, ys, bad


def _band(ranks: Sequence[RankRunUp], step: int) -> Tuple[List[int], List[float], List[float]]:
    """Per step, the smallest and the largest finite value over ``ranks``."""
    by_step: Dict[int, List[float]] = {}
    for rank in ranks:
        xs, ys, _ = _series(rank, step)
        for x, y in zip(xs, ys):
            by_step.setdefault(x, []).append(y)
    xs = sorted(by_step)
    return xs, [min(by_step[x]) for x in xs], [max(by_step[x]) for x in xs]


def runup_block(runup: RunUp, highlighted: Sequence[int], width_in: float) -> Block:
    """The culprit bucket's largest |gradient| per step on every rank, log scale (module docstring)."""
    from matplotlib.ticker import MaxNLocator, NullFormatter

    def draw(figure, left: float, top: float) -> None:
        axes = figure.add_axes(_inches_to_figure(figure, left + 0.55, top, width_in - 0.6, RUNUP_HEIGHT_IN))
        axes.set_yscale("log")
        red = [rank for rank in runup.ranks if rank.global_rank in highlighted]
        grey = [rank for rank in runup.ranks if rank.global_rank not in highlighted]
        if len(grey) > MAX_RUNUP_LINES:
            xs, low, high = _band(grey, runup.step)
            axes.fill_between(xs, low, high, color="#bbbbbb", step="mid",
                              label=f"{len(grey)} other ranks (smallest to largest)")
        else:
            for number, rank in enumerate(grey):
                xs, ys, _ = _series(rank, runup.step)
                axes.plot(xs, ys, color="#999999", linewidth=1, marker=".",
                          label="other ranks" if number == 0 else None)
        for number, rank in enumerate(red[:MAX_RUNUP_LINES]):
            xs, ys, bad = _series(rank, runup.step)
            axes.plot(xs, ys, color="#c0392b", linewidth=1.8, marker="o", markersize=3,
                      label=shortened(clean(rank.label), 40) if number < 3 else None)
            for x in bad:
                axes.plot([x], [1], transform=axes.get_xaxis_transform(), marker="v", color="#c0392b",
                          markersize=8, clip_on=False)
        axes.set_xlabel("steps before the failing step (0: the failing step; red mark at the top: NaN/Inf)",
                        fontsize=8)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        axes.set_ylabel("largest |grad|", fontsize=8)
        axes.yaxis.set_major_formatter(_magnitude_formatter())
        low, high = axes.get_ylim()
        # within one decade no major tick is drawn: the minor ones carry the labels (matplotlib's own
        # would be raw mathtext here)
        within_a_decade = 0 < low and high < 10 * low
        axes.yaxis.set_minor_formatter(_magnitude_formatter() if within_a_decade else NullFormatter())
        axes.tick_params(which="both", labelsize=8)
        axes.legend(fontsize=7, loc="upper left", frameon=False)
    return Block(RUNUP_HEIGHT_IN + TICK_SPACE_IN + 0.05, draw)


def _magnitude_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: magnitude_text(value))


# --- the grid ------------------------------------------------------------------------------------------

def _grid_pixels(layout: Layout, height_in: float) -> Tuple[float, float]:
    """The width and height in pixels of one rank's place, unpooled."""
    return (GRID_WIDTH_IN * DPI / (layout.cols * layout.inner_cols),
            height_in * DPI / (layout.rows * layout.inner_rows))


def grid_image(layout: Layout, states: Dict[int, int], pooled: bool):
    """The picture's array: a pixel per rank; ``pooled``: a pixel per cell, its strongest rank's state."""
    import numpy

    image = numpy.zeros((layout.rows, layout.inner_rows, layout.cols, layout.inner_cols), dtype=numpy.int8)
    for rank, (row, col, inner_row, inner_col) in layout.places.items():
        image[row, inner_row, col, inner_col] = states.get(rank, NO_RANK)
    if pooled:
        return image.max(axis=(1, 3))
    return image.reshape(layout.rows * layout.inner_rows, layout.cols * layout.inner_cols)


def _ticks(count: int, length_in: float, size: float, widest: int, marked: Sequence[int]) -> List[int]:
    """Positions to label along an axis of ``count`` cells, ``length_in`` long, labels ``widest``
    characters wide at ``size`` points (1 for the height of a vertical axis' labels): every k-th, and the
    ``marked`` ones (the origin's) with no neighbour closer than k."""
    room = length_in * 72 / (size * (CHAR_WIDTH * widest + 0.8))
    stride = max(1, math.ceil(count / max(1.0, room)))
    chosen = sorted(set(marked))
    for position in range(0, count, stride):
        if all(abs(position - other) >= stride for other in chosen):
            chosen.append(position)
    return sorted(chosen)


def _place(layout: Layout, rank: int, pooled: bool) -> Tuple[float, float]:
    """The centre of a rank's place, in cell units (x, y)."""
    row, col, inner_row, inner_col = layout.places[rank]
    if pooled:
        return col + 0.5, row + 0.5
    return col + (inner_col + 0.5) / layout.inner_cols, row + (inner_row + 0.5) / layout.inner_rows


def grid_height(layout: Layout) -> float:
    return min(4.2, max(1.2, 0.3 * layout.rows * layout.inner_rows))


def grid_block(incident: Incident, layout: Layout, states: Dict[int, int]) -> Tuple[Block, Dict[str, Any]]:
    height = grid_height(layout)
    width, tall = _grid_pixels(layout, height)
    pooled = width < MIN_PIXELS or tall < MIN_PIXELS
    origin = [rank for rank, state in states.items() if state == ORIGIN and rank in layout.places]
    peers = [view for view in incident.receivers if view.get("holds_nonfinite")
             and rank_role(view, list(incident.origin)) == "dp_peer"]
    outlined = sorted({layout.places[rank][0] for rank in origin}) if peers and not layout.by_number else []
    drawn = {"pooled": pooled, "outlined_rows": outlined}

    def draw(figure, left: float, top: float) -> None:
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Rectangle

        axes = figure.add_axes(_inches_to_figure(figure, GRID_LEFT_IN, top, GRID_WIDTH_IN, height))
        axes.imshow(grid_image(layout, states, pooled), cmap=ListedColormap(COLOURS), vmin=0,
                    vmax=len(COLOURS) - 1, aspect="auto", interpolation="nearest",
                    extent=(0, layout.cols, layout.rows, 0))
        if GRID_WIDTH_IN * DPI / layout.cols >= 4:
            axes.vlines(range(1, layout.cols), 0, layout.rows, colors="white", linewidth=1)
        if height * DPI / layout.rows >= 4:
            axes.hlines(range(1, layout.rows), 0, layout.cols, colors="white", linewidth=1.5)
        origin_cells = [layout.places[rank] for rank in origin]
        row_name, col_name = ("pp", "dp") if not layout.by_number else ("r", "+")
        cols = _ticks(layout.cols, GRID_WIDTH_IN, 8, len(f"{col_name}{layout.cols}") + 1,
                      [cell[1] for cell in origin_cells])
        rows = _ticks(layout.rows, height, 8, 1, [cell[0] for cell in origin_cells])
        axes.set_xticks([col + 0.5 for col in cols],
                        [f"{col_name}{col}" for col in cols], fontsize=8)
        axes.set_yticks([row + 0.5 for row in rows],
                        [f"{row_name}{row * (layout.cols if layout.by_number else 1)}" for row in rows],
                        fontsize=8)
        for label, col in zip(axes.get_xticklabels(), cols):
            if col in {cell[1] for cell in origin_cells}:
                label.set_color(COLOURS[ORIGIN])
        for label, row in zip(axes.get_yticklabels(), rows):
            if row in {cell[0] for cell in origin_cells}:
                label.set_color(COLOURS[ORIGIN])
        axes.tick_params(length=2)
        if layout.by_number:
            axes.set_xlabel("ranks by number (the records lack a parallel layout): row start + column",
                            fontsize=9)
        else:
            axes.set_xlabel("data-parallel replica (dp)", fontsize=9)
            axes.set_ylabel("pipeline stage (pp)", fontsize=9)
        named = not pooled and _name_places(axes, layout, states, height)
        if not pooled:
            _separate_peers(axes, layout, height)
        place_pt = max(GRID_WIDTH_IN / layout.cols / (1 if pooled else layout.inner_cols),
                       height / layout.rows / (1 if pooled else layout.inner_rows)) * 72
        for rank in origin:
            x, y = _place(layout, rank, pooled)
            axes.plot([x], [y], marker="o", markersize=min(40.0, max(20.0, 1.5 * place_pt)),
                      markerfacecolor="none", markeredgecolor=ORIGIN_RING, markeredgewidth=1.8, clip_on=False)
        if origin and not named:
            _point_at_origin(axes, layout, origin[0], pooled, height)
        for row in outlined:
            axes.add_patch(Rectangle((0, row), layout.cols, 1, fill=False, edgecolor=OUTLINE, linewidth=2,
                                     linestyle="--", clip_on=False))
            axes.text(layout.cols, row + 0.5, "  data-parallel\n  all-reduce", fontsize=8, va="center",
                      ha="left", color=OUTLINE)
    return Block(height + TICK_SPACE_IN, draw), drawn


def _separate_peers(axes, layout: Layout, height: float) -> None:
    """Thin lines between the peers inside a cell, where they are wide enough to tell apart."""
    if layout.inner_cols > 1 and GRID_WIDTH_IN * DPI / (layout.cols * layout.inner_cols) >= 8:
        axes.vlines([col + inner / layout.inner_cols for col in range(layout.cols)
                     for inner in range(1, layout.inner_cols)], 0, layout.rows, colors="white", linewidth=0.6)
    if layout.inner_rows > 1 and height * DPI / (layout.rows * layout.inner_rows) >= 8:
        axes.hlines([row + inner / layout.inner_rows for row in range(layout.rows)
                     for inner in range(1, layout.inner_rows)], 0, layout.cols, colors="white", linewidth=0.6)


def _name_places(axes, layout: Layout, states: Dict[int, int], height: float) -> bool:
    """Each rank's number inside its place, where every place has room for the widest; whether it did."""
    width_pt = GRID_WIDTH_IN * 72 / (layout.cols * layout.inner_cols)
    height_pt = height * 72 / (layout.rows * layout.inner_rows)
    widest = max(len(f"rank {rank}") for rank in layout.places)
    if widest * 8 * CHAR_WIDTH + 6 > width_pt or _line_height(8) * 72 + 4 > height_pt:
        return False
    for rank in layout.places:
        x, y = _place(layout, rank, False)
        axes.text(x, y, f"rank {rank}", fontsize=8, ha="center", va="center",
                  color="white" if states.get(rank) in (ORIGIN, NO_RECORD) else "black")
    return True


def _point_at_origin(axes, layout: Layout, rank: int, pooled: bool, height: float) -> None:
    """"origin: rank N" above the origin's place (below it on the top row), an arrow to it; aligned so that
    it stays inside the grid wherever the origin is."""
    x, y = _place(layout, rank, pooled)
    row_height_pt = height * 72 / layout.rows
    above = layout.places[rank][0] > 0
    offset = (0.5 * row_height_pt + 12) * (1 if above else -1)
    side = x / layout.cols
    align = "left" if side < 0.25 else "right" if side > 0.75 else "center"
    axes.annotate(f"origin: rank {rank}", (x, y), xytext=(0, offset), textcoords="offset points",
                  fontsize=9, fontweight="bold", ha=align, va="bottom" if above else "top", color=ORIGIN_RING,
                  bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": ORIGIN_RING,
                        "linewidth": 0.8},
                  arrowprops={"arrowstyle": "-|>", "color": ORIGIN_RING, "linewidth": 1.2,
                              "shrinkB": 9})


def layout_caption(layout: Layout) -> str:
    count = len(layout.places)
    if layout.by_number:
        return f"{count:,} rank(s), by rank number"
    down = f", {' x '.join(layout.axes[3:])} down ({layout.inner_rows} rows)" if layout.axes[3:] else ""
    return (f"{count:,} rank(s): pp{layout.rows} x dp{layout.cols} cells, tp{layout.inner_cols} across"
            f" each{down}")


def legend_blocks(incident: Incident, states: Dict[int, int], outlined: bool) -> List[Block]:
    """A swatch and a line (or two) per state: who, how many, how it got there."""
    width = GRID_LEFT_IN + GRID_WIDTH_IN - MARGIN_IN - 0.3
    origin = list(incident.origin)
    counts = {state: sum(1 for value in states.values() if value == state) for state in range(len(COLOURS))}
    first = origin[0] if origin else None
    named = (rank_label(first, "after", [axis for axis in AXES if axis in first]) if first else "none found")
    more = f"; and {counts[ORIGIN] - 1} more: {rank_ranges([e['global_rank'] for e in origin[1:]])}" \
        if counts[ORIGIN] > 1 else ""
    holders = [view for view in incident.receivers if view.get("holds_nonfinite")]
    roles: Dict[str, int] = {}
    for view in holders:
        role = rank_role(view, origin)
        roles[role] = roles.get(role, 0) + 1
    received = "; ".join(f"{count} {ROLE_TEXT[role]}"
                         + (", through the data-parallel all-reduce (outlined)"
                            if role == "dp_peer" and outlined else "") for role, count in roles.items())
    entries = [(ORIGIN, f"origin ({incident.origin_basis.description}), ringed: {named}{more}"),
               (RECEIVED, f"received, holding the NaN/Inf: {counts[RECEIVED]:,} rank(s)"
                          + (f": {received}" if received else "")),
               (FINITE, f"own gradients finite (only the norm was non-finite): {counts[FINITE]:,} rank(s)"),
               (NO_RECORD, f"no record at this step (finite norm, or died first): {counts[NO_RECORD]:,}"
                           " rank(s)")]
    blocks = []
    for state, text in entries:
        lines = wrapped(text, width, 9)
        block = text_block(lines, 9, width)

        def draw(figure, left: float, top: float, state=state, block=block) -> None:
            from matplotlib.patches import Rectangle

            figure.patches.append(Rectangle(
                ((left) / WIDTH_IN, 1 - (top + 0.17) / figure.get_figheight()), 0.17 / WIDTH_IN,
                0.15 / figure.get_figheight(), transform=figure.transFigure, facecolor=COLOURS[state],
                edgecolor="#444444", linewidth=0.6))
            block.draw(figure, left + 0.3, top)
        blocks.append(Block(block.height, draw))
    return blocks


# --- the figure ------------------------------------------------------------------------------------------

def _stack(figure, blocks: Sequence[Block], left: float, top: float, gap: float) -> None:
    for block in blocks:
        block.draw(figure, left, top)
        top += block.height + gap


def _height(blocks: Sequence[Block], gap: float) -> float:
    return sum(block.height for block in blocks) + gap * max(0, len(blocks) - 1)


def draw_incident(report: Report):
    """The report's incident as a matplotlib figure, and what it shows (``layout``, ``states``,
    ``pooled``, ``outlined_rows``, ``title``, ``bars``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'gradnan[plot]'") from None
    incident = report.incident
    if incident is None:
        raise InputError(f"{report.run_dir}: no failing step to plot")
    layout, states = parallel_layout(_views(incident)), rank_states(incident)
    full = WIDTH_IN - 2 * MARGIN_IN
    title = wrapped(plot_title(incident), full, 12)
    subtitle = wrapped(f"{step_headline(incident)}  ·  {report.run_dir}", full, 10)
    grid, drawn = grid_block(incident, layout, states)
    caption = text_block(wrapped(f"Every rank by its place in the job: {layout_caption(layout)}",
                                 GRID_LEFT_IN + GRID_WIDTH_IN - MARGIN_IN, 10), 10,
                         GRID_LEFT_IN + GRID_WIDTH_IN - MARGIN_IN, fontweight="bold")
    left = [caption, grid, *legend_blocks(incident, states, bool(drawn["outlined_rows"]))]
    right = evidence_blocks(incident)
    head = [text_block(title, 12, full, fontweight="bold"), text_block(subtitle, 10, full, color="#444444")]
    body_top = MARGIN_IN + _height(head, 0.05) + 0.25
    height = body_top + max(_height(left, 0.08), _height(right, 0.1)) + MARGIN_IN
    with matplotlib.rc_context({"text.usetex": False, "text.parse_math": False, "svg.fonttype": "path"}):
        figure = plt.figure(figsize=(WIDTH_IN, height), dpi=DPI)
        _stack(figure, head, MARGIN_IN, MARGIN_IN, 0.05)
        _stack(figure, left, MARGIN_IN, body_top, 0.08)
        _stack(figure, right, EVIDENCE_LEFT_IN, body_top, 0.1)
    _, bars, _ = gradient_bars(incident)
    return figure, {"layout": layout, "states": states, "title": title, "bars": bars, **drawn}


def plot_incident(report: Report, path: Path) -> Dict[str, Any]:
    """Draw the report's incident into ``path`` (PNG, SVG or PDF by suffix, ``PICTURE_FORMATS``); return
    what was drawn (``draw_incident``). The picture is written whole to a new file, then renamed over
    ``path`` (an old picture stays whole if the disk is full); a link, a device or a directory at ``path``
    is refused, never written through. matplotlib's warnings (a glyph missing from the font for a name
    from a file, numpy's overflow near float64's limit) are dropped: the terminal gets the report."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        figure, drawn = draw_incident(report)
        import matplotlib

        try:
            with matplotlib.rc_context({"text.usetex": False, "text.parse_math": False,
                                        "svg.fonttype": "path"}):
                write_atomic(path, lambda stream: figure.savefig(stream, format=path.suffix[1:].lower(),
                                                                 dpi=DPI), plain_only=True)
        except (OSError, ValueError) as exc:
            reason = clean(str(exc).splitlines()[0])
            raise UsageError(f"{clean(path)}: cannot write the picture ({reason})") from None
        finally:
            import matplotlib.pyplot as plt

            plt.close(figure)
    return drawn
