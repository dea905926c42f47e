"""CUDA tests: marked ``cuda``, skipped where no CUDA device is visible, with that reason.

A GPU is not a system component CI installs (see tests/conftest.py's ``SYSTEM_SKIP``): a machine without one skips
these tests and says so. ``make test-gpu`` runs this folder with ``OPALCTL_REQUIRE_GPU=1``, which refuses to start
without a visible device, so a GPU run can never pass by skipping everything.
"""

from __future__ import annotations

import os

import pytest
import torch

NO_CUDA = ("needs a CUDA device: none is visible here (torch.cuda.is_available() is False); "
           "`make test-gpu` runs these on a machine with one")


def cuda_visible() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install is no device
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one; `make test-gpu` runs them)")


def pytest_collection_modifyitems(config, items):
    if cuda_visible():
        return
    if os.environ.get("OPALCTL_REQUIRE_GPU") == "1":
        raise pytest.UsageError("OPALCTL_REQUIRE_GPU=1 but no CUDA device is visible (torch.cuda.is_available() is "
                                "False): run on a machine with a GPU and a CUDA build of torch")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
