"""Replica divergence: data-parallel replicas hold bitwise equal weights after every step, so a replica whose
weights differ from its peers' was corrupted (silent data corruption: a flipped bit that need never become a
NaN, and trains on).

Every ``replica_check_every`` steps, as the optimizer step begins (the weights the step's forward pass used,
gathered where a distributed optimizer shards them), each rank sums every parameter's bit patterns on the
device (``weights.bit_sum``: integers, exact and the same in any order), keeps those sums on the device and
combines them into one value; the data-parallel peers compare it through one asynchronous all-reduce of two
integers (the largest value and the negated smallest: they differ iff the replicas do). Its result is read
where the host next waits for the device anyway before the update (Megatron's grad norm read as a number),
else at the next check, from host memory it landed in: no host sync is added, between checks or at one.

Only where it says the replicas differed, the peers gather the per-parameter sums they kept from that check
(which parameters differ, and which replicas: those unlike a strict majority, or all of them where none
holds one, as with two replicas), then a narrower digest of each such parameter's current values, per block
and then per element: its first differing element, where the copies still differ (a distributed optimizer's
next gather, or a mixed-precision optimizer's copy from its main weights, may have overwritten it since).
The first divergence ends the checks: the replicas stay apart until the job restarts.
"""

from __future__ import annotations

import collections
import ctypes
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..formats.schema import json_float
from .scan import SCANNED_DTYPES, integer_view, unravel
from .weights import bit_sum

MAX_LOCATED = 4  # differing parameters whose first differing element is searched (all are counted)
MAX_NAMED_RANKS = 64  # differing ranks a record lists (all are counted)
BLOCKS = 4096  # a parameter's narrower digest: at most this many block sums, then one block's elements

Weights = List[Tuple[str, torch.Tensor]]


@dataclass
class Check:
    """One check in flight: its step, the per-parameter sums it kept on the device, the all-reduce's result
    and where it lands on the host."""

    step: int
    iteration: Optional[int]
    names: List[str]
    sums: torch.Tensor
    result: torch.Tensor
    work: Any
    host: torch.Tensor
    landed: Optional[torch.cuda.Event]

    def differed(self) -> bool:
        """Whether the replicas' digests differed: the host memory read as memory, not through a tensor
        call (the copy landed long ago; on the CPU the all-reduce is waited for here)."""
        if self.landed is not None:
            self.landed.synchronize()
        else:
            self.work.wait()
        largest = ctypes.c_int64.from_address(self.host.data_ptr()).value
        negated_smallest = ctypes.c_int64.from_address(self.host.data_ptr() + 8).value
        return largest != -negated_smallest


@dataclass(frozen=True)
class Divergence:
    """What the peers found at a check whose replicas differed (the same on every peer): the global ranks
    whose weights differ (from a strict majority's, else every peer's), how many peers agree on the other
    copy (None: no majority), and the differing parameters in registration order, the first
    ``MAX_LOCATED`` with their first differing element now (None where the copies agree again), this
    rank's value there and the majority's."""

    step: int
    iteration: Optional[int]
    replicas: int
    agreeing: Optional[int]
    ranks: Tuple[int, ...]
    params: Tuple[Dict[str, Any], ...]
    params_total: int
    last_equal_step: Optional[int] = None  # the last check before it that saw the replicas equal

    def record_fields(self, read_at: int) -> Dict[str, Any]:
        return {"iteration": self.iteration, "read_at_step": read_at, "last_equal_step": self.last_equal_step,
                "replicas": self.replicas,
                "agreeing": self.agreeing, "differing_ranks": list(self.ranks[:MAX_NAMED_RANKS]),
                "differing_total": len(self.ranks), "diverged": list(self.params),
                "diverged_total": self.params_total}


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Every peer's ``tensor`` (one shape on all), stacked in the group's rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(gathered, tensor.contiguous(), group=group)
    return torch.stack(gathered)


def _first_unequal(rows: torch.Tensor) -> Optional[int]:
    """The first column whose entries are not all equal (rows: one per peer)."""
    unequal = (rows != rows[:1]).any(dim=0).nonzero()
    return int(unequal[0, 0]) if unequal.numel() else None


def _value(bits: int, dtype: torch.dtype) -> Any:
    """A bit pattern of ``dtype``'s width read as that dtype, for a record."""
    width = integer_view(torch.zeros(1, dtype=dtype)).dtype
    return json_float(float(torch.tensor([bits], dtype=width).view(dtype)[0]))


def _first_differing_element(tensor: torch.Tensor, group: Any, size: int) -> Optional[Tuple[int, List[int]]]:
    """The first element where the peers' copies of ``tensor`` differ now, and each peer's bit pattern
    there: block sums gathered, then the first differing block's elements (two all-gathers, a few kilobytes
    each). None where they agree."""
    bits = integer_view(tensor.detach()).reshape(-1)
    block = max(1, math.ceil(bits.numel() / BLOCKS))
    first_block = _first_unequal(_all_gather(_block_sums(bits, block), group, size))
    if first_block is None:
        return None
    elements = _all_gather(bits[first_block * block:(first_block + 1) * block].to(torch.int64), group, size)
    within = _first_unequal(elements)
    if within is None:
        return None
    return first_block * block + within, [int(value) for value in elements[:, within].tolist()]


def _block_sums(bits: torch.Tensor, block: int) -> torch.Tensor:
    """The sums of consecutive ``block`` elements (the last block may be shorter), one kernel for the whole
    blocks and one for the tail."""
    whole = bits.numel() // block * block
    sums = torch.sum(bits[:whole].view(-1, block), dim=1, dtype=torch.int64)
    if whole < bits.numel():
        sums = torch.cat([sums, torch.sum(bits[whole:], dtype=torch.int64).reshape(1)])
    return sums


class ReplicaCheck:
    """The periodic comparison of this rank's weights with its data-parallel peers'. ``group``: the
    data-parallel process group (None, or a group of one: nothing to compare)."""

    def __init__(self, every: int, group: Callable[[], Any]) -> None:
        self._every, self._group = every, group
        self._pending: Optional[Check] = None
        self._last_equal: Optional[int] = None  # the step of the last check read that saw them equal

    def due(self, step: int) -> bool:
        """A check is due, or the last one's result is to be read."""
        return self._every > 0 and step % self._every == 0

    @torch.no_grad()
    def at_step(self, step: int, iteration: Optional[int], weights: Callable[[], Weights],
                ) -> Optional[Divergence]:
        """At a due step, on every peer: read the last check if it is still pending (and, where the replicas
        differed, find where), then start this step's. Returns the last check's divergence, if any."""
        group = self._group()
        size = torch.distributed.get_world_size(group) if group is not None else 1
        if size < 2:
            return None
        named = weights()
        found = self._read(dict(named), group, size)
        self._pending = self.start(step, iteration, named, group)
        return found

    @torch.no_grad()
    def host_waited(self, weights: Callable[[], Weights]) -> Optional[Divergence]:
        """The host has just waited for the device after the check was started (a grad norm read as a number,
        before the update): its result has landed on every peer alike, and the weights are still the ones it
        compared. Read it now, on every peer."""
        if self._pending is None:
            return None
        group = self._group()
        return self._read(dict(weights()), group, torch.distributed.get_world_size(group))

    def _read(self, now: Dict[str, torch.Tensor], group: Any, size: int) -> Optional[Divergence]:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if not pending.differed():
            self._last_equal = pending.step
            return None
        self._every = 0  # the first divergence is the one to record: the replicas stay apart from now on
        return replace(self._locate(pending, now, group, size), last_equal_step=self._last_equal)

    @staticmethod
    def start(step: int, iteration: Optional[int], named: Weights, group: Any) -> Check:
        """One check: the sums, the digest and its all-reduce started (what benchmarks/overhead.py times)."""
        sums = torch.stack([bit_sum([tensor]) for _, tensor in named])
        odd = torch.arange(1, 2 * len(named), 2, dtype=torch.int64, device=sums.device)
        digest = torch.sum(sums * odd)  # integers wrap: still exact, still equal on equal replicas
        result = torch.stack([digest, -digest])
        work = torch.distributed.all_reduce(result, op=torch.distributed.ReduceOp.MAX, group=group,
                                            async_op=True)
        landed = None
        host = result
        if result.is_cuda:
            work.wait()  # the current stream waits for the all-reduce; the host does not
            host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host.copy_(result, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
        return Check(step, iteration, [name for name, _ in named], sums, result, work, host, landed)

    @staticmethod
    def _locate(check: Check, now: Dict[str, torch.Tensor], group: Any, size: int) -> Divergence:
        """On every peer alike (each collective's use is decided from gathered values, the same on all)."""
        ranks = torch.distributed.get_process_group_ranks(group)
        rows = _all_gather(check.sums, group, size)
        keyed = [tuple(row) for row in rows.tolist()]
        counts = collections.Counter(keyed)
        common, agreeing = counts.most_common(1)[0]
        majority = common if 2 * agreeing > size else None
        differing = tuple(rank for rank, row in zip(ranks, keyed) if majority is None or row != majority)
        unequal = (rows != rows[:1]).any(dim=0).nonzero().reshape(-1).tolist()
        reference = keyed.index(majority) if majority is not None else None
        me = torch.distributed.get_rank(group)
        params = []
        for position in unequal[:MAX_LOCATED]:
            name = check.names[position]
            tensor = now.get(name)
            entry: Dict[str, Any] = {"name": name, "numel": None, "flat": None, "index": None, "value": None,
                                     "majority_value": None}
            if tensor is not None:
                entry["numel"] = tensor.numel()
                located = _first_differing_element(tensor, group, size)
                if located is not None:
                    flat, bits = located
                    entry.update(flat=flat, index=unravel(flat, tensor.shape),
                                 value=_value(bits[me], tensor.dtype),
                                 majority_value=None if reference is None else _value(bits[reference],
                                                                                      tensor.dtype))
            params.append(entry)
        return Divergence(check.step, check.iteration, size, agreeing if majority is not None else None,
                          differing, tuple(params), len(unequal))


def compared_weights(weights: Weights, expert_names: Sequence[str]) -> Weights:
    """The weights every data-parallel peer holds alike, of the dtypes whose bits are summed: expert
    parameters are replicated over the expert-data-parallel group instead, and left out."""
    experts = set(expert_names)
    return [(name, tensor) for name, tensor in weights
            if name not in experts and tensor.numel() and tensor.dtype in SCANNED_DTYPES]
