"""The ranks of a formal run under torchrun (one node): who they are, and the few things they tell each other.

A protocol fixes its number of ranks (``training.ranks``), so every arm of a comparison trains on the same world;
``join`` refuses a process whose torchrun world is not the protocol's. Rank 0 is the run: it claims the folder,
starts the evaluator, writes every file and acts on stages. Every other rank trains the same model on its own
batches (DistributedDataParallel all-reduces the gradients) and writes nothing.

What the ranks exchange, and nothing else:

- **the charge of each update**, reduced by the clock's rule (``Clock.combine``: the maximum for the time clocks
  and updates, the sum for cpu), after the clock stopped measuring: every rank's meter is charged the same amount;
- **rank 0's answers**: whether it could claim the folder (or the sentence of its refusal), and its report;
- **a barrier** while rank 0 works outside the budget (a stage's checkpoint and evaluation);
- **each rank's resume state** (its sampler and RNG states, and an agent arm's optimizer state), gathered to rank 0
  for ``resume.pt``;
- for an agent arm, what ``opal.distributed`` tells the ranks: at each boundary between updates whether rank 0
  began running a new program (and its files), after an update of an agent's program whether it failed on any
  rank, and the parameter fingerprints.

The stage and stop facts are not broadcast: they are computed on every rank from the same numbers. A meter's
decisions (which fractions an update reached, whether a resume checkpoint is due, whether the budget is spent) are
a deterministic function of the sequence of charges it was given and of the state it was restored from; every
rank is given the same reduced charge at every update, in the same order, and a resume restores every rank's meter
from the one ``resume.pt``. So every rank reaches each boundary at the same update as rank 0, and rank 0's
decision is the one every rank follows (``tests/driver/test_torchrun_run.py`` checks the meters agree).

A single-process run (ranks 1) goes through ``Ranks``, world 1, with no torch.distributed at all: the clock is
not wrapped and the model is not wrapped, so the loop does exactly what it did before ranks existed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from opalctl.errors import BadInput, OpalctlError

MAX_RANKS = 64


class RankRefused(OpalctlError):
    """Rank 0 refused the run (its sentence and exit code), told to a rank that follows it."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def torchrun_line(ranks: int, opalctl_words: list[str]) -> list[str]:
    """The words of ``opalctl ...`` as torchrun starts it with ``ranks`` processes on this node."""
    return ["torchrun", "--nproc-per-node", str(ranks), "-m", *opalctl_words]


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s sampler: the run's seed itself on rank 0 (a ranks-1 run draws what it always
    drew), a digest of (seed, rank) on the others, so no two ranks draw the same batches."""
    if rank == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"opalctl-rank/{seed}/{rank}".encode()).digest()[:7], "big")


def world_from(environ: dict[str, str], protocol_ranks: int, command: str) -> tuple[int, int]:
    """(rank, world) of this process by torchrun's environment, refused in one sentence when the world is not the
    protocol's; ``command`` is the torchrun command line that would run it."""
    world = int(environ.get("WORLD_SIZE", "1") or "1")
    local = int(environ.get("LOCAL_WORLD_SIZE", str(world)) or str(world))
    if world != protocol_ranks and protocol_ranks > 1:
        raise BadInput(f"the lock's training.ranks is {protocol_ranks}, so this run needs {protocol_ranks} "
                       f"processes started by torchrun (this one has a world of {world}); run `{command}`")
    if world != protocol_ranks:
        raise BadInput(f"the lock's training.ranks is 1 but torchrun started {world} processes; run it in one "
                       f"process (`opalctl run` without torchrun), or freeze a protocol with training.ranks: {world}")
    if local != world:
        raise BadInput(f"a formal run uses one node, but torchrun's LOCAL_WORLD_SIZE is {local} of a world of "
                       f"{world}; start all {world} ranks on one machine")
    return int(environ.get("RANK", "0") or "0"), world


class Ranks:
    """The world of a single-process run: rank 0 of 1, no collectives, nothing wrapped."""

    rank = 0
    world = 1

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def reduced(self, clock, combine: str):
        """The clock whose ``stop`` charges the update's charge combined over ranks (``combine``)."""
        return clock

    def for_update(self, model):
        """The module the update's forward and backward run through."""
        return model

    def answer_of_lead(self, work: Callable[[], Any]) -> Any:
        """``work()`` on rank 0; its refusal (an ``OpalctlError``) is raised on every rank in the same sentence."""
        return work()

    def from_lead(self, value: Any) -> Any:
        return value

    def lead_alone(self, work: Callable[[], Any]) -> None:
        """``work()`` on rank 0 while the other ranks wait for it."""
        work()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, on rank 0 (``None`` elsewhere)."""
        return [value]

    def close(self) -> None:
        pass


class ReducedClock:
    """A clock whose charge is combined over the ranks after the measurement ended (outside the timed interval)."""

    def __init__(self, clock, reduce: Callable[[float], float]):
        self.clock, self._reduce = clock, reduce

    def start(self) -> Any:
        return self.clock.start()

    def stop(self, token: Any) -> float:
        return self._reduce(self.clock.stop(token))


class TorchRanks(Ranks):
    """The ranks of a torchrun world: the process group (gloo on the CPU; NCCL for CUDA, with the gloo group of
    ``opal.distributed.RankLink`` for the control messages), joined before the arm is built."""

    def __init__(self, rank: int, world: int, device: str):
        import torch.distributed as dist

        from opalctl.opal.distributed import RankLink

        # a caller that initialised the process group itself (a script running several runs) keeps it
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
        if device == "cuda":
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.link = RankLink()
        self.rank, self.world = self.link.rank, self.link.world
        if (self.rank, self.world) != (rank, world):
            raise OpalctlError(f"torch.distributed says rank {self.rank} of {self.world}, torchrun's environment "
                               f"rank {rank} of {world}; start the run with torchrun alone")

    def reduced(self, clock, combine: str):
        import torch
        import torch.distributed as dist

        op = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[combine]
        group = self.link.control

        def reduce(charge: float) -> float:
            value = torch.tensor([charge], dtype=torch.float64)
            dist.all_reduce(value, op=op, group=group)
            return float(value.item())

        return ReducedClock(clock, reduce)

    def for_update(self, model):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)

    def answer_of_lead(self, work: Callable[[], Any]) -> Any:
        refusal = None
        if self.lead:
            try:
                result = work()
            except OpalctlError as error:
                self.link.object_from_root((error.message, error.exit_code))
                raise
            self.link.object_from_root(refusal)
            return result
        refusal = self.link.object_from_root(None)
        if refusal is not None:
            raise RankRefused(*refusal)
        return None

    def from_lead(self, value: Any) -> Any:
        return self.link.object_from_root(value)

    def lead_alone(self, work: Callable[[], Any]) -> None:
        import torch.distributed as dist

        if self.lead:
            work()
        dist.barrier(group=self.link.control)

    def gather(self, value: Any) -> list[Any]:
        return self.link.gather_objects(value)

    def close(self) -> None:
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def join(protocol, command: str, environ: dict[str, str] | None = None) -> Ranks:
    """This process's ranks: ``Ranks`` for a protocol of one rank, else the torchrun world it must be part of."""
    rank, world = world_from(os.environ if environ is None else environ, protocol.training.ranks, command)
    if world == 1:
        return Ranks()
    return TorchRanks(rank, world, protocol.training.device)


class FollowerSteps:
    """The steps records of a rank that follows rank 0: rank 0 alone writes ``steps.jsonl.gz``, so a follower's
    loop keeps its rows until the next flush and drops them (the same loop body on every rank)."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []
        self.lines, self.seen, self.sha256, self.last_loss = 0, "", "", float("nan")

    def flush(self) -> None:
        self.lines += len(self.pending)
        self.pending.clear()

    def take_sums(self) -> dict[str, float]:
        self.flush()
        return {"train_wall": 0.0, "train_cpu": 0.0, "examples": 0, "nonfinite_losses": 0}

    def begin_sync(self) -> None:
        self.flush()

    def finish_sync(self) -> int:
        return 0

    def close(self) -> None:
        self.flush()

    def abandon(self) -> None:
        self.pending.clear()


def lost_rank(error: BaseException) -> str | None:
    """The first line of a collective's failure when another rank of the world is gone (killed, or stopped by
    torchrun), else None; the run then ends in one sentence that gives the command continuing it."""
    import torch.distributed as dist

    failed = isinstance(error, getattr(dist, "DistError", ())) or (
        isinstance(error, RuntimeError) and "gloo" in str(error).lower())
    return (str(error).strip().splitlines() or [type(error).__name__])[0] if failed else None


def prints_here(environ: dict[str, str] | None = None) -> bool:
    """Whether this process prints a run's report: rank 0 alone under torchrun (the others hold the same one)."""
    return (os.environ if environ is None else environ).get("RANK", "0") in ("", "0")
