"""What to do about a verdict (``next_steps``), every cause at least one step, with what to type where
there is something to type; and the GRADNAN_CAPTURE_* settings that capture the implicated module when
the job is rerun from a checkpoint (``capture_settings``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..formats.incident import Action, Cause
from ..formats.layout import host_device
from ..formats.text import untrusted
from .causes import Decision, Evidence
from .gradients import module_of
from .verdict import HealthReading, NextStep, Pattern, RerunFinding, View


def capture_settings(pattern: Pattern, origin: Sequence[View], step: int,
                     iteration: Optional[int]) -> Optional[Dict[str, str]]:
    """The GRADNAN_CAPTURE_* settings that capture the failing step's implicated module on the origin
    ranks when the job is rerun from a checkpoint (step filters use Megatron-LM's iteration where its
    loop ran, else steps count from the launch that is rerun)."""
    if not pattern.first_in_backward or not origin:
        return None
    return {"GRADNAN_CAPTURE_MODULES": module_of(pattern.first_in_backward),
            "GRADNAN_CAPTURE_STEPS": str(iteration if isinstance(iteration, int) else step),
            "GRADNAN_CAPTURE_RANKS": ",".join(str(e["global_rank"]) for e in origin)}


MAX_DRAINED = 8  # devices named to drain, at most (a hardware verdict names one replica's few devices)


def next_steps(decision: Decision, e: Evidence, rerun: Optional[RerunFinding], origin: Sequence[View],
               ranks: Dict[int, Dict[str, Any]], run_dir: str, health: Sequence[HealthReading],
               capture: Optional[Dict[str, str]], captured: Optional[str]) -> List[NextStep]:
    """What the cause calls for, every cause at least one step. ``captured``: a bundle of the origin's
    first bad gradient's module on an origin rank, where capture took one after the detection."""
    cause, steps = decision.cause, []
    devices = list(dict.fromkeys((entry.get("host"), entry.get("device")) for entry in origin))[:MAX_DRAINED]
    if cause is Cause.DEVICE:
        for host, device in devices:
            named = [entry["global_rank"] for entry in origin if (entry.get("host"), entry.get("device"))
                     == (host, device)]
            steps.append(NextStep(Action.DRAIN, Action.DRAIN.wording(
                f"{host_device({'host': host, 'device': device})}"
                f" (rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))})"),
                health=tuple(reading for reading in health if reading.rank["global_rank"] in named)))
    if cause in (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE):
        steps.append(NextStep(Action.RESUME, Action.RESUME.wording(_resume_before(e, cause))))
    if cause is Cause.COLLECTIVE:
        hosts = ", ".join(dict.fromkeys(str(host) for host, _ in devices)) or "the ranks named"
        steps.append(NextStep(Action.CHECK_INTERCONNECT, Action.CHECK_INTERCONNECT.wording(hosts)))
    if cause is Cause.LOSS:
        steps.append(NextStep(Action.FIX_LOSS, Action.FIX_LOSS.wording(f"micro-batch {e.micro_batch}")))
    if cause in (Cause.NORM_OVERFLOW,) or (cause is Cause.FORWARD_OP and e.recurs):
        steps.append(NextStep(Action.TUNE_NUMERICS, Action.TUNE_NUMERICS.wording(
            "a lower learning rate, a tighter --clip-grad, bf16 instead of fp16, or a lower"
            " --initial-loss-scale; skipping the iteration cannot help where every step fails")))
    batch = rerun.batch if rerun is not None else (e.rejected or {}).get("batch")
    if cause in (Cause.FORWARD_OP, Cause.LOSS) and batch:
        steps.append(NextStep(Action.INSPECT_BATCH,
                              Action.INSPECT_BATCH.wording(f"micro-batch {e.micro_batch}"),
                              ("gradnan", "batch", batch)))
    if cause in (Cause.FORWARD_OP, Cause.LOSS) and e.iterations_seen and not e.recurs and rerun is not None:
        refusal = _skip_refusal(e)
        # a checkpoint written by Megatron's own validate_results exit runs the iteration again on restart,
        # then exits (17) rather than skipping it: that restart goes without the rerun state machine
        restarted_rerun = ("--rerun-mode", "disabled") if rerun.megatron else ()
        steps.append(NextStep(Action.SKIP_ITERATION, f"no --iterations-to-skip option: {refusal}")
                     if refusal or e.iteration is None else
                     NextStep(Action.SKIP_ITERATION, Action.SKIP_ITERATION.wording(str(e.iteration)),
                              ("--iterations-to-skip", str(e.iteration - 1), *restarted_rerun)))
    if rerun is not None and rerun.bundle and cause is Cause.FORWARD_OP:
        steps.append(NextStep(Action.REPLAY,
                              Action.REPLAY.wording(f"{untrusted(rerun.module)} on rank {rerun.global_rank}"),
                              ("gradnan", "replay", rerun.bundle)))
    if cause is Cause.BACKWARD_OP and captured:
        steps.append(NextStep(Action.REPLAY, Action.REPLAY.wording(module_of(e.first_in_backward or "")),
                              ("gradnan", "replay", captured)))
    elif cause is Cause.BACKWARD_OP and capture:
        modules = untrusted(capture["GRADNAN_CAPTURE_MODULES"])
        steps.append(NextStep(Action.CAPTURE, Action.CAPTURE.wording(modules)))
    if cause in (Cause.DEVICE, Cause.COLLECTIVE, Cause.BACKWARD_OP) or (
            cause in (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE) and not e.launch_first_step):
        drained = cause is Cause.DEVICE  # NVML's readings are printed beside the drain, else the self-test
        for host in dict.fromkeys(host for host, _ in devices):
            processes = sum(1 for coords in ranks.values() if coords.get("host") == host) or 1
            steps.append(NextStep(Action.SELFTEST, Action.SELFTEST.wording(f"{untrusted(host)}'s devices"), (
                "torchrun", f"--nproc_per_node={processes}", "-m", "gradnan", "selftest", "--out", run_dir),
                health=() if drained else tuple(reading for reading in health
                                                if reading.rank.get("host") == host)))
    if cause is Cause.UNDETERMINED:
        steps.append(NextStep(Action.DECIDE, Action.DECIDE.wording(_DECIDERS.get(decision.rule, _DECIDER))))
    steps += [NextStep(Action.BISECT, Action.BISECT.wording("torch, megatron-core, TE"), (
        *step.command, "--against", "OLD_STACK/bin/python", "--against", "NEW_STACK/bin/python"))
        for step in list(steps) if step.action is Action.REPLAY and step.command]
    return steps


def _resume_before(e: Evidence, cause: Cause) -> str:
    """The point a restart must go back before: the checkpoint the launch resumed from (Megatron-LM's
    iteration before its first where the loop gives it), the update that wrote the weights, or the step."""
    if e.launch_first_step and cause is Cause.WEIGHTS:
        resumed = "" if e.iteration is None else f" (iteration {e.iteration - e.step})"
        return (f"the checkpoint this launch resumed from{resumed}, which holds them (Megatron-LM: --load a"
                " directory whose latest_checkpointed_iteration.txt names the earlier one)")
    if cause is Cause.OPTIMIZER_UPDATE:
        when = f"step {e.step - 1}" + ("" if e.iteration is None else f" (iteration {e.iteration - 1})")
        return f"the update of {when}, which wrote them"
    return f"step {e.step}" + ("" if e.iteration is None else f" (iteration {e.iteration})")


_DECIDER = ("run a self-test on the origin's node and replay the captured step on another device, or rerun"
            " from the last checkpoint with gradnan's defaults")
_DECIDERS = {
    "forward_not_rerun": "rerun from the last checkpoint with rerun='auto' (the default) so the failing step"
                         " is run again in place and its forward operator named",
    "rejected_loss": "replay the kept micro-batch, or rerun with --rerun-mode validate_results",
    "unconfirmed_holders": "rerun from the last checkpoint with pre_reduction='deferred' (the default)",
}


def _skip_refusal(e: Evidence) -> Optional[str]:
    """Why the failing iteration cannot be named to ``--iterations-to-skip`` (None: it can)."""
    if len(e.iterations_seen) > 1:
        seen = ", ".join(map(str, e.iterations_seen))
        return (f"the ranks' records disagree on the failing iteration ({seen}); read it from Megatron-LM's"
                " log before skipping one")
    if e.iteration is None or e.iteration < 1:
        return f"the records name iteration {e.iteration}, and Megatron-LM counts its iterations from 1"
    return None
