"""What a self-test is told: its options (``SelftestOptions``) and where the launcher put this process
(``launch_environment``). Both are checked before anything waits on another rank. No torch here: the
command line builds its parser from this module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

from ..errors import UsageError

DEFAULT_SECONDS = 30.0
DEFAULT_TIMEOUT = 60.0
DEFAULT_OUT = "gradnan_out"
DEFAULT_SIZE = {"cuda": 4096, "cpu": 256}
MAX_SECONDS = 7 * 24 * 3600.0  # a datetime.timedelta holds far more, but no test or wait needs longer
PERTURB_ENV = "GRADNAN_SELFTEST_PERTURB_RANK"  # test only: flip one bit of one result on that rank
STALL_ENV = "GRADNAN_SELFTEST_STALL_RANK"  # test only: that rank stops answering, as a hung device would


@dataclass(frozen=True)
class SelftestOptions:
    """The options of one self-test run, the same on every rank. A value that cannot work raises
    ``UsageError`` naming its command-line option."""

    tp: Optional[int] = None
    """Tensor-parallel size: with it (or ``pp``) the tp, pp and dp groups are checked too. None: the world
    group only."""
    pp: Optional[int] = None
    """Pipeline-parallel size; 1 when only ``tp`` is given."""
    size: Optional[int] = None
    """Square matrix size of the arithmetic checks. None: ``DEFAULT_SIZE`` of the device type."""
    seconds: Optional[float] = None
    """Repeat the arithmetic checks for this long, at least once. None: ``DEFAULT_SECONDS``. Unused with
    ``repeats``."""
    repeats: Optional[int] = None
    """Repeat the arithmetic checks exactly this many times instead of for ``seconds``."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds to wait for a rank at the rendezvous and at each collective and barrier."""
    out: Path = Path(DEFAULT_OUT)
    """The run directory: rank 0 writes the result into its ``selftest/`` folder."""

    def __post_init__(self) -> None:
        counts = (("--tp", self.tp), ("--pp", self.pp), ("--size", self.size), ("--repeats", self.repeats))
        for option, value in counts:
            if value is not None and value < 1:
                raise UsageError(f"{option} must be at least 1, not {value}")
        for option, seconds in (("--seconds", self.seconds), ("--timeout", self.timeout)):
            if seconds is not None and not (0 < seconds <= MAX_SECONDS):
                raise UsageError(f"{option} must be a positive number of seconds up to {MAX_SECONDS:g}"
                                 f" (a week), not {seconds:g}")


class Launch(NamedTuple):
    """Where torchrun or srun put this process, and the rendezvous address of rank 0's store."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_environment(environ: Mapping[str, str]) -> Launch:
    """The launch as torchrun's variables describe it, else srun's."""
    if "RANK" in environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif "SLURM_PROCID" in environ:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    else:
        raise UsageError("not launched by torchrun or srun: neither RANK nor SLURM_PROCID is set")
    rank, world_size, local_rank = (_int_variable(environ, name) for name in names)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise UsageError(f"{names[0]}={rank}, {names[1]}={world_size}, {names[2]}={local_rank} do not fit")
    if not environ.get("MASTER_ADDR"):
        raise UsageError("MASTER_ADDR is not set (under srun, export the first host of the job)")
    port = _int_variable(environ, "MASTER_PORT")
    if not 0 < port < 65536:
        raise UsageError(f"MASTER_PORT={port} is not a TCP port")
    return Launch(rank, world_size, local_rank, environ["MASTER_ADDR"], port)


def switched_rank(environ: Mapping[str, str], name: str, world_size: int) -> Optional[int]:
    """The rank a test switch (``PERTURB_ENV``, ``STALL_ENV``) names, None when it is not set."""
    if name not in environ:
        return None
    rank = _int_variable(environ, name)
    if not 0 <= rank < world_size:
        raise UsageError(f"{name}={rank} is not a rank of this world (size {world_size})")
    return rank


def _int_variable(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise UsageError(f"{name} is not set")
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer") from None
