"""Keys never reach a file. The training process's redaction catches what is shaped like a key and holds no secret
(and no hash of one: an agent's program could read it); the agent host's, which holds the keys anyway, catches
every secret-looking variable of its environment and the backend's key whole, reversed, and in any piece of seven
characters or more, without shredding ordinary text (the shipped prompts, a heuristic decision's records).

The run-level tests point the anthropic backend at the loopback server (``messages_server.py``) and grep every
file under the run folder for the key and for each of its pieces.
"""

from __future__ import annotations

import gzip
import importlib.util
import secrets as random_source
import string
import uuid
from pathlib import Path

import pytest

from opalctl.opal import wrap
from opalctl.opal.agents.anthropic import AnthropicBackend
from opalctl.opal.agents.workspace import sweep
from opalctl.opal.messages import prompt_text
from opalctl.opal.records import PIECE, REDACTED, Redaction, SecretRedaction, secret_names

_spec = importlib.util.spec_from_file_location("messages_server", Path(__file__).with_name("messages_server.py"))
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

KEPT = "Observed: nothing of note.\nKept: the programs.\nPrediction: no change.\nRules: none."
KEY_CHARACTERS = string.ascii_letters + string.digits + "_-"


def anthropic_shaped_key() -> str:
    return "sk-ant-api03-" + "".join(random_source.choice(KEY_CHARACTERS) for _ in range(40))


def pieces(secret: str, size: int = PIECE) -> list[str]:
    return [text[i:i + size] for text in (secret, secret[::-1]) for i in range(len(text) - size + 1)]


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


# -- the redactions themselves -------------------------------------------------------------------------------------

def test_the_hosts_redaction_catches_the_whole_value_every_piece_of_seven_and_the_key_reversed():
    secret = "Zq7" + uuid.uuid4().hex
    redaction = SecretRedaction([secret])
    assert redaction(f"key={secret}!") == f"key={REDACTED}!"
    assert redaction(f"the middle {secret[5:12]} of it") == f"the middle {REDACTED} of it"
    assert redaction(f"two {secret[:9]} and {secret[-12:]}") == f"two {REDACTED} and {REDACTED}"
    assert redaction(f"backwards {secret[::-1]} here") == f"backwards {REDACTED} here"
    assert redaction(f"a reversed piece {secret[10:17][::-1]} too") == f"a reversed piece {REDACTED} too"
    assert redaction(f"six {secret[3:9]} only") == f"six {secret[3:9]} only"
    assert redaction("nothing secret here at all") == "nothing secret here at all"


def test_the_secret_looking_variables_of_the_environment_are_caught():
    environ = {"ANTHROPIC_API_KEY": "a" * 4 + uuid.uuid4().hex, "ANTHROPIC_AUTH_TOKEN": uuid.uuid4().hex,
               "GH_TOKEN": uuid.uuid4().hex, "SERVICE_SECRET_VALUE": uuid.uuid4().hex,
               "DB_PASSWORD": uuid.uuid4().hex, "HOME": "/root/somewhere", "TOKENIZERS_PARALLELISM": "false-ish",
               "OPALCTL_HANDOVER": "12 5 ANTHROPIC_API_KEY"}
    assert secret_names(environ) == ["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "DB_PASSWORD", "GH_TOKEN",
                                     "SERVICE_SECRET_VALUE"]
    redaction = SecretRedaction(environ=environ)
    for name in secret_names(environ):
        assert redaction(f"x {environ[name][2:14]} y") == f"x {REDACTED} y", name
    assert redaction("/root/somewhere") == "/root/somewhere"


def test_the_training_processs_redaction_holds_no_secret_and_catches_only_what_looks_like_one():
    key = anthropic_shaped_key()
    redaction = Redaction()
    assert not redaction.holds_secrets and vars(redaction) == {}
    assert redaction(f"the key {key}") == f"the key {REDACTED}"
    assert redaction(f"token={uuid.uuid4().hex}") == f"token={REDACTED}"
    middle = key[20:40]  # a piece of a key, not shaped like one: nothing here can tell it from any other text
    assert redaction(f"a piece {middle}") == f"a piece {middle}"


def test_the_hosts_redaction_leaves_the_shipped_prompts_and_a_heuristic_decision_whole(opal, tmp_path):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", decisions=2, schedule=[0.3, 0.6],
                     total_steps=100, run_dir=tmp_path / "opal")
    opal.train(model, optimizer, 100)
    optimizer.close()
    decisions = tmp_path / "opal" / "agent" / "decisions"
    texts = [prompt_text("neutral"), prompt_text("aggressive")]
    texts += [path.read_text() for path in sorted(decisions.rglob("*")) if path.is_file()]
    assert len(texts) > 10 and any('"rule"' in text for text in texts), "a heuristic transcript is among them"
    for _ in range(50):
        redaction = SecretRedaction([anthropic_shaped_key(), uuid.uuid4().hex])
        for text in texts:
            assert redaction(text) == text


def test_the_sweep_after_a_decision_redacts_every_file_of_the_workspace(tmp_path):
    secret = uuid.uuid4().hex
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text(f"the key is {secret[4:20]}\n")
    (tmp_path / "updater.py").write_text(f"KEY = '{secret[::-1]}'\n")
    done = sweep(tmp_path, SecretRedaction([secret]), keep=("updater.py", "analysis.py"))
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
    # the host answered the analysis with its reversed piece redacted: the training process never got one
    (answered,) = [path for path in run_dir.rglob("agent/decisions/001/analysis.py")]
    assert f"HIDDEN = {REDACTED!r}" in answered.read_text()
    if opal.of_kind(run_dir, "applied"):  # the program loaded (the static check let torch.os through)
        reports = (run_dir / "reports.jsonl").read_text()
        assert REDACTED[::-1] in reports and '"environment": "None"' in reports
