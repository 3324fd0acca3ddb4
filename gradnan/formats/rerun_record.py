"""A ``rerun`` record's own fields, checked: its role and what its replica observed (version 2) or
concluded (version 1), where a value grew out of line (``grew_in``), where its output first went
non-finite (``nonfinite_at``), and where the failing micro-batch sits in the data (``samples``).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from ..errors import InputError
from .incident import Conclusion, OwnFailure, RerunRole, values
from .observed import MEGATRON_JOB_VALUES, SEEN_VALUES, Seen, is_observation
from .schema import is_finite, is_int, is_stat, is_text, optional

RERUN_ROLES = values(RerunRole)


RERUN_CONCLUSIONS = values(Conclusion)  # what a version 1 rerun record wrote


OWN_FAILURES = values(OwnFailure)


# a rerun origin's tensor-parallel reduction (``training.rerun_pass.reduction_finding``)
REDUCTION_FINDINGS = ("partial", "received", "collective")


def check_rerun(record: Dict[str, Any], where: str) -> None:
    batch = record.get("batch")
    if (record.get("role") not in RERUN_ROLES or not _concluded(record)
            or not all(optional(record.get(key), is_text)
                       for key in ("trigger", "module", "class", "bundle"))
            or record.get("megatron") not in (None, *MEGATRON_JOB_VALUES)
            or not all(optional(record.get(key), is_int)
                       for key in ("micro_batch", "call", "frames_traced", "origin_rank"))
            or not is_stat(record.get("output_abs_max"))
            or not (batch is None or (isinstance(batch, dict) and is_text(batch.get("path"))))
            or not optional(record.get("grew_in"), is_growth)
            or not optional(record.get("samples"), is_samples)
            or not optional(record.get("nonfinite_at"), is_element)
            or record.get("reduction") not in (None, *REDUCTION_FINDINGS)
            or not optional(record.get("loss_here"), is_loss_here)):
        raise InputError(f"{where}: a rerun record needs 'role' one of {', '.join(RERUN_ROLES)}, 'observed'"
                         " an object with boolean 'reproduced'/'norm_overflow', 'loss'/'loss_again'/"
                         f"'own_gradients' one of {', '.join(SEEN_VALUES)} and 'megatron_job' null or one"
                         f" of {', '.join(MEGATRON_JOB_VALUES)} (version 1: 'conclusion' one of"
                         f" {', '.join(RERUN_CONCLUSIONS)} and 'own_failure' null or one of"
                         f" {', '.join(OWN_FAILURES)}), text or null 'module'/'class'/'bundle',"
                         f" 'megatron' null or one of {', '.join(MEGATRON_JOB_VALUES)},"
                         " integer or null 'micro_batch'/'call'/'origin_rank', 'batch' null or an object"
                         " with a text 'path',"
                         " and 'grew_in' absent, null or an object with text 'module'/'class'/'dtype',"
                         " integer 'call', finite 'output_abs_max'/'inputs_abs_max' and boolean"
                         " 'near_limit', 'samples' absent, null or an object with integer 'consumed',"
                         " 'data_parallel_rank'/'data_parallel_size' and 'indices'/'sources' null or lists"
                         f" (at most {MAX_SAMPLES}), 'nonfinite_at' absent, null or an object with integer"
                         f" 'output' and 'shape'/'index' lists of at most {MAX_DIMS} integers, and"
                         f" 'reduction' absent, null or one of {', '.join(REDUCTION_FINDINGS)}, and"
                         " 'loss_here' absent, null or an object with 'loss'/'loss_again' one of"
                         f" {', '.join(SEEN_VALUES)}")
    origin, world = record.get("origin_rank"), record["rank"].get("world_size")
    if origin is not None and not 0 <= origin < (world if is_int(world) else origin + 1):
        raise InputError(f"{where}: a rerun record's 'origin_rank' {origin} is no rank of its world of"
                         f" {world} ranks")


def is_loss_here(loss_here: Any) -> bool:
    """A rank's own losses in the failing pass and the pass run again (``Seen`` values)."""
    return (isinstance(loss_here, dict)
            and all(loss_here.get(key) in SEEN_VALUES for key in ("loss", "loss_again")))


def loss_here_nonfinite(loss_here: Optional[Mapping[str, Any]]) -> Optional[bool]:
    """Whether a rank's own loss (a rerun record's ``loss_here``) was non-finite in either pass; None
    where it says nothing (no loss on that rank, or a record written before the field)."""
    return None if not loss_here else Seen.NONFINITE.value in loss_here.values()


def _concluded(record: Dict[str, Any]) -> bool:
    """What a rerun record's replica concluded from: its ``observed`` (version 2), or the ``conclusion``
    and ``own_failure`` a version 1 record wrote."""
    if record["version"] >= 2:
        return is_observation(record.get("observed"))
    return (record.get("conclusion") in RERUN_CONCLUSIONS
            and record.get("own_failure") in (None, *OWN_FAILURES))


def is_growth(grew_in: Any) -> bool:
    """A ``rerun`` record's ``grew_in``: where a value first grew out of line (optional, added in place)."""
    return (isinstance(grew_in, dict)
            and all(is_text(grew_in.get(key)) for key in ("module", "class", "dtype"))
            and is_int(grew_in.get("call")) and optional(grew_in.get("micro_batch"), is_int)
            and is_finite(grew_in.get("output_abs_max"))
            and optional(grew_in.get("inputs_abs_max"), is_finite)
            and isinstance(grew_in.get("near_limit"), bool))


MAX_DIMS = 64  # a tensor's dimensions (torch allows 64): an index or a shape
MAX_SAMPLES = 1024  # samples of one micro-batch, documents packed into one sample: far above real batches


def _int_list(value: Any, most: int = MAX_SAMPLES) -> bool:
    return isinstance(value, list) and len(value) <= most and all(is_int(item) for item in value)


def is_element(element: Any) -> bool:
    """A ``rerun`` record's ``nonfinite_at``: the origin output's first non-finite element (optional)."""
    return (isinstance(element, dict) and is_int(element.get("output"))
            and _int_list(element.get("shape"), MAX_DIMS) and _int_list(element.get("index"), MAX_DIMS)
            and len(element["index"]) == len(element["shape"]))


def _is_source(source: Any) -> bool:
    return (isinstance(source, dict) and is_int(source.get("index")) and is_text(source.get("dataset"))
            and optional(source.get("dataset_path"), is_text) and _int_list(source.get("documents"))
            and all(optional(source.get(key), is_int)
                    for key in ("shuffled", "documents_total", "offset", "blend_dataset", "blend_sample")))


def is_samples(samples: Any) -> bool:
    """A ``rerun`` record's ``samples``: where the failing micro-batch sits in Megatron-LM's data (optional,
    added in place)."""
    return (isinstance(samples, dict)
            and all(is_int(samples.get(key))
                    for key in ("consumed", "data_parallel_rank", "data_parallel_size"))
            and all(optional(samples.get(key), is_text) for key in ("sampler", "not_derived"))
            and optional(samples.get("micro_batch_size"), is_int)
            and optional(samples.get("indices"), _int_list)
            and optional(samples.get("sources"),
                         lambda v: isinstance(v, list) and len(v) <= MAX_SAMPLES and all(map(_is_source, v))))
