"""``install()`` / ``uninstall()``: patch the Megatron surfaces that are there, say which are not."""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .. import log
from ..config import GradnanConfig
from ..config.sources import resolve_config
from ..errors import InternalError
from ..log import logger
from ..patches import Instrumentor, SurfaceMissing, all_instrumentors, split_disabled
from ..patches.instrumentor import megatron_version
from ..patches.model import MEGATRON_FACTS
from ..patches.supported import MEGATRON_CORE
from .messages import PLAIN_SPACES
from .runtime import Runtime


@dataclass
class Installation:
    """What ``install()`` did, by patch name: the surfaces patched, those missing (with why), those whose
    patching failed in gradnan itself (a bug to report), those ``disabled_patches`` left alone; and the
    live runtime."""

    config: GradnanConfig
    runtime: Runtime
    patched: List[str] = field(default_factory=list)
    missing: Dict[str, str] = field(default_factory=dict)
    failed: Dict[str, str] = field(default_factory=dict)
    disabled: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    _instrumentors: List[Instrumentor] = field(default_factory=list, repr=False)  # all, applied or not

    @property
    def out_dir(self) -> str:
        return self.config.out_dir

    def summary(self) -> str:
        descriptions = {instrumentor.name: instrumentor.description for instrumentor in self._instrumentors}

        def named(name: str) -> str:
            return f"{descriptions[name]} [{name}]"

        lines = [f"gradnan installed, writing to {self.out_dir}"]
        lines += [f"  patched: {named(name)}" for name in self.patched]
        lines += [f"  MISSING: {named(name)}: {why}" for name, why in self.missing.items()]
        lines += [f"  FAILED (a gradnan bug, please report it): {named(name)}: {why}"
                  for name, why in self.failed.items()]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def uninstall(self) -> None:
        uninstall()

    def start(self, model: Any = None) -> None:
        """(Re)start recording (msprobe's ``start()``). ``model``: the model chunk(s) of a loop whose
        optimizer is not Megatron's, so frame tracing, probes and capture know its modules."""
        if model is not None:
            self.runtime.start_model(list(model) if isinstance(model, (list, tuple)) else [model])
        self.runtime.set_recording(True)

    def stop(self) -> None:
        """Stop recording after writing what the step so far measured; ``start()`` resumes."""
        self.runtime.set_recording(False)

    def step(self) -> None:
        """End a step of a custom loop: its frames and probes are written, the step count advances, and
        from now on records carry this count instead of the optimizer's (msprobe's ``step()``)."""
        self.runtime.advance_step()


_lock = threading.RLock()
_current: Optional[Installation] = None


def install(out_dir: Optional[str] = None, *, config: Optional[GradnanConfig] = None,
            config_file: Optional[str] = None, **options: Any) -> Installation:
    """Patch Megatron so non-finite gradients are named by rank and parameter. Call it before the
    optimizer is built. A second call returns the first installation unchanged (nothing is wrapped
    twice). Options: the fields of ``GradnanConfig``, also settable as ``GRADNAN_<FIELD>`` or in a JSON
    or TOML file (``config_file``, else ``GRADNAN_CONFIG``). A ``config`` object overrides those with the
    fields given to its constructor only; keyword options override it."""
    global _current
    with _lock:
        if _current is not None:
            logger.info("already installed; keeping the first configuration")
            return _current
        resolved = resolve_config(config, config_file=config_file, out_dir=out_dir, **options)
        resolved = dataclasses.replace(resolved, out_dir=os.path.abspath(resolved.out_dir))
        instrumentors = all_instrumentors()
        enabled, disabled = split_disabled(instrumentors, resolved.disabled_patches)
        log.configure(resolved.log_level)
        log.logger.addFilter(PLAIN_SPACES)  # once: a filter already there is not added again
        installation = Installation(resolved, Runtime(resolved, MEGATRON_FACTS),
                                    disabled=[instrumentor.name for instrumentor in disabled],
                                    _instrumentors=instrumentors)
        _report_missing(installation, enabled)
        for instrumentor in enabled:
            if instrumentor.name in installation.missing:
                continue
            try:
                instrumentor.instrument(installation.runtime)
            except SurfaceMissing as exc:
                installation.missing[instrumentor.name] = str(exc)
                continue
            except InternalError as exc:
                if resolved.strict:
                    raise
                installation.failed[instrumentor.name] = str(exc)
                continue
            installation.patched.append(instrumentor.name)
            note = instrumentor.version_note()
            if note and note not in installation.notes:
                installation.notes.append(note)
        _current = installation
        _announce(installation)
        atexit.register(_flush_at_exit, installation)
        return installation


def _flush_at_exit(installation: Installation) -> None:
    """A run that dies of an exception before its optimizer step (Megatron-LM's NaN-loss check raises in
    the forward) still gets that step's frames and probes written."""
    if _current is installation:
        installation.runtime.flush_at_end()


def _report_missing(installation: Installation, enabled: List[Instrumentor]) -> None:
    """Before anything is patched: the surfaces this megatron-core lacks (a newer release renamed or removed
    them), found by a dry run of each patch, logged at once and left alone by ``install()``."""
    for instrumentor in enabled:
        why = instrumentor.missing(installation.runtime)
        if why is not None:
            installation.missing[instrumentor.name] = why
    if installation.missing:
        logger.warning("megatron-core %s lacks what %d patch(es) need, left unpatched (tested: %s): %s",
                       megatron_version() or "(version unknown)", len(installation.missing), MEGATRON_CORE,
                       "; ".join(f"{name}: {why}" for name, why in installation.missing.items()))


def _announce(installation: Installation) -> None:
    if not installation.patched:
        logger.error("nothing could be patched, gradnan is inactive:\n%s", installation.summary())
    elif installation.failed:
        logger.error("%s", installation.summary())
    elif installation.missing or installation.notes:
        logger.warning("%s", installation.summary())
    elif log.launcher_rank() == "0":
        logger.info("%s", installation.summary())
    if log.launcher_rank() == "0":
        for instrumentor in installation._instrumentors:
            if instrumentor.name in installation.disabled:
                logger.info("patch %s disabled (disabled_patches), %s not patched: %s", instrumentor.name,
                            instrumentor.description, instrumentor.without)


def uninstall() -> None:
    """Restore every patched Megatron attribute to the very object it was before ``install()``."""
    global _current
    with _lock:
        if _current is None:
            return
        for instrumentor in reversed(_current._instrumentors):
            instrumentor.uninstrument()
        _current.runtime.close()
        atexit.unregister(_flush_at_exit)
        _current = None


def current() -> Optional[Installation]:
    return _current


def check(tensor: Any, label: str) -> None:
    """Record non-finite values of ``tensor`` under ``label``, with the enclosing module's global name and
    the step, read at the end of the step (no host sync here). Does nothing when gradnan is not installed."""
    installation = _current
    if installation is not None:
        installation.runtime.guarded("gradnan.check", installation.runtime.probe, tensor, label)
