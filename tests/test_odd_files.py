"""Every file opalctl did not just write is read one way (``files.read_plain``): a regular file within a size limit of
its kind, JSON nested within a depth. A FIFO where a record is expected is refused at once, never waited on; a
device such as /dev/zero is refused before a byte is read, never read until memory runs out; a link is refused as a
link; JSON nested a hundred thousand deep is refused, never a RecursionError. Each is one sentence naming the file.

Each kind of file a run folder holds, and the lock, is replaced in turn by a FIFO, by a /dev/zero device node and by
a link to /dev/zero, under every command that reads it (verify, show, compare, report, export), in this process
with an alarm: a command that waited on the FIFO would be stopped by the alarm and fail the case."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest

from tests.support.cli import call_cli

SECONDS_PER_CASE = 20
RUN = "adamw/seed-1"
AGENT_RUN = "agent/seed-1"
# each kind of file: where it lies under the lock's runs folder, and the run folder it belongs to
KINDS = {
    "start.json": (f"{RUN}/start.json", RUN),
    "stage record": (f"{RUN}/stage-01.json", RUN),
    "last.json": (f"{RUN}/last.json", RUN),
    "selected.json": (f"{RUN}/selected.json", RUN),
    "report.json": (f"{RUN}/report.json", RUN),
    "anchor.json": ("anchors/seed-1/anchor.json", RUN),
    "steps": (f"{RUN}/training/steps.jsonl.gz", RUN),
    "stage checkpoint": (f"{RUN}/training/stage-01.pt", RUN),
    "events.jsonl": (f"{AGENT_RUN}/training/opal/events.jsonl", AGENT_RUN),
    "decision record": (f"{AGENT_RUN}/agent/decisions/001/answer.json", AGENT_RUN),
}
COMMANDS = ("verify", "show", "compare", "report", "export")


@pytest.fixture(scope="module")
def copied(finished_runs, tmp_path_factory) -> dict[str, Path]:
    """A copy of the finished runs and their project, to put odd files into (each case puts the file back)."""
    root = tmp_path_factory.mktemp("odd-files")
    shutil.copytree(finished_runs["project"], root / "project")
    shutil.copytree(finished_runs["runs"], root / "runs")
    lock = root / "project" / finished_runs["lock"].name
    return {"lock": lock, "runs": root / "runs", "base": root / "runs" / finished_runs["base"].name, "root": root}


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_zero_device(path: Path) -> None:
    zero = os.stat("/dev/zero").st_rdev
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, zero)
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD (the link to /dev/zero is tried in its place)")


def make_zero_link(path: Path) -> None:
    path.symlink_to("/dev/zero")


ODD = {"fifo": make_fifo, "/dev/zero": make_zero_device, "link to /dev/zero": make_zero_link}


@contextlib.contextmanager
def replaced(path: Path, make):
    aside = path.with_name(path.name + ".aside")
    os.replace(path, aside)
    try:
        make(path)
        yield
    finally:
        path.unlink()
        os.replace(aside, path)


class TookTooLong(Exception):
    pass


def within_time(call, *args):
    """``call(*args)`` stopped by an alarm after ``SECONDS_PER_CASE`` (a blocking open of a FIFO is interrupted)."""

    def alarm(signum, frame):
        raise TookTooLong(f"still running after {SECONDS_PER_CASE} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS_PER_CASE)
    started = time.monotonic()
    try:
        return call(*args), time.monotonic() - started
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def command_line(command: str, copied: dict[str, Path], run: str, tmp_path: Path) -> tuple:
    lock, runs = copied["lock"], copied["runs"]
    return {"verify": ("verify", copied["base"] / run), "show": ("show", copied["base"] / run),
            "compare": ("compare", lock, "--runs-dir", runs),
            "report": ("report", lock, "--runs-dir", runs, "--out", tmp_path / "page"),
            "export": ("export", lock, "--runs-dir", runs, "--tensorboard", tmp_path / "tb")}[command]


def assert_refused_naming(result, seconds: float, name: str) -> None:
    assert result.code in (1, 2, 3), result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    assert name in result.output, result.output
    assert "opalctl: error: " in result.stderr, result.output
    assert seconds < SECONDS_PER_CASE


@pytest.mark.parametrize("odd", list(ODD))
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_odd_file_where_a_record_lies_is_refused_at_once_by_every_reader(copied, tmp_path, kind,
                                                                            odd):
    relative, run = KINDS[kind]
    path = copied["base"] / relative
    assert path.is_file()
    with replaced(path, ODD[odd]):
        for command in COMMANDS:
            result, seconds = within_time(call_cli, *command_line(command, copied, run, tmp_path))
            assert_refused_naming(result, seconds, path.name)
    assert call_cli("verify", copied["base"] / run).code == 0, "the folder is whole again"


@pytest.mark.parametrize("odd", list(ODD))
def test_an_odd_file_in_place_of_the_lock_is_refused_at_once_by_every_reader(copied, tmp_path, odd):
    lock = copied["lock"]
    with replaced(lock, ODD[odd]):
        for command in ("verify", "compare", "report", "export"):
            line = ("verify", lock) if command == "verify" else command_line(command, copied, RUN, tmp_path)
            result, seconds = within_time(call_cli, *line)
            assert_refused_naming(result, seconds, lock.name)
            assert result.code == 2 and result.stderr.count("\n") == 1, result.output
        result, seconds = within_time(call_cli, "run", lock, "--arm", "idle", "--seed", "1", "--runs-dir",
                                      tmp_path / "runs")
        assert_refused_naming(result, seconds, lock.name)
        assert not (tmp_path / "runs").exists()


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("kind", ["start.json", "report.json", "anchor.json", "events.jsonl", "decision record"])
def test_json_nested_a_hundred_thousand_deep_is_one_sentence_not_a_recursion_error(copied, tmp_path,
                                                                                   kind):
    relative, run = KINDS[kind]
    path = copied["base"] / relative
    with replaced(path, lambda target: target.write_bytes(DEEP + b"\n")):
        for command in COMMANDS:
            result, seconds = within_time(call_cli, *command_line(command, copied, run, tmp_path))
            assert_refused_naming(result, seconds, path.name)
            assert "Recursion" not in result.output


def test_a_lock_nested_a_hundred_thousand_deep_is_one_sentence(tmp_path):
    lock = tmp_path / "deep.lock.json"
    lock.write_bytes(b'{"format": "opalctl-lock/1", "x": ' + DEEP + b"}")
    result = call_cli("verify", lock)
    assert result.code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"lock {lock} is not valid JSON (it is nested deeper than" in result.stderr


def test_a_record_over_its_kinds_limit_is_refused_before_it_is_read(tmp_path):
    from opalctl.formats import RecordDamaged, StartRecord, read_record

    path = tmp_path / "start.json"
    with open(path, "wb") as handle:
        handle.truncate(StartRecord.MAX_BYTES + 1)  # sparse: nothing is written, and nothing may be read
    with pytest.raises(RecordDamaged, match=f"over the limit of {StartRecord.MAX_BYTES}"):
        read_record(path, StartRecord)


@pytest.mark.parametrize("odd", list(ODD))
def test_freeze_refuses_an_odd_file_where_its_lock_goes_at_once(digits_project, odd):
    """freeze reads the lock already there (to keep it if it is replaced): never a FIFO waited on."""
    lock = digits_project / "digits.lock.json"
    ODD[odd](lock)
    result, seconds = within_time(call_cli, "freeze", digits_project / "digits.yaml", "--force")
    assert result.code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"{lock} is where the lock goes, and it cannot be read as one" in result.stderr
    assert seconds < SECONDS_PER_CASE and not stat.S_ISREG(os.lstat(lock).st_mode)


@pytest.mark.parametrize("odd", list(ODD))
@pytest.mark.parametrize("kind", ["start.json", "steps"])
def test_grid_status_reads_past_an_odd_file_where_its_progress_lies(copied, kind, odd):
    """``grid --status`` reads the budget from start.json and the progress from the steps file of a run that has not
    finished: a FIFO there is never waited on and /dev/zero never read, the status is shown without those figures."""
    relative, run = KINDS[kind]
    path, report = copied["base"] / relative, copied["base"] / KINDS["report.json"][0]
    os.replace(report, report.with_name("report.json.aside"))  # the run reads as one that has not finished
    try:
        with replaced(path, ODD[odd]):
            result, seconds = within_time(call_cli, "grid", copied["lock"], "--status", "--runs-dir",
                                          copied["runs"])
    finally:
        os.replace(report.with_name("report.json.aside"), report)
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    assert result.code in (0, 1), result.output
    assert seconds < SECONDS_PER_CASE
