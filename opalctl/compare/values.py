"""What one finished run says about one metric: at the selected model, the last stage or stage N, and the final
training loss from its steps records.

``train.loss`` is the mean loss of the run's last ``FINAL_LOSS_UPDATES`` updates with a finite loss (one update's
loss is one batch's, too noisy to compare seeds by); it is read from ``steps.jsonl.gz``, whatever stage is asked
for, since it describes the end of training.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from opalctl.driver.records import read_steps
from opalctl.errors import BadInput
from opalctl.layout import RunLayout

TRAIN_LOSS = "train.loss"
FINAL_LOSS_UPDATES = 16
STAGE_CHOICES = ("selected", "last")


def parse_stage(value: str | int | None) -> str | int:
    """``selected`` (the default), ``last`` or a stage number."""
    if value is None or value in STAGE_CHOICES:
        return value or "selected"
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise BadInput(f"--stage {value!r} is neither selected, last nor a stage number; give one of those") from None
    if number < 1:
        raise BadInput(f"--stage {number} is not a stage number (stages count from 1); give selected, last or N")
    return number


def stage_metrics(report: dict[str, Any], stage: str | int, where: Path) -> dict[str, Any]:
    """The metrics of the model ``stage`` names in one run (``where`` is its folder, named in a refusal)."""
    if stage == "selected":
        if report["selected"]["source"] == "anchor":
            return report["anchor_metrics"]
        stage = report["selected"]["stage"]
    elif stage == "last":
        if not report["stages"]:
            return report["anchor_metrics"]
        return report["stages"][-1]["metrics"]
    for record in report["stages"]:
        if record["stage"] == stage:
            return record["metrics"]
    have = ", ".join(str(r["stage"]) for r in report["stages"]) or "none"
    raise BadInput(f"run {where} has no stage {stage} (its stages: {have}); give --stage selected, last or one of "
                   f"those")


def final_train_loss(run_dir: Path) -> float | None:
    """The mean training loss of the run's last ``FINAL_LOSS_UPDATES`` finite updates; None without records."""
    path = RunLayout.of(run_dir).steps
    if not path.is_file():
        return None
    last: deque[float] = deque(maxlen=FINAL_LOSS_UPDATES)
    for line in read_steps(path):
        loss = line.get("loss")
        if isinstance(loss, (int, float)) and loss - loss == 0.0:
            last.append(float(loss))
    return sum(last) / len(last) if last else None
