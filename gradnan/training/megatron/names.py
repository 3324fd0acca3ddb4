"""Pure functions over parameter names."""

from __future__ import annotations

from typing import Mapping


def global_name(local_name: str, prefix_renames: Mapping[str, str]) -> str:
    """Rewrite the longest matching local prefix (e.g. ``decoder.layers.0.`` on pipeline stage 1) to its
    global form (``decoder.layers.2.``); names with no matching prefix are returned unchanged."""
    best = ""
    for prefix in prefix_renames:
        if len(prefix) > len(best) and local_name.startswith(prefix):
            best = prefix
    return prefix_renames[best] + local_name[len(best):] if best else local_name
