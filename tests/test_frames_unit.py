"""Frame tracing and probes at unit level, on plain torch modules (the Megatron scenarios are in
test_frames.py): naming, one host read per step, weights measured once, recompute not doubled, the ring
across steps, the forward origin, probes' enclosing module, and the flush at exit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gradnan.patches.module_hooks import ModuleHooks
from gradnan.testing.measure import HostSyncCounter
from gradnan.training import frames as frames_module
from gradnan.training.frames import FrameBuffer, FrameTracer, forward_origin, named_entries, read_pairs
from gradnan.training.probe import Probes, enclosing_module


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x, scale=None):
        hidden = self.fc1(x)
        if scale is not None:
            hidden = hidden * scale
        return self.fc2(torch.relu(hidden)), hidden


def tracer_for(model, active=lambda: True, step=1):
    modules = [(name, module) for name, module in model.named_modules()]
    return FrameTracer(modules, lambda: step, active, ModuleHooks()).attach()


def test_entries_are_named_as_debug_underflow_overflow_names_them_plus_kwargs():
    tensor = torch.ones(1)
    names = [(name, kind) for name, kind, _ in named_entries(
        (tensor, [tensor, {"k": tensor}], 3), {"mask": tensor, "none": None}, (tensor, (tensor, tensor)))]
    assert names == [("input[0]", "input"), ("input[1][0]", "input"), ("input[1][1].k", "input"),
                     ("kwargs.mask", "input"), ("output[0]", "output"), ("output[1][0]", "output"),
                     ("output[1][1]", "output")]


def test_a_step_costs_one_host_read_and_values_match_the_tensors():
    torch.manual_seed(0)
    model = Block()
    tracer = tracer_for(model)
    x = torch.randn(3, 4)
    with HostSyncCounter() as during:
        model(x, scale=torch.tensor(2.0))
    with HostSyncCounter() as reading:
        frames = tracer.read()
    assert during.total == 0 and reading.total == 1
    assert [f.step for f in frames] == [1, 1, 1] and [f.module for f in frames] == ["fc1", "fc2", ""]
    root = frames[-1]
    assert root.names == ["input[0]", "kwargs.scale", "output[0]", "output[1]"]
    assert root.values[0] == pytest.approx((x.abs().min().item(), x.abs().max().item()))
    fc1 = frames[0]
    assert fc1.names == ["weight", "bias", "input[0]", "output"]
    assert fc1.values[0] == pytest.approx((model.fc1.weight.abs().min().item(),
                                           model.fc1.weight.abs().max().item()))
    assert not any(frame.nonfinite for frame in frames)
    tracer.detach()
    assert not model.fc1._forward_hooks


def test_weights_are_measured_once_per_step_and_integer_inputs_are_named_not_measured():
    model = torch.nn.Embedding(10, 4)
    tracer = tracer_for(model)
    for _ in range(3):
        model(torch.tensor([1, 2]))
    frames = tracer.read()
    assert len(frames) == 3 and len({frame.stats[0] for frame in frames}) == 1  # one weight measurement
    assert frames[0].names == ["weight", "input[0]", "output"] and frames[0].values[1] is None
    assert frames[0].dtypes[1] == "torch.int64"


def test_a_tensor_seen_again_unchanged_is_measured_once_and_frames_without_tensors_are_dropped():
    class Passthrough(torch.nn.Module):
        def forward(self, x):
            return x

    class Nothing(torch.nn.Module):
        def forward(self):
            return None

    model = torch.nn.Sequential(Passthrough(), torch.nn.Linear(4, 4), Passthrough())
    nothing = Nothing()
    modules = [(name, module) for name, module in model.named_modules()] + [("nothing", nothing)]
    tracer = FrameTracer(modules, lambda: 1, lambda: True, ModuleHooks()).attach()
    x = torch.randn(2, 4)
    model(x)
    nothing()
    x.mul_(1e6)  # changed in place: a new version, measured again
    model[0](x)
    frames = tracer.read()
    assert [f.module for f in frames] == ["0", "1", "2", "", "0"]
    passthrough = frames[0]
    assert passthrough.stats[0] == passthrough.stats[1]  # input and output: one tensor, one measurement
    assert frames[1].stats[2] == passthrough.stats[1]  # the Linear's input is the same tensor again
    assert frames[4].stats[0] not in (passthrough.stats[0], None)
    assert frames[4].values[0][1] == pytest.approx(x.abs().max().item())


def test_statistics_of_mixed_dtypes_come_back_in_order():
    flat = [torch.tensor(1.5, dtype=torch.float16), torch.tensor(2.0, dtype=torch.bfloat16),
            torch.tensor(3.0, dtype=torch.float64), torch.tensor(float("inf")),
            torch.tensor(0.25, dtype=torch.float16), torch.tensor(float("nan"), dtype=torch.bfloat16)]
    pairs = read_pairs(flat)
    assert pairs[:2] == [(1.5, 2.0), (3.0, float("inf"))]
    assert pairs[2][0] == 0.25 and pairs[2][1] != pairs[2][1]


def test_long_forward_only_phases_are_read_early_instead_of_piling_up(monkeypatch):
    """Evaluation between two optimizer steps runs forwards only: statistics are read in batches."""
    monkeypatch.setattr(frames_module, "MAX_PENDING", 8)
    model = torch.nn.Linear(4, 4)
    tracer = tracer_for(model)
    with HostSyncCounter() as counter, torch.no_grad():
        for _ in range(10):
            model(torch.randn(2, 4))
    assert counter.total >= 2 and len(tracer._pending) < 8
    frames = tracer.read()
    assert len(frames) == 10 and all(v is not None for frame in frames for v in frame.values)


def test_activation_recompute_marks_the_forward_frame_instead_of_adding_one():
    model = Block()
    tracer = tracer_for(model)
    x = torch.randn(2, 4, requires_grad=True)
    out, _ = checkpoint(model, x, use_reentrant=True)  # Megatron's recompute re-runs the whole forward too
    out.sum().backward()
    frames = tracer.read()
    assert [f.module for f in frames] == ["fc1", "fc2", ""]
    assert [f.recomputed for f in frames] == [1, 1, 1]


def test_nothing_is_measured_in_steps_that_are_not_traced():
    model = Block()
    tracer = tracer_for(model, active=lambda: False, step=2)
    model(torch.randn(2, 4))
    assert tracer.read() == []


def test_the_ring_keeps_the_last_frames_across_steps_and_ends_at_the_first_nonfinite():
    model = Block()
    tracer = tracer_for(model)
    ring = FrameBuffer(max_frames=4)
    model(torch.randn(2, 4))
    assert ring.add(tracer.read()) is None
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("inf")
    model(torch.randn(2, 4))
    window = ring.add(tracer.read())
    assert [f.module for f in window] == ["fc2", "", "fc1", "fc2"]
    assert window[-1].nonfinite and not any(f.nonfinite for f in window[:-1])
    origin = forward_origin(window)  # no computation overflowed: the module whose weight is non-finite
    assert origin is window[-1] and origin.nonfinite_in("weight")


def test_the_forward_origin_is_the_first_call_with_finite_inputs_and_nonfinite_outputs():
    model = Block()
    tracer = tracer_for(model)
    model(torch.full((2, 4), 1e30), scale=torch.tensor(1e30))
    frames = tracer.read()
    origin = forward_origin(frames)
    fc1, fc2, root = frames
    assert not fc1.nonfinite and fc2.nonfinite_in("input")  # the overflow happened between the two
    assert origin is root  # the scaling is the block's own code: finite inputs, non-finite outputs


def test_probes_read_once_per_step_and_report_only_nonfinite_values():
    probes = Probes()
    with HostSyncCounter() as counter:
        probes.add(torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]), "bad", 4, "m")
        probes.add(torch.ones(3), "good", 4, None)
        probes.add(torch.tensor([1, 2]), "integers", 4, None)
    assert counter.total == 0
    with HostSyncCounter() as counter:
        bad = probes.read()
    assert counter.total == 1
    assert bad == [{"label": "bad", "module": "m", "step": 4, "recompute": False, "nan": 1, "inf": 2,
                    "abs_min": "nan", "abs_max": "nan", "shape": [4], "dtype": "torch.float32"}]
    assert probes.read() == []
    with pytest.raises(TypeError, match="needs a tensor"):
        probes.add([1.0], "list", 1, None)


def test_a_probe_names_the_innermost_model_module_on_the_call_stack():
    model = Block()
    names = {id(module): name for name, module in model.named_modules()}
    seen = []
    model.fc2.register_forward_hook(lambda module, args, out: seen.append(enclosing_module(lambda: names)))
    model(torch.randn(1, 4))
    assert seen == ["fc2"]
    assert enclosing_module(lambda: names) is None


def test_on_nonfinite_raise_stops_at_the_first_nonfinite_forward_value_after_writing_its_frames(tmp_path):
    import gradnan

    handle = gradnan.install(out_dir=str(tmp_path), frames="detect", on_nonfinite="raise",
                             log_level="CRITICAL")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        handle.start(model=model)
        model(torch.ones(1, 4))
        handle.step()  # a healthy step goes on
        model(torch.full((1, 4), float("inf")))
        with pytest.raises(gradnan.NonFiniteGradientError, match="frames at step 2"):
            handle.step()
    finally:
        gradnan.uninstall()
    [record] = [json.loads(line) for path in (tmp_path / "records").glob("*.jsonl")
                for line in path.read_text().splitlines()]
    assert record["kind"] == "frames" and record["step"] == 2 and record["frames"][-1]["module"] == "0"


def test_a_step_of_many_nonfinite_probes_writes_the_first_ones_and_counts_them_all(tmp_path):
    """A probe in a loop over 2,000 tensors: the record lists the first ``MAX_PROBES`` in call order and
    counts all 2,000, and the report says so."""
    import gradnan
    from gradnan.formats.records import MAX_PROBES

    from .test_untrusted import cli

    handle = gradnan.install(out_dir=str(tmp_path), log_level="CRITICAL")
    try:
        handle.start(model=torch.nn.Linear(2, 2))
        for index in range(2000):
            gradnan.check(torch.tensor([float("nan")]), f"tensor {index}")
        handle.step()
    finally:
        gradnan.uninstall()
    [record] = [json.loads(line) for path in (tmp_path / "records").glob("*.jsonl")
                for line in path.read_text().splitlines()]
    assert record["probes_total"] == 2000 and len(record["probes"]) == MAX_PROBES
    assert record["probes"][-1]["label"] == f"tensor {MAX_PROBES - 1}"
    code, out, _ = cli("report", str(tmp_path))
    assert code == 0 and "and 1996 more probe finding(s)" in out, out
    code, out, _ = cli("report", str(tmp_path), "--json")
    assert json.loads(out)["probes_total"] == 2000 and len(json.loads(out)["probes"]) == MAX_PROBES


@pytest.mark.slow
def test_a_run_that_dies_before_its_optimizer_step_still_writes_its_frames(tmp_path):
    """Megatron-LM's NaN-loss check raises in the forward pass: the step's frames are written at exit."""
    script = textwrap.dedent(f"""
        import torch, gradnan
        handle = gradnan.install(out_dir={str(tmp_path)!r}, frames="detect", log_level="ERROR")
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        handle.start(model=model)
        with torch.no_grad():
            model[1].weight.fill_(1e38)
        loss = model(torch.ones(2, 4) * 1e3).sum()
        gradnan.check(loss, "loss")
        raise RuntimeError("found NaN in local forward loss calculation")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "found NaN in local forward loss" in done.stderr
    records = [json.loads(line) for path in (tmp_path / "records").glob("*.jsonl")
               for line in path.read_text().splitlines()]
    kinds = {record["kind"]: record for record in records}
    assert set(kinds) == {"frames", "probe"}
    assert kinds["frames"]["frames"][-1]["module"] == "1" and kinds["frames"]["step"] == 1
    probe = kinds["probe"]["probes"][0]
    assert probe["label"] == "loss" and probe["module"] is None and probe["nan"] + probe["inf"] == 1


def test_gradnan_frames_selects_by_megatron_lm_iteration_as_trace_steps_count_there(tmp_path, capsys):
    from gradnan.cli import main

    rank = {"global_rank": 0, "tp": 0, "pp": 0, "dp": 0, "host": "h", "device": "cpu"}
    frame = {"step": 3, "module": "fc", "class": "Linear", "call": 0, "recomputed": 0,
             "entries": [{"name": "output", "kind": "output", "dtype": "torch.float32", "abs_min": 0.5,
                          "abs_max": 2.0}]}
    record = {"schema": "gradnan.record", "version": 1, "kind": "frames", "step": 3, "iteration": 1003,
              "rank": rank, "params": [], "params_total": 0, "mode": "trace", "frames": [frame],
              "frames_total": 1, "first_nonfinite": None}
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "rank00000_tp0_pp0_dp0.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["frames", str(tmp_path), "--iteration", "1003"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "5.00e-01 2.00e+00 output"
    assert main(["frames", str(tmp_path), "--iteration", "3"]) == 2
    assert "no frames recorded for iteration 3" in capsys.readouterr().err


def test_gradnan_frames_marks_values_within_2x_of_their_dtypes_largest():
    from gradnan.offline.incident.frames_view import format_frames

    def entry(name, dtype, high):
        return {"name": name, "kind": "output", "dtype": dtype, "abs_min": 0.0, "abs_max": high}

    frame = {"step": 1, "module": "m", "class": "Linear", "call": 0, "recomputed": 0,
             "entries": [entry("output[0]", "torch.float16", 3.3e4),
                         entry("output[1]", "torch.float16", 3.2e4),
                         entry("output[2]", "torch.float16", "inf"),
                         entry("output[3]", "torch.float32", 3.3e4)]}
    record = {"rank": {"global_rank": 0, "tp": 0, "pp": 0, "dp": 0}, "step": 1, "mode": "trace",
              "frames": [frame], "first_nonfinite": None}
    lines = format_frames(record).splitlines()[-4:]
    assert lines[0].endswith("output[0]  [near float16 max 6.55e+04]")
    assert [line.endswith(name)
            for line, name in zip(lines[1:], ("output[1]", "output[2]", "output[3]"))] == [True] * 3
