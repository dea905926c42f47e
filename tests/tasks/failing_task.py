"""A custom task (docs/custom-task.md) that misbehaves in one chosen way: the built-in digits, with the failure named
by the environment variable ``TASK_FAIL`` (unset: it behaves), so one lock serves every test and a run whose cause
has passed resumes. ``TASK_FAIL_AT=N`` delays a ``loss``, ``next_batch`` or ``hang_evaluate`` failure to the N-th call of the process
(the evaluator's first three calls of ``evaluate`` are the anchor's splits).

The ways (``TASK_FAIL``, several separated by commas): ``load``, ``build``, ``sampler``, ``next_batch``, ``state_dict``, ``load_state_dict`` and
``evaluate`` raise in that method; ``loss`` raises in it; ``loss_vector`` returns one loss per row; ``loss_no_grad``
a loss without a gradient; ``state_numpy`` a numpy integer in the sampler's state; ``metric_nan_count``,
``metric_huge``, ``metric_string`` and ``metric_bool`` such a metric; ``metric_numpy`` numpy numbers (converted,
the run finishes); ``print`` prints from every method; ``hang_evaluate`` sleeps in ``evaluate`` until
``TASK_RELEASE`` (a file) exists, after writing the evaluator's pid to ``TASK_HANG_PID`` (a file).

It is read by the tests as text and written as a task module of the test's project (``Project.task_module``).
"""

import os
import time
from pathlib import Path

import numpy as np

from opalctl.files import atomic_write_text
from opalctl.tasks.digits import Digits, DigitsSampler

CALLS = {"loss": 0, "next_batch": 0, "evaluate": 0}


def failing(way: str) -> bool:
    return way in os.environ.get("TASK_FAIL", "").split(",")


def due(method: str) -> bool:
    CALLS[method] += 1
    return str(CALLS[method]) == os.environ.get("TASK_FAIL_AT", "1")


def say(method: str) -> None:
    if failing("print"):
        print(f"the failing task prints from {method}")


class FailingSampler(DigitsSampler):
    def next_batch(self):
        say("next_batch")
        if failing("next_batch") and due("next_batch"):
            raise RuntimeError("the test's next_batch fails")
        return super().next_batch()

    def state_dict(self):
        say("state_dict")
        if failing("state_dict"):
            raise KeyError("the test's state_dict fails")
        state = super().state_dict()
        if failing("state_numpy"):
            state["streams"][0]["position"] = np.int64(state["streams"][0]["position"])
        return state

    def load_state_dict(self, state):
        if failing("load_state_dict"):
            raise ValueError("the test's load_state_dict fails")
        super().load_state_dict(state)


class FailingDigits(Digits):
    def load(self, data_paths):
        say("load")
        if failing("load"):
            raise OSError("the test's load fails")
        return super().load(data_paths)

    def build(self, parent_path, arm_config, seed, device="cpu"):
        say("build")
        if failing("build"):
            raise RuntimeError("the test's build fails")
        return super().build(parent_path, arm_config, seed, device)

    def sampler(self, train, seed, batch_size, device="cpu"):
        say("sampler")
        if failing("sampler"):
            raise ZeroDivisionError("the test's sampler fails")
        return FailingSampler(train, seed, batch_size, self.config.replay_share, device)

    def loss(self, model, batch):
        say("loss")
        loss, details = super().loss(model, batch)
        if failing("loss") and due("loss"):
            raise RuntimeError("the test's loss fails")
        if failing("loss_vector"):
            return loss.repeat(len(batch)), details
        if failing("loss_no_grad"):
            return loss.detach(), details
        return loss, details

    def evaluate(self, model, rows):
        say("evaluate")
        if failing("evaluate"):
            raise IndexError("the test's evaluate fails")
        if failing("hang_evaluate") and due("evaluate"):
            # written whole (aside, then renamed): a test waits for the file to exist, then reads the pid (read
            # between the file's creation and its write, it was once empty)
            atomic_write_text(os.environ["TASK_HANG_PID"], str(os.getpid()), durable=False)
            release = Path(os.environ.get("TASK_RELEASE", os.devnull + ".never"))
            while not release.exists():
                time.sleep(0.05)
        metrics = super().evaluate(model, rows)
        if failing("metric_nan_count"):
            metrics["total"] = float("nan")
        if failing("metric_huge"):
            metrics["correct"] = 10 ** 400
        if failing("metric_string"):
            metrics["loss"] = "low"
        if failing("metric_bool"):
            metrics["correct"] = True
        if failing("metric_numpy"):
            metrics = {"correct": np.int64(metrics["correct"]), "total": np.int32(metrics["total"]),
                       "loss": np.float32(metrics["loss"])}
        return metrics
