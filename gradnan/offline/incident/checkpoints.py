"""Checkpoint marks read back (``checkpoint`` records): one ``Save`` per checkpoint save of a launch, from
its ranks' marks; which one is the newest known clean before a failure (the restart advice), and the
``gradnan checkpoints`` listing.

A save is clean when every rank of the job marked it and every mark found its weights, the optimizer's
main copies and moments finite. Before a failure, only a save made before it counts: none made after the
launch's first incident (Megatron's exit save under ``validate_results`` among them, labelled with the
iteration before the failing one), and none that a later save of the same iteration to the same place
wrote over (that exit save writes over the regular save of that iteration). Where a periodic replica check
of a launch saw its data-parallel replicas differ, no save of that launch written since the last check that
saw them equal is known clean: which replica's copy it holds is not known (with two replicas, no majority
tells the good one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...decision.evidence import KnownCheckpoint
from ...formats.incident import RecordKind
from ...formats.layout import peers_key, rank_ranges, vocabulary_token
from ...formats.schema import NONFINITE_WORDS, is_int
from ...formats.text import magnitude, untrusted
from .runs import split_runs
from .world import inside_job, job_world_size

MAX_NAMED = 4  # non-finite tensors (and ranks) a save's description names


@dataclass(frozen=True)
class Save:
    """One save of a launch (``number``: its n-th), as its ranks' marks say: the iteration it is labelled
    with and where it went (where the saver named them), when (its first mark), the step of the launch's
    first incident before it, the ranks that marked it out of ``world_size``, and each non-finite tensor
    as (rank, parameter, tensor)."""

    launch: str
    number: int
    iteration: Optional[int]
    path: Optional[str]
    time: float
    after_incident: Optional[int]
    ranks: Tuple[int, ...]
    world_size: Optional[int]
    nonfinite: Tuple[Tuple[int, str, str], ...]
    unclean_ranks: Tuple[int, ...]
    step: Optional[int] = None  # the launch's step when it was saved (its marks' ``step``)
    # the vocabulary's rows far out of range, finite (``outlying_rows``): each described with its rank
    outlying: Tuple[str, ...] = ()
    negative: Tuple[Tuple[int, str], ...] = ()  # (rank, parameter) of second moments below zero
    foreign: int = 0  # marks from outside the job: another world size, or a rank outside it
    replicas_unequal: str = ""  # why the replicas' copies it holds are not known equal, where they are not

    @property
    def all_marked(self) -> bool:
        """Every rank of the job marked it: its ranks are exactly 0 .. world_size - 1 (a mark from a rank
        outside the job, or claiming another world size, counts for nothing)."""
        return (self.world_size is not None and not self.foreign
                and set(self.ranks) == set(range(self.world_size)))

    @property
    def clean(self) -> bool:
        return (self.all_marked and not self.unclean_ranks and not self.outlying and not self.negative
                and not self.replicas_unequal)

    def place(self) -> Tuple[Optional[str], Optional[int]]:
        """What a later save of the same place writes over (None: a save that names neither)."""
        return self.path, self.iteration

    def name(self) -> str:
        label = f"iteration {self.iteration}" if self.iteration is not None else f"save {self.number}"
        return f"the checkpoint of {label}" + (f" ({untrusted(self.path)})" if self.path else "")

    def condition(self) -> str:
        """"clean", or what is wrong with its contents or its marks."""
        if self.unclean_ranks:
            shown = ", ".join(f"{untrusted(name)} ({untrusted(tensor)}) on rank {rank}"
                              for rank, name, tensor in self.nonfinite[:MAX_NAMED])
            more = len(self.nonfinite) - MAX_NAMED
            return (f"not clean: non-finite on rank(s) {', '.join(map(str, self.unclean_ranks))}: {shown}"
                    + (f" and {more} more listed" if more > 0 else ""))
        if self.outlying:
            more = len(self.outlying) - MAX_NAMED
            return ("not clean: a vocabulary row far out of range (finite): "
                    + "; ".join(self.outlying[:MAX_NAMED]) + (f" and {more} more" if more > 0 else ""))
        if self.negative:
            shown = ", ".join(f"{untrusted(name)} on rank {rank}" for rank, name in self.negative[:MAX_NAMED])
            more = len(self.negative) - MAX_NAMED
            return (f"not clean: a second moment (exp_avg_sq) below zero: {shown}"
                    + (f" and {more} more" if more > 0 else ""))
        if self.replicas_unequal:
            return f"not known clean: {self.replicas_unequal}"
        if not self.all_marked:
            return (f"not known clean: marked by {len(self.ranks)} of"
                    f" {self.world_size if self.world_size is not None else 'an unknown number of'} ranks"
                    + (f", and {self.foreign} mark(s) from outside the job" if self.foreign else ""))
        return "clean"

    def to_json(self) -> Dict[str, Any]:
        return {"launch": self.launch, "save": self.number, "iteration": self.iteration, "path": self.path,
                "time": self.time, "after_incident": self.after_incident, "clean": self.clean,
                "condition": self.condition(), "ranks": list(self.ranks), "world_size": self.world_size,
                "nonfinite": [{"global_rank": rank, "name": name, "tensor": tensor}
                              for rank, name, tensor in self.nonfinite]}


def _row_text(mark: Dict[str, Any], row: Dict[str, Any]) -> str:
    token = vocabulary_token(mark["rank"].get("tp"), row["rows"], row["row"])
    return (f"row {row['row']} of {untrusted(row['name'])} (token {token}) on rank"
            f" {mark['rank'].get('global_rank')}: largest magnitude {magnitude(row['largest'])},"
            f" the rows' median {magnitude(row['median'])}")


def _replicas_unequal(divergences: Sequence[Dict[str, Any]]) -> Tuple[Optional[int], str]:
    """From a launch's ``replica_divergence`` records, the step of the last check that saw its replicas
    equal (a save marked at a later step is not known to hold equal copies; None: no save of the launch
    is), and why; ("", no divergence) where none was seen."""
    steps = [record for record in divergences if is_int(record.get("step"))]
    if not steps:
        return None, ""
    first = min(steps, key=lambda record: record["step"])
    equal = first.get("last_equal_step")
    equal = equal if is_int(equal) and equal < first["step"] else None
    since = (f"written since the last replica check that saw the data-parallel replicas equal (step {equal})"
             if equal is not None else "written before any replica check of its launch saw the data-parallel"
             " replicas equal")
    return equal, (f"{since}; the check of step {first['step']} saw them differ, and which replica's copy it"
                   " holds is not known")


def saves_of(records: Sequence[Dict[str, Any]]) -> List[Save]:
    """Every save the run directory's checkpoint marks name, oldest first; a save counts the marks of the
    job's ranks (``job_world_size``), each once."""
    saves = []
    for launch, in_launch in split_runs([record for record in records if record.get("kind")]).items():
        if not any(record["kind"] == RecordKind.CHECKPOINT for record in in_launch):
            continue
        equal_until, unequal = _replicas_unequal([record for record in in_launch
                                                  if record["kind"] == RecordKind.REPLICA_DIVERGENCE])
        marks = [record for record in in_launch if record["kind"] == RecordKind.CHECKPOINT]
        world = job_world_size(in_launch)
        for (number, *_), group in sorted(_by_save(marks).items(), key=lambda item: item[0][0]):
            group.sort(key=lambda record: record["rank"].get("global_rank", -1))
            first = group[0]
            inside = [record["rank"].get("global_rank") for record in group
                      if world is not None and inside_job(record["rank"], world)]
            step = min((record["step"] for record in group if is_int(record.get("step"))), default=None)
            # a mark's step is the step about to run: that save holds the weights a check of its step reads
            suspect = bool(unequal) and (equal_until is None or step is None or step > equal_until)
            differ = _copies_differ([record for record in group if inside_job(record["rank"], world)])
            saves.append(Save(
                launch=launch, number=number, iteration=first.get("saved_iteration"),
                path=first.get("checkpoint"),
                time=min(record.get("time") or 0.0 for record in group),
                after_incident=min((record["after_incident"] for record in group
                                    if record.get("after_incident") is not None), default=None),
                ranks=tuple(dict.fromkeys(inside)), world_size=world, foreign=len(group) - len(inside),
                nonfinite=tuple((record["rank"].get("global_rank"), entry["name"], entry["tensor"])
                                for record in group for entry in record["nonfinite"]),
                unclean_ranks=tuple(record["rank"].get("global_rank") for record in group
                                    if not record["clean"]),
                step=step, replicas_unequal=differ or (unequal if suspect else ""),
                outlying=tuple(_row_text(record, row) for record in group
                               for row in record.get("outlying_rows") or ()
                               if row["largest"] not in NONFINITE_WORDS),
                negative=tuple((record["rank"].get("global_rank"), entry["name"]) for record in group
                               for entry in record.get("negative_moments") or ())))
    return sorted(saves, key=lambda save: save.time)


def after_failure(saves: Sequence[Save], launch: str, step: int) -> List[Save]:
    """``saves``, those of the failing ``launch`` marked after its failing ``step`` (a mark's step is the step
    about to run) taken as written after that incident, whatever their time says: a step of one launch
    is a fact its records agree on, a time stamp is not."""
    return [replace(save, after_incident=step) if save.launch == launch and save.after_incident is None
            and save.step is not None and save.step > step else save for save in saves]


def _copies_differ(marks: Sequence[Dict[str, Any]]) -> str:
    """Where data-parallel peers' marks of one save give different digests of their weights (replicas hold
    bitwise equal weights when a save returns: Megatron-LM syncs a distributed optimizer's overlapped
    gather first), which ranks' copies differ; "" where every group agrees."""
    groups: Dict[Tuple[Any, ...], Dict[str, List[int]]] = {}
    for mark in marks:
        groups.setdefault(peers_key(mark["rank"], "dp"), {}).setdefault(mark["weights_digest"], []).append(
            mark["rank"].get("global_rank"))
    ranks = sorted(rank for digests in groups.values() if len(digests) > 1
                   for holders in digests.values() for rank in holders)
    return (f"its data-parallel copies differ (the weight digests of ranks {rank_ranges(ranks)}), and which"
            " copy is right is not known") if ranks else ""


def _by_save(marks: Sequence[Dict[str, Any]]) -> Dict[Tuple[Any, ...], List[Dict[str, Any]]]:
    """A launch's marks by save: its number, iteration and place, and where one rank marked that more than
    once (two launches that ``split_runs`` could not tell apart, restarted within minutes without a run
    id), the n-th of each rank's marks in time order as the n-th save."""
    groups: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = {}
    marked: Dict[Tuple[Any, ...], int] = {}  # (save key, rank): how many of its marks came before
    for record in sorted(marks, key=lambda record: record.get("time") or 0.0):
        key = (record["save"], record.get("saved_iteration"), record.get("checkpoint"))
        repeat = marked.get((*key, record["rank"].get("global_rank")), 0)
        marked[(*key, record["rank"].get("global_rank"))] = repeat + 1
        groups.setdefault((*key, repeat), []).append(record)
    return groups


def _overwritten(save: Save, saves: Sequence[Save]) -> Optional[Save]:
    """The last later save to the same place, which wrote over it."""
    if save.place() == (None, None) or save.iteration is None:
        return None
    return next((later for later in reversed(saves)
                 if later.time > save.time and later.place() == save.place()), None)


def why_not(save: Save, saves: Sequence[Save], failure_time: float,
            iteration: Optional[int], limit: str = "the failing iteration") -> Optional[str]:
    """Why ``save`` is not a checkpoint to restart from after a failure at ``failure_time`` (of Megatron-LM's
    ``iteration``, where known: ``limit`` says what it is); None: it is one."""
    if save.after_incident is not None or save.time >= failure_time:
        incident = "" if save.after_incident is None else f" (the incident of step {save.after_incident})"
        return f"{save.name()} was written after the failure{incident}"
    if iteration is not None and save.iteration is not None and save.iteration >= iteration:
        return f"{save.name()} is not older than {limit} {iteration}"
    over = _overwritten(save, saves)
    if over is not None:
        after = " after the failure" if over.after_incident is not None or over.time >= failure_time else ""
        return f"{save.name()} was written over by a later save{after} ({over.condition()})"
    if not save.clean:
        return f"{save.name()} is {save.condition()}"
    return None


def newest_clean(saves: Sequence[Save], failure_time: float, iteration: Optional[int],
                 limit: str = "the failing iteration") -> Tuple[Optional[KnownCheckpoint], str]:
    """The newest checkpoint saved before the failure, older than ``iteration`` (``limit`` says what it
    is) and known clean, else None and why none is (the newest saves' reasons)."""
    reasons = []
    for save in reversed(saves):
        reason = why_not(save, saves, failure_time, iteration, limit)
        if reason is None:
            return KnownCheckpoint(save.iteration, save.path), ""
        reasons.append(reason)
    return None, "; ".join(reasons[:MAX_NAMED]) + (f" (and {len(reasons) - MAX_NAMED} older)"
                                                   if len(reasons) > MAX_NAMED else "")


def format_saves(saves: Sequence[Save]) -> str:
    """``gradnan checkpoints``: one line per save, oldest first."""
    lines = []
    for save in saves:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(save.time))
        after = ("" if save.after_incident is None
                 else f"; written after the incident of step {save.after_incident} (do not restart from it)")
        lines.append(f"{when} UTC  {save.name()}  launch {untrusted(save.launch)} save {save.number}:"
                     f" {save.condition()}{after}")
    return "\n".join(lines)
