"""A checkpoint save that ran out of disk space, said in one line.

A full disk surfaces from a save as ``OSError: [Errno 28] No space left on device`` from Python's writers, or as
torch's zip writer's ``RuntimeError: [enforce fail at inline_container.cc:...] ... file write failed`` (or
``unexpected pos``), which names neither the cause nor the folder. :func:`no_space_error` turns either into one
``OSError`` (errno ENOSPC) naming the checkpoint, the folder and the space left there.
"""

from __future__ import annotations

import errno
import os
import shutil

__all__ = ["no_space_error"]


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
