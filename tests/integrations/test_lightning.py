"""The agent optimizer under real Lightning (2.x) on CPU: ``configure_optimizers`` returns it, automatic
optimisation's ``step(closure)`` runs the closure once, and ``keep`` is bit for bit the plain optimizer."""

from __future__ import annotations

import json

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

    def training_step(self, batch, index):
        self.training_steps += 1
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * UPDATES))
        if self.agent is None:
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        from opalctl.integrations.lightning import wrap_for

        return wrap_for(self, optimizer, scheduler=scheduler, **self.agent)


def fit(agent: dict | None) -> Regression:
    from opalctl.integrations.lightning import CloseAgent

    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=8)
    module = Regression(agent)
    trainer = pl.Trainer(max_steps=UPDATES, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[CloseAgent()])
    trainer.fit(module, loader)
    return module


@pytest.fixture(scope="module")
def plain():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield fit(None)
    torch.set_num_threads(threads)


def test_keep_returned_by_configure_optimizers_equals_the_plain_optimizer_bit_for_bit(plain, tmp_path):
    wrapped = fit({"backend": "keep", "run_dir": tmp_path / "run"})
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), wrapped.state_dict().values()))
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert kinds[-1] == "end"  # CloseAgent closed it


def test_automatic_optimisation_runs_the_closure_exactly_once_per_update(plain, tmp_path):
    wrapped = fit({"backend": "keep", "run_dir": tmp_path / "run"})
    assert wrapped.training_steps == plain.training_steps == UPDATES
    agent = wrapped.trainer.optimizers[0]
    assert agent.t == UPDATES
    assert agent.observer.unobserved.count == 0 and agent.observer.observed_since(0) == UPDATES  # the closure's loss
