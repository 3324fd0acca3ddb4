"""The report's ranks by their role towards the origin (``rank_role``, ``focus_ranks``: which ranks get a
column) and its table of offending modules, one column per rank (``module_table``): rendering only, of the
``Incident`` that ``analysis`` decided."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from ...formats.incident import OriginBasis, RecordKind
from ...formats.schema import nonfinite_counts
from ...formats.text import untrusted, wrap
from .gradients import module_of
from .verdict import Incident

MAX_TABLE_RANKS = 16
_POSITION = ("tp", "pp", "cp", "ep")


def _same(view: Dict[str, Any], other: Dict[str, Any], axes: Sequence[str]) -> bool:
    for axis in axes:  # a loop, not all(...): called for each of 131,072 ranks
        if view.get(axis) != other.get(axis):
            return False
    return True


def rank_role(view: Dict[str, Any], origin: Sequence[Dict[str, Any]]) -> str:
    """How a rank stands to the origin: ``dp_peer`` (same model-parallel position, another data-parallel
    replica: where the collective carries the NaN), ``mp_peer`` (same replica, another position),
    ``other``."""
    if any(_same(view, entry, _POSITION) for entry in origin):
        return "dp_peer"
    if any(_same(view, entry, ("dp",)) for entry in origin):
        return "mp_peer"
    return "other"


def focus_ranks(incident: Incident, limit: int) -> List[int]:
    """The ranks worth a column, at most ``limit``, by number: the origin; then, nearest the origin first,
    the ranks holding the NaN and the origin's model-parallel peers, half the columns left each (one
    kind's unused share goes to the other); then the ranks nearest the origin."""
    origin = incident.origin
    anchor = min((entry["global_rank"] for entry in origin), default=0)
    chosen = list(dict.fromkeys(entry["global_rank"] for entry in origin))[:limit]
    views = [view for view in incident.receivers + incident.silent if view["global_rank"] not in chosen]

    def nearest(ranks):
        return sorted(ranks, key=lambda rank: (abs(rank - anchor), rank))

    holding = nearest(view["global_rank"] for view in views if view.get("holds_nonfinite"))
    peers = nearest(view["global_rank"] for view in views
                    if not view.get("holds_nonfinite") and rank_role(view, origin) == "mp_peer")
    left = limit - len(chosen)
    chosen += holding[:max(left // 2, left - len(peers))]
    chosen += peers[:limit - len(chosen)]
    taken = set(chosen)
    rest = [rank for rank in nearest(view["global_rank"] for view in views) if rank not in taken]
    chosen += rest[:limit - len(chosen)]
    return sorted(chosen)


ROLE_TEXT = {"dp_peer": "data-parallel peer(s) of the origin (same tp/pp)",
              "mp_peer": "model-parallel peer(s) of the origin (same dp replica)",
              "other": "other rank(s)"}


def _origin_modules(incident: Incident) -> Dict[int, List[str]]:
    """The modules the verdict names as the origin, per rank: the rerun's forward origin (parameterless or
    not), else the modules of the weights a state record names; none where the origin is a rank's
    gradients."""
    rerun = incident.rerun
    if incident.origin_basis is OriginBasis.RERUN and rerun is not None:
        named: Dict[int, List[str]] = {}
        for view in rerun.origins:
            if view.get("module"):
                named.setdefault(view["global_rank"], []).append(view["module"])
        return named
    return {entry["global_rank"]: list(dict.fromkeys(
        module_of(weight["name"]) for weight in entry["params"] + entry.get("outlying_rows", [])))
            for entry in incident.origin if entry.get("kind") == RecordKind.STATE}


TABLE_MARKS = {"O": "the origin module", "o": "non-finite gradients on an origin rank",
               "r": "non-finite gradients received", ".": "finite gradients"}


def _module_rows(incident: Incident, named: Dict[int, List[str]], max_modules: int) -> List[Dict[str, Any]]:
    """The table's rows: the first ``max_modules`` offending modules in backward order, then each origin
    module no row shows: one with offending parameters after them, in backward order; one without (an
    attention core: no gradient of its own to list) beside the first row of its parent, at the top where
    none."""
    origins = set(name for names in named.values() for name in names)
    rows = [dict(module) for index, module in enumerate(incident.parameters)
            if index < max_modules or module["module"] in origins]
    shown = {row["module"] for row in rows}
    for module in sorted(origins - shown):
        parent = module.rsplit(".", 1)[0] + "."
        at = next((index for index, row in enumerate(rows) if row["module"].startswith(parent)), 0)
        rows.insert(at, {"module": module, "params": []})
    return rows


def module_table(incident: Incident, max_modules: int, line_width: int) -> List[str]:
    """One line per offending module, in backward order, with a column per rank (``focus_ranks``): the
    origin module itself, the origin ranks' other non-finite gradients, those received, the finite ones
    (``TABLE_MARKS``); and the counts per parameter on the first rank holding them."""
    named = _origin_modules(incident)
    origin_ranks = {entry["global_rank"] for entry in incident.origin}
    holding = {module["module"]: {rank for p in module["params"] for rank in p["ranks"]}
               for module in incident.parameters}
    for view in incident.receivers:
        for module in view["modules"]:
            holding.setdefault(module, set()).add(view["global_rank"])

    def mark(rank: int, row: Dict[str, Any]) -> str:
        if row["module"] in named.get(rank, ()):
            return "O"
        if not row["params"]:
            return ""
        if rank in holding.get(row["module"], ()):
            return "o" if rank in origin_ranks else "r"
        return "."

    ranks = focus_ranks(incident, MAX_TABLE_RANKS)
    rows = _module_rows(incident, named, max_modules)
    names = {row["module"]: untrusted(row["module"]) for row in rows}
    width = max((len(name) for name in names.values()), default=6)
    cell = max([3] + [len(str(rank)) + 1 for rank in ranks])
    first = {p["ranks"][0] for row in rows for p in row["params"]}
    counted = f"on rank {first.pop()}" if len(first) == 1 else "on the first rank holding it"
    cells = {row["module"]: [mark(rank, row) for rank in ranks] for row in rows}
    used = {value for marks in cells.values() for value in marks}
    legend = ", ".join(f"{value} {text}" for value, text in TABLE_MARKS.items() if value in used)
    lines = wrap(f"Offending modules in backward order ({legend}):", line_width, subsequent_indent="    ")
    lines.append(f"  {'module':<{width}}  " + " ".join(f"{'r' + str(rank):<{cell}}" for rank in ranks)
                 + f"  {counted}")
    for row in rows:
        marks = " ".join(f"{value:<{cell}}" for value in cells[row["module"]])
        counts = ", ".join(f"{untrusted(p['name'].rsplit('.', 1)[-1])} {nonfinite_counts(p)}"
                           + (" [near dtype limit]" if p["near_limit"] else "") for p in row["params"])
        lines.append(f"  {names[row['module']]:<{width}}  {marks}  {counts or '(no parameters)'}")
    hidden = len({m["module"] for m in incident.parameters} - set(names))
    if hidden:
        lines.append(f"  ... and {hidden} more module(s) (see --json)")
    total = len(incident.origin) + len(incident.receivers) + len(incident.silent)
    if total > len(ranks):
        lines.append(f"  ({total - len(ranks)} more rank(s) not shown: the columns are the origin, the ranks"
                     " holding the NaN and the origin's peers; see --json)")
    return lines
