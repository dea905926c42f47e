"""The checks opalctl/tasks/calls.py makes of what a task returns, without a run: the metrics (numbers of their
kind, numpy and 0-dim tensors converted, a non-finite "higher"/"lower" value kept as a result) and the sampler's
state (plain data a resume checkpoint loads). The runs that meet them are tests/driver/test_task_failures.py's."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from opalctl.tasks.calls import TaskFailed, check_plain, checked_metrics

KINDS = {"correct": "higher", "total": "count", "loss": "lower"}


def test_numpy_and_tensor_numbers_become_python_numbers_of_their_kind():
    got = checked_metrics("m:T", KINDS, {"correct": np.int64(3), "total": 128.0, "loss": torch.tensor(0.5)})
    assert got == {"correct": 3, "total": 128, "loss": 0.5}
    assert [type(v) for v in got.values()] == [int, int, float]


def test_a_non_finite_loss_is_a_result_and_kept():
    got = checked_metrics("m:T", KINDS, {"loss": float("nan"), "correct": np.float32("inf")})
    assert np.isnan(got["loss"]) and got["correct"] == float("inf")


@pytest.mark.parametrize(("metrics", "said"), [
    ({"total": float("nan")}, "returned nan, not a whole number for metric 'total' (a count metric)"),
    ({"total": 2.5}, "returned 2.5, not a whole number for metric 'total'"),
    ({"total": 1e300}, "returned 1e+300, beyond what a record holds exactly (2**53) for metric 'total'"),
    ({"correct": 10 ** 400}, "returned an integer of 401 digits, beyond what a record holds exactly"),
    ({"correct": True}, "returned bool 'True', not a number for metric 'correct'"),
    ({"correct": np.bool_(False)}, "returned bool 'False', not a number"),
    ({"loss": None}, "returned NoneType 'None', not a number for metric 'loss' (a lower metric)"),
    ({"loss": "low"}, "returned str 'low', not a number"),
    ({"loss": torch.zeros(2)}, "returned Tensor"),
    ({1: 2}, "returned the metric name 1, not a string"),
])
def test_a_metric_that_is_no_number_of_its_kind_is_one_sentence_naming_it(metrics, said):
    with pytest.raises(TaskFailed) as refused:
        checked_metrics("m:T", KINDS, metrics)
    assert refused.value.message.startswith("task m:T's evaluate ") and said in refused.value.message


def test_evaluate_must_return_a_dict():
    with pytest.raises(TaskFailed, match="task m:T's evaluate returned list, not a dict of metrics"):
        checked_metrics("m:T", KINDS, [("correct", 1)])


def test_plain_state_passes_and_the_first_other_thing_is_named_where_it_is():
    plain = {"a": [1, 2.0, None, True, "x", (1, 2)], "b": torch.zeros(2), "c": collections.OrderedDict(x=1)}
    assert check_plain(plain, "state") == ""
    assert check_plain({"a": [np.int64(1)]}, "state") == "a numpy.int64 at state['a'][0]"
    assert check_plain({"a": np.zeros(2)}, "state") == "a numpy.ndarray at state['a']"
    assert check_plain({1: 2}, "state") == "the key 1 (of type int) in state"
    assert check_plain({"s": {1, 2}}, "state") == "a set at state['s']"
