"""The run-up: each gradient bucket's largest magnitude before the data-parallel collective over the last
``runup_steps`` steps, kept on the device, read back only at an incident.

The statistic is the pre-reduction check's own (``scan.abs_max``: one ``aminmax`` pass per bucket, NaN or
Inf where the bucket holds one), not a sum of squares: torch has no kernel giving both in one pass, so a sum
of squares would read every gradient byte a second time each step, while the abs max is already there and
shows a growing gradient as well. Keeping it costs one device copy of a few numbers per bucket group per
step into a preallocated ``[runup_steps, buckets]`` tensor; the row to write is counted on the host, so
nothing is read back from the device (tests/test_host_syncs.py). At an incident the ring is copied to the
host once and written with the parameter names of each bucket (``formats.runup``)."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional

import torch

from ..events import DescribeContents
from ..formats.schema import json_float


class BucketGroupRing:
    """One bucket group's last ``capacity`` rows of per-bucket magnitudes, oldest overwritten first."""

    def __init__(self, index: int, capacity: int, maxima: torch.Tensor, contents: DescribeContents) -> None:
        self.index, self.contents = index, contents
        self._values = torch.zeros((capacity, maxima.numel()), dtype=torch.float32, device=maxima.device)
        self._steps: List[Optional[int]] = [None] * capacity
        self._written = 0

    def write(self, step: int, maxima: torch.Tensor) -> None:
        """This step's row: a device-to-device copy into the next slot, counted on the host."""
        slot = self._written % len(self._steps)
        self._values[slot].copy_(maxima.reshape(-1))
        self._steps[slot] = step
        self._written += 1

    def to_json(self, group: Any) -> Dict[str, Any]:
        """The rows oldest first, read back from the device (one copy: at an incident only), and the
        buckets of ``group`` (this ring's)."""
        capacity = len(self._steps)
        order = [(self._written + k) % capacity for k in range(capacity)]
        order = [slot for slot in order if self._steps[slot] is not None]
        rows = self._values.cpu().tolist()
        return {"bucket_group": self.index, "steps": [self._steps[slot] for slot in order],
                "buckets": self.contents(group),
                "values": [[json_float(v) for v in rows[slot]] for slot in order]}


class RunUp:
    """Every bucket group's ring (none when ``capacity`` is 0), as long as its group lives (a ring holds no
    reference to its group: ``contents`` is given the group when the run-up is written)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._rings: "weakref.WeakKeyDictionary[Any, BucketGroupRing]" = weakref.WeakKeyDictionary()

    def write(self, group: Any, index: int, step: int, maxima: torch.Tensor,
              contents: DescribeContents) -> None:
        """Keep ``maxima`` (one per bucket of ``group``, numbered ``index``) as ``step``'s row."""
        if not self.capacity:
            return
        with self._lock:
            ring = self._rings.get(group)
            if ring is None:
                ring = self._rings[group] = BucketGroupRing(index, self.capacity, maxima, contents)
        ring.write(step, maxima)

    def to_json(self) -> List[Dict[str, Any]]:
        """Every group's rows, in bucket-group order; empty when nothing was kept."""
        with self._lock:
            rings = sorted(self._rings.items(), key=lambda item: item[1].index)
        return [ring.to_json(group) for group, ring in rings]
