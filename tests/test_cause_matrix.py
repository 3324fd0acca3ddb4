"""Issue 36: every cause, planted by cause on real megatron-core through its schedules (4 gloo processes),
across positions: tensor-parallel rank, pipeline stage, data-parallel replica, layer kind, micro-batch, the
first step, bf16/fp16/fp32, the distributed optimizer on and off. The expected answer is computed from the
plant (``gradnan.testing.plants``). CI runs a seeded sample that holds every cause and every layer kind
(``CAUSE_MATRIX=all`` runs the whole product, ``CAUSE_MATRIX_SEED`` another sample)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import shutil

import pytest
from packaging.version import Version

from gradnan.formats.incident import Cause
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.patches.instrumentor import megatron_version
from gradnan.testing.plants import LEARNING_RATE, LINKS, Plant, coordinates, expert_of, holds, sender_stage
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import TinyGPTJob

pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

TP_DP = TinyGPTJob(world_size=4, tp=2, dtype="bf16", quiet=True, steps=3)
# Megatron-LM's loss check in validate_results mode: a NaN loss makes Megatron run the step again and exit
# before any grad norm (from step 2: it never validates the first)
LOSS_CHECKED = TP_DP.with_(rerun_mode="validate_results")
LAYOUTS = (TP_DP, TP_DP.with_(distributed_optimizer=True),
           TinyGPTJob(world_size=4, pp=2, dtype="fp32", quiet=True, steps=3, micro_batches=2),
           TP_DP.with_(dtype="fp16"), LOSS_CHECKED)
# column- and row-parallel linears, layer norm, embedding (the position embedding: every step reads each of
# its rows, where a word embedding's row is read only where the data holds its token), output layer
PARAMETERS = ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_proj.weight",
              "decoder.layers.0.input_layernorm.weight", "embedding.position_embeddings.weight",
              "output_layer.weight", "decoder.layers.1.self_attention.linear_qkv.weight")
ROW_PARALLEL = ("decoder.layers.0.mlp.linear_fc2", "decoder.layers.1.self_attention.linear_proj")
MODULES = ("decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.self_attention.linear_proj",
           "decoder.layers.1.self_attention.core_attention", "decoder.layers.0.input_layernorm", "embedding",
           "output_layer")
ON_PARAMETERS = (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE, Cause.BACKWARD_OP, Cause.COLLECTIVE,
                 Cause.NORM_OVERFLOW, Cause.REPLICA_DIVERGENCE)
ON_MODULES = (Cause.FORWARD_OP, Cause.DEVICE)
GRADIENT_CAUSES = (Cause.BACKWARD_OP, Cause.COLLECTIVE, Cause.NORM_OVERFLOW)
TP_DUPLICATES = ("layernorm", "position_embeddings")  # the same copy on every tensor-parallel rank
# fp16's loss scaler skips a step whose gradients alone overflow, by design: only what breaks the forward
# pass or the weights is an incident there
# what a loss check sees: a non-finite loss, from a weight, a forward operator or the loss function
LOSS_CHECK_CAUSES = (Cause.WEIGHTS, Cause.FORWARD_OP, Cause.LOSS)
# and fp16's own: its loss scale stuck at +Inf, every step skipped (issue 59)
FP16_CAUSES = (*LOSS_CHECK_CAUSES, Cause.LOSS_SCALE)
# the loss backward runs from is read where megatron-core returns it (forward_step_calc_loss, 0.13 on);
# before, only the reported loss is (docs/megatron-versions.md): a loss that differs from it is not judged
LOSS_USED_SEEN = (megatron_version() or Version("0")) >= Version("0.13")
# a token's row of the output layer (every step reads each of its rows) set to 1e30, on one replica
ROW = ("output_layer.weight", 9)


def _all_plants():
    plants = []
    for job in LAYOUTS:
        dp_size = job.world_size // (job.tp * job.pp)
        wheres = [(tp, dp) for tp in range(job.tp) for dp in range(dp_size)]
        for cause in Cause:
            if cause is Cause.UNDETERMINED or (job.dtype == "fp16" and cause not in FP16_CAUSES) or (
                    job.rerun_mode and cause not in LOSS_CHECK_CAUSES) or (
                    cause is Cause.LOSS_SCALE and job.dtype != "fp16"):
                continue
            targets = (PARAMETERS if cause in ON_PARAMETERS else MODULES if cause in ON_MODULES else ("",))
            if cause is Cause.COLLECTIVE and job.tp > 1:  # and the tensor-parallel reduction of a layer
                targets += ROW_PARALLEL
            places = wheres[:1] if cause is Cause.LOSS_SCALE else wheres  # one scale for every rank
            for target, where in itertools.product(targets, places):
                if cause in GRADIENT_CAUSES and any(part in target for part in TP_DUPLICATES) and where[0]:
                    continue  # Megatron's norm counts a tensor-parallel duplicate on tensor rank 0 only
                for step in ((1, 2) if cause is Cause.WEIGHTS else (2,)):
                    micro_batch = job.micro_batches - 1 if cause is Cause.LOSS else 0
                    plants.append(Plant(cause, job, target, where, step, micro_batch))
        plants += [Plant(Cause.WEIGHTS, job, ROW[0], where, 2, row=ROW[1]) for where in wheres]
        if not (job.dtype == "fp16" or job.rerun_mode):  # a broken schedule's rate (issue 48, case 3)
            plants.append(Plant(Cause.OPTIMIZER_UPDATE, job, LEARNING_RATE))
        # a loss function that reports a finite value and hands backward a NaN (issue 48, case 4)
        plants += [Plant(Cause.LOSS, job, "", where, 2, job.micro_batches - 1, after_report=True)
                   for where in wheres if not where[0]]
    return plants


def _marks(plant):
    """What the sample must hold at least once: causes, targets, layouts, a row plant, a loss after report."""
    return (plant.cause, plant.target, plant.job, plant.row, "after_report" if plant.after_report else None)


def _sample(plants, seed: int):
    """Every cause and every layer kind at least once, then a seeded draw up to 20 plants."""
    rng = random.Random(seed)
    pool = list(plants)
    rng.shuffle(pool)
    chosen = []
    for wanted in [*(p for p in Cause if p is not Cause.UNDETERMINED), *PARAMETERS, *MODULES, *ROW_PARALLEL,
                   *(job for job in LAYOUTS), ROW[1], "after_report", LEARNING_RATE]:
        if any(wanted in _marks(plant) for plant in chosen):
            continue
        chosen.append(next(p for p in pool if wanted in _marks(p)))
    chosen += [p for p in pool if p not in chosen][:max(0, 20 - len(chosen))]
    return chosen


# issue 48 case 2: what a pipeline link delivers, forward and backward, on a tensor-parallel pipeline and on
# the interleaved schedule (two model chunks per stage: the last stage's chunk feeds the first stage's next,
# so stage 0 receives activations too); and a forward operator on stage 0 there, which stage 1 only receives
PP_TP = TinyGPTJob(world_size=4, tp=2, pp=2, dtype="bf16", quiet=True, steps=3, micro_batches=2)
VIRTUAL = TinyGPTJob(world_size=4, pp=2, vpp=2, num_layers=4, dtype="fp32", quiet=True, steps=3,
                     micro_batches=2)
PIPELINE_PLANTS = [Plant(Cause.COLLECTIVE, PP_TP, "link:forward", (1, 0), stage=1),
                   Plant(Cause.COLLECTIVE, PP_TP, "link:backward", (0, 0), stage=0),
                   Plant(Cause.COLLECTIVE, VIRTUAL, "link:forward", (0, 1), stage=0),
                   Plant(Cause.COLLECTIVE, VIRTUAL, "link:backward", (0, 0), stage=1),
                   Plant(Cause.FORWARD_OP, VIRTUAL, "decoder.layers.0.mlp.linear_fc1", (0, 1))]

PLANTS = (_all_plants() if os.environ.get("CAUSE_MATRIX") == "all"
          else _sample(_all_plants(), int(os.environ.get("CAUSE_MATRIX_SEED", "36")))) + PIPELINE_PLANTS

# issue 48: mixture of experts under expert parallelism (4 experts over EP=2, megatron-core's allgather
# dispatcher; data-parallel rank dp is expert-parallel rank dp % 2, expert-data-parallel rank dp // 2). An
# expert's overflow reaches the other expert-parallel rank through the token exchange, its non-finite
# gradients every rank. Always run: every plant on 2 ranks (an expert on each expert-parallel rank; a weight,
# a gradient; dense layers beside the experts: an attention overflow reaches every expert through the
# exchange, a dense gradient brings in its replica alone, which cannot run the step again), and with the
# matrix's 4 ranks an expert on the second expert-data-parallel replica
EP = TinyGPTJob(world_size=2, dtype="bf16", experts=4, ep=2, quiet=True, steps=3)
EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}"
EP_PLANTS = (Plant(Cause.FORWARD_OP, EP, EXPERT.format(0, 1), (0, 0)),
             Plant(Cause.FORWARD_OP, EP, EXPERT.format(1, 2), (0, 1)),
             Plant(Cause.WEIGHTS, EP, EXPERT.format(1, 3) + ".linear_fc1.weight", (0, 1)),
             Plant(Cause.BACKWARD_OP, EP, EXPERT.format(0, 0) + ".linear_fc2.weight", (0, 0)),
             Plant(Cause.FORWARD_OP, EP, "decoder.layers.1.self_attention.linear_proj", (0, 1)),
             Plant(Cause.BACKWARD_OP, EP, "decoder.layers.0.self_attention.linear_qkv.weight", (0, 0)),
             # the rerun's group spans both replicas: each rank's own loss (``loss_here``) names whose it was
             Plant(Cause.LOSS, EP, "", (0, 1), 2, 0))
PLANTS = (*PLANTS, Plant(Cause.FORWARD_OP, EP.with_(world_size=4), EXPERT.format(0, 3), (0, 3)))
# under fp16 the step is not run again with experts (whether an overflow is an incident may differ between
# replicas): an honest undetermined, not the receiver's gradients read as a backward operator
FP16_EXPERT = Plant(Cause.FORWARD_OP, EP.with_(dtype="fp16"), EXPERT.format(0, 2), (0, 1))
# issue 48 case 8: records made to contradict each other on a real run (``test_a_planted_conflict...``)
CONFLICTED = Plant(Cause.WEIGHTS, TP_DP, "decoder.layers.0.mlp.linear_fc1.weight", (1, 1), 2)
PLANTS = (*PLANTS, CONFLICTED)


def _named(plant, incident) -> bool:
    """Whether the report names the planted parameter or module where this cause names one."""
    origin_params = {p["name"] for entry in incident.origin for p in entry["params"]}
    if plant.target in LINKS:  # the link, as sender stage -> receiver stage
        receiver = plant.coordinate[1]
        link = f"pp{sender_stage(plant.job, plant.target, receiver)} -> pp{receiver}"
        return link in incident.verdict.summary
    if plant.cause is Cause.WEIGHTS:
        rows = {row["name"] for entry in incident.origin for row in entry.get("outlying_rows", [])}
        return plant.target in origin_params | rows
    if plant.cause is Cause.REPLICA_DIVERGENCE:
        return plant.target in {weight["name"] for entry in incident.origin
                                for weight in entry.get("diverged", [])}
    if plant.target == LEARNING_RATE:
        return incident.verdict.rule == "learning_rate"
    if plant.cause is Cause.OPTIMIZER_UPDATE:
        return plant.target in {fault["name"] for entry in incident.origin
                                for fault in entry.get("optimizer_state", [])}
    if plant.cause is Cause.FORWARD_OP:
        return incident.rerun is not None and incident.rerun.module == plant.target
    if plant.cause is Cause.NORM_OVERFLOW:
        return any((entry.get("largest_grad") or {}).get("name") == plant.target for entry in incident.origin)
    if plant.cause is Cause.COLLECTIVE and plant.target in ROW_PARALLEL:
        return incident.rerun is not None and incident.rerun.module == plant.target
    if plant.cause in (Cause.BACKWARD_OP, Cause.COLLECTIVE):
        return incident.pattern.first_in_backward == plant.target or plant.target in origin_params
    if plant.cause is Cause.LOSS_SCALE:  # the scaler, no parameter
        return not any(entry["params"] for entry in incident.origin)
    return plant.cause is not Cause.LOSS or incident.rerun.micro_batch == plant.micro_batch


def _outcomes(root, plants):
    jobs = [plant.planted_job(str(root / str(number))) for number, plant in enumerate(plants)]
    results = launch_many(jobs)
    return [(plant, analyze(read_run(root / str(number))), frozenset(
        rank for rank, result in per_rank.items() if result.injected), _read_state(root / str(number)),
        root / str(number)) for number, (plant, per_rank) in enumerate(zip(plants, results))]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return _outcomes(tmp_path_factory.mktemp("matrix"), PLANTS)


@pytest.fixture(scope="module")
def expert_outcomes(tmp_path_factory):
    return _outcomes(tmp_path_factory.mktemp("experts"), (*EP_PLANTS, FP16_EXPERT))


def _read_state(run_dir):
    """The coordinates of the ranks that read their weights at the incident (a replica that did not fail
    reads none: an fp16 skip with a finite loss, a bad embedding row its data did not read)."""
    files = read_run(run_dir)
    return frozenset((r["rank"]["tp"], r["rank"]["pp"], r["rank"]["dp"]) for r in files.all_records()
                     if r["kind"] == "state")


def test_every_planted_cause_is_named_with_its_origin_and_parameter(outcomes):
    wrong = _wrong(outcomes)
    assert not wrong, wrong


def test_every_cause_planted_under_expert_parallelism_is_named(expert_outcomes):
    """Each expert is named by its global number on the expert-parallel rank that holds it."""
    wrong = _wrong(expert_outcomes[:len(EP_PLANTS)])
    assert not wrong, wrong


def test_an_expert_overflow_under_fp16_not_run_again_is_undetermined_not_a_backward_operator(expert_outcomes):
    """It was ``backward_op`` on the receiving rank's ``output_layer.weight``: that rank's gradients were
    only partly non-finite, and its fp16 skip recorded a non-finite loss (the forward pass made it)."""
    plant, report, *_ = expert_outcomes[-1]
    assert plant is FP16_EXPERT and report.incident.rerun is None
    verdict = report.incident.verdict
    assert (verdict.cause, verdict.rule) == (Cause.UNDETERMINED, "forward_not_rerun"), verdict
    assert "was non-finite in the failing pass" in verdict.summary


def test_an_expert_overflow_without_its_ranks_files_is_undetermined_naming_that_rank(expert_outcomes,
                                                                                   tmp_path):
    """Issue 48 (d): without the files of the rank holding the expert, the other rank's rerun record still
    names it as the origin; the verdict says so, undetermined, not a cause read from the receiver's own
    gradients (it was ``backward_op`` on the receiver's ``output_layer.weight``)."""
    plant, _, _, _, run_dir = expert_outcomes[1]
    kept = tmp_path / "run"
    shutil.copytree(run_dir, kept, ignore=lambda _, names: [name for name in names
                                                              if name.startswith(f"rank{plant.rank:05d}")])
    verdict = analyze(read_run(kept)).incident.verdict
    assert (verdict.cause, verdict.rule) == (Cause.UNDETERMINED, "rerun_origin_absent"), verdict
    assert f"first on rank {plant.rank} " in verdict.summary and "not in the run directory" in verdict.summary


def _wrong(outcomes):
    wrong = []
    for plant, report, applied, read, _ in outcomes:
        if plant.after_report and not LOSS_USED_SEEN:
            continue
        incident = report.incident
        expected = plant.expected(applied)
        if plant.cause in (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE):
            expected = dataclasses.replace(expected, must=expected.must & read)
        if incident is None:
            wrong.append(f"{plant.label()}: no incident")
            continue
        origin = {(entry.get("tp"), entry.get("pp"), entry.get("dp")) for entry in incident.origin}
        # a bad weight (an embedding row) fails the first step whose data reads it
        late = plant.cause in (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE)
        # a flip in an fp32 main copy reaches the model parameter, and the next check, with the update
        next_check = plant.cause is Cause.REPLICA_DIVERGENCE and incident.step == plant.failing_step + 1
        step_right = (incident.step == plant.failing_step or (late and incident.step > plant.failing_step)
                      or next_check)
        checks = {"step": step_right,
                  "cause": incident.verdict.cause is expected.cause,
                  "origin": expected.must <= origin <= expected.may, "named": _named(plant, incident)}
        if not all(checks.values()):
            wrong.append(f"{plant.label()}: {[key for key, ok in checks.items() if not ok]} wrong:"
                         f" {incident.verdict.cause.value} ({incident.verdict.rule}) at step {incident.step},"
                         f" origin {sorted(origin)}, expected {sorted(expected.must)}")
    return "\n".join(wrong)


def test_a_planted_conflict_between_records_is_undetermined_naming_both_ranks(outcomes, tmp_path):
    """Case 8 planted on a real run: one replica's weight made NaN (its ``state`` record names it), then
    its clean peer's record made to report the same weights digest, which equal weights would have: the
    records contradict each other, and the verdict says so instead of ``one_replica_weights``."""
    _, _, _, _, run_dir = next(outcome for outcome in outcomes if outcome[0] is CONFLICTED)
    forged = tmp_path / "run"
    shutil.copytree(run_dir, forged)
    states = {r["rank"]["global_rank"]: r for r in read_run(forged).all_records() if r["kind"] == "state"}
    bad = CONFLICTED.rank
    peer = next(rank for rank, r in states.items() if r["rank"]["tp"] == states[bad]["rank"]["tp"]
                and rank != bad)
    for path in (forged / "records").iterdir():
        lines = path.read_text().splitlines()
        edited = [json.dumps({**record, "weights_digest": states[bad]["weights_digest"]})
                  if record["kind"] == "state" and record["rank"]["global_rank"] == peer else line
                  for line, record in zip(lines, map(json.loads, lines))]
        path.write_text("\n".join(edited) + "\n")
    incident = analyze(read_run(forged)).incident
    assert (incident.verdict.cause, incident.verdict.rule) == (Cause.UNDETERMINED, "records_conflict")
    assert f"ranks {min(bad, peer)} and {max(bad, peer)} report equal digests" in incident.verdict.summary
    assert {entry["global_rank"] for entry in incident.origin} == {bad, peer}


def test_the_sample_holds_every_cause_layout_and_layer_kind():
    assert {plant.cause for plant in PLANTS} == set(Cause) - {Cause.UNDETERMINED}
    assert {plant.job for plant in PLANTS} == {*LAYOUTS, EP.with_(world_size=4), PP_TP, VIRTUAL}
    assert any(plant.row is not None for plant in PLANTS) and any(plant.after_report for plant in PLANTS)
    assert any(plant.target == LEARNING_RATE for plant in PLANTS)
    assert {plant.target for plant in PLANTS} >= set(LINKS)
    assert set(PARAMETERS) | set(MODULES) | set(ROW_PARALLEL) <= {plant.target for plant in PLANTS}
    assert all(plant.coordinate in coordinates(plant.job) for plant in PLANTS)
    assert all(holds(plant.job, plant.coordinate, plant.target) for plant in PLANTS + EP_PLANTS)
    assert {plant.where[1] % EP.ep for plant in EP_PLANTS if plant.cause is Cause.FORWARD_OP
            and expert_of(plant.target) is not None} == set(range(EP.ep))
