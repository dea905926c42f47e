"""Every command that writes outside a run (report, export, show --html, init, freeze) tells a write the storage
refuses in one sentence naming the path and the way on, exit 1 (the storage faults' code, README), no traceback,
and leaves what an earlier call wrote whole; a runs folder that is a file is told the same way by ``run``.

The read-only and full disks are small tmpfs mounts the tests make (root and mount(8); elsewhere they skip as a
missing system component, which CI does not allow): chmod means nothing to root.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests import support
from tests.support.cli import call_cli, run_cli


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(name, size="1m")``: a tmpfs mounted at ``tmp_path / name``, unmounted at the end."""
    reason = f"{support.SYSTEM_SKIP} a tmpfs mount (root and mount(8))"
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(reason)
    mounted = []

    def mount(name: str, size: str = "1m"):
        folder = tmp_path / name
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"{reason}: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def read_only(folder) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)


def fill(folder) -> None:
    """Take every free block of ``folder``'s file system."""
    status = os.statvfs(folder)
    (folder / "ballast").write_bytes(b"\0" * (status.f_bavail * status.f_frsize))


def one_sentence(result, path, *words: str) -> str:
    """The command's one line: exit 1, nothing on stdout, no traceback, naming ``path`` and each of ``words``."""
    lines = result.stderr.strip().splitlines()
    assert result.code == 1 and result.stdout == "", result.output
    assert len(lines) == 1 and lines[0].startswith("opalctl: error: cannot write "), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    assert str(path) in lines[0] and all(word in lines[0] for word in words), lines[0]
    return lines[0]


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_report_export_and_show_html_on_a_read_only_disk_each_say_so_and_keep_what_they_wrote_before(
        finished_runs, tmpfs):
    lock, runs = finished_runs["lock"], finished_runs["runs"]
    run_dir = finished_runs["base"] / "adamw" / "seed-1"
    disk = tmpfs("disk")
    assert call_cli("report", lock, "--runs-dir", runs, "--out", disk / "pages").code == 0
    assert call_cli("export", lock, "--runs-dir", runs, "--tensorboard", disk / "tb").code == 0
    assert call_cli("show", run_dir, "--html", disk / "pages" / "run.html").code == 0
    read_only(disk)
    before = snapshot(disk)

    said = one_sentence(call_cli("report", lock, "--runs-dir", runs, "--out", disk / "pages"),
                        disk / "pages" / "report.html", "read-only", "make the folder writable")
    assert said.endswith("then run `opalctl report` again (or give --out a folder that can be written)"), said
    said = one_sentence(call_cli("export", lock, "--runs-dir", runs, "--tensorboard", disk / "tb"),
                        disk / "tb", "read-only")
    assert "run `opalctl export` again" in said, said
    one_sentence(call_cli("show", run_dir, "--html", disk / "pages" / "run.html"),
                 disk / "pages" / "run.html", "read-only", "run `opalctl show --html` again")
    one_sentence(call_cli("report", lock, "--runs-dir", runs, "--out", disk / "new" / "folder"),
                 disk / "new" / "folder" / "report.html", "read-only")
    assert snapshot(disk) == before


def test_an_export_that_fills_the_disk_keeps_the_earlier_export_and_leaves_no_part_of_its_own(
        finished_runs, tmpfs):
    lock, runs = finished_runs["lock"], finished_runs["runs"]
    disk = tmpfs("disk")
    assert call_cli("export", lock, "--runs-dir", runs, "--tensorboard", disk / "tb").code == 0
    earlier = snapshot(disk / "tb")
    fill(disk)

    # a child: the exporter's writer thread must not print past the sentence as the process ends
    result = run_cli("export", lock, "--runs-dir", runs, "--tensorboard", disk / "tb")
    said = one_sentence(result, disk / "tb", "the disk is full", "free space there")
    assert "run `opalctl export` again" in said and "Exception in thread" not in result.stderr, said
    assert snapshot(disk / "tb") == earlier


def test_init_freeze_and_demo_on_a_read_only_disk_say_so_and_name_their_own_way_on(digits_project, tmpfs):
    disk = tmpfs("disk", size="8m")
    shutil.copy(digits_project / "digits.yaml", disk / "digits.yaml")
    shutil.copytree(digits_project / "data", disk / "data")
    shutil.copytree(digits_project / "parents", disk / "parents")
    read_only(disk)
    before = snapshot(disk)

    said = one_sentence(call_cli("init", "digits", "--dir", disk / "new"), disk / "new", "read-only")
    assert said.endswith("then run `opalctl init digits` again (or give --dir a folder that can be written)"), said
    said = one_sentence(call_cli("freeze", disk / "digits.yaml"), disk / "digits.lock.json", "read-only")
    assert said.endswith("make the folder writable, then freeze again"), said
    demo = call_cli("demo", "--dir", disk / "demo")
    assert demo.code == 1 and "Traceback" not in demo.stderr, demo.output
    assert demo.stderr.strip().splitlines()[-1] == (
        f"opalctl: error: cannot write {disk / 'demo'}: the file system is read-only (Read-only file system); make "
        f"the folder writable, then run `opalctl demo` again (or give --dir a folder that can be written)"), demo.stderr
    assert snapshot(disk) == before


def test_a_file_where_a_folder_must_be_is_named_by_run_report_export_init_and_show_html(
        finished_runs, tmp_path, monkeypatch):
    lock, runs = finished_runs["lock"], finished_runs["runs"]
    run_dir = finished_runs["base"] / "adamw" / "seed-1"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    in_the_way = f"{blocker} is a file, not a folder; move it away or choose another place"

    monkeypatch.setenv("OPALCTL_RUNS", str(blocker))
    result = call_cli("run", lock, "--arm", "adamw", "--seed", "1")
    said = one_sentence(result, blocker, in_the_way)
    assert said.endswith(f"then `opalctl run {lock} --arm adamw --seed 1` continues the run"), said
    one_sentence(call_cli("report", lock, "--runs-dir", runs, "--out", blocker / "pages"), blocker, in_the_way)
    one_sentence(call_cli("export", lock, "--runs-dir", runs, "--tensorboard", blocker / "tb"), blocker, in_the_way)
    one_sentence(call_cli("init", "digits", "--dir", blocker / "project"), blocker, in_the_way)
    one_sentence(call_cli("show", run_dir, "--html", blocker / "run.html"), blocker, in_the_way)
    assert blocker.read_text() == "not a folder\n"


def test_show_html_into_a_folder_not_made_yet_makes_it(finished_runs, tmp_path):
    run_dir = finished_runs["base"] / "adamw" / "seed-1"
    target = tmp_path / "not" / "made" / "yet" / "run.html"
    result = call_cli("show", run_dir, "--html", target)
    assert result.code == 0 and f"wrote {target}" in result.stderr, result.output
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
