"""A rank's records (``gradnan.record``, one JSON object per line, appended): what each detection found.

Kinds: ``nonfinite_grad_norm``, ``loss_scale_overflow``, ``pre_reduction``, ``frames``, ``probe``, ``rerun``,
``nonfinite_loss``, ``state``, ``replica_divergence``, ``checkpoint`` (docs/formats.md has every field; the
fields of ``rerun``, ``state``/``checkpoint`` and ``replica_divergence`` are checked in their own modules).
A reader keeps the good lines of a file and names each bad one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
)

from ..errors import InputError
from .divergence_record import check_divergence
from .loop import LoopKind, is_loop
from .magnitude import DTYPE_MAX as DTYPE_MAX  # where readers have always found it
from .rerun_record import MAX_DIMS, check_rerun
from .schema import (
    Schema,
    check_rank,
    check_run,
    is_bool,
    is_finite,
    is_int,
    is_number,
    is_stat,
    is_text,
    open_regular,
    optional,
    parse_json,
    read_if_small,
)
from .state_record import MAX_PARAMS_READ as MAX_PARAMS_READ  # where readers have always found it
from .state_record import check_checkpoint, check_state

SCHEMA = Schema("gradnan.record", 2)  # 2: a rerun record writes what it observed, not a conclusion
FORWARD_SHARE = 0.9  # this share of a rank's gradients non-finite: the forward pass already was

# a finite float32 value at least this large squares past float32's maximum: a grad norm computed in
# float32 (Megatron's, and its per-bucket check) overflows to Inf although the value itself is finite
FLOAT32_SQUARE_LIMIT = DTYPE_MAX["torch.float32"] ** 0.5

# the pipeline's links as a stage saw them in the step (an incident record's ``pipeline_links``): what it
# sent to the next stage (activations) and to the previous one (gradients), what it received from each;
# per direction {"transfers": n, "first_nonfinite": position or null, "unchecked": n}
LINK_DIRECTIONS = ("sent_forward", "received_forward", "sent_backward", "received_backward")


_PARAM_INTS = ("nan", "inf", "pos_inf", "neg_inf", "numel", "order", "id", "first_bad_flat", "vocab_rows")


def to_json(kind: str, step: int, iteration: Optional[int], coords: Mapping[str, Any],
            run: Mapping[str, Any], params: Sequence[Mapping[str, Any]], params_total: int,
            extra: Mapping[str, Any], loop: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """One record; ``params`` are the offending parameters listed in full (the writer caps them);
    ``loop``: the training loop that ran the step (``formats.loop``), None for a loop of the user's own."""
    return {
        **SCHEMA.header(),
        "kind": kind,
        "step": step,
        "iteration": iteration,
        "loop": None if loop is None else dict(loop),
        "time": time.time(),
        "rank": dict(coords),
        "run": dict(run),
        "local_nonfinite": params_total > 0,
        "params": list(params),
        "params_total": params_total,
        **extra,
    }


def from_json(record: Any, where: str) -> Dict[str, Any]:
    """One record, checked: InputError (one line) for anything a reader could not use."""
    record = SCHEMA.check(record, where)
    if not is_int(record.get("step")):
        raise InputError(f"{where}: a record needs an integer 'step'")
    check_rank(record.get("rank"), where)
    params = record.get("params")
    if not isinstance(params, list):
        raise InputError(f"{where}: a record needs a 'params' list")
    if len(params) > MAX_PARAMS_READ:  # the rest are counted in params_total: the writer caps them so too
        params = record["params"] = params[:MAX_PARAMS_READ]
    for position, entry in enumerate(params):
        if not _is_param(entry):
            raise InputError(f"{where}: params[{position}] needs a text 'name', integer counts, a numeric"
                             f" 'abs_max_finite', 'first_bad_index' null or a list of at most {MAX_DIMS}"
                             " integers, 'near_limit' null or a boolean and 'kind'/'copy' null or text")
    key = _bad_key(record, ("consecutive_skips", "iteration", "optimizer_index", "bucket_group"), is_int)
    if key is not None:
        raise InputError(f"{where}: '{key}' must be an integer")
    if not is_int(record.get("params_total", 0)):  # absent: the report counts the listed params
        raise InputError(f"{where}: 'params_total' must be an integer")
    if not optional(record.get("time"), is_number) or _bad_key(record, _FLAGS, is_bool) is not None:
        raise InputError(f"{where}: 'time' must be a number, 'scale_collapsed', 'warmup' and 'loss_finite'"
                         " booleans")
    check_run(record.get("run"), where)
    if not is_loop(record.get("loop")):
        raise InputError(f"{where}: 'loop' needs a 'name' among {', '.join(kind.value for kind in LoopKind)}"
                         " and a 'release' null or text")
    _check_largest(record.get("largest_grad"), where)
    if not optional(record.get("device_health"), is_device_health):
        raise InputError(f"{where}: 'device_health' needs 'source' text, a 'device' object, a 'values' object"
                         " of numbers, booleans or lists of integers or text, and an 'unread' object of text"
                         f" (at most {MAX_HEALTH_ITEMS} of each, and of each list's items)")
    if not optional(record.get("pipeline_links"), _is_links):
        raise InputError(f"{where}: 'pipeline_links' needs an object whose keys are among"
                         f" {', '.join(LINK_DIRECTIONS)}, each an object with integer 'transfers' and"
                         " 'unchecked' and 'first_nonfinite' null or an integer below 'transfers'")
    key = _bad_key(record, ("kind", "pre_reduction", "mode", "map", "runup"), is_text)
    if key is not None:
        raise InputError(f"{where}: '{key}' must be text")
    if record.get("kind") == "frames":
        _check_frames(record, where)
    elif record.get("kind") == "probe":
        _check_probes(record, where)
    elif record.get("kind") == "rerun":
        check_rerun(record, where)
    elif record.get("kind") == "nonfinite_loss":
        _check_nonfinite_loss(record, where)
    elif record.get("kind") == "state":
        check_state(record, where)
    elif record.get("kind") == "replica_divergence":
        check_divergence(record, where)
    elif record.get("kind") == "checkpoint":
        check_checkpoint(record, where)
    return record




def _is_index(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_DIMS and all(is_int(i) for i in value)


def _is_param(entry: Any) -> bool:
    """One offending parameter (or, in a ``state`` record, a bad weight), every field a reader uses."""
    return (isinstance(entry, dict) and is_text(entry.get("name"))
            and all(optional(entry.get(key), is_int) for key in _PARAM_INTS)
            and all(is_int(entry.get(key)) and entry[key] >= 0 for key in ("nan", "inf"))
            and is_stat(entry.get("abs_max_finite")) and optional(entry.get("first_bad_index"), _is_index)
            and optional(entry.get("near_limit"), is_bool)
            and all(optional(entry.get(key), is_text) for key in ("kind", "copy")))


_FLAGS = ("scale_collapsed", "warmup", "loss_finite")


def _bad_key(record: Dict[str, Any], keys: Sequence[str], accepts: Callable[[Any], bool]) -> Optional[str]:
    """The first of ``keys`` whose value is there, not null and not one ``accepts``; None where each is
    (a loop over the values there: a record of each of 131,072 ranks is checked)."""
    for key in keys:
        value = record.get(key)
        if value is not None and not accepts(value):
            return key
    return None


def _is_links(links: Any) -> bool:
    return isinstance(links, dict) and all(key in LINK_DIRECTIONS and _is_direction(value)
                                           for key, value in links.items())


def _is_direction(seen: Any) -> bool:
    if not (isinstance(seen, dict) and is_int(seen.get("transfers")) and is_int(seen.get("unchecked"))):
        return False
    first = seen.get("first_nonfinite")
    return 0 <= seen["unchecked"] <= seen["transfers"] and (
        first is None or (is_int(first) and 0 <= first < seen["transfers"]))


def _check_largest(largest: Any, where: str) -> None:
    """``largest_grad`` (optional): the largest gradient of a rank whose gradients were all finite."""
    if largest is None:
        return
    if not (isinstance(largest, dict) and is_text(largest.get("name")) and is_stat(largest.get("value"))
            and all(optional(largest.get(key), is_int) for key in ("id", "flat"))
            and _is_index(largest.get("index"))
            and isinstance(largest.get("overflows"), bool)):
        raise InputError(f"{where}: 'largest_grad' needs a text 'name', a numeric 'value', an 'index' list of"
                         f" at most {MAX_DIMS} integers and a boolean 'overflows'")


MAX_HEALTH_ITEMS = 256  # items of one NVML list (XID errors, throttle reasons): NVML reports a few


def _is_health_value(value: Any) -> bool:
    return isinstance(value, bool) or is_finite(value) or (
        isinstance(value, list) and len(value) <= MAX_HEALTH_ITEMS
        and all(is_int(item) or is_text(item) for item in value))


def is_device_health(health: Any) -> bool:
    """An incident record's ``device_health`` (optional, added in place): NVML's reading of the rank's
    device at the incident. The report prints its values: each must be a plain number, a boolean or a
    list of integers or text, named by text."""
    if not (isinstance(health, dict) and is_text(health.get("source"))
            and all(isinstance(health.get(key), dict) and len(health[key]) <= MAX_HEALTH_ITEMS
                    for key in ("device", "values", "unread"))):
        return False
    device, values, unread = health["device"], health["values"], health["unread"]
    return (optional(device.get("index"), is_int) and all(optional(device.get(key), is_text)
                                                          for key in ("name", "uuid"))
            and all(is_text(name) and _is_health_value(value) for name, value in values.items())
            and all(is_text(name) and is_text(reason) for name, reason in unread.items()))


def _check_nonfinite_loss(record: Dict[str, Any], where: str) -> None:
    batch = record.get("batch")
    if (not optional(record.get("micro_batch"), is_int) or not is_stat(record.get("loss"))
            or not all(optional(record.get(key), is_text)
                       for key in ("message", "megatron_mode", "rerun_skipped"))
            or not (batch is None or (isinstance(batch, dict) and is_text(batch.get("path"))))):
        raise InputError(f"{where}: a nonfinite_loss record needs integer or null 'micro_batch', a numeric"
                         " 'loss', text or null 'message'/'megatron_mode'/'rerun_skipped', and 'batch' null"
                         " or an object with a text 'path'")


def _check_frames(record: Dict[str, Any], where: str) -> None:
    frames, first = record.get("frames"), record.get("first_nonfinite")
    if not isinstance(frames, list) or not (first is None or (is_int(first) and 0 <= first < len(frames))):
        raise InputError(f"{where}: a frames record needs a 'frames' list and 'first_nonfinite' null or the"
                         " index of one of them")
    for position, frame in enumerate(frames):
        if not (isinstance(frame, dict) and is_text(frame.get("module")) and is_text(frame.get("class"))
                and all(is_int(frame.get(key)) for key in ("step", "call", "recomputed"))
                and isinstance(frame.get("entries"), list)):
            raise InputError(f"{where}: frames[{position}] needs text 'module'/'class', integer"
                             " 'step'/'call'/'recomputed' and an 'entries' list")
        for entry in frame["entries"]:
            if not (isinstance(entry, dict)
                    and all(is_text(entry.get(key)) for key in ("name", "kind", "dtype"))
                    and {"abs_min", "abs_max"} <= entry.keys()  # null: not measured; absent: not ours
                    and is_stat(entry["abs_min"]) and is_stat(entry["abs_max"])):
                raise InputError(f"{where}: frames[{position}] has an entry without text"
                                 " 'name'/'kind'/'dtype' and numeric 'abs_min'/'abs_max'")


# a probe record's non-finite probes kept by the writer and by a reader, in call order; ``probes_total``
# counts them all: at most one per call of gradnan.check in one step on one rank, far below MAX_COUNTED
MAX_PROBES = 1024
MAX_COUNTED = 10**9


def _is_count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _check_probes(record: Dict[str, Any], where: str) -> None:
    probes = record.get("probes")
    # absent (written before it): every probe is listed; counted before the list is cut to what is kept
    listed = len(probes) if isinstance(probes, list) else 0
    total = record.setdefault("probes_total", listed)
    if not (is_int(total) and listed <= total <= MAX_COUNTED):
        raise InputError(f"{where}: 'probes_total' must be an integer from the probes listed ({listed}) to"
                         f" {MAX_COUNTED}")
    if isinstance(probes, list) and len(probes) > MAX_PROBES:
        probes = record["probes"] = probes[:MAX_PROBES]
    if not isinstance(probes, list) or not all(
            isinstance(probe, dict) and is_text(probe.get("label")) and optional(probe.get("module"), is_text)
            and _is_count(probe.get("nan")) and _is_count(probe.get("inf")) and is_stat(probe.get("abs_min"))
            and is_stat(probe.get("abs_max")) for probe in probes):
        raise InputError(f"{where}: a probe record needs a 'probes' list of text 'label', counts"
                         " 'nan'/'inf' (integers from 0)")


class Line(NamedTuple):
    """One non-empty line of a records file: where it starts (bytes), and its record or what is wrong (a
    tuple: one is made for each line of 131,072 ranks' files)."""

    number: int
    offset: int
    record: Optional[Dict[str, Any]]
    problem: Optional[str]


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{where}: not UTF-8 text") from None


def _parse_line(raw: bytes, path: Path, number: int) -> Dict[str, Any]:
    where = f"{path}:{number}"
    return from_json(parse_json(_decode(raw, where), where), where)


SMALL_FILE = 1 << 20  # a records file up to this size is read at once, a larger one line by line


def stream(path: Path) -> Iterator[Line]:
    """The lines of one rank's file, read one at a time (a file of any size in the memory of one line;
    one of at most ``SMALL_FILE`` bytes read at once: 131,072 ranks' files cost a read each).

    A last line without its newline is a record cut short (the process died while writing it); a line
    that is not UTF-8 is a problem of its own. A file that holds more lines that are no record than records
    is given up after ``MAX_JUNK_LINES`` of them, with a problem that says so."""
    data = read_if_small(path, SMALL_FILE)
    if data is not None:
        yield from _lines(path, _split_lines(data))
        return
    with open_regular(path) as handle:
        yield from _lines(path, handle)


def _split_lines(data: bytes) -> Iterator[bytes]:
    """The lines of ``data`` as a file yields them: each with its newline, the last perhaps without."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start) + 1 or len(data)
        yield data[start:end]
        start = end


# lines that are no record (blank, not a JSON object, or one that does not parse) read before a file that
# holds more of them than records is given up: 100 MB of one-character lines cost these lines (a few
# milliseconds), not 50 M of them; a file of records torn by a few thousand bad lines is still read whole
MAX_JUNK_LINES = 10_000


def _lines(path: Path, raws: Iterable[bytes]) -> Iterator[Line]:
    offset, junk, good = 0, 0, 0
    for number, raw in enumerate(raws, start=1):
        start, offset = offset, offset + len(raw)
        first = raw[:1]
        if first != b"{" and (not first.isspace() or raw.lstrip()[:1] != b"{"):  # no record: not parsed
            problem = None if raw.isspace() else f"{path}:{number}: not a JSON object"
        else:
            try:
                record = _parse_line(raw, path, number)
            except InputError as exc:
                problem = (f"{path}:{number}: truncated last line (the rank died while writing it)"
                           if not raw.endswith(b"\n") else str(exc))
            else:
                good += 1
                yield Line(number, start, record, None)
                continue
        junk += 1
        if junk > MAX_JUNK_LINES and junk > good:
            yield Line(number, start, None, f"{path}:{number}: given up: {junk} of its first {number} lines"
                                            " are no record (a records file holds one JSON object a line)")
            return
        if problem is not None:
            yield Line(number, start, None, problem)


def load_at(path: Path, number: int, offset: int) -> Dict[str, Any]:
    """The record on line ``number`` that starts at byte ``offset`` (as ``stream`` found it)."""
    with open_regular(path) as handle:
        handle.seek(offset)
        return _parse_line(handle.readline(), path, number)


def load(path: Path) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The records of one rank's file, and a problem per line that could not be used."""
    records: List[Dict[str, Any]] = []
    problems: List[str] = []
    for line in stream(path):
        if line.record is not None:
            records.append(line.record)
        elif line.problem is not None:
            problems.append(line.problem)
    return records, problems
