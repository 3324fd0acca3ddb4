"""How findings read in the log: where (rank, coordinates, host, device) and what (parameter, counts)."""

from __future__ import annotations

from typing import Any, Dict

from ..formats.layout import rank_label, step_label
from ..formats.schema import nonfinite_counts
from ..formats.text import PlainSpaces

# on the gradnan logger from install(): its wordings share values laid out for a text with the report
PLAIN_SPACES = PlainSpaces()


def where(document: Dict[str, Any]) -> str:
    """The rank of a record or manifest: "rank 1 (tp1 pp0 dp0, host cuda:1)"."""
    return rank_label(document["rank"], "inside")


def when(document: Dict[str, Any]) -> str:
    """The step as the user's own log counts it: Megatron-LM's iteration where its loop runs."""
    return step_label(document["step"], document.get("iteration"))


def describe_params(record: Dict[str, Any]) -> str:
    params = record["params"]
    if not params:
        return "no local parameter gradient is non-finite"
    first = params[0]
    if record["params_total"] == 1:
        return (f"non-finite gradient in {first['name']} ({nonfinite_counts(first)}, first at "
                f"{first['first_bad_index']})")
    return (f"non-finite gradients in {record['params_total']} parameters, the first in backward order"
            f" {first['name']} ({nonfinite_counts(first)}, first at {first['first_bad_index']})")


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
