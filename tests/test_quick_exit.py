"""``quick_exit.end_without_teardown`` in real child processes: what a normal exit does that matters still happens
(atexit handlers, the exit code, a file left open keeps what was written to it), and where it must not act it
does not (no torch, a thread of the process's own still running)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r'''
import atexit, sys, threading
from pathlib import Path

folder = Path(sys.argv[1])
if sys.argv[2] == "torch":
    import torch  # noqa: F401
left_open = open(folder / "left-open.txt", "w")  # never closed: a task's log
left_open.write("the tail a normal exit would flush")
atexit.register(lambda: (folder / "atexit.txt").write_text("ran"))
if sys.argv[3] == "thread":
    threading.Thread(target=lambda: __import__("time").sleep(0.5)).start()
from opalctl.quick_exit import end_without_teardown

print("before the end", flush=False)
end_without_teardown(int(sys.argv[4]))
(folder / "returned.txt").write_text("the usual exit follows")
sys.exit(int(sys.argv[4]))
'''


@pytest.mark.parametrize(("imports", "thread", "quick"), [("torch", "none", True), ("none", "none", False),
                                                          ("torch", "thread", False)])
def test_the_end_keeps_what_a_normal_exit_does_and_acts_only_where_it_should(tmp_path, imports, thread, quick):
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), imports, thread, "7"], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 7 and child.stdout == "before the end\n", child.stderr
    assert (tmp_path / "left-open.txt").read_text() == "the tail a normal exit would flush"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "returned.txt").exists() is not quick
