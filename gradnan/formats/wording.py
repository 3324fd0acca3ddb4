"""The sentences of an incident that both sides print from a file's values: the largest gradient, a value
that grew out of line and where it went non-finite, where the failing micro-batch sits in the data, and a
loss Megatron's check rejected. Every value from a file is shown as untrusted text.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .incident import NORM_OVERFLOW_WORDS
from .magnitude import LIMIT_MARGIN, magnitude_text
from .text import listing, shell_word, untrusted


def describe_largest(largest: Optional[Mapping[str, Any]]) -> str:
    """A record's ``largest_grad`` as a log line and a report name it: "decoder.x.weight[3, 5] = 1e+30"."""
    if not largest:
        return "none"
    index = ", ".join(str(i) for i in largest.get("index") or [])
    number, name = largest["value"], untrusted(largest["name"])
    shown = f"{number:.4g}" if isinstance(number, (int, float)) else number
    return f"{name}[{index}] = {shown}"


def norm_overflow_summary(rank: str, largest: Mapping[str, Any], before_collective: bool) -> str:
    """The verdict's summary for exploding gradients: the rank (``rank_label``), parameter, element, value."""
    when = " before the data-parallel collective" if before_collective else ""
    return (f"exploding gradients: {NORM_OVERFLOW_WORDS}: {rank} held the largest gradient{when},"
            f" {describe_largest(largest)}, whose square passes float32's range; the data or the numerics"
            " (a diverging loss, a bad batch, a learning rate too high), not one device")


def _magnitudes(grew_in: Mapping[str, Any]) -> str:
    """``2.91 -> 3.9e28``, and whether the output came near its dtype's limit."""
    text = (f"{magnitude_text(grew_in.get('inputs_abs_max'))} ->"
            f" {magnitude_text(grew_in.get('output_abs_max'))}")
    if grew_in.get("near_limit"):
        text += f", within {LIMIT_MARGIN:g}x of the {_dtype(grew_in)} limit"
    return text


def grew_text(grew_in: Mapping[str, Any]) -> str:
    """The culprit of a value that grew out of line (a ``rerun`` record's ``grew_in``), as the verdict
    names it: ``decoder.layers.0.mlp (MLP) grew a value out of line (2.91 -> 3.9e28)``."""
    return f"{_module(grew_in)} grew a value out of line ({_magnitudes(grew_in)})"


def growth_path(grew_in: Mapping[str, Any], module: Optional[str], module_class: Optional[str]) -> str:
    """The magnitude path as a report headline says it: where the value grew, then where it went
    non-finite (``module``; None: it stayed finite on the ranks traced)."""
    grown = (f"{_module(grew_in)} grew a value to"
             f" {magnitude_text(grew_in.get('output_abs_max'))} (from"
             f" {magnitude_text(grew_in.get('inputs_abs_max'))})")
    if grew_in.get("near_limit"):
        grown += f", near the {_dtype(grew_in)} limit"
    return grown + (f", which went non-finite in {_module(module, module_class)}" if module else "")


def _module(module: Any, module_class: Any = None) -> str:
    """ "decoder.layers.0.mlp (MLP)": a module and its class from a file (a ``grew_in``, or the two)."""
    if isinstance(module, Mapping):
        module, module_class = module["module"], module["class"]
    return f"{untrusted(module)} ({untrusted(module_class)})"


def _dtype(grew_in: Mapping[str, Any]) -> str:
    return untrusted(str(grew_in.get("dtype")).removeprefix("torch."))


def growth_log(grew_in: Mapping[str, Any], module: Optional[str], module_class: Optional[str]) -> str:
    """The magnitude path as a rank's log line says it."""
    grown = (f"values first grew out of line in {_module(grew_in)}"
             f" ({_magnitudes(grew_in)})")
    return grown + (f", then went non-finite in {_module(module, module_class)}" if module else "")


MAX_SAMPLES_SHOWN = 8  # sample indices (and their documents) a log line or the report names


def samples_wording(samples: Dict[str, Any], micro_batch: Any) -> str:
    """Where a failing micro-batch sits in Megatron-LM's data (a ``rerun`` record's ``samples``), in one
    sentence: its global sample indices on its data-parallel rank, the samples consumed before the
    iteration, and the documents behind each sample where the dataset is megatron-core's."""
    where = (f"data-parallel rank {samples['data_parallel_rank']} of {samples['data_parallel_size']},"
             f" micro-batch {micro_batch}")
    consumed = f"{samples['consumed']} samples consumed before this iteration"
    indices = samples.get("indices")
    if not indices:
        return f"{where}: {consumed}; sample indices not derived ({samples.get('not_derived')})"
    shown = ", ".join(map(str, indices[:MAX_SAMPLES_SHOWN]))
    more = f" and {len(indices) - MAX_SAMPLES_SHOWN} more" if len(indices) > MAX_SAMPLES_SHOWN else ""
    text = f"{where}: global samples {shown}{more} ({consumed})"
    sources = [_source_wording(source) for source in (samples.get("sources") or [])[:MAX_SAMPLES_SHOWN]]
    return text + ("; " + "; ".join(sources) if sources else "")


def _source_wording(source: Dict[str, Any]) -> str:
    blend = (f"blend dataset {untrusted(source['blend_dataset'])} sample {source['blend_sample']}, "
             if source.get("blend_dataset") is not None else "")
    documents = listing(source["documents"])
    more = (f" (of {source['documents_total']})"
            if (source.get("documents_total") or 0) > len(source["documents"]) else "")
    path = f" {untrusted(source['dataset_path'])}" if source.get("dataset_path") else ""
    dataset = untrusted(source["dataset"])
    return (f"sample {source['index']}: {blend}{dataset}{path} document(s) {documents}{more}"
            f" from token {source.get('offset')}")


def micro_batch_words(micro_batch: Any) -> str:
    """"micro-batch 3", or "an unnamed micro-batch" where the records name none."""
    return "an unnamed micro-batch" if micro_batch is None else f"micro-batch {untrusted(micro_batch)}"


def rejected_loss_summary(rank: Any, micro_batch: Any, loss: Any, batch: Optional[str],
                          rerun_skipped: Optional[str]) -> str:
    """The verdict's summary of a loss Megatron's check rejected (``--rerun-mode disabled``): what
    Megatron did, what gradnan could and could not do before Megatron raised."""
    kept = f"kept the micro-batch ({shell_word(batch)})" if batch else "kept no micro-batch"
    look = "look at the kept micro-batch, or " if batch else ""
    again = (f"it could not run the step again ({untrusted(rerun_skipped)}): {look}run with --rerun-mode"
             " validate_results, to tell the data from the device" if rerun_skipped
             else "the step's forward pass was run again in place (see the rerun)")
    return (f"Megatron's loss check rejected a non-finite loss ({untrusted(loss)}) on rank {rank}"
            f" ({micro_batch_words(micro_batch)}) and raised (--rerun-mode disabled): the forward pass or the"
            f" loss function went non-finite on that micro-batch. gradnan recorded the loss before Megatron"
            f" raised and {kept}; {again}")
