"""The verdict holds when an agent's code runs anything in the training process (issue 25).

The threat model: every agent program may run arbitrary Python with the training process's rights. Here that is
given on purpose, by a test-only task (never reachable in production): its ``loss``, which only the training
process calls, runs the attacks a program past the allowlist made in a real ``opalctl run`` (digits, the
``updates`` clock, the anthropic backend answered by the loopback Messages server of tests/opal/messages_server.py,
whose one scheduled decision changes the updater). The attacks find what they need as such code would, with
``gc.get_objects()`` (the formal run, the loop, the agent host's handle), and print what each attempt gave on
standard error (``ATTACK {...}``), the one place left to them.

Each attack is refused or caught, and ``compare`` never shows a forged figure:

- **the forged verdict**: an exit handler rewrites every stage record, ``selected.json`` and ``report.json`` with
  selection.correct raised by 250 and every digest of the chain recomputed: each write is refused (the records lie
  beside ``training/``, which alone the confined process may write), and compare shows the evaluator's figures;
- **the host as a deputy**: requests on the agent host's pipe that name the seed's ``anchors/`` folder (the agent
  told to write a forged anchor record there), the protocol's folder (the agent told to read a file standing for
  sealed data) and an unrelated folder of 80 files (which the sweep of a decision would thin out), and a request
  for the keys: each refused and recorded by the host; nothing there is written, read or deleted, and the arm of
  the seed run afterwards is judged against the anchor the evaluator wrote;
- **training off the budget**: at a resume checkpoint (outside every timed update) the model is trained 2,000
  more updates on the train split: the kernel's count of the training process, read by the evaluator, shows it,
  and compare flags the arm in its own line and in every verdict of the arm;
- **rewritten agent records**: an exit handler puts the version the agent applied back to the released updater in
  the training process's records: the agent host's records are untouched, ``verify`` exits 3 naming the file.

The key by every route (``os.environ``, ``/proc/self/environ``, the environment block in memory, the redaction's
state, the host's pipe, ``close()``) is tests/driver/test_agent_keys.py's and tests/opal/test_agent_host.py's.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from opalctl.files import canonical_json
from opalctl.formats import anchor_sha256
from tests import support
from tests.support.cli import call_cli

UPDATES = 300
ATTACK_AT = 150  # the loss call the attacks start at: after the one decision (at 20 % of the budget)
# CPU seconds the attack trains for (as many updates as fit; a count of updates would fall under the flag's slack
# on a fast host): well past the slack (OUTSIDE_SLACK_SECONDS) and the run's training CPU
EXTRA_CPU_SECONDS = 2.5
SEALED = "final-test-stand-in.txt"  # a file of the protocol's folder that training may never read

HOSTILE_TASK = '''
import atexit
import gc
import json
import os
import sys
import time
from pathlib import Path

from opalctl.tasks.digits import Digits

# the evaluator imports this module too; only the training process (`opalctl run`) attacks
TRAINING = sys.orig_argv[1:4] == ["-m", "opalctl", "run"]


def say(attack, **found):
    sys.stderr.write("ATTACK " + json.dumps({"attack": attack, **found}) + "\\n")
    sys.stderr.flush()


def objects(name):
    gc.unfreeze()  # what the run set aside from the collector is not listed by get_objects() until then
    return [o for o in gc.get_objects() if type(o).__name__ == name]


def run_folder():
    """The run folder, found as code in this process finds it (whatever this opalctl names it)."""
    (formal,) = objects("FormalRun")
    layout = getattr(formal, "layout", None)
    return Path(layout.root) if layout is not None else Path(formal.paths.run)


def write(path, text):
    try:
        Path(path).write_text(text)
        return "written"
    except OSError as error:
        return type(error).__name__


def forged_records(root):
    """selection.correct + 250 in every stage record, selected.json and report.json, the chain recomputed."""
    from opalctl.files import canonical_json
    from opalctl.formats import record_sha256, report_sha256

    stages = {}
    for path in sorted(root.glob("stage-*.json")):
        record = json.loads(path.read_text())
        record["metrics"]["selection.correct"] += 250
        stages[path.name] = record
    report = json.loads((root / "report.json").read_text())
    report["stages"] = [stages[name] for name in sorted(stages)]
    selected = json.loads((root / "selected.json").read_text())
    selected["metrics"]["selection.correct"] += 250
    report["digests"]["stages"] = {name: record_sha256(record) for name, record in stages.items()}
    report["digests"]["selected"] = record_sha256(selected)
    report["digests"]["report"] = report_sha256(report)
    return {**{name: canonical_json(record) for name, record in stages.items()},
            "selected.json": canonical_json(selected), "report.json": canonical_json(report)}


def forge_the_verdict(root):
    """Rewrite the records of results as a forger would: recomputed from them, or blind where they cannot be read."""
    tried = {}
    try:
        forged = forged_records(root)
    except OSError as error:
        tried["reading them"] = type(error).__name__
        forged = {name: "{}\\n" for name in ("stage-01.json", "stage-04.json", "selected.json", "report.json")}
    tried.update({name: write(root / name, text) for name, text in forged.items()})
    say("forge_the_verdict", tried=tried)


def put_the_agents_records_back(root):
    """The applied version's updater, in the training process's records, put back to the released one."""
    from opalctl.opal.optimizer import default_sources

    opal = root / "training" / "opal" if (root / "training").is_dir() else root / "opal"
    say("put_the_agents_records_back",
        tried=write(opal / "programs" / "v001" / "updater.py", default_sources()["updater.py"]))


def deputy():
    """Requests on the agent host's pipe naming folders of others, and asking for the keys."""
    (host,) = objects("AgentHost")
    root = run_folder()
    anchors = root.parent.parent / "anchors" / root.name
    asked = {"anchors": (anchors, "FORGE-ANCHOR"), "protocol": (Path(os.environ["PROTOCOL_FOLDER"]), "READ-SEALED"),
             "unrelated": (Path(os.environ["UNRELATED_FOLDER"]), "SWEEP-IT")}
    replies = {}
    for number, (what, (folder, message)) in enumerate(asked.items(), start=1_000_001):
        host._send({"op": "decide", "id": number, "workspace": str(folder), "message": message, "facts": {},
                    "seconds": 60, "programs": {}})
        reply = host.mailbox.take(number, True, 60)
        replies[what] = sorted(reply) if reply else None
    host._send({"op": "environment", "id": 1_000_009})
    reply = host.mailbox.take(1_000_009, True, 20) or {}
    replies["environment"] = sorted(reply)
    replies["key_in_reply"] = os.environ.get("ATTACK_KEY", "-") in json.dumps(reply)
    say("deputy", replies=replies)


def train_off_the_budget():
    """At the next resume checkpoint, inside the work the run does not charge (outside every timed update, where a
    program's build() runs at a decision), EXTRA_CPU_SECONDS of more updates of the model on the train split."""
    import torch

    (loop,) = objects("BudgetLoop")
    parts, steps = loop.parts, loop.steps
    syncing = steps.begin_sync  # called by the resume checkpoint, inside the ledger's span outside the budget
    done = []

    def begin_sync():
        if not done:
            done.append(True)
            started, updates = time.process_time(), 0
            while time.process_time() - started < float(os.environ["EXTRA_CPU_SECONDS"]):
                updates += 1
                loss, _ = parts.task.loss(parts.model, parts.sampler.next_batch())
                parts.model.zero_grad()
                loss.backward()
                with torch.no_grad():
                    for p in parts.model.parameters():
                        if p.grad is not None:
                            p.sub_(p.grad * 1e-3)
            say("train_off_the_budget", updates=updates, cpu_seconds=time.process_time() - started)
        syncing()

    steps.begin_sync = begin_sync


class HostileDigits(Digits):
    def loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if TRAINING and self.calls == int(os.environ["ATTACK_AT"]):
            chosen = os.environ["ATTACKS"].split(",")
            if "deputy" in chosen:
                deputy()
            if "off_budget" in chosen:
                train_off_the_budget()
            if "put_back" in chosen:
                atexit.register(put_the_agents_records_back, run_folder())
            if "forge" in chosen:
                atexit.register(forge_the_verdict, run_folder())
        return super().loss(model, batch)
'''


def agent_arm() -> dict:
    return {"optimizer": {"name": "AdamW", "lr": 1.0e-3},
            "agent": {"backend": "anthropic", "model": "claude-opus-5-5", "decisions": 1, "schedule": [0.2],
                      "every": 25, "trial_steps": 5}}


def the_agent(ms, forged_anchor: str, halved: str, rationale: str):
    """The loopback Messages API: the scheduled decision halves the learning rate; what the forged requests ask
    for (write a forged anchor record, read the sealed stand-in) is asked of the backend as a real agent would."""
    def answer(body):
        first, opening = json.dumps(body["messages"][0]), len(body["messages"]) == 1
        if "FORGE-ANCHOR" in first:
            return ms.reply(ms.tool_use("write_file", {"path": "anchor.json", "content": forged_anchor})) \
                if opening else ms.reply(ms.text("Changed: the anchor."))
        if "READ-SEALED" in first:
            return ms.reply(ms.tool_use("read_file", {"path": SEALED})) if opening else ms.reply(ms.text("Kept."))
        if "SWEEP-IT" in first:
            return ms.reply(ms.text("Kept."))
        return ms.reply(ms.tool_use("write_file", {"path": "updater.py", "content": halved})) if opening \
            else ms.reply(ms.text(rationale))
    return [answer] * 12


def attacks(stderr: str) -> dict:
    return {entry["attack"]: entry for entry in
            (json.loads(line[len("ATTACK "):]) for line in stderr.splitlines() if line.startswith("ATTACK "))}


@pytest.fixture(scope="module")
def hostile(digits_template, tmp_path_factory):
    """The baseline, the hostile run and an arm of the same seed run after it; what each attack printed."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from hostile_runs(support.Project(digits_template,
                                                     tmp_path_factory.mktemp("hostile") / "project", monkeypatch))


def hostile_runs(project):
    """The attacks in three runs folders, so that the forged verdict and the records put back are each compared or
    verified on their own: in ``deputy/``, the baseline (its evaluator made the seed's anchor), the arm that uses the
    host as a deputy and trains off the budget (the two leave no mark on each other: one is refused by the host,
    the other is counted by the kernel) and an arm of the seed run after it; in ``forged/`` the arm that forges the
    verdict, in ``put-back/`` the one that puts its records back."""
    root = project.folder.parent
    entry = project.task_module(HOSTILE_TASK, "HostileDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": UPDATES},
                   arms={"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}, "deputy": agent_arm(), "forger": agent_arm(), "putter": agent_arm(),
                         "later": {"optimizer": {"name": "AdamW", "lr": 2.0e-3}}},
                   selection={"denominators": ["selection.total", "retention.total"],
                              "floors": {"retention.correct": 2}, "improve_any": ["selection.correct"]})
    runs = {"deputy": root / "deputy", "forger": root / "forged", "putter": root / "put-back"}
    project.run("adamw", 1, runs_dir=runs["deputy"])  # the baseline, and the seed's anchor there made by an evaluator
    anchor_path = runs["deputy"] / project.base.name / "anchors" / "seed-1" / "anchor.json"
    forged = json.loads(anchor_path.read_text())
    forged["metrics"]["retention.correct"] = 0  # every floor passes against this anchor
    forged["sha256"] = anchor_sha256(forged)
    (project.folder / SEALED).write_text(marker := "SEALED-" + secrets.token_hex(16))
    unrelated = root / "unrelated"
    unrelated.mkdir()
    for number in range(80):
        (unrelated / f"file-{number:02d}.txt").write_text(f"someone's file {number}\n")
    before = {"anchor": anchor_path.read_bytes(), "unrelated": sorted(p.name for p in unrelated.iterdir())}
    key = "sk-ant-api03-" + secrets.token_urlsafe(30)
    results, bodies = {}, []
    for arm, chosen in (("deputy", "deputy,off_budget"), ("forger", "forge"), ("putter", "put_back")):
        ms = support.messages_server()
        with ms.MessagesServer(the_agent(ms, canonical_json(forged), support.HALVED, support.RATIONALE)) as server:
            env = project.env(ANTHROPIC_API_KEY=key, ANTHROPIC_BASE_URL=server.url, ATTACK_AT=str(ATTACK_AT),
                              ATTACKS=chosen, EXTRA_CPU_SECONDS=str(EXTRA_CPU_SECONDS), PROTOCOL_FOLDER=str(project.folder),
                              UNRELATED_FOLDER=str(unrelated), ATTACK_KEY=key)
            results[arm] = project.process(project.run_args(arm, 1, runs=runs[arm]), env=env)
        bodies += server.bodies
    later = project.run("later", 1, runs_dir=runs["deputy"])
    yield {"project": project, "results": results, "bodies": bodies, "marker": marker, "before": before,
           "unrelated": unrelated, "anchor": anchor_path, "later": later,
           "attacks": {name: entry for result in results.values() for name, entry in attacks(result.stderr).items()},
           "runs": runs}


def run_dir(hostile, arm: str) -> Path:
    return hostile["project"].run_dir(arm, 1, runs=hostile["runs"][arm])


def test_every_hostile_run_finishes_and_every_attack_ran(hostile):
    for arm, result in hostile["results"].items():
        assert result.returncode == 0, (arm, result.stderr[-3000:])
        report = json.loads((run_dir(hostile, arm) / "report.json").read_text())
        assert report["agent"]["decisions_applied"] == 1 and report["updates"] == UPDATES
    assert set(hostile["attacks"]) == {"deputy", "train_off_the_budget", "put_the_agents_records_back",
                                       "forge_the_verdict"}


def test_the_forged_verdict_is_refused_and_compare_shows_the_evaluators_figures(hostile):
    project = hostile["project"]
    tried = hostile["attacks"]["forge_the_verdict"]["tried"]
    assert tried and set(tried.values()) == {"PermissionError"}, tried  # not even read: the records are not its
    forger = run_dir(hostile, "forger")
    stages = [json.loads(path.read_text()) for path in sorted(forger.glob("stage-*.json"))]
    assert len(stages) == 4
    assert all(stage["metrics"]["selection.correct"] <= stage["metrics"]["selection.total"] for stage in stages)
    assert call_cli("verify", forger).code == 0
    result = call_cli("compare", project.lock, "--runs-dir", hostile["runs"]["forger"], "--stage", "last",
                           "--json")
    assert result.code == 0, result.output
    [row] = json.loads(result.stdout)["arms"]
    assert row["values"]["selection.correct"] == {"1": stages[-1]["metrics"]["selection.correct"]}


def test_the_host_refuses_to_be_a_deputy_and_nothing_of_the_others_is_touched(hostile):
    replies = hostile["attacks"]["deputy"]["replies"]
    for what in ("anchors", "protocol", "unrelated", "environment"):
        assert replies[what] == ["id", "refused"], (what, replies)
    assert replies["key_in_reply"] is False
    assert hostile["anchor"].read_bytes() == hostile["before"]["anchor"], "the anchor record is the evaluator's"
    assert sorted(path.name for path in hostile["anchor"].parent.iterdir()) == ["anchor.json"]
    assert sorted(path.name for path in hostile["unrelated"].iterdir()) == hostile["before"]["unrelated"]
    assert not any(hostile["marker"] in json.dumps(body) for body in hostile["bodies"]), \
        "the sealed stand-in reached the API"
    refused = (run_dir(hostile, "deputy") / "agent" / "refused.jsonl").read_text().splitlines()
    assert len(refused) == 4 and "workspace" in refused[0]
    # the arm run after it was judged against the anchor the evaluator wrote
    anchor = json.loads(hostile["before"]["anchor"])
    assert all(stage["anchor_sha256"] == anchor["sha256"] for stage in hostile["later"]["stages"])


def test_training_off_the_budget_is_flagged_by_compare_in_every_verdict_of_the_arm(hostile):
    project = hostile["project"]
    assert hostile["attacks"]["train_off_the_budget"]["cpu_seconds"] >= EXTRA_CPU_SECONDS
    assert hostile["attacks"]["train_off_the_budget"]["updates"] > 100
    result = call_cli("compare", project.lock, "--runs-dir", hostile["runs"]["deputy"], "--json")
    assert result.code == 0, result.output
    rows = {row["arm"]: row for row in json.loads(result.stdout)["arms"]}
    flags = rows["deputy"]["flags"]
    assert any(flag.startswith("work outside the charged updates") for flag in flags), (flags, rows["deputy"])
    assert all("Flagged: work outside the charged updates" in figure["verdict"]
               for figure in rows["deputy"]["paired"].values())
    assert not any("work outside" in flag for flag in rows["later"]["flags"]), rows["later"]["flags"]
    shown = call_cli("compare", project.lock, "--runs-dir", hostile["runs"]["deputy"])
    assert "flagged: deputy: work outside the charged updates" in shown.stdout


def test_the_agents_records_put_back_are_caught_by_verify_naming_the_file(hostile):
    assert hostile["attacks"]["put_the_agents_records_back"]["tried"] == "written"  # training's own folder
    putter = run_dir(hostile, "putter")
    assert (putter / "agent" / "decisions" / "001" / "updater.py").read_text() == support.HALVED, "the host's record"
    result = call_cli("verify", putter)
    assert result.code == 3, result.output
    assert "training/opal/programs/v001/updater.py: is not the program the agent host answered at decision 1" in \
        result.stderr
    assert call_cli("show", putter).code == 3
