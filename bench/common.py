"""What the per-update benches share: a built-in task set up from its shipped protocol in a scratch folder.

``setup(work, "digits")`` writes the task's data and the seed-1 parent under ``work`` (as ``opalctl init`` does) and
returns the task built with the protocol's own config, its training split, the parent's path and the protocol's
batch size, so a bench trains exactly what a formal run of that protocol would.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TASKS = ("digits", "pylm")


def block_arguments(description: str, shared_model: bool = False) -> argparse.Namespace:
    """The options of the interleaved-block benches: updates per block, blocks, the task, --json (and
    --shared-model where the bench offers it)."""
    parser = argparse.ArgumentParser(description=description)
    if shared_model:
        parser.add_argument("--shared-model", action="store_true",
                            help="every variant trains one model (each with its own optimizer), so that where a "
                                 "model's tensors lie falls on all variants alike")
    parser.add_argument("--updates", type=int, default=500, help="updates per block")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--task", choices=TASKS, default="digits",
                        help="digits (the target's task) or pylm (a 16 ms update, for scale)")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def setup(work: Path, name: str = "digits"):
    from opalctl.tasks.builtin import init

    init(name, work, seeds=[1])
    return prepared(work, name)


def prepared(work: Path, name: str = "digits"):
    """What ``setup`` returns, from a folder ``setup`` (or ``opalctl init``) has already written."""
    import yaml

    from opalctl.tasks import make_task

    protocol = yaml.safe_load((work / f"{name}.yaml").read_text())
    task = make_task(protocol["task"]["entry"], protocol["task"].get("config") or {})
    train = task.load({"train": work / protocol["data"]["train"]})["train"]
    parent = work / protocol["parents"].format(seed=1)
    return task, train, parent, int(protocol["training"]["batch_size"])
