"""The incident picture's right column: the evidence behind the verdict, as ``evidence_blocks`` stacks it:
the rerun's forward origin and its magnitude path, the offending gradients against their dtype's limit, the
run-up of the culprit's bucket on every rank, and the verdict's evidence lines.

Apart from ``plot`` because it is where the picture reads the analysis' findings (the rerun, the origin's
maps, the run-up) and turns them into panels; the grid only needs each rank's state.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

from ...formats.incident import OriginBasis, RecordKind
from ...formats.magnitude import DTYPE_MAX, magnitude_text
from .plot_blocks import (
    EVIDENCE_WIDTH_IN,
    TICK_SPACE_IN,
    Block,
    _inches_to_figure,
    bar_block,
    clean,
    shortened,
    text_block,
    wrapped,
)
from .report import rerun_lines
from .runup import RankRunUp, RunUp
from .verdict import Incident

MAX_BARS = 8
MAX_EVIDENCE_LINES = 12
RUNUP_HEIGHT_IN = 1.9
MAX_RUNUP_LINES = 8  # other ranks drawn one by one; more are drawn as one band


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
    if rerun is None or not rerun.grew_in:
        return [], []
    grew_in = rerun.grew_in
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
        grew_in = incident.rerun.grew_in
        if bars and grew_in:  # bars: where the rerun has a magnitude path (grew_in)
            limit = f" (red line: the {_dtype_name(grew_in['dtype'])} limit)" if limits else ""
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
