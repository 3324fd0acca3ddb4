"""The vocabulary of an incident, shared by the training side (log lines, records) and the offline side
(report, plot): record kinds, the in-place rerun's roles and conclusions, where an origin's evidence
comes from, and the verdict's causes. Each value is the string the files carry (docs/formats.md); each
conclusion's wording lives here and nowhere else, so a log line and a report headline cannot disagree.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping, Optional, Tuple, Type

from .layout import step_label
from .magnitude import magnitude_text
from .text import untrusted


class RecordKind(str, enum.Enum):
    """What a ``gradnan.record`` line says happened (its ``kind``)."""

    NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
    """The grad norm was NaN/Inf: the rank's own offending parameters at the norm."""
    LOSS_SCALE_OVERFLOW = "loss_scale_overflow"
    """fp16 dynamic loss scaling skipped the step (found Inf/NaN in the scaled gradients)."""
    PRE_REDUCTION = "pre_reduction"
    """The rank's own gradients were non-finite before the data-parallel collective: it produced them."""
    FRAMES = "frames"
    """Forward frame tracing (``frames=detect|trace``): per-module value ranges of a step."""
    PROBE = "probe"
    """``gradnan.check`` probes: the values a user asked to watch."""
    RERUN = "rerun"
    """What the in-place rerun of the failing step found on this rank."""
    NONFINITE_LOSS = "nonfinite_loss"
    """Megatron's loss check (``validate_result``, ``--rerun-mode disabled``) rejected this rank's loss."""
    STATE = "state"
    """At the run's first incident, before any update: this rank's non-finite weights (model parameters and
    the optimizer's main copies), its optimizer state's faults and a digest of its weights."""
    REPLICA_DIVERGENCE = "replica_divergence"
    """At a periodic replica check, this rank's weights differed from its data-parallel peers' (or, with no
    majority among them, the peers' weights differed): the parameters, their first differing element."""
    CHECKPOINT = "checkpoint"
    """A checkpoint save just returned (its mark): whether this rank's weights, the optimizer's main copies
    and its moments were all finite then, and a digest of its weights."""


INCIDENT_KINDS = (RecordKind.NONFINITE_GRAD_NORM, RecordKind.LOSS_SCALE_OVERFLOW, RecordKind.PRE_REDUCTION,
                  RecordKind.NONFINITE_LOSS)
NORM_KINDS = (RecordKind.NONFINITE_GRAD_NORM, RecordKind.LOSS_SCALE_OVERFLOW)


class RerunRole(str, enum.Enum):
    """How one rank's forward pass stood in the rerun of the failing step."""

    ORIGIN = "origin"
    """The earliest call on its tensor-parallel group whose inputs were finite and outputs not."""
    RECEIVER = "receiver"
    """Its first non-finite value came later than a peer's, or arrived in its inputs: it received it."""
    CLEAN = "clean"
    """Every traced value stayed finite on this rank."""


class OwnFailure(str, enum.Enum):
    """What of one data-parallel replica's own went non-finite in the failing pass (a ``rerun`` record's
    ``own_failure``): the facts a transient conclusion rests on, and its wording."""

    LOSS = "loss"
    """Its loss (on its last pipeline stage)."""
    GRADIENTS = "gradients"
    """Its own gradients before the data-parallel collective (its loss was finite, or not seen)."""


class Conclusion(str, enum.Enum):
    """One data-parallel replica's conclusion from the rerun, from that replica's own facts (its loss, its
    forward pass, its gradients before the data-parallel collective), the same on every rank of its
    model-parallel group, decided from its observations by ``decision.replica.REPLICA_RULES`` (which
    also declares which replica's conclusion leads: ``PRECEDENCE``)."""

    REPRODUCIBLE = "reproducible"
    """The forward pass went non-finite again with the same micro-batches and RNG state."""
    LOSS = "loss"
    """Run again, every traced module's output was finite and the loss computed from it was not: the loss
    function made it (a division by a zero token count, a log of zero)."""
    TRANSIENT = "transient"
    """The replica's own loss (or, where Megatron's rerun of forward and backward was finite, its own
    gradients) was non-finite in the failing pass, and finite when run again."""
    NORM_OVERFLOW = "norm_overflow"
    """Forward pass clean, every gradient finite, and the grad norm overflowed: a finite gradient so large
    that its square (or the sum of squares) passed float32's range (exploding gradients)."""
    BACKWARD = "backward"
    """The forward pass and the loss were finite in both passes: the values arose in backward."""
    AFTER_COLLECTIVE = "after_collective"
    """Forward pass, loss and own gradients before the data-parallel collective finite: at or after it (the
    replica received the values)."""
    NOT_REPRODUCED = "not_reproduced"
    """Finite this time, and neither a loss nor the gradients were seen to tell a transient fault from a
    clean step."""

    @property
    def headline(self) -> str:
        """The conclusion as the report's headline states it."""
        return _HEADLINES[self]

    def explain(self, own: Optional[OwnFailure]) -> str:
        """The conclusion as a sentence (a rank's log line), from what of the replica's own failed."""
        if self is Conclusion.TRANSIENT:
            return _TRANSIENT_EXPLANATIONS[own or OwnFailure.LOSS]
        return _EXPLANATIONS[self]


NORM_OVERFLOW_WORDS = "the grad norm overflowed although every gradient is finite"

_HEADLINES = {
    Conclusion.REPRODUCIBLE: "REPRODUCIBLE (same micro-batches, same RNG state)",
    Conclusion.LOSS: "REPRODUCIBLE in the loss function: every module's output finite, the loss not",
    Conclusion.TRANSIENT: "NOT reproduced: transient",
    Conclusion.NORM_OVERFLOW: f"forward pass clean and {NORM_OVERFLOW_WORDS}",
    Conclusion.BACKWARD: "forward pass clean: the backward pass",
    Conclusion.AFTER_COLLECTIVE: "forward pass and local gradients clean: it arose at or after the"
                                 " data-parallel collective",
    Conclusion.NOT_REPRODUCED: "not reproduced",
}

_EXPLANATIONS = {
    Conclusion.REPRODUCIBLE: "it fails again with the same micro-batches and RNG state: not a passing fault"
                             " (gradnan report weighs it with the weights and every rank's records)",
    Conclusion.LOSS: "run again with the same micro-batches and RNG state, every module's output was finite"
                     " and the loss computed from it was not: the loss function made it (a division by a"
                     " zero token count, a log of zero), not the model or the device",
    Conclusion.NORM_OVERFLOW: f"the forward pass was finite in both passes and {NORM_OVERFLOW_WORDS}: a"
                              " gradient too large for the norm's float32 sum of squares (exploding"
                              " gradients), not a NaN/Inf produced by a rank",
    Conclusion.BACKWARD: "the forward pass was finite in both passes: the non-finite values arose in the"
                         " backward pass",
    Conclusion.AFTER_COLLECTIVE: "this replica's forward pass, loss and own gradients before the"
                                 " data-parallel collective were finite: the non-finite values arose at or"
                                 " after that collective (from another replica, or a corruption after it)",
    Conclusion.NOT_REPRODUCED: "the forward pass was finite this time with the same micro-batches and RNG"
                               " state; neither its loss nor its own gradients were seen to tell a transient"
                               " fault from a clean replica",
}

_TRANSIENT_EXPLANATIONS = {
    OwnFailure.LOSS: "the forward pass was finite this time with the same micro-batches and RNG state,"
                     " although this replica's loss was not in the failing pass: a transient fault;"
                     " suspect this replica's devices (gradnan selftest)",
    OwnFailure.GRADIENTS: "Megatron's own rerun of the step (forward and backward) was finite, although this"
                          " replica's own gradients were non-finite before the data-parallel collective in"
                          " the failing pass: a transient fault; suspect this replica's devices (gradnan"
                          " selftest)",
}


class Cause(str, enum.Enum):
    """Where the non-finite value was born: the report's verdict (decided by ``decision.causes.RULES``)."""

    WEIGHTS = "weights"
    """A weight was non-finite when the step began (a checkpoint, a bad write), or replicas' copies differ."""
    OPTIMIZER_UPDATE = "optimizer_update"
    """The previous step's update wrote a non-finite weight from finite gradients and a finite norm."""
    FORWARD_OP = "forward_op"
    """A module's output went non-finite from finite inputs and weights, again when run again."""
    LOSS = "loss"
    """The loss function's value was non-finite from a finite model output."""
    BACKWARD_OP = "backward_op"
    """A gradient went non-finite in backward from a finite forward pass."""
    COLLECTIVE = "collective"
    """Every input of a collective finite on every rank, its output non-finite on some."""
    DEVICE = "device"
    """Not reproduced when the step was run again in place: a transient fault of the device."""
    REPLICA_DIVERGENCE = "replica_divergence"
    """A data-parallel replica's weights differed from its peers' at a periodic replica check, every weight
    finite or not: a silent corruption of that replica's memory or device, which trains on."""
    NORM_OVERFLOW = "norm_overflow"
    """Every gradient finite; the grad norm's float32 sum of squares overflowed (exploding gradients)."""
    LOSS_SCALE = "loss_scale"
    """fp16's dynamic loss scale itself non-finite: every scaled loss overflows and every step is skipped,
    whatever the data, the weights and the device (halving +Inf leaves +Inf; a NaN stays NaN)."""
    UNDETERMINED = "undetermined"
    """The evidence cannot decide: the summary says what would."""


class Action(str, enum.Enum):
    """What to do next about a verdict (the report's ``next`` steps), most urgent first."""

    RESUME = "resume"
    """Restart from a checkpoint written before the weights or the optimizer state went bad."""
    RESTORE_ROW = "restore_row"
    """Restore a token's row of the vocabulary's weights from a checkpoint written before it went bad."""
    FIX_LOSS = "fix_loss"
    """Guard the loss function against the micro-batch that made it non-finite."""
    INSPECT_BATCH = "inspect_batch"
    """Look at the failing micro-batch's tokens: ``gradnan batch``."""
    REPLAY = "replay"
    """Replay the captured call offline, in other dtypes or on another device: ``gradnan replay``."""
    BISECT = "bisect"
    """Replay the same bundle under the stack before and after a change: ``gradnan replay --against``."""
    CHECK_INTERCONNECT = "check_interconnect"
    """The interconnect and the communication library on the hosts that received corrupted values."""
    TUNE_NUMERICS = "tune_numerics"
    """Change the numerics (learning rate, clipping, loss scale, dtype) where no batch is to blame."""
    FIX_LEARNING_RATE = "fix_learning_rate"
    """Correct the learning-rate schedule whose rate made the update write non-finite weights."""
    CAPTURE = "capture"
    """Run again from the last checkpoint with capture set on the origin, to get the failing call."""
    DRAIN = "drain"
    """Take a suspect device's node out of the job before it runs again."""
    SELFTEST = "selftest"
    """Confirm or clear that device: ``gradnan selftest`` launched on its node (docs/selftest.md)."""
    SKIP_ITERATION = "skip_iteration"
    """Train past data that reproducibly fails: the loop's option that skips an iteration (Megatron-LM's
    ``--iterations-to-skip``, by its release; Megatron-Bridge's ``train.iterations_to_skip``)."""
    DECIDE = "decide"
    """An undetermined verdict: what would decide it."""

    def wording(self, subject: str) -> str:
        """The sentence for one step about ``subject`` (a device, a node, an iteration)."""
        return _ACTION_WORDING[self].format(subject=subject)


_ACTION_WORDING = {
    Action.RESUME: "restart from {subject}",
    Action.RESTORE_ROW: "restore {subject} from a checkpoint written before it went bad (that row of the"
                        " weight and of its optimizer's main copy), or restart from that checkpoint",
    Action.FIX_LOSS: "guard the loss function: {subject} made it non-finite from a finite model output (e.g."
                     " divide by max(number of valid tokens, 1))",
    Action.INSPECT_BATCH: "look at the failing micro-batch ({subject}):",
    Action.REPLAY: "replay the captured call in its dtype, fp32 and fp64, or on another device ({subject}):",
    Action.BISECT: "if it began with a new stack ({subject}), name the first operator that differs:",
    Action.CHECK_INTERCONNECT: "check the interconnect and the communication library of {subject}"
                               " (NCCL_DEBUG=INFO, the fabric's error counters), then self-test there",
    Action.TUNE_NUMERICS: "change the numerics, not the data: {subject}",
    Action.FIX_LEARNING_RATE: "fix the learning rate before restarting: {subject}",
    Action.CAPTURE: "to see the failing call ({subject}), restart from the last checkpoint with the"
                    " GRADNAN_CAPTURE_* settings printed at the end",
    Action.DECIDE: "to decide it: {subject}",
    Action.DRAIN: "drain {subject}: take its node out of the job before restarting",
    Action.SELFTEST: "confirm or clear {subject}: gradnan selftest, launched there as training is"
                     " (docs/selftest.md)",
    Action.SKIP_ITERATION: "to train past iteration {subject}",
}


class OriginBasis(str, enum.Enum):
    """What the origin ranks of an incident were decided from, best evidence first."""

    RERUN = "rerun"
    """Where a forward value first went non-finite when the failing step was run again in place."""
    BEFORE_COLLECTIVE = "before_collective"
    """Their own gradients were non-finite before the data-parallel collective (pre-reduction check)."""
    AFTER_COLLECTIVE = "after_collective"
    """Every checked rank was clean before the collective; these hold the non-finite gradients after it."""
    UNCHECKED = "unchecked"
    """Every checked rank was clean before the collective, but these ranks of the job were not checked (no
    record of theirs at the failing step): the value may have come from them."""
    UNCONFIRMED = "unconfirmed"
    """They hold the non-finite gradients; no pre-reduction check ran to say whether they produced them."""
    OWN_FAILURE = "own_failure"
    """No gradient was recorded (Megatron's validation stopped the step before the norm): the replica whose
    own loss or gradients the rerun's facts show non-finite in the failing pass."""
    NORM_OVERFLOW = "norm_overflow"
    """No rank held a non-finite gradient; these held the largest, finite, gradient, whose square overflowed
    the float32 grad norm (before the data-parallel collective where the pre-reduction check saw it)."""
    LOSS_SCALE = "loss_scale"
    """Their fp16 loss scaler held a non-finite scale at the failing step (``loss_scale_overflow``
    records): no parameter is at fault."""
    LOSS_CHECK = "loss_check"
    """Megatron's loss check rejected their non-finite loss (``--rerun-mode disabled``), and no rerun
    named a forward origin."""
    STATE = "state"
    """Their weights, or their optimizer state, were non-finite when the failing step began (``state``)."""
    REPLICAS = "replicas"
    """Their weights differed from their data-parallel peers' when the failing step began (``state``)."""
    REPLICA_CHECK = "replica_check"
    """Their weights differed from their data-parallel peers' at a periodic replica check
    (``replica_divergence``)."""
    LINK = "link"
    """The two ends of a pipeline link: the sender sent a finite tensor, the receiver got a non-finite one."""
    LINK_UNOBSERVED = "link_unobserved"
    """The receiving end of a pipeline link that delivered a non-finite tensor, what its sender sent there
    not observed: a receiver, named because nothing upstream was seen."""
    CONFLICT = "conflict"
    """Their records contradict another record of the step: nothing is concluded from them."""
    NONE = "none"
    """No rank held a non-finite gradient."""

    @property
    def description(self) -> str:
        return _BASIS_TEXT[self]


_BASIS_TEXT = {
    OriginBasis.LINK: "an end of the pipeline link: sent finite, received non-finite",
    OriginBasis.LINK_UNOBSERVED: "the receiving end of a pipeline link: received non-finite, what its sender"
                                 " sent there not observed",
    OriginBasis.BEFORE_COLLECTIVE: "local gradients non-finite before the data-parallel collective",
    OriginBasis.AFTER_COLLECTIVE: "holds the non-finite gradients; clean before the collective",
    OriginBasis.UNCHECKED: "own gradients not checked at the failing step, where every checked rank's were"
                           " finite",
    OriginBasis.UNCONFIRMED: "holds the non-finite gradients (unconfirmed: no pre-reduction check)",
    OriginBasis.OWN_FAILURE: "the replica whose own loss or gradients were non-finite in the failing pass,"
                             " by the rerun's facts",
    OriginBasis.NORM_OVERFLOW: "its largest gradient, finite, squares past float32's range: the grad norm"
                               " overflowed",
    OriginBasis.NONE: "",
    OriginBasis.STATE: "weights or optimizer state bad (non-finite, or a row far out of range) when the"
                       " failing step began",
    OriginBasis.REPLICAS: "weights unlike their data-parallel peers' when the failing step began",
    OriginBasis.LOSS_CHECK: "where Megatron's loss check rejected a non-finite loss",
    OriginBasis.LOSS_SCALE: "their fp16 loss scale was non-finite at the failing step",
    OriginBasis.RERUN: "named by the failing step, run again in place",
    OriginBasis.CONFLICT: "their records contradict each other",
    OriginBasis.REPLICA_CHECK: "weights unlike their data-parallel peers' at a periodic replica check",
}


class GradientPass(str, enum.Enum):
    """Which pass the origin's gradients point at (the report's ``pattern.pass``)."""

    FORWARD = "forward"
    """(Nearly) every gradient of the origin is non-finite: the loss or an activation already was."""
    BACKWARD = "backward"
    """Only some are: the first in backward order is where it started."""
    UNKNOWN = "unknown"
    """The maps needed to tell are missing."""


class RunUpFinding(str, enum.Enum):
    """Whether the culprit's gradients grew in the steps before the failing one (the run-up, read from the
    ``gradnan.runup`` files; the rule: ``offline.runup``)."""

    GREW = "grew"
    """Its bucket's largest gradient before the collective rose well above its earlier median first."""
    SUDDEN = "sudden"
    """Its bucket stayed at its earlier level until the failing step: no run-up."""
    UNDECIDED = "undecided"
    """The run-up does not decide (too few steps kept, the culprit in no recorded bucket, none named)."""

    @property
    def headline(self) -> str:
        """The finding in a few words (the plot's heading)."""
        return _RUNUP_HEADLINES[self]

    def summary(self, parameter: Optional[str], ratio: Optional[float], first: str, before: Optional[int],
                reason: str) -> str:
        """The finding as one sentence: ``ratio``, the largest of the last steps over the earlier median
        (on the ``first`` ranks where it grew); ``before``: how many steps before the failing one it first
        did; ``reason``: why the evidence does not decide."""
        subject = (f"the gradients of {untrusted(parameter)}'s bucket" if parameter
                   else "the culprit's gradients")
        if self is RunUpFinding.GREW:
            return (f"{subject} grew before the failing step: up to {magnitude_text(ratio)}x their earlier"
                    f" median, first on {first}, {before} step(s) before it: the value built up over"
                    " several steps rather than appearing at once")
        if self is RunUpFinding.SUDDEN:
            return (f"{subject} did not grow before the failing step (at most {magnitude_text(ratio)}x their"
                    " earlier median on any rank): the value went non-finite at once, with no run-up")
        return f"the run-up does not say whether {subject} grew: {reason}"


_RUNUP_HEADLINES = {
    RunUpFinding.GREW: "the culprit's gradients grew before the failing step",
    RunUpFinding.SUDDEN: "no growth before the failing step",
    RunUpFinding.UNDECIDED: "not decided",
}


def values(enum_type: Type[enum.Enum]) -> Tuple[str, ...]:
    """The strings a file may carry for ``enum_type``, in declaration order."""
    return tuple(member.value for member in enum_type)


def failing_step_headline(step: int, iteration: Optional[int], kinds) -> str:
    """The failing step as the report's first line names it, and as TensorBoard shows it at training time."""
    megatron = f", Megatron iteration {iteration}" if iteration else ""
    return f"First failing step: {step}{megatron}  ({', '.join(kinds)})"


def board_text(headline: str, step: int, iteration: Optional[int], conclusion: Optional[Conclusion],
               origin_rank: Optional[int], micro_batch: Optional[int], rank: Any,
               record: Optional[Mapping[str, Any]], out_dir: str) -> str:
    """The incident as TensorBoard shows it at its iteration (markdown, a paragraph a line), from what the
    rank that writes it knows: the failing step, its replica's rerun (the report's wording), its own
    non-finite gradients, and where the job's verdict is (the report reads every rank's files)."""
    lines = [headline]
    if conclusion is not None:
        origin = f", forward origin on rank {origin_rank}" if origin_rank is not None else ""
        batch = f", micro-batch {micro_batch}" if micro_batch is not None else ""
        lines.append(f"Rerun of {step_label(step, iteration)} in place: {conclusion.headline}{origin}{batch}"
                     f" (the data-parallel replica of rank {rank})")
    if record is not None and record["kind"] == RecordKind.NONFINITE_LOSS:
        lines.append(f"Rank {rank}: Megatron's loss check rejected a non-finite loss ({record['loss']}) at"
                     f" micro-batch {record['micro_batch']}")
    elif record is not None:
        lines.append(f"Rank {rank}: {record['params_total']} parameter(s) with non-finite gradients")
    lines.append(f"The verdict, from every rank's records: gradnan report {out_dir}")
    return "\n\n".join(lines)
