"""One rank's self-test: the options resolved against the launch and the devices, the rendezvous, then
the communication and arithmetic checks, each phase behind a bounded barrier; rank 0 gathers, prints
and writes the result."""

from __future__ import annotations

import datetime
import itertools
import json
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from ..commandline import say
from ..errors import InputError, UsageError
from ..formats.layout import SELFTEST_DIR
from .arithmetic import Tally, arithmetic_workload, repeat_checksums, split_plans
from .communication import allreduce_results, communication_entries, groups_under_test, layout_groups
from .options import (
    DEFAULT_SECONDS,
    DEFAULT_SIZE,
    PERTURB_ENV,
    STALL_ENV,
    SelftestOptions,
    launch_environment,
    switched_rank,
)
from .render import format_header, format_text, show
from .result import build_document, write_result
from .wording import first_line, shortened

_STORE_PREFIX = "gradnan_selftest/"
_BARRIER_MISSING = re.compile(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier")


@dataclass(frozen=True)
class Settings:
    """Everything this rank needs, resolved once from the options, the launch and this machine."""

    rank: int
    """This process's global rank."""
    world_size: int
    """Ranks in the job, every one running the self-test."""
    local_rank: int
    """This process's rank on its node, which picks its GPU."""
    master_addr: str
    """Host of the store every rank announces itself in."""
    master_port: int
    """Port of that store."""
    serves_store: bool
    """Whether this process serves that store: rank 0, unless torchrun's agent already does."""
    layout: Optional[Dict[str, int]]
    """``{"tp", "pp", "dp"}`` sizes, or None: only the world group is checked."""
    size: int
    """Square matrix size of the arithmetic checks."""
    seconds: Optional[float]
    """How long the arithmetic checks repeat; None when they run a number of ``repeats`` instead."""
    repeats: Optional[int]
    """How many times the arithmetic checks run; None when ``seconds`` bounds them."""
    timeout: float
    """Seconds to wait for a rank at the rendezvous and at each collective and barrier."""
    out: Path
    """The run directory; rank 0 writes the result into its ``selftest/``."""
    device: torch.device
    """The device under test: ``cuda:LOCAL_RANK`` (``cuda:0`` when only one GPU is visible), else the CPU."""
    perturb_rank: Optional[int]
    """The rank whose results the test switch ``PERTURB_ENV`` corrupts, if any."""
    stall_rank: Optional[int]
    """The rank the test switch ``STALL_ENV`` stalls, if any."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def timeout_delta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)


def resolve_settings(options: SelftestOptions, environ: Mapping[str, str]) -> Settings:
    """The options with the launch environment and this machine's devices, checked before anything waits
    on another rank."""
    rank, world_size, local_rank, master_addr, master_port = launch_environment(environ)
    layout = None
    if options.tp is not None or options.pp is not None:
        tp, pp = options.tp or 1, options.pp or 1
        try:
            layout_groups(world_size, tp, pp)
        except ValueError:
            raise UsageError(f"--tp {tp} x --pp {pp} does not divide the world size {world_size}") from None
        layout = {"tp": tp, "pp": pp, "dp": world_size // (tp * pp)}
    device = torch.device("cpu")
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if visible > 1 and local_rank >= visible:
            raise UsageError(f"local rank {local_rank} but only {visible} GPUs visible")
        # Only one GPU visible: srun --gpus-per-task=1 bound this task to it, whatever its local rank.
        device = torch.device("cuda", local_rank if visible > 1 else 0)
    out = options.out
    for directory in (out, out / SELFTEST_DIR):
        if rank == 0 and directory.exists() and not directory.is_dir():
            raise InputError(f"--out {out}: {directory} is not a directory")
    # Under torchrun its agent already serves MASTER_PORT and every rank is a client.
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return Settings(
        rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr,
        master_port=master_port, serves_store=rank == 0 and not agent_store, layout=layout,
        size=options.size or DEFAULT_SIZE[device.type],
        seconds=None if options.repeats else (options.seconds or DEFAULT_SECONDS), repeats=options.repeats,
        timeout=options.timeout, out=out, device=device,
        perturb_rank=switched_rank(environ, PERTURB_ENV, world_size),
        stall_rank=switched_rank(environ, STALL_ENV, world_size))


def run_selftest(options: SelftestOptions, environ: Mapping[str, str]) -> bool:
    """Run the self-test on this rank, launched as ``environ`` says; True when every check agrees on every
    rank. ``UsageError`` or ``InputError`` for options, a launch or an ``--out`` that cannot work."""
    return _Selftest(resolve_settings(options, environ)).run()


class LostContact(Exception):
    """A bounded collective or rendezvous gave up. ``ranks``: the ones named as missing (rank 0 only)."""

    def __init__(self, phase: str, ranks: Sequence[int], error: str) -> None:
        super().__init__(f"{phase}: {error}")
        self.phase, self.ranks, self.error = phase, list(ranks), error


def ranks_named_in(barrier_error: str) -> List[int]:
    """The ranks a failed ``monitored_barrier`` names on rank 0 (other ranks' errors name none)."""
    found = _BARRIER_MISSING.search(barrier_error)
    return [int(rank) for rank in re.findall(r"\d+", found.group(1))] if found else []


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

    def run(self) -> bool:
        settings = self.settings
        if settings.device.type == "cuda":
            torch.cuda.set_device(settings.device)
        try:
            self._rendezvous()
            if settings.rank == 0:
                show(format_header(settings))
            results = self._gather(self._communication(), "the end of the communication checks")
            self.checks += communication_entries(results)
            self._arithmetic()
        except LostContact as lost:
            if settings.rank != 0:
                say(f"gradnan selftest: rank {settings.rank}: gave up at {lost.phase}: {lost.error}"
                    " (see rank 0's output)", file=sys.stderr)
                return False
            return self._finish({"phase": lost.phase, "ranks": lost.ranks, "error": lost.error})
        try:
            return self._finish(None)
        finally:
            torch.distributed.destroy_process_group()

    def _rendezvous(self) -> None:
        """Every rank announces itself in the store before the process group exists, so a rank that never
        starts is named instead of leaving the others to time out blind."""
        settings, dist = self.settings, torch.distributed
        try:
            store = dist.PrefixStore(_STORE_PREFIX, dist.TCPStore(
                settings.master_addr, settings.master_port, settings.world_size,
                is_master=settings.serves_store, timeout=settings.timeout_delta, wait_for_workers=False))
        except RuntimeError as exc:
            where = f"{settings.master_addr}:{settings.master_port}"
            raise LostContact("the rendezvous", [], f"cannot serve or reach the store at {where} within"
                                                    f" {settings.timeout:g} s: {first_line(exc)}") from None
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
            raise LostContact("the rendezvous", [], f"lost the store: {first_line(exc)}") from None
        missing = sorted(set(range(settings.world_size)) - set(present))
        if missing:
            raise LostContact("the rendezvous", missing, f"rank(s) {shortened(missing)} did not join")
        try:
            dist.init_process_group(
                settings.backend, store=dist.PrefixStore("pg/", store), rank=settings.rank,
                world_size=settings.world_size, timeout=settings.timeout_delta,
                device_id=settings.device if settings.device.type == "cuda" else None)
            # Barriers, results and repeat decisions go over gloo, apart from the group under test.
            self.control = dist.new_group(backend="gloo", timeout=settings.timeout_delta)
        except RuntimeError as exc:
            raise LostContact("process group setup", [], first_line(exc)) from None

    def _barrier(self, phase: str) -> None:
        try:
            torch.distributed.monitored_barrier(self.control, timeout=self.settings.timeout_delta,
                                                wait_all_ranks=True)
        except RuntimeError as exc:
            raise LostContact(phase, ranks_named_in(str(exc)), first_line(exc)) from None

    def _gather(self, value: Any, phase: str) -> List[Any]:
        """Every rank's ``value``, on every rank, after a barrier that names the ranks that did not come."""
        self._barrier(phase)
        gathered: List[Any] = [None] * self.settings.world_size
        try:
            torch.distributed.all_gather_object(gathered, value, group=self.control)
        except RuntimeError as exc:
            raise LostContact(phase, [], first_line(exc)) from None
        return gathered

    def _communication(self) -> List[Dict[str, Any]]:
        """This rank's all-reduce results on the backend under test."""
        settings = self.settings
        self._barrier("the communication checks")
        try:
            groups = groups_under_test(settings.world_size, settings.rank, settings.layout,
                                       settings.timeout_delta)
        except RuntimeError as exc:
            raise LostContact("creating the tp/pp/dp groups", [], first_line(exc)) from None
        return allreduce_results(groups, settings.rank, settings.device, settings.timeout_delta)

    def _arithmetic(self) -> None:
        """Repeat the workload until the repeats or seconds run out (decided from every rank's clock, so
        every rank stops after the same repeat); tally the checksums of each check."""
        settings = self.settings
        workload, cannot_run = arithmetic_workload(settings.size, settings.device)
        if settings.stall_rank == settings.rank:
            time.sleep(10 * settings.timeout)
        plans = self._gather((list(workload), cannot_run), "the arithmetic checks")
        common, self.skipped = split_plans(plans)
        self.tallies = {name: Tally(settings.world_size) for name in common}
        start = time.monotonic()
        for repeat in itertools.count():
            checksums = repeat_checksums(workload, common, perturb=settings.perturb_rank == settings.rank)
            gathered = self._gather((checksums, time.monotonic() - start), f"arithmetic repeat {repeat}")
            for name, tally in self.tallies.items():
                tally.add([values[name] for values, _ in gathered])
            if (repeat + 1 >= settings.repeats if settings.repeats
                    else max(elapsed for _, elapsed in gathered) >= settings.seconds):
                break

    def _finish(self, unreachable: Optional[Dict[str, Any]]) -> bool:
        """Every rank decides the outcome from the same gathered results; rank 0 prints and writes."""
        settings = self.settings
        checks = self.checks + [tally.entry(name) for name, tally in self.tallies.items()]
        document = build_document(
            started=self.started, world_size=settings.world_size, layout=settings.layout,
            backend=settings.backend, size=settings.size, seconds=settings.seconds,
            repeats=max((tally.repeats for tally in self.tallies.values()), default=0),
            timeout=settings.timeout, torch_version=torch.__version__, cuda_version=torch.version.cuda,
            ranks=self.ranks, checks=checks, skipped=self.skipped, unreachable=unreachable)
        if settings.rank == 0:
            try:
                path = write_result(settings.out, self.started, document)
            except InputError:
                show(format_text(document, None))
                raise
            show(format_text(document, path))
        return document["pass"]
