"""What would hang or fail at run is refused at freeze: one sentence naming the key, exit 2, no lock written.

Each case here froze (or ended freeze in an internal error) before these checks existed; the run then looped
forever, trained a whole budget and failed, or printed an internal error.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from opalctl.protocol.schema import ProtocolError, load_protocol, parse, validate
from opalctl.protocol.yamlfile import load_yaml_with_lines
from opalctl.tasks.builtin import protocol_text
from tests.support.cli import call_cli, run_cli

BASE = protocol_text("digits", [1, 2])
OPTIMIZER_LINE = "adamw:        {optimizer: {name: AdamW, lr: 1.0e-3, weight_decay: 0.01}}"
TRAINING_LINE = "training: {batch_size: 64, gradient_clip: 2.0}"


def edited(old: str, new: str, text: str = BASE) -> str:
    assert text.count(old) == 1, f"{old!r} is not unique in the protocol"
    return text.replace(old, new)


def freeze_text(folder: Path, text: str):
    path = folder / "digits.yaml"
    path.write_text(text, encoding="utf-8")
    return path, call_cli("freeze", path)


def refused(folder: Path, text: str, key: str, *fragments: str) -> str:
    """Freeze ``text`` in ``folder``: exit 2, one line on stderr naming the file and ``key``, no lock."""
    path, result = freeze_text(folder, text)
    assert result.code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"opalctl: error: {path}"), result.stderr
    assert f" {key}" in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert not list(folder.glob("*.lock.json"))
    return result.stderr


def optimizer(arguments: str) -> str:
    return edited(OPTIMIZER_LINE, "adamw:        {optimizer: {" + arguments + "}}")


# --------------------------------------------------------------------------------------------------------------
# budgets and schedules that never end


def test_a_tiny_checkpoint_every_is_refused(digits_project):
    text = edited(TRAINING_LINE, "training: {batch_size: 64, checkpoint_every: 1.0e-12}")
    refused(digits_project, text, "training.checkpoint_every", "0.001")


@pytest.mark.parametrize("amount", ["1.0e-300", "0.001", "1.0e+300"])
def test_a_seconds_budget_out_of_range_is_refused(digits_project, amount):
    refused(digits_project, edited("amount: 20", f"amount: {amount}"), "budget.amount",
            "between 0.01 and 1e+08 seconds")


@pytest.mark.parametrize("amount, left, fragment", [(2, "0.6", "outside 1 to"), (4, "1.2", "whole updates")])
def test_a_multiplier_leaving_part_of_an_update_is_refused(digits_project, amount, left, fragment):
    text = edited("budget_multiplier: 3}", "budget_multiplier: 0.3}",
                  edited("clock: cpu, amount: 20", f"clock: updates, amount: {amount}"))
    refused(digits_project, text, "arms.adamw-long.budget_multiplier", f"{left} updates", fragment)


def test_a_multiplier_taking_the_budget_past_its_range_is_refused(digits_project):
    text = edited("budget_multiplier: 3}", "budget_multiplier: 100}", edited("amount: 20", "amount: 9.0e+7"))
    refused(digits_project, text, "arms.adamw-long.budget_multiplier", "outside")


def test_a_whole_multiplier_of_an_updates_budget_is_accepted(digits_project):
    text = edited("budget_multiplier: 3}", "budget_multiplier: 0.5}",
                  edited("clock: cpu, amount: 20", "clock: updates, amount: 4"))
    assert freeze_text(digits_project, text)[1].code == 0


def test_a_huge_batch_size_is_refused(digits_project):
    refused(digits_project, edited("batch_size: 64", "batch_size: 1000000000000"),
            "training.batch_size", "65536")


@pytest.mark.parametrize("schedule", ["[0.5, 0.2]", "[0.2, 0.2, 0.4]"])
def test_an_unsorted_or_repeated_agent_schedule_is_refused(digits_project, schedule):
    text = edited("decisions: 8}", f"decisions: 8, schedule: {schedule}}}")
    refused(digits_project, text, "arms.agent.agent.schedule", "increasing order, each once")


# --------------------------------------------------------------------------------------------------------------
# optimizers that cannot step in opalctl's loop


@pytest.mark.parametrize("arguments, fragment", [
    ("name: LBFGS, lr: 0.1", "needs a closure"),
    ("name: SparseAdam, lr: 1.0e-3", "does not support dense gradients"),
    ("name: AdamW, lr: 1.0e-3, capturable: true", "'capturable' needs a CUDA device"),
    ("name: Adam, lr: 1.0e-3, differentiable: true", "'differentiable'"),
    ("name: Optimizer, lr: 1.0e-3", "base class"),
    ("name: Optimizer", "base class"),
    ("name: AdamW, lr: 1.0e-3, betas: {a: 1}", "'betas' must be a list of 2 (a number, a number), not dict"),
    ("name: AdamW, lr: 1.0e-3, betas: [0.9]", "'betas' must be a list of 2"),
    ("name: AdamW, lr: 1.0e-3, betas: [0.9, true]", "'betas' must be a list of 2"),
    ("name: AdamW, lr: 1.0e-3, amsgrad: 1", "'amsgrad' must be true or false"),
    ("name: AdamW, lr: {x: 1}", "'lr' must be a number"),
    ("name: SGD, lr: 0.1, foreach: [1]", "'foreach' must be a number, true or false, a name or null"),
    ("name: LBFGS, line_search_fn: 3", "needs a closure"),
])
def test_an_optimizer_that_cannot_step_here_is_refused(digits_project, arguments, fragment):
    refused(digits_project, optimizer(arguments), "arms.adamw.optimizer.name", fragment)


def test_capturable_is_left_to_the_run_when_training_is_on_cuda():
    from opalctl.protocol.optimizers import check_optimizer

    assert check_optimizer("AdamW", {"lr": 1e-3, "capturable": True}, "cuda") is None
    assert "CUDA" in check_optimizer("AdamW", {"lr": 1e-3, "capturable": True}, "cpu")


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax",
                                  "Rprop", "ASGD", "Adadelta"])
def test_every_dense_optimizer_passes_with_its_defaults(name):
    from opalctl.protocol.optimizers import check_optimizer

    assert check_optimizer(name, {"lr": 0.01}) is None


# --------------------------------------------------------------------------------------------------------------
# data and parents


def test_a_five_thousand_character_data_path_is_refused(digits_project):
    text = edited("train: data/digits/train.npz", "train: " + "a" * 5000)
    refused(digits_project, text, "data.train", "5000 characters")


def test_a_data_path_with_an_overlong_part_is_refused(digits_project):
    text = edited("train: data/digits/train.npz", "train: data/" + "b" * 300 + ".npz")
    refused(digits_project, text, "data.train", "255 bytes")


def test_a_folder_given_as_a_data_file_is_called_a_folder(digits_project):
    stderr = refused(digits_project, edited("train: data/digits/train.npz", "train: data/digits"),
                     "data.train", "is a folder")
    assert "missing" not in stderr


def _torch_weights(path: Path) -> None:
    torch.save(torch.nn.Linear(3, 2).state_dict(), path)


def _random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _torch_weights_only_text(path: Path) -> None:
    torch.save({"weights": [1.0, 2.0], "note": "not an opalctl checkpoint"}, path)


@pytest.mark.parametrize("damage", [_torch_weights, _random_bytes, _torch_weights_only_text])
def test_a_parent_that_is_not_an_opalctl_checkpoint_is_refused(digits_project, damage):
    damage(digits_project / "parents" / "digits" / "seed-2.pt")
    refused(digits_project, BASE, "the parent of seed 2", "not ")


def test_a_parent_larger_than_the_checkpoint_limit_is_refused(digits_project):
    size = (digits_project / "parents" / "digits" / "seed-1.pt").stat().st_size
    text = edited("selection:\n", f"limits: {{checkpoint_bytes: {size - 1}}}\nselection:\n")
    refused(digits_project, text, "the parent of seed 1", f"is {size} bytes",
            "limits.checkpoint_bytes")


# --------------------------------------------------------------------------------------------------------------
# sealed data, by where a path leads


def _sealed_copy(project: Path, sealed: str, name: str) -> Path:
    folder = project / sealed
    folder.mkdir(exist_ok=True)
    shutil.copy(project / "data" / "digits" / name, folder / name)
    return folder


@pytest.mark.parametrize("sealed", ["sealed", "final-test"])
def test_a_file_symlink_into_sealed_data_is_refused(digits_project, sealed):
    target = _sealed_copy(digits_project, sealed, "retention.npz") / "retention.npz"
    os.symlink(target, digits_project / "data" / "old-classes.npz")
    text = edited("retention: data/digits/retention.npz", "retention: data/old-classes.npz")
    refused(digits_project, text, "data.retention", "symbolic link", sealed)


def test_a_folder_symlink_into_sealed_data_is_refused(digits_project):
    _sealed_copy(digits_project, "sealed", "selection.npz")
    os.symlink(digits_project / "sealed", digits_project / "data" / "more", target_is_directory=True)
    text = edited("selection: data/digits/selection.npz", "selection: data/more/selection.npz")
    refused(digits_project, text, "data.selection", "symbolic link")


def test_a_relative_symlink_out_of_the_project_into_sealed_data_is_refused(digits_project):
    outside = digits_project.parent / "final-test"
    outside.mkdir()
    shutil.copy(digits_project / "data" / "digits" / "train.npz", outside / "train.npz")
    os.symlink(os.path.join("..", "..", "..", "final-test", "train.npz"),
               digits_project / "data" / "digits" / "rows.npz")
    text = edited("train: data/digits/train.npz", "train: data/digits/rows.npz")
    refused(digits_project, text, "data.train", "final-test")


def test_a_parent_symlink_into_sealed_data_is_refused(digits_project):
    parents = digits_project / "parents" / "digits"
    sealed = digits_project / "sealed"
    sealed.mkdir()
    for seed in (1, 2):
        shutil.move(parents / f"seed-{seed}.pt", sealed / f"seed-{seed}.pt")
        os.symlink(sealed / f"seed-{seed}.pt", parents / f"seed-{seed}.pt")
    refused(digits_project, BASE, "parents", "symbolic link")


def test_the_run_side_validation_refuses_a_symlink_the_lock_folder_holds(digits_project):
    """``validate`` is what run and verify call on a lock's protocol: the link is judged from the folder given."""
    path = digits_project / "digits.yaml"
    data, lines = load_yaml_with_lines(path)
    protocol = parse(data, lines, str(path))
    validate(protocol, lines, str(path), digits_project)  # as shipped: accepted
    retention = digits_project / "data" / "digits" / "retention.npz"
    target = _sealed_copy(digits_project, "sealed", "retention.npz") / "retention.npz"
    retention.unlink()
    os.symlink(target, retention)
    with pytest.raises(ProtocolError) as caught:
        validate(protocol, lines, str(path), digits_project)
    assert "data.retention" in caught.value.message and "symbolic link" in caught.value.message


def test_a_project_under_a_folder_named_sealed_is_not_refused_for_where_it_lives(digits_init_folder, tmp_path):
    project = tmp_path / "sealed-experiments" / "project"
    shutil.copytree(digits_init_folder, project)
    assert freeze_text(project, BASE)[1].code == 0


# --------------------------------------------------------------------------------------------------------------
# the task entry, and YAML


def test_a_refused_task_module_that_prints_on_import_writes_nothing_to_stdout(digits_project):
    (digits_project / "noisy_task.py").write_text("import sys\nprint('hello from the task module')\n"
                                                  "print('and to stderr', file=sys.stderr)\nclass Nope:\n    pass\n")
    text = edited("entry: opalctl.tasks.digits:Digits", "entry: noisy_task:Nope")
    (digits_project / "digits.yaml").write_text(text, encoding="utf-8")
    result = run_cli("freeze", "digits.yaml", cwd=digits_project, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")
                                                                   + os.pathsep + str(digits_project)})
    assert result.code == 2, result.output
    assert result.stdout == "" and "hello" not in result.stderr and result.stderr.count("\n") == 1, result.output
    assert "task.entry" in result.stderr


def test_a_task_module_that_exits_on_import_is_refused(digits_project, monkeypatch):
    (digits_project / "exiting_task.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(digits_project))
    monkeypatch.delitem(sys.modules, "exiting_task", raising=False)
    text = edited("entry: opalctl.tasks.digits:Digits", "entry: exiting_task:Task")
    refused(digits_project, text, "task.entry", "SystemExit")


def alias_bomb(levels: int) -> str:
    """Nine references per level to the level below: ``levels`` levels expand to 9 ** levels values."""
    lines = ["x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, levels):
        lines.append(f"x{level}: &x{level} [" + ", ".join([f"*x{level - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [9, 10, 14])
def test_an_alias_bomb_is_refused_quickly(digits_project, levels):
    text = edited("name: digits\n", "name: digits\n" + alias_bomb(levels).replace("x0:", "extra0:"))
    assert len(text.encode()) < len(BASE.encode()) + 1200
    started = time.process_time()  # CPU seconds: what the bomb costs, whatever else the machine does
    path, result = freeze_text(digits_project, text)
    assert time.process_time() - started < 2.0
    assert result.code == 2 and result.stderr.count("\n") == 1, result.output
    assert "expands to more than 100000 values" in result.stderr


def test_a_recursive_alias_is_refused(digits_project):
    path, result = freeze_text(digits_project, BASE + "loop: &loop [*loop]\n")
    assert result.code == 2 and "refers to a value that contains it" in result.stderr, result.output


def test_an_integer_too_long_for_python_is_refused(digits_project):
    path, result = freeze_text(digits_project, edited("amount: 20", "amount: " + "9" * 5000))
    assert result.code == 2 and "more than" in result.stderr and "digits" in result.stderr, result.output
    assert result.stderr.count("\n") == 1


def test_an_oversized_protocol_file_is_refused_unread(digits_project):
    path, result = freeze_text(digits_project, BASE + "# " + "x" * (1 << 20) + "\n")
    assert result.code == 2 and "over 1 MiB" in result.stderr, result.output


def test_numbers_with_an_exponent_and_no_dot_are_numbers(tmp_path):
    path = tmp_path / "numbers.yaml"
    path.write_text("a: 1e-3\nb: 4e1\nc: 1E5\nd: .5\ne: -2e+2\nf: 1.0e-3\ng: 1e\nh: e5\ni: 12\nj: '1e-3'\n")
    data, _ = load_yaml_with_lines(path)
    assert data == {"a": 0.001, "b": 40.0, "c": 100000.0, "d": 0.5, "e": -200.0, "f": 0.001, "g": "1e",
                    "h": "e5", "i": 12, "j": "1e-3"}
    import yaml

    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}  # PyYAML's own loader is left as it was


def test_lr_1e_3_and_amount_4e1_freeze_as_numbers(digits_project):
    text = edited("amount: 20", "amount: 4e1", optimizer("name: AdamW, lr: 1e-3, weight_decay: 1E-2"))
    path, result = freeze_text(digits_project, text)
    assert result.code == 0, result.output
    protocol = load_protocol(path)
    assert protocol.budget.amount == 40.0
    assert protocol.arms["adamw"].optimizer.arguments() == {"lr": 0.001, "weight_decay": 0.01}


# --------------------------------------------------------------------------------------------------------------
# the protocol path itself, and the lock's place


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_protocol_that_is_a_device_or_a_pipe_is_refused_without_reading_it(tmp_path, special):
    if special == "fifo":
        special = tmp_path / "protocol.yaml"
        os.mkfifo(special)  # reading it would wait for a writer forever
    started = time.perf_counter()
    result = call_cli("freeze", special)
    assert result.code == 2 and "is not a regular file" in result.stderr, result.output
    assert time.perf_counter() - started < 10.0


def test_an_existing_lock_that_is_not_text_is_a_lock_that_differs(digits_project):
    (digits_project / "digits.lock.json").write_bytes(b"\xff\xfe\x00binary")
    path, result = freeze_text(digits_project, BASE)
    assert result.code == 2 and "already exists and differs" in result.stderr, result.output


def test_a_folder_where_the_lock_goes_is_refused(digits_project):
    (digits_project / "digits.lock.json").mkdir()
    path, result = freeze_text(digits_project, BASE)
    assert result.code == 2 and "is a folder where the lock goes" in result.stderr, result.output


def test_a_task_module_that_cannot_be_imported_is_refused_before_torch_loads(digits_project):
    """The task is what everything else needs, so a missing module is said at once: the optimizer checks that
    come after it import torch, which took 10.9 s of a loaded machine's 10.9 s before the refusal."""
    import subprocess

    path = digits_project / "digits.yaml"
    path.write_text(edited("entry: opalctl.tasks.digits:Digits", "entry: no_such_task_module:Task"), encoding="utf-8")
    probe = ("import sys\nfrom opalctl.errors import BadInput\nfrom opalctl.protocol.freeze import freeze\n"
             f"try:\n    freeze({str(path)!r})\nexcept BadInput as error:\n    print(error.message)\n"
             "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    said, torch_loaded = done.stdout.strip().splitlines()
    assert "task.entry: module 'no_such_task_module' cannot be imported" in said, done.stdout + done.stderr
    assert torch_loaded == "False"
    assert not list(digits_project.glob("*.lock.json"))
