"""Keys never reach a file: one redaction, for every writer of the agent's records and of the workspace, catches
the whole value and any piece of eight characters or more of every secret-looking variable of the environment and
of the key the backend uses, and it holds no secret itself.

The run-level tests point the anthropic backend at the loopback server (``messages_server.py``) and grep every
file under the run folder for the key and for each of its pieces.
"""

from __future__ import annotations

import gzip
import importlib.util
import uuid
from pathlib import Path

import pytest

from opalctl.opal import wrap
from opalctl.opal.agents.anthropic import AnthropicBackend
from opalctl.opal.agents.workspace import sweep
from opalctl.opal.records import FRAGMENT, REDACTED, Redaction, secret_names

_spec = importlib.util.spec_from_file_location("messages_server", Path(__file__).with_name("messages_server.py"))
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

KEPT = "Observed: nothing of note.\nKept: the programs.\nPrediction: no change.\nRules: none."


def pieces(secret: str) -> list[str]:
    return [secret[i:i + FRAGMENT] for i in range(len(secret) - FRAGMENT + 1)]


def assert_no_piece_in_any_file(secret: str, folder: Path) -> int:
    """Every file under ``folder`` holds neither ``secret`` nor any piece of it; returns how many were read."""
    read = 0
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if path.suffix == ".gz":
                data = gzip.decompress(data)
            for piece in pieces(secret):
                assert piece.encode() not in data, f"a piece of the key ({piece}) reached {path}"
            read += 1
    return read


# -- the redaction itself ------------------------------------------------------------------------------------------

def test_the_whole_value_and_every_piece_of_eight_characters_are_redacted_and_shorter_ones_are_not():
    secret = "Zq7" + uuid.uuid4().hex
    redaction = Redaction([secret])
    assert redaction(f"key={secret}!") == f"key={REDACTED}!"
    assert redaction(f"the middle {secret[5:13]} of it") == f"the middle {REDACTED} of it"
    assert redaction(f"two {secret[:9]} and {secret[-12:]}") == f"two {REDACTED} and {REDACTED}"
    assert redaction(f"seven {secret[3:10]} only") == f"seven {secret[3:10]} only"
    assert redaction("nothing secret here at all") == "nothing secret here at all"


def test_the_secret_looking_variables_of_the_environment_are_caught():
    environ = {"ANTHROPIC_API_KEY": "a" * 4 + uuid.uuid4().hex, "ANTHROPIC_AUTH_TOKEN": uuid.uuid4().hex,
               "GH_TOKEN": uuid.uuid4().hex, "SERVICE_SECRET_VALUE": uuid.uuid4().hex,
               "DB_PASSWORD": uuid.uuid4().hex, "HOME": "/root/somewhere", "TOKENIZERS_PARALLELISM": "false-ish"}
    assert secret_names(environ) == ["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "DB_PASSWORD", "GH_TOKEN",
                                     "SERVICE_SECRET_VALUE"]
    redaction = Redaction(environ=environ)
    for name in secret_names(environ):
        assert redaction(f"x {environ[name][2:14]} y") == f"x {REDACTED} y", name
    assert redaction("/root/somewhere") == "/root/somewhere"


def test_the_redaction_holds_no_secret():
    secret = uuid.uuid4().hex
    redaction = Redaction([secret])
    held = repr(vars(redaction))
    assert not any(piece in held for piece in pieces(secret))


def test_the_sweep_after_a_decision_redacts_every_file_of_the_workspace(tmp_path):
    secret = uuid.uuid4().hex
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text(f"the key is {secret[4:20]}\n")
    (tmp_path / "updater.py").write_text(f"KEY = '{secret}'\n")
    done = sweep(tmp_path, Redaction([secret]), keep=("updater.py", "analysis.py"))
    assert len(done) == 2
    assert assert_no_piece_in_any_file(secret, tmp_path) == 2


# -- a run ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def key(monkeypatch):
    secret = uuid.uuid4().hex + uuid.uuid4().hex
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    return secret


def echoing_analysis(key: str) -> str:
    """An analysis whose report echoes a piece of the key (held reversed, so the file itself holds no piece) and
    whatever the environment of the training process still says the key is."""
    return f'''import torch

EVERY = 5
HIDDEN = {key[6:30][::-1]!r}


def analyze(obs, memory):
    return {{"report": {{"echo": HIDDEN[::-1], "environment": str(torch.os.environ.get("ANTHROPIC_API_KEY"))}}}}
'''


def test_an_analysis_that_reads_the_key_or_echoes_a_piece_of_it_puts_none_in_any_file(opal, run_dir, key):
    script = [ms.reply(ms.tool_use("write_file", {"path": "analysis.py", "content": echoing_analysis(key)}),
                       ms.tool_use("write_file", {"path": "notes.md", "content": f"the key: {key}"})),
              ms.reply(ms.text(f"Observed: {key[40:52]}.\nChanged: analysis.py.\nPrediction: none.\nRules: none.")),
              ms.reply(ms.text(KEPT))]
    with ms.MessagesServer(script) as server:
        model = opal.make_model()
        backend = AnthropicBackend(model="claude-opus-5-5", base_url=server.url)
        optimizer = wrap(opal.adamw(model), model, backend=backend, decisions=2, schedule=[0.25, 0.75],
                         total_steps=40, run_dir=run_dir)
        opal.train(model, optimizer, 40)
        optimizer.close()
    assert len(server.requests) == 3
    assert [e["kind"] for e in opal.of_kind(run_dir, "applied", "kept", "load_failed")][0] in ("applied",
                                                                                               "load_failed")
    files = assert_no_piece_in_any_file(key, run_dir)
    assert files >= 10
    for body in server.bodies[2:]:  # the second decision's message: the report, redacted, went to the agent
        text = str(body["messages"])
        assert not any(piece in text for piece in pieces(key))
    if opal.of_kind(run_dir, "applied"):  # the program loaded (the static check let torch.os through)
        reports = (run_dir / "reports.jsonl").read_text()
        assert REDACTED in reports and '"environment": "None"' in reports
