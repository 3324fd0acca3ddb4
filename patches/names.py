"""Pure functions over parameter names."""

from __future__ import annotations

from typing import Callable, Mapping


def prefix_renamer(prefix_renames: Mapping[str, str]) -> Callable[[str], str]:
    """Rewrites a local name's longest matching prefix (e.g. ``decoder.layers.0.`` on pipeline stage 1) to
    its global form (``decoder.layers.2.``); a name with no matching prefix is returned unchanged. Built
    once per table: each name tries only the distinct prefix lengths, longest first, a dict lookup each
    (50,000 names x hundreds of layers)."""
    lengths = sorted({len(prefix) for prefix in prefix_renames}, reverse=True)

    def rename(local_name: str) -> str:
        for length in lengths:
            replacement = prefix_renames.get(local_name[:length]) if length <= len(local_name) else None
            if replacement is not None:
                return replacement + local_name[length:]
        return local_name

    return rename

