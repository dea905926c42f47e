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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl import checkpoints
from opalctl.driver.evaluation import evaluate_all, recorded_metrics, rng_state, set_rng_state
from opalctl.driver.promotion import decide
from opalctl.files import sha256_bytes
from opalctl.formats import RecordChanged, RecordDamaged, StageFacts, StageRecord, finite_or_none


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
class SavedStage:
    """A stage's checkpoint: where the layout puts it (``name`` beneath the run folder ``root``, never a path the
    training process sent) and what the training process says it saved there (``formats.StageSaved``'s fields: a
    claim the judge checks)."""

    index: int  # the fraction's index; the stage number is index + 1
    root: Path
    name: str  # relative to the run folder: training/stage-01.pt
    sha256: str
    model_sha256: str
    bytes: int

    @property
    def path(self) -> Path:
        return self.root / self.name


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
        self.holds: int | None = None  # the index of the stage whose weights the model holds (None: the parent's)

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
        """The metrics of the model in ``saved``'s file, which must be the file and the model its record names.
        The file is read once, without following a link and only as one regular file (``checkpoints.read_beneath``:
        no stage checkpoint can make this unconfined process open an evaluation split or anything else), and the
        bytes hashed are the bytes loaded."""
        started = time.perf_counter()
        advice = f"move the run folder {saved.root} aside and start the run again"
        try:
            data = checkpoints.read_beneath(saved.root, saved.name, limit_bytes=self.limit_bytes)
        except checkpoints.CheckpointRefused as error:
            raise RecordDamaged(f"{error.message} (stage {saved.index + 1}); {advice}") from None
        if sha256_bytes(data) != saved.sha256:
            raise RecordChanged(f"checkpoint {saved.path} is not the file stage {saved.index + 1} saved (its sha256 "
                                f"differs from what the training process saved); {advice}")
        payload = checkpoints.load_bytes(data, saved.path, expected_shapes=self.shapes,
                                         require_finite=False)  # a diverged stage is judged, not refused
        if payload["model_sha256"] != saved.model_sha256:
            raise checkpoints.CheckpointRefused(f"checkpoint {saved.path} holds another model than the stage "
                                                f"saved; {advice}")
        self.model.load_state_dict(payload["model"])
        self.holds = saved.index
        self.load_seconds += time.perf_counter() - started
        return evaluate_all(self.task, self.model, self.splits)

    def weights_of(self, saved: SavedStage) -> dict[str, Any]:
        """The weights of the stage ``saved`` (a copy, on the CPU as its file holds them, whatever the device the
        judge evaluates on: ``initial.pt``'s are compared with them): from the judge's own model when it judged
        that stage last, else read from its file as ``evaluate`` reads it."""
        if self.holds != saved.index:
            data = checkpoints.read_beneath(saved.root, saved.name, limit_bytes=self.limit_bytes)
            if sha256_bytes(data) != saved.sha256:
                raise RecordChanged(f"checkpoint {saved.path} is not the file stage {saved.index + 1} was judged on "
                                    f"(its sha256 differs from the stage record); move the run folder {saved.root} "
                                    f"aside and start the run again")
            return checkpoints.load_bytes(data, saved.path, expected_shapes=self.shapes, require_finite=False)["model"]
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()}

    def judge(self, saved: list[SavedStage], facts: StageFacts, incumbent: Incumbent, anchor_metrics: dict[str, Any],
              anchor_sha256: str | None = None) -> tuple[list[StageRecord], Incumbent]:
        """The records of the stages one update reached (they share its weights, so they are evaluated once) and
        the incumbent after them, decided in order; each names the anchor record it was judged against."""
        started = time.perf_counter()
        metrics = self.evaluate(saved[0])
        eval_seconds = time.perf_counter() - started
        records = []
        for stage in saved:
            against = anchor_metrics if incumbent.stage is None else incumbent.metrics
            decision = decide(metrics, against, anchor_metrics, self.selection)
            before = incumbent.label
            checkpoint = {"file": stage.name, "sha256": stage.sha256, "model_sha256": stage.model_sha256}
            if decision.promoted:
                incumbent = Incumbent(stage=stage.index + 1, metrics=metrics, checkpoint=checkpoint)
            records.append(StageRecord(
                stage=stage.index + 1, fraction=self.fractions[stage.index],
                **{**facts.fields(), "loss": finite_or_none(facts.loss)},  # a diverged update's loss: None
                checkpoint={**checkpoint, "bytes": stage.bytes}, metrics=recorded_metrics(metrics), eval_seconds=eval_seconds,
                incumbent_before=before, decision=decision.to_json(), promoted=decision.promoted,
                incumbent_after=incumbent.label,
                shared_state_with=[other.index + 1 for other in saved if other.index != stage.index],
                anchor_sha256=anchor_sha256))
        return records, incumbent
