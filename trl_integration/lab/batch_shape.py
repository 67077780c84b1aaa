"""The batch-shape control: how much the training side disagrees with itself when only the batch shape changes.

Part of what ``safevocab diagnose`` (and a trainer's ``mismatch/*`` metrics) report as engine mismatch is not the
engine: the trainer's own log-probability of a token depends on the shape of the batch it is scored in (GEMM blocking
by the number of rows, attention over padded or packed rows, the accumulation order of low-precision kernels). trl
issue 6789 (Qwen2.5-0.5B, 3,916 tokens) found 8.0 % of the importance ratios outside ``[0.9, 1.1]`` between a bf16
trainer scoring the same tokens in chunks of 1 and of 8, with no engine at all (7.5 % for vLLM against it).

The control scores the tokens the comparison scored (`DiagnoseResult.sequences`) again on the training side (its
dtype and temperature; no noise, no rounding), with explicit positions and ``use_cache=False`` as in training, under
three shapes:

- ``micro_batch_1``: each sequence alone, ``[1, L_i]``, no padding;
- ``batch_n``: the ``N`` sequences in one batch, right-padded to the longest, ``[N, L_max]``, with the attention mask;
- ``packed``: the ``N`` sequences in one row ``[1, sum_i L_i]``, positions restarting at 0 for each sequence and no
  attention mask (transformers then builds a block-diagonal causal mask; flash-attention runs the row as varlen).
  Only where the model isolates packed sequences: a probe packs two sequences, changes the first one and checks that
  the second one's logits do not change (bit for bit; within 4x the run-to-run noise of non-deterministic kernels).
  Otherwise the pair is skipped, with the reason in ``"skipped"``.

Two pairs ``A vs B`` are compared: ``micro_batch_1_vs_n`` (A: micro-batch 1, B: the batch of ``N``) and
``padded_vs_packed`` (A: the batch of ``N``, B: packed). A plays the comparison's training side, B its rollout side:
per scored token ``log r = log pi_A(y) - log pi_B(y)``, ``r = exp(log r)``, ``p = pi_A(y)``, and per pair:

- ``k3_kl = mean (r - log r - 1)``; ``abs_diff_mean`` and ``abs_diff_max`` of ``|log r|``;
- ``frac_ratio_outside_0.9_1.1`` and ``frac_ratio_outside_0.8_1.25`` (:mod:`trl_integration.lab.bands`);
- ``frac_identical = mean 1[log pi_A(y) == log pi_B(y)]`` (bit for bit; 1: the two shapes agree exactly here);
- ``buckets``: per bucket of ``p``: ``n``, ``abs_diff_mean = mean |log r|`` and ``diff_mean = mean log r``;
- with a rule, ``rule``: ``out_of_set_frac`` (the share of the tokens outside A's safe set, below the cut),
  ``k3_share_outside = sum_outside k3 / sum k3`` and the shares of :func:`~trl_integration.lab.bands.cut_shares`.

``N`` is every scored sequence, or the first ones whose padded batch holds at most ``max_tokens`` tokens (the
command passes ``--batch_size x --max_length``, the largest batch the comparison itself runs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from safevocab.mismatch import DEFAULT_BUCKETS, bucket_mismatch
from safevocab.mismatch.formulas import k3_terms
from safevocab.rules import NoPruning, SafeVocabRule, parse_rule
from trl_integration.lab.bands import RATIO_BANDS, band_name, cut_shares, ratio_band_fracs
from trl_integration.lab.sides import model_in

__all__ = ["SHAPE_PAIRS", "batch_shape_control", "shape_pair", "batch_shape_rows", "plot_batch_shape"]

#: The compared pairs of batch shapes, as named in ``summary["batch_shape"]``.
SHAPE_PAIRS = ("micro_batch_1_vs_n", "padded_vs_packed")

Sequences = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _forward(model, ids: torch.Tensor, attn: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits


def _micro_batch(model, seqs: Sequences, device) -> list[torch.Tensor]:
    out = []
    for ids, _ in seqs:
        n = ids.numel()
        ones = torch.ones(1, n, dtype=torch.long, device=device)
        out.append(_forward(model, ids[None].to(device), ones, torch.arange(n, device=device)[None])[0])
    return out


def _padded(model, seqs: Sequences, device, pad_token_id: int) -> list[torch.Tensor]:
    width = max(ids.numel() for ids, _ in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (seq, _) in enumerate(seqs):
        ids[i, : seq.numel()], attn[i, : seq.numel()] = seq, 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = _forward(model, ids.to(device), attn.to(device), pos.to(device))
    return [logits[i, : seq.numel()] for i, (seq, _) in enumerate(seqs)]


def _packed_row(model, parts: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    ids = torch.cat(list(parts))[None].to(device)
    pos = torch.cat([torch.arange(part.numel()) for part in parts])[None].to(device)
    return list(_forward(model, ids, None, pos)[0].split([part.numel() for part in parts]))


def _packing_probe(model, seqs: Sequences, device) -> str | None:
    """``None`` when ``model`` isolates the sequences of a packed row, else why the packed shape is skipped."""
    first, second = seqs[0][0], seqs[-1][0]
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    changed = (first + 1) % vocab if vocab > 1 else first.flip(0)
    try:
        base, other, again = (_packed_row(model, [head, second], device)[1] for head in (first, changed, first))
    except (TypeError, ValueError, RuntimeError) as err:
        return f"a packed forward (no attention mask, positions restarting per sequence) failed: {err}"
    drift, noise = float((base - other).abs().max()), float((base - again).abs().max())
    if drift == 0.0 or (noise > 0.0 and drift <= 4 * noise):
        return None
    impl = getattr(config, "_attn_implementation", None)
    return (
        f"this model's attention ({impl}) does not isolate packed sequences: changing the first of two packed "
        f"sequences moves the second one's logits by up to {drift:.3g}"
    )


def _score(logits: list[torch.Tensor], seqs: Sequences, temperature: float, rule: SafeVocabRule | None):
    """Float64 ``log pi(y)`` of the scored targets (in ``seqs`` order) and, with a rule, whether ``y`` is kept."""
    from safevocab import safe_log_softmax

    z_all = torch.cat([row[:-1][counted.to(row.device)] for row, (_, counted) in zip(logits, seqs)])
    y_all = torch.cat([ids[1:][counted] for ids, counted in seqs]).to(z_all.device)
    logp, kept = [], []
    step = max(1, 2**22 // max(1, z_all.shape[-1]))  # float64 elements per chunk, as the comparison's
    for i in range(0, z_all.shape[0], step):
        z, y = z_all[i : i + step].double() / temperature, y_all[i : i + step]
        logp.append(z.log_softmax(-1).gather(-1, y[:, None])[:, 0].cpu())
        if rule is not None:
            kept.append(safe_log_softmax(z, y, rule).in_safe.cpu())
    return torch.cat(logp), torch.cat(kept) if rule is not None else None


def _none_if_nan(x) -> float | None:
    v = float(x)
    return None if v != v else v


def shape_pair(
    logp_a: torch.Tensor,
    logp_b: torch.Tensor,
    in_set_a: torch.Tensor | None = None,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    rule: str | None = None,
) -> dict:
    """The metrics of one pair ``A vs B`` (see the module docstring) from the float64 ``[T]`` log-probabilities of
    the same tokens under shape A and shape B, and (with a rule) whether each token is in A's safe set."""
    log_r = logp_a.double() - logp_b.double()
    if log_r.numel() == 0:
        raise ValueError("shape_pair: no token to compare")
    k3 = k3_terms(log_r)
    b = bucket_mismatch(logp_a[None], logp_b[None], torch.ones(1, log_r.numel(), dtype=torch.bool), buckets)
    pair: dict = {
        "skipped": None,
        "n_tokens": int(log_r.numel()),
        "k3_kl": float(k3.mean()),
        "abs_diff_mean": float(log_r.abs().mean()),
        "abs_diff_max": float(log_r.abs().max()),
        **ratio_band_fracs(log_r),
        "frac_identical": float((logp_a == logp_b).double().mean()),
        "buckets": [
            {
                "name": name,
                "lo": float(b.lo[j]),
                "hi": float(b.hi[j]),
                "n": int(b.count[j]),
                "abs_diff_mean": _none_if_nan(b.abs_diff_mean[j]),
                "diff_mean": _none_if_nan(b.diff_mean[j]),
            }
            for j, name in enumerate(b.names)
        ],  # fmt: skip
        "rule": None,
    }
    if in_set_a is not None:
        out = ~in_set_a.bool()
        total = float(k3.sum())
        pair["rule"] = {
            "rule": rule,
            "out_of_set_frac": float(out.double().mean()),
            "k3_share_outside": float(k3[out].sum()) / total if total else None,
            **cut_shares(log_r, out, logp_a.double().exp(), buckets),
        }
    return pair


def _fitting(sequences: Sequences, max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first sequences whose right-padded batch holds at most ``max_tokens`` tokens (at least one)."""
    n = width = 0
    for ids, _ in sequences:
        width = max(width, ids.numel())
        if n and (n + 1) * width > max_tokens:
            break
        n += 1
    return list(sequences[:n])


def batch_shape_control(
    model: torch.nn.Module,
    sequences: Sequences,
    *,
    dtype: torch.dtype = torch.float32,
    temperature: float = 1.0,
    rule: SafeVocabRule | str | None = None,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    max_tokens: int = 8192,
    pad_token_id: int = 0,
) -> dict:
    """Score ``sequences`` on the training side under the three batch shapes and compare the two pairs.

    Args:
        model: the transformers causal LM (not modified: a copy in ``dtype`` where its weights are in another).
        sequences: ``(ids, counted)`` per sequence, as `DiagnoseResult.sequences`: the token ids without padding and
            which targets ``ids[1:]`` are scored.
        dtype: the training side's dtype.
        temperature: divides the logits (> 0).
        rule: the safe-vocabulary rule of the "below the cut" shares (``None``/``"none"``: no ``rule`` block).
        buckets: inner edges of the probability buckets.
        max_tokens: the batch of ``N`` holds the first sequences that fit in this many padded tokens.
        pad_token_id: the id the padded batch pads with (masked out).

    Returns:
        ``{"dtype", "temperature", "n_sequences", "n_sequences_total", "n_tokens", "shapes",
        "micro_batch_1_vs_n", "padded_vs_packed"}``, each pair a dict of `shape_pair` or ``{"skipped": reason}``.

    Raises:
        ValueError: no sequence, ``max_tokens < 1`` or a temperature that is not > 0.
    """
    if not sequences:
        raise ValueError("batch-shape control: no sequence to score")
    if max_tokens < 1 or not temperature > 0:
        raise ValueError(f"max_tokens={max_tokens!r}, temperature={temperature!r}: accepted max_tokens >= 1 and > 0")
    rule_obj = parse_rule(rule)
    rule_obj = None if isinstance(rule_obj, NoPruning) else rule_obj
    train = model_in(model, dtype, {})
    device = next(train.parameters()).device
    seqs = _fitting(sequences, max_tokens)
    lengths = [ids.numel() for ids, _ in seqs]
    n_tokens = sum(int(counted.sum()) for _, counted in seqs)
    summary: dict = {
        "dtype": str(dtype).replace("torch.", ""),
        "temperature": float(temperature),
        "n_sequences": len(seqs),
        "n_sequences_total": len(sequences),
        "n_tokens": n_tokens,
        "shapes": {
            "micro_batch_1": f"{len(seqs)} forwards of [1, L] (one sequence each, no padding)",
            "batch_n": f"1 forward of [{len(seqs)}, {max(lengths)}] (right-padded, attention mask)",
            "packed": f"1 forward of [1, {sum(lengths)}] (positions restart per sequence, no attention mask)",
        },
    }
    if n_tokens == 0:
        return {**summary, **{key: {"skipped": "no scored token in these sequences"} for key in SHAPE_PAIRS}}
    name = None if rule_obj is None else str(rule_obj)
    micro = _score(_micro_batch(train, seqs, device), seqs, temperature, rule_obj)
    batch = _score(_padded(train, seqs, device, pad_token_id), seqs, temperature, rule_obj)
    summary["micro_batch_1_vs_n"] = shape_pair(micro[0], batch[0], micro[1], buckets, name)
    reason = _packing_probe(train, seqs, device)
    if reason is None:
        packed = _score(_packed_row(train, [ids for ids, _ in seqs], device), seqs, temperature, rule_obj)
        summary["padded_vs_packed"] = shape_pair(batch[0], packed[0], batch[1], buckets, name)
    else:
        summary["padded_vs_packed"] = {"skipped": reason}
    return summary


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _pair_label(summary: dict, key: str) -> str:
    return f"micro-batch 1 vs {summary['n_sequences']}" if key == SHAPE_PAIRS[0] else "padded vs packed"


def batch_shape_rows(summary: dict) -> list[tuple[str, str]]:
    """The console rows of ``summary["batch_shape"]`` (none when the control did not run)."""
    control = summary.get("batch_shape")
    if not control:
        return []
    bands = ", ".join(f"[{lo:g}, {hi:g}]" for lo, hi in RATIO_BANDS)
    rows = [
        (
            "batch-shape control",
            f"the training side ({control['dtype']}) scores the same {control['n_tokens']} tokens of "
            f"{control['n_sequences']}/{control['n_sequences_total']} sequences under two batch shapes; "
            "log r = log π(first) − log π(second)",
        )
    ]
    for key in SHAPE_PAIRS:
        pair, label = control[key], _pair_label(control, key)
        if pair.get("skipped"):
            rows.append((f"  {label}", f"skipped: {pair['skipped']}"))
            continue
        outside = " / ".join(_pct(pair[f"frac_ratio_outside_{band_name(lo, hi)}"]) for lo, hi in RATIO_BANDS)
        rows.append((
            f"  {label}",
            f"k3 {_num(pair['k3_kl'])}; r outside {bands}: {outside}; |Δ| mean {_num(pair['abs_diff_mean'])} / max "
            f"{_num(pair['abs_diff_max'])}; {_pct(pair['frac_identical'], 1)} bit-identical",
        ))  # fmt: skip
        rows.append(
            ("    mean |Δ| by bucket", ", ".join(f"{_num(r['abs_diff_mean'])} (n={r['n']})" for r in pair["buckets"]))
        )
        rule = pair["rule"]
        if rule:
            where = f"{_pct(rule['out_of_set_frac'], 1)} of the tokens are outside {rule['rule']}'s set"
            if rule["abs_diff_share_outside"] is None:
                rows.append(("    below the cut", f"{where}; no gap to share"))
                continue
            shares = " / ".join(
                _pct(rule[f"ratio_outside_{band_name(lo, hi)}_share_outside"], 1) for lo, hi in RATIO_BANDS
            )
            rows.append((
                "    below the cut",
                f"{where} and carry {_pct(rule['k3_share_outside'], 1)} of the k3 sum, "
                f"{_pct(rule['abs_diff_share_outside'], 1)} of Σ|Δ| and {shares} of the ratios outside {bands}",
            ))  # fmt: skip
    return rows


def plot_batch_shape(summary: dict, path: str | os.PathLike) -> None:
    """``batch_shape.png``: per training-probability bucket, the mean ``|Δ log p|`` of the engine-vs-trainer
    comparison beside each batch-shape pair's (log scale; an exact 0 is drawn at the floor and marked "0")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from trl_integration.lab.figures import mismatch_source

    control, inner = summary["batch_shape"], band_name(*RATIO_BANDS[0])
    series = [(f"engine vs trainer ({mismatch_source(summary)})", summary["buckets"], summary)]
    series += [
        (f"trainer vs itself: {_pair_label(control, key)}", control[key]["buckets"], control[key])
        for key in SHAPE_PAIRS
        if not control[key].get("skipped")
    ]
    names = [r["name"] for r in summary["buckets"]]
    values = [[np.nan if r["abs_diff_mean"] is None else r["abs_diff_mean"] for r in rows] for _, rows, _ in series]
    positive = [v for row in values for v in row if v > 0]
    floor = min(positive) / 10 if positive else 1e-12
    x, width = np.arange(len(names)), 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=110)
    for i, ((label, _, stats), vals) in enumerate(zip(series, values)):
        offset = (i - (len(series) - 1) / 2) * width
        k3 = stats.get("k3_kl", (stats.get("sequence_metrics") or {}).get("k3_kl"))
        label = f"{label}: k3 {_num(k3)}, {_pct(stats[f'frac_ratio_outside_{inner}'])} of r outside [{RATIO_BANDS[0][0]:g}, {RATIO_BANDS[0][1]:g}]"
        ax.bar(x + offset, [max(v, floor) for v in vals], width, color=f"C{i}", label=label, alpha=0.85)
        for xi, v in zip(x, vals):
            if v == 0:
                ax.annotate(
                    "0", (xi + offset, floor), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7
                )
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xticks(x, names, rotation=15, fontsize=8)
    ax.set_xlabel("bucket of the reference probability p (training side; the pair's first shape)")
    ax.set_ylabel("mean |Δ log p|  (nats)")
    ax.set_title(f"engine mismatch against the trainer's own under batch shape ({control['dtype']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
