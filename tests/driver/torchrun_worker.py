"""One rank of the formal-run tests under ``torchrun --nproc-per-node 2`` (gloo, CPU), each rank writing what it
saw to ``OUT/rank-R.json``. Two scenarios, one launch each (torchrun's start-up costs seconds):

- ``runs OUT RUNS LOCK_UPDATES LOCK_CPU``: a 2-rank fixed arm on the real clock, the same start again (refused
  on both ranks in rank 0's sentence), the agent arms ``keep`` and ``heuristic`` that wrap it, then the charge rule through the real gloo reduction with a clock whose
  charge is the rank's number plus one: ``max`` (the updates clock) charges 2 per update, ``sum`` (cpu) 3;
- ``kill OUT RUNS LOCK AT [ARM]``: the same fixed arm (or ARM), rank 1 killing itself with SIGKILL at its update
  AT.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from opalctl.driver.run import run
from opalctl.errors import OpalctlError


class RankCharge:
    """A clock that charges rank r exactly r + 1 per update, and counts the updates it measured; on rank
    ``kill_rank`` the update ``kill_at`` never ends (SIGKILL)."""

    def __init__(self, per_rank: bool = True, kill_rank: int | None = None, kill_at: int = 0):
        self.rank = dist.get_rank()
        self.per_rank, self.kill_rank, self.kill_at = per_rank, kill_rank, kill_at
        self.measured = 0

    def start(self) -> None:
        return None

    def stop(self, token) -> float:
        self.measured += 1
        if self.rank == self.kill_rank and self.measured == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return float(self.rank + 1) if self.per_rank else 1.0


def summary(report: dict) -> dict:
    return {key: report[key] for key in ("updates", "final_model_sha256", "rows_digest", "budget", "run_dir")} | {
        "ranks": report.get("ranks")}


def runs(out: Path, runs_dir: Path, lock_updates: str, lock_cpu: str) -> dict:
    seen = {"plain": summary(run(lock_updates, "adamw", 1, runs_dir=runs_dir / "plain"))}
    try:
        run(lock_updates, "adamw", 1, runs_dir=runs_dir / "plain")
        seen["again"] = None
    except OpalctlError as error:
        seen["again"] = {"message": error.message, "exit_code": error.exit_code}
    for arm in ("keep", "heuristic"):
        seen[arm] = summary(run(lock_updates, arm, 1, runs_dir=runs_dir / "plain"))
    for name, lock in (("max", lock_updates), ("sum", lock_cpu)):
        clocks: list[RankCharge] = []

        def factory(clock_name: str, clocks=clocks) -> RankCharge:
            clocks.append(RankCharge())
            return clocks[-1]

        seen[name] = summary(run(lock, "adamw", 1, runs_dir=runs_dir / name, clock_factory=factory))
        seen[name]["measured"] = clocks[0].measured
    return seen


def main() -> None:
    scenario, out, runs_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    if scenario == "runs":
        seen = runs(out, runs_dir, sys.argv[4], sys.argv[5])
    else:
        clock = RankCharge(per_rank=False, kill_rank=1, kill_at=int(sys.argv[5]))
        arm = sys.argv[6] if len(sys.argv) > 6 else "adamw"
        try:
            run(sys.argv[4], arm, 1, runs_dir=runs_dir, clock_factory=lambda name: clock)
            seen = {"finished": True}
        except BaseException as error:  # rank 0 when rank 1 is gone: what it said, for the test to read
            seen = {"finished": False, "error": f"{type(error).__name__}: {error}"}
            (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(seen), encoding="utf-8")
            raise
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(seen, indent=1), encoding="utf-8")
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
