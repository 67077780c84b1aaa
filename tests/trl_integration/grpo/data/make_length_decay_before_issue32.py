"""Writes ``length_decay_before_issue32.pt``: a ``scheduler.pt`` written by the trainer before length decay composed
with trl's schedules, and the learning rates of the run that wrote it.

Before issue 32's trainer side (commit 5c9e98c), ``length_decay=True`` replaced trl's schedule by ``LengthDecayLR``
without a base schedule (the constant one). The run here is that code's own: the commit's files (``git archive``; the
repository and its worktrees are left alone), the tiny test model of ``tests/helpers/trl_helpers.py``,
``length_decay_start="step0"`` with period 1 and floor 0.1 (the LR halves every step, so the schedule's position shows
in every LR), 4 steps, checkpoints every 2. ``tests/trl_integration/grpo/test_length_decay.py`` resumes today's trainer from this
state and checks that it continues the run as that code did. Rerun (from the repository root; it needs git and takes
about a minute; the record it writes is equal, as torch.load reads it, to the one committed):

    python tests/trl_integration/grpo/data/make_length_decay_before_issue32.py
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

COMMIT = "5c9e98c"
HERE = Path(__file__).resolve().parent
SETTINGS = dict(
    length_decay=True, length_decay_start="step0", length_decay_period="1", length_decay_min_lr_ratio=0.1,
    max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=2, num_generations=2,
    max_completion_length=2,
)  # fmt: skip

RUN = """
import json, sys
sys.path.insert(0, "tests/trl")  # in the archived tree of COMMIT, where trl_helpers lived
from trl_helpers import build_model, build_tokenizer, grpo_kwargs, prompt_dataset, vowel_reward
from trl_integration import SafeVocabGRPOConfig, SafeVocabGRPOTrainer
out, settings = sys.argv[1], json.loads(sys.argv[2])
tokenizer = build_tokenizer()
build_model(tokenizer).save_pretrained(out + "/model")
tokenizer.save_pretrained(out + "/model")
args = SafeVocabGRPOConfig(**grpo_kwargs(out + "/run", **settings))
trainer = SafeVocabGRPOTrainer(model=out + "/model", reward_funcs=vowel_reward, args=args,
                               train_dataset=prompt_dataset(16))
trainer.train()
json.dump([h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
          open(out + "/learning_rate.json", "w"))
"""


def main():
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True, cwd=HERE
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree, out = os.path.join(tmp, "tree"), os.path.join(tmp, "out")
        os.mkdir(tree)
        archive = subprocess.run(["git", "archive", COMMIT], capture_output=True, check=True, cwd=root).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", RUN, out, json.dumps(SETTINGS)], check=True, cwd=tree, env=env)
        scheduler = torch.load(os.path.join(out, "run", "checkpoint-2", "scheduler.pt"), weights_only=True)
        learning_rate = json.load(open(os.path.join(out, "learning_rate.json")))
    record = {"commit": COMMIT, "settings": SETTINGS, "scheduler_at_step_2": scheduler, "learning_rate": learning_rate}
    torch.save(record, HERE / "length_decay_before_issue32.pt")
    print(record)


if __name__ == "__main__":
    main()
