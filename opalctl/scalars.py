"""Reading many scalar losses back from torch at once.

The agent optimizer's analysis, and the formal run's per-update records on a GPU, keep each update's loss as a
detached tensor and read a whole batch of them later: one stack and one transfer, where a read per update would
cost a device synchronisation. On the CPU the formal run reads each loss when it keeps it (``item()`` costs no
synchronisation there, and measured cheaper between two updates than ``detach()``), so its batches are numbers.
"""

from __future__ import annotations

from typing import Any


def read_floats(values: list[Any]) -> list[float]:
    """Numbers and scalar tensors as Python floats, the tensors of each device and dtype read in one transfer."""
    import torch

    if values and type(values[0]) is float:  # read already (a loss on the CPU is read when it is kept)
        return [float(value) for value in values]
    if values and isinstance(values[0], torch.Tensor):
        try:  # the usual case: scalar tensors of one device and dtype, one stack and one transfer
            with torch.no_grad():
                read = torch.stack(values)
            if read.dim() == 1:
                return read.tolist()  # Python floats hold every float32/bfloat16/float16 value exactly
        except (TypeError, RuntimeError):
            pass
    out: list[float] = [0.0] * len(values)
    groups: dict[tuple, list[int]] = {}
    for position, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            groups.setdefault((str(value.device), value.dtype), []).append(position)
        else:
            out[position] = float(value)
    for positions in groups.values():
        with torch.no_grad():
            read = torch.stack([values[p].detach().reshape(()) for p in positions]).double().tolist()
        for position, value in zip(positions, read):
            out[position] = value
    return out
