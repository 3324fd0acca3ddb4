"""Issue 26 (first part): the next step after each verdict, decided once in the analysis and rendered in
the text report and ``--json``: the device to drain and the self-test to launch on its node for a device
fault, the Megatron-LM option that trains past data that fails again in place."""

from __future__ import annotations

import shlex

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.report import format_text

from .test_report_unit import _files, _record, clean_states

CORE = "decoder.layers.1.self_attention.core_attention"


LM16 = {"name": "megatron-lm", "release": "0.16.1"}
LM19 = {"name": "megatron-lm", "release": "0.19.2"}
BRIDGE = {"name": "megatron-bridge", "release": "0.6.2"}


def _rerun(rank, conclusion, host, own=None, module=None, iteration=None, megatron=None, bundle=None,
           loop=LM16):
    record = _record(2, "rerun", rank, trigger="nonfinite_grad_norm", megatron=megatron,
                     role="origin" if module else "clean", conclusion=conclusion, own_failure=own,
                     micro_batch=0, module=module, bundle=bundle, batch=None, iteration=iteration,
                     **{"class": "DotProductAttention" if module else None},
                     **({} if loop == "not recorded" else {"loop": loop}))
    record["rank"].update(host=host, device=f"cuda:{rank % 8}")
    return record


def _next(records):
    analysis = analyze(_files(*records, *clean_states(records)))
    return analysis.incident.next_steps, analysis.to_json()["incident"]["next"], format_text(analysis)


def test_a_transient_fault_names_the_device_to_drain_and_the_self_test_for_its_node():
    steps, document, text = _next([_rerun(9, "transient", "node00272", own="loss"),
                                   _rerun(1, "after_collective", "node00001"),
                                   _rerun(10, "after_collective", "node00272")])
    assert [step.action.value for step in steps] == ["drain", "selftest"]
    assert steps[0].text == "drain node00272 cuda:1 (rank 9): take its node out of the job before restarting"
    assert steps[0].command is None
    assert steps[1].command == ("torchrun", "--nproc_per_node=2", "--no-python", "gradnan", "selftest",
                                "--out", "/run")  # the job ran two ranks on node00272
    assert document[1] == {"action": "selftest", "text": steps[1].text, "command": list(steps[1].command),
                           "health": []}  # NVML's readings are beside the drain
    section = text.split("Next:\n")[1].split("Evidence:")[0]
    assert section.startswith(f"  1. {steps[0].text}\n"), text
    assert "\n     torchrun --nproc_per_node=2 --no-python gradnan selftest --out /run\n" in section, text
    assert "node00001" not in section


@pytest.mark.parametrize("loop, command", [
    (LM16, ("--iterations-to-skip", "1206")),  # up to core_v0.16: `iteration in args.iterations_to_skip`
    (LM19, ("--iterations-to-skip", "1207")),  # core_v0.17.0 on: `(iteration + 1) in ...` (issue 58)
    ({"name": "megatron-lm", "release": "0.17.0rc0"}, ("--iterations-to-skip", "1207")),
    (BRIDGE, ("train.iterations_to_skip=[1207]",)),  # Bridge: `(train_state.step + 1) in ...`
])
def test_data_that_fails_again_in_place_gets_the_option_of_the_loop_and_release_that_ran(loop, command):
    steps, document, text = _next([_rerun(1, "reproducible", "node3", module=CORE, iteration=1207, loop=loop),
                                   _rerun(0, "after_collective", "node3", iteration=1207, loop=loop)])
    assert [(step.action.value, step.command) for step in steps] == [("skip_iteration", command)]
    assert "to train past iteration 1207, restart" in text, text
    assert f"\n     {shlex.join(command)}\n" in text and document[0]["command"] == list(command)


@pytest.mark.parametrize("loop, says", [
    ("not recorded", "--iterations-to-skip 1207 on core_v0.17.0 and later, 1206 before it"),
    (None, "a loop of your own"),
])
def test_a_loop_whose_skip_option_is_unknown_gets_what_to_do_and_nothing_to_paste(loop, says):
    """An older kit's records name no loop (Megatron-LM's, by their iteration, of a release not recorded);
    a loop of the user's own has no such option."""
    steps, _, text = _next([_rerun(1, "reproducible", "node3", module=CORE, iteration=1207, loop=loop)])
    assert [(step.action.value, step.command) for step in steps] == [("skip_iteration", None)]
    assert says in steps[0].text, steps[0].text


def test_ranks_naming_different_loops_get_no_option():
    steps, _, _ = _next([_rerun(1, "reproducible", "node3", module=CORE, iteration=1207, loop=LM16),
                         _rerun(0, "after_collective", "node3", iteration=1207, loop=LM19)])
    assert [step.command for step in steps] == [None]
    assert "name different training loops (megatron-lm 0.16.1, megatron-lm 0.19.2)" in steps[0].text


@pytest.mark.parametrize("loop, command", [
    (LM16, ("--iterations-to-skip", "3", "--rerun-mode", "disabled")),
    (LM19, ("--iterations-to-skip", "4", "--rerun-mode", "disabled")),
    (BRIDGE, ("train.iterations_to_skip=[4]", "rerun_state_machine.rerun_mode=disabled")),
])
def test_after_megatrons_own_rerun_ended_the_job_the_restart_goes_without_it(loop, command):
    """A checkpoint Megatron's validate_results wrote at its exit makes the restart run the failing iteration
    again and exit (17) instead of skipping it (seen on pretrain_gpt.py, docs/recipes.md)."""
    steps, _, text = _next([_rerun(1, "reproducible", "node3", module=CORE, iteration=4,
                                   megatron="reproducible", loop=loop)])
    assert [step.command for step in steps] == [command]
    assert f"\n     {shlex.join(command)}\n" in text


def test_without_megatron_lms_iteration_there_is_no_option_to_give():
    steps, _, text = _next([_rerun(1, "reproducible", "node3", module=CORE),
                            _rerun(0, "after_collective", "node3")])
    assert steps == () and "Next:" not in text


def test_a_command_naming_a_hostile_run_dir_is_quoted_for_the_shell():
    from pathlib import Path

    from gradnan.offline.incident.read import RunFiles

    records = [_rerun(9, "transient", "node00272", own="loss"), _rerun(1, "after_collective", "n1")]
    files = RunFiles(Path("/tmp/x; touch /tmp/PWNED #"), records={Path("/r.jsonl"): records})
    [_, selftest] = analyze(files).incident.next_steps
    assert shlex.split(shlex.join(selftest.command))[-1] == "/tmp/x; touch /tmp/PWNED #"
    assert "'/tmp/x; touch /tmp/PWNED #'" in format_text(analyze(files))


def test_a_bundle_gets_the_replay_and_the_comparison_of_two_stacks_with_it():
    bundle = "/run/bundles/rank00001_tp1_pp0_dp0/step0000002_" + CORE
    steps, document, text = _next([_rerun(1, "reproducible", "node3", module=CORE, bundle=bundle),
                                   _rerun(0, "after_collective", "node3")])
    assert [(step.action.value, step.command) for step in steps] == [
        ("replay", ("gradnan", "replay", bundle)),
        ("bisect", ("gradnan", "replay", bundle, "--against", "OLD_STACK/bin/python", "--against",
                    "NEW_STACK/bin/python"))]
    assert document[1]["action"] == "bisect" and "name the first operator that differs" in document[1]["text"]
    assert f"gradnan replay {bundle} --against OLD_STACK/bin/python --against NEW_STACK/bin/python" in text
