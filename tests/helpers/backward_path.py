"""Choose the fused op's backward path in tests: ``density`` 0.0 forces the dense backward (recomputation) and 1.0
the sparse one (stored ``S``), on every backend: the torch sparse GEMMs read ``SPARSE_MAX_DENSITY``, a backend's own
sparse backward (Triton) ``KERNEL_SPARSE_MAX_DENSITY`` (:func:`safevocab.fused.op.sparse_density`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from safevocab.fused import op as fused_op

DENSITY_NAMES = ("SPARSE_MAX_DENSITY", "KERNEL_SPARSE_MAX_DENSITY")


def set_sparse_max_density(monkeypatch, density: float) -> None:
    """Both gates at ``density`` for the rest of the test (pytest's ``monkeypatch`` restores them)."""
    for name in DENSITY_NAMES:
        monkeypatch.setattr(fused_op, name, density)


@contextlib.contextmanager
def sparse_max_density(density: float | None) -> Iterator[None]:
    """Both gates at ``density`` inside the block (``None``: the defaults), restored after (for hypothesis tests,
    where a function-scoped ``monkeypatch`` would outlive the example)."""
    saved = {name: getattr(fused_op, name) for name in DENSITY_NAMES}
    if density is not None:
        for name in DENSITY_NAMES:
            setattr(fused_op, name, density)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(fused_op, name, value)
