"""The next actions a rule of ``causes.RULES`` lists (its ``actions``), each a small function of the
evidence and of where the origin runs (``Setting``): what to do, and what to type where there is something
to type. A rule's actions run in its order; an action with nothing to say for the evidence at hand (no
kept micro-batch to inspect, no bundle to replay) adds no step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from ..formats.incident import Action
from ..formats.layout import host_device
from ..formats.text import untrusted
from ..formats.wording import micro_batch_words
from .evidence import Evidence, HealthReading, View
from .facts import Fact
from .loop_terms import (
    learning_rate_options,
    load_earlier,
    load_option,
    loss_scale_options,
    numerics_options,
    rerun_mode,
    skip_option,
)


@dataclass(frozen=True)
class NextStep:
    """One thing to do about the verdict: what and why (``text``), and what to type (``command``, an
    argument list, or the option to add; None where there is nothing to type). A device to drain carries
    NVML's readings of it at the incident (``health``), where its ranks' records hold them."""

    action: Action
    text: str
    command: Optional[Tuple[str, ...]] = None
    health: Tuple[HealthReading, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        drained = ({"health": [reading.to_json() for reading in self.health]}
                   if self.action in (Action.DRAIN, Action.SELFTEST) else {})
        return {"action": self.action.value, "text": self.text,
                "command": None if self.command is None else list(self.command), **drained}


@dataclass(frozen=True)
class Setting:
    """What the actions say beyond the evidence: the decided origin's ranks as the report shows them
    (hosts, devices), every known rank's coordinates (processes per host), the run directory, NVML's
    readings of the origin's devices, the capture settings and the bundle they took (``captured``), the
    rerun's bundle of the forward origin, its module and rank, the kept micro-batch, and whether
    Megatron's own validation ran the step again."""

    origin: Sequence[View]
    ranks: Mapping[int, Mapping[str, Any]]
    run_dir: str
    health: Sequence[HealthReading] = ()
    capture: Optional[Dict[str, str]] = None
    captured: Optional[str] = None
    bundle: Optional[str] = None
    bundle_module: Optional[str] = None
    bundle_rank: Optional[int] = None
    batch: Optional[str] = None
    reran: bool = False  # the failing step was run again in place (a rerun record exists)
    megatron_reran: bool = False

    def devices(self) -> list:
        """The origin's (host, device) pairs, each once, at most ``MAX_DRAINED``."""
        return list(dict.fromkeys((entry.get("host"), entry.get("device"))
                                  for entry in self.origin))[:MAX_DRAINED]


Steps = Tuple[NextStep, ...]
ActionRule = Callable[[Evidence, Setting, Steps], Steps]  # (evidence, setting, steps so far) -> new steps
MAX_DRAINED = 8  # devices named to drain, at most (a hardware verdict names one replica's few devices)


def drain(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """Every origin device, with NVML's readings of it."""
    steps = []
    for host, device in s.devices():
        named = [entry["global_rank"] for entry in s.origin
                 if (entry.get("host"), entry.get("device")) == (host, device)]
        steps.append(NextStep(Action.DRAIN, Action.DRAIN.wording(
            f"{host_device({'host': host, 'device': device})}"
            f" (rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))})"),
            health=tuple(reading for reading in s.health if reading.rank["global_rank"] in named)))
    return tuple(steps)


def _selftest(with_health: bool) -> ActionRule:
    """A self-test of each origin host's devices; NVML's readings beside it unless a drain step already
    prints them."""
    def selftest(e: Evidence, s: Setting, so_far: Steps) -> Steps:
        steps = []
        for host in dict.fromkeys(host for host, _ in s.devices()):
            processes = sum(1 for coords in s.ranks.values() if coords.get("host") == host) or 1
            steps.append(NextStep(Action.SELFTEST, Action.SELFTEST.wording(f"{untrusted(host)}'s devices"), (
                "torchrun", f"--nproc_per_node={processes}", "--no-python", "gradnan", "selftest", "--out",
                s.run_dir),
                health=tuple(reading for reading in s.health
                             if with_health and reading.rank.get("host") == host)))
        return tuple(steps)
    return selftest


selftest = _selftest(with_health=True)
selftest_beside_drain = _selftest(with_health=False)


def selftest_after_launch(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """A bad weight written since the launch began: a device may have written it."""
    return () if e.launch_first_step else selftest(e, s, so_far)


CLEAN_MARKS = "every rank's weights, main copies and optimizer moments finite when it was saved"


def restart_from(e: Evidence, s: Setting, older_than: str, clean: str = CLEAN_MARKS,
                 before_resume: bool = False) -> NextStep:
    """The newest checkpoint known clean before the failure (its marks; ``before_resume``: older than the one
    the launch resumed from), with the loop's option that loads it; else one older than ``older_than``, and
    why none is known clean. Never Megatron's exit save: labelled with the iteration before the failing
    one, it holds what the failing step found."""
    known = e.clean_before_resume if before_resume else e.clean_checkpoint
    if known is not None:
        how, command = (None, None) if known.iteration is None else load_option(e.loop, known.iteration)
        return NextStep(Action.RESUME, Action.RESUME.wording(
            f"{known.text()}, the newest known clean ({clean}), older than {older_than}; the later ones hold"
            " the bad values or were written after the failure" + ("" if how is None else f" ({how})")),
            command)
    marks = Fact.CHECKPOINT_MARKS
    why = ((e.no_clean_before_resume if before_resume else e.no_clean_checkpoint) if marks in e.observed
           else f"the run directory holds no checkpoint marks (to have them: {marks.how_to_observe})")
    exit_save = ("; not Megatron's exit save, labelled with the iteration before the failing one but written"
                 " after the failure" if s.megatron_reran else "")
    return NextStep(Action.RESUME, Action.RESUME.wording(
        f"a checkpoint older than {older_than}; later ones hold the bad values{exit_save}. No checkpoint is"
        f" known clean: {why}"))


def _failing_step(e: Evidence) -> str:
    """The failing step, with Megatron-LM's iteration where its loop gives it."""
    return f"step {e.step}" + ("" if e.iteration is None else f" (iteration {e.iteration})")


def resume_before_weights(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """Before the checkpoint the launch resumed from where the weights came with it, else before the step
    (Megatron-LM's iteration where its loop gives it). How Megatron-LM loads an earlier one is said once:
    with a checkpoint known clean, the option that loads it by its iteration."""
    if e.launch_first_step:
        resumed = "" if e.iteration is None else f" (iteration {e.iteration - e.step})"
        how = "" if e.clean_checkpoint is not None else f" ({load_earlier(e.loop)})"
        before = f"the checkpoint this launch resumed from{resumed}, which holds them{how}"
    else:
        before = _failing_step(e)
    return (restart_from(e, s, before),)


def resume_before_divergence(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """The newest save its marks call clean and written before the last replica check that saw the replicas
    equal (the marks of a launch whose check saw them differ are not clean since then: a flipped bit is
    finite, and with two replicas which copy a save holds is not known)."""
    before = f"{_failing_step(e)}, the replica check that saw the replicas differ"
    return (restart_from(e, s, before, CLEAN_MARKS + ", and written before the last replica check that saw"
                         " the replicas equal"),)


def restore_rows(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """Each outlying row (at most ``MAX_DRAINED``), with the ranks that hold it."""
    held: Dict[Tuple[str, int, int], Tuple[int, ...]] = {}
    for row in e.outlying_rows:
        key = (row.name, row.row, row.token)
        held[key] = held.get(key, ()) + (row.rank,)
    exit_checkpoint = ("" if not s.megatron_reran else
                       "; not from the checkpoint Megatron's validate_results wrote at its exit"
                       + ("" if e.iteration is None else f" (iteration {e.iteration - 1})")
                       + ", which holds the weights as the failing step found them")
    known = e.clean_checkpoint
    how, command = ((None, None) if known is None or known.iteration is None
                    else load_option(e.loop, known.iteration))
    clean = ("" if known is None else f"; the newest save known clean is {known.text()} (its marks: every"
             " weight finite and no vocabulary row out of range)" + ("" if how is None else f" ({how})"))
    return tuple(NextStep(Action.RESTORE_ROW, Action.RESTORE_ROW.wording(
        f"row {row} of {untrusted(name)} (token {token}) on {e.labelled(ranks)}") + exit_checkpoint + clean,
        command) for (name, row, token), ranks in list(held.items())[:MAX_DRAINED])


def skip_where_the_data_reads_it(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """Where only the data reads the rows (an untied embedding's, read where the data holds the token) and
    the rerun failed again in the forward pass: the skip trains past that data. Never where every step
    reads one (the output layer's, or an embedding tied to it): the next step fails the same way."""
    if not e.rerun_module or any(row.every_step for row in e.outlying_rows):
        return ()
    return skip_iteration(e, s, so_far)


def resume_before_update(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """Before the update that wrote the bad weights; where that was the launch's first, the state it used
    came with the checkpoint the launch resumed from: before that one."""
    if e.step == 2:
        resumed = "" if e.iteration is None else f" (iteration {e.iteration - e.step})"
        return (restart_from(e, s, f"the checkpoint this launch resumed from{resumed}: the update of step 1,"
                             " the launch's first, used the optimizer state that came with it",
                             before_resume=True),)
    when = f"step {e.step - 1}" + ("" if e.iteration is None else f" (iteration {e.iteration - 1})")
    return (restart_from(e, s, f"the update of {when}, which wrote them"),)


def fix_learning_rate(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """The schedule's rate that wrote the weights, and the options that set it."""
    fault = e.rate_fault
    if fault is None:
        return ()
    return (NextStep(Action.FIX_LEARNING_RATE, Action.FIX_LEARNING_RATE.wording(
        f"the update of step {fault.step} used {fault.text()}; {learning_rate_options(e.loop)}")),)


def check_interconnect(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    hosts = ", ".join(dict.fromkeys(str(host) for host, _ in s.devices())) or "the ranks named"
    return (NextStep(Action.CHECK_INTERCONNECT, Action.CHECK_INTERCONNECT.wording(hosts)),)


def fix_loss(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    return (NextStep(Action.FIX_LOSS, Action.FIX_LOSS.wording(micro_batch_words(e.micro_batch))),)


def tune_numerics(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    return (NextStep(Action.TUNE_NUMERICS, Action.TUNE_NUMERICS.wording(
        f"{numerics_options(e.loop)}; skipping the iteration cannot help where every step fails")),)


def fix_loss_scale(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    return (NextStep(Action.TUNE_NUMERICS, Action.TUNE_NUMERICS.wording(
        f"restart with a finite loss scale: {loss_scale_options(e.loop)}")),)


def tune_numerics_if_it_recurs(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """An fp16 overflow that fails again at the next step: the numerics, not one batch."""
    return tune_numerics(e, s, so_far) if e.recurs else ()


def inspect_batch(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """The kept micro-batch, where one was kept and the failure is its own (not an fp16 overflow that
    recurs on the next step's data)."""
    if not s.batch or e.recurs:
        return ()
    return (NextStep(Action.INSPECT_BATCH, Action.INSPECT_BATCH.wording(micro_batch_words(e.micro_batch)),
                     ("gradnan", "batch", s.batch)),)


def skip_iteration(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """The loop's option that trains past the failing iteration (Megatron-LM's ``--iterations-to-skip`` by
    its release, Megatron-Bridge's ``train.iterations_to_skip``), where the rerun tied the failure to the
    step's data and the records name the iteration; never for an fp16 overflow that recurs (no batch is to
    blame). A checkpoint written by Megatron's own validate_results exit runs the iteration again on
    restart, then exits (17) rather than skipping it: that restart goes without the rerun state machine."""
    if not (e.iterations_seen and not e.recurs and s.reran):
        return ()
    refusal = _skip_refusal(e)
    if refusal or e.iteration is None:
        return (NextStep(Action.SKIP_ITERATION, f"no option to skip the iteration: {refusal}"),)
    text, command = skip_option(e.loop, e.iteration, s.megatron_reran)
    wording = Action.SKIP_ITERATION.wording(f"{e.iteration}, {text}")
    return (NextStep(Action.SKIP_ITERATION, wording, command),)


def _skip_refusal(e: Evidence) -> Optional[str]:
    """Why the failing iteration cannot be named to ``--iterations-to-skip`` (None: it can)."""
    if len(e.iterations_seen) > 1:
        seen = ", ".join(map(str, e.iterations_seen))
        return (f"the ranks' records disagree on the failing iteration ({seen}); read it from Megatron-LM's"
                " log before skipping one")
    if e.iteration is None or e.iteration < 1:
        return f"the records name iteration {e.iteration}, and Megatron-LM counts its iterations from 1"
    return None


def replay_forward_origin(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """The rerun's bundle of the forward origin."""
    if not s.bundle:
        return ()
    origin = f"{untrusted(s.bundle_module)} on rank {s.bundle_rank}"
    return (NextStep(Action.REPLAY, Action.REPLAY.wording(origin), ("gradnan", "replay", s.bundle)),)


def replay_or_capture(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """The bundle of the first bad gradient's module where capture took one after the detection, else the
    settings that capture it on a rerun from a checkpoint."""
    if s.captured:
        module = (e.first_in_backward or "").rsplit(".", 1)[0]
        return (NextStep(Action.REPLAY, Action.REPLAY.wording(module), ("gradnan", "replay", s.captured)),)
    if s.capture:
        modules = untrusted(s.capture["GRADNAN_CAPTURE_MODULES"])
        return (NextStep(Action.CAPTURE, Action.CAPTURE.wording(modules)),)
    return ()


def bisect(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """One per replay step so far: the same bundle under the stacks before and after a change."""
    return tuple(NextStep(Action.BISECT, Action.BISECT.wording("torch, megatron-core, TE"), (
        *step.command, "--against", "OLD_STACK/bin/python", "--against", "NEW_STACK/bin/python"))
        for step in so_far if step.action is Action.REPLAY and step.command)


def decide_by(what: str) -> ActionRule:
    """An undetermined verdict's step: what would decide it."""
    def decide(e: Evidence, s: Setting, so_far: Steps) -> Steps:
        return (NextStep(Action.DECIDE, Action.DECIDE.wording(what)),)
    return decide


def decide_rejected_loss(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """A loss Megatron's check rejected, the step not run again: the kept micro-batch where there is one,
    and Megatron's own rerun."""
    rerun = f"rerun with {rerun_mode(e.loop, 'validate_results')}, so that Megatron runs the step again"
    if not (e.rejected or {}).get("batch"):
        return decide_by(rerun)(e, s, so_far)
    return (NextStep(Action.DECIDE, Action.DECIDE.wording(f"look at the kept micro-batch, or {rerun}"),
                     ("gradnan", "batch", (e.rejected or {})["batch"])),)


def decide_link(e: Evidence, s: Setting, so_far: Steps) -> Steps:
    """A link whose sender's side was not observed: where Megatron's loss check raised on the last stage,
    the other stages died waiting in their exchange and never wrote it (recording everywhere cannot help):
    Megatron's own rerun runs the step again on every stage, and the kept micro-batch; else record on
    every stage."""
    if e.rejected_losses:
        return decide_rejected_loss(e, s, so_far)
    return decide_by("rerun from the last checkpoint with gradnan recording on every pipeline stage (its"
                     " default), so the sender's side of the link is checked too")(e, s, so_far)


def next_steps(actions: Sequence[ActionRule], e: Evidence, s: Setting) -> Steps:
    """The steps of a rule's ``actions``, in its order."""
    steps: Steps = ()
    for action in actions:
        steps += action(e, s, steps)
    return steps
