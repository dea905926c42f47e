"""The agent optimizer's settings: one frozen ``AgentSettings``, checked once, that ``wrap``'s keyword arguments
build; and the cost cap, which expects what ``estimate`` forecasts for the model the backend calls."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from opalctl.errors import BadInput
from opalctl.opal import wrap
from opalctl.opal.agents.base import Answer, Backend
from opalctl.opal.settings import FIELDS, AgentSettings


def test_keywords_and_a_settings_object_make_one_optimizer(opal, tmp_path):
    model = opal.make_model()
    settings = AgentSettings(total_steps=10, backend="keep", decisions=2, schedule=[0.2, 0.6], run_dir=str(tmp_path))
    assert settings.run_dir == tmp_path and settings.schedule == (0.2, 0.6)  # one form for what a caller may give
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.decisions = 3
    optimizer = wrap(opal.adamw(model), model, settings, every=5)  # a keyword beside it takes its field's place
    assert optimizer.settings == dataclasses.replace(settings, every=5)
    optimizer.close()
    by_keywords = wrap(opal.adamw(model), model, total_steps=10, backend="keep", run_dir=tmp_path / "b")
    assert by_keywords.settings == AgentSettings(total_steps=10, backend="keep", run_dir=tmp_path / "b")
    by_keywords.close()


@pytest.mark.parametrize(("keywords", "message"), [
    ({}, "wrap() needs total_steps or progress"),
    ({"total_steps": 10, "blocking": "sometimes"}, "blocking must be True, False or 'auto'"),
    ({"total_steps": 10, "max_cost_usd": 0}, "max_cost_usd must be a number of US dollars above 0"),
    ({"total_steps": 10, "max_cost_usd": float("nan")}, "max_cost_usd must be a number of US dollars above 0"),
])
def test_a_wrong_setting_is_refused_once_in_one_sentence(opal, keywords, message):
    model = opal.make_model()
    for make in (lambda: AgentSettings(**keywords), lambda: wrap(opal.adamw(model), model, **keywords)):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
            make()
        assert "\n" not in str(refused.value)


def test_a_keyword_that_names_no_setting_is_refused_with_the_names_there_are(opal):
    model = opal.make_model()
    with pytest.raises(TypeError, match="'total_step' is not a setting of the agent optimizer") as refused:
        wrap(opal.adamw(model), model, total_step=10)
    assert all(name in str(refused.value) for name in FIELDS)


class PricedBackend(Backend):
    """A backend that answers here, calls ``model`` (as its description says) and bills ``usd`` per decision."""

    name = "priced"

    def __init__(self, model: str, usd: float):
        self.model, self.usd, self.calls = model, usd, 0

    def describe(self):
        return {"backend": self.name, "model": self.model}

    def decide(self, workspace: Path, message: str, facts):
        self.calls += 1
        return Answer(rationale="kept", cost_usd=self.usd)


def test_the_cost_cap_expects_the_cost_of_the_model_the_backend_calls(opal, run_dir):
    # claude-haiku-4-5 lists at a fifth of the measured model's prices: a first decision is expected to cost
    # 1.08 / 5 = $0.216, within a $0.30 cap (the measured model's $1.08 would skip it); it costs $0.20, and the
    # $0.10 left is below the next one's expected $0.20
    model = opal.make_model()
    backend = PricedBackend("claude-haiku-4-5", usd=0.2)
    optimizer = wrap(opal.adamw(model), model, backend=backend, decisions=3, schedule=[0.2, 0.4, 0.6],
                     total_steps=50, run_dir=run_dir, max_cost_usd=0.3)
    opal.train(model, optimizer, 50)
    figures = optimizer.close()
    assert backend.calls == 1 and figures["decisions_asked"] == 1
    skipped = opal.of_kind(run_dir, "skipped")
    assert [e["reason"] for e in skipped] == ["cost cap", "cost cap"]
    assert skipped[0]["expected_usd"] == pytest.approx(0.2) and skipped[0]["priced_as"] == "claude-haiku-4-5"


def test_a_cost_cap_on_a_model_without_prices_is_refused(opal, run_dir):
    model = opal.make_model()
    with pytest.raises(BadInput, match="max_cost_usd needs the prices of the agent's model 'gpt-9'"):
        wrap(opal.adamw(model), model, backend=PricedBackend("gpt-9", usd=0.2), total_steps=10, run_dir=run_dir,
             max_cost_usd=1.0)
    assert not run_dir.exists()  # refused before anything was written
    without_cap = wrap(opal.adamw(model), model, backend=PricedBackend("gpt-9", usd=0.2), total_steps=10)
    without_cap.close()
