"""What only a CUDA device can show: the ``gpu`` clock's CUDA events, the integrity ring on the device with no host
synchronisation, the audit's host-sync count, the agent optimizer bit for bit on the device, and NCCL DDP with two
ranks (where two GPUs exist). Every test is marked ``cuda`` and skips without a device (conftest.py)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from opalctl.driver.budget import GpuClock, make_clock
from opalctl.opal import wrap
from opalctl.opal.audit import count_step
from opalctl.opal.integrity import IntegrityRecorder

pytestmark = pytest.mark.cuda
WORKER = Path(__file__).resolve().parents[1] / "distributed" / "ddp_worker.py"


def no_host_sync():
    """A context in which any synchronising CUDA call raises (torch's sync debug mode "error")."""

    class Guard:
        def __enter__(self):
            torch.cuda.synchronize()
            self.before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc_info):
            torch.cuda.set_sync_debug_mode(self.before)

    return Guard()


def test_the_gpu_clock_charges_the_device_time_of_the_queued_work_from_cuda_events():
    clock = make_clock("gpu", "cuda")
    assert isinstance(clock, GpuClock)
    matrix = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()

    def work(repeats: int) -> float:
        token = clock.start()
        for _ in range(repeats):
            matrix @ matrix
        return clock.stop(token)  # waits for the end event: the work has finished

    work(2)  # warm-up (cuBLAS handles)
    started = time.perf_counter()
    short = work(5)
    wall = time.perf_counter() - started
    long = work(20)
    assert 0 < short <= wall * 1.05
    assert 2.5 < long / short < 6.0  # four times the work, about four times the charge


def test_the_integrity_ring_records_on_the_device_without_a_host_synchronisation():
    torch.manual_seed(0)
    params = {"weight": torch.randn(512, 256, device="cuda"), "bias": torch.randn(256, device="cuda"),
              "half": torch.randn(64, 64, device="cuda", dtype=torch.bfloat16),
              "transposed": torch.randn(128, 96, device="cuda").t()}
    gathered = IntegrityRecorder(params, window_before=8, window_after=2)
    each = IntegrityRecorder(params, window_before=8, window_after=2, alias=False)  # the plain twin
    assert all(group.ring.device.type == "cuda" for group in gathered.groups)
    assert any(group.alias is not None for group in gathered.groups), "no CUDA alias: the one-gather path is untested"
    with no_host_sync():
        for update in range(1, 6):
            for tensor in params.values():
                tensor.add_(0.01)
            gathered.record(update)
            each.record(update)
    for update in range(1, 6):
        ours, twin = gathered.values_at(update), each.values_at(update)
        assert set(ours) == set(params) and all((ours[name] == twin[name]).all() for name in ours)


def test_the_audit_counts_host_synchronisations_on_cuda():
    x = torch.randn(1024, device="cuda")
    assert count_step(lambda: x.mul_(1.0001))["syncs"] == 0
    assert count_step(lambda: x.sum().item())["syncs"] >= 1
    assert count_step(lambda: (x.add_(1), torch.cuda.synchronize()))["syncs"] >= 1
    assert count_step(lambda: [x.sum().item() for _ in range(3)])["syncs"] >= 3


def test_keep_on_cuda_is_bit_for_bit_the_plain_optimizer_and_its_plain_path_never_syncs():
    def run(wrapped: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stepper = wrap(optimizer, model, backend="keep", total_steps=40) if wrapped else optimizer
        generator = torch.Generator(device="cuda").manual_seed(1)
        for update in range(40):
            inputs = torch.randn(16, 32, device="cuda", generator=generator)
            loss = model(inputs).pow(2).mean()
            stepper.zero_grad()
            loss.backward()
            if wrapped and update >= 30:  # past the audit and the first analysis: the plain path
                with no_host_sync():
                    stepper.step(loss=loss.detach())
            else:
                stepper.step(loss=loss.detach()) if wrapped else stepper.step()
        if wrapped:
            stepper.close()
        return [p.detach().cpu() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_nccl_ddp_with_two_ranks_keeps_bit_for_bit_and_relays_programs(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL DDP needs two CUDA devices; {torch.cuda.device_count()} is visible")
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    for rank in worker.launch(tmp_path, "nccl"):
        assert rank["keep"] == {"bit_for_bit": True, "same_on_every_rank": True}
        assert rank["heuristic"]["same_on_every_rank"] and rank["heuristic"]["installed"]
        assert rank["failure"]["version"] == 0 and rank["failure"]["same_on_every_rank"]
        assert rank["divergence"]["stopped"] is not None


CONFINED_CUDA = r'''
import json, sys, threading
from pathlib import Path

import torch

from opalctl.opal.audit import count_step
from opalctl.sandbox import confine_process, device_access, training_paths

steps = {}
x = torch.randn(256, 256, device="cuda")
torch.cuda.synchronize()  # the context made before confinement, as a run makes it when it builds the model
confinement = confine_process(writable=[Path(sys.argv[1])], readable=training_paths(), devices=device_access("cuda"))
steps["confined"] = confinement.mechanism
print(json.dumps(steps), flush=True)
y = x @ x  # cuBLAS's first use, after confinement
torch.cuda.synchronize()
steps["matmul"] = "ok"
print(json.dumps(steps), flush=True)
z = torch.empty(64 << 20, device="cuda")  # a new allocation from the driver
steps["allocation"] = "ok"
print(json.dumps(steps), flush=True)
thread = threading.Thread(target=lambda: torch.cuda.synchronize(), daemon=True)
thread.start()
thread.join(30)
steps["thread"] = "ok" if not thread.is_alive() else "hung"
print(json.dumps(steps), flush=True)
steps["audit"] = count_step(lambda: x.mul_(1.0001))  # the profiler on CUDA (CUPTI), as the agent's audit runs it
print(json.dumps({**steps, "done": True}, default=str), flush=True)
'''


def test_a_confined_process_goes_on_with_cuda_work_after_confinement(tmp_path):
    """What an agent arm's training process does on CUDA once confined (sandbox.device_access), step by step in a
    child, so that a step the confinement stops is named (on an H200, before device_access, a confined keep arm
    made no update at all)."""
    import json
    import subprocess
    import sys

    try:
        child = subprocess.run([sys.executable, "-c", CONFINED_CUDA, str(tmp_path)], capture_output=True, text=True,
                               timeout=120)
    except subprocess.TimeoutExpired as stopped:
        pytest.fail(f"the confined CUDA child hung; it got as far as: {stopped.stdout!r} {stopped.stderr[-1500:]!r}")
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    assert child.returncode == 0 and lines and lines[-1].get("done"), (lines, child.stderr[-2000:])
    assert lines[-1]["confined"] == "landlock" and lines[-1]["thread"] == "ok"
