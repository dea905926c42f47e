"""The chain of digests from the lock to the verdict, and ``opalctl verify RUN_DIR``: every damaged record of a run
folder is caught by verify (exit 3, one line per finding) and refused by show and compare in one sentence naming
the file (exit 1 for a record that cannot be read, 3 for one that no longer matches); ``--resume`` refuses a damaged
or edited stage record, stage checkpoint or anchor record, naming the file.

One small lock (12 updates, four stages) is run once per session: arm ``adamw`` to its end, arm ``paused``
interrupted after stage 2 (its resume checkpoint carries stages 1 and 2); arm ``fresh`` never ran. Each case
damages a copy of that runs folder.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.cli import call_cli

ARMS = {"adamw": {"optimizer": {"name": "AdamW", "lr": 3.0e-2}},
        "paused": {"optimizer": {"name": "AdamW", "lr": 3.0e-2}},
        "fresh": {"optimizer": {"name": "AdamW", "lr": 3.0e-2}}}
POLICY = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 12},
          "improve_any": ["selection.correct"]}
STOP_AT = 8  # the paused run stops inside update 8: its last resume checkpoint, at stage 2 (update 6), carries 1, 2


class StoppingClock:
    """The updates clock, interrupted (as by Ctrl-C) inside update ``at``."""

    def __init__(self, clock, at: int):
        self._clock, self._at, self._count = clock, at, 0

    def __getattr__(self, name):
        return getattr(self._clock, name)

    def start(self):
        return self._clock.start()

    def stop(self, token):
        self._count += 1
        if self._count == self._at:
            raise KeyboardInterrupt
        return self._clock.stop(token)


@pytest.fixture(scope="session")
def chain_runs(digits_template, tmp_path_factory):
    """The lock, its runs folder and the base of its runs (read-only: cases copy it)."""
    from opalctl.driver.budget import make_clock
    from opalctl.driver.run import run
    from opalctl.protocol.freeze import freeze

    root = tmp_path_factory.mktemp("chain")
    project = root / "project"
    shutil.copytree(digits_template, project, ignore=shutil.ignore_patterns(".complete"))
    protocol = yaml.safe_load((project / "digits.yaml").read_text())
    protocol.update(budget={"clock": "updates", "amount": 12, "threads": 1, "fractions": [0.25, 0.5, 0.75, 1.0]},
                    arms=ARMS, selection=POLICY, seeds=[1])
    (project / "digits.yaml").write_text(yaml.safe_dump(protocol, sort_keys=False))
    lock = Path(freeze(project / "digits.yaml", force=True)["lock"])
    runs = root / "runs"
    report = run(lock, "adamw", 1, runs_dir=runs)
    with pytest.raises(KeyboardInterrupt):
        run(lock, "paused", 1, runs_dir=runs, clock_factory=lambda name: StoppingClock(make_clock(name), STOP_AT))
    base = Path(report["run_dir"]).parents[1]
    paused = base / "paused" / "seed-1" / "training"
    assert (paused / "resume.pt").is_file() and (paused / "stage-02.pt").is_file()
    return {"lock": lock, "runs": runs, "base": base}


@pytest.fixture
def copy(chain_runs, tmp_path):
    """A private copy of the runs folder: ``copy.base``, ``copy.run(arm)``, ``copy.runs``."""
    runs = tmp_path / "runs"
    shutil.copytree(chain_runs["runs"], runs)

    class Copy:
        lock = chain_runs["lock"]
        base = runs / chain_runs["base"].name

        def run(self, arm: str = "adamw") -> Path:
            return self.base / arm / "seed-1"

    Copy.runs = runs
    return Copy()


# -- ways to damage a file -------------------------------------------------------------------------------------

def edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def not_utf8(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] = 0xFF
    path.write_bytes(bytes(data))


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def empty(path: Path) -> None:
    path.write_bytes(b"")


def delete(path: Path) -> None:
    path.unlink()


def steps_rewritten(path: Path) -> None:
    """Valid gzip, the same number of lines, one loss changed."""
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    first = json.loads(lines[0])
    first["loss"] = 0.001
    lines[0] = json.dumps(first, separators=(",", ":"), sort_keys=True)
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def steps_not_json(path: Path) -> None:
    path.write_bytes(gzip.compress(b"\xff\xfe not a line\n" * 12))


def swap_stages(run: Path) -> None:
    one, two = (run / "stage-01.json").read_bytes(), (run / "stage-02.json").read_bytes()
    (run / "stage-01.json").write_bytes(two)
    (run / "stage-02.json").write_bytes(one)


def metric_up(key: str = "selection.correct"):
    def change(record):
        record["metrics"][key] += 5
    return change


def anchor_of(run: Path) -> Path:
    return run.parents[1] / "anchors" / "seed-1" / "anchor.json"


# (case, damage(run folder), the file the refusal names)
CASES = [
    ("report.json cut short", lambda r: cut(r / "report.json"), "report.json"),
    ("report.json not UTF-8", lambda r: not_utf8(r / "report.json"), "report.json"),
    ("report.json empty", lambda r: empty(r / "report.json"), "report.json"),
    ("report.json deleted", lambda r: delete(r / "report.json"), "report.json"),
    ("report.json not an object", lambda r: (r / "report.json").write_text("[1, 2]\n"), "report.json"),
    ("report.json lacks stages", lambda r: edit_json(r / "report.json", lambda v: v.pop("stages")), "report.json"),
    ("report.json updates of the wrong type",
     lambda r: edit_json(r / "report.json", lambda v: v.update(updates="twelve")), "report.json"),
    ("report.json stage metric edited",
     lambda r: edit_json(r / "report.json", lambda v: metric_up()(v["stages"][0])), "report.json"),
    ("report.json anchor metric edited",
     lambda r: edit_json(r / "report.json", lambda v: v["anchor_metrics"].update({"retention.correct": 100})),
     "report.json"),
    ("report.json seconds edited",
     lambda r: edit_json(r / "report.json", lambda v: v["seconds"].update(train_cpu=99.0)), "report.json"),
    ("report.json digests removed", lambda r: edit_json(r / "report.json", lambda v: v.pop("digests")),
     "report.json"),
    ("report.json selection edited",
     lambda r: edit_json(r / "report.json", lambda v: v["selected"].update(flagged=not v["selected"]["flagged"])),
     "report.json"),
    ("stage-01.json cut short", lambda r: cut(r / "stage-01.json"), "stage-01.json"),
    ("stage-01.json not UTF-8", lambda r: not_utf8(r / "stage-01.json"), "stage-01.json"),
    ("stage-01.json empty", lambda r: empty(r / "stage-01.json"), "stage-01.json"),
    ("stage-01.json deleted", lambda r: delete(r / "stage-01.json"), "stage-01.json"),
    ("stage-01.json metric edited", lambda r: edit_json(r / "stage-01.json", metric_up()), "stage-01.json"),
    ("stage-01.json metrics of the wrong type",
     lambda r: edit_json(r / "stage-01.json", lambda v: v.update(metrics="all correct")), "stage-01.json"),
    ("stage-01.json lacks decision", lambda r: edit_json(r / "stage-01.json", lambda v: v.pop("decision")),
     "stage-01.json"),
    ("stage-01.json eval_seconds edited",
     lambda r: edit_json(r / "stage-01.json", lambda v: v.update(eval_seconds=0.5)), "stage-01.json"),
    ("stage-01.json a key added", lambda r: edit_json(r / "stage-01.json", lambda v: v.update(note="fine")),
     "stage-01.json"),
    ("stage-01.json and stage-02.json swapped", swap_stages, "stage-01.json"),
    ("stage-05.json added", lambda r: shutil.copy(r / "stage-04.json", r / "stage-05.json"), "stage-05.json"),
    ("stage-02.pt one byte flipped", lambda r: flip(r / "training" / "stage-02.pt"), "stage-02.pt"),
    ("stage-02.pt deleted", lambda r: delete(r / "training" / "stage-02.pt"), "stage-02.pt"),
    ("stage-02.pt cut short", lambda r: cut(r / "training" / "stage-02.pt"), "stage-02.pt"),
    ("stage-02.pt replaced by stage-01.pt", lambda r: shutil.copy(r / "training" / "stage-01.pt", r / "training" / "stage-02.pt"),
     "stage-02.pt"),
    ("stage-02.pt empty", lambda r: empty(r / "training" / "stage-02.pt"), "stage-02.pt"),
    ("initial.pt one byte flipped", lambda r: flip(r / "initial.pt"), "initial.pt"),
    ("initial.pt deleted", lambda r: delete(r / "initial.pt"), "initial.pt"),
    ("steps.jsonl.gz gzip garbage", lambda r: (r / "training" / "steps.jsonl.gz").write_bytes(b"\x1f\x8b" + b"garbage" * 40),
     "steps.jsonl.gz"),
    ("steps.jsonl.gz rewritten, same line count", lambda r: steps_rewritten(r / "training" / "steps.jsonl.gz"),
     "steps.jsonl.gz"),
    ("steps.jsonl.gz cut short", lambda r: cut(r / "training" / "steps.jsonl.gz"), "steps.jsonl.gz"),
    ("steps.jsonl.gz deleted", lambda r: delete(r / "training" / "steps.jsonl.gz"), "steps.jsonl.gz"),
    ("steps.jsonl.gz lines not JSON", lambda r: steps_not_json(r / "training" / "steps.jsonl.gz"), "steps.jsonl.gz"),
    ("start.json deleted", lambda r: delete(r / "start.json"), "start.json"),
    ("start.json seed edited", lambda r: edit_json(r / "start.json", lambda v: v.update(seed=2)), "start.json"),
    ("start.json cut short", lambda r: cut(r / "start.json"), "start.json"),
    ("last.json sha256 edited", lambda r: edit_json(r / "last.json", lambda v: v.update(sha256="0" * 64)),
     "last.json"),
    ("last.json deleted", lambda r: delete(r / "last.json"), "last.json"),
    ("selected.json metric edited", lambda r: edit_json(r / "selected.json", metric_up()), "selected.json"),
    ("selected.json deleted", lambda r: delete(r / "selected.json"), "selected.json"),
    ("selected.json garbage", lambda r: (r / "selected.json").write_bytes(b"\x00\x01garbage"), "selected.json"),
    ("anchor.json retention.correct edited",
     lambda r: edit_json(anchor_of(r), metric_up("retention.correct")), "anchor.json"),
    ("anchor.json deleted", lambda r: delete(anchor_of(r)), "anchor.json"),
    ("anchor.json cut short", lambda r: cut(anchor_of(r)), "anchor.json"),
]


def one_sentence(err: str, named: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "internal error" not in err and "Traceback" not in err, err
    assert named in lines[0], f"{named!r} not named: {lines[0]}"
    return lines[0]


def test_a_finished_run_verifies_and_its_report_names_the_digest_of_every_record(chain_runs):
    from opalctl.files import sha256_file
    from opalctl.formats import anchor_sha256, report_sha256

    run = chain_runs["base"] / "adamw" / "seed-1"
    result = call_cli("verify", run)
    assert result.code == 0 and result.stdout.startswith("ok: 1 run folder(s)"), result.output
    report = json.loads((run / "report.json").read_text())
    digests = report["digests"]
    assert digests["stages"] == {f"stage-0{n}.json": sha256_file(run / f"stage-0{n}.json") for n in (1, 2, 3, 4)}
    for name, key in (("start.json", "start"), ("training/steps.jsonl.gz", "steps"), ("last.json", "last"),
                      ("selected.json", "selected")):
        assert digests[key] == sha256_file(run / name), name
    anchor = json.loads(anchor_of(run).read_text())
    assert digests["anchor"] == anchor["sha256"] == anchor_sha256(anchor)
    assert digests["report"] == report_sha256(report) and isinstance(report["machine"], dict)
    for stage in report["stages"]:
        assert stage["anchor_sha256"] == anchor["sha256"]
        assert stage["checkpoint"]["sha256"] == sha256_file(run / stage["checkpoint"]["file"])
    result = call_cli("verify", chain_runs["lock"], "--runs", "--runs-dir", chain_runs["runs"], "--json")
    checked = json.loads(result.stdout)
    assert {Path(r["run_dir"]).parent.name: r["ok"] for r in checked["runs"]} == {"adamw": True, "paused": True}


@pytest.mark.parametrize("case, damage, named", CASES, ids=[c[0] for c in CASES])
def test_every_damaged_record_is_caught_by_verify_and_refused_by_show_and_compare_naming_the_file(
        copy, case, damage, named):
    run = copy.run()
    damage(run)
    verified = call_cli("verify", run)
    assert verified.code == 3, verified.output
    sentence, *details = verified.stderr.strip().splitlines()
    assert f"run {run} does not verify" in sentence and "internal error" not in verified.output
    assert details and all(line.startswith("  ") for line in details), verified.stderr
    assert any(named in line for line in details), verified.stderr
    as_json = call_cli("verify", run, "--json")
    assert as_json.code == 3 and any(named in f["file"] for f in json.loads(as_json.stdout)["findings"])
    shown = call_cli("show", run)
    assert shown.code in (1, 3) and shown.stdout == "", shown.output
    one_sentence(shown.stderr, named)
    compared = call_cli("compare", copy.lock, "--runs-dir", copy.runs)
    assert compared.code in (1, 3) and compared.stdout == "", compared.output
    one_sentence(compared.stderr, named)


def test_an_edited_record_is_exit_3_and_an_unreadable_one_exit_1(copy):
    run = copy.run()
    edit_json(run / "report.json", lambda v: metric_up()(v["stages"][0]))
    assert call_cli("compare", copy.lock, "--runs-dir", copy.runs).code == 3
    assert call_cli("show", run).code == 3
    cut(run / "report.json")
    assert call_cli("compare", copy.lock, "--runs-dir", copy.runs).code == 1
    assert call_cli("show", run).code == 1


def test_verify_names_each_mismatch_on_its_own_line(copy):
    run = copy.run()
    flip(run / "training" / "stage-02.pt")
    edit_json(run / "stage-03.json", metric_up())
    result = call_cli("verify", run)
    details = result.stderr.strip().splitlines()[1:]
    assert result.code == 3
    assert any("stage-02.pt: has sha256" in line for line in details)
    assert any("stage-02.pt: does not load" in line for line in details)
    assert any("stage-03.json: has sha256" in line for line in details)
    assert "(4 findings)" in result.stderr.splitlines()[0] or len(details) >= 3


def test_records_written_before_the_chain_still_read_and_verify_says_they_predate_it(copy):
    run = copy.run()
    for path in sorted(run.glob("stage-*.json")):
        edit_json(path, lambda v: v.pop("anchor_sha256"))
    edit_json(run / "report.json", lambda v: (v.pop("digests"), v.pop("machine"),
                                             [s.pop("anchor_sha256") for s in v["stages"]]))
    edit_json(anchor_of(run), lambda v: v.pop("sha256"))
    result = call_cli("verify", run, "--json")
    checked = json.loads(result.stdout)
    assert result.code == 0 and checked["ok"], result.output
    assert {note["file"] for note in checked["notes"] if "predates the chain" in note["problem"]} >= \
        {"report.json", "stage-01.json", "../../anchors/seed-1/anchor.json"}
    assert call_cli("show", run).code == 0
    assert call_cli("compare", copy.lock, "--runs-dir", copy.runs).code == 0


def test_verify_tells_a_run_folder_from_a_lock_and_refuses_a_folder_that_is_neither(copy, tmp_path):
    result = call_cli("verify", tmp_path)
    assert result.code == 2 and "is not a run folder" in result.stderr
    result = call_cli("verify", copy.run(), "--runs")
    assert result.code == 2 and "go with a lock file" in result.stderr
    flip(copy.run() / "initial.pt")
    result = call_cli("verify", copy.lock, "--runs", "--runs-dir", copy.runs)
    assert result.code == 3 and any("adamw/seed-1/initial.pt" in line for line in result.stderr.splitlines()[1:])


# -- --resume ---------------------------------------------------------------------------------------------------

def evaluator_of(copy, arm: str):
    """The evaluator of ``arm``'s run in this process (what ``run`` starts as its own process), opened."""
    import sys

    import torch

    from opalctl.driver.evaluator import Evaluator, Opening
    from opalctl.protocol.lock import read_lock

    threads = torch.get_num_threads()
    try:
        return Evaluator(Opening(lock=str(copy.lock), lock_sha256=read_lock(copy.lock).sha256, arm=arm, seed=1,
                                 run_dir=str(copy.run(arm)), anchor_dir=str(copy.base / "anchors" / "seed-1"),
                                 sys_path=list(sys.path)))
    finally:
        torch.set_num_threads(threads)  # the evaluator sets the lock's threads, for its own process


def carried_stages(run: Path):
    """What the training process tells the evaluator of the stages the resume checkpoint of ``run`` has passed
    (the records are the evaluator's files)."""
    from opalctl import checkpoints
    from opalctl.formats import CarriedStages

    resume = checkpoints.load(run / "training" / "resume.pt", require_finite=False)
    return CarriedStages(stages=resume["extra"]["stages"], update=resume["meta"]["update"])


RESUME_CASES = [
    ("stage-01.json garbage", lambda r: (r / "stage-01.json").write_bytes(b"{\"stage\": 1, \xff"), "stage-01.json", 1),
    ("stage-01.json metric edited", lambda r: edit_json(r / "stage-01.json", metric_up()), "stage-01.json", 3),
    ("stage-01.json decision edited", lambda r: edit_json(r / "stage-01.json", lambda v: v.update(promoted=True)),
     "stage-01.json", 3),
    ("stage-01.json a key added", lambda r: edit_json(r / "stage-01.json", lambda v: v.update(note="fine")),
     "stage-01.json", 3),
    ("stage-02.pt one byte flipped", lambda r: flip(r / "training" / "stage-02.pt"), "training/stage-02.pt", 3),
    ("stage-02.pt deleted", lambda r: delete(r / "training" / "stage-02.pt"), "training/stage-02.pt", 1),
]


@pytest.mark.parametrize("case, damage, named, code", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_the_evaluator_of_a_resume_refuses_a_damaged_or_edited_stage_record_or_checkpoint_naming_it(
        copy, case, damage, named, code):
    from opalctl.errors import OpalctlError

    run = copy.run("paused")
    stages = carried_stages(run)
    evaluator = evaluator_of(copy, "paused")
    damage(run)
    with pytest.raises(OpalctlError) as refused:
        evaluator.carried(stages)
    message = refused.value.message
    assert refused.value.exit_code == code and "\n" not in message and str(run / named) in message, message
    assert "move the run folder" in message or "restore it" in message, message


def test_the_evaluator_of_an_honest_resume_keeps_the_stage_records_as_they_were_written(copy):
    from opalctl.files import sha256_file
    from opalctl.formats import record_sha256

    run = copy.run("paused")
    evaluator = evaluator_of(copy, "paused")
    assert carried_stages(run).stages == 2
    evaluator.carried(carried_stages(run))
    assert [record_sha256(stage.to_json()) for stage in evaluator.stages] == \
        [sha256_file(run / f"stage-0{n}.json") for n in (1, 2)], "report.json's stages will be the stage files"


def test_resume_after_the_anchor_record_was_edited_is_refused_naming_it(copy):
    run = copy.run("paused")
    edit_json(anchor_of(run), metric_up("retention.correct"))  # 127 -> 132: another stage would be promoted
    before = json.loads(anchor_of(run).read_text())
    got, out, err = call_cli("run", copy.lock, "--arm", "paused", "--seed", "1", "--resume", "--runs-dir",
                              copy.runs)
    assert got == 3, err
    assert "no longer matches its digest" in one_sentence(err, str(anchor_of(run)))
    assert not (run / "report.json").exists() and json.loads(anchor_of(run).read_text()) == before


def test_a_later_arm_of_the_seed_is_never_judged_against_an_edited_anchor(copy):
    from opalctl.formats import RecordChanged

    edit_json(anchor_of(copy.run()), metric_up("retention.correct"))
    with pytest.raises(RecordChanged, match="anchor.json no longer matches its digest"):
        evaluator_of(copy, "fresh")


def test_an_anchor_record_written_before_the_chain_is_evaluated_again_before_it_is_used(copy):
    from opalctl.formats import RecordChanged, anchor_sha256

    anchor = anchor_of(copy.run())
    edit_json(anchor, lambda v: v.pop("sha256"))  # as an older opalctl wrote it
    evaluator = evaluator_of(copy, "fresh")
    assert evaluator.anchor_sha256 == anchor_sha256(json.loads(anchor.read_text()))
    edit_json(anchor, metric_up("retention.correct"))
    with pytest.raises(RecordChanged, match="metrics are not the parent's"):
        evaluator_of(copy, "fresh")
