"""Precision arms: the training side scoring the same sampled tokens in several precisions, each against the rollout
side and against itself, with its scoring time beside.

A trainer's share of the mismatch depends on the precision it scores in: verl issue 6280 found fp16 scoring to bring
the share of importance ratios outside ``[0.9, 1.1]`` to 0.00 % on 1.5B-1.7B models at 0.93-0.99x the bf16 time, and
an fp32 LM head to take it from 8.0 % to 1.5 %. The arms (:data:`PRECISION_ARMS`) score the tokens the comparison
scored (`DiagnoseResult.sequences`) again, the model's weights cast from one load (as the comparison's sides):

- ``bf16``, ``fp16``, ``fp32``: the whole forward with the weights in that dtype;
- ``bf16+fp32_head``: the bf16 model with its LM head run as trl's ``cast_lm_head_to_fp32`` runs it,
  ``logits = linear(h.float(), W.float(), b.float())``: the hidden states and the head's (bf16) weights upcast and
  the head's matmul and the logits in fp32; the rest of the forward in bf16.

Each arm's logits are divided by the temperature and log-softmaxed in float64, as the comparison's. Per scored token
``y``, ``p = pi_arm(y)`` and:

- ``vs_rollout``: ``log r = log pi_arm(y) - log mu(y)``, ``mu`` the rollout side (the comparison's ``rollout_logp``,
  the engine's reported log-probability in ``scripts/measure_precision_arms.py``), with the metrics of a batch-shape
  pair (:func:`~trl_integration.lab.batch_shape.shape_pair`): ``k3_kl = mean (r - log r - 1)``, ``abs_diff_mean`` and
  ``abs_diff_max`` of ``|log r|``, ``frac_ratio_outside_0.9_1.1``, ``frac_ratio_outside_0.8_1.25``,
  ``frac_identical``, per-bucket ``abs_diff_mean``/``diff_mean`` and, with a rule, the shares below the cut of the
  arm's safe set (``rule``);
- ``vs_itself``: the batch-shape control (:func:`~trl_integration.lab.batch_shape.batch_shape_control`) run in the
  arm: its pairs ``micro_batch_1_vs_n`` and ``padded_vs_packed``, the arm's own noise under a change of batch shape;
- ``seconds``: the wall time of the arm's scoring forwards, ``time.perf_counter()`` around each forward of the
  ``vs_rollout`` scoring (the sequences in right-padded batches of ``batch_size``, ``use_cache=False``, explicit
  positions, as a trainer's micro-batches), summed; the float64 log-softmax, the casts of the weights and one untimed
  warm-up forward (the first sequence, which builds the low-precision kernels' one-time state) are not counted; on
  CUDA the device is synchronised before each clock read. ``n_forwards`` counts them.

An fp16 forward can overflow: the tokens whose arm log-probability is not finite are counted (``n_nonfinite``) and
left out of ``vs_rollout``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from safevocab.mismatch import DEFAULT_BUCKETS
from safevocab.rules import NoPruning, SafeVocabRule, parse_rule
from trl_integration.lab.bands import RATIO_BANDS, band_name
from trl_integration.lab.batch_shape import SHAPE_PAIRS, _padded, _score, batch_shape_control, shape_pair
from trl_integration.lab.sides import model_in

__all__ = [
    "PRECISION_ARMS",
    "ARM_DTYPES",
    "parse_precision_arms",
    "fp32_lm_head",
    "run_precision_arms",
    "precision_arm_rows",
    "plot_precision_arms",
]

#: The arms, in the order they run and print.
PRECISION_ARMS: tuple[str, ...] = ("bf16", "fp16", "fp32", "bf16+fp32_head")

#: Each arm's weight dtype and whether its LM head runs in fp32.
ARM_DTYPES: dict[str, tuple[torch.dtype, bool]] = {
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "fp32": (torch.float32, False),
    "bf16+fp32_head": (torch.bfloat16, True),
}

Sequences = Sequence[tuple[torch.Tensor, torch.Tensor]]


def parse_precision_arms(values: Sequence[str] | str | None) -> tuple[str, ...]:
    """The arms of ``--precision_arms`` (``"all"``: the four), in the order given, each once (an arm ``all`` already
    names counts once; a value given twice is refused); ``()`` for ``None``.

    Raises:
        ValueError: one line naming ``--precision_arms``, the value and the accepted values.
    """
    if values is None:
        return ()
    values = [values] if isinstance(values, str) else list(values)
    arms: list[str] = []
    for position, value in enumerate(values):
        if value not in (*PRECISION_ARMS, "all"):
            raise ValueError(
                f"--precision_arms {value!r} is not accepted: accepted one or more of {', '.join(PRECISION_ARMS)}, "
                "or all"
            )
        if value in values[:position]:
            raise ValueError(
                f"--precision_arms {value!r} is given twice: accepted each of {', '.join(PRECISION_ARMS)} once, or all"
            )
        arms += [arm for arm in (PRECISION_ARMS if value == "all" else (value,)) if arm not in arms]
    if not arms:
        raise ValueError(f"--precision_arms needs a value: accepted one or more of {', '.join(PRECISION_ARMS)}, or all")
    return tuple(arms)


@contextmanager
def fp32_lm_head(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """While open, ``model``'s LM head runs as trl's ``cast_lm_head_to_fp32`` runs it: ``linear(h.float(),
    W.float(), b.float())`` (the weights keep their dtype: a tied head still feeds the embedding its own values);
    put back on exit.

    Raises:
        ValueError: the model has no LM head with a ``weight`` (``get_output_embeddings()``).
    """
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(
            "--precision_arms bf16+fp32_head: this model has no LM head with a weight (get_output_embeddings()): "
            f"accepted a causal LM with one, or the arms {', '.join(a for a in PRECISION_ARMS if '+' not in a)}"
        )
    had_own = "forward" in vars(head)
    own = vars(head).get("forward")

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        bias = getattr(head, "bias", None)
        return torch.nn.functional.linear(
            hidden_states.float(), head.weight.float(), None if bias is None else bias.float()
        )

    head.forward = forward
    try:
        yield model
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _score_timed(model, seqs: Sequences, *, batch_size: int, temperature: float, rule, pad_token_id: int):
    """Float64 ``log pi(y)`` (and, with a rule, ``y`` in the safe set) of the scored targets in ``seqs`` order, from
    right-padded batches of ``batch_size``; and the summed wall seconds and number of the forwards."""
    device = next(model.parameters()).device
    _padded(model, list(seqs[:1]), device, pad_token_id)  # warm-up, untimed (the module docstring)
    logp, kept, seconds, n_forwards = [], [], 0.0, 0
    for start in range(0, len(seqs), batch_size):
        chunk = list(seqs[start : start + batch_size])
        _sync(device)
        tic = time.perf_counter()
        logits = _padded(model, chunk, device, pad_token_id)
        _sync(device)
        seconds += time.perf_counter() - tic
        n_forwards += 1
        chunk_logp, chunk_kept = _score(logits, chunk, temperature, rule)
        logp.append(chunk_logp)
        if chunk_kept is not None:
            kept.append(chunk_kept)
    return torch.cat(logp), torch.cat(kept) if kept else None, seconds, n_forwards


def run_precision_arms(
    model: torch.nn.Module,
    sequences: Sequences,
    rollout_logp: torch.Tensor,
    *,
    arms: Sequence[str] = PRECISION_ARMS,
    temperature: float = 1.0,
    rule: SafeVocabRule | str | None = None,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    batch_size: int = 16,
    max_tokens: int = 8192,
    pad_token_id: int = 0,
) -> dict[str, dict]:
    """Score ``sequences`` in each arm and compare it with the rollout side and with itself (the module docstring).

    Args:
        model: the transformers causal LM (not modified: a copy per dtype where its weights are in another).
        sequences: ``(ids, counted)`` per sequence, as `DiagnoseResult.sequences`.
        rollout_logp: ``[T]`` the rollout side's log-probability of each scored token, in ``sequences`` order (as
            `DiagnoseResult.tokens["rollout_logp"]`).
        arms: names of :data:`PRECISION_ARMS` (`parse_precision_arms`).
        temperature: divides the logits (> 0).
        rule: the safe-vocabulary rule of the "below the cut" shares (``None``/``"none"``: no ``rule`` block).
        buckets: inner edges of the probability buckets.
        batch_size: sequences per timed scoring forward.
        max_tokens: the self-comparison's batch of ``N`` (`batch_shape_control`'s ``max_tokens``).
        pad_token_id: the id the padded batches pad with (masked out).

    Returns:
        ``{arm: {"dtype", "lm_head_dtype", "seconds", "n_forwards", "batch_size", "n_tokens", "n_nonfinite",
        "vs_rollout", "vs_itself"}}``, ``vs_rollout`` a dict of `shape_pair` (``{"skipped": reason}`` when no token is
        finite) and ``vs_itself`` ``{"n_sequences", "n_tokens", "micro_batch_1_vs_n", "padded_vs_packed"}``.

    Raises:
        ValueError: an unknown arm, no sequence, ``rollout_logp`` of another length than the scored tokens,
            ``batch_size < 1`` or a temperature that is not > 0.
    """
    arms = parse_precision_arms(list(arms))
    if not sequences:
        raise ValueError("precision arms: no sequence to score")
    n_tokens = sum(int(counted.sum()) for _, counted in sequences)
    if rollout_logp.numel() != n_tokens:
        raise ValueError(
            f"rollout_logp has {rollout_logp.numel()} log-probabilities for {n_tokens} scored tokens: accepted one "
            "per scored token, in the order of sequences"
        )
    if batch_size < 1 or not temperature > 0:
        raise ValueError(f"batch_size={batch_size!r}, temperature={temperature!r}: accepted batch_size >= 1 and > 0")
    rule_obj = parse_rule(rule)
    rule_obj = None if isinstance(rule_obj, NoPruning) else rule_obj
    name = None if rule_obj is None else str(rule_obj)
    cache: dict = {}
    results: dict[str, dict] = {}
    for arm in arms:
        dtype, head32 = ARM_DTYPES[arm]
        side = model_in(model, dtype, cache)
        with fp32_lm_head(side) if head32 else _as_is(side):
            logp, kept, seconds, n_forwards = _score_timed(
                side, sequences, batch_size=batch_size, temperature=temperature, rule=rule_obj,
                pad_token_id=pad_token_id,
            )  # fmt: skip
            control = batch_shape_control(
                side, sequences, dtype=dtype, temperature=temperature, rule=rule_obj, buckets=buckets,
                max_tokens=max_tokens, pad_token_id=pad_token_id,
            )  # fmt: skip
        finite = torch.isfinite(logp)
        if bool(finite.any()):
            vs_rollout = shape_pair(
                logp[finite], rollout_logp.double()[finite], None if kept is None else kept[finite], buckets, name
            )
        else:
            vs_rollout = {"skipped": f"no finite log-probability in {arm} (every forward overflowed)"}
        results[arm] = {
            "dtype": str(dtype).replace("torch.", ""),
            "lm_head_dtype": "float32" if head32 else str(dtype).replace("torch.", ""),
            "seconds": seconds,
            "n_forwards": n_forwards,
            "batch_size": batch_size,
            "n_tokens": n_tokens,
            "n_nonfinite": int((~finite).sum()),
            "vs_rollout": vs_rollout,
            "vs_itself": {k: control[k] for k in ("n_sequences", "n_tokens", *SHAPE_PAIRS)},
        }
    return results


@contextmanager
def _as_is(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    yield model


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _pair_text(pair: dict) -> str:
    if pair.get("skipped"):
        return f"skipped ({pair['skipped']})"
    inner = band_name(*RATIO_BANDS[0])
    return f"k3 {_num(pair['k3_kl'])}, {_pct(pair[f'frac_ratio_outside_{inner}'])} outside"


def precision_arm_rows(summary: dict) -> list[tuple[str, str]]:
    """The console rows of ``summary["precision_arms"]``: one per arm (none when the arms did not run)."""
    arms = summary.get("precision_arms")
    if not arms:
        return []
    lo, hi = RATIO_BANDS[0]
    rows = [
        (
            "precision arms",
            f"the trainer re-scores the same tokens per arm; vs rollout ({summary.get('rollout_dtype', 'rollout')}) "
            f"and vs itself (micro-batch 1 vs N / padded vs packed): k3 and the share of r outside [{lo:g}, {hi:g}]; "
            "scoring wall time",
        )
    ]
    for arm, data in arms.items():
        itself = " / ".join(_pair_text(data["vs_itself"][key]) for key in SHAPE_PAIRS)
        overflow = f"; {data['n_nonfinite']} tokens not finite" if data["n_nonfinite"] else ""
        rows.append((
            f"  {arm}",
            f"vs rollout {_pair_text(data['vs_rollout'])}; vs itself {itself}; {data['seconds']:.3g} s "
            f"({data['n_forwards']} forwards){overflow}",
        ))  # fmt: skip
    return rows


def plot_precision_arms(summary: dict, path: str | os.PathLike) -> None:
    """``precision_arms.png``: per arm, k3 against the rollout side and against itself (the larger of its two batch
    -shape pairs) against the arm's scoring seconds (log k3; an exact 0 is drawn at the floor and marked "0")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["precision_arms"]

    def self_k3(data: dict) -> float | None:
        values = [data["vs_itself"][k].get("k3_kl") for k in SHAPE_PAIRS]
        values = [v for v in values if v is not None]
        return max(values) if values else None

    points = [(arm, d["seconds"], d["vs_rollout"].get("k3_kl"), self_k3(d)) for arm, d in arms.items()]
    positive = [v for _, _, a, b in points for v in (a, b) if v]
    floor = min(positive) / 10 if positive else 1e-12
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for i, (arm, seconds, k3_rollout, k3_self) in enumerate(points):
        for value, marker, what in ((k3_rollout, "o", "vs rollout"), (k3_self, "s", "vs itself")):
            if value is None:
                continue
            ax.scatter(
                [seconds], [max(value, floor)], color=f"C{i}", marker=marker, s=50,
                facecolors=f"C{i}" if marker == "o" else "none", label=f"{arm} {what}",
            )  # fmt: skip
            if value == 0:
                ax.annotate("0", (seconds, floor), xytext=(5, 3), textcoords="offset points", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xlabel("scoring wall seconds (the arm's forwards, time.perf_counter)")
    ax.set_ylabel("k3 = mean (r − log r − 1)")
    ax.set_title(
        f"precision arms: k3 vs the rollout ({summary.get('rollout_dtype', 'rollout')}, filled) and vs itself "
        "(max over batch-shape pairs, hollow)",
        fontsize=8,
    )
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
