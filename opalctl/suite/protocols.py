"""Each task's protocol, made from the suite: the task's own protocol (a built-in's template, or the protocol file
named) with the suite's name, arms and seeds, the task's budget rule, target and settings over it, and its paths
made relative to the folder the protocol is written in.

A built-in task's data and parents are written by ``opalctl init`` into the task's folder (with the task's
settings, so a suite may make a smaller task than the template's), which never overwrites a file with other bytes.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from opalctl.errors import BadInput
from opalctl.protocol.yamlfile import load_yaml_with_lines
from opalctl.suite.spec import Suite
from opalctl.tasks import BUILTIN, builtin

HEADER = ("# Written by `opalctl suite freeze {suite}` for its task {task}: the suite's arms and seeds over the task's\n"
          "# protocol. Edit the suite file, not this one, then freeze the suite again.\n")


def task_folder(folder: Path, task: str) -> Path:
    return folder / task


def protocol_path(folder: Path, suite: Suite, task: str) -> Path:
    return task_folder(folder, task) / f"{suite.protocol_name(task)}.yaml"


def base_protocol(suite: Suite, task: str, suite_path: Path, folder: Path, say) -> tuple[dict[str, Any], Path]:
    """The task's protocol before the suite's keys, and the folder its paths are relative to. A built-in task's
    data and parents are made here (``opalctl init``, with the task's settings)."""

    spec = suite.tasks[task]
    seeds = suite.seeds_of(task)
    if spec.builtin is not None:
        if spec.builtin not in BUILTIN:
            raise BadInput(f"{suite_path}: tasks.{task}.builtin: there is no built-in task {spec.builtin!r}; choose "
                           f"one of {', '.join(sorted(BUILTIN))}")
        where = task_folder(folder, task)
        say(f"init {spec.builtin} in {where} (data and one parent per seed; a minute or more for some tasks)")
        builtin.init(spec.builtin, where, seeds, config=spec.config)
        return yaml.safe_load(builtin.protocol_text(spec.builtin, seeds)), where
    source = (suite_path.parent / spec.protocol).resolve()
    if not source.is_file():
        raise BadInput(f"{suite_path}: tasks.{task}.protocol: {spec.protocol} is not a file; give a protocol file's "
                       f"path relative to the suite file")
    data, _ = load_yaml_with_lines(source)
    if not isinstance(data, dict):
        raise BadInput(f"{suite_path}: tasks.{task}.protocol: {spec.protocol} is not a protocol (a mapping); give a "
                       f"protocol file")
    if data.get("control") is not None:
        raise BadInput(f"{suite_path}: tasks.{task}.protocol: {spec.protocol} is a post-hoc control's protocol; a "
                       f"suite runs pre-registered protocols only")
    return data, source.parent


def task_protocol(suite: Suite, document: dict[str, Any], task: str, base: dict[str, Any], base_folder: Path,
                  target_folder: Path, suite_path: Path) -> dict[str, Any]:
    """The protocol of ``task`` as the suite makes it, its paths relative to ``target_folder``."""
    spec = suite.tasks[task]
    protocol = copy.deepcopy(base)
    protocol["name"] = suite.protocol_name(task)
    protocol["seeds"] = suite.seeds_of(task)
    # the suite's arms, in its order, each replaced whole by the task's own settings of it where it has them
    task_arms = (document["tasks"][task] or {}).get("arms") or {}
    protocol["arms"] = {arm: copy.deepcopy(task_arms.get(arm, settings)) for arm, settings in document["arms"].items()}
    if not isinstance(protocol.get("budget"), dict):
        protocol["budget"] = {}
    protocol["budget"].update(copy.deepcopy(spec.budget))
    if spec.config:
        task_spec = protocol.setdefault("task", {})
        task_spec["config"] = {**(task_spec.get("config") or {}), **copy.deepcopy(spec.config)}
    if spec.target is not None:
        protocol["target"] = spec.target.model_dump()
    elif "target" not in protocol:
        raise BadInput(f"{suite_path}: tasks.{task}: give a target ({{metric: SPLIT.METRIC, value: NUMBER}}); the "
                       f"suite's profiles compare the arms' time to it")
    protocol.update(copy.deepcopy(spec.overrides))
    if base_folder.resolve() != target_folder.resolve():
        _relocate(protocol, base_folder, target_folder)
    return protocol


def _relocate(protocol: dict[str, Any], base_folder: Path, target_folder: Path) -> None:
    """Data and parent paths of a protocol file, relative to the folder the suite writes its protocol in."""
    def moved(relative: Any) -> Any:
        if not isinstance(relative, str) or os.path.isabs(relative):
            return relative
        return os.path.relpath(os.path.join(base_folder.resolve(), relative), target_folder.resolve())

    if isinstance(protocol.get("data"), dict):
        protocol["data"] = {split: moved(path) for split, path in protocol["data"].items()}
    parents = protocol.get("parents")
    protocol["parents"] = ({seed: moved(path) for seed, path in parents.items()} if isinstance(parents, dict)
                           else moved(parents))


def protocol_text(suite: Suite, suite_path: Path, task: str, protocol: dict[str, Any]) -> str:
    return HEADER.format(suite=suite_path.name, task=task) + yaml.safe_dump(protocol, sort_keys=False,
                                                                             default_flow_style=None, width=100)
