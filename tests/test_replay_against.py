"""Issue 41: which change broke numerics. One real bundle (the tiny Megatron GPT's MLP, bf16, with the
digests of every op's outputs) replayed with ``gradnan replay --against PYTHON`` under real virtual
environments made in ``tmp_path``: this project's interpreter, and second ones that see the same packages
but load a ``torch.library`` registration changing ``aten::gelu`` on the CPU (a kernel regression: its
result scaled by 1 + 2^-6; made Inf for large inputs; or computed in bf16 throughout instead of in float32,
a different dtype path). The comparison names ``aten.gelu.default`` and nothing before it.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradnan.formats import bundle as bundle_format
from gradnan.formats.layout import MANIFEST
from gradnan.offline.replay.comparison import format_comparison

from .test_replay_safety import X, hostile_bundle, op, t

pytestmark = pytest.mark.slow  # real subprocesses and a real Megatron capture

ROOT = Path(__file__).resolve().parent.parent
GELU = 6  # the index of aten.gelu.default in the MLP's trace
KERNEL = '''
import torch
_library = torch.library.Library("aten", "IMPL")
def _gelu(x, approximate="none"):
    {body}
_library.impl("gelu", _gelu, "CPU")
'''
SCALED = KERNEL.format(body="return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476)) * (1 + 2 ** -6)")
INFINITE = KERNEL.format(body="y = x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))\n"
                              "    return torch.where(x > 0.3, float('inf'), y)")
# the same formula in the input's own dtype (bf16 here): each step rounded, where torch computes in float32
IN_BF16 = KERNEL.format(body="return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))")


def gradnan_replay(bundle: Path, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gradnan", "replay", str(bundle), "--device", "cpu", *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def compared(bundle: Path, *options: str) -> dict:
    result = gradnan_replay(bundle, "--json", *options)
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads(result.stdout)
    assert document["schema"] == "gradnan.comparison" and document["version"] == 1
    return document


def differences(document: dict) -> dict:
    return {f"{pair['left']} vs {pair['right']}": (pair["first_difference"] or {}).get("index")
            for pair in document["pairs"]}


def test_the_bundle_holds_a_digest_of_every_ops_outputs(mlp_bundle):
    trace = bundle_format.load_manifest(mlp_bundle / MANIFEST)["trace"]
    assert trace["version"] == 4 and len(trace["digests"]) == len(trace["ops"])
    assert trace["ops"][GELU]["op"] == "aten.gelu.default"
    assert trace["digests"][GELU][0]["dtype"] == "bfloat16" and trace["digests"][GELU][0]["nonfinite"] == 0


def test_a_kernel_regression_in_one_operator_is_named_and_nothing_before_it(mlp_bundle, python_environment):
    regressed = python_environment("regressed", SCALED)
    document = compared(mlp_bundle, "--against", sys.executable, "--against", str(regressed))
    assert differences(document) == {"capture vs A": None, "capture vs B": GELU, "A vs B": GELU}
    assert document["first_difference"] == {"index": GELU, "op": "aten.gelu.default",
                                            "pairs": ["capture vs B", "A vs B"]}
    names = [environment["name"] for environment in document["environments"]]
    assert names == ["capture", "A", "B"] and document["environments"][2]["python"] == str(regressed)
    versions = [environment["versions"] for environment in document["environments"]]
    assert versions[2]["torch"] == versions[1]["torch"]  # one torch: only the kernel differs
    operators = document["operators"]
    assert all(op["digests"]["capture"] == op["digests"]["A"] == op["digests"]["B"]
               for op in operators[:GELU])
    assert operators[GELU]["digests"]["B"][0]["abs_max"] > operators[GELU]["digests"]["A"][0]["abs_max"]
    text = format_comparison(document)
    assert ("First operator that differs: op #6 aten.gelu.default (capture vs B, A vs B); nothing before"
            in text)
    assert "capture vs A: no operator differs" in text
    gelu_row = next(line for line in text.splitlines() if line.lstrip().startswith("6  aten.gelu.default"))
    assert gelu_row.count("*") == 1  # B differs from the capture; A does not


def test_an_operator_made_non_finite_is_the_first_non_finite_in_that_environment_only(mlp_bundle,
                                                                                      python_environment):
    broken = python_environment("broken", INFINITE)
    document = compared(mlp_bundle, "--against", str(broken), "--ulps", "1")
    capture, replayed = document["environments"]
    assert capture["first_nonfinite"] is None
    assert replayed["first_nonfinite"] == {"index": GELU, "op": "aten.gelu.default", "phase": "forward"}
    assert replayed["verdict"] == "bad_operator_or_input"
    difference = document["pairs"][0]["first_difference"]
    assert difference["index"] == GELU and "non-finite against" in difference["why"]
    text = format_comparison(document)
    assert "First non-finite: capture none; A op #6 aten.gelu.default (forward)" in text


def test_a_different_dtype_path_differs_bitwise_and_within_one_ulp_it_does_not(mlp_bundle,
                                                                               python_environment):
    in_bf16 = python_environment("in_bf16", IN_BF16)
    bitwise = compared(mlp_bundle, "--against", str(in_bf16))
    assert differences(bitwise) == {"capture vs A": GELU}
    assert bitwise["pairs"][0]["first_difference"]["why"] == "output 0: its bytes differ"
    within = compared(mlp_bundle, "--against", str(in_bf16), "--ulps", "1")
    assert differences(within) == {"capture vs A": None} and within["tolerance"] == {"ulps": 1}
    # the same tolerance still tells the scaled kernel (2 ulps of bf16 everywhere) from the capture
    scaled = compared(mlp_bundle, "--against", str(python_environment("scaled", SCALED)), "--ulps", "1")
    assert differences(scaled) == {"capture vs A": GELU}


def test_a_bundle_without_digests_compares_two_environments_only(mlp_bundle, python_environment,
                                                                  tmp_path):
    old = tmp_path / "old_bundle"
    shutil.copytree(mlp_bundle, old)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["trace"]["digests"]
    manifest["trace"]["version"] = 1
    (old / MANIFEST).write_text(json.dumps(manifest))
    regressed = python_environment("regressed", SCALED)
    document = compared(old, "--against", sys.executable, "--against", str(regressed))
    assert not document["capture_has_digests"] and document["columns"] == ["A", "B"]
    assert differences(document) == {"A vs B": GELU}
    assert "no digests in this bundle" in format_comparison(document)


@pytest.mark.parametrize("options, said", [
    (["--against", "/nonexistent/python"], "argument --against: not an executable file"),
    (["--against", "/bin/true"], "cannot replay under /bin/true: the replay process ended with exit code 0"),
    (["--ulps", "2"], "--ulps compares replays: give it with --against PYTHON"),
    (["--against", sys.executable, "--ulps", "-1"], "argument --ulps: must be a whole number"),
    (["--against", sys.executable, "--ulps", "x"], "argument --ulps: must be a whole number"),
    (["--against", sys.executable, "--device", "tpu"], "--device 'tpu': replay runs on cpu, cuda or cuda:N"),
    (["--against", sys.executable] * 9, "--against: at most 8 environments"),
])
def test_bad_options_and_interpreters_are_one_line_and_exit_2(mlp_bundle, options, said):
    result = subprocess.run([sys.executable, "-m", "gradnan", "replay", str(mlp_bundle), *options],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == "", (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and said in result.stderr, result.stderr


def test_an_interpreter_without_torch_is_one_line_naming_what_it_lacks(mlp_bundle, python_environment,
                                                                       tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    result = gradnan_replay(mlp_bundle, "--against", str(bare / "bin" / "python"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "No module named 'torch'" in result.stderr and "Traceback" not in result.stderr


def test_the_replay_limits_hold_in_the_other_interpreters_child(tmp_path):
    """The hostile bundles of tests/test_replay_safety.py, replayed with --against: the child started from
    that interpreter sets the same limits on itself (CPU time, address space) and ends in one line."""
    import torch

    leaves = {"args.0": torch.ones(2048, 2048), "param.0": torch.ones(2048, 2048)}
    endless = [op("aten.mm.default", t("args.0"), t("param.0"), out=t(f"%{i}")) for i in range(3000)]
    result = gradnan_replay(hostile_bundle(tmp_path / "endless", endless, leaves, t("%0")),
                            "--against", sys.executable, "--max-cpu-seconds", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"cannot replay under {sys.executable}: it ran past its CPU-time limit of 1 s" in result.stderr
    zeros = [op("aten.zeros.default", [2**28], out=t(f"%{i}"), dtype={"dtype": "float32"},
                device={"device": "cpu"}) for i in range(20)]
    result = gradnan_replay(hostile_bundle(tmp_path / "bomb", zeros, X, [t(f"%{i}") for i in range(20)]),
                            "--against", sys.executable, "--max-memory", "2G")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "allocate" in result.stderr or "memory" in result.stderr, result.stderr


SOFTMAX_SCALED = '''
import torch
_library = torch.library.Library("aten", "IMPL")
def _softmax(x, dim, half_to_float):
    e = (x - x.amax(dim, keepdim=True)).exp()
    return e / e.sum(dim, keepdim=True) * (1 + 2 ** -6)
_library.impl("_softmax", _softmax, "CPU")
'''


def test_a_fused_kernel_is_compared_with_each_environments_reference_math(tmp_path, monkeypatch,
                                                                          python_environment):
    """megatron-core's ScaledSoftmax behind the numpy stand-in of tests/test_fused.py: at its boundary its
    output is the saved one everywhere; against the reference math (softmax in fp16) this stack's agrees
    within 2 ulps and the one whose aten::_softmax is scaled by 1 + 2^-6 (16 ulps of fp16) does not."""
    import torch

    from .test_fused import _large_scores_module, capture_bundle, softmax_extension

    monkeypatch.setitem(sys.modules, "scaled_softmax_cuda", softmax_extension(True, "float32"))
    scores = torch.linspace(-0.05, 0.05, 32).view(4, 8).to(torch.float16)
    written, call = capture_bundle(tmp_path / "bundle", _large_scores_module(), scores)
    kernel = next(index for index, op in enumerate(call.trace.ops) if "fused" in op)
    document = compared(written, "--against", sys.executable, "--against",
                        str(python_environment("softmax", SOFTMAX_SCALED)), "--ulps", "2")
    assert document["first_difference"] is None  # the kernel's own output is the saved one in both
    [fused] = document["fused"]
    assert fused["index"] == kernel and fused["class"] == "ScaledSoftmax"
    assert fused["against_reference"]["A"] == {"reference": True, "difference": None}
    assert fused["against_reference"]["B"]["reference"]
    assert "more than 2 ulps of float16 apart" in fused["against_reference"]["B"]["difference"]
    text = format_comparison(document)
    assert f"  op #{kernel} ScaledSoftmax: A the same; B output 0: abs_" in text


# --- attention and whole layers captured on their first call (issue 50) -----------------------------

FIRST_CALL_MODULES = {"attention": "decoder.layers.0.self_attention", "layer": "decoder.layers.0"}
# megatron-core's get_global_memory_buffer().get_tensor() on its first call: torch.empty, then [0:n].view()
BUFFER_OPS = ["aten.empty.memory_format", "aten.slice.Tensor", "aten.view.default"]


@pytest.fixture(scope="module")
def first_call_bundles(tmp_path_factory):
    """Layer 0's self-attention (megatron-core's local DotProductAttention) and the whole layer 0 of the
    tiny GPT, bf16, each captured at step 1 in a job of its own: the first attention call of the job, whose
    memory buffer is made by ``torch.empty`` inside the captured call."""
    from gradnan.testing.toy import launch_many
    from gradnan.testing.toy_job import TinyGPTJob

    out = tmp_path_factory.mktemp("first_call")
    launch_many([TinyGPTJob(world_size=1, dtype="bf16", steps=1, quiet=True,
                            gradnan={"out_dir": str(out / name), "capture_modules": module,
                                     "capture_steps": "1"})
                 for name, module in FIRST_CALL_MODULES.items()])
    return {name: next((out / name / "bundles").glob("*/*")) for name in FIRST_CALL_MODULES}


def trace_of(bundle: Path) -> dict:
    return bundle_format.load_manifest(bundle / MANIFEST)["trace"]


def buffer_indices(trace: dict) -> list:
    """Where the trace makes the memory buffer and views it (``BUFFER_OPS``, one after the other); none
    where the buffer was made before the call (a leaf then)."""
    names = [op["op"] for op in trace["ops"]]
    if BUFFER_OPS[0] not in names:
        return []
    start = names.index(BUFFER_OPS[0])
    assert names[start:start + len(BUFFER_OPS)] == BUFFER_OPS
    return list(range(start, start + len(BUFFER_OPS)))


@pytest.mark.parametrize("which", sorted(FIRST_CALL_MODULES))
def test_against_the_capturing_interpreter_nothing_differs_whatever_the_allocator_held(first_call_bundles,
                                                                                        which):
    bundle = first_call_bundles[which]
    buffer = buffer_indices(trace_of(bundle))
    for options in ([], ["--ulps", "1000"]):
        document = compared(bundle, "--against", sys.executable, *options)
        assert document["first_difference"] is None, document["pairs"]
        assert [op["index"] for op in document["operators"] if op["uninitialized"]] == buffer
        empty = document["operators"][buffer[0]]["digests"]
        assert empty["capture"] != empty["A"]  # garbage at capture, NaN at replay: not compared
        text = format_comparison(document)
        assert "No operator differs" in text and "Not compared: #" in text and "*" not in text
        assert document["environments"][1]["verdict"] == "healthy"


def _changeable(digests: list) -> bool:
    """Outputs that the change alters: a floating one with a finite non-zero element, any other element."""
    return any(item["abs_max"] if item["dtype"] in ("bfloat16", "float16", "float32", "float64")
               else math.prod(item["shape"]) > 0 for item in digests)


def expected_first(trace: dict, operator: str, uninitialized: list) -> object:
    """The first call of ``operator`` whose outputs are compared and which a change alters; None where no
    call is (``empty`` and the views of the buffer; an operator returning no tensor)."""
    return next((index for index, (op, digests) in enumerate(zip(trace["ops"], trace["digests"]))
                 if op["op"] == operator and index not in uninitialized and _changeable(digests)), None)


def overflowed_operators(bundle: Path) -> frozenset:
    """The operators of the bundle's trace none of whose calls outputs a finite non-zero element: a change
    to them cannot show. How far an overflow spreads (a softmax of Inf scores is NaN everywhere) depends on
    the CPU's kernels, so a test names them from the trace, not by hand."""
    trace = trace_of(bundle)
    uninitialized = buffer_indices(trace)
    return frozenset(op["op"] for op in trace["ops"]
                     if expected_first(trace, op["op"], uninitialized) is None)


def assert_each_operator_changed_alone_is_the_first_difference(bundle: Path, changed,
                                                              unseen: frozenset = frozenset()) -> None:
    """For every distinct operator the bundle's trace calls, an environment changing only that operator
    (``changed``): its first difference against the capture is that operator's first call whose outputs
    are compared and which the change alters (``expected_first``), nothing before it; the environment is
    shown by the wrapper given and the interpreter that ran. No call of an operator can show the change
    only for the buffer's, ``_local_scalar_dense`` (no tensor) and ``unseen``."""
    trace = trace_of(bundle)
    uninitialized = buffer_indices(trace)
    operators = sorted({op["op"] for op in trace["ops"]})
    found = {}
    for start in range(0, len(operators), 8):  # at most 8 environments in one comparison
        group = operators[start:start + 8]
        document = compared(bundle, *[word for operator in group
                                      for word in ("--against", str(changed(operator)))])
        assert [op["index"] for op in document["operators"] if op["uninitialized"]] == uninitialized
        for operator, pair, environment in zip(group, document["pairs"], document["environments"][1:]):
            assert environment["given"] == str(changed(operator)) != environment["python"]  # a wrapper
            found[operator] = (pair["first_difference"] or {}).get("index")
    expected = {operator: expected_first(trace, operator, uninitialized) for operator in operators}
    assert found == expected
    assert {operator for operator, index in expected.items() if index is None} <= {
        *BUFFER_OPS[:2], "aten._local_scalar_dense.default", *unseen}


def test_each_operator_changed_alone_is_the_first_difference_and_nothing_before_it(first_call_bundles,
                                                                                    changed):
    """The layer's bundle: its trace calls every operator the attention's does (the layer holds the
    attention), each changed alone in its own interpreter (a minute of CI: the attention's adds no
    operator)."""
    trace = trace_of(first_call_bundles["layer"])
    assert {op["op"] for op in trace_of(first_call_bundles["attention"])["ops"]} <= {
        op["op"] for op in trace["ops"]}
    assert_each_operator_changed_alone_is_the_first_difference(first_call_bundles["layer"], changed)


def test_a_venv_python_given_through_a_link_runs_in_its_venv_and_both_paths_are_shown(mlp_bundle,
                                                                                        python_environment,
                                                                                        tmp_path):
    """Python finds its virtual environment beside the path it was started by: started through a link from
    elsewhere it runs as the base interpreter, without the environment's packages (here: without its
    changed gelu). The comparison runs it by the link's target inside the environment."""
    regressed = python_environment("regressed", SCALED)
    link = tmp_path / "bin" / "new-stack"
    link.parent.mkdir()
    link.symlink_to(regressed)
    document = compared(mlp_bundle, "--against", str(link))
    assert differences(document) == {"capture vs A": GELU}
    environment = document["environments"][1]
    assert environment["given"] == str(link) and environment["python"] == str(regressed)
    assert environment["machine"]["cpu"] and environment["machine"]["gpu"] is None
    text = format_comparison(document)
    assert f"  A: {link}, ran {regressed} (torch " in text
    assert f"; CPU {environment['machine']['cpu']}); verdict healthy" in text


def test_what_the_other_interpreter_says_on_stderr_is_shown_even_when_it_replays(mlp_bundle,
                                                                                  python_environment):
    """A broken ``sitecustomize`` does not stop Python: it says so on stderr and goes on. The comparison
    shows it, rather than passing the environment as an identical stack."""
    broken = python_environment("broken")
    site = next(broken.parent.parent.glob("lib/python*/site-packages"))
    (site / "sitecustomize.py").write_text("import no_such_module_of_this_stack\n")
    document = compared(mlp_bundle, "--against", str(broken))
    assert document["first_difference"] is None
    assert "Error in sitecustomize" in document["environments"][1]["stderr"]
    text = format_comparison(document)
    assert "    its stderr said (" in text and "      Error in sitecustomize" in text
    quiet = compared(mlp_bundle, "--against", sys.executable)
    assert quiet["environments"][1]["stderr"] == "" and "its stderr said" not in format_comparison(quiet)


def _ended(pid: int) -> bool:
    """No such process, or a zombie left for init to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_at_the_wall_clock_limit_what_the_child_started_ends_with_it(tmp_path, monkeypatch):
    """An ``--against`` interpreter (here a script) that starts a process of its own and then waits past
    the limit: the child's whole process group is ended, the grandchild with it."""
    from gradnan.errors import InputError
    from gradnan.offline.replay.isolation import replay_under
    from gradnan.offline.replay.limits import ReplayLimits

    monkeypatch.setattr(ReplayLimits, "wall_seconds", property(lambda self: 2))
    started = tmp_path / "grandchild.pid"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {started}\nexec sleep 300\n")
    script.chmod(0o755)
    bundle = hostile_bundle(tmp_path / "bundle", [op("aten.neg.default", t("args.0"), out=t("%0"))], X,
                            t("%0"))
    with pytest.raises(InputError, match="ran past 2 s of wall-clock time"):
        replay_under(str(script), bundle, "cpu", ReplayLimits(max_memory=1 << 30))
    grandchild = int(started.read_text())
    deadline = time.monotonic() + 10
    while not _ended(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ended(grandchild)
