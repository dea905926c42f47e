"""What the confined training process of an agent arm may leave in its folder of the run, ``training/``.

Landlock lets that process write beneath ``training/`` alone, and one file it writes is bounded by RLIMIT_FSIZE
(opalctl/sandbox.py), but nothing in the kernel bounds how much it writes there in all. So the evaluator, a
process no agent code runs in, measures the folder from outside at every stage (``training_folder_excess``: the
blocks actually used, links not followed, a file with several names counted once) against
``limits.training_folder_bytes`` (``training_folder_bytes``). A run that ends there can be resumed: at a resume,
under the run folder's lock, ``clear_strays`` removes from ``training/`` every file and folder the run itself
never writes (and the temporary files of atomic writes a crash left), so the folder holds the run's own again.

What the run writes there (layout.py names each): a checkpoint per stage (``stage-NN.pt``), ``resume.pt``,
``steps.jsonl.gz``, and the agent optimizer's records in ``opal/`` (opal/records.py: ``events.jsonl``,
``losses.jsonl``, ``reports.jsonl``, ``programs/vNNN/`` with the two program files, ``decisions/NNN/`` with the
decision's files; opal/hangs.py: ``hung.jsonl``; opal/optimizer.py: the agent's ``workspace/``, kept whole).

Between two stages the folder may grow past its bound (each file within RLIMIT_FSIZE) until the next check or
until the disk refuses; and many empty files use inodes, not blocks, so they are not counted.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from opalctl.files import size_text
from opalctl.layout import DECISIONS, HUNG, OPAL, OPAL_STREAM_FILES, PROGRAMS, RESUME, STEPS, WORKSPACE, RunLayout
from opalctl.opal.programs import PROGRAM_FILES
from opalctl.opal.records import MESSAGE, META, RESPONSE, TRANSCRIPT

AUTO = "auto"
RECORDS_BYTES = 1 << 30  # auto: room for the steps file and the agent optimizer's records beside the checkpoints

FILE, WHOLE = "file", "whole"  # a regular file of the run; a folder kept with everything in it
STAGE_CHECKPOINT = re.compile(r"^stage-\d{2,}\.pt$")  # layout.stage_name: two digits or more
RECORD_STREAMS = (*OPAL_STREAM_FILES.values(), HUNG)  # opal/records.py, opal/hangs.py
DECISION_FILES = (MESSAGE, RESPONSE, META, TRANSCRIPT)  # opal/decisions.py's apply
OWN = {  # the run's own tree beneath training/: a name (or a pattern) to FILE, WHOLE or the tree beneath it
    STAGE_CHECKPOINT: FILE, RESUME: FILE, STEPS: FILE,
    OPAL: {**dict.fromkeys(RECORD_STREAMS, FILE), WORKSPACE: WHOLE,
           PROGRAMS: {re.compile(r"^v\d{3,}$"): dict.fromkeys(PROGRAM_FILES, FILE)},  # layout.version_name
           DECISIONS: {re.compile(r"^\d{3,}$"): dict.fromkeys(DECISION_FILES, FILE)}},
}


def training_folder_bytes(limits, stages: int) -> tuple[int, str]:
    """``limits.training_folder_bytes`` in bytes for a protocol of ``stages`` budget fractions, and the rule that
    gave it. ``auto`` depends on the protocol alone, so every run of a lock has the same bound."""
    if limits.training_folder_bytes != AUTO:
        return int(limits.training_folder_bytes), "limits.training_folder_bytes"
    checkpoints = int(stages) + 2
    return (checkpoints * int(limits.checkpoint_bytes) + RECORDS_BYTES,
            f"limits.training_folder_bytes auto: {checkpoints} checkpoints of limits.checkpoint_bytes (one per stage, "
            f"the resume checkpoint and one being written) and 1 GiB for the steps and the agent optimizer's records")


def training_folder_excess(layout: RunLayout, limit: int) -> str | None:
    """None while ``layout.training`` uses at most ``limit`` bytes of disk; past it, the sentence the run ends
    with: how much, the largest entries, and what continues the run (a resume when what the run did not write
    is what overflows; a larger ``limits.training_folder_bytes`` when the run's own files do). Cheap enough for
    every stage: one walk, no file read; the training process may change the folder meanwhile, and an entry that
    goes or turns into a link on the way is skipped, never followed."""
    folder = layout.training
    survey = _survey(folder)
    if survey.deep:
        return f"the training process made folders nested more than {MAX_DEPTH} deep in {folder} " \
               f"({layout.name_of(survey.deep[0])}), which the run never makes and limits.training_folder_bytes " \
               f"cannot measure; resume the run with --resume, which first removes what the run itself did not " \
               f"write there"
    if survey.total <= limit:
        return None
    stray = sum(survey.sizes[path] for path in survey.strays)
    largest = sorted(((path, size) for path, size in survey.sizes.items() if path.parent == folder),
                     key=lambda item: -item[1])[:3]
    shown = ", ".join(f"{layout.name_of(path)} {size_text(size)}" for path, size in largest)
    said = f"the training process uses {size_text(survey.total)} of disk in {folder}, past " \
           f"limits.training_folder_bytes ({size_text(limit)}; the largest: {shown})"
    if survey.total - stray <= limit:
        return f"{said}; resume the run with --resume, which first removes the {size_text(stray)} the run itself " \
               f"did not write there"
    return f"{said}; the run's own files take {size_text(survey.total - stray)}, so freeze the protocol again with " \
           f"a larger limits.training_folder_bytes"


def clear_strays(layout: RunLayout) -> list[str]:
    """Remove from ``layout.training`` everything the run itself never writes there (``OWN``), links and stale
    temporary files included, without following a link; the names removed (as records name them). Call it at a
    resume, under the run folder's lock, before any process of the run opens a file there (nothing changes the
    folder then). A folder made before ``training/`` existed (``layout.legacy``) holds the records too: nothing
    is removed from it."""
    if layout.legacy:
        return []
    removed = []
    for path in _survey(layout.training).strays:
        if stat.S_ISDIR(path.lstat().st_mode):
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        removed.append(layout.name_of(path))
    return sorted(removed)


MAX_DEPTH = 64  # folders deeper than this are not entered (each level holds one descriptor open while walked)


class _Survey(NamedTuple):
    total: int  # the disk the folder uses: its blocks, each file once however many names it has
    sizes: dict[Path, int]  # each entry's, a folder's with everything it holds
    strays: list[Path]  # what OWN does not name as it is, topmost only (a stray folder goes whole)
    deep: list[Path]  # folders not entered, MAX_DEPTH down


def _survey(folder: Path) -> _Survey:
    """One walk of ``folder``: what it uses and what the run did not write there."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # no training folder yet, or a link where it should be
        return _Survey(0, {}, [], [])
    total, counted, deep = _blocks(os.fstat(fd)), set(), []
    sizes: dict[Path, int] = {}
    held_by: list[tuple[Path, Path]] = []  # (entry, its folder), each folder before what it holds
    rules: dict[Path, dict] = {folder: OWN}  # the part of OWN that names what a folder holds
    strays: list[Path] = []
    for path, info, here in _entries(fd, folder, 1, deep):
        sizes[path] = 0 if (info.st_dev, info.st_ino) in counted else _blocks(info)
        counted.add((info.st_dev, info.st_ino))
        held_by.append((path, here))
        tree = rules.get(here)
        if tree is None:  # beneath a stray folder, or one kept whole
            continue
        rule = _rule_of(tree, path.name)
        if rule == FILE and stat.S_ISREG(info.st_mode) or rule == WHOLE and stat.S_ISDIR(info.st_mode):
            continue
        if isinstance(rule, dict) and stat.S_ISDIR(info.st_mode):
            rules[path] = rule
            continue
        strays.append(path)
    for path, here in reversed(held_by):  # what a folder holds is added to it before it is added to its own
        if here == folder:
            total += sizes[path]
        else:
            sizes[here] += sizes[path]
    return _Survey(total, sizes, strays, deep)


def _entries(fd: int, here: Path, depth: int, deep: list[Path]) -> Iterator[tuple[Path, os.stat_result, Path]]:
    """Every entry beneath the folder open as ``fd`` (which it closes): its path, its own status (a link's, not
    its target's) and the folder holding it, each folder before what it holds. Each folder is opened relative to
    the one holding it and never through a link, so a folder swapped for a link on the way is not entered."""
    try:
        listed = []
        with os.scandir(fd) as listing:
            for entry in listing:
                try:
                    listed.append((entry.name, entry.stat(follow_symlinks=False)))
                except OSError:  # gone since it was listed
                    continue
        for name, info in listed:
            path = here / name
            yield path, info, here
            if not stat.S_ISDIR(info.st_mode):
                continue
            if depth >= MAX_DEPTH:
                deep.append(path)
                continue
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:  # gone, or no longer a folder
                continue
            yield from _entries(child, path, depth + 1, deep)
    finally:
        os.close(fd)


def _rule_of(tree: dict, name: str):
    for key, rule in tree.items():
        if key == name if isinstance(key, str) else key.match(name):
            return rule
    return None


def _blocks(info: os.stat_result) -> int:
    blocks = getattr(info, "st_blocks", None)
    return 512 * blocks if blocks is not None else info.st_size  # st_blocks counts 512-byte units
