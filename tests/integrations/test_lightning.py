"""The agent optimizer under real Lightning (2.x) on CPU: ``configure_optimizers`` returns it, automatic
optimisation's ``step(closure)`` runs the closure once, ``keep`` is bit for bit the plain optimizer, and with
gradient accumulation the agent sees each update's loss (its micro-batches', as Lightning scales them, summed)."""

from __future__ import annotations

import json
import math

import pytest

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'opalctl[lightning]')")
torch = pytest.importorskip("torch")

UPDATES = 30


class Regression(pl.LightningModule):
    """An MLP 8-16-1 on fixed data; ``agent`` (None: the plain optimizer) is wrap_for's settings."""

    def __init__(self, agent: dict | None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.agent = agent
        self.training_steps = 0
        self.losses: list[torch.Tensor] = []  # each micro-batch's loss, as training_step returned it

    def training_step(self, batch, index):
        self.training_steps += 1
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * UPDATES))
        if self.agent is None:
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        from opalctl.integrations.lightning import wrap_for

        return wrap_for(self, optimizer, scheduler=scheduler, **self.agent)


def fit(agent: dict | None, accumulate: int = 1, callbacks: list | None = None) -> Regression:
    from opalctl.integrations.lightning import AgentCallback

    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=8)
    module = Regression(agent)
    trainer = pl.Trainer(max_steps=UPDATES, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                         callbacks=[AgentCallback()] if callbacks is None else callbacks)
    trainer.fit(module, loader)
    return module


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain(one_thread):
    return fit(None)


@pytest.fixture(scope="module")
def plain_accumulating(one_thread):
    return fit(None, accumulate=2)


def test_keep_returned_by_configure_optimizers_equals_the_plain_optimizer_bit_for_bit(plain, tmp_path):
    wrapped = fit({"backend": "keep", "run_dir": tmp_path / "run"})
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), wrapped.state_dict().values()))
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert kinds[-1] == "end"  # AgentCallback closed it


def test_automatic_optimisation_runs_the_closure_exactly_once_per_update(plain, tmp_path):
    wrapped = fit({"backend": "keep", "run_dir": tmp_path / "run"})
    assert wrapped.training_steps == plain.training_steps == UPDATES
    agent = wrapped.trainer.optimizers[0]
    assert agent.t == UPDATES
    assert agent.observer.unobserved.count == 0 and agent.observer.observed_since(0, agent.t, 0) == UPDATES  # the closure's loss


def test_with_two_accumulated_micro_batches_the_agent_observes_each_updates_summed_loss(tmp_path,
                                                                                       plain_accumulating):
    run_dir = tmp_path / "run"
    wrapped = fit({"backend": "keep", "run_dir": run_dir}, accumulate=2)
    assert all(torch.equal(a, b) for a, b in
               zip(plain_accumulating.state_dict().values(), wrapped.state_dict().values()))  # keep: bit for bit
    agent, micro = wrapped.trainer.optimizers[0], wrapped.losses
    assert len(micro) == 2 * UPDATES and agent.t == UPDATES
    # Lightning divides each micro-batch's loss by accumulate_grad_batches before backward; the update's is their sum
    expected = [float(micro[2 * u] / 2 + micro[2 * u + 1] / 2) for u in range(UPDATES)]
    analysed = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert [(b["end"], b["count"]) for b in analysed] == [(25, 25)]  # the analysis's bin of updates 1-25
    assert analysed[0]["mean"] == math.fsum(expected[:25]) / 25
    assert [float(loss) for loss in agent.observer.pending_losses] == expected[25:]  # not analysed yet
    assert wrapped.trainer.optimizers[0].observer.unobserved.count == 0


def test_an_accumulating_trainer_without_the_agent_callback_is_refused_in_one_sentence(tmp_path, one_thread):
    from opalctl.errors import BadInput

    with pytest.raises(BadInput, match="accumulates 2 micro-batches per update") as raised:
        fit({"backend": "keep", "run_dir": tmp_path / "run"}, accumulate=2, callbacks=[])
    assert str(raised.value).count(". ") == 0 and "AgentCallback()" in str(raised.value)
