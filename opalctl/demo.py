"""``opalctl demo``: one real comparison, end to end, in about three minutes on two cores.

The question it answers: when the starting learning rate is mis-tuned (AdamW at 0.1 on the built-in ``digits``
task, ten times a usual 1e-2; its loss spikes and it forgets the old classes), does the offline ``heuristic``
agent do better than the fixed optimizer, and better than the fixed schedule it can apply itself? Four arms on
three seeds, all from the same parents, under the same promotion policy as the shipped ``digits`` protocol:

- ``adamw-hot``: the mis-tuned starting point, constant (the baseline every arm is paired against);
- ``adamw-hot-anneal-end``: the same with the ``anneal-end`` schedule, the control for the one schedule the agent
  can apply (its ``ANNEAL_START``; its other moves scale the learning rate or clip, reacting to what it sees);
- ``agent-hot``: the same optimizer steered by the heuristic agent (8 scheduled decisions, and a wake-up on a
  spike or a non-finite loss);
- ``adamw``: a well-tuned learning rate (1e-2), what the task gets when nothing needs rescuing.

The budget is counted in whole updates (the ``updates`` clock), so every run's training, and therefore the
comparison, comes out the same run to run and machine to machine; a CPU clock would count seconds that depend
on what else the machine runs. The protocol is fixed in ``DEMO_PROTOCOL`` (``protocols/demo.yaml`` is the same
text) and was not tuned to make the agent win: the demo prints what happened.

Steps: init (the digits data and one parent per seed), the protocol, freeze, verify, the grid
(``opalctl.grid.run_grid``: two runs side by side, a progress display), compare, and the report page. Running it
again reuses what is there: finished runs are kept (a run folder is never overwritten), an interrupted run is
resumed. The demo's protocol is named ``demo``, so its runs (``runs/demo-SHA12``) never meet those of the README's
first session (``runs/digits-SHA12``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opalctl.driver.show_render import rule_of
from opalctl.errors import BadInput, InputChanged, OpalctlError
from opalctl.files import atomic_write_text, storage
from opalctl.grid import run_grid
from opalctl.grid.display import RunStates
from opalctl.layout import RunLayout, runs_dir_default
from opalctl.tasks.builtin import init

DURATION = "about a minute on 2 cores"  # its wall time after install (36 s measured); `demo --help` and README say it
PROTOCOL_NAME = "demo"
BASELINE = "adamw-hot"
JOBS = 2  # runs side by side: one thread each, on the two cores the demo is held to

DEMO_PROTOCOL = """\
# The protocol `opalctl demo` writes (and runs). Paths are relative to this file's folder; `opalctl init digits`
# writes the data and parents it names. A mis-tuned learning rate (AdamW at 0.1, ten times a usual 1e-2), three
# ways of living with it (constant, the anneal-end schedule, the offline heuristic agent), and a tuned one.
name: demo
task:
  entry: opalctl.tasks.digits:Digits
  config: {hidden: 128, replay_share: 0.25}
data:
  train: data/digits/train.npz
  development: data/digits/development.npz
  selection: data/digits/selection.npz
  retention: data/digits/retention.npz
parents: parents/digits/seed-{seed}.pt
seeds: [1, 2, 3]
budget: {clock: updates, amount: 1600, threads: 1, fractions: [0.25, 0.5, 0.75, 1.0]}
training: {batch_size: 64}
arms:
  adamw-hot:            {optimizer: {name: AdamW, lr: 0.1, weight_decay: 0.01}}
  adamw-hot-anneal-end: {optimizer: {name: AdamW, lr: 0.1, weight_decay: 0.01}, schedule: anneal-end}
  agent-hot:            {optimizer: {name: AdamW, lr: 0.1, weight_decay: 0.01},
                         agent: {backend: heuristic, decisions: 8}}
  adamw:                {optimizer: {name: AdamW, lr: 1.0e-2, weight_decay: 0.01}}
selection:
  denominators: [selection.total, retention.total]
  floors: {retention.correct: 4}        # candidate >= anchor - 4 of the 128 old-class rows
  nondecreasing: [selection.correct]    # candidate >= incumbent
  improve_any: [selection.correct]      # and strictly better on at least one
"""


def demo(folder: str | Path, *, runs_dir: str | Path | None = None, jobs: int = JOBS,
         say: Callable[[str], None] = lambda _: None,
         display: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    from opalctl.compare.aggregate import compare
    from opalctl.protocol.freeze import freeze
    from opalctl.report.grid_page import write_grid_page
    from opalctl.verify.command import verify

    folder = Path(folder)
    runs_dir = runs_dir_default(runs_dir)
    say(f"[1/6] init digits in {folder} (data files and one parent per seed)")
    with storage(folder, then="run `opalctl demo` again (or give --dir a folder that can be written)"):
        init("digits", folder)
        protocol = write_protocol(folder)
        say(f"[2/6] freeze {protocol}")
        frozen = freeze(protocol, force=True)  # a lock from an older opalctl is kept beside it (NAME.lock.SHA12.json)
    say(f"[3/6] verify {frozen['lock']}")
    checked = verify(frozen["lock"])
    if not checked["ok"]:
        raise InputChanged(f"lock {frozen['lock']} does not verify right after freezing")
    runs = len(frozen["arms"]) * len(frozen["seeds"])
    say(f"[4/6] grid: {len(frozen['arms'])} arms x {len(frozen['seeds'])} seeds = {runs} runs, {jobs} at a time")
    grid = run_grid(frozen["lock"], jobs=jobs, runs_dir=runs_dir, display=display)
    if not grid.ok:
        failed = [r for r in grid.runs if r["state"] not in ("finished", "resumed", "skipped")]
        raise OpalctlError(f"{len(failed)} of {runs} demo runs did not finish ({_runs_named(failed)}); read the "
                           f"log named, then run `opalctl demo` again to resume them")
    say(f"[5/6] compare {frozen['lock']} (baseline {BASELINE})")
    comparison = compare(frozen["lock"], runs_dir=runs_dir, baseline=BASELINE)
    # what training itself reached, before the promotion policy chose: where no stage of an arm qualifies, its
    # selected model is the anchor, and only the last stage shows what happened to it
    last = compare(frozen["lock"], runs_dir=runs_dir, baseline=BASELINE, stage="last")
    say("[6/6] report page")
    page = write_grid_page(frozen["lock"], runs_dir=runs_dir)
    return {"folder": str(folder), "protocol": str(protocol), "lock": frozen["lock"], "sha256": frozen["sha256"],
            "verified_records": checked["checked"], "grid": grid.runs, "compare": comparison,
            "rules": agent_rules(comparison), "verdict": verdict(comparison), "verdict_last": verdict(last),
            "report_page": str(page)}


def write_protocol(folder: Path) -> Path:
    """``demo.yaml`` in ``folder``; an existing file with other contents is never overwritten."""
    path = folder / f"{PROTOCOL_NAME}.yaml"
    if path.exists() and path.read_text(encoding="utf-8") != DEMO_PROTOCOL:
        raise BadInput(f"{path} already exists with other contents; the demo never overwrites it, so move it away or "
                       f"give another --dir")
    if not path.exists():
        atomic_write_text(path, DEMO_PROTOCOL)
    return path


def _runs_named(runs: list[dict[str, Any]]) -> str:
    shown = [f"{r['arm']} seed {r['seed']} {r['state']}, log {r.get('log')}" for r in runs[:3]]
    return "; ".join(shown) + (f"; and {len(runs) - 3} more" if len(runs) > 3 else "")


def agent_rules(comparison: dict[str, Any]) -> dict[str, dict[str, int]]:
    """arm -> how often each heuristic rule decided, over every decision of that arm's runs."""
    base = Path(comparison["runs"])
    counted: dict[str, dict[str, int]] = {}
    for row in comparison["arms"]:
        rules: Counter = Counter()
        for seed in row["seeds"]:
            run_dir = base / row["arm"] / f"seed-{seed}"
            for number in RunLayout.of(run_dir).decision_numbers():
                check = rule_of(run_dir, number)
                rules[check.rule if check is not None else "not recorded"] += 1
        if rules:
            counted[row["arm"]] = dict(sorted(rules.items(), key=lambda item: (-item[1], item[0])))
    return counted


def verdict(comparison: dict[str, Any]) -> list[str]:
    """Compare's verdict on the primary metric for each arm against the baseline, as ``opalctl compare`` words it
    (compare/verdict.py: a difference claimed only on the exact test, the paired t-test beside it; for an agent arm
    that acted on no seed, the sentence saying so instead; its flags and controls at the end)."""
    metric = comparison["primary"]
    return [row["paired"][metric]["verdict"] for row in comparison["arms"] if metric in row["paired"]]


class StateLines:
    """The demo's progress where no live table can be drawn (piped): one line per run that reaches its end."""

    FINAL = ("finished", "resumed", "skipped", "failed", "interrupted")

    def __init__(self, say: Callable[[str], None]):
        self.say = say

        self.runs = RunStates()

    def __call__(self, change: dict[str, Any]) -> None:
        if not self.runs.changed(change):
            return
        if change["state"] in self.FINAL:
            states = self.runs.states.values()
            done = sum(1 for state in states if state in self.FINAL)
            self.say(f"      {change['arm']} seed {change['seed']}: {change['state']} ({done} of {len(states)})")
