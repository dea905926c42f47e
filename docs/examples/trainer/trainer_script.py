"""The researcher's script: a tiny GPT-2 trained by ``transformers.Trainer``.

    python trainer_script.py            # the plain Trainer (AdamW, linear schedule)
    python trainer_script.py --agent    # the same, with the agent optimizer (heuristic backend), records in opal/

The only change for the agent is the class (``OpalTrainer``) and its ``opal`` settings: the Trainer still builds
the optimizer, clips, steps and owns its scheduler, saves and resumes checkpoints.
"""

from __future__ import annotations

import sys

import torch
import transformers
from tiny_gpt2 import corpus, make_model


class Rows(torch.utils.data.Dataset):
    def __init__(self, tokens):
        self.tokens = torch.from_numpy(tokens)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main(agent: bool) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    args = transformers.TrainingArguments(output_dir="out", max_steps=200, per_device_train_batch_size=8,
                                          learning_rate=3e-3, lr_scheduler_type="linear", use_cpu=True,
                                          report_to=[], save_strategy="no", logging_steps=50, seed=1,
                                          disable_tqdm=True)
    settings = dict(model=make_model(), args=args, train_dataset=Rows(corpus(512, seed=0)))
    if agent:
        from opalctl.integrations.hf import OpalTrainer

        trainer = OpalTrainer(**settings, opal={"backend": "heuristic", "decisions": 4, "run_dir": "opal"})
    else:
        trainer = transformers.Trainer(**settings)
    trainer.train()
    if agent:
        print(f"agent: version {trainer.agent.current.number} running; records in opal/events.jsonl")


if __name__ == "__main__":
    main(agent="--agent" in sys.argv[1:])
