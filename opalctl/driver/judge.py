"""Judging a stage: evaluate its checkpoint, decide promotion against the incumbent and the anchor, and say it as
``StageRecord``s.

The judge never sees the training model. It lives in the evaluator process (driver/evaluator.py), holds its own
instance of the arm's model, built once when the run starts, and evaluates a stage by loading the stage's
checkpoint file into it, so what it judges is exactly what is on the disk and nothing the training process (or an
agent's program) does to its own model, or to torch in that process, can reach an evaluation. Its inputs are
plain data (a checkpoint's record, the training figures at the stage, the incumbent, the anchor's metrics).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from opalctl import checkpoints
from opalctl.driver.evaluation import evaluate_all, rng_state, set_rng_state
from opalctl.files import sha256_file
from opalctl.formats import RecordChanged, RecordDamaged, StageRecord


@dataclass
class Incumbent:
    """The best stage so far under the promotion policy; ``stage`` None while it is the anchor."""

    stage: int | None = None
    metrics: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None  # file, sha256, model_sha256

    @property
    def label(self) -> int | str:
        return self.stage if self.stage is not None else "anchor"

    def to_json(self) -> dict[str, Any]:
        """The resume checkpoint's ``incumbent``: ``{"stage": None}`` for the anchor."""
        if self.stage is None:
            return {"stage": None}
        return {"stage": self.stage, "metrics": self.metrics, "checkpoint": self.checkpoint}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Incumbent:
        if data.get("stage") is None:
            return cls()
        return cls(stage=data["stage"], metrics=data["metrics"], checkpoint=data["checkpoint"])


@dataclass(frozen=True)
class StageFacts:
    """What training knows when an update reaches one or more stages (the same for each of them): these fields
    are ``StageRecord``'s of the same names, passed on as they are."""

    update: int
    budget_used: float
    budget_fraction_used: float
    examples: int
    train_cpu_seconds: float
    train_wall_seconds: float
    loss: float | None  # the last update's training loss


@dataclass(frozen=True)
class SavedStage:
    """A stage's checkpoint as ``checkpoints.save`` described it."""

    index: int  # the fraction's index; the stage number is index + 1
    path: Path
    sha256: str
    model_sha256: str
    bytes: int

    @classmethod
    def of(cls, index: int, record: dict[str, Any]) -> SavedStage:
        return cls(index=index, path=Path(record["path"]), sha256=record["sha256"],
                   model_sha256=record["model_sha256"], bytes=record["bytes"])


class Judge:
    """Evaluates stage checkpoints on its own model instance and decides about them."""

    def __init__(self, task, splits: dict[str, Any], model, fractions: list[float], selection,
                 limit_bytes: int):
        self.task = task
        self.splits = splits
        self.model = model
        self.shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self.fractions = list(fractions)
        self.selection = selection
        self.limit_bytes = limit_bytes
        self.load_seconds = 0.0  # the time spent loading checkpoints, in total (what judging from files costs)

    @classmethod
    def build(cls, task, splits, parent_path: Path, arm, seed: int, device: str, protocol) -> Judge:
        """A judge with its own model instance, built the way the training model was; the random generators are
        saved and restored around the build, so the run's random stream is the one it would be without it."""
        saved = rng_state()
        try:
            model = task.build(parent_path, arm.model, seed, device).model
        finally:
            set_rng_state(saved)
        model.train()  # evaluated in the mode the training model is in, as a task's evaluate expects
        return cls(task, splits, model, list(protocol.budget.fractions), protocol.selection,
                   protocol.limits.checkpoint_bytes)

    def evaluate(self, saved: SavedStage) -> dict[str, float | int]:
        """The metrics of the model in ``saved``'s file, which must be the file and the model its record names."""
        started = time.perf_counter()
        advice = f"move the run folder {saved.path.parent} aside and start the run again"
        if not saved.path.is_file():
            raise RecordDamaged(f"checkpoint {saved.path} of stage {saved.index + 1} is missing; {advice}")
        if sha256_file(saved.path) != saved.sha256:
            raise RecordChanged(f"checkpoint {saved.path} is not the file stage {saved.index + 1} saved (its sha256 "
                                f"differs from the stage's record); restore it from a copy you trust, or {advice}")
        payload = checkpoints.load(saved.path, limit_bytes=self.limit_bytes, expected_shapes=self.shapes,
                                   require_finite=False)  # a diverged stage is judged, not refused
        if payload["model_sha256"] != saved.model_sha256:
            raise checkpoints.CheckpointRefused(f"checkpoint {saved.path} holds another model than the stage "
                                                f"saved; move the run folder aside and start the run again")
        self.model.load_state_dict(payload["model"])
        self.load_seconds += time.perf_counter() - started
        return evaluate_all(self.task, self.model, self.splits)

    def judge(self, saved: list[SavedStage], facts: StageFacts, incumbent: Incumbent, anchor_metrics: dict[str, Any],
              anchor_sha256: str | None = None) -> tuple[list[StageRecord], Incumbent]:
        """The records of the stages one update reached (they share its weights, so they are evaluated once) and
        the incumbent after them, decided in order; each names the anchor record it was judged against."""
        from opalctl.driver.promotion import decide

        started = time.perf_counter()
        metrics = self.evaluate(saved[0])
        eval_seconds = time.perf_counter() - started
        records = []
        for stage in saved:
            against = anchor_metrics if incumbent.stage is None else incumbent.metrics
            decision = decide(metrics, against, anchor_metrics, self.selection)
            before = incumbent.label
            checkpoint = {"file": stage.path.name, "sha256": stage.sha256, "model_sha256": stage.model_sha256}
            if decision.promoted:
                incumbent = Incumbent(stage=stage.index + 1, metrics=metrics, checkpoint=checkpoint)
            records.append(StageRecord(
                stage=stage.index + 1, fraction=self.fractions[stage.index], **asdict(facts),
                checkpoint={**checkpoint, "bytes": stage.bytes}, metrics=metrics, eval_seconds=eval_seconds,
                incumbent_before=before, decision=decision.to_json(), promoted=decision.promoted,
                incumbent_after=incumbent.label,
                shared_state_with=[other.index + 1 for other in saved if other.index != stage.index],
                anchor_sha256=anchor_sha256))
        return records, incumbent
