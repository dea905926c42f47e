"""One rank of the DDP tests, started by ``torchrun --nproc_per_node 2 ddp_worker.py OUT [gloo|nccl]`` (gloo on
the CPU by default; nccl on one GPU per rank, for tests/gpu): every scenario in one launch (torchrun's start-up
costs seconds), each rank writing what it saw to ``OUT/rank-R.json``.

- ``keep``: a wrapped DDP run with the keep backend against the plain DDP run, bit for bit;
- ``heuristic``: the heuristic agent on rank 0; which programs each rank began running, at which update;
- ``failure``: an agent program that fails on rank 1 only; where each rank reverted, and the versions after;
- ``divergence``: rank 1 nudges one weight; the fingerprint check must stop both ranks;
- ``plain_wrap``: a plain ``wrap()`` in the process group, which must refuse rather than start an agent per rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from opalctl.opal import wrap
from opalctl.opal.distributed import RanksDiverged, wrap_distributed

UPDATES = 24
DEVICE = torch.device("cpu")  # cuda:LOCAL_RANK under nccl (main)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(DEVICE)


def batch(update: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + update)  # each rank its own shard
    inputs = torch.randn(16, 8, generator=generator).to(DEVICE)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def train(*, updates: int = UPDATES, wrap_options: dict | None = None, each=None):
    """Train a fresh DDP model; returns the module and the wrapper (None for the plain run)."""
    ddp = DistributedDataParallel(model(), device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    stepper = optimizer if wrap_options is None else wrap_distributed(
        optimizer, ddp.module, total_steps=updates, **wrap_options)
    for update in range(updates):
        inputs, targets = batch(update)
        loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
        stepper.zero_grad()
        loss.backward()
        if wrap_options is None:
            stepper.step()
        else:
            stepper.step(loss=loss.detach())
        if each is not None:
            each(update, ddp.module, stepper)
    if wrap_options is not None:
        stepper.close()
    return ddp.module, (stepper if wrap_options is not None else None)


def same_on_every_rank(module: torch.nn.Module) -> bool:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {k: v.detach().cpu() for k, v in module.state_dict().items()})
    return all(all(torch.equal(g[k], gathered[0][k]) for k in g) for g in gathered)


def keep() -> tuple[dict, torch.nn.Module]:
    plain, _ = train()
    wrapped, _ = train(wrap_options={"backend": "keep", "check_every": 5})
    return {"bit_for_bit": all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                                  wrapped.state_dict().values())),
            "same_on_every_rank": same_on_every_rank(wrapped)}, wrapped


def heuristic(out: Path, kept: torch.nn.Module) -> dict:
    module, wrapper = train(wrap_options={"backend": "heuristic", "decisions": 3, "schedule": [0.25, 0.5, 0.75],
                                                "trial_steps": 3, "check_every": 4, "run_dir": out / "heuristic"})
    return {"installed": wrapper.installed, "version": wrapper.agent.current.number,
            "same_on_every_rank": same_on_every_rank(module),
            "differs_from_keep": not all(torch.equal(a, b) for a, b in zip(module.state_dict().values(),
                                                                           kept.state_dict().values()))}


def halve_the_learning_rate(workspace: Path, message: str) -> str:
    """The 'agent' of the failure scenario (rank 0 only): a deterministic edit of the starting updater."""
    updater = workspace / "updater.py"
    updater.write_text(updater.read_text(encoding="utf-8").replace("LR_SCALE = 1.0", "LR_SCALE = 0.5"),
                       encoding="utf-8")
    return "Changed: LR_SCALE 1.0 -> 0.5."


def failure(out: Path) -> dict:
    seen: dict = {}

    def fail_on_rank_1(update, module, wrapper):
        """Rank 1's copy of the agent's program raises at its second step (a fault of that rank alone)."""
        version = wrapper.agent.current
        if dist.get_rank() == 1 and version.number == 1 and "patched" not in seen:
            seen["patched"] = update

            def broken(grads, t, ctx):
                raise RuntimeError("out of memory on this rank's device (simulated)")

            version.updater.step = broken

    module, wrapper = train(each=fail_on_rank_1,
                            wrap_options={"backend": halve_the_learning_rate, "decisions": 1, "schedule": [0.25],
                                          "trial_steps": 5, "check_every": 4, "run_dir": out / "failure"})
    statuses = [v.status for v in wrapper.agent.slots.versions]
    return {"reverts": wrapper.reverts, "installed": wrapper.installed, "version": wrapper.agent.current.number,
            "statuses": statuses, "same_on_every_rank": same_on_every_rank(module)}


def divergence() -> dict:
    def nudge_on_rank_1(update, module, wrapper):
        if dist.get_rank() == 1 and update == 5:
            with torch.no_grad():
                module[2].weight[0, 3] += 1e-4

    try:
        train(each=nudge_on_rank_1, wrap_options={"backend": "keep", "check_every": 4})
    except RanksDiverged as error:
        return {"stopped": str(error), "exit_code": error.exit_code}
    return {"stopped": None}


def plain_wrap(out: Path) -> dict:
    ddp = DistributedDataParallel(model(), device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    try:
        agent = wrap(optimizer, ddp.module, total_steps=UPDATES, run_dir=out / "plain")
    except ValueError as error:
        return {"refused": str(error), "folder_made": (out / "plain").exists()}
    agent.close()
    return {"refused": None, "folder_made": (out / "plain").exists()}


def launch(out: Path, backend: str = "gloo", timeout: float = 240) -> list[dict]:
    """Run this file under ``python -m torch.distributed.run --standalone --nproc_per_node 2`` (what the
    ``torchrun`` script runs) and return what each rank reported; a failed launch fails with the ranks' output
    from their first error on."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, str(out), backend], env=env, capture_output=True, text=True, timeout=timeout)
    log = done.stdout + done.stderr
    first = min([log.find(mark) for mark in ("Traceback", "terminate called", "Error") if mark in log] or [0])
    assert done.returncode == 0, log[max(0, first - 500):first + 8000]
    return [json.loads((out / f"rank-{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]


def main() -> None:
    global DEVICE
    out = Path(sys.argv[1])
    backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
    if backend == "nccl":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    kept, kept_model = keep()
    seen = {"keep": kept, "heuristic": heuristic(out, kept_model), "failure": failure(out),
            "divergence": divergence(), "plain_wrap": plain_wrap(out)}
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(seen, indent=1), encoding="utf-8")
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
