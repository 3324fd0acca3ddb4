"""The report of a large job fits one screen, and ``gradnan maps`` reads one rank's table: a synthetic run
directory of 512 ranks (TP=8, PP=8, DP=8), written with the kit's own writers. benchmarks/scale.py shows
4,096 and 16,384 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradnan.cli import main
from gradnan.formats import maps
from gradnan.formats.layout import map_path, rank_ranges, records_path
from gradnan.offline.incident import read
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.module_table import focus_ranks
from gradnan.offline.incident.read import KEPT_PARAMS, map_params, read_run
from gradnan.offline.incident.report import build_report
from gradnan.testing.synthetic import TP, coords_of, write_run_dir

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

WORLD = 512


@pytest.fixture(scope="module")
def large_job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("large")
    origin = write_run_dir(run_dir, WORLD)
    return run_dir, origin, build_report(read_run(run_dir, params=False))


def test_the_text_fits_one_screen_and_starts_with_the_origin(large_job, capsys):
    run_dir, origin, _ = large_job
    assert main(["report", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 60, "\n".join(lines)
    origin_line = next(number for number, line in enumerate(lines) if line.startswith("Origin"))
    assert lines[origin_line + 1].startswith(f"  rank {origin} (tp3 pp7 dp4)")
    dp_size, model_parallel = coords_of(0, WORLD)["dp_size"], WORLD // coords_of(0, WORLD)["dp_size"]
    text = "\n".join(lines)
    assert (f"\n  {dp_size - 1} data-parallel peer(s) of the origin (same tp/pp), holding the NaN/Inf: "
            in text)
    assert f"\n  {model_parallel - 1} model-parallel peer(s) of the origin (same dp replica): " in text
    assert f"\n  {WORLD - dp_size - model_parallel + 1} other rank(s): " in text


def test_json_keeps_every_rank(large_job):
    _, origin, report = large_job
    incident = report["incident"]
    assert [entry["global_rank"] for entry in incident["origin"]] == [origin]
    assert len(incident["receivers"]) == WORLD - 1
    holders = sorted(view["global_rank"] for view in incident["receivers"] if view["holds_nonfinite"])
    assert holders == [rank for rank in range(WORLD)
                       if rank != origin and (rank % TP, coords_of(rank, WORLD)["pp"])
                       == (origin % TP, coords_of(origin, WORLD)["pp"])]


def test_the_origin_parameters_carry_their_dtype_from_the_origin_map(large_job):
    """Read lean (maps without their tables), the origin's map is read back for its parameters' dtype."""
    _, _, report = large_job
    [entry] = report["incident"]["origin"]
    assert {param["dtype"] for param in entry["params"]} == {"torch.bfloat16"}


def test_maps_looks_up_the_reported_parameter(large_job, capsys):
    """What the report sends a user to: ``gradnan maps RUN --rank ORIGIN --id N`` prints that parameter."""
    run_dir, origin, report = large_job
    [offender, *_] = report["incident"]["origin"][0]["params"]
    assert main(["maps", str(run_dir), "--rank", str(origin), "--id", str(offender["id"])]) == 0
    assert capsys.readouterr().out.startswith(f"rank {origin} id {offender['id']}: {offender['name']} ")


def test_maps_of_one_rank_read_one_table(large_job):
    """Choosing a rank sees every map without its table; only the chosen one's table is read."""
    run_dir, origin, _ = large_job
    seen = []
    def wanted(header):
        seen.append(header)
        return header["rank"]["global_rank"] == origin

    chosen, rows = map_params(run_dir, wanted, lambda entry: True)
    assert len(seen) == WORLD and not any("params" in header for header in seen)
    [header] = [header for header in seen if header["rank"]["global_rank"] == origin]
    assert chosen == 1 and len(rows) == header["params_count"] > 0
    assert all(row["rank"] == origin for row in rows)


@pytest.mark.parametrize("ranks, text", [
    ([0, 1, 2, 3, 5], "0-3, 5"),
    ([3, 11, 19, 27, 40], "3-27 every 8, 40"),
    ([7], "7"),
    (list(range(0, 4000, 2)), "0-3998 every 2"),
])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_rank_ranges_are_cut_with_a_count():
    text = rank_ranges(list(range(0, 300, 7)) + list(range(1000, 1100, 3))
                       + [5000, 5002, 7001, 9999, 12345, 13000],
                       max_chars=30)
    assert len(text) <= 50 and text.endswith("in all)")


@pytest.mark.parametrize("kept", [0, 40, KEPT_PARAMS])
def test_the_report_reads_maps_and_records_without_their_lists(large_job, monkeypatch, kept):
    """Lean reading keeps each rank's coordinates and counts, and a record's offenders while ``kept`` entries
    in all are kept; the others are read back on demand, as are the maps of ranks that wrote records. The
    report is the same whichever it is."""
    run_dir, origin, report = large_job
    monkeypatch.setattr(read, "KEPT_PARAMS", kept)
    lean, full = read_run(run_dir, params=False), read_run(run_dir)
    # every rank wrote records: no map is read up front, each only where the report asks for its rank's
    assert not lean.maps and sum(map(len, lean.maps_unread.values())) == WORLD
    lean_maps = dict(lean.maps_of(range(WORLD)))
    assert all("params" not in document for document in lean_maps.values())
    assert [document["params_count"] for document in lean_maps.values()] == [
        len(document["params"]) for document in full.maps.values()]
    # the first stage embeds
    assert {document["params_count"] for document in lean_maps.values()} == {290, 288}
    lean_records, full_records = lean.all_records(), full.all_records()
    inline = sum(len(record["params"]) for record in lean_records if "params" in record)
    assert inline <= kept and (inline > 0) == (kept > 0)
    offenders = sum(len(record["params"]) for record in full_records)
    assert any("params" not in record for record in lean_records) == (kept < offenders)
    assert not any(key.startswith("_") for record in lean_records for key in record)  # no private keys
    assert [lean.full(record) for record in lean_records] == full_records
    assert build_report(lean) == build_report(full) == report


def test_the_text_table_shares_its_columns_between_holders_and_peers(large_job):
    run_dir, origin, _ = large_job
    ranks = focus_ranks(analyze(read_run(run_dir, params=False)).incident, 16)
    position = (coords_of(origin, WORLD)["tp"], coords_of(origin, WORLD)["pp"])
    holders = [rank for rank in ranks
               if (coords_of(rank, WORLD)["tp"], coords_of(rank, WORLD)["pp"]) == position
               and rank != origin]
    peers = [rank for rank in ranks
             if coords_of(rank, WORLD)["dp"] == coords_of(origin, WORLD)["dp"] and rank != origin]
    assert origin in ranks and len(holders) == 7 and len(peers) == 8, (holders, peers)


def test_the_report_reads_only_the_origin_map(large_job, monkeypatch):
    """Every rank wrote records: of 512 maps the report reads the origin's alone (its counts and dtypes)."""
    run_dir, origin, report = large_job
    loaded, load = [], maps.load
    monkeypatch.setattr(maps, "load", lambda path, params=True: loaded.append(path) or load(path, params))
    assert build_report(read_run(run_dir, params=False)) == report
    assert {Path(path).name for path in loaded} == {map_path("", coords_of(origin, WORLD), 0).name}


def test_a_rank_that_wrote_no_records_is_known_by_its_map(tmp_path):
    """A rank that died before its first record: read lean, its map still names it, as read whole."""
    write_run_dir(tmp_path, 8)
    records_path(str(tmp_path), coords_of(5, 8)).unlink()
    lean = build_report(read_run(tmp_path, params=False))
    assert 5 in lean["ranks_seen"] and 5 in [view["global_rank"] for view in lean["incident"]["silent"]]
    assert lean == build_report(read_run(tmp_path))
