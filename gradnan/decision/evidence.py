"""The typed evidence every rule of ``causes`` decides on: the facts the analysis read once from the
failing step's records (``offline.evidence.evidence_of`` fills it), which of the kinds of evidence were
observed at all (``observed``: a rule that needs one that was not cannot fire), and NVML's readings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

from ..formats.incident import Conclusion, OriginBasis, OwnFailure
from ..formats.text import magnitude, untrusted
from .facts import Fact
from .links import LinkFinding
from .loop_terms import OWN_LOOP, TrainingLoop

View = Dict[str, Any]  # a rank's coordinates as the report shows them (``rank_view``), plus what it holds


@dataclass(frozen=True)
class BadWeight:
    """A weight already non-finite when the failing step began (a ``state`` record's param)."""

    rank: int
    name: str
    copy: str  # "model": the model parameter; "main": the copy the optimizer steps
    index: Tuple[int, ...]
    nan: int
    inf: int
    order: int = -1  # its registration order on its rank (backward runs the last registered first)
    token: Optional[int] = None  # a vocabulary weight's: the token its first bad element's row holds

    def text(self) -> str:
        token = "" if self.token is None else f" (token {self.token})"
        where = f"[{', '.join(map(str, self.index))}]{token}"
        copy = "" if self.copy == "model" else " (the optimizer's main copy)"
        return f"{untrusted(self.name)}{where}{copy}: {self.nan} NaN, {self.inf} Inf"


@dataclass(frozen=True)
class OutlyingRow:
    """A row of a vocabulary weight (the word embedding, the output layer) non-finite or far larger than
    the others when the failing step began (a ``state`` record's ``outlying_rows``): ``token`` is the
    vocabulary entry it holds (``tp * rows + row``: Megatron splits the vocabulary evenly over the
    tensor-parallel ranks)."""

    rank: int
    name: str
    row: int
    token: int
    largest: Any  # as the record wrote it: a number, "inf", "nan"
    median: Any
    every_step: bool = True  # every forward pass reads it (the output layer's, or tied to it)

    def text(self) -> str:
        return (f"row {self.row} of {untrusted(self.name)} (token {self.token}): largest magnitude"
                f" {magnitude(self.largest)}, the rows' median {magnitude(self.median)}")


@dataclass(frozen=True)
class StateFault:
    """An optimizer-state tensor holding a NaN/Inf, or a second moment below zero (a ``state`` record)."""

    rank: int
    name: str
    state: str
    nan: int
    inf: int
    negative: int

    def text(self) -> str:
        counts = [f"{count} {what}" for count, what in ((self.nan, "NaN"), (self.inf, "Inf"),
                                                        (self.negative, "negative")) if count]
        return f"{untrusted(self.state)} of {untrusted(self.name)} ({', '.join(counts)})"


@dataclass(frozen=True)
class RateFault:
    """The learning rate an update used where it could only write non-finite weights: non-finite, or
    ``RATE_JUMP`` times the largest of the steps kept before it (``earlier``)."""

    rank: int
    step: int
    group: int
    rate: Any  # as the record wrote it: a number, "inf", "nan"
    earlier: Optional[float] = None

    def text(self) -> str:
        was = "" if self.earlier is None else f", up from at most {self.earlier:.3g} in the steps before it"
        return f"{untrusted(self.rate)} (param group {self.group}, step {self.step}, rank {self.rank}{was})"


RATE_JUMP = 100.0


@dataclass(frozen=True)
class DivergedWeight:
    """A parameter whose copy on ``rank`` differed from its data-parallel peers' (a ``replica_divergence``
    record): its first differing element and the values there, where they were located."""

    rank: int
    name: str
    index: Optional[Tuple[int, ...]]
    value: Any  # as the record wrote it: a number, "inf", "nan", or None (not located)
    majority_value: Any

    def text(self) -> str:
        if self.index is None:
            return (f"{untrusted(self.name)} (its first differing element not located: the copies agreed"
                    " again when it was searched)")
        where = f"{untrusted(self.name)}[{', '.join(map(str, self.index))}]"
        held = ("" if self.majority_value is None
                else f" where the majority holds {untrusted(self.majority_value)}")
        return f"{where} = {untrusted(self.value)} on rank {self.rank}{held}"


@dataclass(frozen=True)
class ReplicaDivergence:
    """The first periodic replica check that saw data-parallel replicas differ (``replica_divergence``
    records): the ranks whose weights differ (from a strict majority's, else every peer's), the peers
    compared, how many agreed (None: no majority), the step the result was read at, the parameters."""

    ranks: Tuple[int, ...]
    replicas: int
    agreeing: Optional[int]
    read_at_step: int
    weights: Tuple[DivergedWeight, ...]
    params_total: int


@dataclass(frozen=True)
class KnownCheckpoint:
    """The newest checkpoint saved before the failure whose marks (``checkpoint`` records of every rank)
    found every weight, main copy and optimizer moment finite: its iteration and where it went, where the
    saver named them."""

    iteration: Optional[int]
    path: Optional[str]

    def text(self) -> str:
        label = f"iteration {self.iteration}" if self.iteration is not None else "the last clean save"
        return f"the checkpoint of {label}" + (f" ({untrusted(self.path)})" if self.path else "")


@dataclass(frozen=True)
class Evidence:
    """Every fact a rule may use, read once from the failing step's records (``evidence.evidence_of``).
    Ranks are global ranks; ``labels`` names each one for the wording ("rank 3 (tp1 pp0 dp1) on h cpu")."""

    step: int
    iteration: Optional[int]
    labels: Mapping[int, str]
    dp_size: int = 1
    # the weights and optimizer state as the failing step found them (``state`` records)
    states_read: Tuple[int, ...] = ()
    # the failing step is the launch's first, or a rank's weights were non-finite already at the launch's
    # first step: the bad weights came with the launch (its checkpoint)
    launch_first_step: bool = False
    bad_weights: Tuple[BadWeight, ...] = ()
    state_faults: Tuple[StateFault, ...] = ()
    rate_fault: Optional[RateFault] = None  # the update of the step before used a rate that explains them
    outlying_rows: Tuple[OutlyingRow, ...] = ()  # vocabulary rows non-finite or far above the others
    lone_weights: Tuple[int, ...] = ()  # holders of a bad weight that a data-parallel peer holds finite
    # a bad weight's holder none of whose data-parallel peers for that weight read its copy (under expert
    # parallelism an expert's peers hold the same experts; a dense weight's are every data-parallel rank)
    weights_unpeered: bool = False
    odd_replicas: Tuple[int, ...] = ()  # weights unlike the majority of their data-parallel peers'
    replicas_compared: Optional[bool] = None  # two or more peers' digests compared (None: no replicas)
    expert_parallel: bool = False  # ranks hold different experts: peers share every coordinate but dp
    split_replicas: Tuple[int, ...] = ()  # peers whose weights differ with no majority to side with
    # the first periodic replica check that saw data-parallel replicas differ (at this step)
    divergence: Optional[ReplicaDivergence] = None
    # the in-place rerun of the failing step
    rerun: Optional[Conclusion] = None
    rerun_module: Optional[str] = None
    rerun_class: Optional[str] = None
    rerun_origins: Tuple[int, ...] = ()  # where a forward value first went non-finite
    rerun_origins_absent: Tuple[int, ...] = ()  # origins other ranks' rerun records name, their own absent
    loss_stage: Tuple[int, ...] = ()  # the last pipeline stage's ranks of the replicas that concluded it
    # run again, ranks whose own loss was non-finite where a tensor-parallel peer's, the same loss, was finite
    tensor_parallel_loss_split: Tuple[int, ...] = ()
    rerun_concluded_by: Tuple[int, ...] = ()  # the replicas that reached the strongest conclusion
    reduction_fault: bool = False  # the origin call's tensor-parallel reduction: finite partials, a bad sum
    own_failure: Optional[OwnFailure] = None
    micro_batch: Optional[int] = None
    grew_in: Optional[Mapping[str, Any]] = None
    # the pipeline's links: receivers' first non-finite tensors set against what their senders sent
    links: Tuple[LinkFinding, ...] = ()
    # the gradients
    gradient_basis: OriginBasis = OriginBasis.NONE
    gradient_origin: Tuple[int, ...] = ()
    unchecked: Tuple[int, ...] = ()  # ranks of the job whose own gradients no record of the step checked
    silent_replicas: Tuple[int, ...] = ()  # ranks of replicas none of whose ranks wrote a record of the step
    origin_replicas: Tuple[int, ...] = ()  # the data-parallel replicas of ``gradient_origin``
    forward_pattern: bool = False  # (nearly) every gradient of the origin non-finite
    share_nonfinite: Optional[float] = None
    first_in_backward: Optional[str] = None
    first_rank: Optional[int] = None
    near_limit: bool = False
    recorded_norm: bool = False
    largest_grad: Optional[Mapping[str, Any]] = None  # a norm overflow's largest, finite, gradient
    largest_before_collective: bool = False
    # Megatron's loss check (--rerun-mode disabled) rejected these ranks' loss before any gradient existed
    rejected_losses: Tuple[int, ...] = ()
    rejected: Optional[Mapping[str, Any]] = None  # the first one: micro_batch, loss, batch, rerun_skipped
    # the ranks whose own loss was non-finite in the failing pass (an fp16 skip recorded with
    # ``loss_finite: false``): the forward pass or the loss made it, whatever the gradients look like
    losses_nonfinite: Tuple[int, ...] = ()
    # fp16's loss scaler at the failing step: the ranks that recorded a non-finite scale and its value, and
    # whether a run of skips (loss finite) recorded no scale at all (its scaler not read)
    loss_scale_bad: Tuple[int, ...] = ()
    loss_scale: Any = None
    loss_scale_unread: bool = False
    recurs: bool = False  # the next step failed too, with no update applied in between (fp16 skips)
    iterations_seen: Tuple[int, ...] = ()  # every Megatron-LM iteration the step's records name (one: agreed)
    loop: TrainingLoop = OWN_LOOP  # the training loop that ran the step: every option is named in its terms
    # the gradient origin's offending parameters, backward order, and its largest finite gradient, by rank
    origin_params: Mapping[int, Tuple[str, ...]] = field(default_factory=dict)
    largest_names: Mapping[int, str] = field(default_factory=dict)
    observed: FrozenSet[Fact] = frozenset()  # the kinds of evidence the run's files hold for this step
    # what of the step's records contradicts another record, and the ranks whose records do
    conflicts: Tuple[str, ...] = ()
    conflict_ranks: Tuple[int, ...] = ()
    # the checkpoint marks: the newest checkpoint known clean before the failure, else why none is
    clean_checkpoint: Optional[KnownCheckpoint] = None
    no_clean_checkpoint: str = ""
    # the same, older than the checkpoint this launch resumed from (where what is bad came with it)
    clean_before_resume: Optional[KnownCheckpoint] = None
    no_clean_before_resume: str = ""

    @property
    def link_faults(self) -> Tuple[LinkFinding, ...]:
        """Received non-finite where the sender sent it finite: the link made it (forward first)."""
        return tuple(sorted((found for found in self.links if found.sent == "finite"),
                            key=lambda found: found.direction != "forward"))

    @property
    def links_unobserved(self) -> Tuple[LinkFinding, ...]:
        """Received non-finite where what the sender sent there was not observed."""
        return tuple(found for found in self.links if found.sent is None)

    @property
    def link_receivers(self) -> Tuple[int, ...]:
        """Ranks that received a non-finite tensor their sender sent non-finite: not where it was made."""
        return tuple(found.receiver for found in self.links if found.sent == "nonfinite")

    @property
    def gradient_makers(self) -> Tuple[int, ...]:
        """The gradient origin without the stages that only received a non-finite gradient from the next
        one (its sender sent it so), where any remain."""
        made = tuple(rank for rank in self.gradient_origin if rank not in self.link_receivers)
        return made or self.gradient_origin

    def label(self, rank: int) -> str:
        return self.labels.get(rank, f"rank {rank}")

    def labelled(self, ranks: Tuple[int, ...], limit: int = 4) -> str:
        shown = "; ".join(self.label(rank) for rank in ranks[:limit])
        return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


@dataclass(frozen=True)
class HealthReading:
    """NVML's reading of an origin rank's device at the failing step (its record's ``device_health``), and
    what in it points at the device (``signs``, ``formats.incident.health_signs``)."""

    rank: View
    nvml_device: Dict[str, Any]
    values: Dict[str, Any]
    unread: Dict[str, str]
    signs: Tuple[str, ...]

    def to_json(self) -> Dict[str, Any]:
        return {**self.rank, "nvml_device": self.nvml_device, "values": self.values, "unread": self.unread,
                "signs": list(self.signs)}
