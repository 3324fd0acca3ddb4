"""A JSON or TOML config file (``config_file=``, ``GRADNAN_CONFIG``, ``gradnan.run --config``) says the same
as keyword arguments and ``GRADNAN_*`` variables: the same GradnanConfig, the same records from a real run; a
bad file is a one-line ConfigError naming the field or the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from gradnan.config import ConfigError, GradnanConfig
from gradnan.config.sources import options_from_file, resolve_config
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import gradnan_variables_cleared, records_by_rank

# One setting of every type and of each list form, as a file holds it ...
FILE_SETTINGS: Dict[str, Any] = {
    "out_dir": "/shared/gradnan run",
    "ranks": [0, "2-3"],
    "steps": "2-4",
    "modules": ["decoder.*"],
    "exclude_modules": ["*.mlp", "output_layer"],
    "frames": "trace",
    "trace_steps": [1, 3],
    "max_frames": 7,
    "pre_reduction": "sync",
    "capture": False,
    "capture_retain": True,
    "max_bundles": 2,
    "max_records_bytes": 1 << 20,
    "on_nonfinite": "raise",
    "log_level": "debug",
}
# ... as keyword arguments ...
KWARGS: Dict[str, Any] = {
    **FILE_SETTINGS, "ranks": "0,2-3", "modules": "decoder.*", "exclude_modules": "*.mlp,output_layer",
    "trace_steps": "1,3",
}
# ... and as GRADNAN_* variables.
ENVIRON = {f"GRADNAN_{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
           for name, value in KWARGS.items()}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(value)  # an int, or a string as a TOML basic string


def _write(path: Path, document: Any) -> Path:
    if path.suffix == ".toml":
        path.write_text("".join(f"{key} = {_toml_value(value)}\n" for key, value in document.items()))
    else:
        path.write_text(json.dumps(document))
    return path


@pytest.fixture(params=["json", "toml"])
def settings_file(request, tmp_path):
    return _write(tmp_path / f"gradnan.{request.param}", FILE_SETTINGS)


# --- one configuration, four ways ----------------------------------------------------------------


def test_the_sources_differ_from_the_defaults_in_every_setting():
    defaults = GradnanConfig()
    assert all(getattr(defaults, name) != value for name, value in KWARGS.items())


def test_a_file_resolves_to_exactly_the_keyword_and_environment_configuration(settings_file):
    from_kwargs = resolve_config(environ={}, **KWARGS)
    assert resolve_config(environ=ENVIRON) == from_kwargs
    assert resolve_config(environ={}, config_file=str(settings_file)) == from_kwargs
    assert resolve_config(environ={"GRADNAN_CONFIG": str(settings_file)}) == from_kwargs
    # as a shell may set it
    assert resolve_config(environ={"GRADNAN_CONFIG": f"  {settings_file}\n"}) == from_kwargs
    assert from_kwargs.ranks == "0,2-3" and from_kwargs.trace_steps == "1,3"


def test_json_and_toml_files_give_the_same_options(tmp_path):
    from_json = options_from_file(str(_write(tmp_path / "a.json", FILE_SETTINGS)))
    assert options_from_file(str(_write(tmp_path / "a.toml", FILE_SETTINGS))) == from_json == KWARGS


# --- precedence ----------------------------------------------------------------------------------


def test_file_then_environment_then_keywords(tmp_path):
    path = str(_write(tmp_path / "c.json", {"max_frames": 3, "out_dir": "from_file"}))
    assert resolve_config(environ={"GRADNAN_CONFIG": path}).max_frames == 3
    environ = {"GRADNAN_CONFIG": path, "GRADNAN_MAX_FRAMES": "5"}
    assert resolve_config(environ=environ).max_frames == 5
    config = resolve_config(environ=environ, max_frames=9)
    assert (config.max_frames, config.out_dir) == (9, "from_file")
    assert resolve_config(environ=environ, max_frames=None).max_frames == 5  # None falls through


def test_config_file_argument_wins_over_gradnan_config(tmp_path):
    named = str(_write(tmp_path / "named.toml", {"max_bundles": 1}))
    from_env = str(_write(tmp_path / "from_env.json", {"max_bundles": 3, "out_dir": "only_in_env_file"}))
    config = resolve_config(environ={"GRADNAN_CONFIG": from_env}, config_file=named)
    assert (config.max_bundles, config.out_dir) == (1, GradnanConfig().out_dir)  # one file, not a merge


# --- bad files -----------------------------------------------------------------------------------

BAD_FIELDS = [
    pytest.param({"out_dri": "x"}, "'out_dri'", id="unknown-field"),
    pytest.param({"max_bundles": "3"}, "'max_bundles'", id="int-as-string"),
    pytest.param({"capture": "yes"}, "'capture'", id="bool-as-yes"),
    pytest.param({"capture": 1}, "'capture'", id="bool-as-int"),
    pytest.param({"max_frames": True}, "'max_frames'", id="int-as-bool"),
    pytest.param({"ranks": [True, False]}, "'ranks'", id="ranks-as-bools"),
    pytest.param({"modules": ["decoder.*", 3]}, "'modules'", id="pattern-list-with-int"),
    pytest.param({"steps": "5-3"}, "'steps'", id="descending-range"),
    pytest.param({"trace_steps": [2, "5-3"], "frames": "trace"}, "'trace_steps'",
                 id="descending-range-in-list"),
    pytest.param({"frames": "always"}, "'frames'", id="bad-choice"),
]


@pytest.mark.parametrize("suffix", ["json", "toml"])
@pytest.mark.parametrize("document, named", BAD_FIELDS)
def test_a_bad_field_is_a_one_line_error_naming_it(tmp_path, suffix, document, named):
    path = _write(tmp_path / f"bad.{suffix}", document)
    with pytest.raises(ConfigError) as info:
        resolve_config(environ={}, config_file=str(path))
    message = str(info.value)
    assert named in message and "\n" not in message, message


@pytest.mark.parametrize("name, text, expected", [
    ("broken.json", '{"out_dir": ', "invalid JSON"),
    ("broken.toml", "out_dir = \n", "invalid TOML"),
    ("array.json", "[1, 2]", "must hold one object"),
    ("string.json", '"out_dir"', "must hold one object"),
    ("binary.json", b"\xff\xfe{}", "not UTF-8 text"),
])
def test_an_unreadable_file_is_a_one_line_error_naming_the_file(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        resolve_config(environ={"GRADNAN_CONFIG": str(path)})
    message = str(info.value)
    assert str(path) in message and expected in message and "\n" not in message, message


def test_a_missing_file_is_a_one_line_error_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / "gradnan.toml"
    with pytest.raises(ConfigError) as info:
        resolve_config(environ={}, config_file=str(missing))
    message = str(info.value)
    assert str(missing) in message and "cannot read" in message and "\n" not in message, message


@pytest.mark.slow
def test_the_launcher_stops_on_a_bad_config_file_in_one_line(tmp_path, clean_environ):
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    bad = _write(tmp_path / "bad.json", {"out_dir": str(tmp_path / "out"), "max_bundles": "3"})
    result = subprocess.run([sys.executable, "-m", "gradnan.run", "--config", str(bad), str(script)],
                            capture_output=True, text=True, timeout=120,
                            env={**clean_environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "'max_bundles'" in result.stderr, result.stderr
    assert result.stderr.startswith("gradnan.run: error: gradnan config file")
    assert not Path(str(script) + ".ran").exists() and not (tmp_path / "out").exists()


# --- the same run, three ways --------------------------------------------------------------------

TARGET = "decoder.layers.1.mlp.linear_fc1.weight"
RUN_FILE = {"ranks": [1], "steps": "2-3", "frames": "trace", "trace_steps": [2],
            "modules": ["decoder.layers.1.*"]}
RUN_KWARGS = {"ranks": "1", "steps": "2-3", "frames": "trace", "trace_steps": "2",
              "modules": "decoder.layers.1.*"}
RUN_JOB = TinyGPTJob(dtype="fp32", steps=3, quiet=True,
                     injections=(Injection(1, 2, TARGET, "nan", where="main_grad"),))


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """The same job configured by keyword arguments, by GRADNAN_* variables and by GRADNAN_CONFIG. Spawned
    workers inherit os.environ, so the variables are set before each launch: GRADNAN_CONFIG for the file job
    and the keyword job (whose own ``config_file``, an empty one, takes the place of GRADNAN_CONFIG, so only
    its keywords configure it), then the GRADNAN_* variables for the environment job."""
    root = tmp_path_factory.mktemp("three_ways")
    config_file = _write(root / "gradnan.toml", {**RUN_FILE, "out_dir": str(root / "file")})
    nothing = _write(root / "empty.json", {})
    launches = [
        ({"GRADNAN_CONFIG": str(config_file)},
         [{}, {**RUN_KWARGS, "out_dir": str(root / "kwargs"), "config_file": str(nothing)}]),
        ({f"GRADNAN_{k.upper()}": v for k, v in {**RUN_KWARGS, "out_dir": str(root / "env")}.items()}, [{}]),
    ]
    for environ, options in launches:
        with gradnan_variables_cleared() as patch:
            for key, value in environ.items():
                patch.setenv(key, value)
            launch_many([RUN_JOB.with_(gradnan=each) for each in options])
    return {way: root / way for way in ("kwargs", "env", "file")}


def _comparable(record: Dict[str, Any]) -> Dict[str, Any]:
    """A record without what differs between launches: time, run identity, file paths (the map's, the
    run-up's), process id."""
    kept = {key: value for key, value in record.items() if key not in ("time", "run", "map", "runup")}
    kept["rank"] = {key: value for key, value in record["rank"].items() if key != "pid"}
    return kept


@pytest.mark.slow
def test_the_three_ways_record_the_same(three_runs):
    by_way = {way: records_by_rank(run_dir) for way, run_dir in three_runs.items()}
    summary = {way: {rank: [(r["kind"], r["step"], r["rank"]["global_rank"], [p["name"] for p in r["params"]])
                            for r in records] for rank, records in by_rank.items()}
               for way, by_rank in by_way.items()}
    assert summary["env"] == summary["kwargs"] and summary["file"] == summary["kwargs"]
    full = {way: {rank: [_comparable(r) for r in records] for rank, records in by_rank.items()}
            for way, by_rank in by_way.items()}
    assert full["env"] == full["kwargs"] and full["file"] == full["kwargs"]


@pytest.mark.slow
def test_the_settings_shaped_what_was_recorded(three_runs):
    """Without them rank 0 would record step 3 (the NaN weights of rank 1 reach it through the all-reduce)
    and there would be no frames: the three ways agree on something the settings decided."""
    for run_dir in three_runs.values():
        by_rank = records_by_rank(run_dir)
        assert sorted(by_rank) == [1]
        records = by_rank[1]
        assert {r["step"] for r in records} == {2, 3}
        assert [(r["kind"], r["step"]) for r in records][:2] == [("frames", 2), ("nonfinite_grad_norm", 2)]
        assert [p["name"] for p in records[1]["params"]] == [TARGET]
        frames = records[0]["frames"]
        assert frames and all(f["module"].startswith("decoder.layers.1.") and f["step"] == 2 for f in frames)
        assert not any(r["kind"] == "frames" for r in records[2:])
        assert len(list((run_dir / "maps").glob("*.json"))) == 2
