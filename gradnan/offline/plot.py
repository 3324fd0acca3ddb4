"""``gradnan report RUN_DIR --plot incident.png``: the first failing step as a picture (needs matplotlib).

Left: rank x module map of the offending modules (origin, received, clean), modules in backward order, the
columns centred on the origin (``report.focus_ranks``: the origin, the ranks holding the NaN, its peers).
Right: the largest finite gradient value of each offending parameter on the origin (log scale), with
the fp16 limit, where an fp16 overflow shows as bars reaching the line.
"""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ..errors import InputError, UsageError
from .analysis import Incident, Report, module_of
from .report import focus_ranks

MAX_MODULES = 20
MAX_RANKS = 32
ORIGIN, RECEIVED, CLEAN = 2, 1, 0
FP16_MAX = 65504.0


def incident_grid(incident: Incident) -> Tuple[List[str], List[int], List[List[int]]]:
    """Modules (rows, backward order), ranks (columns) and the ORIGIN/RECEIVED/CLEAN value of each cell."""
    modules = [m["module"] for m in incident.parameters][:MAX_MODULES]
    cells: Dict[int, Dict[str, int]] = {}
    for entry in incident.origin:
        cells[entry["global_rank"]] = {module_of(p["name"]): ORIGIN for p in entry["params"]}
    for view in incident.receivers:
        cells[view["global_rank"]] = {module: RECEIVED for module in view["modules"]}
    ranks = focus_ranks(incident, MAX_RANKS)
    return modules, ranks, [[cells.get(rank, {}).get(module, CLEAN) for rank in ranks] for module in modules]


def plot_incident(report: Report, path: Path) -> Dict[str, Any]:
    """Draw the report's incident into ``path`` (PNG, SVG or PDF by suffix); return what was drawn.
    Magnitudes near float64's limit (from a file) draw at the axis' edge, without numpy's overflow
    warnings on the terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return _draw(report, path)


def _draw(report: Report, path: Path) -> Dict[str, Any]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'gradnan[plot]'") from None
    incident = report.incident
    if incident is None:
        raise InputError(f"{report.run_dir}: no failing step to plot")
    modules, ranks, grid = incident_grid(incident)
    first_rank = incident.pattern.first_rank
    shown = [e for e in incident.origin if e["global_rank"] == first_rank] or list(incident.origin[:1])
    bars = [(p["name"], float(p["abs_max_finite"])) for entry in shown for p in entry["params"]
            if isinstance(p.get("abs_max_finite"), (int, float)) and p["abs_max_finite"] > 0][:MAX_MODULES]
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 1.6 + 0.35 * max(len(modules), len(bars), 4)),
                                         gridspec_kw={"width_ratios": [max(len(ranks), 4), 6]})
    left.imshow(grid or [[CLEAN]], cmap=ListedColormap(["#e8e8e8", "#f4a259", "#c0392b"]), vmin=0, vmax=2,
                aspect="auto")
    left.set_xticks(range(len(ranks)), [f"r{rank}" for rank in ranks])
    left.set_yticks(range(len(modules)), modules, fontsize=8)
    left.set_title("rank x module (red origin, orange received, grey clean)", fontsize=9)
    origin_ranks = {entry["global_rank"] for entry in incident.origin}
    for column, rank in enumerate(ranks):
        if rank in origin_ranks:
            left.get_xticklabels()[column].set_color("#c0392b")
            left.get_xticklabels()[column].set_fontweight("bold")
    if bars:
        right.barh(range(len(bars)), [value for _, value in bars], color="#34495e")
        right.set_yticks(range(len(bars)), [name for name, _ in bars], fontsize=7)
        right.set_xscale("log")
        right.axvline(FP16_MAX, color="#c0392b", linestyle="--", linewidth=1, label="fp16 max")
        right.legend(fontsize=7, loc="lower right")
        right.invert_yaxis()
    else:
        right.axis("off")
        right.text(0.5, 0.5, "no finite value left in the offending gradients", ha="center", fontsize=9)
    rank = shown[0]["global_rank"] if shown else "?"
    right.set_title(f"largest finite |gradient| per offending parameter on rank {rank}", fontsize=9)
    verdict = incident.verdict
    figure.suptitle("\n".join(textwrap.wrap(f"step {incident.step}: {verdict.cause.value}: {verdict.summary}",
                                            140)), fontsize=10)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot write the picture ({str(exc).splitlines()[0]})") from None
    finally:
        plt.close(figure)
    return {"modules": modules, "ranks": ranks, "grid": grid, "bars": bars}
