"""The arithmetic checks: every rank runs the same seeded matmul/softmax/layer-norm workload in
fp32/bf16/fp16 and hashes each result; the hashes are compared bitwise across ranks and the majority of
each repeat is taken as right."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from .wording import dtype_name, first_line

SEED = 20240917
ARITHMETIC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Workload = Dict[str, Callable[[], torch.Tensor]]  # check name -> its computation, the same on every rank


def checksum(tensor: torch.Tensor) -> str:
    """SHA-256 of the raw bytes: two results hash alike only if every bit is alike."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def flip_lowest_bit(tensor: torch.Tensor) -> torch.Tensor:
    """A copy whose first element has its lowest mantissa bit flipped: the smallest silent corruption."""
    flipped = tensor.clone()
    bits = flipped.view(_SAME_WIDTH_INT[flipped.element_size()]).reshape(-1)
    bits[0] ^= 1
    return flipped


def majority(values: Sequence[Hashable]) -> Optional[Hashable]:
    """The value held by more ranks than any other value; None on a tie, where no rank can be called right."""
    top = Counter(values).most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return None
    return top[0][0]


def arithmetic_workload(size: int, device: torch.device) -> Tuple[Workload, Dict[str, str]]:
    """Named zero-argument checks, identical on every rank, and the reason for each one this device cannot
    run. Inputs come from a seeded CPU generator, so every rank starts from the same bits."""
    checks, skipped = {}, {}
    for suffix, dtype in ARITHMETIC_DTYPES.items():
        for op, make in (("matmul", _matmul), ("softmax", _softmax), ("layer_norm", _layer_norm)):
            name = f"{op}_{suffix}"
            try:
                make(2, dtype, device)()  # a tiny probe: is this op implemented for dtype on device?
            except (RuntimeError, NotImplementedError) as exc:
                skipped[name] = f"{op} in {suffix} is not supported on {device.type}: {first_line(exc)}"
                continue
            checks[name] = make(size, dtype, device)
    return checks, skipped


def _seeded(shapes: Sequence[Tuple[int, ...]], dtype: torch.dtype,
            device: torch.device) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randn(shape, generator=generator).to(device=device, dtype=dtype) for shape in shapes]


def _matmul(size: int, dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    left, right = _seeded([(size, size), (size, size)], dtype, device)
    return lambda: left @ right


def _softmax(size: int, dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    [logits] = _seeded([(size, size)], dtype, device)
    return lambda: torch.softmax(logits, dim=-1)


def _layer_norm(size: int, dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    hidden, weight, bias = _seeded([(size, size), (size,), (size,)], dtype, device)
    return lambda: torch.nn.functional.layer_norm(hidden, (size,), weight, bias)


def repeat_checksums(workload: Workload, names: Sequence[str], perturb: bool) -> Dict[str, str]:
    """One repeat of the checks ``names`` on this rank: the checksum of each result. ``perturb`` (the test
    switch): the first check's result has one bit flipped, as silent corruption would."""
    checksums = {}
    for name in names:
        result = workload[name]()
        if perturb and name == names[0]:
            result = flip_lowest_bit(result)
        checksums[name] = checksum(result)
    return checksums


def split_plans(plans: Sequence[Tuple[List[str], Dict[str, str]]]) -> Tuple[List[str], List[Dict[str, Any]]]:
    """From every rank's (checks it can run, reasons for those it cannot): the checks every rank runs, in
    rank 0's order, and the others with the ranks that could not run them and why."""
    common = [name for name in plans[0][0] if all(name in names for names, _ in plans)]
    skipped = []
    for name in sorted({name for names, reasons in plans for name in [*names, *reasons]} - set(common)):
        unable = [rank for rank, (_, reasons) in enumerate(plans) if name in reasons]
        skipped.append({"name": name, "ranks": unable, "reason": plans[unable[0]][1][name]})
    return common, skipped


@dataclass
class Tally:
    """One arithmetic check over its repeats: what each rank produced, and how often it was outvoted.

    A repeat without a majority (ranks split evenly) fails every rank: any of them may be the wrong one."""

    world_size: int
    repeats: int = 0
    repeats_without_majority: int = 0
    majority_checksums: Counter = field(default_factory=Counter)
    checksums: List[Counter] = field(init=False)
    outvoted: List[int] = field(init=False)
    first_outvoted: List[Optional[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.checksums = [Counter() for _ in range(self.world_size)]
        self.outvoted = [0] * self.world_size
        self.first_outvoted = [None] * self.world_size

    def add(self, values: Sequence[str]) -> None:
        """One repeat: ``values[rank]`` is that rank's checksum."""
        winner = majority(values)
        if winner is None:
            self.repeats_without_majority += 1
        else:
            self.majority_checksums[winner] += 1
        for rank, value in enumerate(values):
            self.checksums[rank][value] += 1
            if winner is not None and value != winner:
                self.outvoted[rank] += 1
                if self.first_outvoted[rank] is None:
                    self.first_outvoted[rank] = self.repeats
        self.repeats += 1

    def entry(self, name: str) -> Dict[str, Any]:
        """The check as written in the JSON result."""
        op, _, suffix = name.rpartition("_")
        ranks = []
        for rank in range(self.world_size):
            problems = []
            if self.outvoted[rank]:
                problems.append(f"differs from the majority in {self.outvoted[rank]} of {self.repeats}"
                                f" repeat(s), first in repeat {self.first_outvoted[rank]}")
            if self.repeats_without_majority:
                problems.append(f"no majority in {self.repeats_without_majority} of {self.repeats} repeat(s)"
                                " (the ranks split evenly: which one is wrong is unknown)")
            row: Dict[str, Any] = {"rank": rank, "agrees": not problems, "outvoted": self.outvoted[rank],
                   "first_outvoted": self.first_outvoted[rank], "checksums": dict(self.checksums[rank])}
            if problems:
                row["detail"] = "; ".join(problems)
            ranks.append(row)
        return {"name": name, "kind": "arithmetic", "op": op, "dtype": dtype_name(ARITHMETIC_DTYPES[suffix]),
                "repeats": self.repeats, "pass": all(row["agrees"] for row in ranks),
                "majority_checksums": dict(self.majority_checksums),
                "repeats_without_majority": self.repeats_without_majority, "ranks": ranks}
