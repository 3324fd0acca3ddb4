"""A ``state`` record's and a ``checkpoint`` mark's own fields, checked: what the report and the restart
advice read of the weights and the optimizer state (their non-finite entries, digests, learning rates,
the vocabulary's outlying rows and second moments below zero). A row the writer would not list is no row.
"""

from __future__ import annotations

from typing import Any, Dict

from ..errors import InputError
from .layout import MAX_VOCABULARY, ROW_OUTLIER, VOCABULARY_ROWS
from .schema import is_bool, is_finite, is_int, is_stat, is_text, optional

# a record's offending parameters kept by a reader, in the order written (backward order: the first to go
# bad); the writer lists 64 (max_params_per_record): a file listing 100,000 costs the report no more
MAX_PARAMS_READ = 1024


WEIGHT_COPIES = ("model", "main")
_STATE_COUNTS = ("nan", "inf", "negative")


def _is_state_fault(entry: Any) -> bool:
    return (isinstance(entry, dict) and is_text(entry.get("name")) and is_text(entry.get("state"))
            and optional(entry.get("id"), is_int)
            and all(is_int(entry.get(key)) and entry[key] >= 0 for key in _STATE_COUNTS))


MAX_RATE_STEPS, MAX_RATE_GROUPS = 64, 4096  # far above what gradnan writes: 8 steps, a rate per group


def _is_learning_rates(value: Any) -> bool:
    """A ``state`` record's ``learning_rates`` (optional, added in place)."""
    return isinstance(value, list) and len(value) <= MAX_RATE_STEPS and all(
        isinstance(entry, dict) and is_int(entry.get("step")) and isinstance(entry.get("lr"), list)
        and len(entry["lr"]) <= MAX_RATE_GROUPS and all(is_stat(rate) for rate in entry["lr"])
        for entry in value)


MAX_ROWS = 64  # far above what gradnan writes (8)


def _is_row(entry: Any) -> bool:
    """An outlying vocabulary row: its weight's name, the shard's row count, the row, its largest magnitude,
    the rows' median and whether every step reads it."""
    return (isinstance(entry, dict) and entry.get("name") in VOCABULARY_ROWS and is_int(entry.get("rows"))
            and is_int(entry.get("row")) and 0 <= entry["row"] < entry["rows"] <= MAX_VOCABULARY
            and is_stat(entry.get("largest")) and is_stat(entry.get("median"))
            and optional(entry.get("every_step"), is_bool)
            and _out_of_line(entry["largest"], entry["median"]))


def _out_of_line(largest: Any, median: Any) -> bool:
    """What makes the writer list a row (``training.weights.outlying_rows``): non-finite, or ``ROW_OUTLIER``
    times a positive median."""
    if not is_finite(largest):
        return True
    return is_finite(median) and median > 0 and largest > ROW_OUTLIER * median


def _is_rows(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_ROWS and all(map(_is_row, value))


def check_state(record: Dict[str, Any], where: str) -> None:
    faults = record.get("optimizer_state")
    if isinstance(faults, list) and len(faults) > MAX_PARAMS_READ:  # optimizer_state_total counts them
        faults = record["optimizer_state"] = faults[:MAX_PARAMS_READ]
    if (not all(entry.get("copy") in WEIGHT_COPIES for entry in record["params"])
            or not is_text(record.get("weights_digest"))
            or not optional(record.get("launch_weights_finite"), lambda v: isinstance(v, bool))
            or not all(is_int(record.get(key)) for key in ("params_checked", "optimizer_state_total",
                                                           "optimizer_state_checked"))
            or not (isinstance(faults, list) and all(map(_is_state_fault, faults)))
            or not optional(record.get("learning_rates"), _is_learning_rates)
            or not optional(record.get("outlying_rows"), _is_rows)
            or not optional(record.get("negative_total"), is_int)
            or not optional(record.get("negative_moments"), lambda found: isinstance(found, list) and all(
                map(_is_mark_entry, found)) and len(found) <= (record.get("negative_total") or 0))):
        raise InputError(f"{where}: a state record needs each param's 'copy' one of"
                         f" {', '.join(WEIGHT_COPIES)}, a text 'weights_digest', 'launch_weights_finite'"
                         " null or a boolean, integer 'params_checked'/'optimizer_state_total'/"
                         "'optimizer_state_checked', an 'optimizer_state' list of objects with text"
                         " 'name'/'state' and counts 'nan'/'inf'/'negative', and 'learning_rates' absent,"
                         f" null or a list of at most {MAX_RATE_STEPS} objects with an integer 'step' and an"
                         f" 'lr' list of at most {MAX_RATE_GROUPS} numbers or nulls, and 'outlying_rows'"
                         f" absent, null or a list of at most {MAX_ROWS} objects with a 'name' among"
                         f" {', '.join(VOCABULARY_ROWS)}, integer 'rows' and 'row' (0 <= row < rows <="
                         f" {MAX_VOCABULARY}), numeric 'largest' (non-finite, or over {ROW_OUTLIER:g} times a"
                         " positive 'median') and 'every_step' absent, null or a boolean")


MARKED_TENSORS = ("weight", "main", "moment")  # what a checkpoint mark checks (``checked``'s keys)


def _is_mark_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and is_text(entry.get("name")) and is_text(entry.get("tensor"))


def check_checkpoint(record: Dict[str, Any], where: str) -> None:
    """A checkpoint mark: its fields as ``gradnan checkpoints`` and the restart advice read them."""
    checked, bad = record.get("checked"), record.get("nonfinite")
    if (not isinstance(record.get("clean"), bool) or not is_text(record.get("weights_digest"))
            or not is_int(record.get("save")) or not is_int(record.get("nonfinite_total"))
            or not all(optional(record.get(key), is_int) for key in ("saved_iteration", "after_incident"))
            or not optional(record.get("checkpoint"), is_text)
            or not (isinstance(checked, dict) and all(is_int(checked.get(key)) for key in MARKED_TENSORS))
            or not (isinstance(bad, list) and all(map(_is_mark_entry, bad)))
            or not optional(record.get("outlying_rows"), _is_rows)
            or record["clean"] != (record["nonfinite_total"] == 0) or len(bad) > record["nonfinite_total"]):
        raise InputError(f"{where}: a checkpoint record needs a boolean 'clean' (true exactly where"
                         " 'nonfinite_total' is 0), a text 'weights_digest', integer"
                         " 'save'/'nonfinite_total',"
                         " 'saved_iteration'/'after_incident' null or integers, 'checkpoint' null or text, a"
                         f" 'checked' object of integer {'/'.join(MARKED_TENSORS)}, a 'nonfinite' list of"
                         " at most 'nonfinite_total' objects with text 'name'/'tensor', 'outlying_rows'"
                         f" absent, null or a list of at most {MAX_ROWS} rows, and 'negative_moments' absent,"
                         " null or a list of at most 'negative_total' such objects")
