"""The workspace is a folder the backend cannot link out of, and a decision may write only so much into it.

- a link a backend leaves in place of a program (``analysis.py -> victim``, ``updater.py -> /etc/passwd``) is
  never written through at the next decision and never copied into ``programs/``: it is a load failure with a
  sentence;
- a program that is a folder, a fifo or not UTF-8 is a load failure with a sentence, and training goes on;
- the file tools refuse a link in a parent folder, and refuse writes past the files and bytes of one decision;
- one response of 300 writes is cut at the limit, and its transcript is capped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from pathlib import Path

import pytest

from opalctl.opal import wrap
from opalctl.opal.agents.anthropic import AnthropicBackend
from opalctl.opal.agents.worker import MAX_TRANSCRIPT_CHARS
from opalctl.opal.agents.workspace import MAX_BYTES_PER_DECISION, MAX_FILES_PER_DECISION, Refused, Workspace, sweep
from opalctl.opal.records import Redaction

_spec = importlib.util.spec_from_file_location("messages_server", Path(__file__).with_name("messages_server.py"))
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

KEPT = "Observed: nothing of note.\nKept: the programs.\nPrediction: no change.\nRules: none."


class Leaver:
    """A callable backend that, at its first decision, leaves ``name`` in the workspace as ``make(path)`` makes it."""

    def __init__(self, name: str, make):
        self.name, self.make, self.calls = name, make, 0

    def __call__(self, workspace: Path, message: str) -> str:
        self.calls += 1
        if self.calls == 1:
            path = Path(workspace) / self.name
            path.unlink()
            self.make(path)
        return KEPT


def run_two_decisions(opal, run_dir, backend, steps: int = 40):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=backend, decisions=2, schedule=[0.25, 0.75],
                     total_steps=steps, run_dir=run_dir)
    opal.train(model, optimizer, steps)
    optimizer.close()
    return optimizer


def test_a_link_left_as_analysis_py_is_not_written_through_at_the_next_decision(opal, run_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("the victim's own text\n")
    optimizer = run_two_decisions(opal, run_dir, Leaver("analysis.py", lambda path: path.symlink_to(victim)))
    assert victim.read_text() == "the victim's own text\n"
    (failed,) = opal.of_kind(run_dir, "load_failed")
    assert failed["decision"] == 1 and "analysis.py in the workspace is a symbolic link" in failed["message"]
    workspace = run_dir / "workspace"
    assert not (workspace / "analysis.py").is_symlink(), "the next decision put the running program back"
    assert (workspace / "analysis.py").read_text() == opal.default_sources()["analysis.py"]
    assert optimizer.t == 40 and opal.of_kind(run_dir, "kept")[0]["decision"] == 2


def test_a_link_to_etc_passwd_as_updater_py_is_not_copied_into_programs(opal, run_dir):
    passwd = Path("/etc/passwd")
    if not passwd.is_file() or not passwd.read_text().strip():
        pytest.skip("this machine has no /etc/passwd to link to")
    first_line = passwd.read_text().splitlines()[0]
    run_two_decisions(opal, run_dir, Leaver("updater.py", lambda path: path.symlink_to(passwd)))
    (failed,) = opal.of_kind(run_dir, "load_failed")
    assert "updater.py in the workspace is a symbolic link" in failed["message"]
    for path in (run_dir / "programs").rglob("*"):
        if path.is_file():
            assert first_line not in path.read_text(), f"/etc/passwd reached {path}"


def _folder(path: Path) -> None:
    path.mkdir()
    (path / "inside.py").write_text("x = 1\n")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _latin1(path: Path) -> None:
    path.write_bytes("# caf\xe9\n".encode("latin-1"))


@pytest.mark.parametrize("make,sentence", [(_folder, "updater.py in the workspace is a folder"),
                                           (_fifo, "updater.py in the workspace is not a regular file"),
                                           (_latin1, "updater.py is not UTF-8 text")])
def test_a_program_that_is_no_regular_utf8_file_is_a_load_failure_with_a_sentence(opal, run_dir, make, sentence):
    optimizer = run_two_decisions(opal, run_dir, Leaver("updater.py", make))
    (failed,) = opal.of_kind(run_dir, "load_failed")
    assert sentence in failed["message"] and failed["version"] == 1
    assert optimizer.t == 40 and optimizer.current.number == 0
    assert opal.of_kind(run_dir, "kept")[0]["decision"] == 2
    assert (run_dir / "workspace" / "updater.py").is_file()


# -- the file tools ------------------------------------------------------------------------------------------------

def test_a_link_in_a_parent_folder_is_refused_for_reading_and_writing(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.py").write_text("outside\n")
    workspace = tmp_path / "workspace"
    (workspace / "sub").mkdir(parents=True)
    os.symlink(outside, workspace / "sub" / "deeper")
    space = Workspace(workspace)
    for action in (lambda: space.read("sub/deeper/a.py"), lambda: space.write("sub/deeper/a.py", "changed"),
                   lambda: space.write("sub/deeper/new/b.py", "new"), lambda: space.list_files("sub/deeper")):
        with pytest.raises(Refused):
            action()
    assert (outside / "a.py").read_text() == "outside\n" and sorted(os.listdir(outside)) == ["a.py"]


def test_writes_past_the_files_or_bytes_of_one_decision_are_refused_with_a_sentence(tmp_path):
    space = Workspace(tmp_path, max_files=3, max_bytes=100)
    for name in ("a", "b", "c"):
        space.write(name, "x" * 10)
    space.write("a", "y" * 10)  # a file already written does not count again
    with pytest.raises(Refused, match="already written 3 files, the most one decision may write"):
        space.write("d", "x")
    with pytest.raises(Refused, match="would pass the 100 bytes one decision may write"):
        space.write("b", "z" * 70)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]
    assert Workspace(tmp_path).max_files == MAX_FILES_PER_DECISION == 64
    assert MAX_BYTES_PER_DECISION == 4_000_000


def test_the_sweep_removes_links_and_special_files_and_what_is_past_the_limits(tmp_path):
    (tmp_path / "updater.py").write_text("x = 1\n")
    os.symlink("/etc", tmp_path / "etc")
    os.symlink("/etc/hostname", tmp_path / "analysis.py")
    os.mkfifo(tmp_path / "pipe")
    for index in range(5):
        (tmp_path / f"note{index}.txt").write_text("n")
    done = sweep(tmp_path, Redaction(), keep=("updater.py", "analysis.py"), max_files=3)
    assert sorted(os.listdir(tmp_path)) == ["note0.txt", "note1.txt", "note2.txt", "updater.py"]
    assert len(done) == 5


# -- one response of 300 writes ----------------------------------------------------------------------------------

def test_one_response_of_300_writes_is_cut_at_the_limit(opal, run_dir, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", uuid.uuid4().hex)
    content = "# a note\n" + "x" * 10_000 + "\n"  # 300 of them: three times what a transcript may hold
    writes = [ms.tool_use("write_file", {"path": f"notes/n{index:03d}.md", "content": content})
              for index in range(300)]
    script = [ms.reply(*writes), ms.reply(ms.text(KEPT))]
    with ms.MessagesServer(script) as server:
        model = opal.make_model()
        backend = AnthropicBackend(model="claude-opus-5-5", base_url=server.url)
        optimizer = wrap(opal.adamw(model), model, backend=backend, decisions=1, schedule=[0.5], total_steps=10,
                         run_dir=run_dir)
        opal.train(model, optimizer, 10)
        optimizer.close()
    results = ms.last_tool_results(server.bodies[1])
    assert len(results) == 300
    wrote = [r for r in results if not r["is_error"]]
    refused = [r for r in results if r["is_error"]]
    assert len(wrote) == MAX_FILES_PER_DECISION and len(refused) == 300 - MAX_FILES_PER_DECISION
    assert all("the most one decision may write" in r["content"] for r in refused)
    notes = list((run_dir / "agent" / "workspace" / "notes").iterdir())
    assert len(notes) == MAX_FILES_PER_DECISION
    assert sum(p.stat().st_size for p in notes) <= MAX_BYTES_PER_DECISION
    transcript = run_dir / "agent" / "decisions" / "001" / "transcript.json"
    assert transcript.stat().st_size <= 2 * MAX_TRANSCRIPT_CHARS
    assert any(entry["event"] == "cut" for entry in json.loads(transcript.read_text()))
