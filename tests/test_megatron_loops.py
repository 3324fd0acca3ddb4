"""Issue 58: today's training loops end to end on CPU, each launched unedited under ``-m gradnan.run``
(TP=2, 2 gloo processes), a fault planted at one iteration, the report read and its ``Next:`` followed as
printed: Megatron-LM's own loop of a 0.17+ release (``megatron.training.pretrain`` from megatron-core's
wheel, which ships it from 0.17 on; tests/megatron_loops/train_gpt_lm.py) and Megatron-Bridge's
(``megatron.bridge.training.pretrain``; train_gpt_bridge.py). CI's Python 3.12 leg installs megatron-core
0.19.2 and Megatron-Bridge 0.6.2; elsewhere these skip.

On core_v0.16.1's loop the skip value was one less than the logged iteration; from core_v0.17.0 it is the
logged one (the option given before this issue, ``--iterations-to-skip 4``, ran the planted iteration 5
again and failed)."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradnan.cli import main
from gradnan.formats.incident import Action
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text, step_headline
from gradnan.patches.instrumentor import megatron_version
from gradnan.testing.gloo import free_port

from .helpers import environ_without_gradnan, read_board, run_bounded

pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

HERE = Path(__file__).resolve().parent / "megatron_loops"
# a tiny GPT, TP=2, bf16, 6 iterations, a save every 2; Megatron-LM's CPU-incompatible fusions off
FLAGS = ("--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion"
         " --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion"
         " --no-persist-layer-norm --mock-data --no-create-attention-mask-in-dataloader"
         " --tokenizer-type NullTokenizer --vocab-size 128 --num-layers 2 --hidden-size 64"
         " --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2"
         " --global-batch-size 4 --train-iters 6 --lr 1e-4 --bf16 --tensor-model-parallel-size 2"
         " --save-interval 2 --eval-iters 0 --eval-interval 1000 --log-interval 1").split()


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


requires_the_loop = pytest.mark.skipif(not _importable("megatron.training"), reason="megatron-core < 0.17:"
                                       " its wheel has no megatron.training (CI's Python 3.12 leg runs this)")
requires_bridge = pytest.mark.skipif(not _importable("megatron.bridge"), reason="Megatron-Bridge is not"
                                     " installed (CI's Python 3.12 leg installs 0.6.2)")


# a launch takes under 40 s here: a hung one is killed with its workers, not left to slow the tests after it
LAUNCH_SECONDS = 240


def _launch(out: Path, script: str, *arguments: str, env=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "gradnan.run", str(HERE / script), *arguments]
    return run_bounded(command, LAUNCH_SECONDS, env={
        **environ_without_gradnan(), "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(HERE),
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1",
        "GRADNAN_OUT_DIR": str(out), **(env or {})})


def _train(out: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    """Megatron-LM's loop: the tiny GPT's flags, then ``extra``."""
    return _launch(out, "train_gpt_lm.py", *FLAGS, *extra, env=env)


@requires_the_loop
@pytest.mark.parametrize("plant, cause, origin, names, ckpt_format", [
    # one element of layer 1's linear_fc1 output NaN on rank 1: a forward operator a batch drives to NaN
    ({"PLANT_ITER": "5", "PLANT_RANK": "1"}, "forward_op", [1], "decoder.layers.1.mlp.linear_fc1 on rank 1",
     "torch"),
    # every token masked and the loss divided by their count (0/0) on both tensor-parallel ranks, which
    # compute the same loss: Megatron's loss check rejects it
    ({"PLANT_LOSS_ITER": "5"}, "loss", [0, 1], "the loss function made it", "torch_dist"),
], ids=["forward_op", "loss"])
def test_a_nan_made_by_the_batch_on_megatron_lms_own_loop_is_named_and_its_skip_option_trains_past_it(
        tmp_path, capsys, plant, cause, origin, names, ckpt_format):
    """Saves in both of Megatron-LM's formats: ``torch`` bypasses ``dist_checkpointing.save`` and is marked
    by Megatron-LM's own ``save_checkpoint``, wrapped as its module is imported."""
    checkpoints = tmp_path / "checkpoints"
    failed = _train(tmp_path / "failed", "--save", str(checkpoints), "--ckpt-format", ckpt_format, env=plant)
    # Megatron's rerun: reproducible, a checkpoint saved, its ranks exit 16 (torchrun then 1)
    assert failed.returncode != 0 and "exitcode  : 16" in failed.stderr, failed.stderr[-3000:]
    analysis = analyze(read_run(tmp_path / "failed"))
    text = format_text(analysis)
    incident = analysis.to_json()["incident"]
    assert incident["iteration"] == 5 and incident["verdict"]["cause"] == cause, text
    assert [entry["global_rank"] for entry in incident["origin"]] == origin, text
    assert names in text, text
    release = megatron_version().base_version  # a wheel inside a git checkout says 0.19.2+<its commit>
    assert f"restart Megatron-LM (core_v{release}) from its last checkpoint" in text, text
    [skip] = [step for step in analysis.incident.next_steps if step.action is Action.SKIP_ITERATION]
    assert skip.command == ("--iterations-to-skip", "5", "--rerun-mode", "disabled"), text
    assert main(["checkpoints", str(tmp_path / "failed")]) == 0
    saves = capsys.readouterr().out.splitlines()  # 2 and 4, then Megatron's exit save, labelled 4
    labels = [save.split("  ")[1].split(" (")[0] for save in saves]
    assert labels == [f"the checkpoint of iteration {n}" for n in (2, 4, 4)], saves
    assert saves[0].endswith("save 1: clean") and "written after the incident of step 5" in saves[2], saves

    # followed literally: the same command, --load of its checkpoints and the printed option
    restarted = _train(tmp_path / "restarted", "--save", str(checkpoints), "--ckpt-format", ckpt_format,
                       "--load", str(checkpoints), *skip.command, env=plant)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    log = restarted.stdout + restarted.stderr
    assert "skipped samples:" in log and "planted NaN" not in log, log[-3000:]
    assert " iteration        6/       6 |" in log, log[-3000:]
    assert "No non-finite gradient was recorded." in format_text(analyze(read_run(tmp_path / "restarted")))


@requires_the_loop
def test_a_nan_loss_under_rerun_mode_disabled_on_megatron_lms_own_loop_is_the_loss_function(tmp_path):
    """Issue 59 (1): with Megatron's rerun off its loss check raises at the NaN loss; gradnan runs the step
    again in place itself and names the loss function, with the samples and the skip option (it said "on
    rank 1, an unnamed ..." and sent the user back to validate_results)."""
    failed = _train(tmp_path, "--rerun-mode", "disabled", env={"PLANT_LOSS_ITER": "5"})
    assert failed.returncode != 0, failed.stderr[-3000:]
    analysis = analyze(read_run(tmp_path))
    text = format_text(analysis)
    incident = analysis.to_json()["incident"]
    assert (incident["iteration"], incident["verdict"]["rule"]) == (5, "loss_function"), text
    assert [entry["global_rank"] for entry in incident["origin"]] == [0, 1], text
    assert "an unnamed" not in text and "global samples" in text, text
    [skip] = [step for step in analysis.incident.next_steps if step.action is Action.SKIP_ITERATION]
    assert skip.command == ("--iterations-to-skip", "5"), text


@requires_the_loop
def test_a_nan_weight_saved_then_resumed_on_megatron_lms_own_loop_gets_the_clean_checkpoint_that_trains_on(
        tmp_path):
    """Rank 1's copy of one weight NaN as iteration 3 begins, with Megatron's checks off so that it trains
    on and saves the NaN weights at 4 and 6; then the user's restart resumes from 6 and fails at once. The
    report names the weights that came with the checkpoint and the newest clean save (2) with the option
    that loads it; followed literally, the restart trains on."""
    checkpoints, out = tmp_path / "checkpoints", tmp_path / "gradnan"
    unchecked = ("--save", str(checkpoints), "--no-check-for-nan-in-loss-and-grad", "--rerun-mode",
                 "disabled")
    spoiled = _train(out, *unchecked, env={"PLANT_WEIGHT_ITER": "3", "PLANT_RANK": "1"})
    assert spoiled.returncode == 0 and "grad norm: nan" in spoiled.stdout, spoiled.stderr[-3000:]
    resume = ("--load", str(checkpoints), "--train-iters", "8", "--override-opt_param-scheduler")
    resumed = _train(out, "--save", str(checkpoints), *resume)
    assert resumed.returncode != 0, resumed.stderr[-3000:]  # Megatron's loss check: NaN at once
    analysis = analyze(read_run(out))  # the newest launch: the resumed one
    text = format_text(analysis)
    incident = analysis.to_json()["incident"]
    assert incident["verdict"]["cause"] == "weights" and incident["iteration"] == 7, text
    assert "they came with the checkpoint this launch resumed from" in incident["verdict"]["summary"], text
    [restart] = [step for step in analysis.incident.next_steps if step.action is Action.RESUME]
    assert restart.command == ("--ckpt-step", "2") and "the checkpoint of iteration 2" in restart.text, text

    followed = _train(tmp_path / "followed", *resume, *restart.command)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "grad norm: nan" not in followed.stdout and " iteration        3/       8 |" in followed.stdout
    assert " iteration        8/       8 |" in followed.stdout, followed.stdout[-3000:]


@requires_bridge
def test_a_forward_nan_on_megatron_bridges_own_loop_gets_its_iteration_and_its_override_that_trains_past_it(
        tmp_path, capsys):
    """Bridge's defaults: its rerun state machine disabled, so its loss check raises at the NaN loss and
    gradnan runs the step again in place itself. The records name Bridge's loop and its iteration (read from
    its train_step); the skip is Bridge's override with the logged iteration (Bridge checks
    ``train_state.step + 1``); its saves are marked by its own save_checkpoint; the incident goes to its
    TensorBoard writer as to Megatron-LM's. Followed as printed, with
    ``checkpoint.load`` of its checkpoints: iteration 3 skipped, 4 to 6 trained."""
    checkpoints = tmp_path / "checkpoints"
    bridge = {"MEGATRON_LOOP": "bridge", "BRIDGE_CHECKPOINTS": str(checkpoints)}
    board = f"logger.tensorboard_dir={tmp_path / 'board'}"
    failed = _launch(tmp_path / "failed", "train_gpt_bridge.py", board,
                     env={**bridge, "PLANT_ITER": "3", "PLANT_RANK": "1"})
    assert failed.returncode != 0 and "planted NaN at iteration 3" in failed.stderr, failed.stderr[-3000:]
    files = read_run(tmp_path / "failed")
    assert {record["loop"]["name"] for record in files.all_records()} == {"megatron-bridge"}
    analysis = analyze(files)
    text = format_text(analysis)
    incident = analysis.to_json()["incident"]
    assert incident["iteration"] == 3 and incident["verdict"]["cause"] == "forward_op", text
    assert [entry["global_rank"] for entry in incident["origin"]] == [1], text
    assert "decoder.layers.1.mlp.linear_fc1 on rank 1" in text, text
    [skip] = [step for step in analysis.incident.next_steps if step.action is Action.SKIP_ITERATION]
    assert skip.command == ("train.iterations_to_skip=[3]",), text
    assert f"\n     {shlex.join(skip.command)}\n" in text and "--" not in " ".join(skip.command)
    texts, scalars, _ = read_board(tmp_path / "board")  # Bridge's own writer, on its last rank
    assert list(texts) == [3] and texts[3].startswith(step_headline(analysis.incident)), texts
    assert scalars["gradnan/origin_rank"] == [(3, 1.0)], scalars
    assert main(["checkpoints", str(tmp_path / "failed")]) == 0
    [save] = capsys.readouterr().out.splitlines()
    assert "the checkpoint of iteration 2" in save and save.endswith("save 1: clean"), save

    pasted = shlex.split(shlex.join(skip.command))  # the line under Next:, as a shell reads it
    followed = _launch(tmp_path / "followed", "train_gpt_bridge.py", f"checkpoint.load={checkpoints}",
                       *pasted, env={**bridge, "PLANT_ITER": "3", "PLANT_RANK": "1"})
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "planted NaN" not in followed.stderr, followed.stderr[-3000:]
    assert "No non-finite gradient was recorded." in format_text(analyze(read_run(tmp_path / "followed")))
