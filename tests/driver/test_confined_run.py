"""An agent arm's ``opalctl run`` process is confined by the operating system (opalctl/sandbox.py) once its
evaluator and agent host are up: code running in the training process can no longer read an evaluation split,
reach the network, write outside its own folder of the run (``training/``; not beside the records of results) or
learn a stage's result while it trains, and the run still ends normally.

The code that probes runs where an agent's program would, in the training process, from a task's ``loss``; it
prints what each probe gave on standard error, since it can write nowhere else.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests import support

PROBING_TASK = '''
import json
import os
import socket
import sys

from opalctl.tasks.digits import Digits

DONE = []


def _probe(what, fn):
    try:
        fn()
        return "ok"
    except OSError as error:
        return type(error).__name__


def _read_split():
    with open(os.environ["PROBE_SPLIT"], "rb") as handle:
        handle.read(1)


def _connect():
    with socket.create_connection(("127.0.0.1", int(os.environ["PROBE_PORT"])), timeout=2):
        pass


def _write_outside():
    with open(os.environ["PROBE_OUTSIDE"], "w") as handle:
        handle.write("escaped")


def _write_beside_the_records():
    with open(os.environ["PROBE_RECORDS"], "w") as handle:
        handle.write("a record the evaluator never wrote")


class ProbingDigits(Digits):
    def loss(self, model, batch):
        if not DONE:
            DONE.append(True)
            found = {"read_split": _probe("read", _read_split), "connect": _probe("connect", _connect),
                     "write_outside": _probe("write", _write_outside),
                     "write_beside_the_records": _probe("write", _write_beside_the_records)}
            sys.stderr.write("PROBE " + json.dumps(found) + "\\n")
        return super().loss(model, batch)
'''


def test_an_agent_arms_training_process_reads_no_split_reaches_no_network_and_writes_only_its_run_folder(
        project, tmp_path):
    entry = project.task_module(PROBING_TASK, "ProbingDigits")
    agent = {**support.ADAMW, "agent": {"backend": "keep", "decisions": 1}}
    project.freeze(entry=entry, budget={"clock": "updates", "amount": 8}, arms={"adamw": support.ADAMW, "agent": agent})
    protocol = project.protocol()
    split = project.folder / protocol["data"]["development"]
    outside = tmp_path / "escaped.txt"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        env = dict(PROBE_SPLIT=str(split), PROBE_PORT=str(server.getsockname()[1]), PROBE_OUTSIDE=str(outside))
        plain = project.process(project.run_args("adamw", 1), env=project.env(
            **env, PROBE_RECORDS=str(project.run_dir("adamw", 1) / "probe.json")))
        confined = project.process(project.run_args("agent", 1), env=project.env(
            **env, PROBE_RECORDS=str(project.run_dir("agent", 1) / "probe.json")))
    assert plain.returncode == 0 and confined.returncode == 0, (plain.stderr[-2000:], confined.stderr[-2000:])

    def probes(result):
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("PROBE ")]
        return json.loads(line[len("PROBE "):])

    # the plain arm runs no agent code and is not confined: the same probes succeed there
    assert probes(plain) == {"read_split": "ok", "connect": "ok", "write_outside": "ok",
                             "write_beside_the_records": "ok"}
    outside.unlink()
    report = support.read(project.run_dir("agent", 1) / "report.json")
    confinement = report["confinement"]
    if confinement["mechanism"] == "none":
        pytest.skip(f"{support.SYSTEM_SKIP} Landlock ({confinement['reason']})")
    assert confinement["network_denied"] is True
    # it writes only training's own folder of the run: never the records of results beside it
    assert confinement["writable"] == [str(project.run_dir("agent", 1) / "training")]
    assert probes(confined) == {"read_split": "PermissionError", "connect": "PermissionError",
                                "write_outside": "PermissionError", "write_beside_the_records": "PermissionError"}
    assert not (project.run_dir("agent", 1) / "probe.json").exists()
    assert not outside.exists()
    # and the run ended as a run does: the evaluator judged every stage
    assert len(report["stages"]) == len(report["budget"]["fractions"]) and report["updates"] == 8
    # the training process of the agent arm was told no result while it trained; the plain arm was
    assert "stage 1/4 at update 2: judged (in stage-01.json)" in confined.stderr
    assert not any(word in confined.stderr for word in ("promoted", "kept anchor", "kept 1")), confined.stderr
    assert "stage 1/4 at update 2: promoted" in plain.stderr or "stage 1/4 at update 2: kept" in plain.stderr
