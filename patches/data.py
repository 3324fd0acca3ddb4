"""Where the failing micro-batch came from, in the terms a user restarts Megatron-LM with: the samples its
training loop had consumed before the iteration, the global sample indices of the micro-batch on this
data-parallel rank, and, for megatron-core's GPT and blended datasets, the dataset and documents behind
each sample.

Megatron-LM's ``--dataloader-type single`` sampler (``MegatronPretrainingSampler``, its default) is
deterministic: its data loader starts at ``args.consumed_train_samples`` and hands each iteration's global
batch out in micro-batch rounds of ``micro_batch_size * data_parallel_size`` consecutive indices,
data-parallel rank ``r`` taking the ``r``-th block of ``micro_batch_size`` of each round, so micro-batch
``m`` of the iteration holds, on rank ``r``::

    consumed + m * micro_batch_size * data_parallel_size + r * micro_batch_size + k,  k < micro_batch_size

(``consumed_train_samples`` grows by the global batch after each iteration, and after each one
``--iterations-to-skip`` skips). The ``cyclic`` sampler draws from a seeded permutation of the whole
dataset, the ``external`` loader from the user's own: not derived; nor under
``--phase-transition-iterations`` (the loader restarts at each phase). Only modules already imported are
read: nothing here imports Megatron-LM.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .model import integer_or_none, megatron_lm_args

MAX_SAMPLES = 64  # sample indices (and their documents) recorded per micro-batch at most
MAX_DOCUMENTS = 16  # documents named per sample at most (a sample of short documents spans many)
_BEHIND = ("source", "iterable", "_dataset", "dataset")  # how a data iterator reaches its dataset
_MAX_DEPTH = 6


def why_not_derived(args: Any) -> Optional[str]:
    """Why the sample indices cannot be derived from Megatron-LM's arguments, or None."""
    sampler = getattr(args, "dataloader_type", None)
    if sampler != "single":
        return f"--dataloader-type {sampler}: only the 'single' sampler's indices follow from the count"
    if getattr(args, "phase_transition_iterations", None):
        return "--phase-transition-iterations: the data loader restarts at each phase"
    if getattr(args, "hybrid_context_parallel", False):
        return "--hybrid-context-parallel: its sampler hands out whole global batches"
    if integer_or_none(getattr(args, "micro_batch_size", None)) is None:
        return "no integer micro_batch_size in Megatron-LM's arguments"
    return None


def sample_indices(consumed: int, micro_batch: int, micro_batch_size: int, dp_rank: int,
                   dp_size: int) -> List[int]:
    """The global sample indices of ``micro_batch`` on data-parallel rank ``dp_rank`` (module docstring)."""
    start = consumed + micro_batch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return list(range(start, start + micro_batch_size))


def dataset_behind(iterator: Any) -> Any:
    """The megatron-core dataset a data iterator draws from (through gradnan's keeping iterator, Megatron's
    ``RerunDataIterator``, a torch ``DataLoader`` or its iterator), or None."""
    found = iterator
    for _ in range(_MAX_DEPTH):
        if found is None or _is_megatron_dataset(found):
            return found
        found = next((getattr(found, name) for name in _BEHIND if getattr(found, name, None) is not None),
                     None)
    return None


def _is_megatron_dataset(value: Any) -> bool:
    return type(value).__module__.startswith("megatron.core.datasets.")


def _documents(dataset: Any, index: int) -> Dict[str, Any]:
    """A GPT dataset's sample: its shuffled position, the documents of the low-level dataset it spans
    (``document_index`` over ``sample_index[s]..sample_index[s + 1]``, as ``GPTDataset.__getitem__``
    reads them) and the token offset it starts at in the first."""
    dataset._query_document_sample_shuffle_indices(index)  # loads the lazily mapped indices
    shuffled = int(dataset.shuffle_index[index])
    first, offset = (int(v) for v in dataset.sample_index[shuffled])
    last = int(dataset.sample_index[shuffled + 1][0])
    documents = [int(d) for d in dataset.document_index[first:min(last + 1, first + MAX_DOCUMENTS)]]
    return {"shuffled": shuffled, "documents": documents, "documents_total": last - first + 1,
            "offset": offset}


def sample_source(dataset: Any, index: int) -> Optional[Dict[str, Any]]:
    """The dataset and documents behind global sample ``index`` of a megatron-core GPT or blended dataset;
    None for any other dataset."""
    entry: Dict[str, Any] = {"index": index}
    if hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):  # BlendedDataset
        dataset[index]  # loads its lazily mapped indices
        chosen = int(dataset.dataset_index[index])
        entry.update({"blend_dataset": chosen, "blend_sample": int(dataset.dataset_sample_index[index])})
        index, dataset = entry["blend_sample"], dataset.datasets[chosen]
    if not (hasattr(dataset, "_query_document_sample_shuffle_indices") and hasattr(dataset, "sample_index")):
        return None
    path = getattr(dataset, "dataset_path", None)
    return {**entry, "dataset": type(dataset).__name__,
            "dataset_path": path if isinstance(path, str) else None, **_documents(dataset, index)}


def micro_batch_samples(micro_batch: int, data_iterator: Any) -> Optional[Dict[str, Any]]:
    """What locates micro-batch ``micro_batch`` of the iteration in progress in the data, as the ``rerun``
    record's ``samples`` (docs/formats.md); None where Megatron-LM's loop is not running."""
    from megatron.core import parallel_state

    args = megatron_lm_args()
    consumed = integer_or_none(getattr(args, "consumed_train_samples", None))
    if consumed is None:
        return None
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    why_not = why_not_derived(args)
    indices = None if why_not else sample_indices(consumed, micro_batch, args.micro_batch_size, dp_rank,
                                                  dp_size)[:MAX_SAMPLES]
    dataset = dataset_behind(data_iterator) if indices else None
    sources = None
    if dataset is not None and indices is not None:  # a dataset is looked for only where there are indices
        found = [sample_source(dataset, index) for index in indices]
        sources = found if all(found) else None
    return {"consumed": consumed, "sampler": getattr(args, "dataloader_type", None),
            "micro_batch_size": integer_or_none(getattr(args, "micro_batch_size", None)),
            "data_parallel_rank": dp_rank, "data_parallel_size": dp_size, "indices": indices,
            "not_derived": why_not, "sources": sources}
