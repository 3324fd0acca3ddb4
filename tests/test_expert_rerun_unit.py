"""Issue 48, case 1 (expert parallelism), what needs no job: a ``rerun`` record's ``origin_rank`` read at
the boundary, and the origin the records name whose own files are absent (``origins_absent``)."""

from __future__ import annotations

import pytest

from gradnan.errors import InputError
from gradnan.formats.records import from_json
from gradnan.offline.incident.rerun_finding import rerun_finding

OBSERVED = {"reproduced": True, "loss": "nonfinite", "loss_again": "nonfinite", "own_gradients": "nonfinite",
            "norm_overflow": False, "megatron_job": None}


def rerun_record(rank, role, module, **extra):
    return {"schema": "gradnan.record", "version": 2, "kind": "rerun", "step": 2, "iteration": None,
            "time": 1.0, "rank": {"global_rank": rank, "world_size": 2, "host": "h", "device": "cpu"},
            "run": {"id": "r", "start": 1.0}, "params": [], "params_total": 0, "role": role,
            "observed": OBSERVED, "module": module, "class": "MLP", "call": 3, "micro_batch": 0,
            "output_abs_max": "inf", "frames_traced": 20, "bundle": None, "batch": None, **extra}


RECEIVER = rerun_record(0, "receiver", "decoder.layers.0.mlp", origin_rank=1)
ORIGIN = rerun_record(1, "origin", "decoder.layers.0.mlp.experts.local_experts.2", origin_rank=1)


def test_the_reader_accepts_origin_rank_absent_null_or_an_integer_and_refuses_anything_else():
    clean = rerun_record(0, "clean", None)
    for record in (clean, {**clean, "origin_rank": None}, RECEIVER):
        from_json(record, "f:1")
    for bad in ("1", 1.5, True, [1]):
        with pytest.raises(InputError, match="origin_rank"):
            from_json({**RECEIVER, "origin_rank": bad}, "f:1")


def test_an_origin_named_by_the_receivers_whose_own_record_is_absent_is_listed():
    assert rerun_finding([from_json(RECEIVER, "f:1")]).origins_absent == (1,)
    both = rerun_finding([from_json(RECEIVER, "f:1"), from_json(ORIGIN, "f:2")])
    assert both.origins_absent == () and both.module == "decoder.layers.0.mlp.experts.local_experts.2"
