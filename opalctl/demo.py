"""``opalctl demo``: everything that exists, end to end, on the built-in ``digits`` task and its defaults.

init, freeze, verify, a pilot of every arm, a formal run of every arm on every seed, and the comparison. It is
the quickest way to see on a new machine that the pieces fit (``make demo`` runs it). Running it again reuses
what is already there: finished runs are kept (a run folder is never overwritten) and an interrupted run is
resumed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def demo(folder: str | Path, *, steps: int = 24, runs_dir: str | Path | None = None,
         say: Callable[[str], None] = lambda _: None, progress_factory=None) -> dict[str, Any]:
    from opalctl.compare.aggregate import compare
    from opalctl.driver.pilot import pilot
    from opalctl.driver.run import RESUME_FILE, RunPaths, run, runs_dir_default
    from opalctl.errors import InputChanged
    from opalctl.protocol.freeze import freeze
    from opalctl.protocol.lock import read_lock
    from opalctl.protocol.verify import verify
    from opalctl.tasks.builtin import init

    folder = Path(folder)
    runs_dir = runs_dir_default(runs_dir)
    say(f"[1/6] init digits in {folder}")
    created = init("digits", folder)
    say(f"[2/6] freeze {created['protocol']}")
    frozen = freeze(created["protocol"], force=True)
    say(f"[3/6] verify {frozen['lock']}")
    checked = verify(frozen["lock"])
    if not checked["ok"]:
        raise InputChanged(f"lock {frozen['lock']} does not verify right after freezing")
    pilots = []
    for index, arm in enumerate(frozen["arms"]):
        say(f"[4/6] pilot {arm} ({index + 1}/{len(frozen['arms'])}, {steps} updates)")
        pilots.append(pilot(frozen["lock"], arm, steps=steps))
    lock = read_lock(frozen["lock"])
    runs = []
    jobs = [(arm, seed) for arm in frozen["arms"] for seed in frozen["seeds"]]
    for index, (arm, seed) in enumerate(jobs):
        paths = RunPaths.of(runs_dir, lock, arm, seed)
        if (paths.run / "report.json").exists():
            say(f"[5/6] run {arm} seed {seed} ({index + 1}/{len(jobs)}): already finished, kept")
            runs.append({"arm": arm, "seed": seed, "status": "kept", "run_dir": str(paths.run)})
            continue
        resume = (paths.run / RESUME_FILE).exists()
        say(f"[5/6] run {arm} seed {seed} ({index + 1}/{len(jobs)})" + (" (resuming)" if resume else ""))
        if progress_factory is not None:
            with progress_factory(f"{arm} seed {seed}") as progress:
                report = run(frozen["lock"], arm, seed, runs_dir=runs_dir, resume=resume, progress=progress)
        else:
            report = run(frozen["lock"], arm, seed, runs_dir=runs_dir, resume=resume)
        runs.append({"arm": arm, "seed": seed, "status": "ran", "run_dir": report["run_dir"],
                     "updates": report["updates"], "selected": report["selected"]})
    say(f"[6/6] compare {frozen['lock']}")
    comparison = compare(frozen["lock"], runs_dir=runs_dir)
    return {"folder": str(folder), "protocol": created["protocol"], "lock": frozen["lock"],
            "sha256": frozen["sha256"], "verified_records": checked["checked"], "pilots": pilots, "runs": runs,
            "compare": comparison}
