"""File names, atomic/append writers (gradnan.formats.records) and the strict readers
(gradnan.offline.incident.read)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict

import numpy
import pytest
import torch

from gradnan.errors import InputError
from gradnan.formats import maps, records
from gradnan.formats.layout import MAPS_DIR, RECORDS_DIR, map_path, rank_tag, records_path
from gradnan.formats.maps import COLUMNS, ParamSlot
from gradnan.formats.maps import load as load_map
from gradnan.formats.maps import to_json as map_document
from gradnan.formats.maps import write as write_map
from gradnan.formats.records import load as load_records
from gradnan.formats.safe_write import append_json_line as append_record
from gradnan.formats.safe_write import write_json_atomic
from gradnan.formats.schema import json_float
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run


def coords(global_rank: int = 0, **overrides: Any) -> Dict[str, Any]:
    """Rank coordinates shaped like ``rank_coordinates()`` returns on a single process."""
    values: Dict[str, Any] = {
        "global_rank": global_rank, "world_size": global_rank + 1, "local_rank": 0, "host": "node-a",
        "device": "cpu", "pid": 1234,
        "tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1, "dp": 0, "dp_size": 1,
        "cp": 0, "cp_size": 1, "ep": 0, "ep_size": 1,
    }
    values.update(overrides)
    return values


def slot(param_id: int, name: str, shape=(4, 3), shard=None) -> ParamSlot:
    return ParamSlot(
        id=param_id, name=name, shape=tuple(shape), dtype="torch.bfloat16", numel=math.prod(shape),
        group=0, wd_mult=1.0, lr_mult=None, is_expert=False, optimizer=0, shard=shard,
        main_dtype="torch.float32",
    )


def a_map_document(rank: Dict[str, Any] = None) -> Dict[str, Any]:
    return map_document(
        rank or coords(),
        {"megatron-core": "0.16.1", "torch": "2.13.0"},
        {"id": "job1", "attempt": 0, "started": 1.0},
        0,
        "ChainedOptimizer",
        [slot(0, "embedding.word_embeddings.weight", (16, 8)),
         slot(1, "decoder.layers.0.mlp.linear_fc1.weight", (8, 8), shard=(0, 32))],
    )


def a_record(step: int, rank: Dict[str, Any] = None, *, param_id: int = 1) -> Dict[str, Any]:
    """A record shaped like ``Runtime._record`` writes (minus the in-memory ``_path``)."""
    return {
        "schema": records.SCHEMA.name, "version": records.SCHEMA.version, "kind": "nonfinite_grad_norm",
        "step": step, "time": 1700000000.5, "rank": rank or coords(), "optimizer_index": 0,
        "map": "/run/maps/rank00000_tp0_pp0_dp0.json", "local_nonfinite": True,
        "params": [{
            "id": param_id, "name": "decoder.layers.0.mlp.linear_fc1.weight", "kind": "nan",
            "nan": 1, "inf": 0, "pos_inf": 0, "neg_inf": 0, "first_bad_flat": 9,
            "first_bad_index": [1, 1], "abs_max_finite": 0.25, "near_limit": False, "numel": 64,
            "shard": [0, 32], "is_expert": False,
        }],
        "params_total": 1, "grad_norm": "nan",
    }


def assert_one_line_naming(error: BaseException, path: Path) -> str:
    message = str(error)
    assert "\n" not in message
    assert str(path) in message
    return message


# --- rank_tag / paths -------------------------------------------------------------------------


def test_rank_tag_has_tp_pp_dp_always():
    assert rank_tag({"global_rank": 3, "tp": 1, "pp": 0, "dp": 1}) == "rank00003_tp1_pp0_dp1"


def test_rank_tag_zero_pads_global_rank_to_five_digits():
    assert rank_tag(coords(7)).startswith("rank00007_")
    assert rank_tag(coords(12345)).startswith("rank12345_")
    assert rank_tag(coords(123456)).startswith("rank123456_")  # wider ranks are not cut


def test_rank_tag_omits_cp_and_ep_of_size_one_or_unknown():
    assert rank_tag(coords(0, cp=0, cp_size=1, ep=0, ep_size=1)) == "rank00000_tp0_pp0_dp0"
    assert rank_tag(coords(0, cp_size=None, ep_size=None)) == "rank00000_tp0_pp0_dp0"
    assert rank_tag({"global_rank": 0, "tp": 0, "pp": 0, "dp": 0}) == "rank00000_tp0_pp0_dp0"


def test_rank_tag_includes_cp_and_ep_when_larger_than_one():
    assert rank_tag(coords(5, tp=1, dp=0, cp=1, cp_size=2)) == "rank00005_tp1_pp0_dp0_cp1"
    assert rank_tag(coords(5, ep=3, ep_size=4)) == "rank00005_tp0_pp0_dp0_ep3"
    assert rank_tag(coords(9, cp=1, cp_size=2, ep=2, ep_size=4)) == "rank00009_tp0_pp0_dp0_cp1_ep2"


def test_rank_tag_marks_unknown_coordinates_with_x():
    assert rank_tag({"global_rank": 2, "tp": None, "pp": 1}) == "rank00002_tpx_pp1_dpx"


def test_rank_tags_of_different_ranks_differ():
    tags = {rank_tag(coords(r, tp=r % 2, dp=r // 2, dp_size=2, tp_size=2)) for r in range(4)}
    assert len(tags) == 4


def test_map_path_first_optimizer_has_no_suffix():
    assert map_path("/out", coords(1), 0) == Path("/out") / MAPS_DIR / "rank00001_tp0_pp0_dp0.json"


def test_map_path_later_optimizers_have_index_suffix():
    assert map_path("/out", coords(1), 1) == Path("/out/maps/rank00001_tp0_pp0_dp0_opt1.json")
    assert map_path("out", coords(1), 12).name == "rank00001_tp0_pp0_dp0_opt12.json"


def test_records_path():
    assert records_path("/out", coords(2, pp=1)) == Path("/out") / RECORDS_DIR / "rank00002_tp0_pp1_dp0.jsonl"


# --- json_float -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [(1.5, 1.5), (0.0, 0.0), (-3, -3.0), (float("nan"), "nan"), (float("inf"), "inf"),
     (float("-inf"), "-inf")],
)
def test_json_float(value, expected):
    assert json_float(value) == expected


def test_json_float_accepts_zero_dim_tensors_and_numpy():
    assert json_float(torch.tensor(float("nan"))) == "nan"
    assert json_float(numpy.float32(-numpy.inf)) == "-inf"
    assert type(json_float(torch.tensor(2.0))) is float


def test_json_float_output_is_strict_json():
    values = [json_float(v) for v in (1.0, float("nan"), float("inf"), float("-inf"))]
    assert json.loads(json.dumps(values, allow_nan=False)) == [1.0, "nan", "inf", "-inf"]


# --- write_json_atomic ------------------------------------------------------------------------


def test_write_json_atomic_creates_parents_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "a" / "b" / "doc.json"
    write_json_atomic(path, {"x": [1, 2], "y": "z"})
    assert json.loads(path.read_text()) == {"x": [1, 2], "y": "z"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["doc.json"]


def test_write_json_atomic_replaces_existing_file_via_rename(tmp_path, mocker):
    """The new content goes to a temporary in the same directory which is renamed over the target."""
    path = tmp_path / "doc.json"
    path.write_text('{"old": true}\n')
    replace = mocker.spy(os, "replace")
    write_json_atomic(path, {"new": True})
    assert json.loads(path.read_text()) == {"new": True}
    replace.assert_called_once()
    source, target = replace.call_args.args
    directory = replace.call_args.kwargs  # names in one directory, reached by its descriptor
    assert source.startswith(".doc.json.") and target == "doc.json"
    assert directory["src_dir_fd"] == directory["dst_dir_fd"]
    assert not (tmp_path / source).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_write_json_atomic_keeps_old_file_when_serialization_fails(tmp_path):
    """allow_nan=False: a NaN float is a ValueError, raised after part of the JSON was written."""
    path = tmp_path / "doc.json"
    path.write_text('{"old": true}\n')
    with pytest.raises(ValueError):
        write_json_atomic(path, {"ok": 1, "bad": float("nan")})
    assert path.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_write_json_atomic_cleans_up_when_rename_fails(tmp_path, mocker):
    path = tmp_path / "doc.json"
    path.write_text("old")
    mocker.patch("gradnan.formats.safe_write.os.replace", side_effect=OSError("disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        write_json_atomic(path, {"new": 1})
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_write_json_atomic_failure_without_previous_file_leaves_nothing(tmp_path):
    path = tmp_path / "maps" / "doc.json"
    with pytest.raises(ValueError):
        write_json_atomic(path, {"bad": float("inf")})
    assert not path.parent.exists()  # the document is encoded before anything is created


# --- append_record ----------------------------------------------------------------------------


def test_append_record_appends_one_compact_line_each(tmp_path):
    path = tmp_path / "records" / "r.jsonl"
    append_record(path, {"step": 1, "a": [1, 2]})
    append_record(path, {"step": 2})
    text = path.read_text()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "a": [1, 2]}, {"step": 2}]
    assert lines[0] == '{"step":1,"a":[1,2]}'


def test_append_record_keeps_existing_content(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"step":0}\n')
    append_record(path, {"step": 1})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]


def test_append_record_rejects_nan_without_writing(tmp_path):
    path = tmp_path / "r.jsonl"
    append_record(path, {"step": 1})
    with pytest.raises(ValueError):
        append_record(path, {"step": 2, "grad_norm": float("nan")})
    assert path.read_text() == '{"step":1}\n'


# --- load_map ---------------------------------------------------------------------------------


def test_load_map_round_trips_a_written_map(tmp_path):
    document = a_map_document(coords(3, tp=1, tp_size=2))
    path = map_path(str(tmp_path), document["rank"], 0)
    write_map(path, document)
    loaded = load_map(path)
    assert {key: value for key, value in loaded.items() if key != "params"} == {
        key: value for key, value in document.items() if key != "params"}
    assert loaded["params"] == [{**asdict(slot(0, "embedding.word_embeddings.weight", (16, 8))),
                                 "shape": [16, 8]},
                                {**asdict(slot(1, "decoder.layers.0.mlp.linear_fc1.weight", (8, 8),
                                               shard=(0, 32))),
                                 "shape": [8, 8], "shard": [0, 32]}]
    assert loaded["params_count"] == 2 and "\n " not in path.read_text(), "compact: one line, no indentation"
    assert load_map(path, params=False) == {key: value for key, value in document.items()
                                            if key not in ("param_columns", "params")}, (
        "the header, parsed alone")


def test_load_map_reads_a_version_1_map(tmp_path):
    """Maps written by kits before version 2: one object per parameter, indented."""
    document = a_map_document()
    version_1 = {**document, "version": 1, "params": [dict(zip(COLUMNS, row)) for row in document["params"]]}
    del version_1["param_columns"]
    path = tmp_path / "maps" / "old.json"
    write_json_atomic(path, version_1)
    loaded = load_map(path)
    assert loaded["params"] == version_1["params"] and loaded["params_count"] == 2
    assert load_map(path, params=False)["params_count"] == 2
    del version_1["params_count"]  # version 1 had no count: readers count the entries
    write_json_atomic(path, version_1)
    assert load_map(path, params=False)["params_count"] == load_map(path)["params_count"] == 2


def test_load_map_version_2_rows_must_match_the_columns(tmp_path):
    document = a_map_document()
    document["params"][1] = document["params"][1][:-1]
    path = tmp_path / "maps" / "short.json"
    write_map(path, document)
    with pytest.raises(InputError) as info:
        load_map(path)
    assert "params[1] needs one value per column" in assert_one_line_naming(info.value, path)


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_load_map_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(InputError) as info:
        load_map(path)
    assert "cannot read" in assert_one_line_naming(info.value, path)


def test_load_map_invalid_json(tmp_path):
    path = write_text(tmp_path / "m.json", '{"schema": "gradnan.map",\n "version": ')
    with pytest.raises(InputError) as info:
        load_map(path)
    assert "invalid JSON" in assert_one_line_naming(info.value, path)


def test_load_map_not_utf8(tmp_path):
    path = tmp_path / "m.json"
    path.write_bytes(b'{"name": "\xff\xfe"}')
    with pytest.raises(InputError) as info:
        load_map(path)
    assert "UTF-8" in assert_one_line_naming(info.value, path)


@pytest.mark.parametrize("body", ["[1, 2]", '"text"', "3"])
def test_load_map_not_an_object(tmp_path, body):
    path = write_text(tmp_path / "m.json", body)
    with pytest.raises(InputError) as info:
        load_map(path)
    assert "not a JSON object" in assert_one_line_naming(info.value, path)


def test_load_map_wrong_schema(tmp_path):
    document = dict(a_map_document(), schema=records.SCHEMA.name)
    path = write_text(tmp_path / "m.json", json.dumps(document))
    with pytest.raises(InputError) as info:
        load_map(path)
    message = assert_one_line_naming(info.value, path)
    assert maps.SCHEMA.name in message and records.SCHEMA.name in message


def test_load_map_future_version(tmp_path):
    path = write_text(tmp_path / "m.json",
                      json.dumps(dict(a_map_document(), version=maps.SCHEMA.version + 1)))
    with pytest.raises(InputError) as info:
        load_map(path)
    message = assert_one_line_naming(info.value, path)
    assert "newer" in message and "upgrade" in message


@pytest.mark.parametrize("version", [None, "1", 1.0, True])
def test_load_map_missing_or_non_integer_version(tmp_path, version):
    document = a_map_document()
    if version is None:
        del document["version"]
    else:
        document["version"] = version
    path = write_text(tmp_path / "m.json", json.dumps(document))
    with pytest.raises(InputError, match="version") as info:
        load_map(path)
    assert_one_line_naming(info.value, path)


@pytest.mark.parametrize(
    "bad_entry",
    [{"name": "w"}, {"id": 1}, {"id": "1", "name": "w"}, {"id": 1, "name": None}, "w", 1],
)
def test_load_map_param_entry_needs_id_and_name(tmp_path, bad_entry):
    document = a_map_document()
    document["params"].append(bad_entry)
    path = write_text(tmp_path / "m.json", json.dumps(document))
    with pytest.raises(InputError) as info:
        load_map(path)
    assert "params[2]" in assert_one_line_naming(info.value, path)


@pytest.mark.parametrize("field, value", [("params", None), ("params", {}), ("rank", None), ("rank", [])])
def test_load_map_needs_params_list_and_rank_object(tmp_path, field, value):
    document = dict(a_map_document(), **{field: value})
    path = write_text(tmp_path / "m.json", json.dumps(document))
    with pytest.raises(InputError, match="'params' list and a 'rank' object") as info:
        load_map(path)
    assert_one_line_naming(info.value, path)


def test_load_map_needs_global_rank(tmp_path):
    document = a_map_document()
    del document["rank"]["global_rank"]
    path = write_text(tmp_path / "m.json", json.dumps(document))
    with pytest.raises(InputError, match="global_rank") as info:
        load_map(path)
    assert_one_line_naming(info.value, path)


# --- load_records -----------------------------------------------------------------------------


def write_records(path: Path, *records: Dict[str, Any]) -> Path:
    for record in records:
        append_record(path, record)
    return path


def test_load_records_round_trips_appended_records(tmp_path):
    written = [a_record(1), a_record(2, param_id=0), a_record(5)]
    path = write_records(tmp_path / "r.jsonl", *written)
    records, problems = load_records(path)
    assert records == written
    assert problems == []


def test_load_records_empty_file(tmp_path):
    path = write_text(tmp_path / "r.jsonl", "")
    assert load_records(path) == ([], [])


def test_load_records_skips_blank_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("\n" + json.dumps(a_record(1)) + "\n   \n" + json.dumps(a_record(2)) + "\n\n")
    records, problems = load_records(path)
    assert [r["step"] for r in records] == [1, 2]
    assert problems == []


def test_load_records_truncated_last_line_keeps_earlier_records(tmp_path):
    path = write_records(tmp_path / "r.jsonl", a_record(1), a_record(2))
    partial = json.dumps(a_record(3), separators=(",", ":"))
    with open(path, "a") as stream:
        stream.write(partial[: len(partial) // 2])  # the rank died mid-write: no newline
    records, problems = load_records(path)
    assert [r["step"] for r in records] == [1, 2]
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:3:")
    assert "truncated" in problems[0]
    assert "\n" not in problems[0]


def test_load_records_complete_last_line_without_newline_is_kept(tmp_path):
    """Only a line that fails to parse is a cut-short record; a whole one missing its newline is fine."""
    path = write_text(tmp_path / "r.jsonl", json.dumps(a_record(1)) + "\n" + json.dumps(a_record(2)))
    records, problems = load_records(path)
    assert [r["step"] for r in records] == [1, 2]
    assert problems == []


@pytest.mark.parametrize("last", ["\n", "", "\n{cut"])
def test_a_file_read_at_once_gives_the_lines_of_one_streamed(tmp_path, monkeypatch, last):
    """A records file of up to ``SMALL_FILE`` bytes is read at once and split: the same lines, numbers,
    byte offsets and problems as a larger one read line by line (``\r`` is no line end in either)."""
    path = write_text(tmp_path / "r.jsonl", "\n" + json.dumps(a_record(1)) + "\r\n  \n{not json\n"
                      + json.dumps(a_record(2)) + last)
    at_once = list(records.stream(path))
    monkeypatch.setattr(records, "SMALL_FILE", 0)
    assert at_once == list(records.stream(path))
    assert [(line.number, line.offset) for line in at_once if line.record] == [(2, 1), (5, len(
        path.read_bytes()) - len(json.dumps(a_record(2)) + last))]


def test_load_records_bad_middle_line_is_reported_not_as_truncated(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(a_record(1)) + "\n{not json\n" + json.dumps(a_record(3)) + "\n")
    records, problems = load_records(path)
    assert [r["step"] for r in records] == [1, 3]
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:2:")
    assert "invalid JSON" in problems[0] and "truncated" not in problems[0]


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"schema": maps.SCHEMA.name}, "not a gradnan.record document"),
        ({"version": records.SCHEMA.version + 1}, "newer"),
        ({"step": "3"}, "integer 'step'"),
        ({"step": None}, "integer 'step'"),
        ({"rank": 0}, "'rank' object"),
        ({"params": None}, "'params' list"),
        ({"params": {"id": 1}}, "'params' list"),
    ],
)
def test_load_records_invalid_record_is_a_problem_with_line_number(tmp_path, change, expected):
    path = write_records(tmp_path / "r.jsonl", a_record(1), dict(a_record(2), **change), a_record(3))
    records, problems = load_records(path)
    assert [r["step"] for r in records] == [1, 3]
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:2:")
    assert expected in problems[0]
    assert "\n" not in problems[0]


def test_load_records_missing_file_is_read_error(tmp_path):
    path = tmp_path / "none.jsonl"
    with pytest.raises(InputError) as info:
        load_records(path)
    assert_one_line_naming(info.value, path)


# --- read_run ---------------------------------------------------------------------------------


def write_run(run_dir: Path, ranks=(0, 1)) -> Dict[str, Path]:
    """A small two-rank run as the runtime lays it out. Returns the written files by role."""
    written = {}
    for rank in ranks:
        rank_coords = coords(rank, dp=rank, dp_size=len(ranks))
        written[f"map{rank}"] = map_path(str(run_dir), rank_coords, 0)
        write_json_atomic(written[f"map{rank}"], a_map_document(rank_coords))
        written[f"records{rank}"] = records_path(str(run_dir), rank_coords)
        write_records(written[f"records{rank}"], a_record(1, rank_coords), a_record(2, rank_coords))
    return written


def test_read_run_reads_every_map_and_record(tmp_path):
    written = write_run(tmp_path)
    files = read_run(tmp_path)
    assert files.run_dir == tmp_path
    assert files.problems == []
    assert set(files.maps) == {written["map0"], written["map1"]}
    assert files.maps[written["map1"]]["rank"]["global_rank"] == 1
    assert set(files.records) == {written["records0"], written["records1"]}
    assert sorted((r["rank"]["global_rank"], r["step"]) for r in files.all_records()) == [
        (0, 1), (0, 2), (1, 1), (1, 2)
    ]


def test_read_run_accepts_a_string_path(tmp_path):
    write_run(tmp_path, ranks=(0,))
    files = read_run(str(tmp_path))
    assert isinstance(files.run_dir, Path)
    assert len(files.maps) == 1 and len(files.all_records()) == 2


def test_read_run_with_only_records(tmp_path):
    path = write_records(records_path(str(tmp_path), coords(0)), a_record(1))
    files = read_run(tmp_path)
    assert files.maps == {} and files.problems == []
    assert files.records == {path: [a_record(1)]}


def test_read_run_ignores_leftover_temporary_files(tmp_path):
    """A rank killed inside write_json_atomic leaves ``.<name>.XXXX.tmp``; it is not a map."""
    write_run(tmp_path, ranks=(0,))
    write_text(tmp_path / MAPS_DIR / ".rank00001_tp0_pp0_dp0.json.abc123.tmp", '{"sch')
    files = read_run(tmp_path)
    assert files.problems == [] and len(files.maps) == 1


def test_read_run_missing_directory(tmp_path):
    run_dir = tmp_path / "missing"
    with pytest.raises(InputError) as info:
        read_run(run_dir)
    assert "no such directory" in assert_one_line_naming(info.value, run_dir)


def test_read_run_not_a_directory(tmp_path):
    run_dir = write_text(tmp_path / "file.txt", "x")
    with pytest.raises(InputError) as info:
        read_run(run_dir)
    assert "not a directory" in assert_one_line_naming(info.value, run_dir)


@pytest.mark.parametrize("subdirs", [(), (MAPS_DIR, RECORDS_DIR)])
def test_read_run_empty_directory(tmp_path, subdirs):
    for name in subdirs:
        (tmp_path / name).mkdir()
    with pytest.raises(InputError) as info:
        read_run(tmp_path)
    assert "no gradnan maps or records" in assert_one_line_naming(info.value, tmp_path)


def test_read_run_with_a_corrupt_map_returns_the_rest(tmp_path):
    written = write_run(tmp_path)
    written["map1"].write_text('{"schema": "gradnan.map", "params": [')
    files = read_run(tmp_path)
    assert set(files.maps) == {written["map0"]}
    assert len(files.all_records()) == 4
    assert len(files.problems) == 1
    assert str(written["map1"]) in files.problems[0] and "invalid JSON" in files.problems[0]


def test_read_run_collects_problems_from_maps_and_record_lines(tmp_path):
    written = write_run(tmp_path)
    written["map0"].write_text(json.dumps(dict(a_map_document(), version=maps.SCHEMA.version + 1)))
    with open(written["records1"], "a") as stream:
        stream.write('{"schema":"gradnan.rec')
    files = read_run(tmp_path)
    assert set(files.maps) == {written["map1"]}
    assert [r["step"] for r in files.records[written["records1"]]] == [1, 2]
    assert len(files.problems) == 2
    assert any(str(written["map0"]) in p and "newer" in p for p in files.problems)
    assert any(p.startswith(f"{written['records1']}:3:") and "truncated" in p for p in files.problems)


def test_read_run_with_an_unreadable_records_file_returns_the_rest(tmp_path):
    """The module promises that bad files are listed in ``problems`` while good ones are returned;
    that must hold for a records file that is not UTF-8 as it does for a corrupt map."""
    written = write_run(tmp_path)
    written["records1"].write_bytes(b"\xff\xfe garbage\n")
    files = read_run(tmp_path)
    assert len(files.maps) == 2
    assert [r["step"] for r in files.records[written["records0"]]] == [1, 2]
    assert len(files.problems) == 1 and str(written["records1"]) in files.problems[0]


def test_maps_are_readable_by_others(tmp_path):
    """Maps are shared with other users' tools: not the 0600 that mkstemp gives."""
    path = tmp_path / "maps" / "m.json"
    write_json_atomic(path, a_map_document())
    assert os.stat(path).st_mode & 0o777 == 0o644


@pytest.mark.parametrize("field", ["step", "version"])
def test_a_boolean_is_not_an_integer_in_a_record(tmp_path, field):
    record = {**a_record(1), field: True}
    path = write_text(tmp_path / "r.jsonl", json.dumps(record) + "\n")
    records, problems = load_records(path)
    assert records == [] and len(problems) == 1 and field in problems[0]


def test_each_document_kind_is_versioned_on_its_own(tmp_path, monkeypatch):
    """A newer bundle schema is read by a gradnan that knows it while records stay at their version: one
    kind's version is never checked against another's."""
    import dataclasses

    from gradnan.formats import bundle

    manifest = {"schema": "gradnan.bundle", "version": 2, "module": {"path": "m"}, "step": 1,
                "rank": coords(0)}
    path = write_text(tmp_path / "manifest.json", json.dumps(manifest))
    with pytest.raises(InputError, match="gradnan.bundle version 2 is newer than this gradnan reads"):
        bundle.load_manifest(path)
    monkeypatch.setattr(bundle, "SCHEMA", dataclasses.replace(bundle.SCHEMA, version=2))
    assert bundle.load_manifest(path)["version"] == 2
    record_line = write_text(tmp_path / "r.jsonl", json.dumps({**a_record(1), "version": 3}) + "\n")
    assert load_records(record_line)[0] == []  # records are still at version 2


def test_the_readers_dtype_limits_are_torchs():
    """``DTYPE_MAX`` is written out so that readers load no torch: it must stay what torch says."""
    from gradnan.formats.records import DTYPE_MAX

    assert DTYPE_MAX == {str(dtype): torch.finfo(dtype).max
                         for dtype in (torch.float16, torch.bfloat16, torch.float32)}


# --- issue 23: a rejected loss, an fp16 skip's loss ------------------------------------------------

def a_nonfinite_loss_record(**overrides: Any) -> Dict[str, Any]:
    return {**a_record(2), "kind": "nonfinite_loss", "params": [], "params_total": 0, "micro_batch": 0,
            "loss": "nan", "message": "found NaN in local forward loss calculation",
            "megatron_mode": "disabled", "batch": {"path": "/run/batches/x.pt"}, "rerun_skipped": None,
            **overrides}


def test_a_nonfinite_loss_record_is_read_and_a_malformed_one_named():
    assert records.from_json(a_nonfinite_loss_record(), "f:1")["micro_batch"] == 0
    for bad in ({"micro_batch": "0"}, {"loss": [1]}, {"batch": {"path": 3}}, {"rerun_skipped": 5}):
        with pytest.raises(InputError, match="nonfinite_loss"):
            records.from_json(a_nonfinite_loss_record(**bad), "f:1")


def test_a_probe_record_keeps_its_first_probes_and_counts_them_all_written_before_the_count_or_after():
    probe = {"label": "x", "module": None, "nan": 1, "inf": 0, "abs_min": 0.0, "abs_max": "nan"}
    listed = {**a_record(2), "kind": "probe", "params": [], "probes": [probe] * 2000}
    old = records.from_json(json.loads(json.dumps(listed)), "f:1")  # written before probes_total
    assert (len(old["probes"]), old["probes_total"]) == (records.MAX_PROBES, 2000)
    new = records.from_json({**listed, "probes": [probe] * 3, "probes_total": 2000}, "f:1")
    assert (len(new["probes"]), new["probes_total"]) == (3, 2000)
    with pytest.raises(InputError, match="probes_total"):
        records.from_json({**listed, "probes_total": "many"}, "f:1")


def test_an_overflow_records_loss_finite_is_a_boolean_or_null():
    overflow = {**a_record(3), "kind": "loss_scale_overflow", "consecutive_skips": 3}
    for value in (True, False, None):
        assert records.from_json({**overflow, "loss_finite": value}, "f:1")["loss_finite"] is value
    with pytest.raises(InputError, match="loss_finite"):
        records.from_json({**overflow, "loss_finite": "no"}, "f:1")


@pytest.mark.parametrize("index", [5, "0, 5", [0, "5"], list(range(100_000)), [2**70]])
def test_a_state_records_bad_weight_index_is_a_listed_problem_not_a_traceback(tmp_path, index):
    """Issue 47: a state record whose weight has an integer (or huge) ``first_bad_index`` ended in a
    TypeError inside the evidence code; it is now a problem with its file and line, and the report is
    made from the rest."""
    state = {**a_record(2), "kind": "state", "weights_digest": "d", "params_checked": 1,
             "optimizer_state_total": 0, "optimizer_state_checked": 0, "optimizer_state": []}
    state["params"][0].update(copy="model", first_bad_index=index)
    path = tmp_path / RECORDS_DIR / f"{rank_tag(coords(0))}.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(a_record(2)) + "\n" + json.dumps(state) + "\n")
    files = read_run(tmp_path)
    assert [problem.split(": ")[0] for problem in files.problems] == [f"{path}:2"]
    assert "'first_bad_index' null or a list of at most 64 integers" in files.problems[0]
    assert analyze(files).incident is not None


ROW = {"name": "embedding.word_embeddings.weight", "rows": 64, "row": 7, "largest": 1e30, "median": 0.05,
       "every_step": True}


@pytest.mark.parametrize("rows", [[{**ROW, "row": 64}], [{**ROW, "row": -1}], [{**ROW, "largest": [1]}],
                                  [{**ROW, "every_step": "yes"}], [{**ROW, "name": 3}], [ROW] * 65, ROW,
                                  # issue 60: a row no writer lists
                                  [{**ROW, "largest": 1e-9, "median": 1.0}], [{**ROW, "median": 0.0}],
                                  [{**ROW, "name": "decoder.layers.0.mlp.linear_fc1.weight"}],
                                  [{**ROW, "rows": 2**62 + 1, "row": 2**62}]])
def test_a_state_records_outlying_rows_are_checked_at_the_boundary(rows):
    """Issue 48, case 6: a row outside its shard, a largest magnitude that is no number, a list too long:
    one named problem, never a traceback in the evidence code; a well-formed list (every_step absent too)
    is read. Issue 60: a row not out of line (1e-09 under a median of 1), of a weight that holds no
    vocabulary, or of a shard of 2^62 rows is none the writer lists."""
    state = {**a_record(2), "kind": "state", "weights_digest": "d", "params_checked": 1, "params": [],
             "optimizer_state_total": 0, "optimizer_state_checked": 0, "optimizer_state": []}
    assert records.from_json({**state, "outlying_rows": [ROW, {**ROW, "every_step": None}]}, "f:1")
    with pytest.raises(InputError, match="'outlying_rows'"):
        records.from_json({**state, "outlying_rows": rows}, "f:1")


@pytest.mark.parametrize("rank, wrong", [
    (coords(9, world_size=8), "rank.global_rank 9 is outside its group (rank.world_size 8)"),
    (coords(1, tp=2, tp_size=2), "rank.tp 2 is outside its group (rank.tp_size 2)"),
    (coords(0, dp=-1), "rank.dp -1 is outside its group (rank.dp_size 1)"),
])
def test_a_record_of_a_rank_outside_its_world_is_a_listed_problem(tmp_path, rank, wrong):
    """Issue 48 (case 8): a forged state record for rank 9 of 8 took the blame; now it is no record."""
    path = tmp_path / RECORDS_DIR / "forged.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(a_record(2, rank)) + "\n")
    files = read_run(tmp_path)
    assert files.problems == [f"{path}:1: {wrong}"] and not list(files.all_records())


def a_divergence_record(**overrides: Any) -> Dict[str, Any]:
    """A ``replica_divergence`` record as ``Detections.replica_divergence`` writes it."""
    from gradnan.training.replicas import Divergence

    found = Divergence(4, None, 3, 2, (1,), ({"name": "decoder.layers.0.mlp.linear_fc1.weight", "numel": 64,
                                               "flat": 9, "index": [1, 1], "value": 0.5,
                                               "majority_value": 0.25},), 1)
    return {**records.to_json("replica_divergence", 4, None, coords(1, dp=1, dp_size=3), {}, [], 0,
                              found.record_fields(read_at=4)), **overrides}


def test_a_replica_divergence_record_is_read_and_reported_and_a_malformed_one_named(tmp_path):
    assert records.from_json(a_divergence_record(), "f:1")["diverged"][0]["flat"] == 9
    for bad in ({"read_at_step": "4"}, {"agreeing": 1.5}, {"differing_ranks": ["1"]},
                {"differing_ranks": list(range(2000))}, {"diverged": [{"name": 3}]},
                {"diverged": [{"name": "w", "index": "1, 1"}]}, {"diverged": [{"name": "w", "value": [1]}]},
                {"diverged": None}):
        with pytest.raises(InputError, match="replica_divergence"):
            records.from_json(a_divergence_record(**bad), "f:1")
    path = tmp_path / RECORDS_DIR / f"{rank_tag(coords(1, dp=1, dp_size=3))}.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(a_divergence_record()) + "\n"
                    + json.dumps(a_divergence_record(diverged=[{"name": 3}])) + "\n")
    files = read_run(tmp_path)
    assert [problem.split(": ")[0] for problem in files.problems] == [f"{path}:2"]
    incident = analyze(files).incident
    assert incident is not None and incident.verdict.cause.value == "replica_divergence"
    assert "linear_fc1.weight[1, 1] = 0.5 on rank 1 where the majority holds 0.25" in incident.verdict.summary
