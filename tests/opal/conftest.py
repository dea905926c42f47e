"""Shared pieces of the agent optimizer tests: a tiny deterministic model and data, training loops for the
plain and the wrapped optimizer, hand-replicable updater programs, and a callable backend that writes them.

Everything is reached through the ``opal`` fixture (conftest modules are not importable under
``--import-mode=importlib``). The model is an MLP 10-32-1 on 50 fixed random batches of 16; one thread, so that
two runs of the same arithmetic give the same bits.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(1)

N_BATCHES = 50
RATIONALE = ("Observed: a test.\nChanged: updater.py.\nPrediction: the test passes; wrong if it fails.\n"
             "Rules: none is a schedule.")
KEEP_RATIONALE = "Observed: a test.\nKept: the programs.\nPrediction: nothing changes.\nRules: none."
SGD_LR = 0.01


def _make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(16, 10, generator=generator), torch.randn(16, 1, generator=generator))
            for _ in range(N_BATCHES)]


DATA = _make_data()


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def loss_at(model: torch.nn.Module, update: int) -> torch.Tensor:
    x, y = DATA[update % N_BATCHES]
    return ((model(x) - y) ** 2).mean()


def train(model, optimizer, steps: int, *, start: int = 0, plain: bool = False, clip: float | None = None,
          scheduler=None, sleep: float = 0.0, between: bool = False, step_seconds: list | None = None,
          losses: dict[int, Any] | None = None):
    """``steps`` updates from update ``start``. ``plain``: the user's loop (clip, step, scheduler.step());
    otherwise the wrapped loop (``step(loss=...)``; ``between`` calls ``between_updates()`` first).
    ``losses`` replaces the loss passed to ``step`` at the given updates (a NaN, say)."""
    for update in range(start, start + steps):
        optimizer.zero_grad()
        loss = loss_at(model, update)
        loss.backward()
        if plain:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        else:
            if between:
                optimizer.between_updates()
            shown = losses[update] if losses and update in losses else loss
            started = time.perf_counter()
            optimizer.step(loss=shown)
            if step_seconds is not None:
                step_seconds.append(time.perf_counter() - started)
        if sleep:
            time.sleep(sleep)
    return model


def manual_sgd(model, steps: int, *, start: int, lr: float = SGD_LR):
    """What ``sgd_updater`` computes, by hand: ``p -= g * lr`` with the same data."""
    for update in range(start, start + steps):
        for p in model.parameters():
            p.grad = None
        loss_at(model, update).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad * lr)
    return model


def mismatches(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the parameters that are not bit for bit equal (empty when all are)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    return [name for name in pa if not torch.equal(pa[name].detach(), pb[name].detach())]


def events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (Path(run_dir) / "events.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def of_kind(run_dir_or_events, *kinds: str) -> list[dict[str, Any]]:
    found = events(run_dir_or_events) if isinstance(run_dir_or_events, (str, Path)) else run_dir_or_events
    return [e for e in found if e["kind"] in kinds]


def without_timing(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if "seconds" not in k} for e in items]


def sgd_updater(fail_at: int = 0, touch_first: bool = True, body: str = "", build_body: str = "") -> str:
    """Plain SGD without momentum, ``p -= g * 0.01``; it raises at its ``fail_at``-th step (1-based; 0 never),
    after updating the parameters when ``touch_first``. ``body`` is extra code run at the start of every step
    (with ``self.count`` already incremented), ``build_body`` extra code at the start of ``build``."""
    return f'''"""Plain SGD for the tests."""

import torch

LR = {SGD_LR!r}
FAIL_AT = {fail_at}
TOUCH_FIRST = {touch_first}


def build(params, previous, spec):
{build_body or "    pass"}
    return Updater(params)


class Updater:
    def __init__(self, params):
        self.params = params
        self.count = 0

    def step(self, grads, update, ctx):
        self.count += 1
{body or "        pass"}
        if self.count == FAIL_AT and not TOUCH_FIRST:
            raise RuntimeError("deliberate failure before touching the parameters")
        for name, p in self.params.items():
            g = grads[name]
            if g is not None:
                p.sub_(g * LR)
        if self.count == FAIL_AT:
            raise RuntimeError("deliberate failure at step " + str(self.count))

    def state_dict(self):
        return {{"count": self.count}}

    def load_state_dict(self, state):
        self.count = int(state["count"])
'''


def broken_updater(step_body: str, imports: str = "import torch") -> str:
    """An updater whose step is ``step_body`` (indented 8 spaces by the caller's text)."""
    return f'''{imports}


def build(params, previous, spec):
    return Updater(params, spec)


class Updater:
    def __init__(self, params, spec):
        self.params = params
        self.spec = spec

    def step(self, grads, update, ctx):
{step_body}

    def state_dict(self):
        return {{}}

    def load_state_dict(self, state):
        pass
'''


class Writer:
    """A callable backend ``fn(workspace, message)``: at its first call (or every call, ``always``) it writes the
    given files into the workspace; later calls write nothing (the workspace then holds the running programs, so
    the decision keeps). ``sleep`` seconds pass first. It records each call and the most calls at once."""

    def __init__(self, updater: str | None = None, analysis: str | None = None, *, rationale: str = RATIONALE,
                 sleep: float = 0.0, always: bool = False):
        self.updater, self.analysis, self.rationale = updater, analysis, rationale
        self.sleep, self.always = sleep, always
        self.calls: list[str] = []
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # recorded in the start event: the same for two runs with the same answers
        return f"Writer(updater={self.updater is not None}, analysis={self.analysis is not None}, sleep={self.sleep})"

    def __call__(self, workspace: Path, message: str) -> str:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.calls.append(message)
            first = len(self.calls) == 1
        try:
            if self.sleep:
                time.sleep(self.sleep)
            if first or self.always:
                if self.updater is not None:
                    (Path(workspace) / "updater.py").write_text(self.updater, encoding="utf-8")
                if self.analysis is not None:
                    (Path(workspace) / "analysis.py").write_text(self.analysis, encoding="utf-8")
                return self.rationale
            return KEEP_RATIONALE
        finally:
            with self._lock:
                self.active -= 1


class Opal:
    N_BATCHES = N_BATCHES
    DATA = DATA
    SGD_LR = SGD_LR
    RATIONALE = RATIONALE
    make_model = staticmethod(make_model)
    adamw = staticmethod(adamw)
    loss_at = staticmethod(loss_at)
    train = staticmethod(train)
    manual_sgd = staticmethod(manual_sgd)
    mismatches = staticmethod(mismatches)
    events = staticmethod(events)
    of_kind = staticmethod(of_kind)
    without_timing = staticmethod(without_timing)
    sgd_updater = staticmethod(sgd_updater)
    broken_updater = staticmethod(broken_updater)
    Writer = Writer

    @staticmethod
    def default_sources() -> dict[str, str]:
        from opalctl.opal.optimizer import default_sources

        return default_sources()

    @staticmethod
    def plain_adamw(steps: int, **options) -> torch.nn.Module:
        model = make_model()
        return train(model, adamw(model), steps, plain=True, **options)


@pytest.fixture(scope="session")
def opal():
    return Opal


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "opal"
