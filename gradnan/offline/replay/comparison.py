"""Which change broke numerics: one bundle replayed under other stacks (``gradnan replay --against``),
compared op by op with what the capture recorded and with each other.

Each environment's replay returns, for every op of the trace, the digests of its outputs in the captured
dtype (``gradnan.formats.trace.digest``); the capture's own are in the bundle (``gradnan.trace`` v3). Two
environments' outputs of an op are the same when their bytes hash the same (bitwise, the default), or,
with a tolerance of N ulps, when their non-finite counts are equal and their finite abs-max and abs-sum
each differ by at most N ulps of the dtype relative to the larger of the two: what digests can show (an
element-wise error of at most N ulps never counts as a difference; a larger one shows where it moves
the abs-max or the abs-sum). The comparison names, for every pair, the first op that differs, and, over
all pairs, the earliest: nothing before it differs in any pair.

Fused kernels (a ``fused`` entry: work outside the dispatcher) are compared at their boundary: in the
captured dtype every replay keeps the kernel's saved output, so they never differ there; and against
their reference math (``gradnan.offline.replay.references``), which each environment computes in the captured
dtype with its own stack: ``fused`` says, per environment, whether the kernel's output and that reference
are the same (bitwise, or within the tolerance).

Ops that cannot be compared: those returning uninitialized memory (``empty``: garbage at capture, NaN at
replay), and, against the capture, collectives (identity at replay: a tensor-parallel shard's partial
result), after which the capture and a replay legitimately differ (two replays still compare).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ...errors import InputError
from ...formats import bundle
from ...formats.layout import MANIFEST
from ...formats.magnitude import magnitude_text
from ...formats.replay import COMPARISON
from ...formats.text import listing, printable_lines, shell_word, untrusted
from .text import module_line, operator_text

CAPTURE = "capture"
_AROUND = 2  # ops shown before and after each op of interest in the table
_STDERR_WIDTH = 200  # characters of one line of it (a longer one loses its middle)
_STDERR_LINES = 5  # the first lines of an environment's stderr shown (a warning or an error says what first)


def environment_names(count: int) -> List[str]:
    """``A``, ``B``, ... for the ``--against`` environments, in the order given."""
    return [chr(ord("A") + i) for i in range(count)]


def capture_versions(path: Path) -> Dict[str, Optional[str]]:
    """The stack the bundle was captured with, as its manifest says (``versions``: text values only)."""
    versions = bundle.load_manifest(Path(path) / MANIFEST).get("versions")
    if not isinstance(versions, dict):
        return {}
    return {str(name)[:40]: value[:80] for name, value in versions.items() if isinstance(value, str)}


def _beyond(left: Optional[float], right: Optional[float], ulps: int, eps: float) -> bool:
    if left is None or right is None:
        return left is not right
    return abs(left - right) > ulps * eps * max(abs(left), abs(right))


def output_difference(left: Sequence[Dict[str, Any]], right: Sequence[Dict[str, Any]],
                      ulps: Optional[int], nan_patterns: bool = False) -> Optional[str]:
    """Why one op's outputs differ between two digests lists, or None where they do not (bitwise where
    ``ulps`` is None). Outputs whose NaNs alone differ in sign or payload (``nan_patterns_differ``) are the
    same unless ``nan_patterns``."""
    if len(left) != len(right):
        return f"{len(left)} outputs against {len(right)}"
    for position, (one, other) in enumerate(zip(left, right)):
        if (one["shape"], one["dtype"]) != (other["shape"], other["dtype"]):
            return (f"output {position} is {one['dtype']} {one['shape']} against {other['dtype']}"
                    f" {other['shape']}")
        if one["hash"] == other["hash"]:
            continue
        if _nan_patterns_alone(one, other):
            if nan_patterns:
                return f"output {position}: the bit patterns of its NaNs differ, and nothing else"
            continue
        if ulps is None:
            return f"output {position}: its bytes differ"
        if one["nonfinite"] != other["nonfinite"]:
            return f"output {position}: {one['nonfinite']} non-finite against {other['nonfinite']}"
        dtype = getattr(torch, one["dtype"])
        if not dtype.is_floating_point:
            return f"output {position}: its values differ ({one['dtype']})"
        eps = torch.finfo(dtype).eps
        for key in ("abs_max", "abs_sum"):
            if _beyond(one[key], other[key], ulps, eps):
                return (f"output {position}: {key} {magnitude_text(one[key])} against"
                        f" {magnitude_text(other[key])}, more than {ulps} ulps of {one['dtype']} apart")
    return None


def _nan_patterns_alone(one: Dict[str, Any], other: Dict[str, Any]) -> bool:
    """Two digests of different bytes whose NaNs, all written alike, make them the same (``canonical_hash``,
    where both have it: a digest read from a version 3 trace has not)."""
    return (one["hash"] != other["hash"] and one["nonfinite"] > 0 and other["nonfinite"] > 0
            and "canonical_hash" in one and "canonical_hash" in other
            and one["canonical_hash"] == other["canonical_hash"])


def nan_patterns_differ(left: Sequence[Dict[str, Any]], right: Sequence[Dict[str, Any]]) -> bool:
    """Some output of one op differs from the other's in the bit patterns of its NaNs alone."""
    return len(left) == len(right) and any(_nan_patterns_alone(one, other) for one, other in zip(left, right))


def _compare_pair(operators: List[Dict[str, Any]], left: str, right: str,
                  ulps: Optional[int], nan_patterns: bool) -> Dict[str, Any]:
    """The first op whose outputs differ between two columns, how many ops were compared, and the first
    op before it whose NaNs alone differ in their bit patterns (where those do not count)."""
    with_capture = CAPTURE in (left, right)
    compared, after_collective, patterns = 0, None, None
    for index, operator in enumerate(operators):
        digests = operator["digests"]
        if operator["uninitialized"] or digests[left] is None or digests[right] is None:
            continue
        if with_capture and operator["collective"]:
            after_collective = index if after_collective is None else after_collective
            continue
        compared += 1
        why = output_difference(digests[left], digests[right], ulps, nan_patterns)
        if why is not None:
            return {"left": left, "right": right, "compared": compared, "after_collective": after_collective,
                    "nan_patterns": patterns,
                    "first_difference": {"index": index, "op": operator["op"], "why": why}}
        if patterns is None and nan_patterns_differ(digests[left], digests[right]):
            patterns = {"index": index, "op": operator["op"]}
    return {"left": left, "right": right, "compared": compared, "after_collective": after_collective,
            "nan_patterns": patterns, "first_difference": None}


def compare(replays: List[Dict[str, Any]], captured_with: Dict[str, Optional[str]], device: Optional[str],
            ulps: Optional[int], nan_patterns: bool = False) -> Dict[str, Any]:
    """The ``gradnan.comparison`` document of one bundle's replays (``replay_bundle(..., digests=True)``
    plus its ``environment``), in ``--against`` order. ``nan_patterns``: a difference in NaN bit patterns
    alone counts as a difference."""
    names = environment_names(len(replays))
    first = replays[0]
    if any(len(replay["digests"]["ops"]) != len(first["digests"]["ops"]) for replay in replays):
        raise InputError(f"{first['bundle']}: its trace changed between the replays: compare again")
    has_capture = all(entry["captured"] is not None for entry in first["digests"]["ops"])
    columns = ([CAPTURE] if has_capture else []) + names
    operators = [{"index": index, "op": entry["op"], "collective": entry["collective"],
                  "uninitialized": any(replay["digests"]["ops"][index]["uninitialized"]
                                       for replay in replays),
                  "digests": {CAPTURE: entry["captured"],
                              **{name: replay["digests"]["ops"][index]["replayed"]
                                 for name, replay in zip(names, replays)}}}
                 for index, entry in enumerate(first["digests"]["ops"])]
    fused = [{"index": index, "op": entry["op"], "class": entry["fused"],
              "against_reference": {name: _against_reference(replay["digests"]["ops"][index], ulps)
                                    for name, replay in zip(names, replays)}}
             for index, entry in enumerate(first["digests"]["ops"]) if entry["fused"] is not None]
    pairs = [(CAPTURE, name) for name in names] if has_capture else []
    pairs += list(zip(names, names[1:]))
    compared = [_compare_pair(operators, left, right, ulps, nan_patterns) for left, right in pairs]
    found = [pair["first_difference"] for pair in compared if pair["first_difference"] is not None]
    earliest = min((difference["index"] for difference in found), default=None)
    environments = [{"name": CAPTURE, "versions": captured_with,
                     "first_nonfinite": first["digests"]["first_nonfinite"]}]
    environments += [{"name": name, **replay["environment"], "verdict": replay["verdict"],
                      "summary": replay["summary"],
                      "first_nonfinite": replay["runs"]["captured"]["first_nonfinite"]}
                     for name, replay in zip(names, replays)]
    return {
        **COMPARISON.header(),
        "bundle": first["bundle"], "module": first["module"], "step": first["step"], "rank": first["rank"],
        "device": device, "tolerance": {"ulps": ulps}, "nan_patterns_counted": nan_patterns,
        "capture_has_digests": has_capture,
        "environments": environments,
        "pairs": compared,
        "first_difference": None if earliest is None else {
            "index": earliest, "op": operators[earliest]["op"],
            "pairs": [f"{pair['left']} vs {pair['right']}" for pair in compared
                      if (pair["first_difference"] or {}).get("index") == earliest]},
        "fused": fused,
        "columns": columns,
        "operators": operators,
    }


def _against_reference(entry: Dict[str, Any], ulps: Optional[int]) -> Dict[str, Any]:
    """A fused kernel's output (saved in training, kept by the replay) against the reference math this
    environment computed for it: ``{"reference": bool, "difference": why or null}``."""
    if entry["reference"] is None:
        return {"reference": False, "difference": None}
    return {"reference": True, "difference": output_difference(entry["replayed"], entry["reference"], ulps)}


def _first_text(operator: Optional[Dict[str, Any]]) -> str:
    if operator is None:
        return "none"
    return f"op #{operator['index']} {operator_text(operator)} ({operator.get('phase', 'forward')})"


def _rows(document: Dict[str, Any]) -> List[int]:
    """The ops around the first differences and the first non-finite forward ops, in order."""
    count = len(document["operators"])
    wanted: Set[int] = {pair[key]["index"] for pair in document["pairs"]
                        for key in ("first_difference", "nan_patterns") if pair[key] is not None}
    wanted |= {environment["first_nonfinite"]["index"] for environment in document["environments"]
               if environment["first_nonfinite"] is not None
               and environment["first_nonfinite"].get("phase", "forward") == "forward"}
    return sorted({index for centre in wanted for index in range(max(0, centre - _AROUND),
                                                                 min(count, centre + _AROUND + 1))})


def _cell(digests: Optional[List[Dict[str, Any]]], reference: Optional[List[Dict[str, Any]]],
          ulps: Optional[int], nan_patterns: bool) -> str:
    """``* 1a2b3c4d max 0.279 nf 3``: the first output's hash prefix and abs-max, the outputs' non-finite
    count, ``*`` where the op differs from the reference column (``~`` where only the bit patterns of its
    NaNs do, and those do not count)."""
    if digests is None:
        return "-"
    if not digests:
        return "(no tensor)"
    mark = " "
    if reference is not None and output_difference(reference, digests, ulps, nan_patterns):
        mark = "*"
    elif reference is not None and nan_patterns_differ(reference, digests):
        mark = "~"
    nonfinite = sum(item["nonfinite"] for item in digests)
    return (f"{mark} {digests[0]['hash'][:8]} max {magnitude_text(digests[0]['abs_max'])}"
            + (f" nf {nonfinite}" if nonfinite else ""))


def _table(document: Dict[str, Any]) -> List[str]:
    columns, ulps = document["columns"], document["tolerance"]["ulps"]
    counted = document["nan_patterns_counted"]
    reference = columns[0]
    header = ["#", "op", *columns]
    rows: List[Tuple[str, ...]] = []
    previous = None
    for index in _rows(document):
        if previous is not None and index != previous + 1:
            rows.append(("...",) + ("",) * (len(header) - 1))
        operator = document["operators"][index]
        digests = operator["digests"]
        note = (" (collective)" if operator["collective"]
                else " (uninitialized)" if operator["uninitialized"] else "")
        compared_with = None if operator["uninitialized"] else digests[reference]
        rows.append((str(index), operator["op"] + note,
                     *(_cell(digests[column], None if column == reference else compared_with, ulps, counted)
                       for column in columns)))
        previous = index
    if not rows:
        return []
    widths = [max(len(row[i]) for row in [tuple(header), *rows]) for i in range(len(header))]
    return [f"Operators around them (* differs from {reference}, ~ in NaN bit patterns alone; uninitialized:"
            " not compared; hash, abs-max of output 0, non-finite count):"] + [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in [tuple(header), *rows]]


def _fused_lines(document: Dict[str, Any], how: str) -> List[str]:
    """One line per fused kernel: its output against each environment's reference math for it."""
    lines = []
    for kernel in document["fused"]:
        said = [f"{name} " + ("no reference math" if not found["reference"]
                              else found["difference"] or "the same")
                for name, found in kernel["against_reference"].items()]
        lines.append(f"  op #{kernel['index']} {untrusted(kernel['class'])}: {'; '.join(said)}")
    if not lines:
        return []
    return [f"Fused kernels against their reference math ({how}), in each environment:", *lines]


def _versions_text(versions: Any) -> str:
    if not isinstance(versions, dict):
        return "versions not recorded"
    return listing(f"{name} {value}" for name, value in versions.items() if isinstance(value, str)
                   and name != "python") or "versions not recorded"


def _environment_lines(environment: Dict[str, Any]) -> List[str]:
    """``A: ./new-stack.sh, ran /venv/bin/python (torch 2.13.0, ...; CPU AVX2); verdict healthy``, and what
    that interpreter wrote on stderr, where it wrote anything (a broken ``sitecustomize``, a kernel
    override's warning)."""
    given, ran = environment.get("given", environment["python"]), environment["python"]
    interpreter = shell_word(given) if given == ran else f"{shell_word(given)}, ran {shell_word(ran)}"
    machine = environment.get("machine") or {}
    where = listing(f"{label} {machine[key]}" for key, label in (("cpu", "CPU"), ("gpu", "GPU"))
                    if machine.get(key))
    lines = [f"  {environment['name']}: {interpreter} ({_versions_text(environment['versions'])}"
             f"{'; ' + where if where else ''}); verdict {environment['verdict']}"]
    said = [line for line in str(environment.get("stderr") or "").splitlines() if line.strip()]
    if said:
        first = f", the first {_STDERR_LINES}" if len(said) > _STDERR_LINES else ""
        lines.append(f"    its stderr said ({len(said)} lines{first}):")
        lines += [f"      {untrusted(line.strip(), _STDERR_WIDTH)}" for line in said[:_STDERR_LINES]]
    return lines


def _uninitialized_lines(document: Dict[str, Any]) -> List[str]:
    """Which ops were not compared because their outputs hold uninitialized memory."""
    skipped = [f"#{operator['index']} {operator['op']}" for operator in document["operators"]
               if operator["uninitialized"]]
    if not skipped:
        return []
    return [f"Not compared: {listing(skipped)}: uninitialized memory (an empty buffer, views of it and values"
            " computed from it, before an operator wrote it): whatever the allocator held at capture"]


def format_comparison(document: Dict[str, Any]) -> str:
    ulps = document["tolerance"]["ulps"]
    how = "bitwise" if ulps is None else f"within {ulps} ulps of each dtype"
    lines = [f"gradnan replay of {shell_word(document['bundle'])}, compared across environments",
             f"{module_line(document)}; replayed on {document['device'] or 'the default device'}, outputs"
             f" compared {how}"]
    for environment in document["environments"]:
        if environment["name"] == CAPTURE:
            lines.append(f"  {CAPTURE}: training's own run ({_versions_text(environment['versions'])})"
                         + ("" if document["capture_has_digests"] else
                            "; no digests in this bundle (captured before gradnan.trace v3): not compared"))
        else:
            lines += _environment_lines(environment)
    first = document["first_difference"]
    if first is None:
        lines.append(f"No operator differs ({how}) between {', '.join(document['columns'])}.")
    else:
        lines.append(f"First operator that differs: op #{first['index']} {first['op']}"
                     f" ({', '.join(first['pairs'])}); nothing before it differs")
    for pair in document["pairs"]:
        difference = pair["first_difference"]
        said = ("no operator differs" if difference is None else
                f"op #{difference['index']} {difference['op']}: {difference['why']}")
        if pair["after_collective"] is not None and (difference is None
                                                     or difference["index"] > pair["after_collective"]):
            said += (f" (after the collective at op #{pair['after_collective']}, which replays as identity:"
                     " compare two environments there)")
        patterns = pair["nan_patterns"]
        if patterns is not None:
            said += (f"; before it, the NaNs of op #{patterns['index']} {patterns['op']} differ in their bit"
                     " patterns alone (the same values: not counted unless --nan-patterns)")
        lines.append(f"  {pair['left']} vs {pair['right']}: {said} ({pair['compared']} compared)")
    lines += _uninitialized_lines(document)
    lines += _fused_lines(document, how)
    lines.append("First non-finite: " + "; ".join(
        f"{environment['name']} {_first_text(environment['first_nonfinite'])}"
        for environment in document["environments"]))
    lines += _table(document)
    return printable_lines(lines)
