"""``gradnan selftest``: the pure pieces, then real gloo worlds on CPU launched like training.

The worlds run the real command (``python -m gradnan selftest``) in separate processes, with the
environment torchrun or srun would give them. They are kept small (1 to 3 ranks, 32x32 matrices, 2
repeats) because the test machine has 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from gradnan.cli import main
from gradnan.errors import InputError, UsageError
from gradnan.selftest.arithmetic import Tally, checksum, flip_lowest_bit, majority, split_plans
from gradnan.selftest.communication import (
    allreduce_expected,
    allreduce_input,
    allreduce_mismatch,
    layout_groups,
)
from gradnan.selftest.options import PERTURB_ENV, STALL_ENV, launch_environment
from gradnan.selftest.result import write_result
from gradnan.selftest.runner import ranks_named_in
from gradnan.testing.gloo import free_port

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

ENTRY = ("-m", "gradnan", "selftest")  # the real command, as a user launches it
SMALL = ("--size", "32", "--repeats", "2")
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                    "SLURM_NTASKS", "SLURM_LOCALID", PERTURB_ENV, STALL_ENV)
STARTUP_SLACK_S = 60  # importing torch in 2-3 processes on 2 busy cores


# ----------------------------------------------------------------------------------------------------
# Pure pieces


def test_majority_is_the_most_common_value_and_none_on_a_tie():
    assert majority(["a", "a", "b"]) == "a"
    assert majority(["a", "b", "b", "c", "d"]) == "b"  # more ranks than any other value
    assert majority(["a"]) == "a"
    assert majority(["a", "b"]) is None
    assert majority(["a", "b", "c"]) is None
    assert majority(["a", "a", "b", "b", "c"]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checksum_changes_when_one_bit_flips(dtype):
    tensor = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    flipped = flip_lowest_bit(tensor)
    assert checksum(tensor) == checksum(tensor.clone())
    assert checksum(flipped) != checksum(tensor)
    assert not torch.equal(flipped, tensor)  # the original is left alone: a copy was flipped
    assert torch.equal(flipped.reshape(-1)[1:], tensor.reshape(-1)[1:])
    int_type = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    difference = flipped.view(int_type).reshape(-1)[0] ^ tensor.view(int_type).reshape(-1)[0]
    assert difference.item() == 1


def test_checksum_tells_apart_values_that_compare_equal():
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))
    one = torch.tensor([1.0])
    assert checksum(one) != checksum(one.to(torch.bfloat16))


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (1, 2, 3), (4, 1, 2), (1, 1, 3), (2, 3, 1)])
def test_layout_groups_follow_megatrons_default_rank_order(tp, pp, dp):
    from megatron.core.parallel_state import RankGenerator

    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    groups = layout_groups(tp * pp * dp, tp, pp)
    for axis in ("tp", "pp", "dp"):
        assert sorted(groups[axis]) == sorted(generator.get_ranks(axis)), axis


def test_layout_groups_refuse_sizes_that_do_not_divide_the_world():
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        layout_groups(4, 3, 1)


def test_allreduce_mismatch_names_the_rank_whose_contribution_arrived_wrong():
    members = [2, 3, 4]
    for dtype in (torch.int64, torch.float32, torch.bfloat16):
        total = sum(allreduce_input(members, rank, dtype) for rank in members)
        assert allreduce_mismatch(total, members, dtype) is None
    total = sum(allreduce_input(members, rank, torch.int64) for rank in members)
    assert int(total.sum()) == sum(member + 1 for member in members)
    total[1] += 1
    message = allreduce_mismatch(total, members, torch.int64)
    assert "rank(s) [3] arrived wrong" in message
    assert str(allreduce_expected(members, torch.int64).tolist()) in message


def test_tally_names_the_outvoted_rank_and_fails_everyone_without_a_majority():
    tally = Tally(3)
    tally.add(["x", "x", "x"])
    tally.add(["x", "y", "x"])
    entry = tally.entry("matmul_fp32")
    assert [row["agrees"] for row in entry["ranks"]] == [True, False, True]
    assert entry["ranks"][1]["first_outvoted"] == 1 and entry["ranks"][1]["checksums"] == {"x": 1, "y": 1}
    assert entry["dtype"] == "float32" and entry["op"] == "matmul" and not entry["pass"]
    tied = Tally(2)
    tied.add(["x", "y"])
    rows = tied.entry("layer_norm_bf16")["ranks"]
    assert [row["agrees"] for row in rows] == [False, False]
    assert all("no majority" in row["detail"] for row in rows)


def test_split_plans_keeps_what_every_rank_can_run_and_says_who_could_not():
    reason = "matmul in fp16 is not supported on cpu: no kernel"
    plans = [(["matmul_fp32", "matmul_fp16"], {}), (["matmul_fp32"], {"matmul_fp16": reason})]
    common, skipped = split_plans(plans)
    assert common == ["matmul_fp32"]
    assert skipped == [{"name": "matmul_fp16", "ranks": [1], "reason": reason}]


def test_ranks_named_in_reads_rank_0s_monitored_barrier_error():
    assert ranks_named_in("[Rank 0]: Ranks 2, 5 failed to pass monitoredBarrier in 5000 ms") == [2, 5]
    assert ranks_named_in("[Rank 0]: Rank 3 failed to pass monitoredBarrier in 5000 ms") == [3]
    assert ranks_named_in("Rank 1 successfully reached monitoredBarrier, but received errors") == []


def test_launch_environment_reads_torchrun_then_srun_variables():
    master = {"MASTER_ADDR": "node-a", "MASTER_PORT": "29500"}
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", **master}
    assert launch_environment(srun) == (5, 8, 1, "node-a", 29500)
    torchrun = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", **srun}
    assert launch_environment(torchrun) == (2, 4, 2, "node-a", 29500)
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        launch_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    with pytest.raises(UsageError, match="neither RANK nor SLURM_PROCID"):
        launch_environment(master)


def test_a_result_never_replaces_an_existing_one_nor_goes_through_a_link(tmp_path):
    import datetime

    started = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    first = write_result(tmp_path, started, {"n": 1})
    first.write_text("earlier result")
    second = write_result(tmp_path, started, {"n": 2})
    assert first == tmp_path / "selftest" / "selftest-20250102T030405Z.json"
    assert second == tmp_path / "selftest" / "selftest-20250102T030405Z-2.json"
    assert first.read_text() == "earlier result" and json.loads(second.read_text()) == {"n": 2}
    elsewhere, linked = tmp_path / "elsewhere", tmp_path / "linked"
    elsewhere.mkdir()
    linked.mkdir()
    (linked / "selftest").symlink_to(elsewhere)
    with pytest.raises(InputError, match="symbolic link"):
        write_result(linked, started, {"n": 3})
    assert not list(elsewhere.iterdir())


def test_the_selftest_package_imports_torch_only_when_it_runs():
    """The command line builds its parser from ``gradnan.selftest``: a fresh interpreter that imports it and
    builds the parser holds no torch module."""
    script = "\n".join(["import argparse, json, sys", "from gradnan import selftest",
                        "selftest.add_arguments(argparse.ArgumentParser())",
                        "print(json.dumps(sorted(name for name in sys.modules"
                        " if name.split('.')[0] == 'torch')))"])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def _run_in_process(argv: List[str], monkeypatch, environ: Dict[str, Optional[str]]) -> int:
    """``gradnan selftest`` in this process as rank 0 of 2 launched by torchrun (a variable set to None is
    unset)."""
    base = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**base, **environ}.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    return main(["selftest", *argv])


@pytest.mark.parametrize("argv,environ,expected", [
    (["--repeats", "0"], {}, "gradnan: error: --repeats must be at least 1, not 0"),
    (["--tp", "0"], {}, "gradnan: error: --tp must be at least 1"),
    (["--tp", "x"], {}, "gradnan selftest: error: argument --tp: invalid int value: 'x'"),
    (["--timeout", "-1"], {}, "gradnan: error: --timeout must be a positive number"),
    (["--seconds", "nan"], {}, "gradnan: error: --seconds must be a positive number"),
    (["--timeout", "1e300"], {}, "gradnan: error: --timeout must be a positive number of seconds up to"),
    (["--seconds", "inf"], {}, "gradnan: error: --seconds must be a positive number of seconds up to"),
    ([], {"RANK": None}, "gradnan: error: not launched by torchrun or srun: neither RANK nor SLURM_PROCID"),
    ([], {PERTURB_ENV: "7"}, f"gradnan: error: {PERTURB_ENV}=7 is not a rank"),
])
def test_bad_arguments_return_2_with_one_line(argv, environ, expected, monkeypatch, capsys, tmp_path):
    assert _run_in_process([*argv, "--out", str(tmp_path / "run")], monkeypatch, environ) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(expected) and out == "", err
    assert not (tmp_path / "run").exists()


def test_an_out_that_is_a_file_is_a_bad_argument(monkeypatch, capsys, tmp_path):
    out = tmp_path / "run"
    out.write_text("not a run directory")
    assert _run_in_process(["--out", str(out)], monkeypatch, {}) == 2
    assert capsys.readouterr().err == f"gradnan: error: --out {out}: {out} is not a directory\n"
    assert out.read_text() == "not a run directory"


# ----------------------------------------------------------------------------------------------------
# Real worlds


def _environment(**variables: str) -> Dict[str, str]:
    environ = {name: value for name, value in os.environ.items()
               if name not in LAUNCH_VARIABLES and not name.startswith("TORCHELASTIC")}
    environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", **variables)
    return environ


def _entry(host: Optional[str]) -> Tuple[str, ...]:
    """The real command, on a machine whose name is ``host`` where one is given."""
    if host is None:
        return ENTRY
    return ("-c", f"import socket, sys; socket.gethostname = lambda: {host!r}; from gradnan.cli import main;"
                  " sys.exit(main())", "selftest")


def _start(world_size: int, ranks: List[int], options: Tuple[str, ...], *, srun: bool = False,
           hosts: Optional[Dict[int, str]] = None, **variables: str) -> Dict[int, subprocess.Popen]:
    """One process per rank in ``ranks`` of a world of ``world_size``, as torchrun (or srun) starts them;
    ``hosts``: the machine names some ranks report."""
    port = str(free_port())
    processes = {}
    for rank in ranks:
        names = (("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if srun
                 else ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        launch = dict(zip(names, (str(rank), str(world_size), str(rank))))
        processes[rank] = subprocess.Popen(
            [sys.executable, *_entry((hosts or {}).get(rank)), *options],
            env=_environment(MASTER_PORT=port, **launch, **variables),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return processes


def _finish(processes: Dict[int, subprocess.Popen], timeout: float = 120,
            ranks: Optional[List[int]] = None) -> Dict[int, Tuple[int, str, str]]:
    """(exit code, stdout, stderr) of the ``ranks`` (default: all); every process is gone afterwards."""
    try:
        results = {}
        for rank in ranks if ranks is not None else sorted(processes):
            out, err = processes[rank].communicate(timeout=timeout)
            results[rank] = (processes[rank].returncode, out, err)
        return results
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()


def _result(out_dir: Path) -> dict:
    [path] = list((out_dir / "selftest").glob("selftest-*.json"))
    document = json.loads(path.read_text())
    assert document["schema"] == "gradnan.selftest" and document["version"] == 1
    return document


def _checks(document: dict, kind: str) -> List[dict]:
    return [check for check in document["checks"] if check["kind"] == kind]


def test_healthy_world_under_torchrun_passes(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "-m", "gradnan", "selftest", *SMALL, "--timeout", "60",
               "--out", str(out)]
    result = subprocess.run(command, env=_environment(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: all 2 rank(s) communicate and agree bitwise on every check" in result.stdout
    document = _result(out)
    assert document["pass"] is True and document["failing_ranks"] == [] and document["unreachable"] is None
    assert [rank["rank"] for rank in document["ranks"]] == [0, 1] and document["layout"] is None
    arithmetic = _checks(document, "arithmetic")
    names = {check["name"] for check in arithmetic}
    assert {"matmul_fp32", "matmul_bf16", "softmax_fp32", "layer_norm_bf16"} <= names
    assert {check["name"] for check in arithmetic} | {skip["name"] for skip in document["skipped"]} == {
        f"{op}_{dtype}" for op in ("matmul", "softmax", "layer_norm") for dtype in ("fp32", "bf16", "fp16")}
    for check in arithmetic:
        assert check["repeats"] == 2 and check["pass"]
        [majority_checksum] = check["majority_checksums"]
        assert [row["checksums"] for row in check["ranks"]] == [{majority_checksum: 2}] * 2
    assert [check["name"] for check in _checks(document, "communication")] == [
        "allreduce_world_int64", "allreduce_world_float32", "allreduce_world_bfloat16"]


def test_layout_groups_are_checked_under_srun_variables(tmp_path):
    out = tmp_path / "run"
    results = _finish(_start(2, [0, 1], (*SMALL, "--tp", "2", "--timeout", "60", "--out", str(out)),
                             srun=True))
    assert [code for code, _, _ in results.values()] == [0, 0], results
    assert "layout tp2 pp1 dp1" in results[0][1] and "PASS" in results[0][1]
    document = _result(out)
    assert document["layout"] == {"tp": 2, "pp": 1, "dp": 1} and document["pass"] is True
    communication = {check["name"]: check for check in _checks(document, "communication")}
    for axis, members in (("world", [[0, 1], [0, 1]]), ("tp", [[0, 1], [0, 1]]), ("pp", [[0], [1]]),
                          ("dp", [[0], [1]])):
        for dtype in ("int64", "float32", "bfloat16"):
            check = communication.pop(f"allreduce_{axis}_{dtype}")
            assert check["pass"] and [row["members"] for row in check["ranks"]] == members, check
    assert communication == {}


def test_perturbed_rank_is_the_only_rank_named(tmp_path):
    out = tmp_path / "run"
    results = _finish(_start(3, [0, 1, 2], (*SMALL, "--timeout", "60", "--out", str(out)),
                             **{PERTURB_ENV: "1"}))
    assert [code for code, _, _ in results.values()] == [1, 1, 1], results
    stdout = results[0][1]
    named = [line for line in stdout.splitlines() if line.startswith("  rank ")]
    assert len(named) == 1 and named[0].startswith("  rank 1 (host ") and "matmul_fp32" in named[0], stdout
    assert "FAIL: 1 of 3 rank(s) named above" in stdout
    document = _result(out)
    assert document["pass"] is False
    assert [(failing["rank"], failing["device"]) for failing in document["failing_ranks"]] == [(1, "cpu")]
    assert document["failing_ranks"][0]["host"] == socket.gethostname()
    failed = [check for check in document["checks"] if not check["pass"]]
    assert [check["name"] for check in failed] == ["matmul_fp32"]
    assert [row["outvoted"] for row in failed[0]["ranks"]] == [0, 2, 0]


def test_rank_that_never_starts_is_named_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    results = _finish(_start(2, [0], (*SMALL, "--timeout", "5", "--out", str(out))))
    elapsed = time.monotonic() - started
    code, stdout, _ = results[0]
    assert code == 1 and elapsed < 5 + STARTUP_SLACK_S
    assert "rank 1 (host unknown): did not reach the rendezvous within 5 s" in stdout, stdout
    document = _result(out)
    assert document["pass"] is False and document["checks"] == []
    assert document["unreachable"]["phase"] == "the rendezvous" and document["unreachable"]["ranks"] == [1]
    assert [(failing["rank"], failing["host"]) for failing in document["failing_ranks"]] == [(1, None)]


def test_rank_that_stops_answering_is_named_by_the_monitored_barrier(tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    processes = _start(2, [0, 1], (*SMALL, "--timeout", "5", "--out", str(out)), **{STALL_ENV: "1"})
    results = _finish(processes, ranks=[0])  # rank 1 sleeps for 10 timeouts; it is killed afterwards
    elapsed = time.monotonic() - started
    code, stdout, _ = results[0]
    assert code == 1 and elapsed < 5 + STARTUP_SLACK_S
    assert "rank 1 (host " in stdout and "did not reach the arithmetic checks within 5 s" in stdout, stdout
    document = _result(out)
    assert document["unreachable"]["ranks"] == [1] and document["pass"] is False
    assert [failing["rank"] for failing in document["failing_ranks"]] == [1]
    assert all(check["pass"] for check in _checks(document, "communication"))


def test_bad_layout_exits_2_with_one_line_and_no_traceback(tmp_path):
    out = tmp_path / "run"
    results = _finish(_start(2, [0], ("--tp", "3", "--out", str(out))), timeout=60)
    code, stdout, stderr = results[0]
    assert code == 2 and stdout == ""
    assert stderr == "gradnan: error: --tp 3 x --pp 1 does not divide the world size 2\n"
    assert not out.exists()


def test_a_host_name_from_another_rank_is_printed_escaped(tmp_path):
    out = tmp_path / "run"
    hostile = "node\x1b]0;owned\x07-1"  # an OSC sequence: printed raw, it would retitle the terminal
    results = _finish(_start(2, [0, 1], (*SMALL, "--timeout", "60", "--out", str(out)), hosts={1: hostile},
                             **{PERTURB_ENV: "1"}))
    assert [code for code, _, _ in results.values()] == [1, 1], results
    stdout = results[0][1]
    assert "rank 1 (host node\\x1b]0;owned\\x07-1, cpu): matmul_fp32: " in stdout, stdout
    assert "\x1b" not in stdout and "\x07" not in stdout
    assert _result(out)["failing_ranks"][1]["host"] == hostile  # the file keeps the name as it was


def test_a_result_that_cannot_be_written_exits_2_after_the_verdict():
    out = "/dev/null/run"  # under a file: no directory can be made there, not even by root
    code, stdout, stderr = _finish(_start(1, [0], (*SMALL, "--timeout", "60", "--out", out)))[0]
    assert code == 2 and "Result:" not in stdout
    assert stdout.splitlines()[-1] == "PASS: all 1 rank(s) communicate and agree bitwise on every check"
    [error] = [line for line in stderr.splitlines() if line.startswith("gradnan")]
    assert error.startswith(f"gradnan: error: --out {out}: cannot write the result: ")
    assert "Not a directory" in error
