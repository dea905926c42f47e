"""What the tests share beyond fixtures, importable (``from tests.support import ...``; pyproject.toml puts the
repository root on the path): conftest modules cannot be imported under ``--import-mode=importlib``, so helpers
kept there had to be handed to tests through fixtures.

- ``tests.support.files``: reading and comparing files and folders (``read``, ``snapshot``, ``tree``, ...).
- ``tests.support.cli``: the one way to run the command line, in a child process (``run_cli``) or in this process
  (``call_cli``), both answering a ``CliResult``.
- ``tests.support.runs``: building formal runs: ``Project`` (a copy of the digits project, frozen as a test needs),
  the arms and tasks tests share, children started and waited on, and runs stopped at a known point.
- ``tests.support.grids``: the same for grids (a task held at an update, a grid's JSON lines, a folder's lock
  held by another process).

The names of ``files``, ``cli`` and ``runs`` are also here, so ``from tests import support`` then ``support.read``
reads as well as the full module path.
"""

from tests.support.cli import CliResult, call_cli, child_env, opalctl_command, run_cli
from tests.support.files import (
    REPO,
    SEEDS,
    SYSTEM_SKIP,
    files_of,
    flip_byte,
    read,
    sha256_of,
    snapshot,
    stage_files,
    tree,
)
from tests.support.runs import (
    ADAMW,
    ADAMW_HIGH,
    CHILD_TIMEOUT,
    DEFAULT_UPDATER,
    DENOMINATORS,
    FINISHED_FILES,
    HALVED,
    KILLABLE_TASK,
    LENIENT,
    PAUSE_TASK,
    RATIONALE,
    Project,
    messages_server,
    spawn,
    wait_for,
)

__all__ = ["ADAMW", "ADAMW_HIGH", "CHILD_TIMEOUT", "DEFAULT_UPDATER", "DENOMINATORS", "FINISHED_FILES", "HALVED",
           "KILLABLE_TASK", "LENIENT", "PAUSE_TASK", "RATIONALE", "REPO", "SEEDS", "SYSTEM_SKIP", "CliResult",
           "Project", "call_cli", "child_env", "files_of", "flip_byte", "messages_server",
           "opalctl_command", "read", "run_cli", "sha256_of", "snapshot", "spawn", "stage_files", "tree",
           "wait_for"]
