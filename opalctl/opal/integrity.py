"""Evaluation integrity (docs/architecture.md): notice a program that moves the parameters to another point for an
evaluation and moves them back after it.

How it works, and what each part costs:

- **The sample.** At construction every floating-point tensor gets a fixed, seeded sample of its entries (logical
  flat indices, the same whatever the memory layout). The budget is at most ``per_tensor`` (1,024) entries per tensor
  and ``total`` (32,768) in all, split as an *equal share*: every tensor gets the same number of entries, capped at
  its size and at ``per_tensor``, and what the small tensors do not use goes to the larger ones (the largest share
  ``c`` with ``sum(min(size, per_tensor, c)) <= total``; the few entries left over go one each to the largest
  tensors). A share in proportion to size would starve the small tensors (biases, norms, gains), which are the
  cheapest to move and back, so they get the same share as the big ones. ``minimum`` (32) entries in all are taken
  whenever the model has that many: with the default limits this always holds; only a ``per_tensor`` below
  ``minimum / tensors`` is raised to reach it. With more tensors than ``total`` (not a real model) the largest
  ``total`` tensors get one entry each. Which entries a tensor gets depends on ``seed``, its name and its size only
  (``numpy.random.default_rng([seed, crc32(name)])``), not on the other tensors.
- **The ring.** One ring per (device, dtype) of the parameters, on that device and in that dtype (so the samples are
  exact), of shape ``(window_before + window_after + 2, samples)``: row ``u % rows`` holds the sampled values after
  update ``u``. Each sampled logical index is converted once, with the tensor's strides, into a memory offset (so
  transposed, sliced, permuted and channels-last parameters are sampled at the same logical entries as a contiguous
  one, and never copied). ``record(u)`` fills the row with **one gather per ring**: ``index_select`` from a flat
  integer alias of the address range that holds the ring's tensors (made through numpy's ``__array_interface__``
  on the CPU, ``__cuda_array_interface__`` on CUDA), at every sampled entry's offset in it, written straight into
  the row (``out=``, the row viewed as integers of the same size: a bit-exact copy). One operation per update
  whatever the number of tensors; where no alias can be made (another device type, a tensor not sampleable now)
  each tensor is gathered on its own into its slice of the row. Device operations only: no ``.item()``,
  ``.cpu()`` or ``.tolist()``, so no host synchronisation. ``alias=False`` is the plain twin of the gather: every
  tensor is copied on its own into its slice of the row (the same bytes and findings, tested). Memory safety:
  only the sampled offsets are read, all inside the tensors' own memory, which the recorder keeps alive through a
  flat view of each (``_Rings``); before every gather
  each tensor's data pointer, strides and shape (host metadata, no sync; the pointer alone when the caller knows
  no code that could re-stride a tensor in place has run, see ``record``) are compared with those the offsets were
  made for, and on a change (a program that assigns ``p.data``, transposes in place, frees a storage) the view,
  offsets and alias are rebuilt on the device first. A tensor whose shape, dtype or device changed, or whose
  storage no longer holds it, is not sampled for that update (the update is left out of its window). The alias is
  checked once against the per-tensor gathers at construction (a host read then, never later).
- **Cost.** Everything here runs between two updates, with cold caches, so it costs several times what it
  does in a tight loop; that is why the usual case is one gather per update and why the agent optimizer compares
  pointers only (``layouts=False``) while the released starting program runs. Host-side work grows with the
  number of tensors, the device work does not. The measured figures are in bench/README.md
  (``bench/integrity_overhead.py``).
- **The check.** ``open_check(t)`` is called when an evaluation happens after update ``t`` (``report_dev``).
  ``maybe_check(u)``, called after each ``record``, runs the check once the ring holds update
  ``t + window_after``: the whole ring (which is exactly the window) is read in one transfer per ring, and the rest
  is numpy on the host.

Detection, per tensor, on the window of updates ``t - window_before .. t + window_after``:

- the *change* of update ``u`` is the L2 norm of the difference of the sampled rows after ``u`` and after ``u - 1``;
  its *norm* is the larger L2 norm of those two rows;
- ``u`` is a *jump* when its change exceeds ``5 x`` the median of the non-zero changes in the window (with fewer than
  8 non-zero changes the median counts as 0) and ``0.1 %`` of its norm. A tensor that never changes has no jump;
- ``a`` is the last jump at or before ``t``; it *moved the evaluated point* when the distance between the rows after
  ``t`` and before ``a`` is at least half the jump;
- ``b`` is the first jump after ``t``; it *brings it back* when the distance between the rows after ``b`` and before
  ``a`` is within 25 % of that distance;
- a *stretch of large updates*: ``a`` (or ``b``) is part of one when at least half of its nearest neighbours
  ``u - 2 .. u + 2`` (those recorded in the window, leaving out the partner ``b`` or ``a``: a move away right
  before the move back is the very thing looked for; at least one) changed by more than twice the window's median
  *and* more than a third of the jump itself. A warm-up, a sustained change of the learning rate, a restart of a
  schedule or a phase of large noisy updates put comparable updates around a jump; a program's excursion stands
  alone, even though the network's own updates right after it may grow (a rule that called two large neighbours
  a stretch, or a jump next to a jump, missed such excursions in the tests).

A round trip (``a`` moved the evaluated point, ``b`` brought it back, neither in a stretch) is a finding of kind
``round_trip``: it flags the run. A jump not in a stretch that moved the evaluated point and was not brought back
is a ``lasting_jump``: information only. One departure from the letter of the rule, for tensors sampled at fewer
than 8 entries (a scalar gain, the output bias of a one- or two-output head): there, two opposite noise spikes of
similar size "return within 25 %" by chance (in one dimension any two opposite spikes within 25 % of each other
do), and plain SGD on a 10-32-1 MLP with a 10x learning-rate step or schedule restarts showed such round trips on
the scalar output bias at up to about 1 % of evaluations (none at 4 or 8 entries). Their round trips are reported
as ``round_trip_small``, information only. Findings are plain dicts of ints, floats and strings.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from opalctl.formats import RecordDamaged

FORMAT = "opal-integrity/1"

JUMP_FACTOR = 5.0  # a jump's change exceeds this many times the window's median non-zero change ...
JUMP_NORM_SHARE = 1e-3  # ... and this share of the tensor's sampled norm
MIN_NONZERO = 8  # fewer non-zero changes in the window than this: the median counts as 0
AWAY_SHARE = 0.5  # the evaluated point is at least this share of the jump away from before it
BACK_SHARE = 0.25  # the move back lands within this share of that distance of the point before the jump
LARGE_FACTOR = 2.0  # a neighbour is "large" (for stretches) when it changes more than this many times the median
COMPARABLE_SHARE = 1 / 3  # ... and more than this share of the jump it neighbours
MIN_SAMPLES_TO_FLAG = 8  # a round trip in a tensor sampled at fewer entries is information only


def sample_sizes(numels: list[int], per_tensor: int = 1024, total: int = 32768, minimum: int = 32) -> list[int]:
    """How many entries each tensor gets (see the module docstring: an equal share, capped by size)."""
    sizes = _equal_share([min(n, per_tensor) for n in numels], numels, total)
    wanted = min(minimum, sum(numels), total)
    if sum(sizes) < wanted:  # only when per_tensor * tensors < minimum: raise the per-tensor cap to reach it
        sizes = _equal_share(list(numels), numels, wanted)
    return sizes


def _equal_share(caps: list[int], numels: list[int], total: int) -> list[int]:
    if sum(caps) <= total:
        return list(caps)
    low, high = 0, max(caps)  # the largest share c with sum(min(cap, c)) <= total
    while low < high:
        middle = (low + high + 1) // 2
        if sum(min(cap, middle) for cap in caps) <= total:
            low = middle
        else:
            high = middle - 1
    sizes = [min(cap, low) for cap in caps]
    left = total - sum(sizes)
    above = sorted((i for i, cap in enumerate(caps) if cap > low), key=lambda i: (-numels[i], i))
    for i in above[:left]:
        sizes[i] += 1
    return sizes


def sample_indices(name: str, numel: int, count: int, seed: int = 0) -> np.ndarray:
    """The logical flat indices sampled from tensor ``name`` (sorted, int64)."""
    if count >= numel:
        return np.arange(numel, dtype=np.int64)
    rng = np.random.default_rng([seed % (1 << 63), zlib.crc32(name.encode("utf-8"))])
    return np.sort(rng.choice(numel, size=count, replace=False, shuffle=False).astype(np.int64))


def memory_offsets(index: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """Memory offsets (relative to the tensor's storage offset) of the logical flat indices ``index`` of a tensor of
    this shape and these strides. Device integer arithmetic with Python ints: no host synchronisation."""
    offsets = torch.zeros_like(index)
    rest = index
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size > 1:
            offsets = offsets + (rest % size) * stride
            rest = rest // size
    return offsets


def _span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))


_DATA_PTR = torch.Tensor.data_ptr
_INDEX_SELECT = torch.index_select

_INTEGER = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"), 8: (torch.int64, "<i8")}


class _Interface:
    """An object exposing a raw address range through numpy's or CUDA's array interface (zero copy)."""

    def __init__(self, name: str, interface: dict[str, Any]):
        setattr(self, name, interface)


def _alias(device: torch.device, base: int, count: int, itemsize: int) -> torch.Tensor | None:
    """A flat integer tensor over ``count`` elements of ``itemsize`` bytes from address ``base`` on ``device``, or
    None where no such alias can be made (a device other than the CPU and CUDA, an item size without an integer)."""
    if itemsize not in _INTEGER or device.type not in ("cpu", "cuda"):
        return None
    dtype, typestr = _INTEGER[itemsize]
    interface = {"shape": (count,), "typestr": typestr, "data": (base, False), "version": 2}
    try:
        if device.type == "cpu":
            alias = torch.from_numpy(np.asarray(_Interface("__array_interface__", {**interface, "version": 3})))
        else:  # no "stream" key: torch then waits on nothing (no synchronisation)
            alias = torch.as_tensor(_Interface("__cuda_array_interface__", interface))
    except Exception:  # noqa: BLE001 - no alias: the per-tensor copies do the same work
        return None
    if alias.device != device or alias.dtype != dtype or alias.data_ptr() != base or alias.numel() != count:
        return None  # not an alias of that memory (a copy, another device): never use it
    return alias


class _Group:
    """The ring of the tensors that share a device and a dtype, and the one gather that fills a row of it."""

    __slots__ = ("device", "dtype", "ring", "members", "alias", "offsets", "rows", "trusted")

    def __init__(self, device: torch.device, dtype: torch.dtype, trusted: bool):
        self.device, self.dtype = device, dtype
        self.ring: torch.Tensor | None = None
        self.members: list[int] = []
        self.alias: torch.Tensor | None = None  # the address range holding the members, as integers of their size
        self.offsets: torch.Tensor | None = None  # every member's sampled entries, as element offsets into alias
        self.rows: list[torch.Tensor] = []  # the ring's rows as the alias's integer dtype
        self.trusted = trusted  # False: per-tensor copies only (asked for, or the alias failed its self-check)


class _Rings:
    """The rings of the sampled tensors and the gathers that fill a row of them: each tensor's flat view (which
    keeps its memory alive) and the memory offsets of its sample, its group (one per device and dtype), and each
    group's alias. ``alias=False`` is the plain twin: every tensor is copied on its own (the same bytes, tested)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], indices: dict[str, np.ndarray], rows: int, alias: bool):
        self.rows = rows
        self.names: list[str] = list(indices)
        self.params: list[torch.Tensor] = [tensors[name] for name in self.names]
        self.shape = [tuple(p.shape) for p in self.params]
        self.dtype = [p.dtype for p in self.params]
        self.device = [p.device for p in self.params]
        self.host_index = {name: np.ascontiguousarray(indices[name], dtype=np.int64) for name in self.names}
        # logical indices, on the tensor's device
        self.index = [torch.from_numpy(self.host_index[name]).to(self.device[k]) for k, name in enumerate(self.names)]
        groups: dict[tuple[str, torch.dtype], _Group] = {}
        self.group_of: list[_Group] = []
        for k in range(len(self.names)):
            key = (str(self.device[k]), self.dtype[k])
            group = groups.setdefault(key, _Group(self.device[k], self.dtype[k], trusted=alias))
            group.members.append(k)
            self.group_of.append(group)
        self.groups = list(groups.values())
        self.columns = self._make_rings()
        self.keys: list[Any] = [None] * len(self.names)
        self.pointers: list[int | None] = [None] * len(self.names)  # the data pointers in keys
        self.flats: list[torch.Tensor | None] = [None] * len(self.names)
        self.offsets: list[torch.Tensor | None] = [None] * len(self.names)
        for k in range(len(self.names)):
            self._relayout(k)
        for group in self.groups:
            self._gather_plan(group)
            self._check_alias(group)
        self.single = self._plan_single()

    def _make_rings(self) -> list[tuple[int, int]]:
        """Each group's ring; returns each tensor's columns in its group's ring."""
        columns = [(0, 0)] * len(self.names)
        for group in self.groups:
            column = 0
            for k in group.members:
                count = len(self.host_index[self.names[k]])
                columns[k] = (column, column + count)
                column += count
            group.ring = torch.zeros((self.rows, column), dtype=group.dtype, device=group.device)
        return columns

    def _check_alias(self, group: _Group) -> None:
        """The alias against the per-tensor gathers, once (a host read, here only): bit for bit (as integers: NaN
        equals itself), or per-tensor copies from then on."""
        if group.alias is None:
            return
        torch.index_select(group.alias, 0, group.offsets, out=group.rows[0])
        via_alias = group.rows[0].clone()
        self.copy_each(group, 0)
        if not torch.equal(via_alias, group.rows[0]):
            group.trusted, group.alias = False, None
        group.ring[0].zero_()

    def _relayout(self, k: int) -> bool:
        """(Re)build tensor ``k``'s flat view and the memory offsets of its sample; False when it cannot be sampled
        as it is now (another shape, dtype or device)."""
        param = self.params[k]
        if tuple(param.shape) != self.shape[k] or param.dtype != self.dtype[k] or param.device != self.device[k]:
            self.keys[k] = self.pointers[k] = None
            return False
        strides = tuple(param.stride())
        data = param.detach()
        try:
            flat = data.as_strided((_span(self.shape[k], strides),), (1,), data.storage_offset())
        except RuntimeError:  # its storage was shrunk under it (untyped_storage().resize_), say
            self.keys[k] = self.pointers[k] = None
            return False
        self.flats[k] = flat
        self.offsets[k] = memory_offsets(self.index[k], self.shape[k], strides)
        self.keys[k] = (param.data_ptr(), strides, param.shape)
        self.pointers[k] = self.keys[k][0]
        return True

    def _plan_single(self) -> _Group | None:
        only = self.groups[0] if len(self.groups) == 1 else None
        return only if only is not None and only.alias is not None else None

    def _gather_plan(self, group: _Group) -> None:
        """One gather per row for the whole group: an alias over the address range that holds every member's
        memory and each sampled entry's offset in it. Only the sampled offsets are ever read, all inside members'
        memory, which the flat views hold alive; ``fill`` checks every member's pointer (and strides and shape)
        before each gather. Without an alias (another device type, a member not sampled now, odd alignment, or
        the plain twin) the members are copied one by one."""
        group.alias, group.offsets = None, None
        if not group.trusted or any(self.keys[k] is None for k in group.members):
            return
        itemsize = group.ring.element_size()
        starts = [self.flats[k].data_ptr() for k in group.members]
        ends = [start + self.flats[k].numel() * itemsize for start, k in zip(starts, group.members)]
        base = min(starts)
        if any((start - base) % itemsize for start in starts):
            return
        alias = _alias(group.device, base, (max(ends) - base) // itemsize, itemsize)
        if alias is None:
            return
        group.offsets = torch.cat([self.offsets[k] + (start - base) // itemsize
                                   for start, k in zip(starts, group.members)])
        group.rows = [group.ring[slot].view(alias.dtype) for slot in range(self.rows)]
        group.alias = alias

    def copy_each(self, group: _Group, slot: int) -> list[int]:
        """Gather each member on its own into its slice of the row; returns the members not sampled now."""
        row = group.ring[slot]
        missing = []
        for k in group.members:
            if self.keys[k] is None:
                missing.append(k)
                continue
            begin, end = self.columns[k]
            torch.index_select(self.flats[k], 0, self.offsets[k], out=row[begin:end])
        return missing

    def refresh(self) -> None:
        """Some tensor's pointer, strides or shape changed (a program assigned ``p.data``, say): rebuild its view
        and offsets on the device (no host read) and the gather plan of its group."""
        changed = set()
        for k, param in enumerate(self.params):
            if self.keys[k] is None or self.keys[k] != (param.data_ptr(), tuple(param.stride()), param.shape):
                self._relayout(k)
                changed.add(id(self.group_of[k]))
        for group in self.groups:
            if id(group) in changed:
                self._gather_plan(group)
        self.single = self._plan_single()

    def fill(self, slot: int, layouts: bool) -> list[int] | None:
        """Row ``slot`` of every ring from the tensors as they are now; returns the tensors not sampled (None or
        empty when all were). See ``IntegrityRecorder.record`` for ``layouts``."""
        if layouts:
            if [(p.data_ptr(), p.stride(), p.shape) for p in self.params] != self.keys:
                self.refresh()
        elif list(map(_DATA_PTR, self.params)) != self.pointers:
            self.refresh()
        single = self.single
        if single is not None:  # one ring with its alias (one device and dtype): the usual case
            _INDEX_SELECT(single.alias, 0, single.offsets, out=single.rows[slot])
            return None
        missing = []
        for group in self.groups:
            if group.alias is not None:
                _INDEX_SELECT(group.alias, 0, group.offsets, out=group.rows[slot])
            else:
                missing.extend(self.copy_each(group, slot))
        return missing

    def read(self) -> list[np.ndarray]:
        """Each ring on the host as float64: one transfer per ring (the ring is exactly the window)."""
        return [group.ring.detach().to("cpu").to(torch.float64).numpy() for group in self.groups]

    def columns_of(self, values: list[np.ndarray], k: int) -> np.ndarray:
        """Tensor ``k``'s columns of the rings ``values`` (as ``read`` returns them)."""
        begin, end = self.columns[k]
        return values[self.groups.index(self.group_of[k])][:, begin:end]

    def ring_of(self, k: int) -> torch.Tensor:
        """Tensor ``k``'s columns of its ring, on its device."""
        begin, end = self.columns[k]
        return self.group_of[k].ring[:, begin:end]


class IntegrityRecorder:
    """Records a seeded sample of every tensor after each update and checks the window around each evaluation.

    ``record(update)`` after every optimizer step (``update`` is the number of updates done, so the row is the
    point an evaluation after that update sees); ``open_check(update)`` when an evaluation happens;
    ``maybe_check(update)`` after each record returns the findings of the checks that became due (``None`` when
    none was due, a list, possibly empty, when one ran). ``start`` (default 0) records the values at construction
    as that update, so that a jump at the first update can be seen. ``enabled = False`` turns every call into a
    no-op; ``alias = False`` gathers every tensor on its own (the plain twin of the one gather per ring). See the
    module docstring for the sample, the ring and the rules."""

    def __init__(self, named_params: Mapping[str, torch.Tensor], seed: int = 0, window_before: int = 128,
                 window_after: int = 8, per_tensor: int = 1024, total: int = 32768, minimum: int = 32, *,
                 enabled: bool = True, start: int | None = 0, alias: bool = True):
        if window_before < 1 or window_after < 1:
            raise ValueError("window_before and window_after must be at least 1")
        if per_tensor < 1 or total < 1 or minimum < 0 or minimum > total:
            raise ValueError("need per_tensor >= 1, total >= 1 and 0 <= minimum <= total")
        self.seed = int(seed)
        self.window_before = int(window_before)
        self.window_after = int(window_after)
        self.per_tensor, self.total, self.minimum = int(per_tensor), int(total), int(minimum)
        self.enabled = bool(enabled)
        self.alias = bool(alias)
        self.rows = self.window_before + self.window_after + 2
        self.skipped: dict[str, str] = {}  # tensors not sampled, and why
        self._all = self._eligible(named_params)
        names = list(self._all)
        sizes = sample_sizes([self._all[n].numel() for n in names], self.per_tensor, self.total, self.minimum)
        indices = {name: sample_indices(name, self._all[name].numel(), size, self.seed)
                   for name, size in zip(names, sizes) if size > 0}
        for name, size in zip(names, sizes):
            if size == 0:
                self.skipped[name] = "over the total budget"
        self._build(indices)
        self.last: int | None = None
        self.pending: list[int] = []
        self.checked: list[int] = []  # the evaluations checked by the last call that ran a check
        if start is not None and self.enabled:
            self.record(int(start))

    def _eligible(self, named_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors that can be sampled (``skipped`` says why the others cannot)."""
        eligible: dict[str, torch.Tensor] = {}
        for name, param in named_params.items():
            if param.layout != torch.strided:
                self.skipped[name] = f"layout {param.layout}"
            elif not param.dtype.is_floating_point:
                self.skipped[name] = f"dtype {param.dtype}"
            elif param.device.type == "meta":
                self.skipped[name] = "meta device"
            elif param.numel() == 0:
                self.skipped[name] = "empty"
            else:
                eligible[name] = param
        return eligible

    def _build(self, indices: dict[str, np.ndarray]) -> None:
        self._rings = _Rings(self._all, indices, self.rows, self.alias)
        self.slot_update: list[int | None] = [None] * self.rows
        self.gaps: dict[int, set[int]] = {}  # update -> tensors (positions) not sampled at that update
        self.breaks: set[int] = set()  # updates whose change is not judged (see discontinuity)

    @property
    def names(self) -> list[str]:
        return self._rings.names

    @property
    def groups(self) -> list[_Group]:
        return self._rings.groups

    @property
    def sample_counts(self) -> dict[str, int]:
        return {name: len(index) for name, index in self._rings.host_index.items()}

    def indices(self, name: str) -> np.ndarray:
        """The logical flat indices sampled from tensor ``name``."""
        return self._rings.host_index[name].copy()

    # -- recording ---------------------------------------------------------------------------------------------
    def record(self, update: int, layouts: bool = True) -> None:
        """Copy the sampled entries of every tensor into the ring row of ``update``: one gather per ring (per
        tensor where no alias could be made). Device operations only, no host synchronisation.

        Before the gather every tensor's data pointer is compared with the one its offsets were made for (memory
        safety: a tensor given new memory, or whose storage was freed, is never read at the old addresses), and
        with ``layouts`` (the default) its strides and shape too (a tensor re-strided in place, ``t_()`` say,
        still samples the same logical entries). A caller that knows no code that could re-stride a tensor in
        place ran since the last record (the agent optimizer while the released starting program runs: it only
        calls the user's torch optimizer) may pass ``layouts=False``: the pointer comparison alone costs less."""
        if not self.enabled:
            return
        slot = update % self.rows
        if self.gaps:  # forget what was missing in the row about to be overwritten (or recorded again)
            self.gaps.pop(update, None)
            previous = self.slot_update[slot]
            if previous is not None:
                self.gaps.pop(previous, None)
        missing = self._rings.fill(slot, layouts)
        if missing:
            self.gaps.setdefault(update, set()).update(missing)
        self.slot_update[slot] = update
        self.last = update

    def discontinuity(self, update: int) -> None:
        """The change made at ``update`` is not the program's (a rollback, a restored checkpoint): not judged."""
        self.breaks.add(int(update))
        if len(self.breaks) > 4 * self.rows:
            floor = (self.last or 0) - 2 * self.rows
            self.breaks = {u for u in self.breaks if u >= floor}

    # -- checks ------------------------------------------------------------------------------------------------
    def open_check(self, update: int) -> None:
        """An evaluation happened after ``update``: check its window once the ring holds ``update + window_after``."""
        if not self.enabled:
            return
        update = int(update)
        if update not in self.pending:
            self.pending.append(update)
            self.pending.sort()

    def maybe_check(self, update: int) -> list[dict[str, Any]] | None:
        """Run the checks that are due at ``update`` (None when none is: cheap enough to call after every record)."""
        pending = self.pending
        if not pending or update < pending[0] + self.window_after or not self.enabled:
            return None
        due = [t for t in pending if t + self.window_after <= update]
        self.pending = [t for t in pending if t + self.window_after > update]
        return self._run(due)

    def flush(self) -> list[dict[str, Any]] | None:
        """Run every pending check now, with the updates recorded so far (at the end of a run)."""
        if not self.pending or not self.enabled:
            return None
        due, self.pending = self.pending, []
        return self._run(due)

    def check(self, update: int) -> list[dict[str, Any]]:
        """Check the evaluation after ``update`` now, with what the ring holds (pending checks are left alone)."""
        return self._run([int(update)])

    def _run(self, evaluations: list[int]) -> list[dict[str, Any]]:
        values = self._rings.read()
        findings: list[dict[str, Any]] = []
        for t in evaluations:
            findings.extend(self._check_window(values, t))
        self.checked = list(evaluations)
        return findings

    def window(self, update: int) -> dict[str, tuple[list[int], np.ndarray]]:
        """Per tensor, the updates recorded in the window of ``update`` and their sampled rows (host, float64)."""
        values = self._rings.read()
        out = {}
        for k, name in enumerate(self.names):
            updates, (rows, valid) = self._rows_of(values, k, update)
            out[name] = ([u for u, ok in zip(updates, valid) if ok], rows[valid])
        return out

    def values_at(self, update: int) -> dict[str, np.ndarray] | None:
        """The sampled values recorded for ``update`` (host, float64), None when the ring no longer holds it."""
        slot = update % self.rows
        if self.slot_update[slot] != update:
            return None
        values = self._rings.read()
        out = {}
        for k, name in enumerate(self.names):
            if k in self.gaps.get(update, ()):
                continue
            out[name] = self._rings.columns_of(values, k)[slot].copy()
        return out

    def _rows_of(self, values: list[np.ndarray], k: int, t: int):
        low, high = t - self.window_before - 1, t + self.window_after
        updates = list(range(low, high + 1))
        slots = [u % self.rows for u in updates]
        valid = np.array([u >= 0 and self.slot_update[s] == u and k not in self.gaps.get(u, ())
                          for u, s in zip(updates, slots)], dtype=bool)
        return updates, (self._rings.columns_of(values, k)[slots], valid)

    def _check_window(self, values: list[np.ndarray], t: int) -> list[dict[str, Any]]:
        findings = []
        for k, name in enumerate(self.names):
            finding = self._check_tensor(values, k, t)
            if finding is not None:
                finding["tensor"] = name
                findings.append(finding)
        return findings

    def _check_tensor(self, values: list[np.ndarray], k: int, t: int) -> dict[str, Any] | None:
        updates, (rows, valid) = self._rows_of(values, k, t)
        low = updates[0]
        at = t - low  # position of the row after t
        if not valid[at]:
            return None
        norms = np.linalg.norm(rows, axis=1)
        change = np.linalg.norm(rows[1:] - rows[:-1], axis=1)  # change[j] is the change of update low + 1 + j
        ok = valid[1:] & valid[:-1] & np.isfinite(change)
        if self.breaks:
            ok &= np.array([u not in self.breaks for u in updates[1:]], dtype=bool)
        nonzero = change[ok & (change > 0)]
        median = float(np.median(nonzero)) if len(nonzero) >= MIN_NONZERO else 0.0
        size = np.maximum(norms[1:], norms[:-1])
        with np.errstate(invalid="ignore"):
            jump = ok & (change > JUMP_FACTOR * median) & (change > JUMP_NORM_SHARE * size)
        if not jump.any():
            return None

        def position(update: int) -> int:  # index into change / jump
            return update - low - 1

        def known(update: int) -> bool:
            j = position(update)
            return 0 <= j < len(jump) and bool(ok[j])

        def in_stretch(update: int, partner: int | None) -> bool:
            neighbours = [u for u in (update - 2, update - 1, update + 1, update + 2) if u != partner and known(u)]
            bar = max(LARGE_FACTOR * median, COMPARABLE_SHARE * float(change[position(update)]))
            large = sum(1 for u in neighbours if change[position(u)] > bar)
            return large >= 1 and 2 * large >= len(neighbours)

        before_t = [u for u in range(low + 1, t + 1) if jump[position(u)]]
        if not before_t:
            return None
        a = before_t[-1]
        start = rows[position(a)]  # the row before a
        distance = float(np.linalg.norm(rows[at] - start))
        jump_a = float(change[position(a)])
        if not distance >= AWAY_SHARE * jump_a:
            return None
        after_t = [u for u in range(t + 1, updates[-1] + 1) if jump[position(u)]]
        facts = {"evaluated_at": t, "away": a, "distance": distance, "jump": jump_a,
                 "norm": float(norms[at]), "median_change": median, "samples": int(rows.shape[1])}
        if after_t:
            b = after_t[0]
            residual = float(np.linalg.norm(rows[position(b) + 1] - start))
            if residual <= BACK_SHARE * distance:
                if not in_stretch(a, b) and not in_stretch(b, a):
                    kind = "round_trip" if rows.shape[1] >= MIN_SAMPLES_TO_FLAG else "round_trip_small"
                    return {"kind": kind, **facts, "back": b, "back_jump": float(change[position(b)]),
                            "residual": residual}
                return None  # it came back, within a stretch of large updates: not a finding
        if in_stretch(a, None):
            return None
        return {"kind": "lasting_jump", **facts}

    # -- state -------------------------------------------------------------------------------------------------
    def _config(self) -> dict[str, int]:
        return {"seed": self.seed, "window_before": self.window_before, "window_after": self.window_after,
                "per_tensor": self.per_tensor, "total": self.total, "minimum": self.minimum}

    def state_dict(self) -> dict[str, Any]:
        """The sample, the ring (copied to the host) and the pending checks, so that a resumed run goes on
        exactly."""
        values = {}
        for k, name in enumerate(self.names):
            values[name] = self._rings.ring_of(k).detach().to("cpu", copy=True)
        return {
            "format": FORMAT,
            "config": self._config(),
            "enabled": self.enabled,
            "tensors": {name: {"shape": list(self._rings.shape[k]), "indices": torch.from_numpy(self.indices(name))}
                        for k, name in enumerate(self.names)},
            "ring": values,
            "slot_update": list(self.slot_update),
            "last": self.last,
            "pending": list(self.pending),
            "gaps": {int(u): sorted(self.names[k] for k in ks) for u, ks in self.gaps.items()},
            "breaks": sorted(self.breaks),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != FORMAT:
            raise RecordDamaged(f"the saved state is not an integrity recorder state ({FORMAT}); resume from a "
                                f"checkpoint this opalctl wrote")
        if dict(state["config"]) != self._config():
            raise RecordDamaged(f"the integrity recorder was saved with {dict(state['config'])}, not {self._config()}; "
                                f"resume with the settings the run started with")
        tensors = state["tensors"]
        unknown = [name for name in tensors if name not in self._all]
        if unknown:
            raise RecordDamaged(f"the saved integrity state samples tensors this model does not have ({unknown[:3]}); "
                                f"resume with the model the run started with")
        for name, entry in tensors.items():
            if tuple(entry["shape"]) != tuple(self._all[name].shape):
                raise RecordDamaged(f"tensor {name} has shape {tuple(self._all[name].shape)}, the saved integrity "
                                    f"state {tuple(entry['shape'])}; resume with the model the run started with")
        indices = {name: np.asarray(entry["indices"].cpu().numpy() if isinstance(entry["indices"], torch.Tensor)
                                    else entry["indices"], dtype=np.int64)
                   for name, entry in tensors.items()}
        self._build(indices)
        for k, name in enumerate(self.names):
            self._rings.ring_of(k).copy_(state["ring"][name])
        self.enabled = bool(state["enabled"])
        self.slot_update = list(state["slot_update"])
        self.last = state["last"]
        self.pending = sorted(int(t) for t in state["pending"])
        position = {name: k for k, name in enumerate(self.names)}
        self.gaps = {int(u): {position[n] for n in names if n in position} for u, names in state["gaps"].items()}
        self.breaks = {int(u) for u in state["breaks"]}


def summarise(findings: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Counts for a report: ``{"flagged", "round_trips", "lasting_jumps", "small_round_trips", "tensors"}``
    (``tensors``: those with a round trip that flags the run)."""
    findings = list(findings)
    trips = [f for f in findings if f["kind"] == "round_trip"]
    return {"flagged": bool(trips), "round_trips": len(trips),
            "lasting_jumps": sum(1 for f in findings if f["kind"] == "lasting_jump"),
            "small_round_trips": sum(1 for f in findings if f["kind"] == "round_trip_small"),
            "tensors": sorted({f["tensor"] for f in trips})}


__all__ = ["IntegrityRecorder", "sample_sizes", "sample_indices", "memory_offsets", "summarise", "FORMAT",
           "JUMP_FACTOR", "JUMP_NORM_SHARE", "MIN_NONZERO", "AWAY_SHARE", "BACK_SHARE", "LARGE_FACTOR",
           "COMPARABLE_SHARE", "MIN_SAMPLES_TO_FLAG"]
