"""How the self-test puts a list of values, an error and a dtype into its one-line messages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:
    import torch


def shortened(values: List[Any], limit: int = 8) -> str:
    """``values`` as a list, cut after ``limit`` of them: a line about thousands of ranks stays readable."""
    return str(values) if len(values) <= limit else f"{str(values[:limit])[:-1]}, ... ({len(values)} values)]"


def first_line(error: BaseException) -> str:
    """The first line of an error (torch's run to pages), or its type when it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as check names and results spell it."""
    return str(dtype).replace("torch.", "")
