"""``opalctl grid``: every arm and seed of a lock, on a bounded local pool or on Slurm (docs/grid.md).

The Python API: ``run_grid(lock_path, *, arms=None, seeds=None, jobs=None, executor="local", runs_dir=None,
display=None) -> GridResult`` and ``live_display(json_mode)``, the display the CLI uses. Nothing heavy is
imported here: torch loads only in the runs' own processes.
"""

from opalctl.grid.display import live_display
from opalctl.grid.records import GridResult, RunOutcome
from opalctl.grid.runner import run_grid

__all__ = ["GridResult", "RunOutcome", "live_display", "run_grid"]
