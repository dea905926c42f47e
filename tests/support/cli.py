"""The one way tests run the command line: ``run_cli`` in a child process (what a user types: exit codes seen
from outside, children that are killed, a package other than this one on the path) and ``call_cli`` through
``opalctl.cli.main`` in this process (much faster: torch is already imported). Both answer a ``CliResult``,
which also unpacks as ``code, stdout, stderr``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def json(self):
        return json.loads(self.stdout)

    def __iter__(self) -> Iterator:
        return iter((self.code, self.stdout, self.stderr))


def opalctl_command(*args) -> list[str]:
    """``python -m opalctl ARGS`` as an argument list, for a child a test starts and leaves running."""
    return [sys.executable, "-m", "opalctl", *map(str, args)]


def child_env(extra: dict[str, str] | None = None, *, clean: bool = False) -> dict[str, str]:
    """This process's environment for a child, without ``OPALCTL_DEBUG`` (with ``clean``: without any
    ``OPALCTL_`` or ``PYTEST_`` variable), ``NO_COLOR`` set, and ``extra`` added."""
    drop = ("OPALCTL_", "PYTEST_") if clean else ("OPALCTL_DEBUG",)
    env = {key: value for key, value in os.environ.items() if not key.startswith(drop)}
    env["NO_COLOR"] = "1"
    env.update(extra or {})
    return env


def run_cli(*args, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
            timeout: float = 180, clean: bool = False) -> CliResult:
    """``python -m opalctl ARGS`` in a child process; ``env`` adds to (not replaces) this process's environment,
    less any ``OPALCTL_`` and ``PYTEST_`` variable with ``clean`` (``child_env``)."""
    completed = subprocess.run(opalctl_command(*args), cwd=cwd, env=child_env(env, clean=clean), capture_output=True,
                               text=True, timeout=timeout)
    return CliResult(completed.returncode, completed.stdout, completed.stderr)


def call_cli(*args) -> CliResult:
    """``opalctl.cli.main(ARGS)`` in this process, with stdout and stderr captured and SystemExit caught."""
    from opalctl.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main([str(a) for a in args])
        except SystemExit as exit_:
            code = exit_.code
    if code is None:
        code = 0
    if not isinstance(code, int):  # sys.exit("text") prints the text and exits 1
        stderr.write(f"{code}\n")
        code = 1
    return CliResult(code, stdout.getvalue(), stderr.getvalue())
