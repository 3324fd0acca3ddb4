"""Capture bundles (``gradnan.bundle``): everything needed to replay one module call offline.

    <bundle>/manifest.json   the manifest: JSON, with the op trace (``gradnan.formats.trace``)
    <bundle>/tensors.pt      a flat name -> tensor dict

A bundle is written into a temporary directory and renamed into place, so a reader sees all of it or
none of it. Opening one never executes code from it: the manifest is JSON and the tensors are loaded
with ``torch.load(weights_only=True)``, which refuses any pickled object that is not a tensor.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, Mapping, Tuple

from ..errors import InputError
from .layout import MANIFEST, TENSORS
from .schema import (
    Schema,
    check_rank,
    check_run,
    is_int,
    is_number,
    is_text,
    open_regular,
    optional,
    read_document,
)

SCHEMA = Schema("gradnan.bundle", 1)
MAX_TENSORS_BYTES = 1 << 36  # a tensors.pt larger than 64 GiB is no capture gradnan wrote
_GRAD_OUT = re.compile(r"grad_out\.(\d{1,9})")
# what changed a module's output after it returned, in ``outputs_changed`` (the replay's wording:
# ``gradnan.offline.replay.text.changed_text``); a module returns at most this many tensors
CHANGED_BY = ("forward_hook", "in_place")
MAX_CHANGES = 1 << 16

if TYPE_CHECKING:  # torch is imported where tensors are written or loaded: reading a manifest needs none
    import torch


def tensors_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write(path: Path, manifest: Dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write atomically: a temporary sibling directory renamed to ``path`` once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _save_tensors(tensors, temporary / TENSORS)
        document = json.dumps({**SCHEMA.header(), **manifest}, indent=1, allow_nan=False)
        (temporary / MANIFEST).write_text(document)
        os.chmod(temporary, 0o755)
        os.rename(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return path


def write_batch(path: Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """A micro-batch's tensors (``torch.save`` of a dict, loadable with ``weights_only=True``), written to a
    temporary sibling then linked in place: never over an existing file (a suffix is added instead)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        _save_tensors(tensors, Path(temporary))
        candidate, suffix = path, 1
        while True:
            try:
                os.link(temporary, candidate)
                return candidate
            except FileExistsError:
                suffix += 1
                candidate = path.with_name(f"{path.stem}_{suffix}{path.suffix}")
    finally:
        os.unlink(temporary)


def _save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """``torch.save``, its write failures (a full disk: ``enforce fail at inline_container.cc``) raised
    as the OSError they are, naming ``path``."""
    import torch

    try:
        torch.save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, path)
    except RuntimeError as exc:
        reason = (str(exc).strip().splitlines() or ["torch.save failed"])[-1].strip()
        raise OSError(errno.EIO, f"torch.save could not write it ({reason})", str(path)) from None


def manifest_from_json(document: Any, where: str) -> Dict[str, Any]:
    """A bundle manifest, checked for what the report needs (``gradnan replay`` checks its trace)."""
    document = SCHEMA.check(document, where)
    module = document.get("module")
    if not isinstance(module, dict) or not is_text(module.get("path")) or not is_int(document.get("step")):
        raise InputError(f"{where}: a bundle manifest needs a 'module' with a 'path' and an integer 'step'")
    check_rank(document.get("rank"), where)
    check_run(document.get("run"), where)
    if not all(optional(document.get(key), is_number) for key in ("time", "created")):
        raise InputError(f"{where}: 'time' and 'created' must be numbers (seconds since the epoch)")
    if not optional(document.get("trigger"), is_text):
        raise InputError(f"{where}: 'trigger' must be text")
    return document


def check_replayable(manifest: Dict[str, Any], tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Everything ``gradnan replay`` uses beyond the trace, checked before anything runs."""
    import torch

    module, seen = manifest["module"], manifest.get("seen", {})
    if not is_text(module.get("class")):
        raise InputError(f"{where}: 'module.class' must be text")
    if not isinstance(manifest["trace"].get("leaves"), dict):
        raise InputError(f"{where}: the trace needs a 'leaves' object")
    outputs = manifest.get("outputs", 0)
    if not (is_int(outputs) and 0 <= outputs <= len(tensors)):
        raise InputError(f"{where}: 'outputs' must be a count of saved tensors (0 to {len(tensors)}), not"
                         f" {repr(outputs)[:40]}")
    if not isinstance(seen, dict) or not optional(manifest.get("recompute"), lambda v: isinstance(v, bool)):
        raise InputError(f"{where}: 'seen' must be an object and 'recompute' a boolean")
    if not _changes_valid(manifest.get("outputs_changed", [])):
        raise InputError(f"{where}: 'outputs_changed' must be a list of {{\"output\": number, \"by\":"
                         f" {' or '.join(map(repr, CHANGED_BY))}, \"nonfinite\": boolean}}")
    parameters = manifest.get("outputs_parameters", [None] * outputs)
    if not (isinstance(parameters, list) and len(parameters) == outputs
            and all(optional(name, is_text) for name in parameters)):
        raise InputError(f"{where}: 'outputs_parameters' must be a list of {outputs} parameter names or"
                         " nulls, one per output")
    odd = [name for name in tensors if name.startswith("grad_out.") and not _GRAD_OUT.fullmatch(name)]
    if odd:
        raise InputError(f"{where}: tensor {odd[0][:60]!r} is not named grad_out.<output number>")
    rng = tensors.get("rng.cpu")
    if rng is not None and not (rng.dtype == torch.uint8 and rng.dim() == 1):
        raise InputError(f"{where}: tensor 'rng.cpu' is not a generator state (a 1-d uint8 tensor)")
    unusual = [name for name, tensor in tensors.items() if tensor.layout != torch.strided or tensor.is_meta]
    if unusual:
        raise InputError(f"{where}: tensor {unusual[0][:60]!r} is not a dense tensor with data")


def _changes_valid(changes: Any) -> bool:
    return isinstance(changes, list) and len(changes) <= MAX_CHANGES and all(
        isinstance(change, dict) and set(change) == {"output", "by", "nonfinite"} and is_int(change["output"])
        and 0 <= change["output"] < MAX_CHANGES and change["by"] in CHANGED_BY
        and isinstance(change["nonfinite"], bool) for change in changes)


def load_manifest(path: Path) -> Dict[str, Any]:
    """A capture bundle's manifest alone (its tensors are read by ``gradnan replay``)."""
    return manifest_from_json(read_document(path, SCHEMA), str(path))


def _check_declared_sizes(stream: BinaryIO, where: Path) -> None:
    """A zip archive (what ``torch.save`` writes) whose members declare, uncompressed, more bytes than the
    file holds is refused from its central directory, before anything is inflated: ``torch.save`` stores
    its members uncompressed, so only a compressed member can (a 1 MB zip of 1 GiB of zeros). The
    reader inflates a member into no more than its declared size. A file that is no zip is left to
    ``torch.load`` (its older formats are not compressed)."""
    size = os.fstat(stream.fileno()).st_size
    try:
        members = zipfile.ZipFile(stream).infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        members = []
    declared = sum(member.file_size for member in members)
    if declared > size:
        raise InputError(f"{where}: its members declare {declared} bytes uncompressed, more than the file's"
                         f" {size} (compressed; gradnan stores tensors uncompressed): refused")
    stream.seek(0)


def load(path: Path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """The manifest and the tensors of a bundle; InputError (one line) for anything unusable or unsafe."""

    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: not a bundle directory")
    manifest = load_manifest(path / MANIFEST)
    if not isinstance(manifest.get("trace"), dict):
        raise InputError(f"{path / MANIFEST}: a bundle manifest needs a 'trace' object")
    if not (path / TENSORS).exists():
        raise InputError(f"{path / TENSORS}: missing")
    return manifest, load_tensors(path / TENSORS)


def load_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """A flat name -> tensor dict as gradnan saves them (a bundle's tensors, a kept micro-batch), loaded
    without running code from the file; InputError (one line) for anything unusable or unsafe."""
    import torch

    try:
        with open_regular(path, MAX_TENSORS_BYTES) as stream, warnings.catch_warnings():
            _check_declared_sizes(stream, path)
            warnings.simplefilter("ignore")  # torch's notes on an odd tensor: the error is one line
            tensors = torch.load(stream, weights_only=True, map_location="cpu")
    except InputError:
        raise
    except Exception as exc:  # an unpickling refusal, a truncated zip, a foreign file
        reason = "holds a pickled object that is not a tensor: refused" if "weights_only" in str(
            exc).lower() or "unpickl" in type(exc).__name__.lower() else f"unreadable ({type(exc).__name__})"
        raise InputError(f"{path}: {reason}") from None
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise InputError(f"{path}: not a flat name -> tensor dict")
    return tensors
