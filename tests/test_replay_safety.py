"""Memory-safe replay (issue 24): a bundle made only of allowlisted operators cannot make replay read or
write outside its tensors, exhaust the machine or run without end.

The attacks of the issue (a view past its storage written through with ``fill_`` or read with
``clone``, ``embedding_dense_backward`` with index 10^9, a trace of 10^6 ops, 3,000 large ``mm``, a
zip bomb in ``tensors.pt``) go through the real command (``python -m gradnan replay``) and end in one
line on stderr and exit code 2; the per-operator checks are shown on the in-process function
(``gradnan.offline.replay.trace.replay``: a refused ``TraceError`` naming the op). Each hostile bundle is
written by the project's own writer (``gradnan.formats.bundle.write``) around a hand-written trace.
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from gradnan.errors import InputError
from gradnan.formats import bundle
from gradnan.formats.layout import TENSORS
from gradnan.formats.trace import Trace
from gradnan.formats.trace_ops import REPLAY_ALLOWLIST, TraceError
from gradnan.offline.replay.checks import (
    COMPANION_RULES,
    NO_POSITIONS_READ,
    POSITION_ARGUMENTS,
    POSITION_RULES,
)
from gradnan.offline.replay.limits import DEFAULT_MAX_OPS
from gradnan.offline.replay.trace import replay

from .conftest import UNIT_COORDS

ROOT = Path(__file__).resolve().parent.parent


def op(name: str, *args: Any, out: Any = None, **kwargs: Any) -> Dict[str, Any]:
    """One trace entry; tensors as ``{"t": name}``."""
    return {"op": name, "args": list(args), "kwargs": kwargs, "out": out}


def t(name: str) -> Dict[str, str]:
    return {"t": name}


def trace_document(ops: List[Dict[str, Any]], leaves: Dict[str, torch.Tensor],
                   outputs: Any) -> Dict[str, Any]:
    specs = {name: {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
             for name, tensor in leaves.items()}
    return {"schema": "gradnan.trace", "version": 1, "ops": ops, "outputs": outputs,
            "first_nonfinite": None, "leaves": specs}


def hostile_bundle(path: Path, ops: List[Dict[str, Any]], leaves: Dict[str, torch.Tensor],
                   outputs: Any) -> Path:
    manifest = {"module": {"path": "decoder.linear", "class": "Linear"}, "step": 1, "rank": dict(UNIT_COORDS),
                "run": {"id": None, "attempt": "0", "started": 1.7e9}, "created": 1.7e9, "trigger": "always",
                "outputs": 0, "recompute": False, "trace": trace_document(ops, leaves, outputs),
                "seen": {"outputs_nonfinite": True}}
    return bundle.write(path, manifest, leaves)


def gradnan_replay(path: Path, *options: str) -> subprocess.CompletedProcess:
    """The real command, in its own process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "gradnan", "replay", str(path), "--device", "cpu", *options],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def assert_one_line(result: subprocess.CompletedProcess, *said: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-500:], result.stderr[-2000:])
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("gradnan: error: "), result.stderr
    assert all(text in result.stderr for text in said), result.stderr


# --- the attacks of the issue, through the real command ---------------------------------------

X = {"args.0": torch.ones(4)}
PAST_STORAGE = op("aten._reshape_alias.default", t("args.0"), [2**20], [1], out=t("%0"))
COMMAND_ATTACKS = {
    "view past its storage, then fill_": (
        [PAST_STORAGE, op("aten.fill_.Scalar", t("%0"), 1e30, out=t("%1"))], X, t("%1"),
        "op 0 (aten._reshape_alias.default)"),
    "view past its storage, then clone": (
        [PAST_STORAGE, op("aten.clone.default", t("%0"), out=t("%1"))], X, t("%1"),
        "op 0 (aten._reshape_alias.default)"),
    "embedding_dense_backward, index 10^9, scale_grad_by_freq": (
        [op("aten.embedding_dense_backward.default", t("args.0"), t("args.1"), 10, -1, True, out=t("%0"))],
        {"args.0": torch.ones(1, 4), "args.1": torch.tensor([10**9])}, t("%0"),
        "op 0 (aten.embedding_dense_backward.default): indices holds position 1000000000, outside [0, 10)"),
}


@pytest.mark.parametrize("case", COMMAND_ATTACKS)
def test_the_issues_memory_attacks_end_in_one_line_and_exit_2(tmp_path, case):
    ops, leaves, outputs, said = COMMAND_ATTACKS[case]
    result = gradnan_replay(hostile_bundle(tmp_path / "evil", ops, leaves, outputs))
    assert_one_line(result, said, "refused")


def test_a_trace_longer_than_max_ops_is_refused_before_a_replay_process_starts(tmp_path):
    adds = [op("aten.add.Tensor", t("args.0"), t("args.0"), out=t(f"%{i}"))
            for i in range(DEFAULT_MAX_OPS + 1)]
    path = hostile_bundle(tmp_path / "long", adds, X, t("%0"))
    started = time.monotonic()
    result = gradnan_replay(path)
    assert_one_line(result, f"the trace has {DEFAULT_MAX_OPS + 1} ops, more than the {DEFAULT_MAX_OPS}",
                    "(--max-ops): refused")
    assert time.monotonic() - started < 60


def test_an_endless_trace_is_stopped_by_the_cpu_limit_in_the_child(tmp_path):
    """3,000 mm of 2048 x 2048 (about 50 TFLOP): the child is killed by SIGXCPU after 1 s of CPU."""
    leaves = {"args.0": torch.ones(2048, 2048), "param.0": torch.ones(2048, 2048)}
    ops = [op("aten.mm.default", t("args.0"), t("param.0"), out=t(f"%{i}")) for i in range(3000)]
    started = time.monotonic()
    result = gradnan_replay(hostile_bundle(tmp_path / "endless", ops, leaves, t("%0")),
                            "--max-cpu-seconds", "1")
    assert_one_line(result, "ran past its CPU-time limit of 1 s (--max-cpu-seconds): stopped")
    assert time.monotonic() - started < 120


def test_an_allocation_bomb_hits_the_memory_limit_in_the_child(tmp_path):
    """Twenty 1 GiB tensors, kept: the child's address space ends at 2 GiB beyond torch's own."""
    zeros = [op("aten.zeros.default", [2**28], out=t(f"%{i}"), dtype={"dtype": "float32"},
                device={"device": "cpu"}) for i in range(20)]
    result = gradnan_replay(hostile_bundle(tmp_path / "bomb", zeros, X, [t(f"%{i}") for i in range(20)]),
                            "--max-memory", "2G")
    assert_one_line(result, "cannot replay")
    assert "allocate" in result.stderr or "memory" in result.stderr, result.stderr


def zip_bomb(path: Path, inflated: int = 1 << 30) -> Path:
    """``path``'s own tensors.pt rewritten with its first data member replaced by ``inflated`` bytes of
    zeros, deflated (about 5 MB)."""
    original = zipfile.ZipFile(io.BytesIO((path / TENSORS).read_bytes()))
    chunk = bytes(64 << 20)
    with zipfile.ZipFile(path / TENSORS, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for member in original.infolist():
            if not member.filename.endswith("/data/0"):
                archive.writestr(member.filename, original.read(member))
                continue
            with archive.open(member.filename, "w", force_zip64=True) as stream:
                for _ in range(inflated // len(chunk)):
                    stream.write(chunk)
    return path


def test_a_zip_bomb_in_tensors_pt_is_refused_before_it_is_inflated(tmp_path, crafted_bundle):
    path = zip_bomb(crafted_bundle(tmp_path / "bomb", "healthy"))
    size = (path / TENSORS).stat().st_size
    assert size < 8 << 20 and sum(m.file_size for m in zipfile.ZipFile(path / TENSORS).infolist()) > 1 << 30
    started = time.monotonic()
    with pytest.raises(InputError, match=r"declare \d{10} bytes uncompressed, more than the file's \d{7}"):
        bundle.load(path)
    assert time.monotonic() - started < 1.0  # inflating 1 GiB through torch.load takes about 20 s
    assert_one_line(gradnan_replay(path), "more than the file's", "refused")


# --- every check, on the in-process function --------------------------------------------------

LONG = torch.tensor([10**9])
CHECKED = {
    "_reshape_alias past its storage": ([op("aten._reshape_alias.default", t("a"), [64], [1], out=t("%0"))],
                                        {"a": torch.ones(4)}, "reaches elements 0 to 63 of a storage of 4"),
    "_reshape_alias of an offset view": (
        [op("aten.slice.Tensor", t("a"), 0, 2, 4, out=t("%0")),
         op("aten._reshape_alias.default", t("%0"), [3], [1], out=t("%1"))],
        {"a": torch.ones(4)}, "reaches elements 2 to 4 of a storage of 4"),
    "embedding_dense_backward 10^9": ([op("aten.embedding_dense_backward.default", t("g"), t("i"), 10, -1,
                                          False, out=t("%0"))], {"g": torch.ones(1, 4), "i": LONG},
                                      "outside [0, 10)"),
    "embedding_dense_backward -5": (
        [op("aten.embedding_dense_backward.default", t("g"), t("i"), 10, -1, False, out=t("%0"))],
        {"g": torch.ones(1, 4), "i": torch.tensor([-5])}, "position -5, outside [0, 10)"),
    "embedding_backward 10^9": ([op("aten.embedding_backward.default", t("g"), t("i"), 10, -1, True, False,
                                    out=t("%0"))], {"g": torch.ones(1, 4), "i": LONG}, "outside [0, 10)"),
    "embedding 10^9": ([op("aten.embedding.default", t("w"), t("i"), out=t("%0"))],
                       {"w": torch.ones(10, 4), "i": LONG}, "outside [0, 10)"),
    "gather": ([op("aten.gather.default", t("a"), 0, t("i"), out=t("%0"))], {"a": torch.ones(10), "i": LONG},
               "outside [0, 10)"),
    "scatter_add_": ([op("aten.scatter_add_.default", t("a"), 0, t("i"), t("s"), out=t("a"))],
                     {"a": torch.ones(10), "i": LONG, "s": torch.ones(1)}, "outside [0, 10)"),
    "index_select": ([op("aten.index_select.default", t("a"), 0, t("i"), out=t("%0"))],
                     {"a": torch.ones(10), "i": LONG}, "outside [0, 10)"),
    "index, negative past the start": ([op("aten.index.Tensor", t("a"), [t("i")], out=t("%0"))],
                                       {"a": torch.ones(10), "i": torch.tensor([-11])}, "outside [-10, 10)"),
    "_unsafe_index": ([op("aten._unsafe_index.Tensor", t("a"), [None, t("i")], out=t("%0"))],
                      {"a": torch.ones(2, 10), "i": LONG}, "indices[1] holds position 1000000000"),
    "index_put_": ([op("aten.index_put_.default", t("a"), [t("i")], t("v"), out=t("a"))],
                   {"a": torch.ones(10), "i": LONG, "v": torch.ones(1)}, "outside [-10, 10)"),
    "nll_loss target": ([op("aten.nll_loss_forward.default", t("a"), t("i"), None, 1, -100, out=t("%0"))],
                        {"a": torch.ones(1, 3), "i": LONG}, "target holds position"),
    "layer norm backward, one mean for 1000 rows": (
        [op("aten.native_layer_norm_backward.default", t("g"), t("x"), [8], t("m"), t("m"), None, None,
            [True, False, False], out={"tuple": [t("%0"), t("%1"), t("%2")]})],
        {"g": torch.ones(1000, 8), "x": torch.ones(1000, 8), "m": torch.ones(1)}, "mean has 1 elements"),
    "batch norm, one running mean for 1000 channels": (
        [op("aten.native_batch_norm.default", t("x"), None, None, t("m"), t("m"), True, 0.1, 1e-5,
            out={"tuple": [t("%0"), t("%1"), t("%2")]})],
        {"x": torch.ones(4, 1000), "m": torch.ones(1)}, "running_mean has 1 elements"),
    "log_softmax backward, output smaller than the gradient": (
        [op("aten._log_softmax_backward_data.default", t("g"), t("o"), 1, {"dtype": "float32"}, out=t("%0"))],
        {"g": torch.ones(1000, 8), "o": torch.ones(1)}, "output is [1]"),
}


@pytest.mark.parametrize("case", CHECKED)
def test_each_check_refuses_before_the_op_runs(case):
    ops, leaves, said = CHECKED[case]
    trace = Trace.from_json(trace_document(ops, leaves, ops[-1]["out"]), leaves)
    with pytest.raises(TraceError, match=r"^op \d+ \(aten\.") as refused:
        replay(trace)
    assert said in str(refused.value) and "refused" in str(refused.value) and "\n" not in str(refused.value)


def test_in_range_indices_and_legal_views_still_replay():
    leaves = {"a": torch.arange(10.0), "i": torch.tensor([0, 9, -10])}
    ops = [op("aten.index.Tensor", t("a"), [t("i")], out=t("%0")),
           op("aten.as_strided.default", t("a"), [5], [2], 0, out=t("%1")),
           op("aten.nll_loss_forward.default", t("%2"), t("%3"), None, 1, -100,
              out={"tuple": [t("%4"), t("%5")]})]
    ops[2:2] = [op("aten.view.default", t("a"), [2, 5], out=t("%2")),
                op("aten.new_full.default", t("i"), [2], -100, out=t("%3"))]
    result = replay(Trace.from_json(trace_document(ops, leaves, [t("%0"), t("%1")]), leaves))
    assert result.outputs[0].tolist() == [0.0, 9.0, 0.0] and result.outputs[1].tolist() == [0, 2, 4, 6, 8]


def test_the_backward_is_counted_and_checked_against_max_ops():
    leaves = {"args.0": torch.full((4,), 2.0)}
    ops = [op("aten.mul.Tensor", t("args.0" if i == 0 else f"%{i - 1}"), t("args.0"), out=t(f"%{i}"))
           for i in range(10)]
    trace = Trace.from_json(trace_document(ops, leaves, t("%9")), leaves)
    assert replay(trace, grad_outputs=torch.ones(4), max_ops=100).grads["args.0"] is not None
    with pytest.raises(TraceError, match=r"^backward op 10 \(aten\.\w+\.\w+\): the backward runs more than"
                                         r" the 10 ops a replay allows \(--max-ops\): refused$"):
        replay(trace, grad_outputs=torch.ones(4), max_ops=10)
    with pytest.raises(TraceError, match="the trace has 10 ops, more than the 9"):
        replay(trace, max_ops=9)


def test_every_allowlisted_operator_reading_positions_has_a_rule():
    """An operator added to the allowlist with an index argument fails here until it has a check."""
    missing = []
    for packet in sorted(REPLAY_ALLOWLIST - NO_POSITIONS_READ):
        family = getattr(torch.ops.aten, packet)
        for overload in family.overloads():
            arguments = getattr(family, overload)._schema.arguments
            if any(argument.name in POSITION_ARGUMENTS and "Tensor" in str(argument.type)
                   and not argument.is_out for argument in arguments) and packet not in POSITION_RULES:
                missing.append(f"{packet}.{overload}")
    assert not missing, missing
    assert not set(COMPANION_RULES) - REPLAY_ALLOWLIST


def test_limit_options_are_checked_and_documented(tmp_path):
    result = gradnan_replay(tmp_path, "--max-memory", "lots")
    assert result.returncode == 2 and result.stderr == (
        "gradnan replay: error: argument --max-memory: not a size (bytes, or a number with K, M, G or T):"
        " 'lots'\n")
    page = (ROOT / "docs" / "cli.md").read_text()
    assert all(option in page for option in ("--max-memory", "--max-cpu-seconds", "--max-ops"))

