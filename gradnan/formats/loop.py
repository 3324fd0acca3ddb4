"""Which training loop ran a step, as a record names it (``loop``): Megatron-LM's (``megatron.training``)
or Megatron-Bridge's, and its release; null where neither runs (a loop of the user's own). The report
words every action in that loop's terms (``decision/loop_terms.py``): a flag, an override, or what to do
where the loop has no option for it."""

from __future__ import annotations

import enum
import re
from typing import Any, Dict, Optional, Tuple

from .schema import is_text


class LoopKind(str, enum.Enum):
    MEGATRON_LM = "megatron-lm"
    """Megatron-LM's ``megatron.training`` loop (``pretrain_gpt.py`` and its kin): command-line flags."""
    MEGATRON_BRIDGE = "megatron-bridge"
    """Megatron-Bridge's ``megatron.bridge.training`` loop (its recipes): ``KEY=VALUE`` overrides."""


RELEASE = re.compile(r"(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?")  # 0.19.2, 0.20.0rc1, 0.6.2 (+ local tags)


def to_json(kind: LoopKind, release: Optional[str]) -> Dict[str, Any]:
    return {"name": kind.value, "release": release}


def is_loop(value: Any) -> bool:
    """A record's ``loop``: null, or a known loop's name with its release (text or null)."""
    names = {kind.value for kind in LoopKind}
    return value is None or (isinstance(value, dict) and value.get("name") in names
                             and (value.get("release") is None or is_text(value.get("release"))))


def release_text(release: Any) -> Optional[str]:
    """The release a record names, as the report may print it: its leading ``MAJOR.MINOR[.PATCH]`` alone
    (a file's value is untrusted: nothing else of it reaches a line), None where it starts with none."""
    found = RELEASE.match(release) if isinstance(release, str) else None
    return None if found is None else found.group(0)


def release_numbers(release: Optional[str]) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) of a release as text, None where it is not one (a file's value is untrusted)."""
    found = RELEASE.match(release or "")
    if found is None:
        return None
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)
