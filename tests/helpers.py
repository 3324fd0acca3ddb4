"""Shared assertions over what a real run wrote."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

import pytest

from gradnan.offline.incident.read import read_run


def environ_without_gradnan() -> Dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("GRADNAN_")}


def run_bounded(command: Sequence[str], timeout: float, **options: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a launcher (torchrun and its workers) in its own process group: past
    ``timeout`` the whole group is killed (a hung worker left behind would slow every test after it) and
    the result says so in its stderr, returncode -9, for the test's assertion to show."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **options) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            return subprocess.CompletedProcess(command, -9, out, f"{err}\n[killed after {timeout} s]")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@contextlib.contextmanager
def gradnan_variables_cleared() -> Iterator[pytest.MonkeyPatch]:
    """For a module-scoped fixture: no ``GRADNAN_*`` variable is set inside the block (restored after)."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [key for key in os.environ if key.startswith("GRADNAN_")]:
            patch.delenv(key)
        yield patch


def records_by_rank(run_dir: Path) -> Dict[int, List[Dict[str, Any]]]:
    files = read_run(run_dir)
    assert not files.problems, files.problems
    by_rank: Dict[int, List[Dict[str, Any]]] = {}
    for record in files.all_records():
        by_rank.setdefault(record["rank"]["global_rank"], []).append(record)
    return by_rank


def map_names(map_file: str) -> Dict[int, str]:
    from gradnan.formats.maps import load as load_map

    return {entry["id"]: entry["name"] for entry in load_map(Path(map_file))["params"]}


def assert_origin(run_dir: Path, *, rank: int, step: int, param: str, value: str, index: int,
                  kind: str) -> Dict[str, Any]:
    """The first record on ``rank`` is at ``step``, names exactly ``param`` (one bad element at ``index``),
    and the map file resolves the reported id to the same name. Returns that record."""
    by_rank = records_by_rank(run_dir)
    assert rank in by_rank, f"no record on rank {rank}; ranks with records: {sorted(by_rank)}"
    record = min(by_rank[rank], key=lambda r: r["step"])
    assert record["step"] == step
    assert record["kind"] == kind
    assert [p["name"] for p in record["params"]] == [param]
    found = record["params"][0]
    assert found["first_bad_flat"] == index
    expected_counts = {"nan": (1, 0), "inf": (0, 1)}[value]
    assert (found["nan"], found["inf"]) == expected_counts
    assert map_names(record["map"])[found["id"]] == param
    return record


def assert_clean_elsewhere(run_dir: Path, *, origin: int, step: int) -> None:
    """Every other rank's records at ``step`` (if any) name no local parameter."""
    for rank, records in records_by_rank(run_dir).items():
        if rank == origin:
            continue
        at_step = [r for r in records if r["step"] == step]
        assert all(not r["params"] and not r["local_nonfinite"] for r in at_step), (rank, at_step)


def step_trace(outcome) -> Dict[int, List[tuple]]:
    """Each rank's (loss, grad norm, update applied) per step, floats as exact hex: compares bitwise."""
    def bits(value):
        return None if value is None else float(value).hex()

    return {rank: [(bits(s.loss), bits(s.grad_norm), s.update_successful) for s in result.steps]
            for rank, result in outcome.items()}


def weight_digests(outcome) -> Dict[int, str]:
    """Each rank's SHA-256 of its weights after the last step: equal digests, bitwise equal weights."""
    return {rank: result.param_digest for rank, result in outcome.items()}


def rerun_block(text: str) -> List[str]:
    """The report's lines about the rerun of the failing step (``Forward origin (...`` or ``Rerun of ...``
    and the indented lines under it): evidence, after the verdict, the origin and the next steps."""
    lines = text.splitlines()
    start = next(number for number, line in enumerate(lines)
                 if line.startswith(("Forward origin (", "Rerun of ")))
    end = next((number for number in range(start + 1, len(lines)) if not lines[number].startswith(" ")),
               len(lines))
    return lines[start:end]


def printed_commands(text: str, command: str) -> List[List[str]]:
    """The copyable ``gradnan COMMAND ...`` lines of a report, as a shell splits them: under ``Next:``, or
    in the rerun's lines where no next step prints them (``replay it: ...``, ``the micro-batch: PATH``,
    which ``gradnan batch PATH`` reads)."""
    found = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("replay it: "):
            stripped = stripped.split(": ", 1)[1]
        elif stripped.startswith("the micro-batch: "):
            stripped = "gradnan batch " + stripped.split(": ", 1)[1]
        if stripped.startswith(f"gradnan {command} "):
            found.append(shlex.split(stripped))
    return found


WANDB_BLOCK = 32768  # the .wandb file is LevelDB's log format: records in chunks within 32 KiB blocks
WANDB_CHUNK_HEADER = struct.Struct("<IHB")  # checksum, length, type (1 whole, 2 first, 3 middle, 4 last)


def wandb_records(run_folder: Path) -> List[Any]:
    """The records of a W&B run folder's ``run-<id>.wandb`` file (what ``wandb sync`` uploads), as W&B's
    own protobuf ``Record`` messages. wandb 0.31 ships no reader of it: the log format is read here."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_folder.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, chunks, position = [], [], 7
    while position + WANDB_CHUNK_HEADER.size <= len(data):
        left = WANDB_BLOCK - position % WANDB_BLOCK
        checksum, length, kind = WANDB_CHUNK_HEADER.unpack_from(data, position)
        if left < WANDB_CHUNK_HEADER.size or (length, kind) == (0, 0):  # a block's zero padding
            position += left
            continue
        chunk = data[position + WANDB_CHUNK_HEADER.size:position + WANDB_CHUNK_HEADER.size + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"{path}: corrupt at {position}"
        chunks.append(chunk)
        position += WANDB_CHUNK_HEADER.size + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def wandb_run_folder(directory: Path) -> Path:
    """The one offline run folder W&B wrote under ``directory`` (its ``dir``, or ``WANDB_DIR``)."""
    [folder] = (directory / "wandb").glob("offline-run-*")
    return folder


def wandb_incident(run_folder: Path) -> Dict[str, Any]:
    """What a W&B run folder holds of gradnan: its history rows' ``gradnan/*`` values by step, the summary's
    ``gradnan/incident`` text, and its alerts as (title, text, level)."""
    history: Dict[int, Dict[str, Any]] = {}
    texts, alerts = [], []
    for record in wandb_records(run_folder):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            values = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                      for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(
                {key: value for key, value in values.items() if key.startswith("gradnan/")})
        elif kind == "summary":
            texts += [json.loads(update.value_json) for update in record.summary.update
                      if (update.key or "/".join(update.nested_key)) == "gradnan/incident"]
        elif kind == "alert":
            alerts.append((record.alert.title, record.alert.text, record.alert.level))
    return {"history": {step: row for step, row in history.items() if row}, "texts": texts, "alerts": alerts}


def read_board(directory: Path):
    """A TensorBoard log directory, read with TensorBoard's own event reader: (the incident's texts by step,
    each scalar's (step, value) events, how many event files)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    accumulator = EventAccumulator(str(directory), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    texts = {event.step: make_ndarray(event.tensor_proto).item().decode()
             for event in accumulator.Tensors("gradnan/incident/text_summary")}
    scalars = {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
               for tag in accumulator.Tags()["scalars"]}
    return texts, scalars, len(list(directory.glob("events.out.tfevents.*")))


_OBSERVED_FOR = {
    "reproducible": {"reproduced": True},
    "loss": {"loss_again": "nonfinite"},
    "norm_overflow": {"norm_overflow": True},
    "backward": {"own_gradients": "nonfinite"},
    "after_collective": {"own_gradients": "finite"},
    "not_reproduced": {},
}


def observed(conclusion: str, own_failure: Any = None) -> Dict[str, Any]:
    """A version 2 ``rerun`` record's ``observed`` that concludes ``conclusion`` (for a transient one,
    from the ``own_failure`` given: "loss", or "gradients" with Megatron's rerun transient); checked
    against ``decision.replica.conclude``."""
    from gradnan.decision.replica import conclude
    from gradnan.formats.observed import ReplicaObservation

    fields = {"reproduced": False, "loss": "unseen", "loss_again": "unseen", "own_gradients": "unseen",
              "norm_overflow": False, "megatron_job": None}
    if conclusion == "transient":
        fields.update({"loss": "nonfinite"} if own_failure in (None, "loss") else
                      {"own_gradients": "nonfinite", "megatron_job": "transient"})
    else:
        fields.update(_OBSERVED_FOR[conclusion])
    assert conclude(ReplicaObservation.from_json(fields)) == conclusion
    return fields
