"""The agent optimizer under torchrun / DDP, one node: one agent, on rank 0, and every rank on the same program.

Each rank wraps its own optimizer (``wrap_distributed``); DDP all-reduces the gradients, so every rank holds the
same parameters and gradients at every update, and the ranks stay one model as long as they run the same program
at the same update. Only rank 0 has the agent (its backend, its records, its workspace); the other ranks follow:

- **Programs.** Before each update rank 0 takes its boundary (a decision asked or applied) and broadcasts one flag:
  whether a new version is now running. When one is, its files follow and every other rank installs them before
  the same update (``ProgramSlots.swap_in``, the same static check and trial as on rank 0).
- **Failures.** While an agent's program runs, the ranks tell each other after each update whether it failed on
  them (one flag, reduced). A failure on any rank reverts the version on all at that update, and rank 0's
  parameters, optimizer state and scheduler state are sent to every rank: from the next update all run the
  fallback from one state. (A fallback that is itself an agent's program keeps its own state per rank; the
  fingerprints below would catch what that changed.)
- **Fingerprints.** Every ``check_every`` updates (and at the start and the close) each rank computes a
  fingerprint of every parameter on its device (two integer sums over the parameter's bits), the ranks gather
  them, and any difference stops training on every rank with ``RanksDiverged``, naming the rank, the parameter
  and the update: ranks that no longer train one model must not go on looking as if they did.

With ``keep`` (or before any change), each rank's update is exactly the user's optimizer step: a wrapped DDP run
is bit for bit the plain DDP run. The control messages go over a CPU (gloo) group, so on CUDA the only host
synchronisation is the fingerprint's, once every ``check_every`` updates.

Progress must be the same on every rank, so it is counted in updates (``total_steps``), never a callable, unless
the caller vouches that its callable answers the same on every rank at every update (``rank_consistent_progress``:
a formal run's budget meter, charged the same reduced charge on every rank, driver/ranks.py). A caller that times
its own updates (a formal run's budget loop) takes the boundaries between them instead of in ``step``
(``boundaries_between_updates``): every rank then calls ``between_updates`` after each update, outside its clock.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from opalctl.errors import OpalctlError
from opalctl.formats import Event
from opalctl.opal.optimizer import AgentOptimizer, linked_ranks, wrap
from opalctl.opal.settings import AgentSettings
from opalctl.opal.slots import version_digest

DEFAULT_CHECK_EVERY = 50
WEIGHT_PERIOD = 1021  # the position weights of the second sum: a swap of two values changes it
# what a rank that follows rank 0 never does on its own: ask an agent, keep records, schedule decisions
FOLLOWER_OPTIONS = {"backend": "keep", "decisions": 0, "schedule": "uniform", "run_dir": None, "max_wakes": 0,
                    "notes_dir": None}
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class RanksDiverged(OpalctlError):
    """The ranks of a DDP run no longer hold the same model, or cannot run the same program."""


def fingerprint(named: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[parameters, 2]`` int64 on the parameters' device: the sum of each parameter's bits read as integers, and
    the same sum weighted by position (wrapping on overflow, the same on every device). Equal parameters give
    equal fingerprints; one flipped bit changes the first sum."""
    rows = []
    for tensor in named.values():
        flat = tensor.detach().reshape(-1)
        bits = flat.view(BITS[flat.element_size()]).to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % WEIGHT_PERIOD + 1
        rows.append(torch.stack([bits.sum(), (bits * weights).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def _cpu(value: Any) -> Any:
    """A copy of a state dict with every tensor on the CPU (what crosses the control group)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {key: _cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(item) for item in value)
    return value


class RankLink:
    """The ranks as the agent optimizer needs them: this rank, the world, and a CPU group for control messages
    (the default group when it is gloo already; a gloo group beside NCCL, so a flag never waits on the device)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise OpalctlError("wrap_distributed needs torch.distributed initialised: call "
                               "torch.distributed.init_process_group (torchrun sets up its environment) before "
                               "wrapping, or use opalctl.opal.wrap in a single process")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.control = group if backend == "gloo" else dist.new_group(backend="gloo")

    def flag_from_root(self, value: int) -> int:
        """Rank 0's ``value``, on every rank."""
        flag = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(flag, src=self.root, group=self.control)
        return int(flag.item())

    def any_rank(self, value: bool) -> bool:
        """Whether ``value`` is true on any rank."""
        flag = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def object_from_root(self, value: Any) -> Any:
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self.root, group=self.control)
        return box[0]

    def gather_objects(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def tensor_from_root(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self.root, group=self.group)

    @property
    def root(self) -> int:
        """Rank 0 of the group, as the global rank the collectives name."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0


class DistributedAgent:
    """One rank's agent optimizer and the rules that keep the ranks on one program and one model (see the module
    docstring). ``agent`` is this rank's ``AgentOptimizer``; ``installed`` lists ``(update, version digest)`` for
    each program this rank began running at a boundary, ``reverts`` ``(update, failed ranks)`` for each revert."""

    def __init__(self, agent: AgentOptimizer, link: RankLink, check_every: int,
                 boundaries_between_updates: bool = False):
        if check_every < 1:
            raise ValueError("check_every must be a positive number of updates")
        self.agent = agent
        self.link = link
        self.check_every = check_every
        self.boundaries_between_updates = boundaries_between_updates
        self.installed: list[tuple[int, str]] = []
        self.reverts: list[tuple[int, list[int]]] = []
        self.diverged = False
        self.check()

    # -- what a training loop calls ------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.agent.param_groups

    @property
    def rank(self) -> int:
        return self.link.rank

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.agent.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None, loss=None):
        """One update on this rank: the boundary (rank 0 decides, every rank installs), the step, the failure
        flags while an agent's program runs, and the fingerprints every ``check_every`` updates."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        agent = self.agent
        if not self.boundaries_between_updates:
            self._boundary()
        version = agent.current
        watched = version is not agent.slots.versions[0]
        failures = agent.slots.step_failures
        agent.step(loss=loss)
        if watched and self.link.any_rank(agent.slots.step_failures != failures):
            self._revert_everywhere(version, failed=agent.slots.step_failures != failures)
        if agent.t % self.check_every == 0:
            self.check()
        return loss

    def close(self, wait: bool = True) -> dict[str, Any]:
        """The last fingerprint check (unless the ranks already diverged), then this rank's close."""
        if not self.diverged and self.agent.t % self.check_every != 0:
            self.check()
        return self.agent.close(wait=wait)

    def needs_boundary(self) -> bool:
        """With ``boundaries_between_updates``, True: every rank takes part in each boundary's flag, and rank 0
        alone asks its agent whether it needs one (the answer may differ between ranks, the flag does not)."""
        return self.boundaries_between_updates

    def between_updates(self) -> None:
        """The boundary between two updates (``boundaries_between_updates``), on every rank at the same update."""
        self._boundary()

    def report_dev(self, **facts: Any) -> None:
        """Rank 0's evaluation-integrity check (the records are rank 0's); nothing on the other ranks."""
        if self.rank == 0:
            self.agent.report_dev(**facts)

    def figures(self) -> dict[str, Any]:
        return self.agent.figures()

    def take_outside_charge(self) -> tuple[float, float]:
        """This rank's ``AgentOptimizer.take_outside_charge``."""
        return self.agent.take_outside_charge()

    def state_dict(self) -> dict[str, Any]:
        return self.agent.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agent.load_state_dict(state)
        self.check()

    # -- the rules -----------------------------------------------------------------------------------------
    def _boundary(self) -> None:
        """Rank 0 takes its boundary; a version it began running reaches every rank before the same update."""
        agent, t = self.agent, self.agent.t
        changed = 0
        if self.rank == 0:
            before = agent.current
            if agent.needs_boundary():
                agent.between_updates()
            changed = int(agent.current is not before)
        if not self.link.flag_from_root(changed):
            return
        files = self.link.object_from_root(dict(agent.current.files) if self.rank == 0 else None)
        if self.rank != 0:
            version, rejection = agent.slots.swap_in(files, t)
            if rejection is not None:
                raise RanksDiverged(f"rank {self.rank} cannot load the programs rank 0 began running at update {t} "
                                    f"({rejection.splitlines()[0]}); the ranks would train different models, so "
                                    f"training stops: check that every rank runs the same opalctl and torch")
        self.installed.append((t, version_digest(files)))

    def _revert_everywhere(self, version, *, failed: bool) -> None:
        """``version`` failed at the update just done on some rank: every rank runs its fallback from now on, from
        rank 0's state."""
        agent = self.agent
        update = agent.t - 1
        message = agent.observer.errors[-1]["message"] if failed and agent.observer.errors else ""
        reports = self.link.gather_objects((failed, message))
        ranks = [rank for rank, (did, _) in enumerate(reports) if did]
        if agent.current is version and version.status != "failed":
            fallback = agent.slots.revert(version)
            if self.rank == 0:
                said = "; ".join(f"rank {rank}: {reports[rank][1] or 'failed'}" for rank in ranks)
                agent.records.event(Event.REVERTED, update=update, version=version.number, to=fallback.number,
                                    reason="exception", message=f"failed on another rank ({said})", traceback="",
                                    restored="rank 0's state, on every rank")
                agent.decisions.reverted(version.number, update, f"failed on rank {ranks[0]}")
        self._state_from_root()
        self.reverts.append((update, ranks))

    def _state_from_root(self) -> None:
        """Rank 0's parameters, optimizer state and scheduler state, on every rank."""
        agent = self.agent
        with torch.no_grad():
            for parameter in agent.named.values():
                self.link.tensor_from_root(parameter.data)
        optimizer, scheduler = agent.spec.optimizer, agent.spec.scheduler
        sent = None
        if self.rank == 0:
            # only plain data crosses (pickling an object a program left in the user's optimizer would run its
            # code); what is left out of it is left out of rank 0's own optimizer too, so the ranks stay equal
            base, scheduler_state, _ = agent.user_state.checked(agent.current)
            sent = _cpu({"optimizer": base, "scheduler": scheduler_state})
        states = self.link.object_from_root(sent)
        if self.rank != 0:
            if states["optimizer"] is not None:
                optimizer.load_state_dict(states["optimizer"])
            if scheduler is not None and states["scheduler"] is not None:
                scheduler.load_state_dict(states["scheduler"])

    def check(self) -> None:
        """Compare every rank's parameter fingerprints; raise ``RanksDiverged`` on every rank on a difference."""
        agent = self.agent
        mine = fingerprint(agent.named).to("cpu")  # the one host synchronisation of this module, every K updates
        gathered = self.link.gather_objects(mine)
        names = list(agent.named)
        for rank, theirs in enumerate(gathered):
            if torch.equal(theirs, gathered[0]):
                continue
            row = next(i for i in range(len(names)) if not torch.equal(theirs[i], gathered[0][i]))
            self.diverged = True
            raise RanksDiverged(f"rank {rank}'s parameter {names[row]!r} differs from rank 0's at update {agent.t} "
                                f"(fingerprints compared every {self.check_every} updates); the ranks no longer "
                                f"train one model, so training stops: look for rank-dependent code in the training "
                                f"loop (a seed, a branch on the data) or a rank that skipped an update")


def wrap_distributed(optimizer: torch.optim.Optimizer, model: torch.nn.Module, settings: AgentSettings | None = None,
                     *, check_every: int = DEFAULT_CHECK_EVERY, group=None, rank_consistent_progress: bool = False,
                     boundaries_between_updates: bool = False, **keywords: Any) -> DistributedAgent:
    """``opalctl.opal.wrap`` for one rank of a DDP run (``model``: the module DDP wraps, ``ddp.module``). Every
    rank calls it with the same settings (an ``AgentSettings``, or ``wrap``'s keyword arguments); rank 0's
    ``backend`` and ``run_dir`` are the agent's, the other ranks follow rank 0 (see the module docstring).
    Boundaries are the wrapper's: call ``step(loss=...)`` each update (and ``between_updates()`` after it, with
    ``boundaries_between_updates``).

    ``rank_consistent_progress`` admits a ``progress`` callable in place of ``total_steps``: only for a caller
    whose progress is computed on every rank from the same numbers (a formal run's budget meter), since ranks
    whose progress differs would schedule different decisions."""
    if "manual_boundaries" in keywords or (settings is not None and settings.manual_boundaries):
        raise ValueError("under torchrun boundaries are taken by the wrapper: leave out manual_boundaries")
    if (keywords.get("progress") is not None or (settings is not None and settings.progress is not None)) \
            and not rank_consistent_progress:
        raise ValueError("under torchrun progress is counted in updates (total_steps), equal on every rank: leave "
                         "out progress, or pass rank_consistent_progress=True when it is the same on every rank")
    link = RankLink(group)
    keywords = {**keywords, "manual_boundaries": True}
    if link.rank != 0:
        keywords.update(FOLLOWER_OPTIONS)
    with linked_ranks():
        agent = wrap(optimizer, model, AgentSettings.of(settings, **keywords))
    return DistributedAgent(agent, link, check_every, boundaries_between_updates)
