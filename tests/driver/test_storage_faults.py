"""A full disk or a read-only folder stops a run in one sentence that names the file being written and says that
freeing space (or making the folder writable) and ``opalctl run ... --resume`` continues; it does, to the weights
of an uninterrupted run.

The runs live on a small tmpfs the test mounts (it needs root and mount(8); elsewhere it skips as a missing
system component, which CI does not allow), filled with a ballast file until a run no longer fits, then remounted
read-only (chmod means nothing to root).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from tests import support
from tests.support.cli import call_cli


@pytest.fixture
def disk(tmp_path):
    """A 1 MiB tmpfs at ``tmp_path / "disk"``, unmounted at the end."""
    folder = tmp_path / "disk"
    folder.mkdir()
    reason = f"{support.SYSTEM_SKIP} a tmpfs mount (root and mount(8))"
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(reason)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"{reason}: {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def remount(folder, mode):
    subprocess.run(["mount", "-o", f"remount,{mode}", str(folder)], check=True)


def one_line(err):
    """The run's one sentence: the last line, and the only one of opalctl's own (the others are its stages)."""
    said = [line for line in err.strip().splitlines() if line.startswith("opalctl:")]
    assert len(said) == 1 and err.strip().endswith(said[0]) and said[0].startswith("opalctl: error: cannot write "), err
    return said[0]


def test_a_full_disk_then_a_read_only_one_stop_the_run_in_one_sentence_and_resume_ends_with_the_same_weights(
        pausing, pausing_reference, disk):
    project, (reference_dir, uninterrupted) = pausing, pausing_reference
    model_bytes = (reference_dir / "initial.pt").stat().st_size
    # room for the start (the anchor, initial.pt, start.json, the first resume checkpoint: about 4 models), not for
    # the first stage's checkpoint and the second resume checkpoint beside the first
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "ballast").write_bytes(b"\0" * (free - 6 * model_bytes))
    run_dir = project.run_dir("adamw", 1, runs=disk)
    resume = shlex.join(["opalctl", *project.run_args("adamw", 1, "--resume", runs=disk)])

    code, out, err = call_cli(*project.run_args("adamw", 1, runs=disk))
    line = one_line(err)
    assert code == 1 and out == "" and str(run_dir) in line and "the disk is full" in line, line
    assert line.endswith(f"free space there, then `{resume}` continues the run"), line
    assert (run_dir / "training" / "resume.pt").exists() and not (run_dir / "report.json").exists()
    assert not list(run_dir.glob(".*.tmp")), "a refused write leaves no temporary file"

    (disk / "ballast").unlink()
    remount(disk, "ro")
    before = support.snapshot(disk)
    code, out, err = call_cli(*project.run_args("adamw", 1, "--resume", runs=disk))
    line = one_line(err)
    assert code == 1 and str(run_dir.parent) in line and "read-only" in line, line
    assert line.endswith(f"make the folder writable, then `{resume}` continues the run"), line
    remount(disk, "rw")
    assert support.snapshot(disk) == before

    code, _, err = call_cli(*shlex.split(resume)[1:])
    assert code == 0, err
    report = support.read(run_dir / "report.json")
    assert report["final_model_sha256"] == uninterrupted["final_model_sha256"] and report["resumes"] >= 1
    assert support.files_of(run_dir) == support.FINISHED_FILES


@pytest.mark.parametrize("in_process", [False, True], ids=["helper process", "in-process twin"])
def test_the_steps_records_on_a_full_disk_end_in_the_sentence_every_writer_uses_naming_their_file(disk, in_process):
    import numpy as np

    from opalctl.driver.records import StepsWriter
    from opalctl.errors import StorageFault

    (disk / "ballast").write_bytes(b"\0" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize))
    path = disk / "steps.jsonl.gz"
    writer = StepsWriter(path, in_process=in_process)
    with pytest.raises(StorageFault) as refused:
        for update in range(1, 2049):
            writer.add(update, 1.0, float(update), 0.001, 0.5, np.arange(64) + update)
        writer.begin_sync()
        writer.finish_sync()
    writer.abandon()
    assert refused.value.message == (f"cannot write {path}: the disk is full (No space left on device); free space "
                                     f"there, then `opalctl run ... --resume` continues the run")
