"""The facts of a decision say how many losses were observed since the last one (needs decisions.py's
``losses_observed``, seam 6): 0 when ``step()`` never had one, and the message says it in words."""

from __future__ import annotations

import json
import warnings

import torch

from opalctl.opal import wrap
from opalctl.opal.messages import NO_LOSS


def decisions_of_a_run_with_losses(run_dir, with_loss) -> list:
    """A 60-update keep run with decisions at updates 20 and 40, whose update ``n`` passes its loss when
    ``with_loss(n)``; the two decision folders, in order."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    agent = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, backend="keep", total_steps=60, decisions=2,
                 schedule="uniform", run_dir=run_dir)
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for update in range(60):
            loss = model(inputs).pow(2).mean()
            agent.zero_grad()
            loss.backward()
            agent.step(loss=loss) if with_loss(update) else agent.step()
    agent.close()
    return sorted((run_dir / "decisions").iterdir())


def test_a_decision_after_updates_without_a_loss_says_no_loss_was_observed(tmp_path):
    run_dir = tmp_path / "run"
    first, second = decisions_of_a_run_with_losses(run_dir, lambda update: update >= 30)
    assert NO_LOSS in (first / "message.md").read_text()
    assert NO_LOSS not in (second / "message.md").read_text()
    assert "10 loss(es) observed since the last decision." in (second / "message.md").read_text()
    facts = json.loads((run_dir / "workspace" / ".opal" / "facts.json").read_text())  # the last decision's
    assert facts["losses_observed"] == 10  # updates 30-39, not analysed yet


def test_losses_observed_counts_the_updates_since_the_last_decision_even_inside_an_analysed_bin(tmp_path):
    # the analysis bins are 1-25 and 26-50, so the first bin began before decision 1 (update 20): the losses of
    # updates 10-19 belong to decision 1, and decision 2 saw none
    first, second = decisions_of_a_run_with_losses(tmp_path / "run", lambda update: 10 <= update < 20)
    assert "10 loss(es) observed since the last decision." in (first / "message.md").read_text()
    assert NO_LOSS in (second / "message.md").read_text()
