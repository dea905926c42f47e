"""The watch's readers on folders made by hand (no run): a run the grid has spawned and not yet locked is starting,
not failed; the loss curve keeps the last steps lines in order across gzip members, a member being written included; the sparkline's shape."""

from __future__ import annotations

import gzip
import json

from opalctl.grid.local import LOG_HEADER
from opalctl.grid.progress import StepsTail
from opalctl.layout import RunLayout
from opalctl.watch.reader import observed_state
from opalctl.watch.render import sparkline


def test_a_run_whose_log_holds_only_the_grids_header_is_starting_and_one_with_its_own_words_failed(tmp_path):
    folder = tmp_path / "runs" / "digits-0123456789ab" / "adamw" / "seed-1"
    folder.mkdir(parents=True)
    layout = RunLayout.of(folder)
    assert observed_state(layout) == "not started"
    layout.grid_log.write_text(f"{LOG_HEADER} 2026-12-03T14:00:00Z: opalctl run x.lock.json --arm adamw --seed 1\n")
    assert observed_state(layout) == "starting"
    with layout.grid_log.open("a") as log:
        log.write("opalctl: error: 1 frozen input no longer matches lock x.lock.json; freeze again\n")
    assert observed_state(layout) == "failed"


def test_the_kept_steps_lines_are_the_last_ones_in_order_across_members_and_a_member_being_written(tmp_path):
    path = tmp_path / "steps.jsonl.gz"
    lines = [json.dumps({"update": n, "used": float(n), "loss": 1.0 / n}) + "\n" for n in range(1, 31)]
    path.write_bytes(gzip.compress("".join(lines[:20]).encode()))
    tail = StepsTail(path, keep=8)
    assert tail.read()["update"] == 20 and [line["update"] for line in tail.recent] == list(range(13, 21))
    member = gzip.compress("".join(lines[20:]).encode())
    with path.open("ab") as handle:
        handle.write(member[:len(member) // 2])  # a member being written: only its complete lines so far
    partway = tail.read()["update"]
    assert 20 <= partway < 30 and [line["update"] for line in tail.recent] == list(range(partway - 7, partway + 1))
    with path.open("ab") as handle:
        handle.write(member[len(member) // 2:])
    assert tail.read()["update"] == 30 and [line["update"] for line in tail.recent] == list(range(23, 31))


def test_the_sparkline_falls_with_a_falling_loss_and_is_flat_for_a_constant_one():
    assert sparkline([4.0, 3.0, 2.0, 1.0]) == "█▆▃▁"
    assert len(sparkline([float(n) for n in range(100)], width=16)) == 16
    assert sparkline([2.0] * 5) == "▅▅▅▅▅" and sparkline([None, None]) == ""


def test_a_posix_lock_held_by_another_process_reads_as_running_and_is_only_asked_about(tmp_path):
    """What an NFS client makes of a run's flock held on another node: a POSIX lock, which /proc/locks here does
    not tie to the run; the watch asks about it (F_GETLK) and never takes it."""
    import subprocess
    import sys

    folder = tmp_path / "arm" / "seed-1"
    folder.mkdir(parents=True)
    layout = RunLayout.of(folder)
    layout.folder_lock.write_bytes(b"")
    (folder / "start.json").write_text("{}")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); fcntl.lockf(f, fcntl.LOCK_EX); print('held', "
        "flush=True); time.sleep(60)"), str(layout.folder_lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert observed_state(layout) == "running"
        assert holder.poll() is None, "asking took nothing from the holder"
    finally:
        holder.kill()
        holder.wait()
    assert observed_state(layout) == "interrupted"


def test_grid_status_says_starting_for_a_run_spawned_but_not_yet_in_its_folder(tmp_path):
    """grid --status words a run as watch does (one ``state_word``): before, a run the grid had just spawned read
    as failed until it took its folder's lock."""
    from opalctl.grid.local import LOG_HEADER
    from opalctl.grid.status import state_word
    from opalctl.layout import NEW, RunLayout

    layout = RunLayout.of(tmp_path / "runs" / "digits-0123456789ab" / "adamw" / "seed-1")
    assert state_word(layout, NEW) == "not started"
    layout.root.mkdir(parents=True)
    layout.grid_log.write_text(f"{LOG_HEADER} 2026-12-03 15:00:00: opalctl run x --arm adamw --seed 1\n")
    assert state_word(layout, NEW) == "starting"
    with layout.grid_log.open("a") as log:
        log.write("opalctl: error: arm adamw: something refused\n")
    assert state_word(layout, NEW) == "failed"
