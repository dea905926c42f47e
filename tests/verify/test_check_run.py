"""The chain's checks (``opalctl/verify/chain.py``) over small run folders built on disk here, without a formal run:
a clean folder has no finding, and each check catches its own damage, naming the file and the kind of finding.

``write_run`` writes the records of a finished two-stage run as opalctl does, every digest sealed: ``edit`` changes
the records before the report's digests are sealed (a forger who recomputes them), a change to a file after it is
written is a damage the digests alone catch.
"""

from __future__ import annotations

import copy
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opalctl.files import canonical_json, sha256_bytes
from opalctl.formats import RunDigests, anchor_sha256, report_sha256, step_line
from opalctl.layout import RunLayout
from opalctl.verify.chain import (
    CHANGED,
    DAMAGED,
    NOTE,
    AgentRecords,
    Finding,
    check_agent_records,
    check_run,
    failures,
)
from opalctl.verify.folder import read_run_folder

LOCK_SHA256 = "1" * 64
ANCHOR = "../../anchors/seed-1/anchor.json"  # the anchor record, as a finding names it from the run folder
FRACTIONS = [0.5, 1.0]
UPDATES_PER_STAGE = 2


def _sha(data: bytes) -> str:
    return sha256_bytes(data)


def records_of(layout: RunLayout, promoted: tuple[bool, ...] = (False, True)) -> dict[str, Any]:
    """The records, checkpoints and steps lines of a finished run with one stage per entry of ``promoted``."""
    initial = b"the parent's weights"
    anchor = {"lock_sha256": LOCK_SHA256, "seed": 1, "parent": {"path": "parents/seed-1.pt", "sha256": _sha(initial)},
              "data": {"data.train": "2" * 64}, "model_sha256": "m0", "metrics": {"loss": 2.0},
              "eval_seconds": 0.5, "format": 1}
    start = {"lock": "demo.lock.json", "lock_sha256": LOCK_SHA256, "protocol": "demo", "arm": "adamw", "seed": 1,
             "budget": {"clock": "updates", "total": UPDATES_PER_STAGE * len(promoted), "fractions": FRACTIONS,
                        "threads": 1},
             "initial": {"file": layout.name_of(layout.initial), "sha256": _sha(initial), "model_sha256": "m0"},
             "anchor": {"folder": "../../anchors/seed-1", "model_sha256": "m0"}, "format": 1}
    checkpoints = {layout.name_of(layout.initial): initial}
    stages, incumbent = [], "anchor"
    for number, promotes in enumerate(promoted, start=1):
        weights = f"the weights at stage {number}".encode()
        name = layout.name_of(layout.stage_checkpoint(number))
        checkpoints[name] = weights
        after = number if promotes else incumbent
        stages.append({
            "stage": number, "fraction": FRACTIONS[number - 1], "update": UPDATES_PER_STAGE * number,
            "budget_used": float(UPDATES_PER_STAGE * number), "budget_fraction_used": FRACTIONS[number - 1],
            "examples": 8 * number, "train_cpu_seconds": 0.1, "train_wall_seconds": 0.1,
            "checkpoint": {"file": name, "sha256": _sha(weights), "model_sha256": f"m{number}",
                           "bytes": len(weights)},
            "metrics": {"loss": 2.0 - number / 10}, "eval_seconds": 0.2, "incumbent_before": incumbent,
            "decision": {"promoted": promotes}, "promoted": promotes, "incumbent_after": after,
            "shared_state_with": [], "loss": 1.5, "format": 1})
        incumbent = after
    final = stages[-1]
    last = {"stage": final["stage"], "update": final["update"], **final["checkpoint"]}
    chosen = next((stage for stage in stages if stage["stage"] == incumbent), None)
    selected = ({"source": "anchor", "stage": None, "flagged": True,
                 "checkpoint": {"file": "parents/seed-1.pt", "sha256": _sha(initial), "model_sha256": "m0"},
                 "metrics": anchor["metrics"], "reason": "no stage was promoted"} if chosen is None else
                {"source": "stage", "stage": chosen["stage"], "flagged": False,
                 "checkpoint": {key: chosen["checkpoint"][key] for key in ("file", "sha256", "model_sha256")},
                 "metrics": chosen["metrics"], "reason": None})
    updates = final["update"]
    steps = [step_line(update, 1.0, float(update), 0.01, 1.5, f"r{update}", f"s{update}", False)
             for update in range(1, updates + 1)]
    report = {"lock_sha256": LOCK_SHA256, "protocol": "demo", "arm": "adamw", "seed": 1,
              "budget": copy.deepcopy(start["budget"]), "updates": updates, "examples_seen": 8 * len(promoted),
              "rows_digest": f"s{updates}", "seconds": {"train_wall": 1.0}, "peak_memory_bytes": 1,
              "parameter_change": {}, "promoted_stages": [s["stage"] for s in stages if s["promoted"]],
              "selected": {key: selected[key] for key in ("source", "stage", "flagged")},
              "final_model_sha256": final["checkpoint"]["model_sha256"], "anchor_metrics": anchor["metrics"],
              "agent": None, "resumes": 0, "nonfinite_losses": 0, "limitations": [], "format": 1}
    return {"start": start, "anchor": anchor, "stages": stages, "last": last, "selected": selected,
            "report": report, "checkpoints": checkpoints, "steps": steps}


def write_run(root: Path, edit: Callable[[dict[str, Any]], None] | None = None,
              promoted: tuple[bool, ...] = (False, True)) -> RunLayout:
    """A finished run's folder under ``root`` (``runs/demo-111111111111/adamw/seed-1``), its anchor beside it."""
    layout = RunLayout(root / "runs" / "demo-111111111111" / "adamw" / "seed-1")
    layout.training.mkdir(parents=True)
    layout.anchor.record.parent.mkdir(parents=True)
    records = records_of(layout, promoted)
    if edit is not None:
        edit(records)
    records["anchor"].setdefault("sha256", anchor_sha256(records["anchor"]))  # unless the edit named one
    for stage in records["stages"]:
        stage.setdefault("anchor_sha256", records["anchor"]["sha256"])
        if stage["anchor_sha256"] is None:  # a stage record written before the chain has no such key
            del stage["anchor_sha256"]
    records["report"].setdefault("stages", copy.deepcopy(records["stages"]))  # the stage records, as sealed

    def write(path: Path, value: Any) -> bytes:
        data = canonical_json(value).encode()
        path.write_bytes(data)
        return data

    for name, data in records["checkpoints"].items():
        layout.path_of(name).write_bytes(data)
    steps = gzip.compress("".join(line + "\n" for line in records["steps"]).encode())
    layout.steps.write_bytes(steps)
    write(layout.anchor.record, records["anchor"])
    digests = RunDigests(start=_sha(write(layout.start, records["start"])), steps=_sha(steps),
                         stages={layout.stage_record(n).name: _sha(write(layout.stage_record(n), stage))
                                 for n, stage in enumerate(records["stages"], start=1)},
                         last=_sha(write(layout.last, records["last"])),
                         selected=_sha(write(layout.selected, records["selected"])),
                         anchor=anchor_sha256(records["anchor"]))
    report = {**records["report"], "digests": digests.to_json()}
    report["digests"]["report"] = report_sha256(report)
    write(layout.report, report)
    return layout


def findings_of(layout: RunLayout, **options) -> list[Finding]:
    return check_run(read_run_folder(layout.root, load_checkpoints=False), **options)


def rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """A record edited after it was written (its digests left as they were)."""
    value = json.loads(path.read_text())
    change(value)
    path.write_text(canonical_json(value))


def has(findings: list[Finding], file: str, kind: str, clause: str) -> bool:
    return any(f.file == file and f.kind == kind and clause in f.problem for f in findings)


def test_a_clean_folder_has_no_finding(tmp_path):
    assert findings_of(write_run(tmp_path)) == []
    assert findings_of(write_run(tmp_path / "anchor", promoted=(False, False))) == []


def test_a_clean_folder_checked_against_its_lock_has_no_finding_and_against_another_lock_one(tmp_path):
    layout = write_run(tmp_path)
    assert findings_of(layout, lock_sha256=LOCK_SHA256) == []
    assert has(findings_of(layout, lock_sha256="9" * 64), "start.json", CHANGED, "names lock 111111111111")


# (what is done to the folder, the file named, the kind, a clause of the finding): each check of the chain once
FILE_DAMAGES = {
    "a missing start record": (lambda run: run.start.unlink(), "start.json", DAMAGED, "is missing"),
    "a start record that is no JSON": (lambda run: run.start.write_text("{"), "start.json", DAMAGED, "is not JSON"),
    "a start record of another shape": (lambda run: rewrite(run.start, lambda v: v.pop("arm")), "start.json", DAMAGED,
                                        "lacks arm"),
    "a missing initial checkpoint": (lambda run: run.initial.unlink(), "initial.pt", DAMAGED,
                                     "is missing (start.json names it)"),
    "a forged stage checkpoint": (lambda run: run.stage_checkpoint(2).write_bytes(b"other weights"),
                                  "training/stage-02.pt", CHANGED, "stage-02.json records"),
    "a missing stage record": (lambda run: run.stage_record(1).unlink(), "stage-01.json", DAMAGED,
                               "is missing (stage 2's record is there)"),
    "an edited stage record": (lambda run: rewrite(run.stage_record(1), lambda v: v["metrics"].update(loss=0.1)),
                               "stage-01.json", CHANGED, "report.json records"),
    "a stage record added after the run": (lambda run: run.stage_record(3).write_bytes(run.stage_record(2).read_bytes()),
                                           "stage-03.json", CHANGED, "is not a record the report names"),
    "an edited anchor record": (lambda run: rewrite(run.anchor.record, lambda v: v["metrics"].update(loss=9.0)),
                                ANCHOR, CHANGED, "no longer matches its digest"),
    "a missing anchor record": (lambda run: run.anchor.record.unlink(), ANCHOR, DAMAGED,
                                "is missing (the stages were judged against it)"),
    "a missing steps file": (lambda run: run.steps.unlink(), "training/steps.jsonl.gz", DAMAGED, "is missing"),
    "a steps file cut short": (lambda run: run.steps.write_bytes(gzip.compress(b'{"update":1,"seen":"s1"}\n')),
                               "training/steps.jsonl.gz", CHANGED, "holds 1 complete lines, and stage 2"),
    "a steps file that is no gzip": (lambda run: run.steps.write_bytes(b"plain text"), "training/steps.jsonl.gz",
                                     DAMAGED, "holds no complete gzip member"),
    "a steps file of lines numbered out of turn": (
        lambda run: run.steps.write_bytes(gzip.compress(b"".join(b'{"update":%d}\n' % n for n in (1, 3, 2, 4)))),
        "training/steps.jsonl.gz", CHANGED, "not numbered 1, 2, ... in turn"),
    "an edited last record": (lambda run: rewrite(run.last, lambda v: v.update(stage=1)), "last.json", CHANGED,
                              "does not name stage 2's checkpoint"),
    "a missing last record": (lambda run: run.last.unlink(), "last.json", DAMAGED, "is missing"),
    "an edited selected record": (lambda run: rewrite(run.selected, lambda v: v.update(stage=1)), "selected.json",
                                  CHANGED, "does not select stage 2"),
    "an edited figure of the report": (lambda run: rewrite(run.report, lambda v: v.update(updates=99)), "report.json",
                                       CHANGED, "no longer matches its own digest"),
    "a report whose digests were removed": (lambda run: rewrite(run.report, lambda v: v.pop("digests")), "report.json",
                                            CHANGED, "lacks the digests of the chain"),
    "a report whose digests are of another shape": (
        lambda run: rewrite(run.report, lambda v: v["digests"].pop("start")), "report.json", DAMAGED,
        "holds digests that are not of their shape"),
}


@pytest.mark.parametrize("damage, file, kind, clause", FILE_DAMAGES.values(), ids=FILE_DAMAGES.keys())
def test_each_damaged_file_is_found_naming_it(tmp_path, damage, file, kind, clause):
    layout = write_run(tmp_path)
    damage(layout)
    findings = findings_of(layout)
    assert has(findings, file, kind, clause), [f.to_json() for f in findings]


def _stage(number: int, **values) -> Callable[[dict[str, Any]], None]:
    return lambda records: records["stages"][number - 1].update(values)


# records forged before the report was sealed (every digest recomputed): what the records say must agree
FORGED = {
    "a stage out of order": (lambda r: r["stages"].reverse(), "stage-01.json", "holds the record of stage 2"),
    "a stage at another fraction": (_stage(1, fraction=0.25), "stage-01.json", "is at fraction 0.25"),
    "a stage decided against another incumbent": (_stage(2, incumbent_before=1), "stage-02.json",
                                                  "was decided against incumbent 1"),
    "a promotion its decision denies": (_stage(2, decision={"promoted": False}), "stage-02.json",
                                        "its promotion, decision and incumbent disagree"),
    "a stage naming another checkpoint": (
        _stage(1, checkpoint={"file": "training/stage-02.pt", "sha256": "0", "model_sha256": "m1", "bytes": 1}),
        "stage-01.json", "names checkpoint 'training/stage-02.pt', not its own"),
    "a stage judged against another anchor": (_stage(1, anchor_sha256="3" * 64), "stage-01.json",
                                              "was judged against anchor 333333333333"),
    "a start record naming another initial checkpoint": (
        lambda r: r["start"]["initial"].update(sha256="4" * 64), "initial.pt", "start.json records 444444444444"),
    "an anchor made from another lock": (lambda r: r["anchor"].update(lock_sha256="5" * 64), ANCHOR,
                                         "was made from lock 555555555555"),
    "an anchor of another parent": (lambda r: r["start"]["anchor"].update(model_sha256="m9"), ANCHOR,
                                    "is of another parent model"),
    "a report listing other stages": (lambda r: r["report"].update(stages=[]), "report.json",
                                      "lists stages that are not the stage records"),
    "a report listing other promotions": (lambda r: r["report"].update(promoted_stages=[1, 2]), "report.json",
                                          "lists promoted stages that are not"),
    "a report selecting another model": (lambda r: r["report"]["selected"].update(stage=1), "report.json",
                                         "selects another model than selected.json"),
    "a report naming another final model": (lambda r: r["report"].update(final_model_sha256="m1"), "report.json",
                                            "names another final model"),
    "a report with other anchor metrics": (lambda r: r["report"].update(anchor_metrics={"loss": 1.0}),
                                           "report.json", "holds anchor metrics that are not the anchor record's"),
    "a report of another arm": (lambda r: r["report"].update(arm="other"), "report.json",
                                "names another lock, arm or seed than start.json"),
    "a report counting other updates": (lambda r: r["report"].update(updates=3), "report.json",
                                        "counts 3 updates, training/steps.jsonl.gz holds 4"),
    "a selected record holding other metrics": (lambda r: r["selected"].update(metrics={"loss": 0.0}),
                                                "selected.json", "does not hold stage 2's checkpoint and metrics"),
}


@pytest.mark.parametrize("forge, file, clause", FORGED.values(), ids=FORGED.keys())
def test_each_forged_record_is_found_with_every_digest_recomputed(tmp_path, forge, file, clause):
    findings = findings_of(write_run(tmp_path, edit=forge))
    assert has(findings, file, CHANGED, clause), [f.to_json() for f in findings]


def test_an_anchor_selected_run_must_say_so_flagged(tmp_path):
    layout = write_run(tmp_path, promoted=(False, False))
    rewrite(layout.selected, lambda v: v.update(flagged=False))
    assert has(findings_of(layout), "selected.json", CHANGED, "selects a stage, and no stage was promoted")


def test_records_written_before_the_chain_are_notes_never_failures(tmp_path):
    def before_the_chain(records):
        records["anchor"]["sha256"] = None
        for stage in records["stages"]:
            stage["anchor_sha256"] = None

    layout = write_run(tmp_path, edit=before_the_chain)
    rewrite(layout.report, lambda v: v.pop("digests"))
    findings = findings_of(layout)
    assert failures(findings) == [] and findings
    assert has(findings, ANCHOR, NOTE, "predates the chain of digests")
    assert has(findings, "stage-01.json", NOTE, "predates the chain of digests")
    assert has(findings, "report.json", NOTE, "predates the chain of digests")


def test_an_unfinished_folder_is_checked_as_far_as_it_goes(tmp_path):
    layout = write_run(tmp_path)
    layout.report.unlink()
    assert has(findings_of(layout), "report.json", DAMAGED, "is missing, and last.json or selected.json says")
    layout.last.unlink()
    layout.selected.unlink()
    assert has(findings_of(layout), "report.json", NOTE, "there is no resume checkpoint")
    layout.resume.write_bytes(b"a resume checkpoint")
    assert findings_of(layout) == []
    layout.anchor.record.unlink()  # a run folder copied alone: its anchor is not required there
    assert [f.kind for f in findings_of(layout, anchor_required=False)] == [NOTE]
    assert has(findings_of(layout), ANCHOR, DAMAGED, "is missing")


def _agent(applied: dict[int, int], answered: dict[int, dict[str, str] | None],
           loaded: dict[int, dict[str, str | None]]) -> AgentRecords:
    return AgentRecords(answered=answered, outcomes={d: ("applied", v) for d, v in applied.items()}, loaded=loaded,
                        events="training/opal/events.jsonl", programs="training/opal/programs")


def test_the_agents_programs_are_the_ones_its_host_answered():
    answered = {1: {"updater.py": "a1"}, 2: {"updater.py": "a2"}}
    assert check_agent_records(_agent({1: 1, 2: 2}, answered, {1: {"updater.py": "a1"},
                                                                2: {"updater.py": "a2"}})) == []
    put_back = check_agent_records(_agent({1: 1, 2: 2}, answered, {1: {"updater.py": "a1"},
                                                                    2: {"updater.py": "released"}}))
    assert put_back == [Finding("training/opal/programs/v002/updater.py",
                                "is not the program the agent host answered at decision 2")]
    gone = check_agent_records(_agent({1: 1}, {1: {"updater.py": "a1"}}, {1: {"updater.py": None}}))
    assert gone == [Finding("training/opal/programs/v001/updater.py", "is missing")]
    unanswered = check_agent_records(_agent({3: 1}, {}, {}))
    assert has(unanswered, "training/opal/events.jsonl", CHANGED, "recorded no programs answered at it")
    untold = check_agent_records(_agent({}, {1: {"updater.py": "a1"}}, {}))
    assert untold == [Finding("training/opal/events.jsonl", "says nothing of decision 1, which the agent host "
                                                            "answered", NOTE)]
