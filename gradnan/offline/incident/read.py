"""Read a whole run directory: every map, record, self-test result and bundle manifest that is usable.

Each problem becomes a one-line message naming the file and what is wrong. A run directory in which
some files are bad is still read: the good files are returned and the bad ones listed in ``problems``.

``params=False`` reads only what the report needs of 131,072 ranks: every records file, streamed line by
line and kept with their offending parameters only while ``KEPT_PARAMS`` entries in all are kept, the
others without (a ``LeanRecord``, whose ``location`` says where it is; ``RunFiles.full`` reads one back
whole); the maps (without their parameter lists, ``params_count`` only) of ranks that wrote no records,
the others only listed and read when the report asks for a rank's (``RunFiles.maps_of``); the run-ups
only listed, and read when the report asks for those that can name its culprit parameter
(``RunFiles.runups_naming``). A file read then that is bad is a problem then.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from ...errors import InputError
from ...formats import bundle, maps, records, runup, selftest
from ...formats.layout import BUNDLES_DIR, MANIFEST, MAPS_DIR, RECORDS_DIR, RUNUP_DIR, SELFTEST_DIR
from ...formats.schema import FilePath

Document = Dict[str, Any]
KEPT_PARAMS = 1 << 16  # offending-parameter entries kept in memory with params=False (a few per rank)
RECORDS_SUFFIX = ".jsonl"
MAX_PROBLEMS = 1000  # problems kept as text; past them only counted (a file of 50 M junk lines)


class Problems(list):
    """The first ``MAX_PROBLEMS`` problems, and ``total``: how many there were. A list (the report lists
    them), of bounded length whatever the input: more are counted, not kept."""

    def __init__(self, problems: Iterable[str] = ()) -> None:
        super().__init__()
        self.total = 0
        self.extend(problems)

    def append(self, problem: str) -> None:
        self.total += 1
        if len(self) < MAX_PROBLEMS:
            super().append(problem)

    def extend(self, problems: Iterable[str]) -> None:
        for problem in problems:
            self.append(problem)


@dataclass
class RunFiles:
    """Everything readable in a run directory, with one line per file or line that was not."""

    run_dir: Path
    maps: Dict[Path, Dict[str, Any]] = field(default_factory=dict)
    records: Dict[Path, List[Dict[str, Any]]] = field(default_factory=dict)
    selftests: Dict[Path, Dict[str, Any]] = field(default_factory=dict)
    bundles: Dict[Path, Dict[str, Any]] = field(default_factory=dict)
    # ``runup/``: the gradient buckets' run-up at an incident, read whole; with params=False only listed
    # (``runups_unread``) and read where the report needs them (``runups_naming``)
    runups: Dict[Path, Dict[str, Any]] = field(default_factory=dict)
    problems: Problems = field(default_factory=Problems)
    runups_unread: List[str] = field(default_factory=list)  # names in runup/
    # with params=False, the maps of ranks that wrote records (``rank_tag_of_map``): names in maps/ by rank
    # tag, read where the report needs them (``maps_of``)
    maps_unread: Dict[str, List[str]] = field(default_factory=dict)
    unreadable: Set[str] = field(default_factory=set)  # listed files found bad: one problem, not read again

    def all_records(self) -> List[Dict[str, Any]]:
        return [record for records in self.records.values() for record in records]

    def full(self, record: Dict[str, Any]) -> Dict[str, Any]:
        """A record with its offending parameters (read back from its line if it was kept without)."""
        if not isinstance(record, LeanRecord):
            return record
        path, number, offset = record.location
        return records.load_at(path, number, offset)

    def runups_naming(self, parameter: str) -> Iterator[Tuple[Path, Dict[str, Any]]]:
        """The run-ups, whole, that can hold ``parameter`` in a bucket: every one read, and of those only
        listed the files whose bytes can name it (``runup.loader_naming``), each read now (a bad one is a
        problem); the others are not parsed at all. Data-parallel replicas step the same parameters: of
        the files of one model-parallel position and step (``_replica_groups``) the others are searched
        only where the first can name it (131,072 ranks' run-ups cost the 128 positions' and the 8,192
        that name it). The caller checks the buckets."""
        yield from self.runups.items()
        load = runup.loader_naming(parameter)
        for replicas in _replica_groups(self.runups_unread).values():
            first = list(self._read_listed(RUNUP_DIR, replicas[:1], load))
            if first or os.path.join(self.run_dir, RUNUP_DIR, replicas[0]) in self.unreadable:
                yield from first
                yield from self._read_listed(RUNUP_DIR, replicas[1:], load)

    def all_runups(self) -> Iterator[Tuple[Path, Dict[str, Any]]]:
        """Every run-up, whole (those only listed are read now, a bad one is a problem)."""
        yield from self.runups.items()
        yield from self._read_listed(RUNUP_DIR, self.runups_unread, runup.load)

    def maps_of(self, ranks: Collection[Any]) -> Iterator[Tuple[Path, Dict[str, Any]]]:
        """The maps of these global ranks: of those read, and of those only listed the ones named after
        these ranks' records files, each read now (a bad one is a problem)."""
        yield from ((path, doc) for path, doc in self.maps.items() if doc["rank"]["global_rank"] in ranks)
        tags = set()
        for path, found in self.records.items():
            for record in found:
                if record["rank"].get("global_rank") in ranks:
                    tags.add(path.stem)
                    break
        names = [name for tag in sorted(tags) for name in self.maps_unread.get(tag, ())]
        headers = self._read_listed(MAPS_DIR, names, functools.partial(maps.load, params=False))
        yield from ((path, doc) for path, doc in headers if doc["rank"]["global_rank"] in ranks)

    def _read_listed(self, folder: str, names: Iterable[str],
                     load: Callable[[FilePath], Optional[Document]]) -> Iterator[Tuple[Path, Document]]:
        """``load`` of each named file of the run's ``folder`` that it returns a document for (a Path made
        for those alone); a bad one is a problem once, and not read again."""
        directory = self.run_dir / folder
        prefix = os.path.join(directory, "")
        for name in names:
            where = prefix + name
            if where in self.unreadable:
                continue
            try:
                document = load(where)
            except InputError as exc:
                self.problems.append(str(exc))
                self.unreadable.add(where)
                continue
            if document is not None:
                yield directory / name, document

    def params_of_map(self, path: Path, document: Dict[str, Any]) -> List[Dict[str, Any]]:
        """A map's parameters (read back from its file where ``document``, the map, was read without
        them)."""
        return _whole(document, "params", maps.load, path)


def _whole(document: Dict[str, Any], key: str, load: Callable[[Path], Dict[str, Any]],
           path: Path) -> List[Dict[str, Any]]:
    """``document[key]``, the list a lean read (``params=False``) left out, read back from ``path`` with
    ``load`` where it is missing; none where that file can no longer be read."""
    if key in document:
        return document[key]
    try:
        return load(path)[key]
    except InputError:
        return []


class LeanRecord(dict):
    """A record kept without its offending parameters; ``location`` is where to read it whole: (file, line
    number, byte offset of the line)."""

    __slots__ = ("location",)

    def __init__(self, record: Dict[str, Any], location: Tuple[Path, int, int]) -> None:
        super().__init__((key, value) for key, value in record.items() if key != "params")
        self.location = location


def _read_records(path: Path, params: bool, budget: List[int], problems: Problems) -> List[Dict[str, Any]]:
    """The records of one file, its bad lines added to ``problems``; with ``params=False`` a record keeps
    its parameters while ``budget[0]`` (entries left, shared by every file of the run) allows, so the
    failing step's need no second read."""
    found = []
    for line in records.stream(path):
        if line.record is None:
            problems.append(line.problem or f"{path}:{line.number}: unreadable")
        elif params:
            found.append(line.record)
        elif len(line.record["params"]) <= budget[0]:
            budget[0] -= len(line.record["params"])
            found.append(line.record)
        else:
            budget[0] = 0  # spent: from here only records without offenders stay whole
            found.append(LeanRecord(line.record, (path, line.number, line.offset)))
    return found


_REPLICA = re.compile(r"rank[0-9]+_(.*)_dp[0-9]+(_.*)")  # a run-up's name less its global rank and dp


def _replica_groups(names: Iterable[str]) -> Dict[str, List[str]]:
    """Run-up file names by their name less the global rank and data-parallel coordinate
    (``layout.runup_path``): the data-parallel replicas of one model-parallel position at one step; a
    name not laid out so is a group of its own."""
    groups: Dict[str, List[str]] = {}
    for name in names:
        match = _REPLICA.fullmatch(name)
        groups.setdefault("".join(match.groups()) if match else "/" + name, []).append(name)
    return groups


def _listed(directory: Path, suffix: str, problems: List[str]) -> List[Path]:
    """The ``*suffix`` entries of ``directory`` (none if it does not exist); one that cannot be listed
    is a problem, not an empty directory, and so is a symbolic link: the kit never makes one in a run
    directory, and one planted there would lead the readers to files outside it."""
    return [directory / name for name in _listed_names(directory, suffix, problems)]


def _listed_names(directory: Path, suffix: str, problems: List[str]) -> List[str]:
    """``_listed``, the names alone, sorted."""
    try:
        if stat.S_ISLNK(os.lstat(directory).st_mode):
            problems.append(f"{directory}: a symbolic link, not followed (a run directory's folders are its"
                            " own)")
            return []
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        problems.append(f"{directory}: cannot list it ({exc.strerror or exc})")
        return []
    return [name for name in sorted(names) if name.endswith(suffix) and not name.startswith(".")]


def _bundle_manifests(run_dir: Path, problems: List[str]) -> List[Path]:
    """``bundles/<rank>/<bundle>/manifest.json``; a directory whose name starts with a dot is a bundle
    still being written (or whose writer died)."""
    return [bundle / MANIFEST for rank in _listed(run_dir / BUNDLES_DIR, "", problems)
            for bundle in _listed(rank, "", problems) if (bundle / MANIFEST).exists()]


def _listing(run_dir: Path) -> Tuple[List[str], List[Path], List[Path], List[str]]:
    """The map names, records and self-test files of a run directory, and what could not be listed;
    InputError for a directory that is missing or holds none of them."""
    if not run_dir.exists():
        raise InputError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: not a directory")
    listing: List[str] = []
    map_files = _listed_names(run_dir / MAPS_DIR, ".json", listing)
    record_files = _listed(run_dir / RECORDS_DIR, RECORDS_SUFFIX, listing)
    selftest_files = _listed(run_dir / SELFTEST_DIR, ".json", listing)
    if listing and not map_files and not record_files and not selftest_files:
        raise InputError(listing[0])
    if not map_files and not record_files and not selftest_files:
        raise InputError(f"{run_dir}: no gradnan maps or records here (expected {MAPS_DIR}/ and"
                         f" {RECORDS_DIR}/ as written by gradnan.install(out_dir=...))")
    return map_files, record_files, selftest_files, listing


def map_params(run_dir: Path, wanted: Callable[[Dict[str, Any]], bool],
               keep: Callable[[Dict[str, Any]], bool]) -> Tuple[int, List[Dict[str, Any]]]:
    """How many maps ``wanted`` accepts (given each without its parameters: every map is read for that, a
    version 2 table not parsed, so one rank of 16,000 costs one table), and their
    parameters ``keep`` accepts, each with its map's ``rank`` (global rank) and ``optimizer_index``. The
    tables are streamed (``maps.stream_params``): ``gradnan maps --id 5`` of a map of a million
    parameters holds one of them, not the million. A map that cannot be read is left out whole."""
    chosen, rows = 0, []
    for name in _listing(Path(run_dir))[0]:
        path = Path(run_dir) / MAPS_DIR / name
        try:
            chosen_map = maps.stream_params(path, wanted)
            if chosen_map is None:
                continue
            header, params = chosen_map
            place = {"rank": header["rank"]["global_rank"],
                     "optimizer_index": header.get("optimizer_index", 0)}
            kept = [{**place, **entry} for entry in params if keep(entry)]
        except InputError:
            continue
        chosen += 1
        rows += kept
    return chosen, rows


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a run is read and decided: the documents read hold no
    reference cycles, and its passes over 131,072 ranks' records cost a third of the report."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_run(run_dir: Path, params: bool = True) -> RunFiles:
    run_dir = Path(run_dir)
    map_files, record_files, selftest_files, listing = _listing(run_dir)
    files = RunFiles(run_dir, problems=Problems(listing))
    budget, record_problems = [KEPT_PARAMS], Problems()
    for path in record_files:
        problems = Problems()
        try:
            found = _read_records(path, params, budget, problems)
        except InputError as exc:
            record_problems.append(str(exc))
            continue
        files.records[path] = found
        record_problems.extend(problems)
        record_problems.total += problems.total - len(problems)
    # lean: a map is read where its rank wrote no records (to know the rank), else when the report needs it
    known = set() if params else {path.name[:-len(RECORDS_SUFFIX)] for path, found in files.records.items()
                                  if found}
    for name in map_files:
        tag = rank_tag_of_map(name)
        if tag in known:
            files.maps_unread.setdefault(tag, []).append(name)
            continue
        try:
            files.maps[run_dir / MAPS_DIR / name] = maps.load(run_dir / MAPS_DIR / name, params)
        except InputError as exc:
            files.problems.append(str(exc))
    for path in selftest_files:
        try:
            files.selftests[path] = selftest.load(path)
        except InputError as exc:
            files.problems.append(str(exc))
    for path in _bundle_manifests(run_dir, files.problems):
        try:
            files.bundles[path.parent] = bundle.load_manifest(path)
        except InputError as exc:
            files.problems.append(str(exc))
    files.runups_unread = _listed_names(run_dir / RUNUP_DIR, ".json", files.problems)
    if params:
        files.runups = dict(files.all_runups())
        files.runups_unread = []
    files.problems.extend(record_problems)
    files.problems.total += record_problems.total - len(record_problems)
    return files


def rank_tag_of_map(name: str) -> str:
    """The rank tag a map's file name starts with (``layout.map_path``: ``<rank tag>[_opt<k>][.<launch>]
    .json``), as its rank's records file is named (``<rank tag>.jsonl``)."""
    return re.sub(r"_opt[0-9]+$", "", name.split(".", 1)[0])
