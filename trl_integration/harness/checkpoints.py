"""Checkpoints that a kill cannot leave half-written (the run harness's :class:`AtomicCheckpoints`).

**Writing** (:func:`save_staged`). transformers writes ``checkpoint-N`` file by file straight into the run directory
(model, optimizer, scheduler, scaler, RNG, then ``trainer_state.json``), so a kill during a save leaves a
``checkpoint-N`` that ``resume_from_checkpoint=True`` picks and fails on. Here trl's and transformers' own save writes
``checkpoint-N`` inside the staging folder ``_incomplete-checkpoint-N`` of the run directory instead; once every
process has written its files, the saving process flushes them to disk (``fsync``) and moves the folder to
``checkpoint-N`` with one ``rename`` (atomic on POSIX file systems); only then are old checkpoints rotated out
(``save_total_limit``, transformers' own ``rotate_checkpoints``), so the newest complete checkpoint is never deleted
before the new one is complete. At any moment the run directory holds the complete new ``checkpoint-N`` or none of
it. Staging names start with ``_``: transformers' checkpoint globs (``checkpoint-*``) never see them and its Hub upload
skips them. A killed save's staging folder is ignored by resuming (named in its warning) and deleted by the next save.

**Disk full** (:func:`no_space_error`). A full disk surfaces from a save as ``OSError: [Errno 28] No space left on
device`` from Python's writers, or as torch's zip writer's ``RuntimeError: [enforce fail at inline_container.cc:...]
... file write failed`` (or ``unexpected pos``), which names neither the cause nor the folder; either becomes one
``OSError`` (errno ENOSPC) naming the checkpoint, the folder and the space left there, and the staging folder is
deleted. Each save also writes ``safevocab_settings.json`` (:mod:`trl_integration.harness.resume_settings`)
and, last, ``safevocab_manifest.json`` (:mod:`trl_integration.harness.manifest`: every file's size and CRC-32).
``args.safe_vocab_atomic_checkpoints=False`` saves in place, as transformers does (the resume checks stay).

What a complete checkpoint is, and what a resume checks before it loads one, is
:mod:`trl_integration.harness.checkpoint_files`; :class:`AtomicCheckpoints` runs those checks in ``train``.
"""

from __future__ import annotations

import errno
import os
import shutil

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from trl_integration._private import CheckpointBridge
from trl_integration.harness.checkpoint_files import REPLACED_PREFIX, STAGING_PREFIX, checked_resume_checkpoint
from trl_integration.harness.manifest import write_manifest
from trl_integration.harness.resume_settings import check_settings, checkpoint_step, write_settings

__all__ = ["AtomicCheckpoints", "save_staged", "save_in_place", "publish", "remove_leftovers", "no_space_error"]


class AtomicCheckpoints(CheckpointBridge):
    """The trainer's side (a mixin before the trainer): checkpoints are
    written by :func:`save_staged`, and ``train`` checks ``resume_from_checkpoint`` first
    (:func:`checked_resume_checkpoint`)."""

    def save_checkpoint(self, model, trial) -> None:
        """trl's checkpoint, written so that a kill leaves the complete ``checkpoint-N`` or none (:func:`save_staged`);
        in place with ``args.safe_vocab_atomic_checkpoints=False`` (:func:`save_in_place`)."""
        if getattr(self.args, "safe_vocab_atomic_checkpoints", True):
            save_staged(self, model, trial)
        else:
            save_in_place(self, model, trial)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``. ``resume_from_checkpoint=True`` resumes from the newest *complete* checkpoint (one warning
        names what was skipped); a checkpoint that is incomplete, lacks its optimizer, scheduler or RNG state, holds
        other weights or unchangeable other settings is refused in one line (see the module docstring)."""
        checkpoint = checked_resume_checkpoint(self, resume_from_checkpoint)
        learning_rate = None if checkpoint is None else check_settings(self, checkpoint, checkpoint_step(checkpoint))
        if learning_rate is not None:
            self.add_callback(learning_rate)
        try:
            return super().train(
                resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        finally:
            if learning_rate is not None:
                self.remove_callback(learning_rate)


def save_staged(trainer, model, trial) -> None:
    """Write ``checkpoint-<global_step>`` with trl's own save into a staging folder, then publish it with one rename
    and rotate old checkpoints (see the module docstring). Collective: every process calls it, as transformers calls
    ``_save_checkpoint``; the processes that save (``args.should_save``) empty, publish and rotate."""
    args, state = trainer.args, trainer.state
    run_dir = trainer.checkpoint_run_dir(trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging, final = os.path.join(run_dir, STAGING_PREFIX + name), os.path.join(run_dir, name)
    if args.should_save:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save of this step left
        os.makedirs(staging)
    trainer.accelerator.wait_for_everyone()  # no process writes into the folder before it is emptied
    try:
        trainer.stock_save_checkpoint(model, trial, parent=staging)
        if args.should_save:
            write_settings(trainer, os.path.join(staging, name))
    except (OSError, RuntimeError) as error:
        full = no_space_error(error, name, staging)  # the space left measured before the clean-up
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays behind
        raise full or error  # noqa: B904 (the caught error itself, or its one-line ENOSPC form)
    trainer.accelerator.wait_for_everyone()  # every process has written its files (rng_state_<r>.pth, shards)
    if args.should_save:
        _settle_best_checkpoint(trainer, run_dir, os.path.join(staging, name))
        write_manifest(os.path.join(staging, name))  # last: every file, as published
        push = getattr(trainer, "push_in_progress", None)
        if args.push_to_hub and args.hub_strategy in ("checkpoint", "all_checkpoints") and push is not None:
            push.wait_until_done()  # it uploads from the staged folder, which is about to move
        publish(os.path.join(staging, name), final)
        remove_leftovers(run_dir)
        rotate_checkpoints(run_dir, args.save_total_limit, state.best_model_checkpoint, use_mtime=True)
    trainer.accelerator.wait_for_everyone()  # no process goes on before checkpoint-N exists
    if not args.should_save and args.local_process_index == 0 and os.path.isdir(staging):
        # A node that does not share the saving process's disk: its processes' files (rng_state_<r>.pth) end up in
        # its own checkpoint-N, as transformers leaves them.
        publish(os.path.join(staging, name), final)


def save_in_place(trainer, model, trial) -> None:
    """transformers' own save of ``checkpoint-N``, in place (not atomic), with the settings file; a full disk named."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    folder = os.path.join(trainer.checkpoint_run_dir(trial), name)
    try:
        trainer.stock_save_checkpoint(model, trial)
        if trainer.args.should_save and os.path.isdir(folder):
            write_settings(trainer, folder)
            write_manifest(folder)
    except (OSError, RuntimeError) as error:
        raise no_space_error(error, name, folder, removed=False) or error  # noqa: B904 (as above)


def publish(staged: str, final: str) -> None:
    """Flush ``staged`` to disk and rename it to ``final`` (replacing an existing ``final``: transformers' JIT save
    creates it first), then delete the emptied staging folder."""
    _fsync_tree(staged)
    if os.path.exists(final):
        replaced = os.path.join(os.path.dirname(final), REPLACED_PREFIX + os.path.basename(final))
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        os.rename(staged, final)
        shutil.rmtree(replaced, ignore_errors=True)
    elif os.path.isdir(staged):
        os.rename(staged, final)
    _fsync(os.path.dirname(final))
    shutil.rmtree(os.path.dirname(staged), ignore_errors=True)


def remove_leftovers(run_dir: str) -> None:
    """Delete the staging folders that killed saves left in ``run_dir`` (after a save completed)."""
    for entry in os.scandir(run_dir):
        if entry.is_dir() and entry.name.startswith((STAGING_PREFIX, REPLACED_PREFIX)):
            shutil.rmtree(entry.path, ignore_errors=True)


def no_space_error(error: BaseException, name: str, folder: str, removed: bool = True) -> OSError | None:
    """The one-line ``OSError`` (ENOSPC) for a save of checkpoint ``name`` into ``folder`` that ``error`` ended for want
    of disk space, or ``None`` when ``error`` is not about space (see the module docstring). ``removed``: the partial
    checkpoint was deleted (the atomic save's staging folder), else it stays as transformers left it."""
    text = str(error)
    if isinstance(error, OSError) and error.errno == errno.ENOSPC or "No space left on device" in text:
        cause = "no space left on device (ENOSPC)"
    elif isinstance(error, RuntimeError) and "inline_container.cc" in text:
        cause = f"torch's writer failed ({text.splitlines()[0][:80]}), most often no space left on device (ENOSPC)"
    else:
        return None
    try:
        free = f"{shutil.disk_usage(os.path.dirname(folder) or '.').free / 2**20:.1f} MiB left there"
    except OSError:
        free = "space left unknown"
    return OSError(
        errno.ENOSPC,
        f"saving {name} failed in {folder}: {cause}; {free}; "
        + ("the partial checkpoint was removed, " if removed else "")
        + "the newest complete checkpoint is unchanged: free disk space (or save_total_limit / --output_dir on a "
        "larger disk)",
    )


def _settle_best_checkpoint(trainer, run_dir: str, staged: str) -> None:
    """Set ``state.best_model_checkpoint`` as transformers sets it when it writes into the run directory.

    It looks for ``checkpoint-<best_global_step>`` in the folder it writes into: it finds the staged checkpoint (when
    the best step is this one) and misses an earlier one. The staged ``trainer_state.json`` is rewritten when this
    changes the value."""
    state, before = trainer.state, trainer.state.best_model_checkpoint
    if trainer.args.save_strategy in ("steps", "epoch", "best") and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best
    state_file = os.path.join(staged, TRAINER_STATE_NAME)
    if state.best_model_checkpoint != before and os.path.isfile(state_file):
        state.save_to_json(state_file)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a folder on a platform that cannot open one
        return
    try:
        os.fsync(fd)
    except OSError:  # a file system without fsync on folders
        pass
    finally:
        os.close(fd)
