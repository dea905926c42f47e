"""Helpers shared by the built-in tasks: byte-for-byte deterministic array files and the thread setting.

``numpy.savez`` stamps each member with the current time, so two ``opalctl init`` runs would write different
bytes. ``write_arrays`` writes the same ``.npz`` layout with a fixed timestamp and sorted members instead, and
``read_arrays`` never unpickles.
"""

from __future__ import annotations

import contextlib
import io
import zipfile
from pathlib import Path

import numpy as np

from opalctl.errors import BadInput
from opalctl.files import atomic_write_bytes

FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=FIXED_TIME)
            info.external_attr = 0o644 << 16
            archive.writestr(info, member.getvalue())
    atomic_write_bytes(path, buffer.getvalue())


def read_arrays(path: Path, required: tuple[str, ...]) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise BadInput(f"data file {path} does not exist; run `opalctl init` or fix the protocol's data paths") from None
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise BadInput(f"data file {path} cannot be read as arrays ({error}); regenerate it") from None
    missing = [name for name in required if name not in arrays]
    if missing:
        raise BadInput(f"data file {path} lacks the arrays {', '.join(missing)}; it was not written for this task")
    return arrays


@contextlib.contextmanager
def torch_threads(count: int):
    """Run a block with a fixed intra-op thread count (parents must not depend on the machine's core count)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
