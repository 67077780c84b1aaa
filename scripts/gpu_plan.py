"""The device plan's sections of ``scripts/gpu_bench.py`` (``../shared/GPU_DESIGN.md``, "Update 2026-11-28"), run in
the bench's own process, one function a section:

- :func:`gate`: flat (``synthetic``) logits, ``min_p=0.001``, ``top_p=0.9``, ``top_k=50``, each with the backward the
  gate chooses, then each backward forced (:data:`BACKWARDS`), beside the floor, trl and Liger;
- :func:`topk_sweep`: ``top_k`` 64-512 on both logit profiles with each backward forced: where the sparse backwards
  stop paying;
- :func:`lm_table`: the LM-like profile, ``min_p=0.01``, ``top_k=50``, ``top_p=0.9``, ``none`` and the replay of 64 ids,
  safevocab beside trl's per-token kernel, Liger and the 3-GEMM floor;
- :func:`compact`: the kept-entry micro-benchmark on one LM ``min_p=0.01`` chunk: the fold with and without its pool,
  the pool's packing, and the separate compaction (the fallback re-read) at column blocks of 1024-8192;
- :func:`trace`: one profiled call each of ``min_p=0.01`` (LM), ``top_p=0.9`` (LM: the bounded batch) and ``none``
  (flat): the top kernels and the GPU's idle gaps between kernels inside the call (:func:`idle_gaps`; on a CPU, no
  kernels: the same fields, zero);
- :func:`fallback`: the mass rules' bounded batch (``top_p``'s rows left to the rule's torch code, decided with no
  read of the device: the op's default) priced against the read a chunk it replaced (docs/performance.md, "Host
  synchronisation"): whether the default should go back to the read is this section's question.

Every timed row says which backward ran: the calls of :data:`safevocab.backends.triton.sparse_gate.TAKEN` per step
(``per-id``, ``union``, ``dense``: the dense backward of stored chunks), or ``dense (nothing stored)`` when the forward
stored no chunk; and the chunks counted by ``REREAD_FALLBACKS`` / ``DENSE_FALLBACKS`` / ``MASS_BATCH_REDOS``
(:mod:`safevocab.backends.triton.forward`) per step. Forcing: ``dense`` sets the storage gate
(``safevocab.fused.op.KERNEL_SPARSE_MAX_DENSITY``) to 0, so the forward stores nothing; ``per-id``, ``union`` and
``dense-stored`` set it to 1 (every chunk stored; a pool that overflows is compacted again and counted) and
``sparse_gate.FORCE`` to that backward. Steps are :func:`safevocab.bench.variants.make_step`'s (the op benchmark's
inputs and its floor, trl and ``fused``/``fused_replay`` steps), with the Triton backend (interpreted on a CPU).

:func:`section_problems` says what a section's results lack (a section that recorded nothing, a row without the
backward that ran): the bench reports it and exits 1. This is tooling, not product code.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import importlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

#: The plan's sections, in the order of one device call.
PLAN_SECTIONS = ("gate", "topk_sweep", "lm_table", "compact", "trace", "fallback")
#: The backwards a row can force (module docstring); ``gate``: none forced, the gate decides.
BACKWARDS = ("gate", "dense", "dense-stored", "per-id", "union")
GATE_RULES = ("min_p=0.001", "top_p=0.9", "top_k=50")
GATE_BACKWARDS = ("gate", "dense", "per-id", "union")
TOPK = (64, 128, 256, 512)
SWEEP_BACKWARDS = ("dense", "dense-stored", "per-id", "union")
LM_RULES = ("min_p=0.01", "top_k=50", "top_p=0.9", "none")
#: The LM table's replay row: the sets of this rule, replayed as an engine's kept ids.
REPLAY_RULE = "top_k=64"
#: The LM table's kept-logits rows (``fused_kept``: ``keep_logits_bytes`` large enough for every chunk, so that the
#: dense backward recomputes nothing): the rules whose backward is dense there.
KEPT_RULES = ("none",)
KEEP_LOGITS_BYTES = 8 * 2**30
TRACES = (("minp01_lm", "lm", "min_p=0.01"), ("topp09_lm", "lm", "top_p=0.9"), ("none_synthetic", "synthetic", "none"))
#: The fallback section's rules (mass rules: their rows within the margin take the rule's code) and logits profiles.
FALLBACK_RULES = ("top_p=0.9", "top_p=0.99")
FALLBACK_PROFILES = ("lm", "synthetic")
COMPACT_BLOCKS = (1024, 2048, 4096, 8192)
#: What a forward that records which backward ran says when it stored no chunk.
NOTHING_STORED = "dense (nothing stored)"


@dataclass
class Plan:
    """The shape and timing of the plan's rows, and the time past which no row starts."""

    device: torch.device
    n: int
    h: int
    v: int
    dtype: str
    chunk_bytes: int
    warmups: int
    reps: int
    deadline: float  # time.time() past which rows are skipped (and say so)
    out: Path  # results file: traces are written beside it
    small: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def make_plan(small: bool, n: int | None, deadline: float, out: Path) -> Plan:
    """The GPU plan's shape (N = 8192, H = 4096, V = 151936, bf16, 1 GiB chunks, best of 3 after 2 warm-ups), or with
    ``small`` a CPU smoke (N = 16, H = 8, V = 192, fp32, one step a row, the kernels under Triton's interpreter)."""
    if small:
        return Plan(torch.device("cpu"), n or 16, 8, 192, "float32", 2**13, 0, 1, deadline, out, True)
    return Plan(torch.device("cuda"), n or 8192, 4096, 151936, "bfloat16", 2**30, 2, 3, deadline, out, False)


# ---------------------------------------------------------------------------------------------- steps and counters


def bench_args(plan: Plan, rule: str, profile: str):
    """The op benchmark's arguments (:func:`safevocab.bench.cli.make_parser`) for ``rule`` on ``profile`` logits."""
    from safevocab.bench.cli import make_parser

    return make_parser().parse_args(
        ["--device", str(plan.device), "--n", str(plan.n), "--h", str(plan.h), "--v", str(plan.v), "--dtype",
         plan.dtype, "--rule", rule, "--logits-profile", profile, "--max-chunk-bytes", str(plan.chunk_bytes),
         "--backend", "triton"]
    )  # fmt: skip


@contextlib.contextmanager
def forced(backward: str) -> Iterator[None]:
    """The fused op's backward forced to ``backward`` (one of :data:`BACKWARDS`) inside the block (module docstring)."""
    from safevocab.backends.triton import sparse_gate
    from safevocab.fused import op

    if backward not in BACKWARDS:
        raise ValueError(f"backward={backward!r}: accepted one of {BACKWARDS}")
    if backward not in ("gate", "dense") and not hasattr(sparse_gate, "FORCE"):
        raise RuntimeError("safevocab.backends.triton.sparse_gate has no FORCE: this backward cannot be forced here")
    saved = op.KERNEL_SPARSE_MAX_DENSITY, getattr(sparse_gate, "FORCE", None)
    try:
        if backward == "dense":
            op.KERNEL_SPARSE_MAX_DENSITY = 0.0
        elif backward != "gate":
            op.KERNEL_SPARSE_MAX_DENSITY = 1.0
            sparse_gate.FORCE = {"dense-stored": sparse_gate.DENSE}.get(backward, backward)
        yield
    finally:
        op.KERNEL_SPARSE_MAX_DENSITY = saved[0]
        if hasattr(sparse_gate, "FORCE"):
            sparse_gate.FORCE = saved[1]


def counters() -> dict[str, int]:
    """The process's counts of the backwards taken (``sparse_gate.TAKEN``) and of the forward's fallbacks."""
    from safevocab.backends.triton import forward, sparse_gate

    taken = getattr(sparse_gate, "TAKEN", {})
    return {
        **{f"taken {name}": count for name, count in taken.items()},
        "reread_fallback_chunks": forward.REREAD_FALLBACKS["chunks"],
        "dense_fallback_chunks": forward.DENSE_FALLBACKS["chunks"],
        "mass_batch_redo_chunks": forward.MASS_BATCH_REDOS["chunks"],
    }


def paths(before: dict[str, int], after: dict[str, int], calls: int) -> dict:
    """Which backward ran in ``calls`` steps, from :func:`counters` before and after: ``backward`` names the one(s)
    taken (``per-id``, ``union``, ``dense``: of the stored chunks; ``dense (nothing stored)``), with the fallback chunks
    per step."""
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    taken = {key.removeprefix("taken "): count for key, count in delta.items() if key.startswith("taken ") and count}
    ran = ", ".join(f"{name} {count}/{calls}" if count != calls else name for name, count in taken.items())
    if not any(key.startswith("taken ") for key in after):
        ran = "unknown (no sparse_gate.TAKEN here)"
    return {
        "backward": ran or NOTHING_STORED,
        "reread_fallback_chunks_per_step": delta["reread_fallback_chunks"] / calls,
        "dense_fallback_chunks_per_step": delta["dense_fallback_chunks"] / calls,
        "mass_batch_redo_chunks_per_step": delta["mass_batch_redo_chunks"] / calls,
    }


def _sync(plan: Plan) -> None:
    if plan.cuda:
        torch.cuda.synchronize()


def mean_ms(plan: Plan, fn: Callable[[], object]) -> float:
    """Mean milliseconds of ``plan.reps`` calls of ``fn`` after one (Triton compiles in it), synchronised at both ends
    only: the host runs ahead of the device as it does inside the op."""
    fn()
    _sync(plan)
    started = time.perf_counter()
    for _ in range(plan.reps):
        fn()
    _sync(plan)
    return round((time.perf_counter() - started) / plan.reps * 1e3, 3)


def measure(plan: Plan, step: Callable[[], None]) -> dict:
    """Best of ``plan.reps`` timed steps after ``plan.warmups`` (Triton compiles in the first), the backward that ran
    and, on CUDA, the peak memory above what was allocated before the timed steps."""
    from safevocab.bench.measure import timed

    before = counters()
    for _ in range(plan.warmups):
        step()
    _sync(plan)
    if plan.cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = [timed(step, plan.device) for _ in range(plan.reps)]
    out = {"ms": round(min(times) * 1e3, 3), "all_ms": [round(t * 1e3, 3) for t in times]}
    out.update(paths(before, counters(), plan.warmups + plan.reps))
    if plan.cuda:
        out["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    return out


def row(plan: Plan, section: str, profile: str, rule: str, variant: str, make: Callable[[], Callable[[], None]],
        backward: str | None = None) -> dict:  # fmt: skip
    """One measured row: ``make()``'s step timed with ``backward`` forced (``None``: not a fused row), or the error it
    raised, or a note that the budget was spent; printed as it is done."""
    rec = {"section": section, "profile": profile, "rule": rule, "variant": variant}
    if backward is not None:
        rec["forced"] = backward
    if time.time() > plan.deadline:
        return {**rec, "skipped": "budget (--budget_s) spent before this row"}
    try:
        with forced(backward or "gate"):
            step = make()
            if isinstance(step, str):  # a comparison that does not run here says why
                return {**rec, "skipped": step}
            rec.update(measure(plan, step))
            label = getattr(step, "label", None)
            if label:
                rec["implementation"] = label
    except Exception as err:  # noqa: BLE001 - recorded, the other rows still run
        rec["error"] = f"{type(err).__name__}: {err}"[:400]
    finally:
        if plan.cuda:
            torch.cuda.empty_cache()
    if backward is None:  # not a fused row: which backward the op would take is not its business
        for key in ("backward", "reread_fallback_chunks_per_step", "dense_fallback_chunks_per_step",
                    "mass_batch_redo_chunks_per_step"):  # fmt: skip
            rec.pop(key, None)
    print(json.dumps(rec), flush=True)
    return rec


def fused_row(plan: Plan, section: str, profile: str, rule: str, backward: str, replay: bool = False,
              keep: bool = False) -> dict:  # fmt: skip
    """safevocab's fused op (``fused_replay``: the sets of ``rule`` replayed, no rule; ``fused_kept``: every chunk's
    logits kept for the backward, :data:`KEEP_LOGITS_BYTES`) with ``backward`` forced, and the kept sets' sizes."""
    from safevocab.bench.inputs import kept_set_sizes
    from safevocab.bench.variants import make_step, shared_inputs

    args = bench_args(plan, rule, profile)
    if keep:
        args.keep_logits_bytes = KEEP_LOGITS_BYTES
    variant = "fused_replay" if replay else "fused_kept" if keep else "fused"
    out = row(plan, section, profile, rule, variant,
              lambda: make_step("fused_replay" if replay else "fused", args, plan.device), backward)  # fmt: skip
    if "ms" in out:
        hidden, weight, _, _ = shared_inputs(args, plan.device)
        out["kept"] = {k: round(v, 1) for k, v in kept_set_sizes(hidden.detach(), weight.detach(), rule).items()}
    return out


def reference_rows(plan: Plan, section: str, profile: str, rule: str) -> list[dict]:
    """The floor (3 bare GEMMs), the recompute floor (4: the limit of a head that keeps no logits), trl's per-token
    ``ChunkedLogProbFunction`` and Liger (:func:`liger_step`) on the inputs of ``rule`` (their targets; none of them
    prunes)."""
    from safevocab.bench.variants import make_step, shared_inputs, trl_available

    args = bench_args(plan, rule, profile)
    return [
        row(plan, section, profile, rule, "floor", lambda: make_step("floor", args, plan.device)),
        row(plan, section, profile, rule, "recompute_floor", lambda: make_step("recompute_floor", args, plan.device)),
        row(plan, section, profile, rule, "trl",
            lambda: make_step("trl", args, plan.device) if trl_available() else "trl not installed"),
        row(plan, section, profile, rule, "liger", lambda: liger_step(*shared_inputs(args, plan.device))),
    ]  # fmt: skip


def liger_step(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_out: torch.Tensor):
    """Liger-Kernel's per-token fused linear log-probabilities (forward + backward of ``-nll``), or why not (a
    string). Every use of ``liger_kernel``'s names is here.

    Its Hopper kernel where the frontend ``liger_kernel.ops.LigerFusedLinearScaledCrossEntropyFunction`` dispatches to
    one on this device (CuTe-DSL on sm_90 with the ``cutedsl`` extra; ``apply(x, W, y, temperature, ignore_index,
    m_tiles_per_cluster, return_entropy)`` -> fp32 ``nll [N]``); else (another device, the frontend's torch fallback,
    an older wheel) the Triton ``LigerFusedLinearCrossEntropyFunction`` with ``reduction="none"`` (positional
    ``x, W, y, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction``; its first output, the
    per-token loss). The step's ``label`` names the one that runs and the wheel's version."""
    try:
        ops = importlib.import_module("liger_kernel.ops")
    except Exception as err:  # noqa: BLE001 - absent here (the usual case off the device): the row says so
        return f"liger_kernel not installed ({type(err).__name__})"
    try:
        version = importlib.import_module("importlib.metadata").version("liger-kernel")
    except Exception:  # noqa: BLE001
        version = "?"
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    hopper = _liger_hopper(ops, hidden)
    if hopper is not None:
        scaled, impl = hopper

        def step() -> None:
            nll = scaled.apply(h, w, targets, 1.0, -100, 1, False)
            nll.backward(-grad_out)  # log-probabilities are -nll

        step.label = f"LigerFusedLinearScaledCrossEntropyFunction -> {impl} (liger-kernel {version})"
        return step
    flce = importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy").LigerFusedLinearCrossEntropyFunction

    def step() -> None:
        loss = flce.apply(h, w, targets, None, None, -100, 0.0, 0.0, "none")[0]
        loss.backward(-grad_out)

    step.label = f"LigerFusedLinearCrossEntropyFunction (Triton, reduction='none'; liger-kernel {version})"
    return step


def _liger_hopper(ops, hidden: torch.Tensor):
    """``(LigerFusedLinearScaledCrossEntropyFunction, the implementation its frontend picks here)`` where that is a
    device kernel (sm_90 or later, not the frontend's torch fallback), else ``None``."""
    scaled = getattr(ops, "LigerFusedLinearScaledCrossEntropyFunction", None)
    if scaled is None or hidden.device.type != "cuda" or torch.cuda.get_device_capability(hidden.device) < (9, 0):
        return None
    try:
        frontend = importlib.import_module("liger_kernel.ops.fused_linear_scaled_cross_entropy")
        resolve = frontend._resolve_implementation  # which kernel the frontend would run on this device and dtype
        try:
            impl = resolve(hidden.device, hidden.dtype)
        except TypeError:  # 0.8.x before the SM103 kernel: resolve(device)
            impl = resolve(hidden.device)
    except Exception:  # noqa: BLE001 - no CuTe DSL here, or the frontend moved: the Triton path
        return None
    name = getattr(impl, "__name__", str(impl))
    return None if "Fallback" in name else (scaled, name)


# ---------------------------------------------------------------------------------------------- sections


def gate(plan: Plan, rules: tuple[str, ...] = GATE_RULES, backwards: tuple[str, ...] = GATE_BACKWARDS) -> list[dict]:
    """Flat logits: each rule with each of ``backwards`` (``gate``: the gate's choice), beside the references."""
    rows = reference_rows(plan, "gate", "synthetic", rules[0])
    for rule in rules:
        rows += [fused_row(plan, "gate", "synthetic", rule, backward) for backward in backwards]
    return rows


def topk_sweep(plan: Plan, ks: tuple[int, ...] = TOPK, backwards: tuple[str, ...] = SWEEP_BACKWARDS,
               profiles: tuple[str, ...] = ("lm", "synthetic")) -> list[dict]:  # fmt: skip
    """``top_k=k`` for each ``k`` on each profile, each of ``backwards`` forced; trl once a profile."""
    rows = []
    for profile in profiles:
        rows += reference_rows(plan, "topk_sweep", profile, f"top_k={ks[0]}")[1:2]  # trl
        for k in ks:
            rows += [fused_row(plan, "topk_sweep", profile, f"top_k={k}", backward) for backward in backwards]
    return rows


def lm_table(plan: Plan, rules: tuple[str, ...] = LM_RULES) -> list[dict]:
    """The LM-like profile: the references, each rule with the gate's backward, :data:`KEPT_RULES` with their logits
    kept for the backward (``fused_kept``), and the replay of :data:`REPLAY_RULE`'s sets."""
    rows = reference_rows(plan, "lm_table", "lm", rules[0])
    rows += [fused_row(plan, "lm_table", "lm", rule, "gate") for rule in rules]
    rows += [fused_row(plan, "lm_table", "lm", rule, "gate", keep=True) for rule in KEPT_RULES]
    rows.append(fused_row(plan, "lm_table", "lm", REPLAY_RULE, "gate", replay=True))
    return rows


def compact(plan: Plan, blocks: tuple[int, ...] = COMPACT_BLOCKS) -> dict:
    """One LM ``min_p=0.01`` chunk (2816 rows at most, the 1 GiB budget's chunk): the fold's one pass (``none``) and
    two passes (``min_p``) without a pool, ``min_p`` with the pool that holds ``S``'s entries, the pool's packing into
    CSR (:func:`~safevocab.kernels.kept_entries.pack_kept`), and the separate compaction that re-reads the chunk
    (:func:`~safevocab.kernels.kept_entries.compact_kept`, the fallback) at each column block of ``blocks``. A time
    that falls with the block is a per-block cost, a flat one a per-element cost; ``gb_s``: the chunk's bytes read
    once over each time."""
    if time.time() > plan.deadline:
        return {"skipped": "budget (--budget_s) spent before this section"}
    from safevocab.bench.variants import shared_inputs
    from safevocab.fused.row_stats import RowStats
    from safevocab.kernels import MODE_MIN_P, MODE_NONE, kept_entries
    from safevocab.kernels.forward_fold import forward_fold

    hidden, weight, targets, _ = shared_inputs(bench_args(plan, "min_p=0.01", "lm"), plan.device)
    rows = min(plan.n, 2816)
    with torch.no_grad():
        z = hidden[:rows] @ weight.t()
    y = targets[:rows].contiguous()
    out = RowStats.empty(rows, plan.device, torch.float32, compute_entropy=False).rows(slice(0, rows))

    ms = functools.partial(mean_ms, plan)
    min_p = dict(mode=MODE_MIN_P, log_param=math.log(0.01))
    res = {"rows": rows, "v": plan.v, "chunk_bytes": z.numel() * z.element_size()}
    res["fold_none_ms"] = ms(lambda: forward_fold(z, y, mode=MODE_NONE, **out))
    res["fold_min_p_ms"] = ms(lambda: forward_fold(z, y, **min_p, **out))
    nnz = int(out["safe_size"].sum())
    res["kept_mean"] = round(nnz / rows, 1)
    res["fold_min_p_pool_ms"] = ms(lambda: forward_fold(z, y, **min_p, kept_capacity=max(nnz, 1), **out))
    pool = forward_fold(z, y, **min_p, kept_capacity=max(nnz, 1), **out)
    res["pack_ms"] = ms(lambda: kept_entries.pack_kept(pool, out["row_max"], nnz))
    saved = kept_entries.MAX_BLOCK
    try:
        for block in blocks:
            kept_entries.MAX_BLOCK = block
            args = (z, out["threshold"], out["row_max"], out["safe_size"], 1.0, None, 1.0, True)
            res[f"compact_block{block}_ms"] = ms(lambda args=args: kept_entries.compact_kept(*args))
    finally:
        kept_entries.MAX_BLOCK = saved
    res["gb_s"] = {
        key.removesuffix("_ms"): round(res["chunk_bytes"] / (value * 1e-3) / 1e9, 1)
        for key, value in res.items()
        if key.endswith("_ms") and value > 0
    }
    print(json.dumps(res), flush=True)
    return res


def trace(plan: Plan, traces: tuple[tuple[str, str, str], ...] = TRACES) -> dict:
    """One profiled call of each ``(name, profile, rule)``, after the warm-ups: its top kernels (ops on a CPU) and the
    GPU's idle gaps between kernels (:func:`idle_gaps`); the chrome trace gzipped beside the results file."""
    from torch.profiler import ProfilerActivity, profile

    from safevocab.bench.variants import make_step

    res = {}
    for name, logits, rule in traces:
        if time.time() > plan.deadline:
            res[name] = {"skipped": "budget (--budget_s) spent before this trace"}
            continue
        try:
            step = make_step("fused", bench_args(plan, rule, logits), plan.device)
            before = counters()
            for _ in range(max(plan.warmups, 1)):
                step()
            _sync(plan)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.cuda else [])
            with profile(activities=activities) as prof:
                step()
                _sync(plan)
            ran = paths(before, counters(), max(plan.warmups, 1) + 1)
            key = "device_time_total" if plan.cuda else "cpu_time_total"
            top = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:25]
            path = plan.out.with_name(f"{plan.out.stem}.trace_{name}.json")
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
            with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            path.unlink()
            res[name] = {
                "profile": logits,
                "rule": rule,
                "top": [{"name": e.key[:90], "calls": e.count, "us": round(getattr(e, key, 0.0), 1)} for e in top],
                "idle": idle_gaps(events),
                "trace_file": f"{path.name}.gz",
                **ran,
            }
        except Exception as err:  # noqa: BLE001 - recorded, the other trace still runs
            res[name] = {"profile": logits, "rule": rule, "error": f"{type(err).__name__}: {err}"[:400]}
        print(json.dumps({name: {k: v for k, v in res[name].items() if k != "top"}}), flush=True)
    return res


def fallback(plan: Plan, rules: tuple[str, ...] = FALLBACK_RULES,
             profiles: tuple[str, ...] = FALLBACK_PROFILES) -> list[dict]:  # fmt: skip
    """The mass rules' bounded batch priced against the read a chunk it replaced, per profile and rule: one call's
    chunks (the op's chunk rows for the plan's budget), each its GEMM then its thresholds
    (:func:`~safevocab.kernels.threshold_select.select_thresholds`), timed as a whole call (:func:`mean_ms`):

    - ``batch_ms``: as the op does by default, the rows left to the rule's torch code decided in one bounded batch of
      ``batch_rows`` rows a chunk with no read of the device (``undecided=``);
    - ``read_ms``: the chunk's rows read and given to the rule's torch code (the op before, and after a chunk that
      overflowed the batch: ``MASS_BATCH_REDOS``);
    - ``no_read_ms``: the rows flagged, not decided (``fallback=False``): neither the read nor a batch.

    The read costs ``read_ms - no_read_ms`` a call, the batch ``batch_ms - no_read_ms``; ``flagged_max`` is the most
    rows of one chunk left to the rule's code, ``undecided_max`` the most the batch could not hold (the op folds such
    a chunk again and reads from then on)."""
    rows = []
    for profile in profiles:
        for spec in rules:
            rec = {"section": "fallback", "profile": profile, "rule": spec}
            if time.time() > plan.deadline:
                rec["skipped"] = "budget (--budget_s) spent before this row"
            else:
                try:
                    rec.update(_price_fallback(plan, profile, spec))
                except Exception as err:  # noqa: BLE001 - recorded, the other rows still run
                    rec["error"] = f"{type(err).__name__}: {err}"[:400]
                finally:
                    if plan.cuda:
                        torch.cuda.empty_cache()
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    return rows


def _price_fallback(plan: Plan, profile: str, spec: str) -> dict:
    """:func:`fallback`'s row of one profile and ``top_p`` rule (its fields but the row's names)."""
    from safevocab.backends.triton.route import Route
    from safevocab.bench.variants import shared_inputs
    from safevocab.kernels.rule_rows import BATCH_DIVISOR
    from safevocab.kernels.threshold_select import select_thresholds, selection_plan
    from safevocab.rules import parse_rule

    hidden, weight, _, _ = shared_inputs(bench_args(plan, spec, profile), plan.device)
    hidden, weight, rule = hidden.detach(), weight.detach(), parse_rule(spec)
    chunk = Route.of(rule, hidden.element_size()).chunk_rows(plan.n, plan.v, plan.chunk_bytes)
    chunks = [slice(a, min(a + chunk, plan.n)) for a in range(0, plan.n, chunk)]
    selection = selection_plan(rule)
    buf = torch.empty(chunk, plan.v, device=plan.device, dtype=hidden.dtype)
    threshold = torch.empty(plan.n, device=plan.device, dtype=torch.float32)
    row_max = torch.empty_like(threshold)
    undecided = torch.zeros(plan.n, device=plan.device, dtype=torch.bool)

    def call(mode: str, seen: list[tuple[int, int]] | None = None) -> None:
        for rows in chunks:
            z = buf[: rows.stop - rows.start]
            torch.mm(hidden[rows], weight.t(), out=z)
            t, m = threshold[rows], row_max[rows]
            kw = {"batch": dict(undecided=undecided[rows]), "no_read": dict(fallback=False)}.get(mode, {})
            out, _ = select_thresholds(z, selection, t, m, **kw)
            if seen is not None:
                seen.append((int(out.sum()), int(undecided[rows].sum())))

    res = {f"{mode}_ms": mean_ms(plan, lambda mode=mode: call(mode)) for mode in ("read", "no_read", "batch")}
    seen: list[tuple[int, int]] = []  # the batch's flagged and undecided rows a chunk, from one more call, untimed
    call("batch", seen)
    res.update(chunks=len(chunks), chunk_rows=chunk, batch_rows=math.ceil(chunk / BATCH_DIVISOR),
               flagged_max=max(f for f, _ in seen), flagged_total=sum(f for f, _ in seen),
               undecided_max=max(u for _, u in seen))  # fmt: skip
    res["read_cost_ms"] = round(res["read_ms"] - res["no_read_ms"], 3)
    res["batch_cost_ms"] = round(res["batch_ms"] - res["no_read_ms"], 3)
    return res


def idle_gaps(events: list[dict], min_us: float = 50.0, top: int = 12) -> dict:
    """The GPU's idle time inside one profiled call, from a chrome trace's ``events``: the span from the first
    kernel's start to the last one's end, the time some kernel (or memset) ran, their difference (``idle_us``, the
    sum of the gaps between kernels), and the longest gaps of at least ``min_us`` with the host ops that overlap each
    (a sync, a launch, Python). No kernels (a CPU): every field zero."""
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in ("kernel", "gpu_memset"))
    if not kernels:
        return {"kernels": 0, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime") and "dur" in e]
    busy, gaps, end = 0.0, [], kernels[0][0]
    for start, stop in kernels:
        if start > end:
            gaps.append((start - end, end, start))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - kernels[0][0]
    longest = []
    for length, a, b in sorted(gaps, reverse=True)[:top]:
        if length < min_us:
            break
        names = list(dict.fromkeys(e["name"][:60] for e in host if e["ts"] < b and e["ts"] + e["dur"] > a))
        longest.append({"us": round(length, 1), "at_us": round(a - kernels[0][0], 1), "host": names[:8]})
    return {"kernels": len(kernels), "span_us": round(span, 1), "busy_us": round(busy, 1),
            "idle_us": round(span - busy, 1), "gaps": longest}  # fmt: skip


# ---------------------------------------------------------------------------------------------- checks and report

IDLE_FIELDS = ("kernels", "span_us", "busy_us", "idle_us", "gaps")


def section_problems(name: str, value) -> list[str]:
    """What the results of section ``name`` lack: nothing recorded, a row that neither ran nor said why, a fused row
    without the backward that ran, a trace without its idle fields. Empty: the section recorded what it should (or
    said why not)."""
    if isinstance(value, dict) and "skipped" in value:
        return []
    if name in ("gate", "topk_sweep", "lm_table"):
        if not isinstance(value, list) or not value:
            return [f"{name}: no rows"]
        problems = [f"{name}: row {i} neither ran nor says why: {r}" for i, r in enumerate(value)
                    if not {"ms", "error", "skipped"} & set(r)]  # fmt: skip
        problems += [f"{name}: fused row {i} does not say which backward ran: {r}" for i, r in enumerate(value)
                     if "forced" in r and "ms" in r and not r.get("backward")]  # fmt: skip
        if not any("ms" in r for r in value if "forced" in r) and not all("skipped" in r for r in value):
            problems.append(f"{name}: no fused row was timed")
        return problems
    if name == "compact":
        needed = ("fold_none_ms", "fold_min_p_ms", "fold_min_p_pool_ms", "pack_ms")
        missing = [key for key in needed if key not in (value or {})]
        if not any(str(key).startswith("compact_block") for key in value or {}):
            missing.append("compact_block*_ms")
        return [f"compact: missing {missing}"] if missing else []
    if name == "fallback":
        if not isinstance(value, list) or not value:
            return ["fallback: no rows"]
        needed = ("read_ms", "no_read_ms", "batch_ms", "flagged_max", "batch_rows", "undecided_max")
        return [f"fallback: row {i} lacks {[k for k in needed if k not in r]}: {r}" for i, r in enumerate(value)
                if not {"error", "skipped"} & set(r) and not all(k in r for k in needed)]  # fmt: skip
    if name == "trace":
        if not isinstance(value, dict) or not value:
            return ["trace: no traces"]
        problems = []
        for trace_name, res in value.items():
            if "skipped" in res:
                continue
            missing = [key for key in IDLE_FIELDS if key not in res.get("idle", {})]
            if "error" in res or missing or not res.get("top") or not res.get("backward"):
                problems.append(f"trace {trace_name}: {res.get('error') or f'missing idle {missing}, top or backward'}")
        return problems
    return []


def markdown(results: dict) -> list[str]:
    """The plan's tables: one line per timed row (with its ratio to trl and the floor of its section and profile),
    the compaction micro-benchmark and the traces' idle time."""
    lines = []
    rows = [r for name in ("gate", "topk_sweep", "lm_table") for r in results.get(name) or [] if isinstance(r, dict)]
    if rows:
        lines += ["", "| section | logits | rule | variant | forced | backward ran | ms | / trl | / floor | kept "
                  "(median) | rereads, dense fallbacks / step |", "|---|---|---|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    refs = {(r["section"], r["profile"], r["variant"]): r.get("ms") for r in rows if r["variant"] in ("trl", "floor")}
    for r in rows:
        ms = r.get("ms")
        ratio = lambda ref, ms=ms: f"{ms / ref:.2f}" if ms and ref else ""  # noqa: E731
        what = ms if ms is not None else (r.get("error") or r.get("skipped", ""))[:70]
        variant = r["variant"] + (f" ({r['implementation']})" if r.get("implementation") else "")
        fallbacks = (f"{r['reread_fallback_chunks_per_step']:g}, {r['dense_fallback_chunks_per_step']:g}"
                     if "reread_fallback_chunks_per_step" in r else "")  # fmt: skip
        lines.append(
            f"| {r['section']} | {r['profile']} | {r['rule']} | {variant} | {r.get('forced', '')} | "
            f"{r.get('backward', '')} | {what} | {ratio(refs.get((r['section'], r['profile'], 'trl')))} | "
            f"{ratio(refs.get((r['section'], r['profile'], 'floor')))} | {r.get('kept', {}).get('median', '')} | "
            f"{fallbacks} |"
        )
    comp = results.get("compact")
    if isinstance(comp, dict) and "skipped" not in comp:
        lines += ["", "Compaction micro-benchmark (" + ", ".join(f"{k} {v}" for k, v in comp.items() if k != "gb_s")
                  + ")"]  # fmt: skip
    for r in results.get("fallback") or []:
        if isinstance(r, dict) and "read_ms" in r:
            lines.append(
                f"- fallback {r['profile']} {r['rule']}: read {r['read_ms']} ms, no read {r['no_read_ms']} ms, batch "
                f"{r['batch_ms']} ms a call ({r['chunks']} chunks of {r['chunk_rows']} rows; rows left to the rule's "
                f"code: at most {r['flagged_max']} a chunk, the batch takes {r['batch_rows']}, at most "
                f"{r['undecided_max']} past it)"
            )
    for name, res in (results.get("trace") or {}).items():
        idle = res.get("idle", {})
        lines.append(
            f"- trace {name}: "
            + (
                f"{idle.get('kernels')} kernels, span {idle.get('span_us')} us, idle {idle.get('idle_us')} us, "
                f"backward {res.get('backward')}; longest gaps {[g['us'] for g in idle.get('gaps', [])][:5]}"
                if idle
                else str(res.get("error") or res.get("skipped"))
            )
        )
    return lines
