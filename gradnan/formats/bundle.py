"""Capture bundles (``gradnan.bundle``): everything needed to replay one module call offline.

    <bundle>/manifest.json   the manifest: JSON, with the op trace (``gradnan.formats.trace``)
    <bundle>/tensors.pt      a flat name -> tensor dict

A bundle is written into a temporary directory and renamed into place, so a reader sees all of it or
none of it. Opening one never executes code from it: the manifest is JSON and the tensors are loaded
with ``torch.load(weights_only=True)``, which refuses any pickled object that is not a tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple

import torch

from ..errors import InputError
from .layout import MANIFEST, TENSORS
from .schema import Schema, check_rank, is_int, is_text, read_document

SCHEMA = Schema("gradnan.bundle", 1)


def tensors_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write(path: Path, manifest: Dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write atomically: a temporary sibling directory renamed to ``path`` once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        torch.save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, temporary / TENSORS)
        (temporary / MANIFEST).write_text(json.dumps({**SCHEMA.header(), **manifest}, indent=1, allow_nan=False))
        os.chmod(temporary, 0o755)
        os.rename(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return path


def manifest_from_json(document: Any, where: str) -> Dict[str, Any]:
    """A bundle manifest, checked for what the report needs (``gradnan replay`` checks its trace)."""
    document = SCHEMA.check(document, where)
    module = document.get("module")
    if not isinstance(module, dict) or not is_text(module.get("path")) or not is_int(document.get("step")):
        raise InputError(f"{where}: a bundle manifest needs a 'module' with a 'path' and an integer 'step'")
    check_rank(document.get("rank"), where)
    return document


def load_manifest(path: Path) -> Dict[str, Any]:
    """A capture bundle's manifest alone (its tensors are read by ``gradnan replay``)."""
    return manifest_from_json(read_document(path, SCHEMA), str(path))


def load(path: Path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """The manifest and the tensors of a bundle; InputError (one line) for anything unusable or unsafe."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: not a bundle directory")
    manifest = load_manifest(path / MANIFEST)
    if not isinstance(manifest.get("trace"), dict):
        raise InputError(f"{path / MANIFEST}: a bundle manifest needs a 'trace' object")
    try:
        tensors = torch.load(path / TENSORS, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise InputError(f"{path / TENSORS}: missing") from None
    except Exception as exc:  # an unpickling refusal, a truncated zip, a foreign file
        reason = "holds a pickled object that is not a tensor: refused" if "weights_only" in str(
            exc).lower() or "unpickl" in type(exc).__name__.lower() else f"unreadable ({type(exc).__name__})"
        raise InputError(f"{path / TENSORS}: {reason}") from None
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise InputError(f"{path / TENSORS}: not a flat name -> tensor dict")
    return manifest, tensors
