"""Replay of a recorded agent run (``backend: replay:<run folder>``): the recorded program versions at the recorded
decisions, with no agent.

A heuristic-agent run of the digits project on an ``updates`` clock changes its program at least once; a second
protocol whose agent arm replays that run's folder ends with the same weights (``final_model_sha256``), the same
program versions, and the same decisions at the same updates. A folder with no recorded run is refused when the
run starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from opalctl.driver.run import run
from opalctl.errors import BadInput
from opalctl.protocol.freeze import freeze

AMOUNT = 120
OPTIMIZER = {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.01}


def freeze_with(folder: Path, arms: dict) -> Path:
    path = folder / "digits.yaml"
    data = yaml.safe_load(path.read_text())
    data["budget"] = {"clock": "updates", "amount": AMOUNT, "threads": 1}
    data["training"] = {**data["training"], "checkpoint_every": 0.25}
    data["arms"] = arms
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(freeze(path, force=True)["lock"])


def agent(backend: str) -> dict:
    return {"optimizer": OPTIMIZER, "agent": {"backend": backend, "decisions": 4, "every": 10, "trial_steps": 5}}


def outcomes(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()
    return [(e["kind"], e.get("update"), e.get("decision"), e.get("version"), e.get("files"))
            for e in map(json.loads, lines) if e["kind"] not in ("start", "end")]


def programs(run_dir: Path) -> dict[str, str]:
    folder = run_dir / "training" / "opal" / "programs"
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*.py"))}


def test_a_replay_of_a_heuristic_run_ends_with_the_same_weights(digits_project, tmp_path):
    lock = freeze_with(digits_project, {"plain": {"optimizer": OPTIMIZER}, "agent": agent("heuristic")})
    original = run(lock, "agent", 1, runs_dir=tmp_path / "original")
    plain = run(lock, "plain", 1, runs_dir=tmp_path / "original")
    source = Path(original["run_dir"])
    assert any(kind == "applied" for kind, *_ in outcomes(source)), "the original must change its program"
    assert original["final_model_sha256"] != plain["final_model_sha256"]

    lock = freeze_with(digits_project, {"agent": agent(f"replay:{source}")})
    replay = run(lock, "agent", 1, runs_dir=tmp_path / "replay")
    replayed = Path(replay["run_dir"])
    assert replay["final_model_sha256"] == original["final_model_sha256"]
    assert outcomes(replayed) == outcomes(source)
    assert programs(replayed) == programs(source)
    start = json.loads((replayed / "training" / "opal" / "events.jsonl").read_text().splitlines()[0])
    assert start["backend"]["backend"] == "replay" and start["backend"]["source"] == str(source.resolve())
    rationale = (replayed / "agent" / "decisions" / "001" / "response.md").read_text()
    assert rationale.startswith(f"Replay of {source.resolve()}: decision 1")
    assert rationale.splitlines()[1:] == (source / "agent" / "decisions" / "001" / "response.md").read_text().splitlines()


def test_a_replay_of_a_folder_without_a_recorded_run_is_refused(digits_project, tmp_path):
    lock = freeze_with(digits_project, {"agent": agent(f"replay:{tmp_path / 'nowhere'}")})
    with pytest.raises(BadInput, match="no recorded agent run"):
        run(lock, "agent", 1, runs_dir=tmp_path / "runs")
