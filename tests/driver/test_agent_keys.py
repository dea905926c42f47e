"""The key of an agent arm's backend never enters the training process of an ``opalctl run``, and the agent host's
record of each decision is out of the training process's reach; ``show`` and the report page read the host's.

A real ``python -m opalctl run`` of an agent arm (digits, ``updates`` clock, 300 updates, the anthropic backend
against the loopback Messages server of tests/opal/messages_server.py) is started with
``ANTHROPIC_API_KEY=sk-ant-api03-<40 random characters>`` in its environment. A probe where an agent's program would
run, in the training process (a task module's ``loss``, as tests/driver/test_confined_run.py's), writes into
``training/probe/`` what such code can find: ``os.environ``, ``/proc/self/environ`` (when the task was imported,
before the confinement, and now), the strings libc's ``environ`` points at and a stretch of the stack around them
(the initial environment block, read with ``ctypes.string_at``), and every ``Redaction`` object of the process
(``gc.get_objects``). The key, reversed or in pieces, is in none of them; the run finishes, and its host had the
key (the server saw it). The probe also tries to rewrite the host's records from the training process: refused.

A second run, in this process, has its training process's records rewritten after the fact (events, programs,
decision meta): the host's records are untouched, and ``show`` and the report page show what the host recorded.
"""

from __future__ import annotations

import json
import secrets
import string

from tests import support
from tests.support.cli import call_cli

UPDATES = 300

PROBING_TASK = '''
import ctypes
import gc
import json
import os
import sys
from pathlib import Path

from opalctl.opal.records import Redaction
from opalctl.tasks.digits import Digits

# the evaluator imports this module too; only the training process (`opalctl run`, re-executed) probes
TRAINING = sys.orig_argv[1:4] == ["-m", "opalctl", "run"]


def _stack():
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[stack]"):
            low, high = line.split()[0].split("-")
            return int(low, 16), int(high, 16)
    raise RuntimeError("no [stack] in /proc/self/maps")


def _read(path):
    try:
        return Path(path).read_bytes()
    except OSError as error:
        return ("refused: " + type(error).__name__).encode()


if TRAINING:  # before the confinement: what /proc said when the task was imported
    STACK = _stack()
    ENVIRON_AT_IMPORT = _read("/proc/self/environ")


def _environ_block():
    """The addresses and strings libc's environ points at (the initial block's, for every variable not set since)."""
    libc = ctypes.CDLL(None)
    array = ctypes.cast(ctypes.c_void_p.in_dll(libc, "environ").value, ctypes.POINTER(ctypes.c_void_p))
    found, index = [], 0
    while array[index]:
        found.append((array[index], ctypes.string_at(array[index])))
        index += 1
    return found


def _probe(out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "environ.json").write_text(json.dumps(dict(os.environ)))
    (out / "proc-environ-at-import.bin").write_bytes(ENVIRON_AT_IMPORT)
    (out / "proc-environ-now.bin").write_bytes(_read("/proc/self/environ"))
    block = _environ_block()
    low, high = STACK
    in_stack = [address for address, _ in block if low <= address < high]
    start = max(low, min(in_stack) - (1 << 18)) if in_stack else low
    (out / "stack.bin").write_bytes(ctypes.string_at(start, high - start))
    (out / "environ-block.json").write_text(json.dumps({
        "strings": [text.decode("utf-8", "replace") for _, text in block], "in_stack": len(in_stack),
        "scanned": [start, high]}))
    gc.unfreeze()  # what the run's loop set aside from the collector is not listed by get_objects() until then
    found = [{"type": type(o).__module__ + "." + type(o).__qualname__, "holds_secrets": bool(o.holds_secrets),
              "state": repr(vars(o))} for o in gc.get_objects() if isinstance(o, Redaction)]
    (out / "redactions.json").write_text(json.dumps(found))


def _rewrite_the_hosts_records(out, run):
    tried = {}
    for name in ("decisions/001/response.md", "decisions/001/updater.py", "forged.txt"):
        try:
            with open(run / "agent" / name, "a", encoding="utf-8") as handle:
                handle.write("forged by the training process")
            tried[name] = "written"
        except OSError as error:
            tried[name] = type(error).__name__
    (out / "rewrite.json").write_text(json.dumps(tried))


class ProbingDigits(Digits):
    def loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if TRAINING and self.calls in (1, int(os.environ["PROBE_REWRITE_AT"])):
            out = Path(os.environ["PROBE_OUT"])
            if self.calls == 1:
                _probe(out)
            else:
                _rewrite_the_hosts_records(out, out.parent.parent)
        return super().loss(model, batch)
'''


def anthropic_key() -> str:
    alphabet = string.ascii_letters + string.digits + "_-"
    return "sk-ant-api03-" + "".join(secrets.choice(alphabet) for _ in range(40))


def forms_of(key: str) -> list[bytes]:
    """The key, reversed, and every 12-character piece of its random part, either way round."""
    random_part = key[len("sk-ant-api03-"):]
    found = [key, key[::-1]]
    found += [text[i:i + 12] for text in (random_part, random_part[::-1]) for i in range(len(text) - 11)]
    return [text.encode() for text in found]


def agent_arm() -> dict:
    return {"optimizer": {"name": "AdamW", "lr": 1.0e-3},
            "agent": {"backend": "anthropic", "model": "claude-opus-5-5", "decisions": 1, "schedule": [0.5],
                      "every": 25, "trial_steps": 5}}


def test_an_opalctl_run_keeps_the_key_out_of_its_training_process_and_its_host_has_it(project):
    key = anthropic_key()
    entry = project.task_module(PROBING_TASK, "ProbingDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": UPDATES}, arms={"agent": agent_arm()})
    run_dir = project.run_dir("agent", 1)
    out = run_dir / "training" / "probe"
    ms = support.messages_server()
    script = [ms.reply(ms.tool_use("write_file", {"path": "updater.py", "content": support.HALVED})),
              ms.reply(ms.text(support.RATIONALE + f"\n(my key: {key})"))]
    with ms.MessagesServer(script) as server:
        env = project.env(ANTHROPIC_API_KEY=key, ANTHROPIC_BASE_URL=server.url, PROBE_OUT=str(out),
                          PROBE_REWRITE_AT=str(UPDATES - 20))
        result = project.process(project.run_args("agent", 1), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # the run finished, and its agent host had the key: the server saw it on every request
    report = support.read(run_dir / "report.json")
    assert report["updates"] == UPDATES and report["agent"]["decisions_applied"] == 1
    assert len(server.requests) == 2
    assert all(key in r["headers"].get("x-api-key", "") + r["headers"].get("authorization", "")
               for r in server.requests)

    # what code in the training process finds: no key, however it looks
    dumped = {path.name: path.read_bytes() for path in out.iterdir()}
    assert sorted(dumped) == ["environ-block.json", "environ.json", "proc-environ-at-import.bin",
                              "proc-environ-now.bin", "redactions.json", "rewrite.json", "stack.bin"]
    for name, data in dumped.items():
        for form in forms_of(key):
            assert form not in data, f"{form!r} of the key is in the training process's {name}"
    environ = json.loads(dumped["environ.json"])
    assert "ANTHROPIC_API_KEY" not in environ and "PROBE_OUT" in environ
    block = json.loads(dumped["environ-block.json"])
    assert block["in_stack"] > 0 and any(text.startswith("PROBE_OUT=") for text in block["strings"])
    assert b"PROBE_OUT=" in dumped["stack.bin"], "the scan covered the initial environment block"
    assert b"PROBE_OUT=" in dumped["proc-environ-at-import.bin"], "/proc/self/environ was read at import"
    redactions = json.loads(dumped["redactions.json"])
    assert redactions and all(r == {"type": "opalctl.opal.records.Redaction", "holds_secrets": False, "state": "{}"}
                              for r in redactions), redactions

    # the host's records are its own: the training process could not write them (where Landlock confines it)
    rewrite = json.loads(dumped["rewrite.json"])
    if report["confinement"]["mechanism"] == "landlock":
        assert set(rewrite.values()) == {"PermissionError"}, rewrite
        assert "forged" not in (run_dir / "agent" / "decisions" / "001" / "response.md").read_text()
    # and the key reached no file of the run
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix != ".gz":
            data = path.read_bytes()
            assert not any(form in data for form in forms_of(key)), path


# -- the host's records against a rewriting training process ----------------------------------------------------------

def test_a_training_process_that_rewrites_its_records_changes_neither_the_hosts_nor_what_show_shows(
        project, tmp_path):
    project.freeze(budget={"clock": "updates", "amount": 200},
                   arms={"agent": {"optimizer": {"name": "AdamW", "lr": 1.0e-3},
                                   "agent": {"backend": "heuristic", "decisions": 1, "schedule": [0.6],
                                             "every": 25, "trial_steps": 5}}})
    project.run("agent", 1)
    run_dir = project.run_dir("agent", 1)
    host = run_dir / "agent" / "decisions"
    events = run_dir / "training" / "opal" / "events.jsonl"
    (applied,) = [event for event in map(json.loads, events.read_text().splitlines()) if event["kind"] == "applied"]
    assert applied["decision"] == 1  # at 60 % of the budget a rule of the heuristic always fires
    hosts_before = support.snapshot(host)
    running, answered = ((host / "001" / where / "updater.py").read_text() for where in ("running", "."))
    (new_line,) = [line for line in answered.splitlines() if line not in running.splitlines()]

    # the training process's account rewritten after the fact: its events and its decision meta
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    for event in lines:
        if event["kind"] == "applied":
            event.update(rationale="Observed: nothing. Forged.", summary="Changed: nothing (forged).",
                         files=["analysis.py"], diff={"analysis.py": {"added": 99, "removed": 0}})
    events.write_text("".join(json.dumps(event) + "\n" for event in lines))
    (run_dir / "training" / "opal" / "decisions" / "001" / "meta.json").write_text('{"forged": true}')

    assert support.snapshot(host) == hosts_before, "the host's records are untouched"
    code, out, err = call_cli("show", run_dir, "--json", "--html", tmp_path / "page.html")
    assert code == 0, err
    (shown,) = json.loads(out)["decisions"]
    rationale = (host / "001" / "response.md").read_text()
    assert shown["rationale"] == rationale.splitlines()[0] and "orged" not in json.dumps(shown)
    assert shown["files"] == ["updater.py"] and shown["answered_by"] == "agent host"
    assert shown["diff"] == {"updater.py": {"added": 1, "removed": 1}}
    page = (tmp_path / "page.html").read_text()
    assert new_line in page and "orged" not in page

    # and the program it says it applied put back to another: verify names the file, show refuses the folder
    version = run_dir / "training" / "opal" / "programs" / f"v{applied['version']:03d}" / "updater.py"
    version.write_text(running)
    code, out, err = call_cli("verify", run_dir)
    assert code == 3 and "training/opal/programs/v001/updater.py: is not the program the agent host answered at " \
                         "decision 1" in err, err
    code, out, err = call_cli("show", run_dir)
    assert code == 3 and out == "" and str(version) in err and len(err.strip().splitlines()) == 1, err
