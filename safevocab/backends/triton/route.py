"""How the Triton backend gets a chunk's threshold, decided once per call from the rule and the inputs' dtype.

Three ways to get a chunk's threshold, fixed per call by :meth:`Route.of` so that forward and backward rebuild
``S = {z >= t}`` from bit-identical logits:

- **in-kernel** (``NoPruning``, ``MinP``, ``MinProb``; :func:`safevocab.kernels.kernel_threshold`): the GEMM output
  (inputs' dtype) goes straight to the kernels, which apply the logit transform and compute the threshold
  themselves;
- **selection kernel** (``TopK``, ``TopP``, compositions; bf16/fp16/fp32 inputs): the raw GEMM output goes to
  :func:`safevocab.kernels.threshold_select.select_thresholds` (thresholds computed from it with the kernels'
  transform), then to the fold kernels as for in-kernel thresholds;
- **torch threshold** (other rules, and fp64 inputs): the chunk is transformed in torch into an fp32
  copy (``ChunkLogits``, as the torch backend does), the rule's ``threshold_and_max`` runs in torch,
  and the kernels fold the rest. Logged once per call at DEBUG level.

A :class:`Route` knows everything else that differs between the three: a chunk's scratch
(:meth:`Route.chunk_rows`), a chunk's logits buffer (:meth:`Route.chunk_logits`: the raw GEMM output the kernels
transform, or the torch-transformed fp32 copy) and how a chunk's thresholds and row statistics are made
(:meth:`Route.fold`). The forward, the replayed forward and every backward pass of the Triton backend take the route
of their call from here. A chunk's logits buffer is also what the forward keeps for the backward under the caller's
``keep_logits_bytes`` (:meth:`RouteLogits.forward`, :meth:`RouteLogits.backward`): the GEMM output on the in-kernel
and selection routes, the fp32 transformed copy on the torch route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safevocab.fused.chunking import ChunkJob, ChunkLogits, balanced_chunk_rows
from safevocab.fused.transform import Transform
from safevocab.kernels import MODE_GIVEN, kernel_threshold
from safevocab.kernels.forward_fold import forward_fold
from safevocab.kernels.kept_entries import KeptPool
from safevocab.kernels.threshold_select import KCAP, SelectionPlan, select_thresholds, selection_plan
from safevocab.rules import SafeVocabRule

__all__ = ["IN_KERNEL", "SELECTION", "TORCH", "ChunkGemm", "Route", "RouteLogits"]

#: The routes (:attr:`Route.kind`): the forward kernel computes the threshold; the selection kernel does; torch does.
IN_KERNEL, SELECTION, TORCH = "in-kernel", "selection", "torch"

#: Whether ``TopK``/``TopP``/compositions get their thresholds from :mod:`safevocab.kernels.threshold_select`
#: (``False``: the torch threshold on an fp32 copy, as before; for A/B comparisons and tests).
_KERNEL_SELECTION = True


@dataclass(frozen=True)
class Route:
    """How a call's chunks get their thresholds (the module docstring's three routes), and what follows from it.

    Attributes:
        kind: :data:`IN_KERNEL`, :data:`SELECTION` or :data:`TORCH`.
        rule: the call's rule (the torch route runs its ``threshold_and_max`` and sizes chunks by its scratch).
        in_bytes: bytes of one element of the inputs (2 for bf16/fp16, 4 for fp32, 8 for fp64).
        mode, log_param: the forward kernel's threshold mode and log parameter
            (:func:`~safevocab.kernels.kernel_threshold`); ``MODE_GIVEN`` and 0.0, the defaults, off the in-kernel
            route (the thresholds are given to the kernel).
        plan: the selection kernel's plan for the rule on the selection route; default ``None`` elsewhere.
    """

    kind: str
    rule: SafeVocabRule
    in_bytes: int
    mode: int = MODE_GIVEN
    log_param: float = 0.0
    plan: SelectionPlan | None = None

    @classmethod
    def of(cls, rule: SafeVocabRule, in_bytes: int) -> Route:
        """The route of ``rule`` for inputs of ``in_bytes`` bytes an element: the one place it is decided.

        In-kernel for the rules the forward kernel knows; else the selection kernel where it has a plan for the rule
        (exact ``TopK``, ``TopP`` and their compositions), except for fp64 inputs, which keep the torch path (fp64
        statistics); else the torch threshold."""
        in_kernel = kernel_threshold(rule)
        if in_kernel is not None:
            mode, log_param = in_kernel
            return cls(IN_KERNEL, rule, in_bytes, mode=mode, log_param=log_param)
        plan = selection_plan(rule) if _KERNEL_SELECTION and in_bytes < 8 else None
        if plan is not None:
            return cls(SELECTION, rule, in_bytes, plan=plan)
        return cls(TORCH, rule, in_bytes)

    @property
    def transform_in_kernel(self) -> bool:
        """Whether the kernels read the raw GEMM output and apply the logit transform themselves (the in-kernel and
        selection routes); ``False``: they read the torch-transformed copy (the torch route)."""
        return self.kind != TORCH

    def chunk_rows(self, n_rows: int, vocab: int, max_chunk_bytes: int) -> int:
        """Rows per chunk for ``n_rows`` rows and a vocabulary of ``vocab`` so that one chunk's scratch fits
        ``max_chunk_bytes`` (at least 1).

        The kernels read the GEMM output in the inputs' dtype and write the gradient over it, so a rule
        with an in-kernel threshold needs only that buffer (plus a bool mask for the sparse backward of
        fp32/fp64 inputs); the selection kernel adds its candidate buffer and row scalars. A torch-computed threshold
        also needs the fp32 transformed copy and the rule's own scratch.
        """
        in_bytes = self.in_bytes
        stat_bytes = 8 if in_bytes >= 8 else 4
        mask = 1 if in_bytes >= 4 else 0  # keep-mask of the sparse backward (fp32/fp64 inputs only)
        extra_per_row = 0
        if self.kind == IN_KERNEL:
            per_logit = in_bytes + mask
        elif self.kind == SELECTION:  # the raw chunk, plus the candidate buffer and row scalars
            per_logit, extra_per_row = in_bytes + mask, 4 * min(KCAP, vocab) + 32
        else:
            per_logit = stat_bytes + (in_bytes if in_bytes < 4 else 0) + mask + self.rule.scratch_bytes_per_logit
        # balanced chunks in multiples of 128 rows (no short tail chunk), as many as the budget's own row count gives
        return balanced_chunk_rows(n_rows, max_chunk_bytes // max(1, vocab * per_logit + extra_per_row))

    def chunk_logits(self, job: ChunkJob) -> RouteLogits:
        """The logits of ``job``'s chunks on this route, in one reused buffer of ``job.buffer_rows`` rows (or a kept
        chunk's own): the forward, the replayed forward and the backward each build one, so their chunks are
        bit-identical."""
        return RouteLogits(job, self.transform_in_kernel)

    def fold(
        self,
        z: torch.Tensor,
        targets: torch.Tensor,
        out: dict[str, torch.Tensor | None],
        transform: Transform,
        store_z: bool = False,
        kept_capacity: int | None = None,
        undecided: torch.Tensor | None = None,
    ) -> KeptPool | None:
        """One chunk's thresholds on this route, then the forward kernel's fold of its row statistics; with
        ``kept_capacity``, the fold's last pass also writes ``S``'s entries, returned in a
        :class:`~safevocab.kernels.kept_entries.KeptPool` of that many entries (every route: the fold is the pass
        that compares each logit with ``t``, and its one pass over the chunk on the selection and torch routes).

        Args:
            z: ``[n, V]``, the chunk's logits from :meth:`chunk_logits` (the raw GEMM output where
                :attr:`transform_in_kernel`, else the torch-transformed copy).
            targets: ``[n]`` int64 token ids, row-contiguous.
            out: the chunk's rows of the per-row outputs (:meth:`~safevocab.fused.row_stats.RowStats.rows`), written.
            transform: the call's logit transform (applied by the kernels where :attr:`transform_in_kernel`).
            store_z: write the transformed logits back over ``z`` (fp32/fp64 ``z`` on the in-kernel and selection
                routes, for a sparse chunk's entries); default ``False``. The torch route's ``z`` is transformed
                already.
            kept_capacity: the pool's size in entries (``None``: no pool; default).
            undecided: ``[n]`` bool, written on the selection route: decide the rows whose thresholds take the rule's
                torch code in a bounded batch, with no read of the device, and flag the rows past it, whose
                thresholds and statistics are then wrong until the chunk is folded again without it
                (:func:`~safevocab.kernels.threshold_select.select_thresholds`' ``undecided``). ``None`` (default):
                read the device for those rows. Untouched on the other routes, which leave no row undecided.
        """
        keep = dict(store_z=store_z, kept_capacity=kept_capacity)
        if self.kind == SELECTION:
            # thresholds from the raw chunk (threshold_select: no sort of V, no fp32 copy), then the fold
            # with the same in-kernel transform
            kw = _kernel_transform(transform)
            select_thresholds(z, self.plan, out["threshold"], out["row_max"], undecided=undecided, **kw)
            return forward_fold(z, targets, mode=MODE_GIVEN, **keep, **kw, **out)
        if self.kind == TORCH:  # z: the torch-transformed copy; the rule's own threshold
            t, z_max = self.rule.threshold_and_max(z)
            out["threshold"].copy_(t.squeeze(-1))
            out["row_max"].copy_(z_max.squeeze(-1))
            return forward_fold(z, targets, mode=MODE_GIVEN, kept_capacity=kept_capacity, **out)
        # z: the GEMM output; the kernel transforms it and computes the threshold itself
        kw = _kernel_transform(transform)
        return forward_fold(z, targets, mode=self.mode, log_param=self.log_param, **keep, **kw, **out)


def _kernel_transform(transform: Transform) -> dict[str, float | None]:
    """The transform as the kernels take it (keyword arguments of ``forward_fold`` and ``select_thresholds``)."""
    return dict(scale=transform.logit_scale, softcap=transform.softcap, temperature=transform.temperature)


class ChunkGemm:
    """GEMM of a chunk of rows into one reused buffer in the inputs' dtype (raw, untransformed logits), allocated on
    first use (a call whose chunks are all kept needs none), or into a kept chunk's own buffer."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
        self.weight_t, self.bias = weight.t(), bias
        self.shape, self.dtype, self.device = (rows, weight.shape[0]), hidden.dtype, hidden.device
        self.buf: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            if self.buf is None:
                self.buf = torch.empty(self.shape, device=self.device, dtype=self.dtype)
            out = self.buf[: h.shape[0]]
        if self.bias is None:
            torch.mm(h, self.weight_t, out=out)
        else:
            torch.addmm(self.bias, h, self.weight_t, out=out)
        return out


class RouteLogits:
    """A chunk's logits exactly as the forward made them: the raw GEMM output where the kernels transform it
    (:class:`ChunkGemm`), else the torch-transformed fp32 copy (:class:`~safevocab.fused.chunking.ChunkLogits`).

    Called on a chunk's rows ``h`` (``[n, H]``, a row slice of ``job.hidden``), it returns ``(z, out)``: what the
    kernels read, and the inputs'-dtype buffer the backward kernel writes the logits gradient into (``z`` itself
    on the raw routes). :meth:`forward` and :meth:`backward` do the same for a forward or backward chunk, through the
    job's kept buffers (:class:`~safevocab.fused.chunking.KeptLogits`): a forward chunk the cap lets through gets a
    buffer of its own, kept, and its backward folds that buffer instead of recomputing it.

    What is kept is ``z``, the buffer the folds read: the GEMM output (inputs' dtype: 2 bytes a logit for bf16) on the
    raw routes, the torch-transformed copy (fp32, fp64 for fp64 inputs: 4 or 8 bytes a logit) on the torch route,
    whose half-precision GEMM output is then a reused buffer in forward and backward alike.
    """

    def __init__(self, job: ChunkJob, transform_in_kernel: bool):
        self.job, self.in_kernel = job, transform_in_kernel
        rows = job.buffer_rows
        self.gemm = ChunkGemm(job.hidden, job.weight, job.bias, rows) if self.in_kernel else None
        self.logits = None if self.in_kernel else ChunkLogits(job.hidden, job.weight, job.bias, job.transform, rows)

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_kernel:
            out = self.gemm(h)
            return out, out
        z = self.logits(h)
        return z, self._destination(z)

    def kept_dtype(self) -> torch.dtype:
        """The dtype of a kept chunk's buffer: the inputs' on the raw routes, the statistics' on the torch route."""
        return self.job.hidden.dtype if self.in_kernel else self.logits.stat

    def forward(self, rows: slice) -> torch.Tensor:
        """The logits the forward folds for the chunk ``rows`` (``z`` of :meth:`__call__`): in a buffer of their own,
        kept for the backward, while the job's cap has room for its ``rows x V x itemsize`` bytes; else in the reused
        buffer. The same GEMM and transform on the same operands either way, into a buffer of the same layout."""
        h = self.job.hidden[rows]
        dtype = self.kept_dtype()
        n, vocab = h.shape[0], self.job.vocab
        if not self.job.keeps(rows, n * vocab * dtype.itemsize):
            return self(h)[0]
        z = torch.empty(n, vocab, device=h.device, dtype=dtype)
        if self.in_kernel:
            self.gemm(h, out=z)
        elif self.logits.in_dtype == z.dtype:  # fp32/fp64 inputs: the GEMM writes the logits in place
            self.logits.transformed(self.logits.gemm(h, out=z))
        else:  # half inputs: the GEMM output in the reused buffer, its transformed copy in the kept one
            self.logits.transformed(self.logits.gemm(h), out=z)
        self.job.kept_logits.put(rows.start, z)
        return z

    def again(self, rows: slice) -> torch.Tensor:
        """The logits of the forward chunk ``rows`` once more, for a forward that folds it again: the buffer its
        forward kept (left kept for the backward), else recomputed into the reused buffer (:meth:`__call__`)."""
        z = self.job.kept(rows)
        return z if z is not None else self(self.job.hidden[rows])[0]

    def backward(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, out)`` of the chunk ``rows`` for a backward: the buffer its forward kept, taken (the backward writes
        the gradient over it: a second backward recomputes), with ``out`` the inputs'-dtype destination; else
        recomputed (:meth:`__call__`)."""
        z = self.job.take_kept(rows)
        if z is None:
            return self(self.job.hidden[rows])
        return z, self._destination(z)

    def _destination(self, z: torch.Tensor) -> torch.Tensor:
        """Where the backward kernel writes the logits gradient of ``z``: ``z`` itself where it is in the inputs'
        dtype, else (half inputs on the torch route) the reused GEMM buffer."""
        if self.in_kernel or self.logits.in_dtype == z.dtype:
            return z
        return self.logits.raw_buffer(z.shape[0])
