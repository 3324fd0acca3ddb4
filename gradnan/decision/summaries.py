"""What each rule of ``causes.RULES`` says (its summary, from the evidence) and which ranks it names as
the origin: the wording of the verdict, one function per rule.
"""

from __future__ import annotations

from typing import Iterable, Tuple

from ..formats.incident import Conclusion, OriginBasis, OwnFailure
from ..formats.layout import rank_ranges
from ..formats.text import untrusted
from ..formats.wording import grew_text, micro_batch_words, norm_overflow_summary, rejected_loss_summary
from .evidence import BadWeight, Evidence, StateFault
from .links import LinkFinding


def ranks_of(items: Iterable[BadWeight | StateFault]) -> Tuple[int, ...]:
    return tuple(sorted({item.rank for item in items}))


def model_weights(e: Evidence) -> Tuple[BadWeight, ...]:
    return tuple(weight for weight in e.bad_weights if weight.copy == "model") or e.bad_weights


def weight_holders(e: Evidence) -> Tuple[int, ...]:
    """The ranks holding the bad weights; of those, the odd replicas where their peers' copies are good."""
    holders = ranks_of(model_weights(e))
    lone = tuple(rank for rank in holders if rank in e.lone_weights or rank in e.odd_replicas)
    return lone or holders


def first_weight(e: Evidence, ranks: Tuple[int, ...]) -> str:
    weight = next(w for w in model_weights(e) if w.rank in ranks)
    more = len({w.name for w in e.bad_weights}) - 1
    return weight.text() + (f" (and {more} more parameter(s))" if more > 0 else "")


def checkpoint_weights(e: Evidence) -> str:
    ranks = weight_holders(e)
    return (f"the weights were already non-finite when the launch began: {first_weight(e, ranks)}"
            f" on {e.labelled(ranks)}: they came with the checkpoint this launch resumed from (or its"
            " initialization), not from this step's data or arithmetic")


def bad_state(e: Evidence) -> str:
    ranks = ranks_of(e.state_faults)
    fault = next(f for f in e.state_faults if f.rank in ranks)
    weights = f"; the weight it updates is non-finite now: {first_weight(e, weight_holders(e))}" \
        if e.bad_weights else ""
    return (f"the optimizer update of step {e.step - 1} wrote a non-finite weight from finite gradients: the"
            f" optimizer state is bad on {e.labelled(ranks)}: {fault.text()}{weights}. A moment gone bad is"
            " a corrupted optimizer state (a bad write, a faulty device, a bad resume of optimizer state)"
            + ("; that update was the launch's first, so the state most likely came with the checkpoint it"
               " resumed from" if e.step == 2 else ""))


def one_replica_weights(e: Evidence) -> str:
    ranks = weight_holders(e)
    return (f"the weights on {e.labelled(ranks)} were non-finite when step {e.step} began while their"
            f" data-parallel peers' copies of them were not: {first_weight(e, ranks)}; that replica's copy"
            " went bad after the last update (a bad write, a faulty device)")


def later_weights(e: Evidence) -> str:
    ranks = weight_holders(e)
    if e.weights_unpeered:  # no data-parallel peer of theirs read its copy
        return (f"the weights were non-finite when step {e.step} began, and the optimizer state is finite:"
                f" {first_weight(e, ranks)} on {e.labelled(ranks)}; they were finite when this launch began,"
                " so written since. No data-parallel peer's copy was read to compare"
                + (" (under expert parallelism, one holding the same experts)" if e.expert_parallel else "")
                + ", so whether one replica's copy went bad (a bad write, a faulty device) or the update of"
                f" step {e.step - 1} wrote them on every replica is not known")
    return (f"the weights were non-finite when step {e.step} began, on every replica holding them, and the"
            f" optimizer state is finite: {first_weight(e, ranks)} on {e.labelled(ranks)}; they were finite"
            f" when this launch began, so written since: by the update of step {e.step - 1} (finite"
            " gradients and moments: the learning rate, the update arithmetic) or a bad write")


def row_holders(e: Evidence) -> Tuple[int, ...]:
    return tuple(sorted({row.rank for row in e.outlying_rows}))


def outlying_row(e: Evidence) -> str:
    first = e.outlying_rows[0]
    more = len({(row.name, row.token) for row in e.outlying_rows}) - 1
    holders = tuple(row.rank for row in e.outlying_rows if (row.name, row.token) == (first.name, first.token))
    failed = (f"; run again in place, the step went non-finite again in {untrusted(e.rerun_module)},"
              f" {micro_batch_words(e.micro_batch)}" if e.rerun_module else "")
    return (f"a token's row of the vocabulary's weights is far out of range when step {e.step} began:"
            f" {first.text()} on {e.labelled(holders)}" + (f" (and {more} more row(s))" if more > 0 else "")
            + f"{failed}. No trained row is that large (a bad write, a corrupted checkpoint): it overflows"
            + (" in every step (the output layer reads every row)" if first.every_step else
               " wherever the data holds the token"))


def rerun_named(e: Evidence) -> Tuple[int, ...]:
    """The ranks the rerun names: the loss's stage where it made the value, else the forward origin."""
    return e.loss_stage if e.rerun is Conclusion.LOSS else e.rerun_origins


def diverged(e: Evidence) -> Tuple[int, ...]:
    """The replicas whose weights differ from their data-parallel peers': those unlike a majority of their
    peers; without a majority (two replicas), those of the split that produced the non-finite values
    themselves (the forward origin run again, or their own gradients before the collective): a copy that
    failed where an equal step on its peer's did not is the odd one; else every rank of the split."""
    if e.odd_replicas:
        return e.odd_replicas
    producers = set(rerun_named(e)) | (set(e.gradient_origin)
                                         if e.gradient_basis is OriginBasis.BEFORE_COLLECTIVE else set())
    return tuple(rank for rank in e.split_replicas if rank in producers) or e.split_replicas


def replicas_disagree(e: Evidence) -> str:
    ranks = diverged(e)
    which = ("hold weights unlike their data-parallel peers'" if e.odd_replicas else
             "hold weights unlike their data-parallel peers', and of the copies that differ only theirs"
             " produced the non-finite values" if ranks != e.split_replicas else
             "and their data-parallel peers hold different weights, with no majority to tell which copy is"
             " right")
    return (f"{e.labelled(ranks)} {which} (a digest of every weight, read when step {e.step} began): the"
            " replicas diverged, finite but different; a bad write, a faulty device, or a"
            " non-deterministic update")


def divergence_ranks(e: Evidence) -> Tuple[int, ...]:
    return e.divergence.ranks if e.divergence is not None else ()


def replica_divergence(e: Evidence) -> str:
    found = e.divergence
    assert found is not None  # the rule fires on it
    first = [weight for weight in found.weights if found.weights and weight.name == found.weights[0].name]
    if found.agreeing is not None:
        which = f"differed from the copy {found.agreeing} of the {found.replicas} data-parallel replicas hold"
        located, corrupted = first[:1], "that copy was"
    else:
        which = (f"differ from each other ({found.replicas} data-parallel replicas, no majority: which copy"
                 " is wrong cannot be told)")
        located, corrupted = first, "one of these copies was"
    named = "; ".join(weight.text() for weight in located) or "(no parameter named)"
    more = f" (and {found.params_total - 1} more parameter(s))" if found.params_total > 1 else ""
    read = "" if found.read_at_step == e.step else f", read at step {found.read_at_step}"
    return (f"the weights on {e.labelled(found.ranks)} {which} at the replica check of step {e.step}{read}:"
            f" {named}{more}. Replicas apply equal updates to equal weights, so {corrupted} corrupted since"
            " the check before (silent data corruption of memory or a device); a finite wrong value trains"
            " on")


def tensor_parallel_collective(e: Evidence) -> str:
    where = f" in {untrusted(e.rerun_module)}" if e.rerun_module else ""
    return (f"the tensor-parallel reduction{where}: run again in place, every rank's partial sum was finite"
            f" and the reduced value was not, on {e.labelled(e.rerun_origins)},"
            f" {micro_batch_words(e.micro_batch)}: a transfer or reduction fault")


def pipeline_link(e: Evidence) -> str:
    found = e.link_faults[0]
    return (f"the pipeline link {found.link()}: {e.label(found.receiver)} received a non-finite {found.what}"
            f" (transfer {found.transfer} of the step that way) that {_sender(e, found)} had sent"
            " finite (both checked at the link): a transfer fault between those ranks")


def _sender(e: Evidence, found: LinkFinding) -> str:
    """The sending rank, or its stage where no record of it was read."""
    return (e.label(found.sender) if found.sender is not None
            else f"pipeline stage {found.sender_stage}'s rank")


def link_unobserved(e: Evidence) -> str:
    found = e.links_unobserved[0]
    return (f"{e.label(found.receiver)} received a non-finite {found.what} over the pipeline link"
            f" {found.link()}, and whether {_sender(e, found)} sent it finite was not observed (its"
            " records do not say): the link or the sender, not the receiver")


def loss(e: Evidence) -> str:
    return (f"the loss function made it: run again in place, every module's output was finite and the loss"
            f" of {micro_batch_words(e.micro_batch)} computed from it was not, on {e.labelled(e.loss_stage)}"
            " (a division by a zero token count, a log of zero); the model, its weights and the device are"
            " not at fault")


def loss_scale(e: Evidence) -> str:
    return (f"fp16's dynamic loss scale was {untrusted(e.loss_scale)} at step {e.step} on"
            f" {e.labelled(e.loss_scale_bad)}: every loss it scales overflows, so every step is skipped"
            " whatever the data, the weights and the device (halving +Inf leaves +Inf, a NaN stays NaN); no"
            " parameter is at fault: the scaler's state is (a bad resume of it, a bad --initial-loss-scale,"
            " a broken scaler)")


def loss_scale_unread(e: Evidence) -> str:
    return ("fp16 steps keep being skipped for overflowing gradients with a finite loss, and no record holds"
            " the loss scale (the scaler was not read): a non-finite scale, which overflows every step,"
            " cannot be told from gradients that overflow at any scale, so no parameter is named")


def tensor_parallel_loss(e: Evidence) -> str:
    return (f"the tensor-parallel ranks of one replica disagree on one loss: run again in place, the loss of"
            f" {micro_batch_words(e.micro_batch)} was non-finite on"
            f" {e.labelled(e.tensor_parallel_loss_split)} and finite on its tensor-parallel peer(s), which"
            " compute the same loss from the same micro-batch (Megatron's vocab-parallel cross entropy"
            " all-reduces over them): the tensor-parallel all-reduce"
            " delivered a different value there, or that rank's device computed it wrong; not the loss"
            " function nor the data, which every peer shares")


def forward_op(e: Evidence) -> str:
    where = f"in {untrusted(e.rerun_module)}" + (f", after {grew_text(e.grew_in)}" if e.grew_in else "")
    cause = ("the numerics (an overflow), not one batch: the next step overflowed too, on other data, with"
             " no update in between" if e.recurs
             else "the data or the numerics (an overflow), not a passing fault")
    return (f"a forward operator made it: the failing step, run again in place with the same micro-batches"
            f" and RNG state, went non-finite again {where} on {e.labelled(e.rerun_origins[:1])},"
            f" {micro_batch_words(e.micro_batch)}, with finite inputs and finite weights: {cause}")


def origin_records_absent(e: Evidence) -> str:
    return (f"run again in place, the failing step went non-finite again first on"
            f" {e.labelled(e.rerun_origins_absent)} (so the other ranks' rerun records say: they received"
            " it), whose own records are not in the run directory: the module, and whether its inputs and"
            " weights were finite, are in them")


FAILED = {OwnFailure.LOSS: "its loss was not",
           OwnFailure.GRADIENTS: "its own gradients were not (before the data-parallel collective)"}


def device(e: Evidence) -> str:
    failed = FAILED[e.own_failure or OwnFailure.LOSS]
    return (f"a transient fault: the failing step, run again in place with the same micro-batches and RNG"
            f" state, was finite on every rank of the replica that failed, although {failed}"
            f" in the failing pass: suspect the device of {e.labelled(device_origin(e))}")


def device_origin(e: Evidence) -> Tuple[int, ...]:
    return e.gradient_origin or e.rerun_concluded_by


def norm_overflow(e: Evidence) -> str:
    rank = e.gradient_origin[0] if e.gradient_origin else None
    summary = norm_overflow_summary(e.label(rank) if rank is not None else "a rank", e.largest_grad or {},
                                    e.largest_before_collective)
    return summary + (f" (and on {e.labelled(e.gradient_origin[1:])})" if len(e.gradient_origin) > 1 else "")


def collective(e: Evidence) -> str:
    checked = (" (checked on each)" if not e.silent_replicas else
               f" (checked on each that recorded the step; the replicas of rank(s)"
               f" {rank_ranges(list(e.silent_replicas))} had a finite norm)")
    return (f"the data-parallel gradient collective: every rank's own gradients were finite before it"
            f"{checked}, and {e.labelled(e.gradient_origin)} held non-finite gradients after it"
            f" ({untrusted(e.first_in_backward or 'see the table')}): a transfer or reduction fault")


def backward_op(e: Evidence) -> str:
    rank = e.first_rank if e.first_rank is not None else e.gradient_makers[0]
    forward = (" the step's forward pass and its loss were finite when run again;"
               if e.rerun in (Conclusion.BACKWARD, Conclusion.AFTER_COLLECTIVE) else "")
    if e.first_in_backward is None:  # every gradient: from backward's first, the loss's own gradient
        return (f"a backward operator made it:{forward} every gradient of {e.labelled(e.gradient_makers)} is"
                " non-finite before the data-parallel collective, so from backward's first operator on (the"
                " loss's own gradient, or a loss function whose backward divides by zero)")
    alone = (f" Only one data-parallel replica of {e.dp_size} produced it, on its own data: if it recurs"
             " there on restart the operator and that batch, if not the device."
             if e.dp_size > 1 and len(e.origin_replicas) == 1 else "")
    return (f"a backward operator made it:{forward} the first non-finite gradient in backward order is"
            f" {untrusted(e.first_in_backward)} on {e.label(rank)}, before the data-parallel"
            f" collective.{alone}")


def forward_unconfirmed(e: Evidence) -> str:
    seen = (f"{e.share_nonfinite:.0%} of the gradients of {e.labelled(e.gradient_origin)} are non-finite"
            if e.forward_pattern
            else f"the loss of {e.labelled(e.losses_nonfinite)} was non-finite in the failing pass")
    return (f"{seen}: the forward pass or the loss already was, but the step was not run again in place to"
            " say which operator (rerun='auto', the default, with megatron-core's schedules decides it;"
            " where it was skipped, the ranks' INFO line says why)")


def rejected_loss(e: Evidence) -> str:
    rejected = e.rejected or {}
    return rejected_loss_summary(rejected.get("global_rank"), rejected.get("micro_batch"),
                                 rejected.get("loss"), rejected.get("batch"), rejected.get("rerun_skipped"))


def unchecked_ranks(e: Evidence) -> str:
    return (f"{e.labelled(e.gradient_origin)} hold non-finite gradients, every checked rank's own gradients"
            f" were finite before the data-parallel collective, but {e.labelled(e.unchecked)} went unchecked"
            " (no record of theirs at this step: died first, their files are not in this run directory, or"
            " gradnan's ranks left them out): the value may have come from them, so where it was born is not"
            " known")


def unconfirmed(e: Evidence) -> str:
    return (f"{e.labelled(e.gradient_origin)} hold non-finite gradients, and no check saw each rank's own"
            " gradients before the data-parallel collective (pre_reduction was off, or no Megatron DDP:"
            " Megatron-FSDP reduces them its own way, unchecked), so who produced them is not known")


def not_reproduced(e: Evidence) -> str:
    return ("run again in place, the step was finite, and neither its loss nor its own gradients were seen"
            " non-finite to tell a transient fault from a clean replica: a self-test of the replica's devices"
            " or a capture on a rerun from the checkpoint decides it")


def no_gradient(e: Evidence) -> str:
    if not e.recorded_norm:
        return ("no gradient was recorded at this step: Megatron's result validation ran it again and the job"
                " stopped before the grad norm, and no replica's own loss or gradients were seen non-finite")
    return ("no rank's records hold a non-finite gradient, and none a finite one whose square overflows"
            " where the norm is infinite (only the norm was non-finite): a rank without gradnan's records (a"
            " shard of the gradients it alone held), or the norm's own reduction")


SELFTEST_OR_RERUN = ("run a self-test on the origin's node and replay the captured step on another device, or"
                     " rerun from the last checkpoint with gradnan's defaults")


MAX_CONFLICTS_SHOWN = 3


def records_conflict(e: Evidence) -> str:
    shown = "; ".join(e.conflicts[:MAX_CONFLICTS_SHOWN])
    left = len(e.conflicts) - MAX_CONFLICTS_SHOWN
    more = f" (and {left} more)" if left > 0 else ""
    return (f"the records contradict each other, so no cause is named from them: {shown}{more}. gradnan"
            " writes each of these facts once and consistently: a run directory that mixes launches, or"
            " files edited or damaged, read this way")


def learning_rate(e: Evidence) -> str:
    ranks = weight_holders(e)
    fault = e.rate_fault
    rate = fault.text() if fault is not None else "a bad learning rate"
    return (f"the optimizer update of step {e.step - 1} wrote non-finite weights with the learning rate"
            f" {rate}: {first_weight(e, ranks)} on {e.labelled(ranks)}, on every replica holding it, the"
            " gradients and moments finite: the learning-rate schedule or what feeds it, not the data or a"
            " device")

