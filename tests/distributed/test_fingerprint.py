"""The pieces of the DDP wrapper that need no second process: the parameter fingerprint and the refusals."""

from __future__ import annotations

import pytest
import torch

from opalctl.errors import OpalctlError
from opalctl.opal.distributed import fingerprint, wrap_distributed


def params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(16, 8, generator=generator),
            "half": torch.randn(4, 4, generator=generator).to(torch.bfloat16),
            "double": torch.randn(5, generator=generator, dtype=torch.float64)}


def test_equal_parameters_give_equal_fingerprints_and_one_flipped_bit_changes_its_row_only():
    first, second = params(), params()
    assert torch.equal(fingerprint(first), fingerprint(second))
    bits = second["half"].view(torch.int16)
    bits[1, 2] ^= 1  # the lowest bit of one bfloat16 value
    before, after = fingerprint(first), fingerprint(second)
    assert after.shape == (3, 2) and after.dtype == torch.int64
    assert [bool((before[i] != after[i]).any()) for i in range(3)] == [False, True, False]


def test_two_swapped_values_change_the_fingerprint():
    first, second = params(), params()
    second["weight"][0, 0], second["weight"][3, 5] = first["weight"][3, 5].clone(), first["weight"][0, 0].clone()
    assert fingerprint(first)[0, 0] == fingerprint(second)[0, 0]  # the same values: the plain sum agrees
    assert fingerprint(first)[0, 1] != fingerprint(second)[0, 1]  # not in the same places


def test_wrapping_for_ddp_without_torch_distributed_is_refused_in_one_sentence():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(OpalctlError, match="init_process_group") as info:
        wrap_distributed(torch.optim.SGD(model.parameters(), lr=0.1), model, total_steps=10)
    assert "\n" not in str(info.value)


def test_a_progress_callable_is_refused_under_torchrun():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="total_steps"):
        wrap_distributed(torch.optim.SGD(model.parameters(), lr=0.1), model, total_steps=10, progress=lambda: 0.5)
