"""The only code on the training side that writes files: maps, records and bundles, in the formats of
``gradnan.formats``, atomically where a reader could otherwise see half a file, within the configured
bounds (``max_records_bytes``, ``max_params_per_record``, ``max_bundles``, ``max_bundle_bytes``), each
bound logged once when it is reached.

A file that cannot be written (an out_dir that is a file, a full disk, no permission) is the machine's
fault, not gradnan's: it is logged once per reason (a read-only out_dir once, not once per file), with
the path and the reason, and training goes on, ``strict`` or not. A map is never written over another
launch's (``layout.launch_tag``).

Everything lands inside ``out_dir`` (itself may be a symbolic link: the user chose it): below it no
symbolic link is followed, and a records file that is a link, a FIFO or a hard link to another file is
not appended to (``safe_write.open_directory``, ``RefusedPath``). A shared out dir where someone planted
``records/rank00000....jsonl -> ~victim/.bashrc`` gets a warning naming that path, once; the record is
not written there and nothing of the victim's file is touched."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from ..config import GradnanConfig
from ..events import ModelFacts
from ..formats import bundle, maps, records, runup
from ..formats.incident import RecordKind
from ..formats.layout import (
    batch_path,
    bundle_dir,
    launch_tag,
    map_path,
    records_path,
    run_identity,
    runup_path,
)
from ..formats.maps import ParamSlot
from ..formats.safe_write import RefusedPath, append_json_line, held_directory, write_json_atomic
from ..log import logger


class Written(dict):
    """A document as the writer wrote it (or would have, past ``max_records_bytes``), and ``path``: where
    it is on disk, for the log line that points the user at it."""

    __slots__ = ("path",)

    def __init__(self, document: Mapping[str, Any], path: Path) -> None:
        super().__init__(document)
        self.path = str(path)


class Writer:
    def __init__(self, config: GradnanConfig, facts: ModelFacts) -> None:
        self.config, self._facts = config, facts
        self.run = run_identity(config.run_id, os.environ, time.time())
        self._known_coords: Optional[Dict[str, Any]] = None
        self._bounds_logged: set = set()
        self._bundles_written = 0
        self._maps_written: Dict[Path, Path] = {}  # the name a map wanted -> where this launch wrote it

    def coords(self) -> Dict[str, Any]:
        """This rank's coordinates, as first seen with the optimizer built (a write at exit, after the
        process groups are gone, still lands in this rank's file)."""
        return self._known_coords if self._known_coords is not None else self._facts.coords()

    def remember_coords(self) -> None:
        if self._known_coords is None:
            self._known_coords = self._facts.coords()

    def _log_bound_once(self, bound: str, level: int, message: str, *args: Any) -> None:
        if bound not in self._bounds_logged:
            self._bounds_logged.add(bound)
            logger.log(level, message, *args)

    def _unwritable(self, what: str, path: Path, error: OSError) -> None:
        if isinstance(error, RefusedPath):  # once per refused path: each is a different planted link
            self._log_bound_once(f"refused {error.filename}", logging.WARNING,
                                 "not writing the %s %s (%s: %s); training goes on unchanged",
                                 what, path, error.filename, error.strerror)
            return
        self._log_bound_once(f"unwritable {error.errno or type(error).__name__}", logging.ERROR,
                             "cannot write the %s %s: %s (training goes on unchanged;"
                             " later files may be missing)",
                             what, path, error.strerror or error)

    def _write_map(self, wanted: Path, document: Dict[str, Any], coords: Mapping[str, Any],
                   optimizer_index: int) -> Path:
        """Where the map went: its own name, or with the launch tag where another launch's map has it."""
        root = Path(self.config.out_dir)
        path = self._maps_written.get(wanted)
        if path is not None:
            maps.write(path, document, root=root)
            return path
        try:
            maps.write(wanted, document, replace=False, root=root)
            path = wanted
        except FileExistsError:
            path = map_path(self.config.out_dir, coords, optimizer_index, launch_tag(self.run, coords))
            maps.write(path, document, root=root)
        self._maps_written[wanted] = path
        return path

    def write_map(self, optimizer_index: int, optimizer_class: str, slots: Sequence[ParamSlot]) -> str:
        """The parameter map of one optimizer; returns its path."""
        coords = self.coords()
        path = map_path(self.config.out_dir, coords, optimizer_index)
        document = maps.to_json(coords, self._facts.versions(), self.run, optimizer_index, optimizer_class,
                                slots)
        try:
            path = self._write_map(path, document, coords, optimizer_index)
        except OSError as error:
            self._unwritable("map", path, error)
        logger.debug("wrote parameter map %s (%d parameters)", path, len(slots))
        return str(path)

    def record(self, kind: RecordKind, step: int, found: List[Dict[str, Any]],
               extra: Mapping[str, Any]) -> Written:
        """Append one record (``found`` capped at ``max_params_per_record``, all counted); returns it with
        its ``path``, also when ``max_records_bytes`` kept it off the disk."""
        coords = self.coords()
        record = records.to_json(kind.value, step, self._facts.iteration(), coords, self.run,
                                 found[:self.config.max_params_per_record], len(found), extra,
                                 self._facts.loop())
        path = records_path(self.config.out_dir, coords)
        try:
            if not append_json_line(path, record, Path(self.config.out_dir), self.config.max_records_bytes):
                self._log_bound_once("max_records_bytes", logging.ERROR,
                                     "%s reached max_records_bytes (%d): later records are not written", path,
                                     self.config.max_records_bytes)
        except OSError as error:
            self._unwritable("record", path, error)
        return Written(record, path)

    def runup(self, step: int, groups: List[Dict[str, Any]]) -> Optional[str]:
        """Write this rank's run-up at an incident ``step`` (``formats.runup``); its path, or None where it
        could not be written."""
        coords, iteration = self.coords(), self._facts.iteration()
        document = runup.to_json(coords, self.run, step, iteration, groups)
        path = runup_path(self.config.out_dir, coords, step, iteration)
        root = Path(self.config.out_dir)
        try:
            try:
                write_json_atomic(path, document, indent=None, replace=False, root=root)
            except FileExistsError:  # another launch's, into the same out dir: kept, this one beside it
                path = runup_path(self.config.out_dir, coords, step, iteration, launch_tag(self.run, coords))
                write_json_atomic(path, document, indent=None, root=root)
        except OSError as error:
            self._unwritable("run-up", path, error)
            return None
        return str(path)

    def bundle(self, step: int, module_name: str, manifest: Dict[str, Any],
               tensors: Mapping[str, torch.Tensor]) -> Optional[Written]:
        """Write one capture bundle; its manifest with its ``path``, or None when a bound kept it off the
        disk."""
        bound = ("max_bundles" if self._bundles_written >= self.config.max_bundles
                 else "max_bundle_bytes" if bundle.tensors_bytes(tensors) > self.config.max_bundle_bytes
                 else None)
        if bound is not None:
            self._log_bound_once(bound, logging.WARNING, "capture of %s at step %d not written: %s reached",
                                 module_name, step, bound)
            return None
        coords = self.coords()
        iteration = self._facts.iteration()
        manifest = {**manifest, "rank": coords, "run": self.run, "versions": self._facts.versions(),
                    "step": step, "iteration": iteration}
        path = bundle_dir(self.config.out_dir, coords, step, module_name, iteration)
        try:
            with held_directory(path, Path(self.config.out_dir)) as directory:
                bundle.write(directory / path.name, manifest, tensors)
        except OSError as error:
            self._unwritable("bundle", path, error)
            return None
        self._bundles_written += 1
        return Written(manifest, path)

    def batch(self, step: int, micro_batch: int, tensors: Mapping[str, torch.Tensor],
              left_out_bytes: int) -> Optional[Dict[str, Any]]:
        """Keep one micro-batch's tensors; what the ``rerun`` record says of it, or None if not written."""
        path = batch_path(self.config.out_dir, self.coords(), step, micro_batch, self._facts.iteration())
        try:
            with held_directory(path, Path(self.config.out_dir)) as directory:
                path = path.with_name(bundle.write_batch(directory / path.name, tensors).name)
        except OSError as error:
            self._unwritable("micro-batch", path, error)
            return None
        return {"path": str(path), "micro_batch": micro_batch, "left_out_bytes": left_out_bytes,
                "tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype)}
                            for name, t in tensors.items()}}
