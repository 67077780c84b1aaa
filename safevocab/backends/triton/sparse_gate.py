"""Which backward forms the safe-set part of the chunks whose ``S`` the forward stored, decided once per call.

Three ways, all exact and deterministic (:func:`safevocab.backends.triton.backward.sparse_backward` runs the chosen one
for every stored chunk of the call):

- **per-id** (:mod:`safevocab.kernels.sparse_backward`): per kept logit, a row of ``W`` gathered for ``dX`` and a row
  of ``h`` for ``dW`` (``2 H`` values, no tensor cores), ``dW`` one program per distinct id looping over the rows that
  keep it. The H100 fit (docs/performance.md, third GPU run; H = 4096, bf16) is ~14 ns a kept logit, ~1.2 TB/s of
  gathers, plus the serial loop of the most shared id (5,930 rows in the LM profile).
- **union** (:mod:`safevocab.kernels.union_backward`): ``G_U [R, |U|]`` over ``U``, the chunk's kept ids, and two
  GEMMs, ``4 R |U| H`` FLOPs on tensor cores: ~0.02 ns a cell of ``G_U`` at H = 4096 and the measured 775 TFLOP/s,
  plus the cell's own bytes (written, read by two GEMMs: ~0.003 ns at 3 TB/s).
- **dense** (:func:`safevocab.backends.triton.backward.dense_backward` on the stored chunks): the chunk's logits
  recomputed and two gradient GEMMs over ``V``: ``6 R V H`` FLOPs, two passes over the ``[R, V]`` logits and a
  read-modify-write of the fp32 ``[V, H]`` weight gradient per chunk (~39 ms for N = 8192, V = 151936 on the H100).
  Only where no stored row's gradient leaves ``S`` (that part is added apart, by the fused op) and ``S`` is the
  rule's (a replayed support is no ``{z >= t}``).

Hence the two thresholds below, from the kept counts per row (``nnz``) and the unions' sizes:

- union against per-id: ``0.023 ns x sum_c R_c |U_c|`` against ``14 ns x nnz``: union while the **fill**
  ``nnz / sum_c R_c |U_c|`` (mean kept per row over ``|U|``) is at least ~1/600 (:data:`UNION_MIN_FILL`). The LM
  profile's ``min_p=0.01`` (~40 kept a row, ``|U|`` = 10,354): fill 1/260, ~1.8 ms instead of ~12; flat logits' ``top_k=50``
  (52 a row, ``|U|`` = 0.93 V): fill 1/2700.
- dense against union: ``4 R |U| H`` against ``6 R V H`` FLOPs puts the crossover at ``|U|`` = 1.5 V, never reached; but
  the union's operands are gathered (``W[U]``), its ``G_U`` and ``[|U|, H]`` buffers are fp32 and grow with ``|U|``, and
  its GEMMs are skinnier. Until a device measures it, dense takes a call whose widest union exceeds
  :data:`DENSE_MIN_UNION` of ``V`` (flat ``top_k=50``: 0.93 V, dense, ~70 ms measured, where per-id took 79).

Both are **placeholders, to be placed from the device run** (``/work/shared/tools/gpu_next.py``, its top_k sweep with
each backward forced by :data:`FORCE`). Deciding needs ``|U|`` of every chunk: the caller reads it from the device once
per call, with the flag of rows whose gradient leaves ``S`` (not once per chunk).
"""

from __future__ import annotations

__all__ = ["BACKWARDS", "DENSE", "DENSE_MIN_UNION", "FORCE", "PER_ID", "TAKEN", "UNION", "UNION_MIN_FILL", "choose"]

#: The three backwards of the stored sets (module docstring).
PER_ID, UNION, DENSE = "per-id", "union", "dense"
BACKWARDS = (PER_ID, UNION, DENSE)

#: Smallest fill ``nnz / sum_c R_c |U_c|`` for which the union GEMMs replace the per-id kernels: a placeholder from the
#: FLOP/byte estimate of the module docstring (~1/600), to be placed from the device run.
UNION_MIN_FILL = 1.0 / 512
#: Widest union, as a fraction of ``V``, above which the dense backward recomputes the stored chunks (where it may):
#: a placeholder below the FLOP crossover (1.5 V), to be placed from the device run.
DENSE_MIN_UNION = 0.5

#: Force one backward for every call (``None``, the default: :func:`choose` decides): device sweeps and tests set it.
#: :data:`DENSE` where the dense backward may not run (a replayed support, rows whose gradient leaves ``S``) gives
#: :data:`UNION`.
FORCE: str | None = None

#: Calls that took each backward in this process (a device sweep reads which ran; never reset here).
TAKEN = dict.fromkeys(BACKWARDS, 0)


def choose(entries: int, cells: int, widest: int, vocab: int, dense_allowed: bool) -> str:
    """The backward of a call's stored chunks: :data:`PER_ID`, :data:`UNION` or :data:`DENSE`.

    Args:
        entries: kept logits stored, all chunks (``nnz``, the per-row counts' sum).
        cells: ``sum_c R_c |U_c|``, the cells of the chunks' ``G_U``.
        widest: the largest ``|U_c|``.
        vocab: ``V``.
        dense_allowed: whether the dense backward may form this part (no replayed support, no stored row whose
            gradient leaves ``S``).
    """
    if FORCE is not None:
        if FORCE not in BACKWARDS:
            raise ValueError(f"sparse_gate.FORCE must be one of {BACKWARDS} or None, not {FORCE!r}")
        return UNION if FORCE == DENSE and not dense_allowed else FORCE
    if dense_allowed and widest > DENSE_MIN_UNION * vocab:
        return DENSE
    return UNION if entries >= UNION_MIN_FILL * cells else PER_ID
