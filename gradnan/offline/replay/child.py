"""The child process of ``gradnan replay --against PYTHON``, run by that interpreter:
``python -m gradnan.offline.replay.child SETTINGS`` (JSON: ``bundle``, ``device``, ``limits``, ``result``).

It replays the bundle with digests under the limits (``isolation.replay_outcome``), adds what this
environment is (``environment``), and writes ``[kind, value]`` as JSON to the ``result`` file, written
whole then renamed, so the parent reads all of it or nothing.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from typing import Any, Dict, List, Optional

from .command import replay_device
from .isolation import replay_outcome
from .limits import ReplayLimits

# the distributions whose versions say which stack replayed (``versions`` of the comparison)
STACK = {"torch": "torch", "megatron_core": "megatron-core", "transformer_engine": "transformer-engine"}


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: Optional[str]) -> Dict[str, Any]:
    """This interpreter, the versions of its stack, and the machine it replayed on: the CPU capability
    torch's kernels dispatch to (``AVX2``, ``AVX512``, ``DEFAULT``: another kernel path, other bits) and,
    replaying on CUDA, the GPU's name."""
    import torch

    versions = {name: _version(distribution) for name, distribution in STACK.items()}
    versions["torch"] = torch.__version__  # the one imported, wherever it came from
    target = replay_device(device)
    machine = {"cpu": torch.backends.cpu.get_cpu_capability(),
               "gpu": torch.cuda.get_device_name(target) if target.type == "cuda" else None}
    return {"python": sys.executable, "versions": {"python": platform.python_version(), **versions},
            "machine": machine}


def main(argv: List[str]) -> int:
    settings = json.loads(argv[1])
    kind, value = replay_outcome(settings["bundle"], settings["device"], ReplayLimits(**settings["limits"]),
                                 digests=True)
    if kind == "result":
        value["environment"] = environment(settings["device"])
    temporary = settings["result"] + ".part"
    with open(temporary, "w") as stream:
        json.dump([kind, value], stream)
    os.rename(temporary, settings["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
