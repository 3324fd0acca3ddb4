"""GradnanConfig validation, GRADNAN_* parsing and the precedence of resolve_config."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from gradnan.config import ConfigError, GradnanConfig
from gradnan.config.sources import options_from_env, resolve_config

# --- GradnanConfig -----------------------------------------------------------------------------


def test_defaults_match_the_documented_values():
    config = GradnanConfig()
    assert dataclasses.asdict(config) == {
        "out_dir": "gradnan_out",
        "maps": True,
        "detect": True,
        "pre_reduction": "auto",
        "runup_steps": 32,
        "replica_check_every": 100,
        "max_params_per_record": 64,
        "skip_warn_after": 3,
        "strict": False,
        "on_nonfinite": "continue",
        "run_id": "",
        "max_records_bytes": 64 << 20,
        "capture": True,
        "capture_modules": "",
        "capture_steps": "",
        "capture_ranks": "",
        "capture_retain": False,
        "max_bundles": 4,
        "max_bundle_bytes": 256 << 20,
        "rerun": "auto",
        "max_batch_bytes": 64 << 20,
        "tensorboard_dir": "",
        "wandb_project": "",
        "ranks": "",
        "steps": "",
        "modules": "",
        "exclude_modules": "",
        "frames": "off",
        "trace_steps": "",
        "max_frames": 21,
        "abort_after_step": 0,
        "log_level": "INFO",
        "disabled_patches": (),
    }


@pytest.mark.parametrize("mode", ["auto", "sync", "off"])
def test_pre_reduction_modes(mode):
    assert GradnanConfig(pre_reduction=mode).pre_reduction == mode


def test_unknown_pre_reduction_mode_is_rejected_by_name():
    with pytest.raises(ConfigError, match="pre_reduction"):
        GradnanConfig(pre_reduction="sometimes")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GradnanConfig().detect = False  # type: ignore[misc]


def test_config_error_is_a_value_error():
    """Callers that catch ValueError for bad arguments also catch gradnan's config errors."""
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "field, bad_value",
    [
        ("out_dir", 5),
        ("out_dir", None),
        ("maps", "yes"),
        ("maps", 1),  # an int is not a bool
        ("detect", None),
        ("strict", 0),
        ("max_params_per_record", "64"),
        ("max_params_per_record", 64.0),
        ("skip_warn_after", None),
        ("log_level", 20),
    ],
)
def test_wrong_type_is_rejected_naming_the_field(field, bad_value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        GradnanConfig(**{field: bad_value})


@pytest.mark.parametrize("field", ["max_params_per_record", "skip_warn_after"])
@pytest.mark.parametrize("flag", [True, False])
def test_bool_is_not_accepted_for_int_fields(field, flag):
    """bool is a subclass of int in Python; the config must still refuse it."""
    with pytest.raises(ConfigError, match=f"'{field}'"):
        GradnanConfig(**{field: flag})


@pytest.mark.parametrize("field", ["max_params_per_record", "skip_warn_after"])
@pytest.mark.parametrize("value", [0, -1])
def test_counts_below_one_are_rejected(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        GradnanConfig(**{field: value})


def test_counts_of_one_are_accepted():
    config = GradnanConfig(max_params_per_record=1, skip_warn_after=1)
    assert (config.max_params_per_record, config.skip_warn_after) == (1, 1)


@pytest.mark.parametrize("level", ["DEBUG", "info", "Warning", "ERROR", "critical"])
def test_log_level_accepts_standard_levels_in_any_case(level):
    assert GradnanConfig(log_level=level).log_level == level


@pytest.mark.parametrize("level", ["VERBOSE", "", "10"])
def test_log_level_rejects_unknown_levels(level):
    with pytest.raises(ConfigError, match="'log_level'"):
        GradnanConfig(log_level=level)


# --- options_from_env --------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "On", " true "])
def test_env_truthy_booleans(raw):
    assert options_from_env({"GRADNAN_DETECT": raw}) == {"detect": True}


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", "OFF", "\t0\n"])
def test_env_falsy_booleans(raw):
    assert options_from_env({"GRADNAN_STRICT": raw}) == {"strict": False}


def test_env_parses_each_type():
    environ = {
        "GRADNAN_OUT_DIR": " /tmp/run 1 ",
        "GRADNAN_MAPS": "0",
        "GRADNAN_MAX_PARAMS_PER_RECORD": " 12 ",
        "GRADNAN_SKIP_WARN_AFTER": "-7",
        "GRADNAN_LOG_LEVEL": "debug",
    }
    assert options_from_env(environ) == {
        "out_dir": "/tmp/run 1",  # surrounding whitespace stripped, inner kept
        "maps": False,
        "max_params_per_record": 12,
        "skip_warn_after": -7,  # parsing only; the range is checked by GradnanConfig
        "log_level": "debug",
    }


def test_env_ignores_variables_without_the_prefix():
    environ = {"PATH": "/usr/bin", "gradnan_detect": "0", "XGRADNAN_DETECT": "0", "GRADNAN_MAPS": "1"}
    assert options_from_env(environ) == {"maps": True}


def test_env_empty_mapping_gives_no_options():
    assert options_from_env({}) == {}


@pytest.mark.parametrize("raw", ["2", "maybe", "", "y"])
def test_env_bad_boolean_names_the_variable(raw):
    with pytest.raises(ConfigError, match="GRADNAN_MAPS") as info:
        options_from_env({"GRADNAN_MAPS": raw})
    assert "boolean" in str(info.value)


@pytest.mark.parametrize("raw", ["many", "1.5", "", "0x10"])
def test_env_bad_integer_names_the_variable(raw):
    with pytest.raises(ConfigError, match="GRADNAN_SKIP_WARN_AFTER") as info:
        options_from_env({"GRADNAN_SKIP_WARN_AFTER": raw})
    assert "integer" in str(info.value)


def test_env_unknown_gradnan_variable_is_an_error():
    """A typo such as GRADNAN_DETECTT must not be silently ignored."""
    with pytest.raises(ConfigError, match="GRADNAN_DETECTT"):
        options_from_env({"GRADNAN_DETECTT": "0"})


def test_env_unknown_variable_message_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        options_from_env({"GRADNAN_FOO": "1"})
    message = str(info.value)
    assert "GRADNAN_FOO" in message
    assert "GRADNAN_OUT_DIR" in message and "GRADNAN_LOG_LEVEL" in message


# --- resolve_config ----------------------------------------------------------------------------


def test_resolve_with_nothing_gives_defaults():
    assert resolve_config(environ={}) == GradnanConfig()


def test_resolve_env_overrides_defaults():
    config = resolve_config(environ={"GRADNAN_DETECT": "0", "GRADNAN_OUT_DIR": "from_env"})
    assert config.detect is False
    assert config.out_dir == "from_env"
    assert config.maps is True  # untouched fields keep their default


# max_frames as each source gives it (its default is 21): which value comes out names the winner
MAX_FRAMES_BY_SOURCE = {"file": 3, "env": 5, "config": 7, "keyword": 9}


def _resolved_max_frames(tmp_path, sources):
    path = tmp_path / "gradnan.json"
    path.write_text(json.dumps({"max_frames": MAX_FRAMES_BY_SOURCE["file"]}))
    environ = {"GRADNAN_CONFIG": str(path)} if "file" in sources else {}
    if "env" in sources:
        environ["GRADNAN_MAX_FRAMES"] = str(MAX_FRAMES_BY_SOURCE["env"])
    config = GradnanConfig(max_frames=MAX_FRAMES_BY_SOURCE["config"]) if "config" in sources else None
    keywords = {"max_frames": MAX_FRAMES_BY_SOURCE["keyword"]} if "keyword" in sources else {}
    return resolve_config(config, environ=environ, **keywords).max_frames


@pytest.mark.parametrize("sources, expected", [
    pytest.param(("file",), 3, id="file"),
    pytest.param(("env",), 5, id="env"),
    pytest.param(("config",), 7, id="config"),
    pytest.param(("keyword",), 9, id="keyword"),
    pytest.param(("file", "env"), 5, id="env-over-file"),
    pytest.param(("env", "config"), 7, id="config-over-env"),
    pytest.param(("config", "keyword"), 9, id="keyword-over-config"),
    pytest.param(("file", "env", "config", "keyword"), 9, id="all"),
])
def test_each_source_wins_over_the_one_before(tmp_path, sources, expected):
    assert _resolved_max_frames(tmp_path, sources) == expected


def test_a_field_the_config_object_was_not_given_keeps_the_environment_value():
    """The issue's trap: config=GradnanConfig(out_dir=...) used to turn GRADNAN_FRAMES=detect into off."""
    config = resolve_config(GradnanConfig(out_dir="from_config"), environ={"GRADNAN_FRAMES": "detect"})
    assert (config.out_dir, config.frames) == ("from_config", "detect")


def test_a_field_the_config_object_was_not_given_keeps_the_file_value(tmp_path):
    path = tmp_path / "gradnan.toml"
    path.write_text('frames = "detect"\nout_dir = "from_file"\n')
    config = resolve_config(GradnanConfig(max_frames=7), environ={"GRADNAN_CONFIG": str(path)})
    assert (config.frames, config.out_dir, config.max_frames) == ("detect", "from_file", 7)


def test_a_field_given_its_default_value_still_wins_over_the_environment():
    config = resolve_config(GradnanConfig(frames="off"), environ={"GRADNAN_FRAMES": "detect"})
    assert config.frames == "off"


def test_the_given_fields_are_recorded_by_position_or_name_and_survive_a_pickle():
    config = GradnanConfig("by_position", frames="off")
    assert config.explicit_fields == {"out_dir", "frames"}
    assert GradnanConfig().explicit_fields == frozenset()
    assert pickle.loads(pickle.dumps(config)).explicit_fields == {"out_dir", "frames"}


def test_a_replaced_copy_counts_every_field_as_given():
    """As documented: dataclasses.replace gives the constructor every field."""
    copy = dataclasses.replace(GradnanConfig(out_dir="x"), max_frames=3)
    assert copy.explicit_fields == {spec.name for spec in dataclasses.fields(GradnanConfig)}
    assert resolve_config(copy, environ={"GRADNAN_FRAMES": "detect"}).frames == "off"


def test_a_config_argument_that_is_not_a_gradnan_config_is_a_config_error():
    with pytest.raises(ConfigError, match="gradnan argument 'config' is a dict, not a GradnanConfig"):
        resolve_config({"out_dir": "x"}, environ={})


def test_resolve_none_keyword_values_are_ignored():
    """``install(out_dir=None)`` must fall through to the next source, not set out_dir to None."""
    config = resolve_config(
        GradnanConfig(out_dir="from_config"),
        environ={"GRADNAN_DETECT": "0"},
        out_dir=None,
        detect=None,
    )
    assert config.out_dir == "from_config"


def test_resolve_none_keyword_falls_back_to_env():
    config = resolve_config(environ={"GRADNAN_OUT_DIR": "from_env"}, out_dir=None)
    assert config.out_dir == "from_env"


def test_resolve_unknown_keyword_is_an_error():
    with pytest.raises(ConfigError, match="'outdir'"):
        resolve_config(environ={}, outdir="x")


def test_resolve_unknown_keyword_is_an_error_even_when_none():
    with pytest.raises(ConfigError, match="'detekt'"):
        resolve_config(environ={}, detekt=None)


def test_resolve_validates_the_merged_result():
    with pytest.raises(ConfigError, match="'max_params_per_record'"):
        resolve_config(environ={"GRADNAN_MAX_PARAMS_PER_RECORD": "0"})
    with pytest.raises(ConfigError, match="'skip_warn_after'"):
        resolve_config(environ={}, skip_warn_after=True)


def test_resolve_env_errors_propagate():
    with pytest.raises(ConfigError, match="GRADNAN_NOPE"):
        resolve_config(environ={"GRADNAN_NOPE": "1"}, out_dir="x")


def test_resolve_does_not_modify_the_given_config():
    original = GradnanConfig(out_dir="kept")
    resolve_config(original, environ={}, out_dir="other")
    assert original.out_dir == "kept"


def test_the_selftest_switches_are_not_config_variables():
    """`gradnan selftest` reads GRADNAN_SELFTEST_*; install() must not reject them as unknown."""
    assert options_from_env({"GRADNAN_SELFTEST_PERTURB_RANK": "1", "GRADNAN_STRICT": "1"}) == {"strict": True}


@pytest.mark.parametrize("text", ["²", "3-²", "٣x", "-3", "3-", "a"])
def test_a_range_with_anything_but_ascii_digits_is_a_config_error(text):
    with pytest.raises(ConfigError, match="'steps' has a bad entry"):
        GradnanConfig(steps=text)


def test_a_config_file_may_give_one_step_as_a_number_and_names_itself_in_a_bad_range(tmp_path):
    from gradnan.config.sources import options_from_file

    good = tmp_path / "good.TOML"
    good.write_text("steps = 5\nranks = [1, \"3-4\"]\n")
    assert options_from_file(str(good)) == {"steps": "5", "ranks": "1,3-4"}
    bad = tmp_path / "bad.json"
    bad.write_text('{"trace_steps": "5-3"}')
    with pytest.raises(ConfigError, match=f"{bad}.*'trace_steps' has a bad entry '5-3'"):
        options_from_file(str(bad))


def test_ranges_are_parsed_once_into_intervals_however_wide():
    config = GradnanConfig(steps="0-100000000000,5", ranks="3,7-9")
    steps = config.ranges("steps")
    assert steps is config.ranges("steps")  # parsed when the configuration was made, not on every call
    assert 0 in steps and 10 ** 11 in steps and 10 ** 11 + 1 not in steps and steps.last() == 10 ** 11
    assert [rank for rank in range(12) if rank in config.ranges("ranks")] == [3, 7, 8, 9]
    assert not config.ranges("trace_steps") and config.patterns("modules") == ()


def test_modes_are_enums_that_still_compare_as_text():
    from gradnan.config.values import FramesMode, PreReduction

    config = GradnanConfig(frames="trace", trace_steps="2", pre_reduction="sync")
    assert config.frames is FramesMode.TRACE and config.frames == "trace"
    assert config.pre_reduction is PreReduction.SYNC
    with pytest.raises(ConfigError, match="'frames' must be one of off, detect, trace, got 'sometimes'"):
        GradnanConfig(frames="sometimes")
