"""A tiny GRPO run that SIGKILLs its own process at one point of the save of one checkpoint (the kill tests of
``test_trl_checkpoints.py``).

Kill points (``POINT``):

- ``"<file>:half"``: the file is written, cut to half its size (what a kill while writing it leaves), then SIGKILL;
- ``"<file>:after"``: SIGKILL right after the file is written;
- ``"published"``: SIGKILL right after a folder is renamed to ``checkpoint-<step>`` (the trainer's atomic
  publication; a run that never renames one is not killed and ends normally).

The hooks wrap the writers trl and transformers call during a save (``torch.save``, the safetensors writer of
``save_pretrained``, ``TrainerState.save_to_json``) and ``os.rename``/``os.replace``, and fire only for a file of a
folder named ``checkpoint-<step>``, wherever that folder is. The kill is a real ``SIGKILL`` of the process: no
``finally``, no atexit handler, no flush runs.

As a script (a fresh interpreter; also under ``torchrun``, one run per process)::

    python tests/helpers/kill_during_save.py MODEL_DIR OUTPUT_DIR STEP POINT [--stock]
    python tests/helpers/kill_during_save.py MODEL_DIR OUTPUT_DIR --resume CHECKPOINT|latest
    python tests/helpers/kill_during_save.py MODEL_DIR --batch STEP JSON

``--stock`` trains plain ``trl.GRPOTrainer`` instead of ``HardenedSafeVocabGRPOTrainer``; ``--resume`` trains
``HardenedSafeVocabGRPOTrainer`` from ``CHECKPOINT`` (``latest``: ``resume_from_checkpoint=True``), killing nothing.
``--batch`` runs several killed runs (``JSON``: a list of ``[OUTPUT_DIR, POINT, STOCK]``) from one interpreter: it
imports the training stack once, then forks a child for each run, one at a time, and prints each child's exit
status (``-9``: killed) as a JSON list. The fork comes before any torch op has run, with ``OMP_NUM_THREADS=1``: a
child forked after torch's OpenMP pool ran with several threads hangs in it (why the tests never fork themselves).
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # trl_helpers, when run as a script

from trl_helpers import grpo_kwargs, prompt_dataset, vowel_reward  # noqa: E402

#: The run every kill test trains (and the uninterrupted reference): a checkpoint after every step, at most one kept.
RUN = dict(max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1)


def make_trainer(model_dir, output_dir, *, stock: bool = False, eval_dataset=None, **overrides):
    """The kill tests' trainer: :data:`RUN` in ``output_dir`` (``stock``: plain trl's ``GRPOTrainer``)."""
    kwargs = grpo_kwargs(output_dir, **{**RUN, **overrides})
    data = dict(train_dataset=prompt_dataset(16), eval_dataset=eval_dataset)
    if stock:
        from trl import GRPOConfig, GRPOTrainer

        return GRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=GRPOConfig(**kwargs), **data)
    from trl_integration import HardenedSafeVocabGRPOTrainer, SafeVocabGRPOConfig

    return HardenedSafeVocabGRPOTrainer(
        model=model_dir, reward_funcs=vowel_reward, args=SafeVocabGRPOConfig(**kwargs), **data
    )


def install_kill(step: int, point: str) -> None:
    """SIGKILL this process at ``point`` of the save of ``checkpoint-<step>`` (see the module docstring)."""
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers.trainer_callback import TrainerState

    folder = f"checkpoint-{step}"
    target, _, how = point.partition(":")

    def written(path) -> None:
        path = os.fspath(path)
        if os.path.basename(os.path.dirname(path)) != folder or os.path.basename(path) != target:
            return
        if how == "half":
            os.truncate(path, os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    def after(write, position: int, keyword: str):
        def wrapped(*args, **kwargs):
            result = write(*args, **kwargs)
            path = args[position] if len(args) > position else kwargs.get(keyword)
            if isinstance(path, (str, os.PathLike)):
                written(path)
            return result

        return wrapped

    torch.save = after(torch.save, 1, "f")
    modeling_utils.safe_save_file = after(modeling_utils.safe_save_file, 1, "filename")
    TrainerState.save_to_json = after(TrainerState.save_to_json, 1, "json_path")
    if point == "published":
        for name in ("rename", "replace"):
            move = getattr(os, name)

            def moved(src, dst, *args, _move=move, **kwargs):
                _move(src, dst, *args, **kwargs)
                if os.path.basename(os.fspath(dst)) == folder:
                    os.kill(os.getpid(), signal.SIGKILL)

            setattr(os, name, moved)


def train_until_killed(model_dir: str, output_dir: str, step: int, point: str, stock: bool = False) -> None:
    """Train :data:`RUN`, killed at ``point`` of the save of step ``step`` (returns only if the point never came)."""
    trainer = make_trainer(model_dir, output_dir, stock=stock)
    install_kill(step, point)
    trainer.train()


def killed_in_children(model_dir: str, step: int, runs: list[tuple[str, str, bool]]) -> list[int]:
    """Each run of ``runs`` (``(output_dir, point, stock)``) in a forked child of this interpreter, one at a time; their
    exit statuses (``-SIGKILL`` where the point came)."""
    # the stack each child would import: once, here, before the forks
    import transformers.modeling_utils  # noqa: F401
    from trl import GRPOTrainer  # noqa: F401

    from trl_integration import HardenedSafeVocabGRPOTrainer  # noqa: F401

    statuses = []
    for output_dir, point, stock in runs:
        pid = os.fork()
        if pid == 0:  # the child: killed at the point, or ends without any clean-up of the parent's
            train_until_killed(model_dir, output_dir, step, point, stock=stock)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        statuses.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    return statuses


if __name__ == "__main__":
    model_dir, output_dir, *rest = sys.argv[1:]
    if output_dir == "--batch":
        import json

        print(json.dumps(killed_in_children(model_dir, int(rest[0]), json.loads(rest[1]))))
    elif rest[0] == "--resume":
        make_trainer(model_dir, output_dir).train(resume_from_checkpoint=True if rest[1] == "latest" else rest[1])
    else:
        train_until_killed(model_dir, output_dir, int(rest[0]), rest[1], stock="--stock" in rest[2:])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # As safevocab-grpo under a launcher: end without tearing the gloo process group down (it can deadlock at exit).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
