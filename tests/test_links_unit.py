"""Issue 48 case 2: the training side's per-direction record of a stage's pipeline transfers
(``training.links``) and the record field's check at the reader (``formats.records``)."""

from __future__ import annotations

import math

import pytest
import torch

from gradnan.errors import InputError
from gradnan.events import PipelineTransfer
from gradnan.formats import records
from gradnan.training.links import PipelineLinks


def _transfer(sent=None, received=None, complete=True):
    return PipelineTransfer(sent, None, received, None, complete)


def test_each_direction_counts_its_transfers_and_names_the_first_non_finite_one():
    step = [1]
    links = PipelineLinks(lambda: step[0])
    assert links.read() is None  # no transfer yet: no pipeline to speak of
    links.observe(_transfer(sent=torch.ones(4)))
    links.observe(_transfer(sent=torch.tensor([1.0, math.nan]), received=torch.ones(2)))
    links.observe(_transfer(received=torch.tensor([math.inf]), complete=False))  # not readable
    assert links.read() == {"sent_forward": {"transfers": 2, "first_nonfinite": 1, "unchecked": 0},
                            "received_forward": {"transfers": 2, "first_nonfinite": None, "unchecked": 1}}
    step[0] = 2  # the next step starts afresh
    assert links.read() is None
    links.observe(_transfer(received=torch.tensor([math.inf])))
    assert links.read() == {"received_forward": {"transfers": 1, "first_nonfinite": 0, "unchecked": 0}}


def _record(links):
    return {"schema": "gradnan.record", "version": 2, "kind": "nonfinite_grad_norm", "step": 2,
            "rank": {"global_rank": 0}, "params": [], "pipeline_links": links}


@pytest.mark.parametrize("links", [
    "finite", {"sent_sideways": {"transfers": 1, "first_nonfinite": None, "unchecked": 0}},
    {"sent_forward": {"transfers": 1, "first_nonfinite": 1, "unchecked": 0}},
    {"sent_forward": {"transfers": 1, "first_nonfinite": None, "unchecked": 2}},
    {"sent_forward": {"transfers": True, "first_nonfinite": None, "unchecked": 0}}])
def test_a_malformed_pipeline_links_field_is_refused_in_one_line(links):
    with pytest.raises(InputError, match="pipeline_links"):
        records.from_json(_record(links), "r.jsonl:1")


def test_a_well_formed_pipeline_links_field_reads():
    links = {"received_backward": {"transfers": 3, "first_nonfinite": 2, "unchecked": 0}}
    assert records.from_json(_record(links), "r.jsonl:1")["pipeline_links"] == links


def test_each_finding_goes_to_its_own_direction_whatever_came_first():
    """A later stage receives before it sends: its received NaN is not handed to what it sent."""
    links = PipelineLinks(lambda: 1)
    links.observe(_transfer(received=torch.tensor([math.nan])))
    links.observe(_transfer(sent=torch.ones(2)))
    assert links.read() == {"sent_forward": {"transfers": 1, "first_nonfinite": None, "unchecked": 0},
                            "received_forward": {"transfers": 1, "first_nonfinite": 0, "unchecked": 0}}
