"""``read_floats``: the batched read of scalar losses that the run's records and the agent optimizer share."""

import math

import numpy as np
import torch

from opalctl.scalars import read_floats


def test_scalar_tensors_of_one_dtype_are_read_exactly():
    values = [torch.tensor(x, dtype=torch.float32) for x in (0.1, 2.5, float("nan"))]
    read = read_floats(values)
    assert read[:2] == [float(torch.tensor(0.1)), 2.5] and math.isnan(read[2])


def test_numbers_mixed_dtypes_and_shaped_scalars_fall_back_to_reads_per_group():
    values = [1, np.float32(0.25), torch.tensor([0.5], dtype=torch.float64), torch.tensor(0.75, dtype=torch.bfloat16),
              torch.tensor(1.5, requires_grad=True) * 1.0]
    assert read_floats(values) == [1.0, 0.25, 0.5, 0.75, 1.5]
    assert read_floats([]) == []
