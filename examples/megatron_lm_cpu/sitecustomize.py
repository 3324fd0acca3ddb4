"""Run Megatron-LM's own ``pretrain_gpt.py`` on a CPU-only torch (gloo), to try gradnan without a GPU.

Not needed, and not to be used, on GPUs. Put this directory on ``PYTHONPATH`` with
``MEGATRON_LM_ON_CPU=1`` (docs/recipes.md has the whole command). It acts only inside torchrun's
workers (``LOCAL_RANK`` set; not in the processes a worker starts) and changes nothing in Megatron-LM's
files: it tells Megatron-LM that one CUDA device is there, gives it the device properties it asks for,
points the legacy fused-kernel loader at a stand-in ``nvcc`` that only prints a version, and activates
gradnan's CPU shim (``gradnan.testing.cpu_shim``), which sends every CUDA tensor to the CPU and stands in
for CUDA streams.

To see gradnan at work it can also plant a fault on one rank from outside the script:
- ``PLANT_NAN=RANK:ITERATION:PARAMETER[:VALUE]``: a NaN (or VALUE, e.g. ``1e30``) in that parameter's
  gradient during backward;
- ``PLANT_OVERFLOW=RANK:ITERATION:MODULE[:VALUE]``: an Inf (or VALUE, e.g. ``3.9e28``) in that module's
  forward output.
- ``PLANT_POISON=SAMPLE[,SAMPLE...][:POSITION]``: poisoned data. Those global samples of the training
  data carry, at token POSITION (default 3), the padded vocabulary's last token, which no data holds
  (padding); that token's embedding row is finite but 1e38 on every rank, so a layer norm's variance of it
  overflows: the samples fail wherever and whenever they are read, every weight finite. A reproducible data
  incident, for the samples' indices and ``--iterations-to-skip``.
- ``PLANT_WEIGHT=RANK:ITERATION:PARAMETER[:VALUE]``: a NaN (or VALUE) written into that parameter's first
  element, and its optimizer's fp32 main copy, before the iteration's forward pass: one replica's copy of a
  weight gone bad (a bad write, a faulty device);
- ``PLANT_ROW=RANK[,RANK...]:ITERATION:PARAMETER:ROW[:VALUE]``: as ``PLANT_WEIGHT``, every element of row
  ROW of that 2-D parameter (``embedding.word_embeddings.weight``: a token's row of this rank's vocabulary
  shard) set to VALUE (default 1e30);
- ``PLANT_LOSS=RANK[,RANK...]:ITERATION[:after_report]``: the loss function of those ranks divides its loss
  by a zero token count (as a loss function that divides by its own count of valid tokens does for a
  micro-batch without one): NaN from a finite model output. Plant it on every rank of the last pipeline
  stage of a replica. ``after_report``: it reports (``lm loss``, for logging) before it divides, so only the
  loss backward uses is NaN, the reported one finite.
- ``PLANT_LINK=RANK:ITERATION:forward|backward[:VALUE]``: what RANK receives over the pipeline's
  point-to-point link (``forward``: the previous stage's activation; ``backward``: the next stage's
  gradient) gets a NaN (or VALUE) in its first element once the transfer has finished: the sender's tensor
  was finite, the link delivered a bad one (a faulty interconnect, a corrupting communication library).
ITERATION is the one Megatron-LM's log prints: ``N`` (every pass of iteration N, Megatron's own rerun of
it included), ``N-`` (every iteration from N on: a persistent fault) or ``N!`` (the first pass of
iteration N only: a one-off glitch that a rerun does not meet again). Names are global
(``decoder.layers.1.mlp.linear_fc1``).
"""

import os

# torchrun's worker itself, not the processes it starts (make, pybind11, compilers): they inherit the marker
if ("LOCAL_RANK" in os.environ and os.environ.get("MEGATRON_LM_ON_CPU") == "1"
        and "MEGATRON_LM_ON_CPU_WORKER" not in os.environ):
    os.environ["MEGATRON_LM_ON_CPU_WORKER"] = str(os.getpid())
    import stat
    import sys
    import tempfile
    import types

    import torch

    def _fake_nvcc_home() -> str:
        home = tempfile.mkdtemp(prefix="fake-cuda-home-")
        os.makedirs(os.path.join(home, "bin"))
        nvcc = os.path.join(home, "bin", "nvcc")
        with open(nvcc, "w") as out:
            out.write("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.0'\n")
        os.chmod(nvcc, stat.S_IRWXU)
        return home

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(
        major=9, minor=0, name="cpu (stand-in)", total_memory=16 << 30, multi_processor_count=1)
    import torch.utils.cpp_extension

    torch.utils.cpp_extension.CUDA_HOME = _fake_nvcc_home()

    from gradnan.testing.cpu_shim import SHIM

    SHIM.activate()

    def _planted(variable, default):
        """(rank, iteration spec, name, value) from ``RANK:ITERATION:NAME[:VALUE]``, or None."""
        spec = os.environ.get(variable)
        if not spec:
            return None
        rank, iteration, name, *value = spec.split(":", 3)
        return int(rank), iteration, name, float(value[0]) if value else default

    def _due(spec, fired):
        """Whether a fault planted at ``spec`` (``N``, ``N-``, ``N!``) fires in this pass."""
        current = _iteration()
        if spec.endswith("-"):
            return current >= int(spec[:-1])
        if spec.endswith("!"):
            return current == int(spec[:-1]) and not fired
        return current == int(spec)

    def _iteration():
        from megatron.training.global_vars import get_args

        return get_args().curr_iteration + 1

    def _plant_faults() -> None:
        """Wrap Megatron DDP's constructor: the model is built, its global names are known."""
        from megatron.core.distributed import DistributedDataParallel

        from gradnan.patches.model import global_named_modules, global_named_parameters

        nan, overflow = _planted("PLANT_NAN", float("nan")), _planted("PLANT_OVERFLOW", float("inf"))
        original = DistributedDataParallel.__init__
        rank = int(os.environ.get("RANK", "0"))

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if nan is not None and nan[0] == rank:
                for name, param in global_named_parameters([self]):
                    if name == nan[2]:
                        param.register_hook(_poisoning(nan[1], nan[3]))
            if overflow is not None and overflow[0] == rank:
                for name, module in global_named_modules([self]):
                    if name == overflow[2]:
                        module.register_forward_hook(_overflowing(overflow[1], overflow[3]))

        DistributedDataParallel.__init__ = init

    POISON_ROW = 1e38

    def _plant_poisoned_samples() -> None:
        """The samples' token replaced as the GPT dataset hands them out, the token's embedding row set
        once the model is built (on the tensor-parallel rank whose vocabulary shard holds it)."""
        from megatron.core.datasets.gpt_dataset import GPTDataset
        from megatron.core.distributed import DistributedDataParallel
        from megatron.training.global_vars import get_args

        from gradnan.patches.model import global_named_modules

        samples, *position = os.environ["PLANT_POISON"].split(":")
        poisoned, at = {int(sample) for sample in samples.split(",")}, int(position[0]) if position else 3
        original_item, original_init = GPTDataset.__getitem__, DistributedDataParallel.__init__

        def item(self, idx):
            sample = original_item(self, idx)
            if idx in poisoned and self.index_split.name == "train":
                sample["tokens"] = sample["tokens"].clone()
                sample["tokens"][at] = get_args().padded_vocab_size - 1
            return sample

        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            token = get_args().padded_vocab_size - 1
            for name, module in global_named_modules([self]):
                start, end = (getattr(module, key, None) for key in ("vocab_start_index", "vocab_end_index"))
                if name == "embedding.word_embeddings" and start is not None and start <= token < end:
                    with torch.no_grad():
                        module.weight[token - start].fill_(POISON_ROW)

        GPTDataset.__getitem__, DistributedDataParallel.__init__ = item, init

    def _poisoning(spec, value):
        """A tensor's first element set to ``value`` when ``spec`` is due (a copy: autograd's tensors
        untouched)."""
        fired = []

        def poison(tensor):
            if not _due(spec, fired):
                return tensor
            fired.append(_iteration())
            tensor = tensor.clone()
            tensor.view(-1)[0] = value
            return tensor

        return poison

    def _overflowing(spec, value):
        poison = _poisoning(spec, value)

        def hook(module, inputs, output):
            if isinstance(output, tuple):
                return (poison(output[0]), *output[1:])
            return poison(output)

        return hook

    def _plant_state_faults() -> None:
        """PLANT_WEIGHT and PLANT_LOSS, once the model is built (its names known, ``__main__``'s
        ``loss_func`` defined: ``forward_step`` looks it up at each call)."""
        from megatron.core.distributed import DistributedDataParallel

        from gradnan.patches.model import global_named_parameters

        weight, loss = _planted("PLANT_WEIGHT", float("nan")), os.environ.get("PLANT_LOSS")
        rank = int(os.environ.get("RANK", "0"))
        row = None
        if os.environ.get("PLANT_ROW"):  # RANK[,RANK...]:ITERATION:NAME:ROW[:VALUE]
            at, iteration, name, index, *value = os.environ["PLANT_ROW"].split(":")
            if str(rank) in at.split(","):
                row = (rank, iteration, name, float(value[0]) if value else 1e30, int(index))
        original = DistributedDataParallel.__init__

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            for planted in (weight, row):
                if planted is not None and planted[0] == rank:
                    param = dict(global_named_parameters([self]))[planted[2]]
                    self.register_forward_pre_hook(_writing(param, planted[1], planted[3], *planted[4:]))
            if loss and str(rank) in loss.split(":")[0].split(","):
                main = sys.modules["__main__"]
                main.loss_func = _dividing_by_zero(main.loss_func, loss.split(":")[1],
                                                   loss.split(":")[2:] == ["after_report"])

        DistributedDataParallel.__init__ = init

    def _writing(param, spec, value, row=None):
        """The first element (or every element of ``row``) of ``param`` and of its optimizer's fp32 copy."""
        fired = []

        def hook(module, args):
            if _due(spec, fired):
                fired.append(_iteration())
                main = getattr(param, "main_param", None)  # the fp32 copy Megatron's optimizer steps
                with torch.no_grad():
                    for tensor in (param, main):
                        if tensor is None:
                            continue
                        if row is None:
                            tensor.view(-1)[0] = value
                        else:
                            tensor.view(param.shape)[row] = value
        return hook

    def _dividing_by_zero(loss_func, spec, after_report):
        fired = []

        def divided(loss_mask, output_tensor, *args, **kwargs):
            result = loss_func(loss_mask, output_tensor, *args, **kwargs)
            if not _due(spec, fired):
                return result
            fired.append(_iteration())
            no_token = loss_mask.sum() * 0

            def nan(value):  # the loss and what it reports (Megatron-LM logs it, gradnan reads it)
                return value * 0 / no_token if torch.is_floating_point(value) else value

            report = result[-1] if after_report else {key: nan(value) for key, value in result[-1].items()}
            return (nan(result[0]), *result[1:-1], report)

        return divided

    def _plant_link() -> None:
        """PLANT_LINK: the transfer functions ``p2p_communication._communicate`` looks up when it runs,
        wrapped on the planted rank to poison what arrives (after waiting for it) when the spec is due."""
        from megatron.core.pipeline_parallel import p2p_communication

        rank, spec, direction, value = _planted("PLANT_LINK", float("nan"))
        if rank != int(os.environ.get("RANK", "0")):
            return
        received = {"forward": "tensor_recv_prev", "backward": "tensor_recv_next"}[direction]
        fired = []

        def poisoning(original):
            def transfer(**kwargs):
                requests = original(**kwargs)
                if kwargs.get(received) is None or not _due(spec, fired):
                    return requests
                for request in (requests.values() if isinstance(requests, dict) else requests):
                    request.wait()
                fired.append(_iteration())
                with torch.no_grad():
                    kwargs[received].view(-1)[0] = value
                return type(requests)()

            return transfer

        for name in ("_batched_p2p_ops", "_p2p_ops"):
            setattr(p2p_communication, name, poisoning(getattr(p2p_communication, name)))

    if os.environ.get("PLANT_LINK"):
        _plant_link()
    if os.environ.get("PLANT_NAN") or os.environ.get("PLANT_OVERFLOW"):
        _plant_faults()
    if os.environ.get("PLANT_WEIGHT") or os.environ.get("PLANT_ROW") or os.environ.get("PLANT_LOSS"):
        _plant_state_faults()
    if os.environ.get("PLANT_POISON"):
        _plant_poisoned_samples()
    print(f"[sitecustomize rank {os.environ.get('RANK')}] Megatron-LM on CPU (stand-in CUDA)",
          file=sys.stderr)
