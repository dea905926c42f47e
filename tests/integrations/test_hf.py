"""``OpalTrainer`` with real transformers (5.x) on a tiny GPT-2 built from its config (no download).

One module-scoped import and one data set; each Trainer run is 100 updates of two micro-batches of 4 sequences of
16 tokens on one thread, about a second. The plain Trainer's run is shared by the tests that compare with it.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'opalctl[hf]')")
torch = pytest.importorskip("torch")

UPDATES = 100


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: int = 64, length: int = 16):
        self.ids = torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def train(trainer_class, out: Path, *, resume: Path | None = None, save_at: int | None = None,
          updates: int = UPDATES, **kwargs):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=updates, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, warmup_steps=10, lr_scheduler_type="linear", use_cpu=True, report_to=[], seed=0,
        save_strategy="steps" if save_at else "no", save_steps=save_at or 500, logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    model = tiny_gpt2()
    trainer = trainer_class(model=model, args=args, train_dataset=Rows(), **kwargs)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer, model


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: two runs of the same arithmetic give the same bits, and it is faster
    from opalctl.integrations import hf

    root = tmp_path_factory.mktemp("hf")
    plain_trainer, plain = train(transformers.Trainer, root / "plain")
    yield hf, root, plain_trainer, plain
    torch.set_num_threads(threads)


def test_keep_inside_the_trainer_equals_the_plain_trainer_bit_for_bit_over_100_updates(hf):
    module, root, plain_trainer, plain = hf
    run_dir = root / "keep-run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, wrapped = train(module.OpalTrainer, root / "keep", opal={"backend": "keep", "run_dir": run_dir})
    assert same_weights(plain, wrapped)
    # the Trainer's scheduler stayed the Trainer's: stepped once per update, the same learning rate at the end
    assert trainer.lr_scheduler.get_last_lr() == plain_trainer.lr_scheduler.get_last_lr()
    assert trainer.lr_scheduler.last_epoch == UPDATES
    assert not [w for w in caught if "without a loss" in str(w.message)]
    kinds = [e["kind"] for e in events(run_dir)]
    assert kinds[0] == "start" and kinds[-1] == "end"  # closed when training ended
    assert "resumed" not in kinds  # accelerate's state-dict round trip happened before the wrap
    bins = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert sum(b["count"] for b in bins) == UPDATES  # one loss per update: its two micro-batches summed
    assert trainer.agent.observer.unobserved.count == 0
    # the update's loss is the mean of its micro-batches' losses, as the Trainer reports it
    assert abs(sum(b["mean"] * b["count"] for b in bins) / UPDATES - trainer.state.log_history[-1]["train_loss"]) < 1e-4


BLIND = range(40, 70)  # the updates whose micro-batches' losses never reach the agent (the checkpoint is at 50)


def partly_blind(module):
    """``OpalTrainer`` that does not feed the agent during ``BLIND`` (as a plain Trainer would not): those updates
    step without a loss, on both sides of the checkpoint."""

    class PartlyBlind(module.OpalTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.state.global_step in BLIND:
                return transformers.Trainer.training_step(self, model, inputs, num_items_in_batch)
            return super().training_step(model, inputs, num_items_in_batch)

    return PartlyBlind


def decisions_seen(run_dir: Path) -> list[str]:
    """Each decision's message and answer, without the line of measured durations."""
    return ["\n".join(line for line in (folder / "message.md").read_text().splitlines()
                      if not line.startswith("updater step")) + (folder / "response.md").read_text()
            for folder in sorted((run_dir / "agent" / "decisions").glob("[0-9][0-9][0-9]"))]


def test_a_resumed_trainer_run_equals_an_uninterrupted_one_with_no_spurious_event_and_the_same_no_loss_facts(hf):
    module, root, _, _ = hf
    run_dir = root / "resume-run"
    settings = {"backend": "heuristic", "run_dir": run_dir, "decisions": 4, "schedule": "uniform"}
    trainer_class = partly_blind(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole, whole_model = train(trainer_class, root / "resume", save_at=50, opal=settings)
        uninterrupted, seen = events(run_dir), decisions_seen(run_dir)
        shutil.rmtree(root / "resume" / f"checkpoint-{UPDATES}", ignore_errors=True)
        # a second process would start here: a new Trainer resumes from update 50 in the same run folder
        resumed, resumed_model = train(trainer_class, root / "resume", resume=root / "resume" / "checkpoint-50",
                                       opal=settings)
    assert same_weights(whole_model, resumed_model)
    after = events(run_dir)
    assert [e["update"] for e in after if e["kind"] == "resumed"] == [50]
    assert [(e["kind"], e["update"], e.get("version")) for e in after if e["kind"] != "resumed"] == \
        [(e["kind"], e["update"], e.get("version")) for e in uninterrupted]  # nothing spurious, nothing lost
    assert resumed.agent.current.number == whole.agent.current.number
    # the updates that stepped without a loss are counted across the checkpoint, and warned about once in all
    assert resumed.agent.observer.unobserved.count == whole.agent.observer.unobserved.count == len(BLIND)
    assert len([w for w in caught if "without a loss" in str(w.message)]) == 1
    assert decisions_seen(run_dir) == seen
    assert "No loss was observed" in seen[2] and "No loss was observed" not in seen[3]  # at 60: 40-59 blind


def test_heuristic_decisions_apply_inside_the_trainer(hf):
    module, root, _, plain = hf
    run_dir = root / "heuristic-run"
    trainer, model = train(module.OpalTrainer, root / "heuristic",
                           opal={"backend": "heuristic", "run_dir": run_dir, "decisions": 4, "schedule": "uniform"})
    applied = [e for e in events(run_dir) if e["kind"] == "applied"]
    assert applied, "the heuristic changed nothing over 100 updates"
    assert trainer.agent.current.number >= 1
    assert not same_weights(plain, model)  # the applied program trained the model
    last = sorted((run_dir / "agent" / "decisions").glob("[0-9][0-9][0-9]"))[-1]
    message = (last / "message.md").read_text()
    assert "| 51-75 | 3." in message and "No loss was observed" not in message  # it reasoned on the fed losses


def test_opal_settings_that_belong_to_the_trainer_are_refused_in_one_sentence(hf):
    module = hf[0]
    from opalctl.errors import BadInput

    with pytest.raises(BadInput, match="must not set scheduler") as raised:
        module.OpalTrainer(model=tiny_gpt2(), args=transformers.TrainingArguments(output_dir="unused", use_cpu=True,
                                                                                  report_to=[]),
                           opal={"scheduler": object()})
    assert str(raised.value).count(". ") == 0


def test_a_second_train_on_the_same_opal_trainer_is_refused_in_one_sentence(hf):
    module, root, _, _ = hf
    trainer, _ = train(module.OpalTrainer, root / "twice", updates=5,
                       opal={"backend": "keep", "run_dir": root / "twice-run"})
    from opalctl.errors import BadInput

    with pytest.raises(BadInput, match="has already trained"):
        trainer.train()
