"""``gradnan replay`` in a child process with limits: a bundle is untrusted input, and whatever the checks
before each operator (``checks``) miss, a crash, an allocation bomb or an endless trace ends the
child, never the command: one line on stderr and exit code 2.

The parent reads the manifest alone (JSON, bounded) and refuses a trace longer than ``max_ops`` before
any process starts; the child loads the tensors, replays (``command.replay_bundle``) and sends back the
JSON-able result, so text and ``--json`` render exactly what an in-process replay returns. Limits, set in
the child before it reads anything of the bundle:

- memory: ``RLIMIT_AS`` (``RLIMIT_DATA`` on CUDA, whose driver reserves address space far beyond what it
  uses): ``max_memory`` bytes beyond what the child has mapped when it starts (torch's libraries);
- CPU time: ``RLIMIT_CPU`` of ``max_cpu_seconds`` (every thread's time counts), and a wall-clock
  backstop of ``2 * max_cpu_seconds + 60`` s for a child that waits without computing;
- operators: ``max_ops`` for the forward (the trace's length) and for the ops its backward dispatches;
- no core file (``RLIMIT_CORE`` 0): a crash leaves nothing of the replay's memory on disk.

Children come from a fork server (``multiprocessing``'s ``forkserver``: a clean process that has imported
this module, torch included, once): each replay forks from it, not from the command's own process,
whose state the child therefore never shares.

``replay_under`` runs the same child under another interpreter (``gradnan replay --against PYTHON``: another
virtual environment, another torch, megatron-core or Transformer Engine): a plain process started from
that interpreter (``python -m gradnan.offline.replay.child``) with this gradnan's own package on its
``PYTHONPATH`` (a directory holding only a link to it, so nothing else of this environment leaks in),
the same limits set the same way, its outcome sent back as JSON through a file.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import resource
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ...errors import GradnanError, InputError
from ...formats import bundle
from ...formats.layout import MANIFEST
from .command import checked_device_name, replay_bundle, replay_device
from .limits import ReplayLimits, trace_too_long

_STDERR_TAIL = 4096
_MAX_LINKS = 40  # a chain of symbolic links longer than this is a loop
_PACKAGE = Path(__file__).resolve().parents[2]  # this gradnan, put on another interpreter's path
MAX_RESULT_BYTES = 1 << 30  # a result document larger than 1 GiB is no replay's


def _trace_length(path: Path) -> int:
    """The number of ops the bundle's trace lists (0 where it lists none: the child refuses that)."""
    if not path.is_dir():
        raise InputError(f"{path}: not a bundle directory")
    trace = bundle.load_manifest(path / MANIFEST).get("trace")
    ops = trace.get("ops") if isinstance(trace, dict) else None
    return len(ops) if isinstance(ops, list) else 0


def _refuse_too_long(path: Path, limits: ReplayLimits) -> None:
    refusal = trace_too_long(_trace_length(path), limits.max_ops)
    if refusal is not None:
        raise InputError(f"{path}: {refusal}")


def replay_isolated(path: Path, device: Optional[str], limits: ReplayLimits) -> Dict[str, Any]:
    """``replay_bundle`` in a child process under ``limits``; InputError (one line) for anything that
    ends it without a result."""
    path = Path(path)
    replay_device(device)  # a device that is not here: the usage error, before a process starts
    _refuse_too_long(path, limits)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with tempfile.TemporaryDirectory(prefix="gradnan-replay-") as scratch:
        stderr = Path(scratch) / "stderr"
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=_child, args=(str(path), device, limits, sender, str(stderr)),
                                daemon=True)
        child.start()
        sender.close()
        finished = False
        try:
            finished = receiver.poll(limits.wall_seconds)
            outcome = _outcome(receiver) if finished else None
        finally:
            child.join(timeout=30 if finished else 0)
            if child.is_alive():
                child.kill()
                child.join()
            receiver.close()
        if outcome is None:
            raise InputError(f"{path}: cannot replay: {_death(child.exitcode, limits, not finished, stderr)}")
    kind, value = outcome
    if kind == "error":
        raise InputError(value)
    return value


def _outcome(receiver: Any) -> Optional[Tuple[str, Any]]:
    """The child's outcome, or None where it ended without sending one."""
    try:
        return receiver.recv()
    except EOFError:
        return None


def _death(exitcode: Optional[int], limits: ReplayLimits, timed_out: bool, stderr: Path) -> str:
    """Why the child ended without a result, in words, with the last line it wrote (glibc's
    ``free(): invalid next size``, say)."""
    if timed_out:
        return (f"the replay ran past {limits.wall_seconds} s of wall-clock time (2 x --max-cpu-seconds"
                " + 60) without finishing: stopped")
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        if -exitcode == signal.SIGXCPU:
            said = f"it ran past its CPU-time limit of {limits.max_cpu_seconds} s (--max-cpu-seconds)"
        else:
            said = f"the replay process was killed by {name} (a crash inside an operator, or its memory)"
    else:
        said = f"the replay process ended with exit code {exitcode} and no result"
    last = _last_line(stderr)
    return f"{said}{f' ({last})' if last else ''}: stopped"


def _last_line(path: Path) -> str:
    return next((line.strip()[:200] for line in reversed(_tail(path).split("\n")) if line.strip()), "")


def _limit(limits: ReplayLimits, device: Optional[str]) -> None:
    """The child's resource limits, beyond the address space it has mapped now."""
    on_cuda = replay_device(device).type == "cuda"
    kind = resource.RLIMIT_DATA if on_cuda else resource.RLIMIT_AS
    _lower(kind, _mapped_bytes("VmData" if on_cuda else "VmSize") + limits.max_memory)
    _lower(resource.RLIMIT_CPU, limits.max_cpu_seconds, hard=limits.max_cpu_seconds + 5)
    _lower(resource.RLIMIT_CORE, 0)


def _lower(kind: int, soft: int, hard: Optional[int] = None) -> None:
    """Set a limit, never above the hard limit already in place."""
    _, ceiling = resource.getrlimit(kind)

    def capped(value: int) -> int:
        return value if ceiling == resource.RLIM_INFINITY else min(value, ceiling)

    resource.setrlimit(kind, (capped(soft), capped(hard if hard is not None else soft)))


def _mapped_bytes(field: str) -> int:
    """``VmSize``/``VmData`` of this process (``/proc/self/status``, kB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def replay_outcome(path: str, device: Optional[str], limits: ReplayLimits,
                   digests: bool = False) -> Tuple[str, Any]:
    """In a child: the limits, then the replay; ``("result", document)`` or ``("error", one line)``."""
    try:
        _limit(limits, device)
        return "result", replay_bundle(Path(path), device, max_ops=limits.max_ops, digests=digests)
    except GradnanError as error:
        return "error", str(error)
    except MemoryError:
        return "error", (f"{path}: cannot replay: out of memory within its limit of {limits.max_memory}"
                         " bytes (--max-memory)")


def _child(path: str, device: Optional[str], limits: ReplayLimits, sender: Any, stderr: str) -> None:
    """In the child: output to ``stderr`` (a file), limits, the replay; its outcome sent back."""
    descriptor = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for stream in (1, 2):
        os.dup2(descriptor, stream)
    os.close(descriptor)
    sender.send(replay_outcome(path, device, limits))


def replay_under(python: str, path: Path, device: Optional[str], limits: ReplayLimits) -> Dict[str, Any]:
    """``replay_bundle`` with digests (and the child's ``environment``) in a child process started from
    the interpreter ``python``, under ``limits``; InputError (one line) for anything that ends it without
    a result, an interpreter that cannot run it (no torch there, not a Python) included. The child leads a
    process group of its own, ended whole when it is done or at the wall-clock limit (whatever it started
    dies with it). Its ``environment`` says the path given (``given``: a wrapper script, a link) beside the
    interpreter that ran, and what it wrote on stderr (``stderr``: its last 4 KiB, empty where nothing)."""
    path = Path(path).absolute()
    checked_device_name(device)  # whether it is there is for the other interpreter's torch to say
    _refuse_too_long(path, limits)
    with tempfile.TemporaryDirectory(prefix="gradnan-against-") as scratch:
        folder = Path(scratch)
        (folder / "path").mkdir()
        (folder / "path" / "gradnan").symlink_to(_PACKAGE, target_is_directory=True)
        inherited = os.environ.get("PYTHONPATH")
        search = os.pathsep.join(filter(None, [str(folder / "path"), inherited]))
        environ = {**os.environ, "PYTHONPATH": search}
        settings = {"bundle": str(path), "device": device, "limits": dataclasses.asdict(limits),
                    "result": str(folder / "result.json")}
        stderr = folder / "stderr"
        with open(stderr, "wb") as output:
            try:
                child = subprocess.Popen([venv_interpreter(python), "-m", "gradnan.offline.replay.child",
                                          json.dumps(settings)],
                                         cwd=folder, env=environ, stdin=subprocess.DEVNULL, stdout=output,
                                         stderr=output, start_new_session=True)
            except OSError as error:
                raise InputError(f"--against {python}: cannot run it ({error.strerror or error})") from None
            try:
                child.wait(timeout=limits.wall_seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _end_group(child)
        outcome = _result_file(folder / "result.json") if child.returncode == 0 and not timed_out else None
        if outcome is None:
            raise InputError(f"{path}: cannot replay under {python}:"
                             f" {_death(child.returncode, limits, timed_out, stderr)}")
        said = _tail(stderr)
    kind, value = outcome
    if kind == "error":
        raise InputError(f"under {python}: {value}")
    value["environment"].update(given=python, stderr=said)
    return value


def _end_group(child: subprocess.Popen) -> None:
    """End the child's process group (the child and whatever it started, which may outlive it), then reap
    the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # no process of the group is left
    child.wait()


def venv_interpreter(given: str) -> str:
    """The path to start for ``--against given``: where ``given`` is a symbolic link (or a chain of them)
    to a virtual environment's python, the first link of the chain inside that environment. Python finds
    its environment by the ``pyvenv.cfg`` beside the path it was started by, not beside what that path
    resolves to: started through a link from elsewhere, it runs as the base interpreter."""
    path = Path(given)
    for _ in range(_MAX_LINKS):
        if any((folder / "pyvenv.cfg").is_file() for folder in (path.parent, path.parent.parent)):
            return str(path)
        if not path.is_symlink():
            break
        path = path.parent / os.readlink(path)  # an absolute target replaces the parent
    return given


def _tail(path: Path) -> str:
    """The last ``_STDERR_TAIL`` bytes of a file, as text."""
    try:
        with open(path, "rb") as stream:
            stream.seek(max(0, os.fstat(stream.fileno()).st_size - _STDERR_TAIL))
            return stream.read().decode("utf-8", "backslashreplace")
    except OSError:
        return ""


def _result_file(path: Path) -> Optional[Tuple[str, Any]]:
    """What a replay ``child`` wrote: ``[kind, value]``; None where it wrote nothing usable."""
    try:
        if path.stat().st_size > MAX_RESULT_BYTES:
            return None
        kind, value = json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return None
    return (kind, value) if kind in ("result", "error") else None
