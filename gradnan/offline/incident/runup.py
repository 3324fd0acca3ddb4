"""Did the culprit's gradients grow before the failing step, and on which rank first (pure: run-up
documents in, ``RunUp`` out).

Each rank's ``gradnan.runup`` file at the failing step holds, per gradient bucket, its largest magnitude
before the data-parallel collective over the last steps. The culprit's bucket is the one holding the
culprit parameter (the origin's first offending parameter in backward order, or its largest gradient where
the norm overflowed from finite ones). The rule, per rank holding that bucket, over the steps before the
failing one whose value was finite:

- at least ``MIN_BASELINE_STEPS`` + ``RECENT_STEPS`` steps, else that rank does not decide;
- the baseline is the median of all but the last ``RECENT_STEPS`` of them; the bucket GREW on that rank
  when the largest of the last ``RECENT_STEPS`` is at least ``GROWTH_FACTOR`` times the baseline;
- its onset is the first step at ``GROWTH_FACTOR`` times the baseline.

The finding: GREW where any rank's bucket grew (first: the ranks with the earliest onset; several on a
tie), SUDDEN where every rank that decides says it did not, UNDECIDED where none decides (or no culprit,
or the culprit is in no recorded bucket). Values are compared as recorded, in float; no timing, file order
or rank order enters the finding (ranks are sorted).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ...formats.incident import RunUpFinding
from ...formats.layout import rank_label

GROWTH_FACTOR = 10.0
RECENT_STEPS = 3
MIN_BASELINE_STEPS = 4
MAX_NAMED = 3  # first ranks named in the summary (the JSON lists them all)


@dataclass(frozen=True)
class RankRunUp:
    """One rank's culprit bucket over the kept steps (the failing step's value last where it was kept)."""

    global_rank: int
    label: str  # the rank as the report names it
    bucket_group: int
    bucket: int
    steps: Tuple[int, ...]
    values: Tuple[Any, ...]  # as recorded: numbers, "nan", "inf"
    baseline: Optional[float]
    ratio: Optional[float]  # the largest of the last steps over the baseline
    grew: Optional[bool]  # None: too few steps to decide
    onset: Optional[int]  # the first step at GROWTH_FACTOR x the baseline, where it grew

    def to_json(self) -> Dict[str, Any]:
        return {"global_rank": self.global_rank, "bucket_group": self.bucket_group, "bucket": self.bucket,
                "steps": list(self.steps), "values": list(self.values), "baseline": self.baseline,
                "ratio": _json_ratio(self.ratio), "grew": self.grew, "onset_step": self.onset}


@dataclass(frozen=True)
class RunUp:
    """The run-up's finding, decided once; the report, ``--json`` and the plot render it."""

    finding: RunUpFinding
    summary: str
    parameter: Optional[str]
    step: int  # the failing step
    first_ranks: Tuple[int, ...]  # where it grew first (GREW only)
    onset: Optional[int]  # the first ranks' onset step
    ranks: Tuple[RankRunUp, ...]

    def to_json(self) -> Dict[str, Any]:
        return {"finding": self.finding.value, "summary": self.summary, "parameter": self.parameter,
                "rule": {"growth_factor": GROWTH_FACTOR, "recent_steps": RECENT_STEPS,
                         "min_baseline_steps": MIN_BASELINE_STEPS},
                "first_ranks": list(self.first_ranks), "onset_step": self.onset,
                "steps_before": None if self.onset is None else self.step - self.onset,
                "ranks": [rank.to_json() for rank in self.ranks]}


def _json_ratio(ratio: Optional[float]) -> Any:
    return "inf" if ratio is not None and math.isinf(ratio) else ratio


def culprit_bucket(groups: Sequence[Dict[str, Any]], parameter: str) -> Optional[Tuple[Dict[str, Any], int]]:
    """The group and the column of the bucket holding ``parameter`` (the first, by bucket group)."""
    for group in sorted(groups, key=lambda g: g["bucket_group"]):
        for column, bucket in enumerate(group["buckets"]):
            if parameter in bucket["params"]:
                return group, column
    return None


def rank_runup(document: Dict[str, Any], groups: Sequence[Dict[str, Any]], parameter: str,
               step: int) -> Optional[RankRunUp]:
    """The rule on one rank's run-up (``step``: the failing step); None where no bucket holds the
    parameter."""
    found = culprit_bucket(groups, parameter)
    if found is None:
        return None
    group, column = found
    kept = [(s, row[column]) for s, row in zip(group["steps"], group["values"]) if s <= step]
    before = [(s, float(v)) for s, v in kept if s < step and math.isfinite(float(v))]
    baseline = ratio = onset = grew = None
    if len(before) >= MIN_BASELINE_STEPS + RECENT_STEPS:
        baseline = statistics.median(v for _, v in before[:-RECENT_STEPS])
        peak = max(v for _, v in before[-RECENT_STEPS:])
        ratio = peak / baseline if baseline > 0 else (math.inf if peak > 0 else 1.0)
        grew = ratio >= GROWTH_FACTOR
        if grew:
            onset = next(s for s, v in before if v >= GROWTH_FACTOR * baseline)
    rank = document["rank"]
    return RankRunUp(global_rank=rank["global_rank"], label=rank_label(rank),
                     bucket_group=group["bucket_group"], bucket=group["buckets"][column]["bucket"],
                     steps=tuple(s for s, _ in kept), values=tuple(v for _, v in kept), baseline=baseline,
                     ratio=ratio, grew=grew, onset=onset)


def _reason(ranks: Sequence[RankRunUp], documents: int, step: int) -> str:
    """Why the run-up does not decide (where no rank decides)."""
    if not documents:
        return "no rank wrote a run-up at this step"
    if not ranks:
        return "the culprit parameter is in no bucket the run-up recorded"
    kept = max(sum(1 for s, v in zip(rank.steps, rank.values) if s < step and math.isfinite(float(v)))
               for rank in ranks)
    return (f"at most {kept} finite step(s) before it were kept; the rule needs"
            f" {MIN_BASELINE_STEPS + RECENT_STEPS} (runup_steps, or a run that had only started)")


def decide(documents: Iterable[Tuple[Dict[str, Any], Sequence[Dict[str, Any]]]], parameter: Optional[str],
           step: int) -> RunUp:
    """The finding over every rank's run-up at the failing ``step``: ``documents`` as (document, its
    groups), streamed (one rank's groups at a time)."""
    ranks: List[Optional[RankRunUp]] = []
    for doc, groups in documents:
        ranks.append(None if parameter is None else rank_runup(doc, groups, parameter, step))
    return decide_ranks(ranks, parameter, step)


def decide_ranks(found: Sequence[Optional[RankRunUp]], parameter: Optional[str], step: int) -> RunUp:
    """``decide`` from the rule's result on each rank's run-up (``rank_runup``; None where no bucket holds
    the parameter, or none is named)."""
    ranks = sorted((rank for rank in found if rank), key=lambda rank: rank.global_rank)
    written = len(found)
    grown = [rank for rank in ranks if rank.grew]
    decided = [rank for rank in ranks if rank.grew is not None]
    first: List[RankRunUp] = []
    if grown:
        finding = RunUpFinding.GREW
        onset = min(rank.onset for rank in grown if rank.onset is not None)
        first = [rank for rank in grown if rank.onset == onset]
        ratio = max(rank.ratio for rank in first if rank.ratio is not None)
    elif decided:
        finding, onset, ratio = RunUpFinding.SUDDEN, None, max(rank.ratio for rank in decided
                                                               if rank.ratio is not None)
    else:
        finding, onset, ratio = RunUpFinding.UNDECIDED, None, None
    reason = "no culprit parameter is named" if parameter is None else _reason(ranks, written, step)
    where = " and ".join(rank.label for rank in first[:MAX_NAMED])
    if len(first) > MAX_NAMED:
        where += f" and {len(first) - MAX_NAMED} more rank(s) at the same step"
    summary = finding.summary(parameter, ratio, where, None if onset is None else step - onset, reason)
    return RunUp(finding, summary, parameter, step, tuple(rank.global_rank for rank in first), onset,
                 tuple(ranks))
