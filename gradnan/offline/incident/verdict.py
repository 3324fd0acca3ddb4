"""The typed result of the analysis: a launch's ``Report``, its ``Incident``, and in it the verdict, the
gradients' pattern, the rerun's finding, NVML's readings and the next steps, each with the ``to_json`` of
its part of the ``gradnan.report`` document (docs/formats.md). ``analysis.analyze`` decides it; the text
view, ``--json`` and the plot only render it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ...decision.actions import NextStep
from ...decision.evidence import HealthReading, View
from ...decision.facts import Fact
from ...formats.incident import Cause, Conclusion, GradientPass, OriginBasis, OwnFailure
from ...formats.schema import Schema
from ...formats.text import plain
from .runup import RunUp

SCHEMA = Schema("gradnan.report", 2)


@dataclass(frozen=True)
class Verdict:
    """What most likely made the step non-finite, in one line, and the evidence that says so."""

    cause: Cause
    summary: str
    evidence: Tuple[str, ...]
    rule: str  # the rule of ``decision.causes.RULES`` that decided it
    not_observed: Tuple[Fact, ...] = ()  # evidence earlier rules needed that the run did not hold

    def to_json(self) -> Dict[str, Any]:
        return {"cause": self.cause.value, "rule": self.rule, "summary": self.summary,
                "evidence": list(self.evidence), "not_observed": [fact.value for fact in self.not_observed]}


@dataclass(frozen=True)
class Pattern:
    """Which pass the origin's gradients point at, and the first non-finite one in backward order."""

    gradient_pass: GradientPass
    share_nonfinite: Optional[float]
    first_in_backward: Optional[str]
    first_rank: Optional[int]

    def to_json(self) -> Dict[str, Any]:
        return {"pass": self.gradient_pass.value, "share_nonfinite": self.share_nonfinite,
                "first_in_backward": self.first_in_backward, "first_rank": self.first_rank}


@dataclass(frozen=True)
class Concluded:
    """One conclusion and the ranks whose rerun records reached it (whole replicas: a replica's ranks all
    agree), with what of those replicas' own failed (``own_failure``; transient only)."""

    conclusion: str
    ranks: Tuple[int, ...]
    own_failure: Optional[OwnFailure] = None

    def to_json(self) -> Dict[str, Any]:
        return {"conclusion": self.conclusion, "ranks": list(self.ranks),
                "own_failure": None if self.own_failure is None else self.own_failure.value}


@dataclass(frozen=True)
class RerunFinding:
    """What the in-place rerun of the failing step found: the forward origin (the earliest non-finite call
    on its tensor-parallel group; several only on a tie), the ranks that only received it, the strongest
    conclusion any replica reached and every other one (``conclusions``), Megatron's own conclusions
    where its ranks disagree (``megatron_split``: each rank's state machine concludes for itself), and
    ``grew_in``: where a value first grew out of line before it went non-finite (the magnitude path's
    culprit; the record's ``grew_in`` with its ``global_rank``)."""

    step: int
    iteration: Optional[int]
    trigger: Optional[str]
    megatron: Optional[str]
    conclusion: Conclusion
    concluded_by: Tuple[int, ...]
    own_failure: Optional[OwnFailure]
    conclusions: Tuple[Concluded, ...]
    megatron_split: Tuple[Concluded, ...]
    module: Optional[str]
    module_class: Optional[str]
    rank: Optional[View]
    micro_batch: Optional[int]
    output_abs_max: Any
    bundle: Optional[str]
    batch: Optional[str]
    origins: Tuple[View, ...]
    receivers: Tuple[View, ...]
    grew_in: Optional[Dict[str, Any]] = None
    samples: Tuple[Dict[str, Any], ...] = ()  # the failing micro-batch in the data, per replica
    # the global ranks the records name as the forward origin (``origin_rank``) that wrote no rerun record
    origins_absent: Tuple[int, ...] = ()
    # the data-parallel replicas (dp) of ``concluded_by``: a rerun runs the whole model-parallel group of
    # a replica, and one of its ranks writes the group's record
    concluded_replicas: Tuple[int, ...] = ()
    # the ranks whose own loss (``loss_here``) was finite in both passes: where a rerun's group spans
    # several data-parallel replicas (expert parallelism), its ``observed`` loss is the group's, not theirs
    losses_finite_here: Tuple[int, ...] = ()

    @property
    def global_rank(self) -> Optional[int]:
        return None if self.rank is None else self.rank["global_rank"]

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "iteration": self.iteration, "trigger": self.trigger,
                "megatron": self.megatron, "conclusion": self.conclusion.value,
                "concluded_by": list(self.concluded_by), "concluded_replicas": list(self.concluded_replicas),
                "losses_finite_here": list(self.losses_finite_here),
                "own_failure": None if self.own_failure is None else self.own_failure.value,
                "conclusions": [group.to_json() for group in self.conclusions],
                "megatron_split": [group.to_json() for group in self.megatron_split],
                "module": self.module, "class": self.module_class, "global_rank": self.global_rank,
                "rank": self.rank, "micro_batch": self.micro_batch, "output_abs_max": self.output_abs_max,
                "bundle": self.bundle, "batch": self.batch, "origins": list(self.origins),
                "receivers": list(self.receivers), "grew_in": self.grew_in, "samples": list(self.samples),
                "origins_absent": list(self.origins_absent)}


@dataclass(frozen=True)
class Incident:
    """The first failing step of a launch: who produced it, who received it, and the verdict."""

    step: int
    iteration: Optional[int]
    kinds: Tuple[str, ...]
    origin_basis: OriginBasis
    origin: Tuple[View, ...]  # each with ``kind``, ``params_total`` and its offending ``params``
    receivers: Tuple[View, ...]  # each with ``holds_nonfinite`` and the ``modules`` it holds them in
    silent: Tuple[View, ...]  # known ranks with no record at this step
    parameters: Tuple[Dict[str, Any], ...]  # the origin's offending parameters by module, backward order
    pattern: Pattern
    verdict: Verdict
    rerun: Optional[RerunFinding]
    capture_settings: Optional[Dict[str, str]]  # GRADNAN_CAPTURE_* to capture it on a rerun from a checkpoint
    next_steps: Tuple[NextStep, ...] = ()
    health: Tuple[HealthReading, ...] = ()  # the origin devices' NVML readings at the step, where recorded
    runup: Optional[RunUp] = None  # did the culprit's gradients grow first (None: no run-up was written)

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "iteration": self.iteration, "kinds": list(self.kinds),
                "origin_basis": self.origin_basis.value, "origin": list(self.origin),
                "receivers": list(self.receivers), "silent": list(self.silent),
                "parameters": list(self.parameters), "pattern": self.pattern.to_json(),
                "verdict": self.verdict.to_json(),
                "rerun": None if self.rerun is None else self.rerun.to_json(),
                "next": [step.to_json() for step in self.next_steps],
                "health": [reading.to_json() for reading in self.health],
                "runup": None if self.runup is None else self.runup.to_json()}


@dataclass(frozen=True)
class Report:
    """One launch of a run directory: its incident (None: no failure), and what else its files hold."""

    run_dir: str
    ranks_seen: Tuple[int, ...]
    problems: Tuple[str, ...]
    problems_total: int  # how many there were: ``problems`` holds the first ``read.MAX_PROBLEMS``
    run: Optional[str]
    runs: Tuple[Dict[str, Any], ...]  # every launch: ``run`` key, ``first_step``, ``ranks``
    incident: Optional[Incident]
    later_steps: Tuple[Dict[str, Any], ...]  # later steps with failure records, and their ranks
    loss_scale_overflow_steps: Tuple[int, ...]
    selftests: Tuple[Dict[str, Any], ...]
    bundles: Tuple[Dict[str, Any], ...]
    frames: Tuple[Dict[str, Any], ...]
    probes: Tuple[Dict[str, Any], ...]
    probes_total: int  # every non-finite probe the records counted: ``probes`` holds those they listed

    @property
    def first_step(self) -> Optional[int]:
        return None if self.incident is None else self.incident.step

    def to_json(self) -> Dict[str, Any]:
        """The ``gradnan.report`` document (docs/formats.md), what ``gradnan report --json`` prints."""
        incident = self.incident
        return plain({**SCHEMA.header(), "run_dir": self.run_dir, "ranks_seen": list(self.ranks_seen),
                "problems": list(self.problems),
                "problems_total": self.problems_total, "first_step": self.first_step,
                "incident": None if incident is None else incident.to_json(),
                "later_steps": list(self.later_steps),
                "loss_scale_overflow_steps": list(self.loss_scale_overflow_steps),
                "selftests": list(self.selftests), "bundles": list(self.bundles),
                "rerun_capture": None if incident is None else incident.capture_settings,
                "frames": list(self.frames), "probes": list(self.probes),
                "probes_total": self.probes_total, "run": self.run,
                "runs": list(self.runs)})
