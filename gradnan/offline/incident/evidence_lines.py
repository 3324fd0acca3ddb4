"""The verdict's evidence as sentences (pure: the typed ``Evidence`` and the decision in, lines out): what
the decision rests on, fact by fact, what the run directory's self-tests say of the origin's devices, and
what NVML read on them at the incident. ``analysis`` puts them in the ``Verdict``; the renderers print
them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

from ...decision.causes import Decision
from ...decision.evidence import Evidence, HealthReading, View
from ...decision.facts import missing_text
from ...decision.loop_terms import rerun_mode
from ...formats.health import health_evidence
from ...formats.incident import OriginBasis
from ...formats.layout import host_device, rank_ranges
from ...formats.text import untrusted
from ...formats.wording import micro_batch_words

MAX_SELFTEST_RANKS = 4  # failing ranks named on the origin's devices; the rest counted
MAX_FAILING_LISTED = 1024  # a self-test's failing ranks in --json; failing_total counts them all


def selftest_summary(path: Path, document: Dict[str, Any]) -> Dict[str, Any]:
    """A self-test result for ``--json``: each failing rank once (its first entry), the first
    ``MAX_FAILING_LISTED``."""
    first: Dict[Any, Dict[str, Any]] = {}
    for entry in document["failing_ranks"]:
        first.setdefault(entry["rank"], {key: entry.get(key) for key in ("rank", "host", "device",
                                                                           "reasons")})
    failing = list(first.values())
    return {"file": str(path), "time": document.get("time"), "pass": document["pass"],
            "world_size": document.get("world_size"), "failing_ranks": failing[:MAX_FAILING_LISTED],
            "failing_total": len(failing)}


def selftest_evidence(origin: Sequence[View], selftests: Sequence[Dict[str, Any]]) -> List[str]:
    """What the self-test results in the run directory (whole, as read) say about the origin's devices."""
    devices = {(entry.get("host"), entry.get("device")) for entry in origin}
    evidence = []
    for result in selftests:
        failed_here = list(dict.fromkeys(f"rank {entry['rank']} ({host_device(entry)})"
                                         for entry in result["failing_ranks"]
                                         if (entry.get("host"), entry.get("device")) in devices))
        when = untrusted(result.get("time"))
        if failed_here:
            more = len(failed_here) - MAX_SELFTEST_RANKS
            named = ", ".join(failed_here[:MAX_SELFTEST_RANKS]) + (f" and {more} more" if more > 0 else "")
            evidence.append(f"self-test {when} FAILED on the origin's device: {named}")
        elif result["pass"]:
            evidence.append(f"self-test {when} passed on all {untrusted(result.get('world_size'))} ranks: no"
                            " persistent device fault seen (a transient one, or the data, remain)")
    return evidence


def health_lines(readings: Sequence[HealthReading]) -> List[str]:
    """What NVML said of the origin's devices at the incident."""
    return [health_evidence(f"{host_device(reading.rank)} (rank"
                            f" {reading.rank['global_rank']})", reading.signs, len(reading.unread))
            for reading in readings]


MAX_CONFLICT_LINES = 8


def evidence_lines(e: Evidence, decision: Decision) -> List[str]:
    """What the decision rests on, fact by fact (none of them a competing verdict); for an undetermined
    one, what was not observed and how to observe it."""
    lines = []
    if e.states_read:
        weights = (f"non-finite on rank(s) {rank_ranges(sorted({w.rank for w in e.bad_weights}))}"
                   if e.bad_weights else "every one finite")
        state = (f"bad on rank(s) {rank_ranges(sorted({f.rank for f in e.state_faults}))}" if e.state_faults
                 else "finite")
        differ = e.odd_replicas or e.split_replicas
        replicas = ("" if e.replicas_compared is None else
                    f"; weights unlike their peers' on rank(s) {rank_ranges(list(differ))}" if differ else
                    "; weights equal across data-parallel replicas" if e.replicas_compared else
                    "; weights not compared across data-parallel replicas (no peer of theirs read them"
                    + (": under expert parallelism, ranks holding the same experts" if e.expert_parallel
                       else "") + ")"
                    + ("; each non-finite weight set against its data-parallel peers' copies, read too"
                       if e.bad_weights and not e.weights_unpeered else ""))
        lines.append(f"weights when the step began (read on {len(e.states_read)} rank(s)): {weights};"
                     f" optimizer state {state}{replicas}")
    if e.divergence is not None:
        found = e.divergence
        agree = (f"{found.agreeing} of {found.replicas} agree on the other copy" if found.agreeing is not None
                 else f"no majority among {found.replicas}")
        lines.append(f"replica check of step {e.step} (read at step {found.read_at_step}): weights unlike"
                     f" their data-parallel peers' on rank(s) {rank_ranges(list(found.ranks))} ({agree});"
                     f" {found.params_total} parameter(s) differ: "
                     + "; ".join(weight.text() for weight in found.weights[:MAX_CONFLICT_LINES]))
    if e.conflicts:  # what the records say of the gradients' origin is in question
        lines += [f"records disagree: {conflict}" for conflict in e.conflicts[:MAX_CONFLICT_LINES]]
    elif e.gradient_basis is OriginBasis.BEFORE_COLLECTIVE:
        passed_on = sorted(set(e.gradient_origin) - set(e.rerun_origins)) if e.rerun_origins else []
        lines.append("own gradients non-finite before the data-parallel collective on rank(s)"
                     f" {rank_ranges(list(e.gradient_origin))}" + (
                         f" (rank(s) {rank_ranges(passed_on)} received the value from rank(s)"
                         f" {rank_ranges(list(e.rerun_origins))} within the step, before that collective,"
                         " so their own gradients hold it too)" if passed_on else ""))
    elif e.gradient_basis is OriginBasis.AFTER_COLLECTIVE:
        lines.append("every rank's own gradients were finite before the data-parallel collective")
        if e.silent_replicas:
            lines.append(f"rank(s) {rank_ranges(list(e.silent_replicas))} wrote no record at this step, nor"
                         " did any rank of their data-parallel replica: a finite norm there, as a corruption"
                         " after the collective on another replica leaves (had they died first, or were their"
                         " files missing, the value may have come from them)")
    elif e.gradient_basis is OriginBasis.UNCHECKED:
        lines.append("own gradients finite before the data-parallel collective on every rank checked; not"
                     f" checked on rank(s) {rank_ranges(list(e.unchecked))}")
    if e.forward_pattern and e.share_nonfinite is not None:
        lines.append(f"{e.share_nonfinite:.0%} of the origin's gradients are non-finite (what a non-finite"
                     " activation or loss does in backward)")
    elif e.first_in_backward:
        lines.append(f"first non-finite gradient in backward order: {untrusted(e.first_in_backward)} on rank"
                     f" {e.first_rank}")
    if e.near_limit:
        lines.append("the largest finite gradient values are near the dtype's limit (overflow)")
    if e.rejected:
        lines.append("Megatron's loss check rejected a non-finite loss"
                     f" ({untrusted(e.rejected['loss'])}) on rank {e.rejected['global_rank']},"
                     f" {micro_batch_words(e.rejected['micro_batch'])}, and raised"
                     f" ({rerun_mode(e.loop, 'disabled')})")
    if e.recurs:
        lines.append("the next step overflowed too, on other data, with no update applied in between: not"
                     " one batch")
    if decision.undecided and decision.not_observed:
        lines.append(f"not observed: {missing_text(decision.not_observed)}")
    return lines
