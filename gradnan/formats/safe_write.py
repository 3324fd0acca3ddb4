"""How gradnan writes a file: whole or not at all (``write_atomic``, ``write_json_atomic``), one fsynced
JSON line at a time (``append_json_line``), and never through a symbolic link below the out dir or into
anything but a plain file (``open_directory``, ``held_directory``, ``RefusedPath``).

Apart from ``schema`` (what a document holds and how it is read) because an out dir may be shared with
other users and a process may die at any instant: these are the few functions every writer goes through,
so those two dangers are handled in one place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Optional, Tuple

from .schema import _CLOEXEC, _NOFOLLOW


def with_path(error: OSError, path: Path) -> OSError:
    """The same error naming ``path`` (an ENOSPC from ``write`` names no file); a RefusedPath as it is (it
    names its path and says why)."""
    if isinstance(error, RefusedPath):
        return error
    return OSError(error.errno, error.strerror or str(error), str(path))


class RefusedPath(OSError):
    """A path a writer does not go through: a symbolic link below the out dir (a shared out dir's
    ``records/rank00000....jsonl -> ~victim/.bashrc``), or where a plain file is written, something else
    (a FIFO, a device, a hard link to another file). Nothing is written there."""


def _refused(path: Path, why: str) -> RefusedPath:
    return RefusedPath(errno.ELOOP, f"{why}: refused (gradnan writes only inside its out dir, never through"
                                    " a link)", str(path))


def _below(root: Optional[Path], path: Path) -> Tuple[Path, Tuple[str, ...]]:
    """The directory opened as is (``root``, the out dir the user chose, a symbolic link or not) and the
    names below it to ``path``'s directory. Without ``root``: ``path``'s own directory."""
    if root is None:
        return path.parent, ()
    relative = path.parent.relative_to(root).parts
    if any(part in ("..", "") for part in relative):
        raise _refused(path, "not inside the out dir")
    return Path(root), relative


def open_directory(path: Path, root: Optional[Path] = None) -> int:
    """A descriptor of ``path``'s directory, created where missing; every directory below ``root`` opened
    without following a symbolic link (RefusedPath for one), so whatever is written relative to the
    descriptor lands inside ``root``, even if a directory is swapped for a link meanwhile."""
    top, names = _below(root, path)
    try:
        descriptor = os.open(top, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except FileNotFoundError:
        top.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(top, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    reached = top
    try:
        for name in names:
            reached = reached / name
            try:
                os.mkdir(name, 0o755, dir_fd=descriptor)
            except FileExistsError:
                pass
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=descriptor)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, descriptor):
                    raise _refused(reached, "a symbolic link") from None
                raise
            os.close(descriptor)
            descriptor = child
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _is_link(name: str, directory: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=directory).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def held_directory(path: Path, root: Optional[Path] = None) -> Iterator[Path]:
    """``path``'s directory (``open_directory``) as a path for code that takes paths (``torch.save``, a
    bundle's temporary directory): ``/proc/self/fd/N``, the very directory opened, where the system has
    it; elsewhere the directory's own path, checked just before (a link swapped in after the check is
    followed there)."""
    descriptor = open_directory(path, root)
    try:
        by_descriptor = Path(f"/proc/self/fd/{descriptor}")
        yield by_descriptor if by_descriptor.is_dir() else path.parent
    finally:
        os.close(descriptor)


def write_json_atomic(path: Path, document: Mapping[str, Any], indent: Optional[int] = 1,
                      replace: bool = True, root: Optional[Path] = None) -> None:
    """``document`` written whole or not at all (``write_atomic``). ``indent=None``: compact, for large
    documents."""
    text = json.dumps(document, indent=indent, allow_nan=False, separators=None if indent else (",", ":"))
    write_atomic(path, lambda stream: stream.write((text + "\n").encode("utf-8")), replace, root)


def write_atomic(path: Path, write: Callable[[BinaryIO], Any], replace: bool = True,
                 root: Optional[Path] = None, plain_only: bool = False) -> None:
    """``write(stream)`` to a temporary file in ``path``'s directory, fsync, then rename over ``path``: a
    reader sees the whole file or none of it, and an old file stays whole when the write fails (a full
    disk). ``replace=False``: never over an existing file (another launch's): FileExistsError instead.
    ``root``: the out dir ``path`` is in, below which no symbolic link is followed (``open_directory``;
    RefusedPath); a link named ``path`` is replaced, never written through; ``plain_only``: anything at
    ``path`` but a plain file (a link, a device, a directory) is refused instead. An OSError names
    ``path``."""
    try:
        directory = open_directory(path, root)
    except OSError as error:
        raise with_path(error, path) from None
    if plain_only:
        try:
            _refuse_unless_plain(path, directory)
        except BaseException:
            os.close(directory)
            raise
    temporary = f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644,
                         dir_fd=directory)
    except OSError as error:
        os.close(directory)
        raise with_path(error, path) from None
    try:
        os.fchmod(handle, 0o644)  # whatever the umask: documents are read by other users' tools
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        if replace:
            os.replace(temporary, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        else:  # fails if ``path`` exists, atomically (a rename would replace it)
            os.link(temporary, path.name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
            os.unlink(temporary, dir_fd=directory)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=directory)
        if isinstance(error, OSError) and not isinstance(error, FileExistsError):
            raise with_path(error, path) from None
        raise
    finally:
        os.close(directory)


def _refuse_unless_plain(path: Path, directory: int) -> None:
    """RefusedPath where ``path`` (in ``directory``) exists and is not a plain file of one name."""
    try:
        status = os.lstat(path.name, dir_fd=directory)
    except FileNotFoundError:
        return
    except OSError as error:
        raise with_path(error, path) from None
    if stat.S_ISLNK(status.st_mode):
        raise _refused(path, "a symbolic link")
    if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
        raise _refused(path, "not a plain file" if not stat.S_ISREG(status.st_mode)
                       else "a hard link to another file")


def _write_all(descriptor: int, data: bytes) -> None:
    """``data`` written whole: after a short write the next one raises the reason (ENOSPC, EFBIG)."""
    remaining = memoryview(data)
    while remaining:
        written = os.write(descriptor, remaining)
        if written == 0:
            raise OSError(errno.ENOSPC, "no byte could be written")
        remaining = remaining[written:]


def append_json_line(path: Path, document: Mapping[str, Any], root: Optional[Path] = None,
                     max_bytes: Optional[int] = None) -> bool:
    """One JSON line, flushed and fsynced before returning: the process may die right after. False (and
    nothing written) where the file already holds ``max_bytes`` or more.

    A file whose last line was cut short (a full disk, a killed writer) gets its newline first, so the
    torn line stays one bad line and this record is readable. ``root``: the out dir ``path`` is in
    (``open_directory``); the file itself is opened without following a link and must be a plain file
    with no other name (RefusedPath otherwise). An OSError names ``path``."""
    line = (json.dumps(document, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
    try:
        directory = open_directory(path, root)
        try:
            descriptor = os.open(path.name, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW
                                 | _CLOEXEC, 0o644, dir_fd=directory)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise _refused(path, "a symbolic link") from None
            raise
        finally:
            os.close(directory)
    except OSError as error:
        raise with_path(error, path) from None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
            raise _refused(path, "not a plain file" if not stat.S_ISREG(status.st_mode)
                           else "a hard link to another file")
        size = status.st_size
        if max_bytes is not None and size >= max_bytes:
            return False
        if size and os.pread(descriptor, 1, size - 1) != b"\n":
            line = b"\n" + line
        _write_all(descriptor, line)
        os.fsync(descriptor)
        return True
    except OSError as error:
        raise with_path(error, path) from None
    finally:
        os.close(descriptor)
