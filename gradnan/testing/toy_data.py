"""The toy job's data: random token batches, or Megatron-LM's data path on megatron-core's real
MockGPTDataset (MegatronLMData), with samples poisoned by a token whose embedding row overflows.

Apart from toy because it stands in for what Megatron-LM's training loop reads and counts (the sampler,
consumed_train_samples in its global arguments): a reader comparing it with Megatron-LM finds it whole
here.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch

from .toy_faults import _param_by_global_name
from .toy_job import TinyGPTJob


def _batches(job: TinyGPTJob, dp_rank: int):
    """The same micro-batches on every device: drawn on the CPU, then moved to the job's device."""
    generator = torch.Generator().manual_seed(job.seed + 7919 * dp_rank)
    mask = torch.triu(torch.ones(job.seq_length, job.seq_length, dtype=torch.bool), diagonal=1)
    position_ids = torch.arange(job.seq_length).unsqueeze(0).expand(job.micro_batch_size, -1)
    while True:
        tokens = torch.randint(
            0, job.vocab_size, (job.micro_batch_size, job.seq_length + 1), generator=generator
        )
        yield {name: tensor.to(job.device) for name, tensor in {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": position_ids,
            "attention_mask": mask.view(1, 1, job.seq_length, job.seq_length),
        }.items()}


POISON_TOKEN_FROM_END = 1  # the poisoned token is the model's last vocabulary entry
POISON_ROW = 1e38


class _TinyTokenizer:
    """What megatron-core's GPT datasets read of a tokenizer."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab_size, 0, 1
        self.unique_identifiers = {"class": "TinyTokenizer", "vocab_size": vocab_size}


class PoisonedSamples(torch.utils.data.Dataset):
    """``dataset`` with the token at ``position`` of each sample in ``poisoned`` replaced by ``token``."""

    def __init__(self, dataset: Any, poisoned: Tuple[int, ...], position: int, token: int) -> None:
        self.dataset, self.poisoned, self.position, self.token = dataset, set(poisoned), position, token

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sample = self.dataset[index]
        # megatron-core before 0.13 counts mock tokens up past any vocabulary (0.13+ wraps them at the
        # tokenizer's, which is below the poisoned token): wrapped there, the same data on every version
        sample = {**sample, "tokens": sample["tokens"] % self.token, "labels": sample["labels"] % self.token}
        if index in self.poisoned:
            sample["tokens"][self.position] = self.token
        return sample


def _pretraining_sampler(consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """Megatron-LM's ``MegatronPretrainingSampler`` (``--dataloader-type single``) as its ``__iter__``
    walks the indices: rounds of ``micro_batch_size * dp_size``, this rank's block of each."""
    batch = []
    for index in range(consumed, 1 << 62):
        batch.append(index)
        if len(batch) == micro_batch_size * dp_size:
            yield batch[dp_rank * micro_batch_size:(dp_rank + 1) * micro_batch_size]
            batch = []


class MegatronLMData:
    """Megatron-LM's data path on megatron-core's real ``MockGPTDataset``: a torch ``DataLoader`` over it
    with Megatron-LM's pretraining sampler, and its arguments (``consumed_train_samples``,
    ``curr_iteration``, ...) in ``megatron.training.global_vars._GLOBAL_ARGS``, counted as its training
    loop counts them (Megatron-LM itself is not installable here)."""

    def __init__(self, job: "TinyGPTJob", dp_rank: int, dp_size: int) -> None:
        import sys
        import types

        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

        config = GPTDatasetConfig(random_seed=job.seed, sequence_length=job.seq_length,
                                  tokenizer=_TinyTokenizer(job.vocab_size - POISON_TOKEN_FROM_END),
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                  split="1,0,0")
        dataset, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [None, None, None], lambda: True,
                                                      config).build()
        self.dataset = PoisonedSamples(dataset, job.poisoned_samples, job.poison_position,
                                       job.vocab_size - POISON_TOKEN_FROM_END)
        self.job, self.dp_rank, self.dp_size = job, dp_rank, dp_size
        self.args = types.SimpleNamespace(consumed_train_samples=0, curr_iteration=0,
                                          dataloader_type="single", micro_batch_size=job.micro_batch_size)
        module: Any = types.ModuleType("megatron.training.global_vars")  # a stand-in: holds _GLOBAL_ARGS
        module._GLOBAL_ARGS = self.args
        self._saved = sys.modules.get(module.__name__)
        sys.modules[module.__name__] = module

    def iterator(self) -> Iterator[Any]:
        sampler = _pretraining_sampler(self.args.consumed_train_samples, self.job.micro_batch_size,
                                       self.dp_rank, self.dp_size)
        return iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler))

    def iteration_done(self) -> None:
        self.args.curr_iteration += 1
        self.args.consumed_train_samples += self.dp_size * self.job.micro_batch_size * self.job.micro_batches

    def close(self) -> None:
        import sys

        sys.modules.pop("megatron.training.global_vars", None)
        if self._saved is not None:
            sys.modules["megatron.training.global_vars"] = self._saved


def _poison_token_row(chunks, token: int) -> None:
    """The poisoned token's embedding row ``POISON_ROW`` (on the stage that embeds)."""
    weight = _param_by_global_name(chunks, "embedding.word_embeddings.weight")
    if weight is not None:
        with torch.no_grad():
            weight[token] = POISON_ROW
