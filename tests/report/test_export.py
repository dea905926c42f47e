"""``opalctl export LOCK --tensorboard DIR``, read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.cli import call_cli

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (pip install tensorboard); the export cannot be read back")


def _read(folder):
    accumulator = event_accumulator.EventAccumulator(str(folder), size_guidance={
        event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    accumulator.Reload()
    return accumulator


def _steps(run_dir):
    import gzip

    with gzip.open(run_dir / "training" / "steps.jsonl.gz", "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def test_the_export_holds_each_runs_loss_stage_metrics_and_decisions(grid, tmp_path, capsys):
    from tensorboard.util import tensor_util

    from opalctl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(grid["lock"]), "--runs-dir", str(grid["runs"]), "--tensorboard", str(tmp_path / "tb")])
    out = capsys.readouterr().out
    assert (exit_info.value.code or 0) == 0
    base = next(grid["runs"].glob("digits-*"))
    expected = sorted(f"{arm.name}/{seed.name}" for arm in base.iterdir() if arm.name != "anchors"
                      for seed in arm.glob("seed-*"))
    assert sorted(str(Path(line).relative_to(tmp_path / "tb")) for line in out.split()) == expected
    for name in expected:
        run_dir = base / name
        accumulator = _read(tmp_path / "tb" / name)
        steps = _steps(run_dir)
        loss = accumulator.Scalars("train/loss")
        assert [e.step for e in loss] == [s["update"] for s in steps]
        assert [e.value for e in loss] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
        lrs = accumulator.Scalars("train/lr/group-0")
        assert [(e.step, e.value) for e in lrs] == [(s["update"], pytest.approx(s["lrs"][0], rel=1e-6)) for s in steps]
        assert not [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("train/lr/group-1")], "one group"
        walls = [sum(s["wall"] for s in steps[:i + 1]) for i in range(len(steps))]
        assert [e.wall_time for e in loss] == pytest.approx(walls, rel=1e-9), "wall time is training seconds"
        report = json.loads((run_dir / "report.json").read_text())
        for metric in ("selection.correct", "retention.loss"):
            events = accumulator.Scalars(f"stage/{metric}")
            assert [(e.step, e.value) for e in events] == \
                [(s["update"], pytest.approx(s["metrics"][metric], rel=1e-6)) for s in report["stages"]]
            assert accumulator.Scalars(f"anchor/{metric}")[0].value == \
                pytest.approx(report["anchor_metrics"][metric], rel=1e-6)
        events_path = run_dir / "training" / "opal" / "events.jsonl"
        answered = [json.loads(line) for line in events_path.read_text().splitlines()] if events_path.exists() else []
        outcomes = [e for e in answered if e.get("kind") in ("applied", "kept")]
        if not outcomes:
            assert "agent/decisions/text_summary" not in accumulator.Tags()["tensors"]
            continue
        texts = accumulator.Tensors("agent/decisions/text_summary")
        assert [t.step for t in texts] == [e["update"] for e in outcomes]
        first = tensor_util.make_ndarray(texts[0].tensor_proto).item().decode()
        assert first.startswith(f"**decision {outcomes[0]['decision']}**: {outcomes[0]['kind']}")
        assert outcomes[0]["summary"] in first


def test_exporting_again_replaces_the_earlier_event_files(grid, tmp_path):
    from opalctl.export import export_tensorboard

    export_tensorboard(grid["lock"], tmp_path / "tb", runs_dir=grid["runs"])
    folder = tmp_path / "tb" / "adamw" / "seed-1"
    (folder / "notes.txt").write_text("mine")
    export_tensorboard(grid["lock"], tmp_path / "tb", runs_dir=grid["runs"])
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1 and (folder / "notes.txt").read_text() == "mine"
    loss = _read(folder).Scalars("train/loss")
    assert len(loss) == len({e.step for e in loss}), "each update once"


def test_without_tensorboard_the_export_says_what_to_install(grid, tmp_path, monkeypatch, capsys):
    import sys

    from opalctl.cli import main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(grid["lock"]), "--runs-dir", str(grid["runs"]), "--tensorboard", str(tmp_path / "tb")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 1 and captured.out == ""
    assert "needs the tensorboard package" in captured.err and len(captured.err.strip().splitlines()) == 1


def _strip_the_chain(run_dir):
    """Edit a figure of the report and drop every digest that would tell: it reads like a report of an opalctl
    older than the chain, which compare reads tolerantly."""
    path = run_dir / "report.json"
    report = json.loads(path.read_text())
    report.pop("digests", None)
    for stage in report["stages"]:
        stage.pop("anchor_sha256", None)
        stage["metrics"]["selection.correct"] += 1
    path.write_text(json.dumps(report))


def _flip_a_steps_byte(run_dir):
    data = bytearray((run_dir / "training" / "steps.jsonl.gz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (run_dir / "training" / "steps.jsonl.gz").write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_strip_the_chain, _flip_a_steps_byte], ids=["edited-report", "damaged-steps"])
def test_export_refuses_an_edited_or_damaged_run_folder_in_shows_sentence_and_writes_nothing(grid, tmp_path,
                                                                                            damage):
    runs = tmp_path / "runs"
    shutil.copytree(grid["runs"], runs)
    run_dir = runs / grid["base"].name / "twin" / "seed-2"  # the last run exported: nothing may be written first
    damage(run_dir)
    shown = call_cli("show", run_dir)
    assert shown.code in (1, 3) and shown.stdout == "" and len(shown.stderr.strip().splitlines()) == 1, shown.stderr
    exported = call_cli("export", grid["lock"], "--runs-dir", runs, "--tensorboard", tmp_path / "tb")
    assert (exported.code, exported.stdout, exported.stderr) == (shown.code, "", shown.stderr)
    assert not (tmp_path / "tb").exists()
