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

This module composes the figure and writes it; the left column is ``plot_grid``'s, the right column
``plot_evidence``'s, and the measured text and blocks both stack are ``plot_blocks``'.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, Sequence

from ...errors import InputError, UsageError
from ...formats.safe_write import write_atomic
from .plot_blocks import (
    DPI,
    EVIDENCE_LEFT_IN,
    GRID_LEFT_IN,
    GRID_WIDTH_IN,
    MARGIN_IN,
    WIDTH_IN,
    Block,
    clean,
    text_block,
    wrapped,
)
from .plot_evidence import evidence_blocks, gradient_bars
from .plot_grid import _views, grid_block, layout_caption, legend_blocks, parallel_layout, rank_states
from .report import rank_ranges, step_headline
from .verdict import Incident, Report


def plot_title(incident: Incident) -> str:
    """The verdict in one line: the cause, what made it (the summary's first clause) and the origin ranks;
    the whole summary is the text report's."""
    origin = sorted({entry["global_rank"] for entry in incident.origin})
    where = f" (origin: rank {rank_ranges(origin, 40)})" if origin else ""
    clause = incident.verdict.summary.split(": ")[0].replace("`", "")
    return f"Verdict: {incident.verdict.cause.value}: {clause}{where}"


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
