"""``gradnan selftest``: is the GPU behind a NaN bad? Launched like training, on every rank.

Silent data corruption shows up as arithmetic that differs from the other GPUs on the same input. Every
rank checks that it can reach the others (an all-reduce of known values in the world group and, with
``--tp``/``--pp``, in its tp/pp/dp groups), then runs the same seeded matmul/softmax/layer-norm workload
in fp32/bf16/fp16, hashes each result, and compares the hashes bitwise across ranks. The majority value
of each check is taken as right; rank 0 names every rank that disagrees or cannot be reached, prints
PASS or FAIL and writes ``<out>/selftest/selftest-<UTC time>.json`` (``gradnan.selftest``, version 1).

Nothing waits forever: the rendezvous, every collective and the barriers that name missing ranks are
bounded by ``--timeout``. Docs: docs/selftest.md. The small pure functions come first, the distributed
orchestration after them.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import os
import re
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch

from ..formats import selftest as result_format
from ..formats.layout import SELFTEST_DIR
from ..formats.schema import write_json_atomic

EXIT_PASS, EXIT_FAIL, EXIT_BAD_ARGUMENTS = 0, 1, 2
PERTURB_ENV = "GRADNAN_SELFTEST_PERTURB_RANK"  # test only: flip one bit of one result on that rank
STALL_ENV = "GRADNAN_SELFTEST_STALL_RANK"  # test only: that rank stops answering, as a hung device would
DEFAULT_SECONDS = 30.0
DEFAULT_TIMEOUT = 60.0
MAX_SECONDS = 7 * 24 * 3600.0  # a datetime.timedelta holds far more, but no test or wait needs longer
DEFAULT_SIZE = {"cuda": 4096, "cpu": 256}
SEED = 20240917
ARITHMETIC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMMUNICATION_DTYPES = (torch.int64, torch.float32, torch.bfloat16)
_STORE_PREFIX = "gradnan_selftest/"
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BARRIER_MISSING = re.compile(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier")


class BadArguments(Exception):
    """Options or launch environment that cannot work; the message is one line."""


class LostContact(Exception):
    """A bounded collective or rendezvous gave up. ``ranks``: the ones named as missing (rank 0 only)."""

    def __init__(self, phase: str, ranks: Sequence[int], error: str) -> None:
        super().__init__(f"{phase}: {error}")
        self.phase, self.ranks, self.error = phase, list(ranks), error


# ----------------------------------------------------------------------------------------------------
# Pure pieces


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


def layout_groups(world_size: int, tp: int, pp: int) -> Dict[str, List[List[int]]]:
    """The tp, pp and dp groups of Megatron's default rank order (tp fastest, then dp, then pp)."""
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"tp {tp} x pp {pp} does not divide the world size {world_size}")
    dp = world_size // (tp * pp)
    stage = tp * dp
    return {
        "tp": [list(range(start, start + tp)) for start in range(0, world_size, tp)],
        "pp": [list(range(first, world_size, stage)) for first in range(stage)],
        "dp": [list(range(p * stage + t, (p + 1) * stage, tp)) for p in range(pp) for t in range(tp)],
    }


def allreduce_input(members: Sequence[int], rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros except this rank's own slot, which holds rank+1 (+0.5 for floats): the sum is fully known and
    a wrong slot names the rank whose contribution was lost or changed."""
    contribution = torch.zeros(len(members), dtype=dtype)
    contribution[members.index(rank)] = _known_value(rank, dtype)
    return contribution


def allreduce_expected(members: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([_known_value(member, dtype) for member in members], dtype=dtype)


def _known_value(rank: int, dtype: torch.dtype) -> float:
    return rank + 1 if not dtype.is_floating_point else rank + 1.5


def allreduce_mismatch(received: torch.Tensor, members: Sequence[int], dtype: torch.dtype) -> Optional[str]:
    """None when the all-reduce gave exactly the known sum, else what arrived wrong and from whom."""
    expected = allreduce_expected(members, dtype)
    wrong = [member for member, bad in zip(members, (received.cpu() != expected).tolist()) if bad]
    if not wrong:
        return None
    return (f"received {_short(received.tolist())} instead of {_short(expected.tolist())}: the contribution"
            f" of rank(s) {_short(wrong)} arrived wrong")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _short(values: List[Any], limit: int = 8) -> str:
    return str(values) if len(values) <= limit else f"{str(values[:limit])[:-1]}, ... ({len(values)} values)]"


def ranks_named_in(barrier_error: str) -> List[int]:
    """The ranks a failed ``monitored_barrier`` names on rank 0 (other ranks' errors name none)."""
    found = _BARRIER_MISSING.search(barrier_error)
    return [int(rank) for rank in re.findall(r"\d+", found.group(1))] if found else []


def launch_environment(environ: Mapping[str, str]) -> Tuple[int, int, int, str, int]:
    """(rank, world size, local rank, master address, master port) as torchrun or srun set them."""
    if "RANK" in environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif "SLURM_PROCID" in environ:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    else:
        raise BadArguments("not launched by torchrun or srun: neither RANK nor SLURM_PROCID is set")
    rank, world_size, local_rank = (_int_variable(environ, name) for name in names)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise BadArguments(f"{names[0]}={rank}, {names[1]}={world_size}, {names[2]}={local_rank} do not fit")
    if not environ.get("MASTER_ADDR"):
        raise BadArguments("MASTER_ADDR is not set (under srun, export the first host of the job)")
    port = _int_variable(environ, "MASTER_PORT")
    if not 0 < port < 65536:
        raise BadArguments(f"MASTER_PORT={port} is not a TCP port")
    return rank, world_size, local_rank, environ["MASTER_ADDR"], port


def _int_variable(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise BadArguments(f"{name} is not set")
    try:
        return int(value)
    except ValueError:
        raise BadArguments(f"{name}={value!r} is not an integer") from None


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
                problems.append(f"differs from the majority in {self.outvoted[rank]} of {self.repeats} repeat(s),"
                                f" first in repeat {self.first_outvoted[rank]}")
            if self.repeats_without_majority:
                problems.append(f"no majority in {self.repeats_without_majority} of {self.repeats} repeat(s)"
                                " (the ranks split evenly: which one is wrong is unknown)")
            row = {"rank": rank, "agrees": not problems, "outvoted": self.outvoted[rank],
                   "first_outvoted": self.first_outvoted[rank], "checksums": dict(self.checksums[rank])}
            if problems:
                row["detail"] = "; ".join(problems)
            ranks.append(row)
        return {"name": name, "kind": "arithmetic", "op": op, "dtype": dtype_name(ARITHMETIC_DTYPES[suffix]),
                "repeats": self.repeats, "pass": all(row["agrees"] for row in ranks),
                "majority_checksums": dict(self.majority_checksums),
                "repeats_without_majority": self.repeats_without_majority, "ranks": ranks}


def communication_entries(results_by_rank: Sequence[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Every rank's own communication results (``results_by_rank[rank]``), one JSON check per name."""
    entries: Dict[str, Dict[str, Any]] = {}
    for rank, results in enumerate(results_by_rank):
        for result in results:
            entry = entries.setdefault(result["name"], {
                "name": result["name"], "kind": "communication", "group": result["group"],
                "dtype": result["dtype"], "pass": True, "ranks": []})
            row = {"rank": rank, "members": result["members"], "agrees": result["detail"] is None}
            if result["detail"] is not None:
                row["detail"] = result["detail"]
                entry["pass"] = False
            entry["ranks"].append(row)
    return list(entries.values())


def split_plans(plans: Sequence[Tuple[List[str], Dict[str, str]]]) -> Tuple[List[str], List[Dict[str, Any]]]:
    """From every rank's (checks it can run, reasons for those it cannot): the checks every rank runs, in
    rank 0's order, and the others with the ranks that could not run them and why."""
    common = [name for name in plans[0][0] if all(name in names for names, _ in plans)]
    skipped = []
    for name in sorted({name for names, reasons in plans for name in [*names, *reasons]} - set(common)):
        unable = [rank for rank, (_, reasons) in enumerate(plans) if name in reasons]
        skipped.append({"name": name, "ranks": unable, "reason": plans[unable[0]][1][name]})
    return common, skipped


def failing_ranks(checks: Sequence[Dict[str, Any]], unreachable: Optional[Dict[str, Any]],
                  ranks: Mapping[int, Dict[str, Any]], timeout: float) -> List[Dict[str, Any]]:
    """Every rank named by a check or by a timed-out barrier, with host, device and why."""
    reasons: Dict[int, List[str]] = {}
    for check in checks:
        for row in check["ranks"]:
            if not row["agrees"]:
                reasons.setdefault(row["rank"], []).append(f"{check['name']}: {row['detail']}")
    if unreachable:
        for rank in unreachable["ranks"]:
            reasons.setdefault(rank, []).append(f"did not reach {unreachable['phase']} within {timeout:g} s")
    return [{"rank": rank, "host": ranks.get(rank, {}).get("host"), "device": ranks.get(rank, {}).get("device"),
             "reasons": why} for rank, why in sorted(reasons.items())]


def build_document(*, started: datetime.datetime, world_size: int, layout: Optional[Dict[str, int]],
                   backend: str, size: int, seconds: Optional[float], repeats: int, timeout: float,
                   ranks: Mapping[int, Dict[str, Any]], checks: List[Dict[str, Any]],
                   skipped: List[Dict[str, Any]], unreachable: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``gradnan.selftest`` result (docs/selftest.md)."""
    failing = failing_ranks(checks, unreachable, ranks, timeout)
    return {
        **result_format.SCHEMA.header(),
        "time": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "world_size": world_size, "layout": layout, "backend": backend, "size": size,
        "seconds": seconds, "repeats": repeats, "timeout": timeout,
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "ranks": [{"rank": rank, **ranks[rank]} for rank in sorted(ranks)],
        "checks": checks, "skipped": skipped, "unreachable": unreachable,
        "failing_ranks": failing,
        "pass": not failing and unreachable is None and all(check["pass"] for check in checks),
    }


def format_text(document: Dict[str, Any], path: Optional[Path]) -> str:
    """What rank 0 prints: a line per phase, every rank named with why, the file, then PASS or FAIL."""
    lines = []
    for kind in ("communication", "arithmetic"):
        checks = [check for check in document["checks"] if check["kind"] == kind]
        if checks:
            bad = sum(not check["pass"] for check in checks)
            repeats = f" x {checks[0]['repeats']} repeat(s)" if kind == "arithmetic" else ""
            verdict = f"{bad} failed" if bad else "all ranks agree"
            lines.append(f"{kind}: {len(checks)} check(s){repeats}, {verdict}")
    for skip in document["skipped"]:
        lines.append(f"skipped {skip['name']} on rank(s) {_short(skip['ranks'])}: {skip['reason']}")
    unreachable = document["unreachable"]
    if unreachable and not unreachable["ranks"]:
        lines.append(f"{unreachable['phase']} failed and named no rank: {unreachable['error']}")
    if document["failing_ranks"]:
        lines.append("Ranks that disagree with the majority or could not communicate:")
        for failing in document["failing_ranks"]:
            where = f"host {failing['host']}, {failing['device']}" if failing["host"] else "host unknown"
            lines.append(f"  rank {failing['rank']} ({where}): {'; '.join(failing['reasons'])}")
    if path is not None:
        lines.append(f"Result: {path}")
    world = document["world_size"]
    if document["pass"]:
        lines.append(f"PASS: all {world} rank(s) communicate and agree bitwise on every check")
    else:
        named = len(document["failing_ranks"])
        lines.append(f"FAIL: {named} of {world} rank(s) named above" if named
                     else f"FAIL: {unreachable['phase']} failed")
    return "\n".join(lines)


def result_path(out_dir: Path, started: datetime.datetime) -> Path:
    """``<out>/selftest/selftest-<UTC time>.json``, claimed exclusively: an existing file is never replaced."""
    directory = out_dir / SELFTEST_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"selftest-{started.strftime('%Y%m%dT%H%M%SZ')}"
    attempt = 1
    while True:
        path = directory / (f"{stem}.json" if attempt == 1 else f"{stem}-{attempt}.json")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            attempt += 1


# ----------------------------------------------------------------------------------------------------
# Options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``selftest`` options. Their values are checked by ``run`` (one-line error, exit code 2)."""
    parser.add_argument("--tp", type=int, help="tensor-parallel size: also check the tp/pp/dp groups")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default 1 when --tp is given)")
    parser.add_argument("--size", type=int,
                        help="square matrix size of the arithmetic checks (default 4096 on GPU, 256 on CPU)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float,
                        help=f"repeat the arithmetic checks for this long (default {DEFAULT_SECONDS:g})")
    budget.add_argument("--repeats", type=int, help="repeat the arithmetic checks this many times instead")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="seconds to wait for a rank at the rendezvous and at each collective"
                             " (default %(default)g)")
    parser.add_argument("--out", default="gradnan_out",
                        help="run directory; the result goes to OUT/selftest/ (default %(default)s)")


@dataclass(frozen=True)
class Settings:
    """Everything this rank needs, resolved from the options and the launch environment once."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    layout: Optional[Dict[str, int]]
    size: int
    seconds: Optional[float]
    repeats: Optional[int]
    timeout: float
    out: Path
    device: torch.device
    perturb_rank: Optional[int]
    stall_rank: Optional[int]

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def timeout_delta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)


def resolve_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Options and launch environment, checked before anything waits on another rank."""
    rank, world_size, local_rank, master_addr, master_port = launch_environment(environ)
    counts = (("--tp", args.tp), ("--pp", args.pp), ("--size", args.size), ("--repeats", args.repeats))
    for option, value in counts:
        if value is not None and value < 1:
            raise BadArguments(f"{option} must be at least 1, not {value}")
    layout = None
    if args.tp is not None or args.pp is not None:
        tp, pp = args.tp or 1, args.pp or 1
        try:
            layout_groups(world_size, tp, pp)
        except ValueError:
            raise BadArguments(f"--tp {tp} x --pp {pp} does not divide the world size {world_size}") from None
        layout = {"tp": tp, "pp": pp, "dp": world_size // (tp * pp)}
    for option, value in (("--seconds", args.seconds), ("--timeout", args.timeout)):
        if value is not None and not (0 < value <= MAX_SECONDS):
            raise BadArguments(f"{option} must be a positive number of seconds up to {MAX_SECONDS:g} (a week),"
                               f" not {value:g}")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if visible > 1 and local_rank >= visible:
            raise BadArguments(f"local rank {local_rank} but only {visible} GPUs visible")
        # One visible GPU: the launcher bound this task to it (srun --gpus-per-task=1), whatever its local rank.
        device = torch.device("cuda", local_rank if visible > 1 else 0)
    out = Path(args.out)
    for directory in (out, out / SELFTEST_DIR):
        if rank == 0 and directory.exists() and not directory.is_dir():
            raise BadArguments(f"--out {out}: {directory} is not a directory")
    return Settings(
        rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr,
        master_port=master_port, layout=layout, size=args.size or DEFAULT_SIZE[device.type],
        seconds=None if args.repeats else (args.seconds or DEFAULT_SECONDS), repeats=args.repeats,
        timeout=args.timeout, out=out, device=device,
        perturb_rank=_test_switch(environ, PERTURB_ENV, world_size),
        stall_rank=_test_switch(environ, STALL_ENV, world_size))


def _test_switch(environ: Mapping[str, str], name: str, world_size: int) -> Optional[int]:
    if name not in environ:
        return None
    rank = _int_variable(environ, name)
    if not 0 <= rank < world_size:
        raise BadArguments(f"{name}={rank} is not a rank of this world (size {world_size})")
    return rank


# ----------------------------------------------------------------------------------------------------
# Arithmetic workload


def arithmetic_workload(size: int, device: torch.device) -> Tuple[Dict[str, Callable[[], torch.Tensor]],
                                                                  Dict[str, str]]:
    """Named zero-argument checks, identical on every rank, and the reason for each one this device cannot
    run. Inputs come from a seeded CPU generator, so every rank starts from the same bits."""
    checks, skipped = {}, {}
    for suffix, dtype in ARITHMETIC_DTYPES.items():
        for op, make in (("matmul", _matmul), ("softmax", _softmax), ("layer_norm", _layer_norm)):
            name = f"{op}_{suffix}"
            try:
                make(2, dtype, device)()  # a tiny probe: is this op implemented for dtype on device?
            except (RuntimeError, NotImplementedError) as exc:
                skipped[name] = f"{op} in {suffix} is not supported on {device.type}: {_first_line(exc)}"
                continue
            checks[name] = make(size, dtype, device)
    return checks, skipped


def _seeded(shapes: Sequence[Tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> List[torch.Tensor]:
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------------
# Distributed orchestration


def run(args: argparse.Namespace) -> int:
    """Run the self-test on this rank; 0 when every check agrees on every rank, 1 when not, 2 for bad input."""
    try:
        settings = resolve_settings(args, os.environ)
    except BadArguments as exc:
        print(f"gradnan: error: selftest: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    return _Selftest(settings).run()


def _this_rank(settings: Settings) -> Dict[str, Any]:
    """Host and device of this process: what a person needs to find the GPU to pull."""
    description: Dict[str, Any] = {"host": socket.gethostname(), "device": str(settings.device),
                                   "local_rank": settings.local_rank}
    if settings.device.type == "cuda":
        properties = torch.cuda.get_device_properties(settings.device)
        description["device_name"] = properties.name
        description["device_uuid"] = str(getattr(properties, "uuid", "")) or None
    return description


class _Selftest:
    """One rank's run. Every phase starts at a monitored barrier, so a rank that stops answering is named."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.ranks: Dict[int, Dict[str, Any]] = {}
        self.checks: List[Dict[str, Any]] = []
        self.skipped: List[Dict[str, Any]] = []
        self.tallies: Dict[str, Tally] = {}
        self.control: Any = None

    def run(self) -> int:
        settings = self.settings
        if settings.device.type == "cuda":
            torch.cuda.set_device(settings.device)
        try:
            self._rendezvous()
            if settings.rank == 0:
                print(self._header(), flush=True)
            results = self._gather(self._communication(), "the end of the communication checks")
            self.checks += communication_entries(results)
            self._arithmetic()
        except LostContact as lost:
            if settings.rank != 0:
                print(f"gradnan selftest: rank {settings.rank}: gave up at {lost.phase}: {lost.error}"
                      " (see rank 0's output)", file=sys.stderr)
                return EXIT_FAIL
            return self._finish({"phase": lost.phase, "ranks": lost.ranks, "error": lost.error})
        code = self._finish(None)
        torch.distributed.destroy_process_group()
        return code

    def _header(self) -> str:
        settings = self.settings
        layout = " ".join(f"{axis}{size}" for axis, size in settings.layout.items()) if settings.layout else "none"
        budget = f"{settings.repeats} repeat(s)" if settings.repeats else f"{settings.seconds:g} s"
        return (f"gradnan selftest: {settings.world_size} rank(s), backend {settings.backend}, layout {layout},"
                f" size {settings.size}, arithmetic for {budget}, timeout {settings.timeout:g} s")

    def _rendezvous(self) -> None:
        """Every rank announces itself in the store before the process group exists, so a rank that never
        starts is named instead of leaving the others to time out blind."""
        settings, dist = self.settings, torch.distributed
        # Under torchrun its agent already serves MASTER_PORT and every rank is a client.
        serves = settings.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        try:
            store = dist.PrefixStore(_STORE_PREFIX, dist.TCPStore(
                settings.master_addr, settings.master_port, settings.world_size, is_master=serves,
                timeout=settings.timeout_delta, wait_for_workers=False))
        except RuntimeError as exc:
            where = f"{settings.master_addr}:{settings.master_port}"
            raise LostContact("the rendezvous", [], f"cannot serve or reach the store at {where} within"
                                                    f" {settings.timeout:g} s: {_first_line(exc)}") from None
        keys = [f"joined/{rank}" for rank in range(settings.world_size)]
        try:
            store.set(keys[settings.rank], json.dumps(_this_rank(settings)))
            try:
                store.wait(keys, settings.timeout_delta)
            except RuntimeError:
                pass  # a rank is missing: which one is read below
            present = [rank for rank, key in enumerate(keys) if store.check([key])]
            if settings.rank == 0:
                self.ranks = {rank: json.loads(store.get(keys[rank])) for rank in present}
        except RuntimeError as exc:
            raise LostContact("the rendezvous", [], f"lost the store: {_first_line(exc)}") from None
        missing = sorted(set(range(settings.world_size)) - set(present))
        if missing:
            raise LostContact("the rendezvous", missing, f"rank(s) {_short(missing)} did not join")
        try:
            dist.init_process_group(
                settings.backend, store=dist.PrefixStore("pg/", store), rank=settings.rank,
                world_size=settings.world_size, timeout=settings.timeout_delta,
                device_id=settings.device if settings.device.type == "cuda" else None)
            # Barriers, results and repeat decisions go over gloo, apart from the group under test.
            self.control = dist.new_group(backend="gloo", timeout=settings.timeout_delta)
        except RuntimeError as exc:
            raise LostContact("process group setup", [], _first_line(exc)) from None

    def _barrier(self, phase: str) -> None:
        try:
            torch.distributed.monitored_barrier(self.control, timeout=self.settings.timeout_delta,
                                                wait_all_ranks=True)
        except RuntimeError as exc:
            raise LostContact(phase, ranks_named_in(str(exc)), _first_line(exc)) from None

    def _gather(self, value: Any, phase: str) -> List[Any]:
        """Every rank's ``value``, on every rank, after a barrier that names the ranks that did not come."""
        self._barrier(phase)
        gathered: List[Any] = [None] * self.settings.world_size
        try:
            torch.distributed.all_gather_object(gathered, value, group=self.control)
        except RuntimeError as exc:
            raise LostContact(phase, [], _first_line(exc)) from None
        return gathered

    def _groups_under_test(self) -> List[Tuple[str, List[int], Any]]:
        """(name, members, group) for the world and this rank's tp/pp/dp groups. Every rank creates every
        group in the same order, as torch.distributed requires."""
        settings, dist = self.settings, torch.distributed
        groups = [("world", list(range(settings.world_size)), dist.group.WORLD)]
        if settings.layout:
            for axis, members_list in layout_groups(settings.world_size, settings.layout["tp"],
                                                    settings.layout["pp"]).items():
                for members in members_list:
                    group = dist.new_group(members, timeout=settings.timeout_delta)
                    if settings.rank in members:
                        groups.append((axis, members, group))
        return groups

    def _communication(self) -> List[Dict[str, Any]]:
        """This rank's all-reduce results on the backend under test; after the first error the rest of
        this rank's checks are not run (its group may be broken), and say so."""
        settings = self.settings
        self._barrier("the communication checks")
        try:
            groups = self._groups_under_test()
        except RuntimeError as exc:
            raise LostContact("creating the tp/pp/dp groups", [], _first_line(exc)) from None
        results, failed = [], False
        for group_name, members, group in groups:
            for dtype in COMMUNICATION_DTYPES:
                detail = "not run: an earlier collective failed on this rank" if failed else None
                if not failed:
                    tensor = allreduce_input(members, settings.rank, dtype).to(settings.device)
                    try:
                        work = torch.distributed.all_reduce(tensor, group=group, async_op=True)
                        work.wait(timeout=settings.timeout_delta)
                        detail = allreduce_mismatch(tensor, members, dtype)
                    except RuntimeError as exc:
                        failed, detail = True, f"all-reduce failed: {_first_line(exc)}"
                results.append({"name": f"allreduce_{group_name}_{dtype_name(dtype)}", "group": group_name,
                                "dtype": dtype_name(dtype), "members": members, "detail": detail})
        return results

    def _arithmetic(self) -> None:
        """Repeat the workload until the repeats or seconds run out (decided from every rank's clock, so
        every rank stops after the same repeat); tally the checksums of each check."""
        settings = self.settings
        workload, cannot_run = arithmetic_workload(settings.size, settings.device)
        if settings.stall_rank == settings.rank:
            time.sleep(10 * settings.timeout)
        common, self.skipped = split_plans(self._gather((list(workload), cannot_run), "the arithmetic checks"))
        self.tallies = {name: Tally(settings.world_size) for name in common}
        start = time.monotonic()
        for repeat in itertools.count():
            checksums = {}
            for name in common:
                result = workload[name]()
                if settings.perturb_rank == settings.rank and name == common[0]:
                    result = flip_lowest_bit(result)
                checksums[name] = checksum(result)
            gathered = self._gather((checksums, time.monotonic() - start), f"arithmetic repeat {repeat}")
            for name, tally in self.tallies.items():
                tally.add([values[name] for values, _ in gathered])
            if (repeat + 1 >= settings.repeats if settings.repeats
                    else max(elapsed for _, elapsed in gathered) >= settings.seconds):
                break

    def _finish(self, unreachable: Optional[Dict[str, Any]]) -> int:
        """Every rank decides the exit code from the same gathered results; rank 0 prints and writes."""
        settings = self.settings
        checks = self.checks + [tally.entry(name) for name, tally in self.tallies.items()]
        document = build_document(
            started=self.started, world_size=settings.world_size, layout=settings.layout,
            backend=settings.backend, size=settings.size, seconds=settings.seconds,
            repeats=max((tally.repeats for tally in self.tallies.values()), default=0), timeout=settings.timeout,
            ranks=self.ranks, checks=checks, skipped=self.skipped, unreachable=unreachable)
        if settings.rank == 0:
            try:
                path = result_path(settings.out, self.started)
                write_json_atomic(path, document)
            except OSError as exc:
                print(format_text(document, None), flush=True)
                print(f"gradnan: error: selftest: cannot write the result under {settings.out}: {exc}",
                      file=sys.stderr)
                return EXIT_BAD_ARGUMENTS
            print(format_text(document, path), flush=True)
        return EXIT_PASS if document["pass"] else EXIT_FAIL
