"""Stand-ins for the CUDA-only packages Megatron-Bridge 0.6.2 imports (with megatron-core 0.19.2), so that
its own training loop imports on a CPU machine; each is in ``sys.modules`` only while the one Bridge
module that needs it runs, so that megatron-core's own probes (``HAVE_TE``) still find nothing. Test-only.

- ``transformer_engine.pytorch`` (and ``.ops``): ``megatron/bridge/peft/lora_layers.py`` imports it and
  evaluates ``te.ops.Sequential`` in an annotation. Left in place, megatron-core would take TE as present
  (``Version(te.__version__)``).
- ``nvidia_resiliency_ext.inprocess``: ``megatron/bridge/training/pretrain.py`` imports ``CallWrapper``
  from it (a type only); left in place, Bridge's checkpointing would take its local checkpoints as present.
- ``megatron.energon``: Bridge's energon data module imports it; megatron-core never looks for it.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types


class _Anything(types.ModuleType):
    """A module whose every missing attribute is a class (usable as a base, a type or an annotation)."""

    def __init__(self, name):
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        self.__path__ = []

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        made = type(attribute, (), {"__module__": self.__name__})
        setattr(self, attribute, made)
        return made


def _put(names):
    """Stand-ins for ``names`` (each package before its modules), each its parent's attribute."""
    for name in names:
        sys.modules[name] = _Anything(name)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, sys.modules[name])


class _WhileRunning(importlib.abc.MetaPathFinder):
    """While module ``target`` runs, the stand-ins ``names`` are importable; after it, gone. ``first``: the
    modules ``target`` imports that must see no stand-in (imported for real before it)."""

    def __init__(self, target, names, first):
        self.target, self.names, self.first = target, names, first

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        run, finder = spec.loader.exec_module, self

        def exec_module(module):
            for name in finder.first:
                importlib.import_module(name)
            _put(finder.names)
            try:
                run(module)
            finally:
                for name in finder.names:
                    sys.modules.pop(name, None)

        spec.loader.exec_module = exec_module
        return spec


def install():
    sys.meta_path.insert(0, _WhileRunning(
        "megatron.bridge.peft.lora_layers",
        ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops"],
        ["megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
         "megatron.bridge.peft.lora_merge"]))
    sys.meta_path.insert(0, _WhileRunning(
        "megatron.bridge.training.pretrain", ["nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess"],
        ["megatron.bridge.data.utils", "megatron.bridge.training.eval", "megatron.bridge.training.setup",
         "megatron.bridge.training.train"]))
    importlib.import_module("megatron")
    _put(["megatron.energon"])
