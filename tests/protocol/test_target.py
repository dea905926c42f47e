"""The protocol's ``target`` (time-to-target): accepted and frozen into the lock, refused in one sentence naming the
key when it names no evaluation split, no metric of the task or a count; absent, every lock resolves as before."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from opalctl.compare.target import TargetRule, median, time_to_target
from opalctl.errors import BadInput
from opalctl.protocol.freeze import resolved_protocol
from opalctl.protocol.lock import protocol_digest
from opalctl.protocol.schema import load_protocol
from opalctl.tasks.builtin import protocol_text

ROOT = Path(__file__).resolve().parents[2]
BASE = protocol_text("digits", [1, 2])


def written(folder: Path, extra: str) -> Path:
    path = folder / "protocol.yaml"
    path.write_text(BASE + extra, encoding="utf-8")
    return path


def test_a_target_is_read_and_resolved_into_the_lock(tmp_path):
    protocol = load_protocol(written(tmp_path, "target: {metric: selection.correct, value: 200}\n"))
    resolved = resolved_protocol(protocol)
    assert resolved["target"] == {"metric": "selection.correct", "value": 200.0}
    assert protocol_digest(resolved) != protocol_digest(resolved_protocol(load_protocol(written(tmp_path, ""))))


@pytest.mark.parametrize(("target", "words"), [
    ("{metric: train.correct, value: 1}", "'train.correct' names no evaluation split"),
    ("{metric: selection.accuracy, value: 1}", "reports no metric 'accuracy'"),
    ("{metric: selection.total, value: 1}", "is a count"),
    ("{metric: selection.correct}", "target.value: this key is required"),
    ("{metric: selection.correct, value: 1, kind: higher}", "target.kind: unknown key"),
    ("{metric: correct, value: 1}", "target.metric: string should match pattern"),
])
def test_a_bad_target_is_refused_in_one_sentence(tmp_path, target, words):
    with pytest.raises(BadInput) as caught:
        load_protocol(written(tmp_path, f"target: {target}\n"))
    assert words in caught.value.message
    assert "\n" not in caught.value.message


def test_without_a_target_every_shipped_protocol_resolves_to_the_digest_it_always_had():
    """Digests taken on the code before the target existed (a regression guard: it passes there too)."""
    before = {"digits": "eee3ad5d3d375413c689f5f509d77f87f313cb2069d4c86c6c5153319b18a0c7",
              "pylm": "dcab6b7dbb2533e024ce785c76eb7a61df899fa1530e50eae5706d0aa7a5dfa8",
              "demo": "586eabfd97b5e312f96e9c8c9f1627e986a787d6928dfe6fc1484abd709ff923"}
    for name, digest in before.items():
        resolved = resolved_protocol(load_protocol(ROOT / "protocols" / f"{name}.yaml"))
        assert "target" not in resolved
        assert protocol_digest(resolved) == digest, name


def stages(*values):
    return [{"fraction": f, "metrics": {"selection.loss": v}} for f, v in zip((0.25, 0.5, 0.75, 1.0), values)]


def test_time_to_target_is_the_budget_at_the_first_candidate_that_reached_it():
    lower = TargetRule("selection.loss", 0.5, higher=False)
    assert time_to_target(stages(0.9, 0.5, 0.7, 0.4), lower, 200.0) == 100.0  # stage 2, reached exactly
    assert time_to_target(stages(0.9, None, 0.45, 0.4), lower, 200.0) == 150.0  # a null never reaches
    assert math.isinf(time_to_target(stages(0.9, 0.8, 0.7, 0.6), lower, 200.0))
    higher = TargetRule("selection.loss", 0.5, higher=True)
    assert time_to_target(stages(0.1, 0.2, 0.6, 0.1), higher, 40.0) == 30.0


def test_the_median_counts_not_reached_as_infinite():
    assert median([10.0, 20.0, math.inf]) == 20.0
    assert math.isinf(median([10.0, math.inf, math.inf]))
    assert median([10.0, 30.0]) == 20.0
    assert math.isinf(median([10.0, math.inf]))
