"""Issue 48 (case 8), built on issue 47's table: records that contradict each other get no confident cause.
Each case was a confident wrong verdict before (gradient_collective "checked on each", one_replica_weights,
tensor_parallel_collective); now ``records_conflict`` says which records disagree and names their ranks."""

from __future__ import annotations

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.report import format_text

from .helpers import observed
from .test_report_unit import _files, _record

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


def _state(rank, digest, bad=()):
    record = _record(2, "state", rank, weights_digest=digest, params_checked=4, optimizer_state_total=0,
                     optimizer_state_checked=0, optimizer_state=[])
    record["params"] = [{"name": name, "copy": "model", "nan": 1, "inf": 0, "first_bad_index": [0]}
                        for name in bad]
    return record


def _verdict(*records):
    report = analyze(_files(*records))
    return report.incident.verdict, report.incident.origin, format_text(report)


def test_a_norm_record_claiming_a_pre_reduction_finding_that_was_never_written():
    """Before: gradient_collective, "finite before it (checked on each)", for a rank whose own record said
    its gradients were non-finite before the collective."""
    norm = _record(2, "nonfinite_grad_norm", 0, [FC1], pre_reduction="nonfinite")
    peer = _record(2, "nonfinite_grad_norm", 1, [FC1], pre_reduction="clean")
    verdict, origin, text = _verdict(norm, peer)
    assert (verdict.cause.value, verdict.rule) == ("undetermined", "records_conflict")
    assert [entry["global_rank"] for entry in origin] == [0]
    assert "rank 0's grad-norm record says its own gradients were non-finite" in verdict.summary
    assert "checked on each" not in text and "own gradients were finite before" not in text
    assert "Origin (their records contradict each other):" in text
    assert verdict.evidence[0].startswith("records disagree: rank 0's grad-norm record says")


def test_equal_digests_beside_one_replicas_nan_weight():
    """Before: one_replica_weights on rank 1, from a digest that says rank 1's weights equal rank 0's."""
    verdict, origin, _ = _verdict(_record(2, "nonfinite_grad_norm", 0, [FC1], pre_reduction="clean"),
                                  _state(0, "same"), _state(1, "same", [FC1]))
    assert verdict.rule == "records_conflict"
    assert [entry["global_rank"] for entry in origin] == [0, 1]
    assert f"yet only one of them holds {FC1} non-finite" in verdict.summary


def test_a_reduction_found_clean_by_one_rank_and_bad_by_its_peer():
    """Before: tensor_parallel_collective (a transfer fault) on the word of one rank, against its peer's."""
    def rerun(rank, reduction):
        record = _record(2, "rerun", rank, trigger="nonfinite_grad_norm", role="origin", micro_batch=0,
                         module="decoder.layers.0.mlp.linear_fc2", observed=observed("reproducible"),
                         reduction=reduction, bundle=None, batch=None, megatron=None,
                         **{"class": "RowParallelLinear", "version": 2})
        record["rank"].update(tp=rank, dp=0, dp_size=1)
        return record

    norm = [_record(2, "nonfinite_grad_norm", rank, [FC1], pre_reduction="clean") for rank in (0, 1)]
    verdict, _, _ = _verdict(*norm, rerun(0, "collective"), rerun(1, "partial"))
    assert verdict.rule == "records_conflict"
    assert "found every partial sum of a tensor-parallel reduction finite" in verdict.summary


def test_records_that_agree_are_no_conflict():
    pre = _record(2, "pre_reduction", 0, [FC1])
    norm = _record(2, "nonfinite_grad_norm", 0, [FC1], pre_reduction="nonfinite")
    verdict, _, _ = _verdict(pre, norm, _state(0, "a", [FC1]), _state(1, "b"))
    assert verdict.rule != "records_conflict"
