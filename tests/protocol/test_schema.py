"""The protocol schema: what is refused, and that each refusal names the key, the line and what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from opalctl.errors import BadInput
from opalctl.protocol.schema import ProtocolError, load_protocol
from opalctl.tasks.builtin import protocol_text
from tests.support.cli import call_cli

BASE = protocol_text("digits", [1, 2])


def line_of(text: str, start: str) -> int:
    """The 1-based number of the first line of ``text`` that starts with ``start``."""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(start):
            return number
    raise AssertionError(f"no line starts with {start!r}")


def edited(old: str, new: str, text: str = BASE) -> str:
    assert text.count(old) == 1, f"{old!r} is not unique in the protocol"
    return text.replace(old, new)


def write(folder, text: str, name: str = "protocol.yaml"):
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def refusal(path) -> BadInput:
    with pytest.raises(BadInput) as caught:
        load_protocol(path)
    assert "\n" not in caught.value.message
    return caught.value


def test_the_digits_template_is_valid(tmp_path):
    protocol = load_protocol(write(tmp_path, BASE))
    assert protocol.seeds == [1, 2]
    assert protocol.budget.threads == 1 and protocol.budget.fractions == [0.25, 0.5, 0.75, 1.0]
    assert protocol.parent_for(2) == "parents/digits/seed-2.pt"
    assert protocol.arms["adamw"].schedule == "constant"  # a default, resolved by the schema
    assert protocol.training.checkpoint_every == 0.1
    assert (protocol.limits.memory_bytes, protocol.limits.training_folder_bytes) == ("auto", "auto")


def test_the_bounds_of_the_training_process_take_a_number_of_bytes_or_auto(tmp_path):
    text = edited("arms:\n", "limits: {memory_bytes: 8589934592, training_folder_bytes: auto}\narms:\n")
    limits = load_protocol(write(tmp_path, text)).limits
    assert (limits.memory_bytes, limits.training_folder_bytes) == (8 << 30, "auto")


# --------------------------------------------------------------------------------------------------------------
# line numbers


@pytest.mark.parametrize("old, new, key, starts", [
    ("clock: cpu,", "clock: cpuu,", "budget.clock", "budget:"),
    ("entry: opalctl.tasks.digits:Digits", "entry: 12", "task.entry", "  entry:"),
    ("entry: opalctl.tasks.digits:Digits", "entry: opalctl.tasks.digits:Nope", "task.entry", "  entry:"),
    ("config: {hidden: 128,", "confg: {hidden: 128,", "task.confg", "  confg:"),
    ("hidden: 128", "hidden: 2", "task.config.hidden", "  config:"),
    ("seeds: [1, 2]", "seeds: [1, two]", "seeds[1]", "seeds:"),
    ("batch_size: 64", "batch_size: 0", "training.batch_size", "training:"),
    ("adamw:        {optimizer: {name: AdamW,", "adamw:        {optimizer: {name: AdamWW,",
     "arms.adamw.optimizer.name", "  adamw:"),
    ("budget_multiplier: 3}", "budget_multiplier: -3}", "arms.adamw-long.budget_multiplier", "  adamw-long:"),
    ("  retention: data/digits/retention.npz", "  retention: data/sealed/retention.npz", "data.retention",
     "  retention:"),
    ("floors: {retention.correct: 4}", "floors: {retention.corect: 4}", "selection.floors", "  floors:"),
    ("improve_any: [selection.correct]", "improve_any: [heldout.correct]", "selection.improve_any",
     "  improve_any:"),
])
def test_an_error_names_its_key_and_line(tmp_path, old, new, key, starts):
    text = edited(old, new)
    path = write(tmp_path, text)
    error = refusal(path)
    assert error.message.startswith(f"{path} line {line_of(text, starts)}: {key}: "), error.message


def test_budget_clock_typo_names_line_and_the_choices(tmp_path):
    text = edited("clock: cpu,", "clock: cpuu,")
    path = write(tmp_path, text)
    result = call_cli("freeze", path)
    assert result.code == 2
    assert result.stderr == (f"opalctl: error: {path} line {line_of(text, 'budget:')}: budget.clock: input should "
                             f"be 'cpu', 'gpu', 'wall' or 'updates' (got 'cpuu')\n")


def test_a_missing_key_names_the_line_of_its_mapping(tmp_path):
    text = edited("  entry: opalctl.tasks.digits:Digits\n", "")
    error = refusal(write(tmp_path, text))
    assert f"line {line_of(text, 'task:')}: task.entry: this key is required" in error.message


def test_an_unknown_key_lists_the_known_ones(tmp_path):
    text = edited("training: {batch_size: 64,", "training: {batch_sise: 64,")
    error = refusal(write(tmp_path, text))
    assert "training.batch_sise: unknown key; check its spelling" in error.message
    assert "known keys: batch_size, checkpoint_every, device, gradient_clip" in error.message


def test_several_problems_are_all_kept(tmp_path):
    text = edited("clock: cpu,", "clock: cpuu,", edited("batch_size: 64", "batch_size: -1"))
    error = refusal(write(tmp_path, text))
    assert isinstance(error, ProtocolError)
    assert "(and 1 more problem)" in error.message
    keys = [key for key, _line, _text in error.problems]
    assert keys == ["budget.clock", "training.batch_size"]
    assert all(line == line_of(text, key.split(".")[0] + ":") for key, line, _ in error.problems)
    assert error.details == []  # the sentence is the whole message: a refused protocol is one line


def test_a_misspelt_key_is_named_before_the_missing_one(tmp_path):
    text = edited("  entry: opalctl", "  entri: opalctl")
    error = refusal(write(tmp_path, text))
    assert "task.entri: unknown key" in error.message and "(and 1 more problem)" in error.message


# --------------------------------------------------------------------------------------------------------------
# refusals of the schema and the cross-field checks


@pytest.mark.parametrize("old, new, expected", [
    ("fractions: [0.25, 0.5, 0.75, 1.0]", "fractions: [0.5, 0.25, 1.0]", "fractions must increase strictly"),
    ("fractions: [0.25, 0.5, 0.75, 1.0]", "fractions: [0.25, 0.5]", "the last fraction must be 1.0"),
    ("fractions: [0.25, 0.5, 0.75, 1.0]", "fractions: []", "at least one fraction"),
    ("fractions: [0.25, 0.5, 0.75, 1.0]", "fractions: [0.5, 1.5]", "budget.fractions[1]"),
    ("clock: cpu, amount: 20,", "clock: updates, amount: 20.5,", "give an integer amount"),
    ("amount: 20,", "amount: 0,", "budget.amount: input should be greater than 0"),
    ("threads: 1,", "threads: 1.0,", "budget.threads: input should be a valid integer"),
    ("threads: 1,", "threads: '1',", "budget.threads: input should be a valid integer"),
    ("seeds: [1, 2]", "seeds: [1, 1]", "each seed may appear once"),
    ("seeds: [1, 2]", "seeds: []", "seeds:"),
    ("seeds: [1, 2]", "seeds: [-1, 2]", "seeds[0]"),
    ("name: digits", "name: two words", "name: string should match pattern"),
    ("  train: data/digits/train.npz\n", "", "name the training rows as data.train"),
    ("  development: data/digits/development.npz\n", "", "needs a data.development file"),
    ("lr: 1.0e-3, weight_decay: 0.01}}", "lr: 1.0e-3, weight_decai: 0.01}}", "AdamW takes no argument 'weight_decai'"),
    ("{name: AdamW, lr: 1.0e-3, weight_decay: 0.01}}", "{name: Adamw, lr: 1.0e-3}}", "no optimizer 'Adamw'"),
    ("schedule: cosine}", "schedule: cosin}", "arms.adamw-cosine.schedule"),
    ("budget_multiplier: 3}", "budget_multiplier: 3, agent: {backend: gpt}}", "unknown backend 'gpt'"),
    ("budget_multiplier: 3}", "budget_multiplier: 3, agent: {decisions: 0}}", "arms.adamw-long.agent.decisions"),
    ("budget_multiplier: 3}", "budget_multiplier: 3, agent: {step_time_limit: 0}}",
     "arms.adamw-long.agent.step_time_limit"),
    ("hidden: 128,", "hidden: 128, hiden: 3,", "task.config.hiden: unknown key"),
    ("entry: opalctl.tasks.digits:Digits", "entry: opalctl.tasks.no_such_module:Digits", "cannot be imported"),
    ("entry: opalctl.tasks.digits:Digits", "entry: opalctl.tasks.digits:DigitsConfig", "has no task class"),
    ("floors: {retention.correct: 4}", "floors: {retention.accuracy: 4}", "reports no metric 'accuracy'"),
    ("floors: {retention.correct: 4}", "floors: {retention.correct: -1}", "selection.floors.retention.correct"),
    ("arms:\n", "limits: {checkpoint_bytes: 10}\narms:\n", "limits.checkpoint_bytes"),
    ("arms:\n", "limits: {memory_bytes: 1000}\narms:\n",
     "limits.memory_bytes: give a number of bytes, at least 536870912 (512 MiB: torch alone takes some 220 MB), or "
     "auto (got 1000)"),
    ("arms:\n", "limits: {memory_bytes: lots}\narms:\n", "limits.memory_bytes: give a number of bytes"),
    ("arms:\n", "limits: {training_folder_bytes: 1.5e9}\narms:\n",
     "limits.training_folder_bytes: give a number of bytes, at least 1048576 (1 MiB), or auto (got 1500000000.0)"),
    ("arms:\n  adamw:", "arms: {}\nunused:\n  adamw:", "unknown key"),
])
def test_refused(tmp_path, old, new, expected):
    error = refusal(write(tmp_path, edited(old, new)))
    assert expected in error.message, error.message
    assert error.exit_code == 2


def test_no_arms_is_refused(tmp_path):
    text = BASE.split("arms:\n")[0] + "arms: {}\n"
    assert "arms: dictionary should have at least 1 item" in refusal(write(tmp_path, text)).message


@pytest.mark.parametrize("content, expected", [
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("- name: digits\n", "must be a mapping"),
    ("just a string\n", "must be a mapping"),
    ("name: [digits\n", "the YAML cannot be parsed"),
])
def test_documents_that_are_not_protocols(tmp_path, content, expected):
    assert expected in refusal(write(tmp_path, content)).message


def test_not_utf8_a_folder_and_a_missing_file_are_refused(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: d\xe9j\xe0\n".encode("latin-1"))
    assert "is not UTF-8" in refusal(path).message
    assert "is a folder" in refusal(tmp_path).message
    assert "does not exist" in refusal(tmp_path / "absent.yaml").message


def test_a_repeated_key_is_refused_not_silently_overwritten(tmp_path):
    text = edited("seeds: [1, 2]\n", "seeds: [1, 2]\nseeds: [3]\n")
    error = refusal(write(tmp_path, text))
    assert f"line {line_of(text, 'seeds:') + 1}: key seeds appears twice (first on line {line_of(text, 'seeds:')})" \
        in error.message


def test_a_parents_mapping_gives_each_seed_its_file(tmp_path):
    text = edited("parents: parents/digits/seed-{seed}.pt", "parents: {1: a/one.pt, 2: b/two.pt}")
    protocol = load_protocol(write(tmp_path, text))
    assert [protocol.parent_for(s) for s in (1, 2)] == ["a/one.pt", "b/two.pt"]


# --------------------------------------------------------------------------------------------------------------
# sealed data: refused wherever it appears, even when the file exists


SEALED_CASES = [
    ("  train: data/digits/train.npz", "  train: data/sealed/train.npz", "data/sealed/train.npz", "data.train"),
    ("  selection: data/digits/selection.npz", "  selection: data/final-test.npz", "data/final-test.npz",
     "data.selection"),
    ("  retention: data/digits/retention.npz", "  retention: evaluation-final/retention.npz",
     "evaluation-final/retention.npz", "data.retention"),
    ("  development: data/digits/development.npz", "  development: data/Sealed/development.npz",
     "data/Sealed/development.npz", "data.development"),
    ("parents: parents/digits/seed-{seed}.pt", "parents: sealed/seed-{seed}.pt", "sealed/seed-{seed}.pt", "parents"),
    ("parents: parents/digits/seed-{seed}.pt",
     "parents: {1: parents/digits/seed-1.pt, 2: parents/final-test/seed-2.pt}", "parents/final-test/seed-2.pt",
     "parents"),
]


@pytest.mark.parametrize("old, new, relative, key", SEALED_CASES, ids=[c[1].strip().split(":")[0] + "-" + c[2]
                                                                      for c in SEALED_CASES])
def test_sealed_paths_are_refused_by_freeze(digits_project, old, new, relative, key):
    # put a real file at the sealed path, so the refusal cannot come from a missing file
    source = digits_project / ("parents/digits/seed-1.pt" if key == "parents" else "data/digits/train.npz")
    for seed in (1, 2):
        target = digits_project / relative.replace("{seed}", str(seed))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    text = edited(old, new)
    path = write(digits_project, text, "digits.yaml")
    result = call_cli("freeze", path)
    assert result.code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("opalctl: error: ")
    assert f": {key}: the path names sealed data" in result.stderr
    assert f"{path} line {line_of(text, new.split(':')[0] + ':')}: " in result.stderr
    assert not (digits_project / "digits.lock.json").exists()


def test_a_sealed_path_is_refused_by_the_pilot_as_well(digits_project):
    path = write(digits_project, edited("  train: data/digits/train.npz", "  train: sealed/train.npz"), "digits.yaml")
    result = call_cli("pilot", path, "--arm", "adamw", "--steps", "1")
    assert result.code == 2 and "sealed data" in result.stderr


# --------------------------------------------------------------------------------------------------------------
# once bugs, now fixed: each refusal is exit 2 with one line naming the key and its line, and writes no lock


def assert_one_line_refusal(result, folder, path, text: str, key: str, starts: str) -> str:
    assert result.code == 2, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    assert result.stderr.startswith("opalctl: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert f"{path} line {line_of(text, starts)}: {key}: " in result.stderr, result.stderr
    assert not list(folder.glob("*.lock.json"))
    return result.stderr


def test_a_parents_mapping_without_a_seed_is_refused(digits_project):
    text = edited("parents: parents/digits/seed-{seed}.pt", "parents: {1: parents/digits/seed-1.pt}")
    path = write(digits_project, text, "digits.yaml")
    stderr = assert_one_line_refusal(call_cli("freeze", path), digits_project, path, text, "parents", "parents:")
    assert "no parent for seed 2" in stderr and "seed 1" not in stderr


OPTIMIZER_LINE = "adamw:        {optimizer: {name: AdamW, lr: 1.0e-3, weight_decay: 0.01}}"


@pytest.mark.parametrize("arguments, expected", [
    ("lr: abc", "AdamW argument 'lr' must be a number, not 'abc'"),
    ("lr: '1.0e-3'", "AdamW argument 'lr' must be a number, not '1.0e-3'"),  # a number in quotes is a string
    ("lr: [1, 2]", "AdamW argument 'lr' must be a number, not list"),
    ("lr: null", "AdamW argument 'lr' must be a number, not None"),
    ("lr: -1", "AdamW refuses these arguments: Invalid learning rate: -1"),
    ("lr: 1.0e-3, betas: [0.9, 1.5]", "AdamW refuses these arguments: Invalid beta parameter at index 1: 1.5"),
    ("lr: .nan", "AdamW argument 'lr' must be finite, not nan"),
    ("lr: .inf", "AdamW argument 'lr' must be finite, not inf"),
    ("lr: 1.0e-3, weight_decay: -.inf", "AdamW argument 'weight_decay' must be finite, not -inf"),
    ("lr: 1.0e-3, betas: [0.9, .nan]", "AdamW argument 'betas' must be finite"),
    ("lr: true", "AdamW argument 'lr' must be a number, not True"),
    ("lr: 1.0e-3, weight_decay: false", "AdamW argument 'weight_decay' must be a number, not False"),
])
def test_an_optimizer_argument_that_torch_would_refuse_is_refused(digits_project, arguments, expected):
    text = edited(OPTIMIZER_LINE, "adamw:        {optimizer: {name: AdamW, " + arguments + "}}")
    path = write(digits_project, text, "digits.yaml")
    stderr = assert_one_line_refusal(call_cli("freeze", path), digits_project, path, text,
                                     "arms.adamw.optimizer.name", "  adamw:")
    assert expected in stderr, stderr


def test_valid_optimizer_arguments_are_still_frozen(digits_project):
    text = edited(OPTIMIZER_LINE, "adamw:        {optimizer: {name: AdamW, lr: 3, betas: [0.8, 0.99], amsgrad: true}}")
    result = call_cli("freeze", write(digits_project, text, "digits.yaml"))
    assert result.code == 0, result.output


def test_an_agent_step_time_limit_reaches_the_lock_only_when_given(digits_project):
    """``agent.step_time_limit`` is in the lock where the protocol gives it; an arm without it resolves, and its
    lock hashes, as before the key (the agent optimizer's 10 s)."""
    text = edited("budget_multiplier: 3}", "budget_multiplier: 3, agent: {backend: keep, step_time_limit: 2.5}}")
    plain_agent = "  plain-agent:  {optimizer: {name: AdamW, lr: 1.0e-3}, agent: {backend: keep}}\n"
    text = text.replace("arms:\n", "arms:\n" + plain_agent, 1)
    result = call_cli("freeze", write(digits_project, text, "digits.yaml"), "--json")
    assert result.code == 0, result.output
    arms = json.loads(Path(json.loads(result.stdout)["lock"]).read_text())["protocol"]["arms"]
    assert arms["adamw-long"]["agent"]["step_time_limit"] == 2.5
    assert "step_time_limit" not in arms["plain-agent"]["agent"]


@pytest.mark.parametrize("old, new, key, starts", [
    ("amount: 20,", "amount: .inf,", "budget.amount", "budget:"),
    ("amount: 20,", "amount: .nan,", "budget.amount", "budget:"),
    ("fractions: [0.25, 0.5, 0.75, 1.0]", "fractions: [0.25, .nan, 0.75, 1.0]", "budget.fractions[1]", "budget:"),
    ("gradient_clip: 2.0}", "gradient_clip: .inf}", "training.gradient_clip", "training:"),
    ("floors: {retention.correct: 4}", "floors: {retention.correct: .inf}", "selection.floors.retention.correct",
     "  floors:"),
    ("floors: {retention.correct: 4}", "floors: {retention.correct: -.inf}", "selection.floors.retention.correct",
     "  floors:"),
    ("budget_multiplier: 3}", "budget_multiplier: .inf}", "arms.adamw-long.budget_multiplier", "  adamw-long:"),
    ("replay_share: 0.25", "replay_share: .nan", "task.config.replay_share", "  config:"),
])
def test_non_finite_numbers_are_refused_as_bad_input(digits_project, old, new, key, starts):
    text = edited(old, new)
    path = write(digits_project, text, "digits.yaml")
    stderr = assert_one_line_refusal(call_cli("freeze", path), digits_project, path, text, key, starts)
    assert stderr.endswith(f"{key}: input should be a finite number\n"), stderr


@pytest.mark.parametrize("old, new, expected", [
    ("hidden: 128", "hidden: '128'", "task.config.hidden: input should be a valid integer (got '128')"),
    ("hidden: 128", "hidden: 128.0", "task.config.hidden: input should be a valid integer (got 128.0)"),
    ("hidden: 128", "hidden: true", "task.config.hidden: input should be a valid integer"),
    ("replay_share: 0.25", "replay_share: '0.25'", "task.config.replay_share: input should be a valid number"),
])
def test_task_config_values_are_as_strict_as_the_rest(digits_project, old, new, expected):
    text = edited(old, new)
    path = write(digits_project, text, "digits.yaml")
    stderr = assert_one_line_refusal(call_cli("freeze", path), digits_project, path, text,
                                     expected.split(":")[0], "  config:")
    assert expected in stderr, stderr


def test_a_refusal_is_one_line_even_for_a_key_with_a_newline(digits_project):
    text = edited("name: digits\n", 'name: digits\n"a\\nb": 1\n')
    path = write(digits_project, text, "digits.yaml")
    result = call_cli("freeze", path)
    assert result.code == 2
    assert result.stderr.count("\n") == 1, result.stderr
    line = line_of(text, '"a')
    assert f"{path} line {line}: 'a\\nb': unknown key; check its spelling" in result.stderr, result.stderr


def test_arm_model_settings_are_validated_by_the_task(tmp_path):
    # digits defines no ArmConfig fields: any arms.NAME.model key is refused at freeze, naming it
    text = BASE.replace("adamw:        {optimizer: {name: AdamW, lr: 1.0e-3, weight_decay: 0.01}}",
                        "adamw:        {optimizer: {name: AdamW, lr: 1.0e-3, weight_decay: 0.01}, model: {width: 3}}")
    assert text != BASE
    with pytest.raises(BadInput) as caught:
        load_protocol(write(tmp_path, text))
    assert "arms.adamw.model.width" in caught.value.message and "takes no arm model settings" in caught.value.message
