"""A grad norm given as a tensor: read when its copy has reached the host, and the step's bookkeeping
waits for it. On a GPU the copy lands later than the step's end; a scalar whose copy has not landed
stands in for that here (a CUDA event cannot be made on this CPU-only machine)."""

from __future__ import annotations

import math

import torch

from gradnan.training.norms import DeviceScalar, PendingNorms


class InFlight(DeviceScalar):
    """A device scalar whose copy lands only when read with waiting."""

    def __init__(self, value: float) -> None:
        super().__init__(torch.tensor([value]))
        self.landed = False

    def ready(self) -> bool:
        return self.landed

    def read(self) -> float:
        self.landed = True
        return super().read()


def test_a_cpu_norm_is_read_at_once_as_the_number_it_holds():
    assert DeviceScalar(torch.tensor([2.5, 7.0])).ready()
    assert DeviceScalar(torch.tensor([2.5, 7.0])).read() == 2.5
    assert math.isnan(DeviceScalar(torch.tensor(float("nan"), dtype=torch.bfloat16)).read())


def test_the_step_bookkeeping_waits_for_a_norm_in_flight_then_follows_the_finding():
    events = []
    norms = PendingNorms()
    norms.add(InFlight(math.inf), lambda value: events.append(("nonfinite", value)))
    norms.then(lambda: events.append("step finished"))
    assert events == []
    assert norms.settle(wait=False) is False and events == []
    assert norms.settle(wait=True) is True
    assert events == [("nonfinite", math.inf), "step finished"]
    assert norms.settle(wait=False) is True and len(events) == 2  # nothing left in flight, nothing run twice


def test_a_finite_norm_only_releases_the_step_and_a_landed_one_needs_no_wait():
    events = []
    norms = PendingNorms()
    landed = InFlight(1.0)
    norms.add(landed, lambda value: events.append(value))
    norms.then(lambda: events.append("step finished"))
    landed.landed = True
    assert norms.settle(wait=False) is True
    assert events == ["step finished"]


def test_with_nothing_pending_the_step_finishes_at_once():
    events = []
    PendingNorms().then(lambda: events.append("step finished"))
    assert events == ["step finished"]


def test_the_step_finishes_even_when_the_finding_stops_the_run():
    events = []
    norms = PendingNorms()

    def stop(value):
        raise KeyboardInterrupt("on_nonfinite=raise")

    norms.add(InFlight(math.nan), stop)
    norms.then(lambda: events.append("step finished"))
    try:
        norms.settle(wait=True)
    except KeyboardInterrupt:
        events.append("stopped")
    assert events == ["step finished", "stopped"]
