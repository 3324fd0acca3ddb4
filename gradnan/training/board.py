"""The incident where users already look: TensorBoard and Weights & Biases. At the run's first incident,
once its rerun has concluded, the rank that holds a tracker adds the incident at its iteration: the
headline as text (``gradnan/incident``, the report's wording) and what it knows as scalars
(``gradnan/origin_rank``, ``gradnan/micro_batch``, ``gradnan/nonfinite_params``, ``gradnan/nan``,
``gradnan/inf``); W&B also raises an alert with the same text.

The trackers: Megatron-LM's own (``--tensorboard-dir``, ``--wandb-project``; it holds them on the last
rank), which the adapter finds without importing Megatron-LM (``ModelFacts.tensorboard``,
``ModelFacts.wandb``), and gradnan's own where ``tensorboard_dir`` or ``wandb_project`` is set (on the last
rank too, as Megatron-LM's, made at the incident). Nothing is written, or imported, on a healthy step. A
tracker that fails (a full disk, W&B's service gone) costs its own write only: a WARNING, and training
goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ..config import GradnanConfig
from ..events import ModelFacts
from ..formats.incident import RecordKind, board_text, failing_step_headline
from ..log import logger
from .clock import StepClock
from .rerun import RerunOutcome
from .writer import Writer

TEXT_TAG = "gradnan/incident"


def board_scalars(outcome: Optional[RerunOutcome], record: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """The incident's numbers this rank knows: its replica's forward origin and failing micro-batch (the
    rerun's), its own count of parameters with non-finite gradients and their NaN and Inf elements."""
    scalars: Dict[str, float] = {}
    if outcome is not None and outcome.origin_rank is not None:
        scalars["gradnan/origin_rank"] = outcome.origin_rank
    if outcome is not None and outcome.micro_batch is not None:
        scalars["gradnan/micro_batch"] = outcome.micro_batch
    if record is not None:
        scalars["gradnan/nonfinite_params"] = record["params_total"]
        scalars["gradnan/nan"] = sum(param["nan"] for param in record["params"])
        scalars["gradnan/inf"] = sum(param["inf"] for param in record["params"])
    return scalars


@dataclass(frozen=True)
class BoardIncident:
    """The run's first incident as every tracker shows it: ``text`` (markdown), ``scalars``, and where:
    ``at``, Megatron-LM's iteration where its loop runs (``unit`` "iteration"), else gradnan's step."""

    text: str
    scalars: Dict[str, float]
    at: int
    unit: str

    def title(self) -> str:
        """A one-line title (W&B refuses an alert's of 64 characters or more)."""
        return f"gradnan: the incident at {self.unit} {self.at}"


def on_last_rank(writer: Writer) -> bool:
    """Where Megatron-LM holds its trackers, and gradnan makes its own."""
    coords = writer.coords()
    return coords.get("global_rank") == coords.get("world_size", 1) - 1


class Tracker:
    """Where the incident goes in one tracker: the training loop's own (``loop``: Megatron-LM's, found by the
    patch layer) and gradnan's own where ``setting`` names it, made once, at the incident, on the last rank
    (without ``package`` installed: a WARNING, and none)."""

    name = "?"
    setting = "?"
    package = "?"

    def __init__(self, config: GradnanConfig, writer: Writer, loop: Callable[[], Optional[Any]]) -> None:
        self.config, self._writer, self._loop = config, writer, loop
        self._own: Any = None

    def _make_own(self) -> Any:
        raise NotImplementedError

    def _write(self, target: Any, incident: BoardIncident) -> None:
        raise NotImplementedError

    def _finish(self, own: Any) -> None:
        raise NotImplementedError

    def _own_target(self) -> Any:
        if not getattr(self.config, self.setting) or not on_last_rank(self._writer):
            return None
        if self._own is None:
            try:
                self._own = self._make_own()
            except ImportError as error:
                logger.warning("%s is set but %s cannot be written (%s): pip install %s", self.setting,
                               self.name, error, self.package)
        return self._own

    def targets(self) -> List[Any]:
        return [target for target in (self._loop(), self._own_target()) if target is not None]

    def write(self, incident: BoardIncident) -> bool:
        """The incident in every target; False where there is none."""
        targets = self.targets()
        for target in targets:
            self._write(target, incident)
        return bool(targets)

    def close(self) -> None:
        if self._own is not None:
            self._finish(self._own)


class TensorBoard(Tracker):
    name, setting, package = "TensorBoard", "tensorboard_dir", "tensorboard"

    def _make_own(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=self.config.tensorboard_dir)

    def _write(self, target: Any, incident: BoardIncident) -> None:
        target.add_text(TEXT_TAG, incident.text, incident.at)
        for tag, value in incident.scalars.items():
            target.add_scalar(tag, value, incident.at)
        target.flush()

    def _finish(self, own: Any) -> None:
        own.close()


class WeightsAndBiases(Tracker):
    """The scalars logged at the incident's iteration (a step W&B has not passed: Megatron-LM logs an
    iteration once it is done), the text in the run's summary, and an alert (W&B sends it where the
    project's alerts go, once the run syncs). gradnan's own run goes beside any run the process already
    has (``reinit="create_new"``)."""

    name, setting, package = "W&B", "wandb_project", "wandb"

    def _make_own(self) -> Any:
        import wandb

        return wandb.init(project=self.config.wandb_project, job_type="gradnan", reinit="create_new")

    def _write(self, target: Any, incident: BoardIncident) -> None:
        target.log(incident.scalars, step=incident.at)
        target.summary[TEXT_TAG] = incident.text
        target.alert(title=incident.title(), text=incident.text, level="ERROR")

    def _finish(self, own: Any) -> None:
        own.finish()


class IncidentBoard:
    def __init__(self, config: GradnanConfig, clock: StepClock, writer: Writer, facts: ModelFacts) -> None:
        self.config, self._clock, self._writer, self._facts = config, clock, writer, facts
        self.done = False
        self.trackers = (TensorBoard(config, writer, facts.tensorboard),
                         WeightsAndBiases(config, writer, facts.wandb))

    def incident(self, outcome: Optional[RerunOutcome], record: Optional[Dict[str, Any]],
                 pre_reduction: Optional[str]) -> None:
        """The run's first incident (later ones are its aftermath): ``outcome``, what the rerun concluded
        (None: it did not run); ``record``, this rank's incident record (None: it wrote none);
        ``pre_reduction``, this rank's own gradients before the data-parallel collective (its
        ``pre_reduction`` records of the step, where "nonfinite" or "overflow")."""
        if self.done:
            return
        self.done = True
        incident = self._incident(outcome, record, pre_reduction)
        for tracker in self.trackers:
            try:
                if tracker.write(incident):
                    logger.info("the incident is in %s at %s %d", tracker.name, incident.unit, incident.at)
            except Exception as error:
                logger.warning("the incident could not be written to %s (training goes on): %s: %s",
                               tracker.name, type(error).__name__, error)

    def _incident(self, outcome: Optional[RerunOutcome], record: Optional[Dict[str, Any]],
                  pre_reduction: Optional[str]) -> BoardIncident:
        step = record["step"] if record is not None else self._clock.current()
        iteration = self._facts.iteration()
        kinds = {record["kind"]} if record is not None else set()
        if pre_reduction in ("nonfinite", "overflow"):
            kinds.add(RecordKind.PRE_REDUCTION.value)
        headline = failing_step_headline(step, iteration, sorted(kinds) or [RecordKind.RERUN.value])
        conclusion, origin_rank, micro_batch = (
            (None, None, None) if outcome is None
            else (outcome.conclusion, outcome.origin_rank, outcome.micro_batch))
        text = board_text(headline, step, iteration, conclusion, origin_rank, micro_batch,
                          self._writer.coords().get("global_rank"), record, self.config.out_dir)
        return BoardIncident(text, board_scalars(outcome, record),
                             iteration if iteration is not None else step,
                             "iteration" if iteration is not None else "step")

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as error:
                logger.warning("%s could not be closed: %s: %s", tracker.name, type(error).__name__, error)
