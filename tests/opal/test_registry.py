"""The backend registry (``opalctl.opal.agents.registry``): each backend declares itself once, in its own module,
and the protocol, the lock, the run and the pilot ask the registry instead of switching on names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import opalctl
from opalctl.opal.agents import make_backend, registry

PROTOCOL = {"name": "p", "task": {"entry": "opalctl.tasks.digits:Digits"}, "data": {"train": "t.npz"},
            "parents": "p{seed}.pt", "seeds": [1], "budget": {"clock": "updates", "amount": 10},
            "training": {"batch_size": 4}}
# every default of the agent section, as the lock recorded it before the registry (the same JSON, key for key)
DEFAULTS = {"backend": "heuristic", "blocking": True, "decisions": None, "effort": "high", "every": 25, "goal": None,
            "max_cost_usd": None, "max_lag": 50, "max_tokens": 8192, "model": None, "prices": None,
            "prompt": "neutral", "retries": 4, "schedule": "front", "seconds_per_decision": 900.0,
            "trial_steps": 20, "turns": 24}
OPUS_PRICES = {"cache_read": 0.5, "cache_write": 6.25, "input": 5.0, "output": 25.0}


def _resolved_agent(agent: dict) -> dict:
    from opalctl.protocol.freeze import resolved_protocol
    from opalctl.protocol.schema import parse

    data = dict(PROTOCOL, arms={"a": {"optimizer": {"name": "AdamW", "lr": 0.001}, "agent": agent}})
    return resolved_protocol(parse(data, {}, "p.yaml"))["arms"]["a"]["agent"]


@pytest.mark.parametrize("agent, lock", [
    ({}, {}),
    ({"backend": "keep"}, {"backend": "keep"}),
    ({"backend": "heuristic", "model": "x"}, {"model": "x"}),
    ({"backend": "anthropic"}, {"backend": "anthropic", "model": "claude-opus-5-5", "prices": OPUS_PRICES}),
    ({"backend": "anthropic", "model": "claude-sonnet-4-5", "effort": "low", "max_tokens": 1000, "turns": 3,
      "seconds_per_decision": 10.0, "retries": 1, "max_cost_usd": 2.0},
     {"backend": "anthropic", "model": "claude-sonnet-4-5", "effort": "low", "max_tokens": 1000, "turns": 3,
      "seconds_per_decision": 10.0, "retries": 1, "max_cost_usd": 2.0,
      "prices": {"cache_read": 0.3, "cache_write": 3.75, "input": 3.0, "output": 15.0}}),
    ({"backend": "anthropic", "model": "foo", "prices": {"input": 1.0, "output": 2.0}},
     {"backend": "anthropic", "model": "foo", "prices": {"cache_read": 0.0, "cache_write": 0.0, "input": 1.0,
                                                          "output": 2.0}}),
    ({"backend": "claude-code", "model": "sonnet", "turns": 5}, {"backend": "claude-code", "model": "sonnet", "turns": 5}),
    ({"backend": "replay:runs/x"}, {"backend": "replay:runs/x"}),
    ({"decisions": 3, "schedule": [0.2, 0.5], "blocking": "auto", "goal": "g", "prompt": "aggressive"},
     {"decisions": 3, "schedule": [0.2, 0.5], "blocking": "auto", "goal": "g", "prompt": "aggressive"}),
    ({"notes": "allowed"}, {"notes": "allowed"}),
])
def test_the_lock_records_every_agent_section_as_it_did_before_the_registry(agent, lock):
    assert json.dumps(_resolved_agent(agent), sort_keys=True) == json.dumps({**DEFAULTS, **lock}, sort_keys=True)


def test_each_name_is_declared_by_its_own_module_and_messages_list_them_in_order():
    assert [kind.name for kind in registry.kinds()] == list(registry.NAMES)
    assert registry.spellings() == "keep, heuristic, anthropic, claude-code, mailbox or replay:<run folder>"
    assert registry.find("replay:") is None and registry.find("replay") is None and registry.find("gpt") is None
    assert registry.find("keep:x") is None and registry.find("claude-code")[0].name == "claude-code"
    assert registry.find("replay:runs/a:b") == (registry.find("replay:x")[0], "runs/a:b")


def test_only_the_language_model_backends_wait():
    assert {kind.name: kind.waits for kind in registry.kinds()} == {
        "keep": False, "heuristic": False, "anthropic": True, "claude-code": True, "mailbox": True, "replay": False}


def test_the_protocol_accepts_each_backends_keys_with_the_default_its_backend_states():
    from opalctl.protocol.freeze import AGENT_KEYS_ONLY_WHEN_GIVEN
    from opalctl.protocol.schema import AgentCommon, AgentSpec

    union = set(AgentCommon.model_fields)
    for kind in registry.kinds():
        for key, field in (kind.options.model_fields.items() if kind.options else ()):
            assert AgentSpec.model_fields[key].default == field.default, (kind.name, key)
            union.add(key)
    # the keys only the mailbox backend reads are in no other arm's lock (DEFAULTS is what those locks hold), and
    # notes (opalctl say) and step_time_limit are left out of the lock where the protocol leaves them out: absent,
    # the lock is as before
    assert set(AgentSpec.model_fields) == union == (set(DEFAULTS) | set(registry.find("mailbox")[0].own_keys)
                                                    | set(AGENT_KEYS_ONLY_WHEN_GIVEN))


def test_a_protocol_builds_each_backend_with_the_keys_it_reads(monkeypatch, tmp_path):
    from opalctl.protocol.schema import AgentSpec

    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-key-0123456789")
    monkeypatch.setenv("OPALCTL_CLAUDE_BIN", sys.executable)
    anthropic = registry.from_protocol(AgentSpec(backend="anthropic", model="claude-haiku-4-5", max_tokens=300,
                                                 turns=2, seconds_per_decision=5.0, retries=0, effort="low"))
    assert (anthropic.model, anthropic.max_tokens, anthropic.turns, anthropic.retries) == ("claude-haiku-4-5", 300, 2, 0)
    assert anthropic.seconds_per_decision == 5.0 and anthropic.effort is None  # haiku takes no effort setting
    from opalctl.opal.messages import prompt_text

    assert anthropic.prompt_text == prompt_text("neutral")
    code = registry.from_protocol(AgentSpec(backend="claude-code", model="sonnet", turns=7, prompt="aggressive"))
    assert (code.model, code.turns, code.seconds_per_decision) == ("sonnet", 7, 900.0)
    assert code.prompt_text == prompt_text("aggressive")
    assert registry.from_protocol(AgentSpec(backend="keep")).name == "keep"
    assert registry.from_protocol(AgentSpec()).name == "heuristic"


def test_a_backend_name_that_is_no_backend_is_refused_by_the_library_with_every_spelling():
    with pytest.raises(ValueError, match="unknown agent backend 'gpt'; use keep, heuristic, anthropic, claude-code, mailbox "
                                         "or replay:<run folder> or a callable"):
        make_backend("gpt")
    assert make_backend("keep", model="ignored").name == "keep"  # a backend without settings ignores them


def test_the_default_model_is_written_once_in_the_package():
    root = Path(opalctl.__file__).resolve().parent
    holders = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                     if "claude-opus-5-5" in path.read_text(encoding="utf-8"))
    assert holders == ["opal/agents/default_model.py"]


def test_a_decisions_worker_loads_only_the_backend_it_runs():
    code = ("import sys; from opalctl.opal.agents import make_backend; make_backend('heuristic'); "
            "loaded = [m for m in ('pydantic', 'torch', 'opalctl.opal.agents.anthropic') if m in sys.modules]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(opalctl.__file__).resolve().parents[1])


def test_a_new_backend_is_one_module_that_declares_its_kind(monkeypatch):
    import types

    from opalctl.opal.agents.base import Answer, Backend, BackendKind

    class Echo(Backend):
        name = "echo"

        def __init__(self, argument: str):
            self.argument = argument

        def decide(self, workspace, message, facts):
            return Answer(rationale=self.argument)

    module = types.ModuleType("opalctl.opal.agents.echo")
    module.KIND = BackendKind(name="echo", waits=False, factory=Echo, argument="text")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(registry, "NAMES", registry.NAMES + ("echo",))
    registry._kind.cache_clear()
    try:
        assert registry.spellings().endswith("replay:<run folder> or echo:<text>")
        assert make_backend("echo:hello").decide(None, "", {}).rationale == "hello"
    finally:
        registry._kind.cache_clear()
