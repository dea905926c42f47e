"""``training.ranks``: the number of processes torchrun starts for every run of a lock (default 1)."""

from __future__ import annotations

import pytest

from opalctl.errors import BadInput
from opalctl.protocol.schema import load_protocol, parse
from opalctl.tasks.builtin import protocol_text

BASE = protocol_text("digits", [1, 2])
TRAINING = "training: {batch_size: 64, gradient_clip: 2.0}"


def with_training(tmp_path, extra: str):
    assert BASE.count(TRAINING) == 1
    path = tmp_path / "protocol.yaml"
    path.write_text(BASE.replace(TRAINING, TRAINING[:-1] + extra + "}"), encoding="utf-8")
    return path


def test_a_protocol_without_ranks_trains_in_one_process(tmp_path):
    assert load_protocol(with_training(tmp_path, "")).training.ranks == 1


def test_a_protocol_may_ask_for_two_ranks(tmp_path):
    assert load_protocol(with_training(tmp_path, ", ranks: 2")).training.ranks == 2


@pytest.mark.parametrize("value", ["0", "65", "1.5", "'2'"])
def test_ranks_outside_1_to_64_or_not_an_integer_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(BadInput) as caught:
        load_protocol(with_training(tmp_path, f", ranks: {value}"))
    assert "training.ranks" in caught.value.message and "\n" not in caught.value.message


def test_a_resolved_protocol_frozen_before_ranks_existed_reads_as_one_rank(tmp_path):
    resolved = load_protocol(with_training(tmp_path, "")).model_dump(mode="json")
    del resolved["training"]["ranks"]  # what a lock written by an earlier opalctl holds
    assert parse(resolved, {}, "lock old.json").training.ranks == 1
