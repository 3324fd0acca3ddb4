"""The incident where users already look: TensorBoard. At the run's first incident, once its rerun has
concluded, the rank that holds a TensorBoard writer adds the incident at its iteration: the headline as
text (``gradnan/incident``, the report's wording) and what it knows as scalars (``gradnan/origin_rank``,
``gradnan/micro_batch``, ``gradnan/nonfinite_params``, ``gradnan/nan``, ``gradnan/inf``), then flushes.

The writers: Megatron-LM's own (``--tensorboard-dir``; it holds one on the last rank), which the adapter
finds without importing Megatron-LM (``ModelFacts.tensorboard``), and gradnan's own where
``tensorboard_dir`` is set (on the last rank too, as Megatron-LM's). Nothing is written on a healthy step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

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


class IncidentBoard:
    def __init__(self, config: GradnanConfig, clock: StepClock, writer: Writer, facts: ModelFacts) -> None:
        self.config, self._clock, self._writer, self._facts = config, clock, writer, facts
        self.done = False
        self._own: Any = None

    def _own_writer(self) -> Any:
        """gradnan's own SummaryWriter (``tensorboard_dir``), on the last rank; None elsewhere, or without
        the tensorboard package (said once)."""
        coords = self._writer.coords()
        if not self.config.tensorboard_dir or coords.get("global_rank") != coords.get("world_size", 1) - 1:
            return None
        if self._own is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                logger.warning("tensorboard_dir is set but TensorBoard cannot be written (%s): pip install"
                               " tensorboard", error)
                return None
            self._own = SummaryWriter(log_dir=self.config.tensorboard_dir)
        return self._own

    def writers(self) -> List[Any]:
        return [writer for writer in (self._facts.tensorboard(), self._own_writer()) if writer is not None]

    def incident(self, outcome: Optional[RerunOutcome], record: Optional[Dict[str, Any]],
                 pre_reduction: Optional[str]) -> None:
        """The run's first incident (later ones are its aftermath): ``outcome``, what the rerun concluded
        (None: it did not run); ``record``, this rank's incident record (None: it wrote none);
        ``pre_reduction``, this rank's own gradients before the data-parallel collective (its
        ``pre_reduction`` records of the step, where "nonfinite" or "overflow")."""
        if self.done:
            return
        self.done = True
        writers = self.writers()
        if not writers:
            return
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
        at = iteration if iteration is not None else step
        for board in writers:
            board.add_text(TEXT_TAG, text, at)
            for tag, value in board_scalars(outcome, record).items():
                board.add_scalar(tag, value, at)
            board.flush()
        logger.info("the incident is in TensorBoard at %s %d",
                    "iteration" if iteration is not None else "step", at)

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
