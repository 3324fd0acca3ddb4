"""Capture bundles on disk: everything needed to replay one module call offline.

    <out_dir>/bundles/<rank tag>/step<NNNNNNN>_<module path>[_<k>]/manifest.json   (gradnan.bundle, JSON)
    <out_dir>/bundles/<rank tag>/step<NNNNNNN>_<module path>[_<k>]/tensors.pt      (a flat name -> tensor dict)

A bundle is written into a temporary directory and renamed into place, so a reader sees all of it or
none of it. Opening one never executes code from it: the manifest is JSON and the tensors are loaded
with ``torch.load(weights_only=True)``, which refuses any pickled object that is not a tensor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple

import torch

from .reader import ReadError, load_bundle_manifest
from .records import rank_tag

BUNDLE_SCHEMA = "gradnan.bundle"
BUNDLE_VERSION = 1
BUNDLES_DIR = "bundles"
MANIFEST = "manifest.json"
TENSORS = "tensors.pt"


def bundle_dir(out_dir: str, coords: Mapping[str, Any], step: int, module_path: str) -> Path:
    """A new, unused directory name for this rank, step and module (a suffix keeps earlier bundles)."""
    parent = Path(out_dir) / BUNDLES_DIR / rank_tag(coords)
    stem = f"step{step:07d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', module_path) or 'model'}"
    candidate, suffix = parent / stem, 1
    while candidate.exists():
        suffix += 1
        candidate = parent / f"{stem}_{suffix}"
    return candidate


def tensors_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_bundle(path: Path, manifest: Dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write atomically: a temporary sibling directory renamed to ``path`` once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        torch.save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, temporary / TENSORS)
        (temporary / MANIFEST).write_text(json.dumps(
            {"schema": BUNDLE_SCHEMA, "version": BUNDLE_VERSION, **manifest}, indent=1, allow_nan=False))
        os.chmod(temporary, 0o755)
        os.rename(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return path


def load_bundle(path: Path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """The manifest and the tensors of a bundle; ReadError (one line) for anything unusable or unsafe."""
    path = Path(path)
    if not path.is_dir():
        raise ReadError(f"{path}: not a bundle directory")
    manifest = load_bundle_manifest(path / MANIFEST)
    if not isinstance(manifest.get("trace"), dict):
        raise ReadError(f"{path / MANIFEST}: a bundle manifest needs a 'trace' object")
    try:
        tensors = torch.load(path / TENSORS, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise ReadError(f"{path / TENSORS}: missing") from None
    except Exception as exc:  # an unpickling refusal, a truncated zip, a foreign file
        reason = "holds a pickled object that is not a tensor: refused" if "weights_only" in str(
            exc).lower() or "unpickl" in type(exc).__name__.lower() else f"unreadable ({type(exc).__name__})"
        raise ReadError(f"{path / TENSORS}: {reason}") from None
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ReadError(f"{path / TENSORS}: not a flat name -> tensor dict")
    return manifest, tensors
