"""The training loop that ran the failing step (``TrainingLoop``, from the records' ``loop``), and every
option an action names, in that loop's own terms: Megatron-LM's flags (by its release), Megatron-Bridge's
``KEY=VALUE`` overrides, or, for a loop of the user's own, what to do without a flag that does not exist.

Why the release matters: Megatron-LM's loop skips an iteration when ``iteration in args.iterations_to_skip``
up to core_v0.16 (``iteration``: the iterations completed, one less than the number its log prints) and
when ``(iteration + 1) in args.iterations_to_skip`` from core_v0.17.0 on (the number the log prints), as
Megatron-Bridge does (``train_state.step + 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Tuple

from ..formats.loop import LoopKind, release_numbers, release_text

SKIP_COUNTS_LOGGED = (0, 17, 0)  # Megatron-LM's first release whose --iterations-to-skip takes the logged one

Command = Optional[Tuple[str, ...]]
TRACKER = (" Megatron's --result-rejected-tracker-filename adds skips only for a loss its validate_result"
           " rejected twice on one rank")


@dataclass(frozen=True)
class TrainingLoop:
    """``kind``: Megatron-LM's or Megatron-Bridge's loop; None for a loop of the user's own, or where the
    records do not agree on one (``disagreement`` then says how). ``release``: the loop's release as the
    records give it, its version alone (``formats.loop.release_text``), where known."""

    kind: Optional[LoopKind]
    release: Optional[str] = None
    disagreement: str = ""

    @property
    def release_numbers(self) -> Optional[Tuple[int, int, int]]:
        return release_numbers(self.release)

    def title(self) -> str:
        """The loop as a sentence names it."""
        if self.kind is LoopKind.MEGATRON_LM:
            return "Megatron-LM" + (f" (core_v{self.release})" if self.release_numbers else "")
        if self.kind is LoopKind.MEGATRON_BRIDGE:
            return "Megatron-Bridge" + (f" {self.release}" if self.release_numbers else "")
        return "the training loop"


OWN_LOOP = TrainingLoop(None)


def loop_of(records: Iterable[Mapping[str, Any]]) -> TrainingLoop:
    """The loop the failing step's records name. Records of a kit older than the ``loop`` field: Megatron-LM's
    (release not recorded) where they give its iteration, else a loop of the user's own. Records naming
    different loops or releases: none of them (no option is given for a loop the records disagree on)."""
    named = {_key(record["loop"]) for record in records if "loop" in record}
    if len(named) > 1:
        shown = ", ".join(sorted(f"{kind or 'own'} {release or ''}".strip() for kind, release in named))
        return TrainingLoop(None, None, f"the ranks' records name different training loops ({shown})")
    if named:
        kind, release = named.pop()
        return OWN_LOOP if kind is None else TrainingLoop(LoopKind(kind), release)
    if any(isinstance(record.get("iteration"), int) for record in records):
        return TrainingLoop(LoopKind.MEGATRON_LM)
    return OWN_LOOP


def _key(loop: Optional[Mapping[str, Any]]) -> Tuple[Optional[str], Optional[str]]:
    """(name, release) as the wording may print them: a checked name, the release's version alone."""
    return (None, None) if loop is None else (loop["name"], release_text(loop.get("release")))


def skip_option(loop: TrainingLoop, iteration: int, rerun_disabled: bool) -> Tuple[str, Command]:
    """(how the loop trains past ``iteration``, what to type); ``rerun_disabled``: the restart also turns
    Megatron's own rerun off (its exit checkpoint would run the iteration again and exit)."""
    if loop.kind is LoopKind.MEGATRON_BRIDGE:
        overrides: Tuple[str, ...] = ("rerun_state_machine.rerun_mode=disabled",) if rerun_disabled else ()
        return ("restart the recipe from its last checkpoint with the override below: Megatron-Bridge's"
                " loop consumes that iteration's micro-batches without training on them (its"
                " train.iterations_to_skip takes the iteration its log prints)",
                (f"train.iterations_to_skip=[{iteration}]", *overrides))
    if loop.kind is LoopKind.MEGATRON_LM:
        rerun = ("--rerun-mode", "disabled") if rerun_disabled else ()
        numbers = loop.release_numbers
        consumes = (f"restart {loop.title()} from its last checkpoint with the option below: its loop"
                    " consumes that iteration's micro-batches without training on them. ")
        if numbers is None:
            return (f"restart Megatron-LM from its last checkpoint with --iterations-to-skip {iteration} on"
                    f" core_v0.17.0 and later, {iteration - 1} before it (that release counted the iterations"
                    " completed before the one it skips); the records do not say which release ran", None)
        if numbers >= SKIP_COUNTS_LOGGED:
            return (consumes + "The option takes the iteration the log prints (core_v0.17.0 and later)."
                    + TRACKER, ("--iterations-to-skip", str(iteration), *rerun))
        return (consumes + "The option counts the iterations completed before the one it skips, one less"
                " than the number the log prints (before core_v0.17.0)." + TRACKER,
                ("--iterations-to-skip", str(iteration - 1), *rerun))
    return ("restart from the last checkpoint and have the loop consume that iteration's micro-batches"
            " without training on them (" + (f"{loop.disagreement}: no option is given" if loop.disagreement
                                     else "a loop of your own, whose options gradnan does not know") + ")",
            None)


def load_option(loop: TrainingLoop, iteration: int) -> Tuple[str, Command]:
    """(how the loop loads the checkpoint of ``iteration``, what to type)."""
    if loop.kind is LoopKind.MEGATRON_BRIDGE:
        return ("Megatron-Bridge: keep checkpoint.load and add the override below",
                (f"checkpoint.ckpt_step={iteration}",))
    if loop.kind is LoopKind.MEGATRON_LM:
        return "Megatron-LM: keep --load and add the option below", ("--ckpt-step", str(iteration))
    return "load it as your loop does", None


def load_earlier(loop: TrainingLoop) -> str:
    """How the loop loads a checkpoint older than its latest, where none is known by its iteration."""
    if loop.kind is LoopKind.MEGATRON_BRIDGE:
        return "Megatron-Bridge: checkpoint.load, with checkpoint.ckpt_step naming the earlier one"
    if loop.kind is LoopKind.MEGATRON_LM:
        return "Megatron-LM: --load a directory whose latest_checkpointed_iteration.txt names the earlier one"
    return "load the earlier one as your loop does"


def rerun_mode(loop: TrainingLoop, mode: str) -> str:
    """Megatron's own rerun state machine in ``mode`` (validate_results runs a failing step again)."""
    if loop.kind is LoopKind.MEGATRON_BRIDGE:
        return f"rerun_state_machine.rerun_mode={mode}"
    if loop.kind is LoopKind.MEGATRON_LM:
        return f"--rerun-mode {mode}"
    return f"megatron-core's RerunStateMachine in mode {mode}"


def learning_rate_options(loop: TrainingLoop) -> str:
    """What sets the schedule's rate, and what keeps a resume from taking the checkpoint's."""
    if loop.kind is LoopKind.MEGATRON_BRIDGE:
        return ("Megatron-Bridge sets it with optimizer.lr, optimizer.min_lr and the scheduler.lr_warmup_*"
                " and scheduler.lr_decay_* overrides, and a resume takes the checkpoint's scheduler state"
                " unless scheduler.override_opt_param_scheduler=true")
    if loop.kind is LoopKind.MEGATRON_LM:
        return ("Megatron-LM sets it with --lr, --min-lr and the warm-up and decay options, and a resume"
                " takes the checkpoint's scheduler state unless --override-opt_param-scheduler")
    return "your loop's scheduler sets it, and a resume may take the checkpoint's scheduler state"


def numerics_options(loop: TrainingLoop) -> str:
    """The knobs that change the numerics where no batch is to blame."""
    if loop.kind is LoopKind.MEGATRON_BRIDGE:
        return ("a lower optimizer.lr, a tighter optimizer.clip_grad, bf16 instead of fp16"
                " (mixed_precision=bf16_mixed), or a lower optimizer.initial_loss_scale")
    if loop.kind is LoopKind.MEGATRON_LM:
        return ("a lower learning rate, a tighter --clip-grad, bf16 instead of fp16, or a lower"
                " --initial-loss-scale")
    return ("a lower learning rate, tighter gradient clipping (OptimizerConfig.clip_grad), bf16 instead of"
            " fp16, or a lower initial loss scale (OptimizerConfig.initial_loss_scale)")


def loss_scale_options(loop: TrainingLoop) -> str:
    """How to train with a finite fp16 loss scale again; the dynamic scaler's state is saved with the
    optimizer's, so a restart that loads it brings the bad scale back."""
    if loop.kind is LoopKind.MEGATRON_BRIDGE:
        return ("Megatron-Bridge: a static scale (optimizer.loss_scale=65536) or bf16"
                " (mixed_precision=bf16_mixed); the dynamic scale is saved with the optimizer state, so a"
                " checkpoint saved since it went bad brings it back")
    if loop.kind is LoopKind.MEGATRON_LM:
        return ("Megatron-LM: a static scale (--loss-scale 65536) or bf16 (--bf16); the dynamic scale is"
                " saved with the optimizer state, so a checkpoint saved since it went bad brings it back")
    return ("a static scale (OptimizerConfig.loss_scale) or bf16; the dynamic scale is saved with the"
            " optimizer state, so a checkpoint saved since it went bad brings it back")
