"""``safevocab diagnose``: measure a model's training–inference mismatch and check it against the exact bound.

Two "engines" score the same tokens by teacher forcing:

- the *training* side: the model in ``--compare``'s first dtype (default ``float32``);
- the *rollout* side: the model in the second dtype (default ``bfloat16``), optionally with an injected logit
  perturbation ``delta`` (``--noise EPS``: ``|delta_i| <= EPS`` on the transformed logits, seeded).

For every scored token ``y`` with training probability ``p = pi(y)`` it records ``log r = log pi(y) - log mu(y)``
and the size of the logit perturbation at that position, ``eps_t = (max_i delta_i - min_i delta_i) / 2``
(`safevocab.mismatch.logit_perturbation_eps`, shift-invariant), and reports:

- ``eps_max``: the largest ``eps_t`` (the empirical ε of the logit gap);
- ``frac_within_bound``: the share of tokens with ``|log r| <= log(p + (1 - p) e^{2 eps})``
  (`safevocab.bounds.logprob_mismatch_bound`) for the reference ``eps``: ``--eps`` if given, else the
  injected ``--noise`` when it is the only source of mismatch (then it must be 100%), else ``eps_max``;
- mean ``|log r|`` and signed ``log r`` by training-probability bucket;
- with ``--rule``: how often the two sides pick different safe sets, and how much the renormalised
  ``log pi_S`` shrinks the mismatch on the tokens both sides keep;
- verl's sequence statistics (k3 KL, chi², log-ppl gap) with each text as a sequence.

It writes ``summary.json`` and two PNG plots into ``--output_dir``. Inputs: ``--input FILE`` (one text per line)
and/or ``--prompts TEXT ...``; by default, problems of the arithmetic task (when ``trl_integration.tasks`` is
installed) or a few built-in sentences. With ``--max_new_tokens N`` the inputs are prompts: the rollout side
samples ``N`` tokens from each (``--num_samples`` times, full distribution, with the noise when given) and only
the sampled tokens are scored.

What it does not include: both sides here are full (teacher-forced) forwards, so the KV-cache and kernel
differences of a real sampler are not part of the measured gap (the trainer's ``mismatch/*`` metrics measure
those); and in sampling mode the rollout side's noise used for scoring is a fresh draw of the same
distribution, not the exact draw used while sampling.

Examples::

    safevocab diagnose --compare float32:bfloat16 --output_dir diag-bf16
    safevocab diagnose --model ./my-model --input texts.txt --noise 0.05 --noise_kind uniform --rule min_p=0.01
    safevocab diagnose --prompts "Once upon a time" --max_new_tokens 64 --num_samples 8
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from safevocab.bounds import logprob_mismatch_bound
from safevocab.mismatch import (
    DEFAULT_BUCKETS,
    bucket_mismatch,
    logit_perturbation_eps,
    mismatch_metrics,
    safe_set_disagreement,
)
from safevocab.rules import NoPruning, parse_rule

__all__ = [
    "DTYPES",
    "DEFAULT_TEXTS",
    "DiagnoseResult",
    "build_parser",
    "parse_compare",
    "default_texts",
    "run_diagnose",
    "write_outputs",
    "main",
]

#: Accepted names of the ``--compare`` precisions.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}

#: Texts scored when no input is given and the arithmetic task is not available.
DEFAULT_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning fine-tunes a language model with rewards.",
    "1+1=2, 2+2=4, 3+3=6, 4+4=8.",
    "The training engine and the inference engine disagree in the tail.",
    "Once upon a time there was a small model that liked to count.",
    "Safe vocabularies drop the extreme tail of the next-token distribution.",
)

#: Default rule of ``--rule`` (the trainer's default ``safe_vocab_rule``).
DEFAULT_RULE = "min_p=0.001"

#: Absolute slack (nats) in the bound checks, for float64 rounding of the two log-softmaxes.
BOUND_TOLERANCE = 1e-9

_NOISE_KINDS = ("uniform", "clipped_gaussian")


# ----------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------


def parse_compare(spec: str) -> tuple[torch.dtype, torch.dtype]:
    """``"float32:bfloat16"`` -> ``(torch.float32, torch.bfloat16)`` (training side, rollout side).

    Raises:
        ValueError: on a malformed spec or an unknown dtype name.
    """
    parts = [s.strip().lower() for s in str(spec).split(":")]
    if len(parts) != 2 or any(p not in DTYPES for p in parts):
        raise ValueError(
            f"--compare {spec!r} is not accepted: accepted TRAIN:ROLLOUT with each one of "
            f"{sorted(set(DTYPES))}, e.g. float32:bfloat16"
        )
    return DTYPES[parts[0]], DTYPES[parts[1]]


def default_texts(n: int = 64) -> list[str]:
    """The default inputs: ``n`` arithmetic problems with their answers (``"37+48=85"``) when
    ``trl_integration.tasks`` is available, else `DEFAULT_TEXTS`."""
    try:
        from trl_integration.tasks.arithmetic import sample_problems
    except ImportError:
        return list(DEFAULT_TEXTS)
    import random

    return [p + a for p, a in sample_problems(n, random.Random("safevocab-diagnose"), "test")]


def _read_inputs(args) -> list[str]:
    texts: list[str] = []
    if args.input:
        path = Path(args.input)
        if not path.is_file():
            raise ValueError(f"--input {args.input!r}: no such file")
        texts += [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts += list(args.prompts or [])
    if not texts:
        if args.input:
            raise ValueError(f"--input {args.input!r} has no non-empty line")
        texts = default_texts()
    return texts


def _resolve_model(model: str | None) -> str:
    if model:
        if not Path(model).exists():
            raise ValueError(
                f"--model {model!r}: no such directory (pass a local folder saved with save_pretrained; "
                "diagnose does not download)"
            )
        return str(model)
    try:
        from trl_integration.assets import tiny_model_path

        return str(tiny_model_path())
    except (ImportError, FileNotFoundError) as err:
        raise ValueError(f"no --model given and the bundled tiny model is not available ({err}): pass --model PATH")


# ----------------------------------------------------------------------------------------------------
# scoring
# ----------------------------------------------------------------------------------------------------


@dataclass
class DiagnoseResult:
    """Result of `run_diagnose`.

    Attributes:
        summary: the JSON-serialisable summary (what ``summary.json`` holds).
        tokens: per scored token, 1-D float64/bool CPU tensors: ``p`` (training probability), ``train_logp``,
            ``rollout_logp``, ``log_r`` (``train - rollout``), ``eps_t`` and ``bound`` (at the reference eps);
            with a rule also ``kept`` (both sides keep the token), ``same_set``, ``pruned_log_r``.
    """

    summary: dict
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)


def _forward_logits(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    # Explicit positions: correct under left padding (sampling mode) as well as right padding.
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn, position_ids=pos).logits


def _model_in(base, dtype: torch.dtype, cache: dict):
    """The model with its floating parameters in ``dtype`` (a copy unless they already are). Buffers keep their
    dtype, as ``from_pretrained(..., dtype=dtype)`` leaves them (e.g. RoPE's fp32 ``inv_freq``)."""
    if dtype not in cache:
        params = [p for p in base.parameters() if p.is_floating_point()]
        if all(p.dtype == dtype for p in params):
            model = base
        else:
            model = copy.deepcopy(base)
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        cache[dtype] = model.eval()
    return cache[dtype]


def _sample(model, tokenizer, prompts, *, max_new_tokens, num_samples, temperature, noise, noise_kind, seed, device):
    """Sample continuations on the rollout side; returns ``(ids, attn, counted)`` with ``counted`` marking the
    sampled tokens as targets (``[B, L-1]``, aligned with ``ids[:, 1:]``)."""
    from transformers import LogitsProcessorList

    from trl_integration.rollout import LogitNoiseProcessor

    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
    processors = LogitsProcessorList()
    if noise > 0:
        processors.append(LogitNoiseProcessor(noise, noise_kind, seed=seed, temperature=temperature))
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            min_p=None,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            logits_processor=processors,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    prompt_len = enc["input_ids"].shape[1]
    prompt_mask = enc["attention_mask"].repeat_interleave(num_samples, dim=0)
    gen = out[:, prompt_len:]
    if tokenizer.eos_token_id is not None:
        is_eos = gen == tokenizer.eos_token_id
        # keep tokens up to and including the first EOS
        after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        gen_mask = ~after
    else:
        gen_mask = torch.ones_like(gen, dtype=torch.bool)
    attn = torch.cat([prompt_mask.bool(), gen_mask], dim=1).long()
    counted = torch.zeros(out.shape[0], out.shape[1] - 1, dtype=torch.bool, device=out.device)
    counted[:, prompt_len - 1 :] = gen_mask
    return out, attn, counted


def _batches(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(n, start + size)


def run_diagnose(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    compare: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.bfloat16),
    noise: float = 0.0,
    noise_kind: str = "uniform",
    seed: int = 0,
    temperature: float = 1.0,
    rule: str | None = DEFAULT_RULE,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    eps: float | None = None,
    batch_size: int = 16,
    max_length: int = 512,
    max_new_tokens: int = 0,
    num_samples: int = 1,
    progress: bool = True,
) -> DiagnoseResult:
    """Score ``texts`` on the training and rollout sides and summarise the mismatch (the command's engine).

    Args:
        model: a transformers causal LM (its weights are copied for each dtype of ``compare``; not modified).
        tokenizer: its tokenizer (a transformers ``PreTrainedTokenizerBase``).
        texts: texts to score by teacher forcing (or prompts, with ``max_new_tokens > 0``).
        compare: ``(training dtype, rollout dtype)``.
        noise: hard bound ε of the injected logit perturbation on the rollout side (0: none).
        noise_kind: ``"uniform"`` or ``"clipped_gaussian"``.
        seed: seeds the noise and the sampling.
        temperature: divides the logits on both sides (as a sampler and the trainer do).
        rule: safe-vocabulary rule string for the pruning analysis (``None``/``"none"``: skipped).
        buckets: inner edges of the probability buckets.
        eps: reference ε of ``frac_within_bound`` (default: ``noise`` when it is the only mismatch source,
            else the measured ``eps_max``).
        batch_size: texts per forward pass.
        max_length: texts are truncated to this many tokens.
        max_new_tokens: when > 0, sample this many tokens per prompt on the rollout side and score those.
        num_samples: continuations per prompt (sampling mode).
        progress: show a progress bar (tqdm) when there is more than one batch.

    Returns:
        A `DiagnoseResult`.
    """
    import numpy as np
    from tqdm.auto import tqdm

    from trl_integration.rollout import logit_noise

    if not texts:
        raise ValueError("no texts to score")
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise={noise!r} is out of range: accepted a finite float >= 0")
    if noise_kind not in _NOISE_KINDS:
        raise ValueError(f"noise_kind={noise_kind!r} is not accepted: accepted one of {_NOISE_KINDS}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is out of range: accepted > 0")
    if eps is not None and not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps={eps!r} is out of range: accepted a finite float >= 0")
    rule_obj = parse_rule(rule)
    use_rule = not isinstance(rule_obj, NoPruning)
    train_dtype, rollout_dtype = compare
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    cache: dict = {}
    model_a = _model_in(model, train_dtype, cache)
    model_b = _model_in(model, rollout_dtype, cache)
    same_engine = model_a is model_b
    gen = torch.Generator(device=device).manual_seed(seed)

    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("train_logp", "rollout_logp", "eps_t", "eps_raw", "seq")}
    if use_rule:
        for k in ("kept", "same_set", "pruned_log_r", "jaccard", "train_logp_s"):
            cols[k] = []
    n_seq = 0
    chunk_elems = 2**22  # float64 elements per chunk of [positions, V]
    batches = list(_batches(len(texts), batch_size))
    bar = tqdm(total=len(batches), desc="scoring", unit="batch", disable=not progress or len(batches) < 2)
    for start, stop in batches:
        chunk_texts = list(texts[start:stop])
        if max_new_tokens > 0:
            ids, attn, counted = _sample(
                model_b, tokenizer, chunk_texts, max_new_tokens=max_new_tokens, num_samples=num_samples,
                temperature=temperature, noise=noise, noise_kind=noise_kind, seed=seed + start, device=device,
            )
        else:
            enc = tokenizer(
                chunk_texts, return_tensors="pt", padding=True, padding_side="right", truncation=True,
                max_length=max_length,
            ).to(device)
            ids, attn = enc["input_ids"], enc["attention_mask"]
            counted = (attn[:, 1:] * attn[:, :-1]).bool()
        logits_a = _forward_logits(model_a, ids, attn)[:, :-1]
        logits_b = logits_a if same_engine else _forward_logits(model_b, ids, attn)[:, :-1]
        targets = ids[:, 1:]
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(targets)
        za_all, zb_all, y_all, seq_all = logits_a[counted], logits_b[counted], targets[counted], rows[counted]
        vocab = za_all.shape[-1]
        step = max(1, chunk_elems // max(1, vocab))
        for i in range(0, za_all.shape[0], step):
            za = za_all[i : i + step].double() / temperature
            zb = zb_all[i : i + step].double() / temperature
            if noise > 0:
                zb = zb + logit_noise(zb.shape, noise, noise_kind, generator=gen, device=zb.device, dtype=torch.float64)
            y = y_all[i : i + step].unsqueeze(-1)
            la = za.log_softmax(-1).gather(-1, y).squeeze(-1)
            lb = zb.log_softmax(-1).gather(-1, y).squeeze(-1)
            cols["train_logp"].append(la.cpu())
            cols["rollout_logp"].append(lb.cpu())
            cols["eps_t"].append(logit_perturbation_eps(za, zb).cpu())
            cols["eps_raw"].append(logit_perturbation_eps(za, zb, centered=False).cpu())
            cols["seq"].append((seq_all[i : i + step] + n_seq).cpu())
            if use_rule:
                from safevocab import safe_log_softmax

                sa = safe_log_softmax(za, y.squeeze(-1), rule_obj)
                sb = safe_log_softmax(zb, y.squeeze(-1), rule_obj)
                dis = safe_set_disagreement(za, zb, rule_obj)
                cols["kept"].append((sa.in_safe & sb.in_safe).cpu())
                cols["same_set"].append((~dis.differs).cpu())
                cols["jaccard"].append(dis.jaccard.cpu())
                cols["pruned_log_r"].append((sa.logprobs - sb.logprobs).double().cpu())
                cols["train_logp_s"].append(sa.logprobs.double().cpu())
        n_seq += ids.shape[0]
        bar.update(1)
    bar.close()

    tok = {k: torch.cat(v) if v else torch.zeros(0) for k, v in cols.items()}
    n_tokens = int(tok["train_logp"].numel())
    if n_tokens == 0:
        raise ValueError("no token was scored (texts of a single token? empty continuations?)")
    train_logp, rollout_logp = tok["train_logp"], tok["rollout_logp"]
    log_r = train_logp - rollout_logp
    p = train_logp.exp()
    eps_t = tok["eps_t"]
    eps_max = float(eps_t.max())
    noise_only = noise > 0 and same_engine
    if eps is not None:
        eps_ref, eps_source = float(eps), "--eps"
    elif noise_only:
        eps_ref, eps_source = float(noise), "injected --noise"
    else:
        eps_ref, eps_source = eps_max, "measured eps_max"
    bound = logprob_mismatch_bound(p.clamp(0.0, 1.0), torch.tensor(eps_ref, dtype=torch.float64))
    local_bound = logprob_mismatch_bound(p.clamp(0.0, 1.0), eps_t)
    within = log_r.abs() <= bound + BOUND_TOLERANCE
    within_local = log_r.abs() <= local_bound + BOUND_TOLERANCE
    tightness = torch.where(bound > 0, log_r.abs() / bound, torch.zeros_like(bound))

    # Sequence-level statistics (verl's): each text (or sample) is one sequence.
    seq = tok["seq"].long()
    lengths = torch.bincount(seq, minlength=n_seq)
    width = int(lengths.max())
    pos = torch.arange(n_tokens) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    dense_t = torch.zeros(n_seq, width, dtype=torch.float64)
    dense_r = torch.zeros(n_seq, width, dtype=torch.float64)
    mask = torch.zeros(n_seq, width, dtype=torch.bool)
    dense_t[seq, pos], dense_r[seq, pos], mask[seq, pos] = train_logp, rollout_logp, True
    seq_metrics = {k.split("/", 1)[1]: _num(v) for k, v in mismatch_metrics(dense_t, dense_r, mask).items()}

    flat_mask = torch.ones(1, n_tokens, dtype=torch.bool)
    b = bucket_mismatch(train_logp.unsqueeze(0), rollout_logp.unsqueeze(0), flat_mask, buckets)
    bucket_rows = []
    for j, name in enumerate(b.names):
        lo, hi = float(b.lo[j]), float(b.hi[j])
        in_b = (p >= lo) & ((p < hi) if j < len(b.names) - 1 else torch.ones_like(p, dtype=torch.bool))
        bucket_rows.append(
            {
                "name": name,
                "lo": lo,
                "hi": hi,
                "n": int(b.count[j]),
                "frac": _num(b.frac[j]),
                "abs_diff_mean": _num(b.abs_diff_mean[j]),
                "diff_mean": _num(b.diff_mean[j]),
                "abs_diff_max": _num(log_r.abs()[in_b].max()) if bool(in_b.any()) else None,
                "bound_at_lo": _num(logprob_mismatch_bound(lo, eps_ref)),
                "local_bound_mean": _num(local_bound[in_b].mean()) if bool(in_b.any()) else None,
            }
        )

    summary: dict = {
        "model": getattr(getattr(model, "config", None), "_name_or_path", None),
        "mode": "sample" if max_new_tokens > 0 else "teacher_forcing",
        "train_dtype": _dtype_name(train_dtype),
        "rollout_dtype": _dtype_name(rollout_dtype),
        "noise": float(noise),
        "noise_kind": noise_kind if noise > 0 else None,
        "seed": int(seed),
        "temperature": float(temperature),
        "n_texts": len(texts),
        "n_sequences": int(n_seq),
        "n_tokens": n_tokens,
        "eps_max": eps_max,
        "eps_raw_max": float(tok["eps_raw"].max()),
        "eps_quantiles": {f"p{q}": float(np.quantile(eps_t.numpy(), q / 100)) for q in (50, 90, 99)},
        "eps_ref": eps_ref,
        "eps_ref_source": eps_source,
        "frac_within_bound": float(within.double().mean()),
        "frac_within_local_bound": float(within_local.double().mean()),
        "bound_tolerance": BOUND_TOLERANCE,
        "abs_diff_mean": float(log_r.abs().mean()),
        "abs_diff_max": float(log_r.abs().max()),
        "bound_tightness_median": float(tightness.median()),
        "sequence_metrics": seq_metrics,
        "buckets": bucket_rows,
        "rule": None,
    }
    tokens = {"p": p, "train_logp": train_logp, "rollout_logp": rollout_logp, "log_r": log_r, "eps_t": eps_t,
              "bound": bound}
    if use_rule:
        kept, same = tok["kept"], tok["same_set"]
        pruned = tok["pruned_log_r"]
        p_s = tok["train_logp_s"].exp().clamp(0.0, 1.0)
        pruned_bound = logprob_mismatch_bound(p_s, torch.tensor(eps_ref, dtype=torch.float64))
        both = kept & same
        summary["rule"] = {
            "rule": str(rule_obj),
            "kept_frac": float(kept.double().mean()),
            "set_differ_frac": float((~same).double().mean()),
            "jaccard_mean": float(tok["jaccard"].mean()),
            "abs_diff_mean_all": float(log_r.abs().mean()),
            "abs_diff_mean_kept_full": _mean(log_r.abs(), kept),
            "abs_diff_mean_kept_pruned": _mean(pruned.abs(), kept),
            "abs_diff_mean_dropped": _mean(log_r.abs(), ~kept),
            "abs_diff_max_kept_pruned": _max(pruned.abs(), kept),
            "shrink_vs_all": _ratio(_mean(pruned.abs(), kept), float(log_r.abs().mean())),
            "frac_within_pruned_bound": _mean(
                (pruned.abs() <= pruned_bound + BOUND_TOLERANCE).double(), both
            ),
            "bucket_abs_diff_mean_kept_pruned": [
                _mean(pruned.abs(), kept & (p >= r["lo"]) & ((p < r["hi"]) if r["hi"] < 1 else (p <= 2.0)))
                for r in bucket_rows
            ],
        }
        tokens.update(kept=kept, same_set=same, pruned_log_r=pruned)
    return DiagnoseResult(summary=summary, tokens=tokens)


def _num(x) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v


def _mean(x: torch.Tensor, m: torch.Tensor) -> float | None:
    return float(x[m].mean()) if bool(m.any()) else None


def _max(x: torch.Tensor, m: torch.Tensor) -> float | None:
    return float(x[m].max()) if bool(m.any()) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------------------------------
# outputs
# ----------------------------------------------------------------------------------------------------


def write_outputs(result: DiagnoseResult, output_dir: str | os.PathLike, plots: bool = True,
                  max_points: int = 20000) -> list[Path]:
    """Write ``summary.json`` and (``plots=True``) ``mismatch_vs_p.png`` and ``bucket_means.png``.

    Args:
        result: the `DiagnoseResult` to write.
        output_dir: created if needed.
        plots: also draw the PNG plots (needs matplotlib).
        max_points: the scatter plot shows a seeded random subset of at most this many tokens.

    Returns:
        The written paths (``summary.json`` first).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "summary.json"]
    if plots:
        files += [out / "mismatch_vs_p.png", out / "bucket_means.png"]
    result.summary["files"] = [f.name for f in files]
    files[0].write_text(json.dumps(result.summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if plots:
        _plot_scatter(result, files[1], max_points)
        _plot_buckets(result, files[2])
    return files


def _plot_scatter(result: DiagnoseResult, path: Path, max_points: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    s, t = result.summary, result.tokens
    p = t["p"].numpy()
    gap = t["log_r"].abs().numpy()
    idx = np.arange(p.size)
    if p.size > max_points:
        idx = np.random.default_rng(0).choice(p.size, max_points, replace=False)
    p, gap = p[idx], gap[idx]
    # A logit x-axis shows both tails: the bound is flat (~2 eps) for p -> 0 and vanishes as p -> 1.
    p = np.clip(p, 1e-9, 1 - 1e-9)
    nonzero = gap > 0
    floor = float(gap[nonzero].min()) / 10 if nonzero.any() else 1e-12
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    ax.scatter(p[nonzero], gap[nonzero], s=4, alpha=0.35, color="tab:blue",
               label=f"|log π − log μ| per token ({int(nonzero.sum())} shown)")
    if (~nonzero).any():
        ax.scatter(p[~nonzero], np.full((~nonzero).sum(), floor), s=4, alpha=0.35,
                   color="tab:gray", marker="v", label=f"exactly 0 ({int((~nonzero).sum())}, drawn at the floor)")
    p_lo = max(min(float(p.min()), 1e-3) / 3, 1e-9)
    p_hi = 1 - max(min(1 - float(p.max()), 1e-3) / 3, 1e-9)
    grid = 1.0 / (1.0 + np.exp(-np.linspace(math.log(p_lo / (1 - p_lo)), math.log(p_hi / (1 - p_hi)), 400)))
    eps = s["eps_ref"]
    curve = logprob_mismatch_bound(torch.tensor(grid), torch.tensor(eps, dtype=torch.float64)).numpy()
    ax.plot(grid, np.maximum(curve, floor / 10), color="tab:red", lw=2,
            label=f"bound log(p + (1 − p)·exp(2ε)), ε = {eps:.3g}")
    ax.set_xscale("logit")
    ticks = [t for t in (1e-8, 1e-6, 1e-4, 1e-2, 0.5, 1 - 1e-2, 1 - 1e-4, 1 - 1e-6, 1 - 1e-8)
             if grid[0] <= t <= grid[-1]]
    labels = {1e-8: "1e-8", 1e-6: "1e-6", 1e-4: "1e-4", 1e-2: "0.01", 0.5: "0.5", 1 - 1e-2: "0.99",
              1 - 1e-4: "1-1e-4", 1 - 1e-6: "1-1e-6", 1 - 1e-8: "1-1e-8"}
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([labels[t] for t in ticks]))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xlabel("training probability p of the token")
    ax.set_ylabel("|Δ log p|  (nats)")
    title = f"{s['train_dtype']} vs {s['rollout_dtype']}"
    if s["noise"] > 0:
        title += f" + {s['noise_kind']} noise ε={s['noise']:g}"
    ax.set_title(f"{title}: {s['frac_within_bound'] * 100:.1f}% within the bound")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_buckets(result: DiagnoseResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = result.summary
    rows = s["buckets"]
    x = np.arange(len(rows))
    rule = s["rule"]
    width = 0.38 if rule else 0.6
    nan = float("nan")
    fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=110)
    vals = [nan if r["abs_diff_mean"] is None else r["abs_diff_mean"] for r in rows]
    ax.bar(x - (width / 2 if rule else 0), vals, width, color="tab:blue", label="mean |Δ log p|, full softmax")
    if rule:
        pruned = [nan if v is None else v for v in rule["bucket_abs_diff_mean_kept_pruned"]]
        ax.bar(x + width / 2, pruned, width, color="tab:green",
               label=f"mean |Δ log π_S|, tokens kept by {rule['rule']}")
    ax.plot(x, [nan if r["abs_diff_max"] is None else r["abs_diff_max"] for r in rows], "kv", markersize=6,
            label="max |Δ log p|")
    ax.plot(x, [nan if r["local_bound_mean"] is None else r["local_bound_mean"] for r in rows], "o",
            color="tab:orange", markersize=6, label="mean bound at each token's own ε_t")
    ax.plot(x, [r["bound_at_lo"] for r in rows], "_", color="tab:red", markersize=22, mew=2,
            label=f"bound at the bucket's lower edge, ε = {s['eps_ref']:.3g}")
    ax.set_yscale("log")
    for xi, r in zip(x, rows):
        ax.annotate(f"n={r['n']}", (xi, 0.0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=7)
    ax.set_xticks(x, [r["name"] for r in rows], rotation=15, fontsize=8)
    ax.set_ylabel("nats")
    ax.set_title("mismatch by training-probability bucket")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _print_summary(summary: dict, files: list[Path]) -> None:
    model = str(summary["model"])
    try:
        from trl_integration.assets import TINY_MODEL_NAME, tiny_model_path

        if Path(model).resolve() == tiny_model_path().resolve():
            model = f"{TINY_MODEL_NAME} (bundled)"
    except (ImportError, FileNotFoundError, OSError):
        pass
    lines = [
        ("model", model),
        ("compare (train:rollout)", f"{summary['train_dtype']}:{summary['rollout_dtype']}"),
        ("injected noise", f"{summary['noise']:g} ({summary['noise_kind']})" if summary["noise"] else "none"),
        ("tokens scored", f"{summary['n_tokens']} in {summary['n_sequences']} sequences ({summary['mode']})"),
        ("eps_max (logit gap)", f"{summary['eps_max']:.4g}  (p50 {summary['eps_quantiles']['p50']:.3g}, "
                                f"p99 {summary['eps_quantiles']['p99']:.3g})"),
        ("within bound", f"{summary['frac_within_bound'] * 100:.2f}% at eps={summary['eps_ref']:.4g} "
                         f"({summary['eps_ref_source']})"),
        ("|Δ log p| mean / max", f"{summary['abs_diff_mean']:.3g} / {summary['abs_diff_max']:.3g}"),
        ("k3 KL / chi2 token", f"{summary['sequence_metrics']['k3_kl']:.3g} / "
                               f"{summary['sequence_metrics']['chi2_token']:.3g}"),
    ]
    for r in summary["buckets"]:
        mean = "-" if r["abs_diff_mean"] is None else f"{r['abs_diff_mean']:.3g}"
        lines.append((f"  bucket {r['name']}", f"n={r['n']:<6d} mean |Δ|={mean}  bound≤{r['bound_at_lo']:.3g}"))
    rule = summary["rule"]
    if rule:
        kept = rule["abs_diff_mean_kept_pruned"]
        lines += [
            (f"rule {rule['rule']}", f"keeps {rule['kept_frac'] * 100:.1f}% of tokens, sets differ at "
                                     f"{rule['set_differ_frac'] * 100:.2f}% of positions"),
            ("  mean |Δ| on kept tokens", f"{_fmt(rule['abs_diff_mean_kept_full'])} full softmax -> "
                                          f"{_fmt(kept)} renormalised π_S (all tokens: "
                                          f"{rule['abs_diff_mean_all']:.3g})"),
        ]
    lines.append(("wrote", ", ".join(str(f) for f in files)))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="safevocab diagnose", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for k, v in lines:
            table.add_row(k, v)
        Console().print(table)
    except ImportError:  # pragma: no cover - rich is part of the trl extra
        width = max(len(k) for k, _ in lines)
        for k, v in lines:
            print(f"{k:<{width}}  {v}")


# ----------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``safevocab`` argument parser (subcommand ``diagnose``)."""
    parser = argparse.ArgumentParser(
        prog="safevocab", description="safevocab tools. Run `safevocab diagnose --help` for the mismatch lab."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "diagnose",
        help="measure a model's training-inference mismatch under two precisions or injected logit noise",
        description="Measure a model's training-inference mismatch (two precisions, or injected logit noise "
        "with a hard bound) by teacher forcing, check every token against the bound "
        "log(p + (1 - p) e^(2 eps)), and write summary.json and PNG plots. See docs/mismatch.md.",
    )
    d.add_argument("--model", default=None,
                   help="local model folder (save_pretrained); default: the bundled tiny arithmetic model")
    d.add_argument("--input", default=None, help="text file, one text (or prompt) per line")
    d.add_argument("--prompts", nargs="+", default=None, metavar="TEXT",
                   help="texts (or prompts) on the command line; default without --input: arithmetic problems "
                        "with their answers (or a few built-in sentences)")
    d.add_argument("--compare", default=None, metavar="TRAIN:ROLLOUT",
                   help="precisions of the two sides, each one of float32, bfloat16, float16, float64 (or fp32, "
                        "bf16, fp16, fp64); default float32:bfloat16, or float32:float32 with --noise")
    d.add_argument("--noise", type=float, default=0.0, metavar="EPS",
                   help="hard bound of an injected logit perturbation |delta| <= EPS on the rollout side "
                        "(default: %(default)s)")
    d.add_argument("--noise_kind", choices=_NOISE_KINDS, default="uniform",
                   help="distribution of the injected noise (default: %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="seed of the noise and of the sampling (default: %(default)s)")
    d.add_argument("--eps", type=float, default=None,
                   help="reference eps of frac_within_bound; default: --noise when it is the only mismatch, "
                        "else the measured eps_max")
    d.add_argument("--rule", default=DEFAULT_RULE,
                   help="safe-vocabulary rule to analyse, 'none' to skip (default: %(default)s)")
    d.add_argument("--temperature", type=float, default=1.0,
                   help="temperature dividing the logits on both sides (default: %(default)s)")
    d.add_argument("--buckets", type=float, nargs="+", default=list(DEFAULT_BUCKETS), metavar="EDGE",
                   help="inner edges of the probability buckets, increasing in (0, 1) (default: %(default)s)")
    d.add_argument("--max_new_tokens", type=int, default=0,
                   help="> 0: treat the inputs as prompts and score this many sampled tokens per continuation "
                        "(default: %(default)s)")
    d.add_argument("--num_samples", type=int, default=1,
                   help="continuations per prompt with --max_new_tokens (default: %(default)s)")
    d.add_argument("--batch_size", type=int, default=16, help="texts per forward pass (default: %(default)s)")
    d.add_argument("--max_length", type=int, default=512,
                   help="truncate texts to this many tokens (default: %(default)s)")
    d.add_argument("--device", default=None, help="torch device; default: cuda when available, else cpu")
    d.add_argument("--output_dir", default="safevocab-diagnose",
                   help="where summary.json and the plots go (default: %(default)s)")
    d.add_argument("--no_plots", action="store_true", help="write summary.json only")
    d.add_argument("--quiet", action="store_true", help="no progress bar and no printed summary")
    d.set_defaults(func=_diagnose_command)
    return parser


def _fail(message: str) -> int:
    print(f"safevocab diagnose: error: {message}", file=sys.stderr)
    return 2


def _diagnose_command(args) -> int:
    try:
        compare = parse_compare(args.compare or ("float32:float32" if args.noise > 0 else "float32:bfloat16"))
        if args.noise < 0 or not math.isfinite(args.noise):
            raise ValueError(f"--noise {args.noise!r} is out of range: accepted a finite float >= 0")
        if args.max_new_tokens < 0 or args.num_samples < 1 or args.batch_size < 1 or args.max_length < 2:
            raise ValueError("--max_new_tokens must be >= 0, --num_samples and --batch_size >= 1, --max_length >= 2")
        rule = parse_rule(args.rule)
        model_path = _resolve_model(args.model)
        texts = _read_inputs(args)
    except ValueError as err:
        return _fail(str(err))

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if args.quiet:
        hf_logging.disable_progress_bar()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    try:
        result = run_diagnose(
            model,
            tokenizer,
            texts,
            compare=compare,
            noise=args.noise,
            noise_kind=args.noise_kind,
            seed=args.seed,
            temperature=args.temperature,
            rule=str(rule),
            buckets=args.buckets,
            eps=args.eps,
            batch_size=args.batch_size,
            max_length=args.max_length,
            max_new_tokens=args.max_new_tokens,
            num_samples=args.num_samples,
            progress=not args.quiet,
        )
    except ValueError as err:
        return _fail(str(err))
    result.summary["model"] = model_path
    files = write_outputs(result, args.output_dir, plots=not args.no_plots)
    if not args.quiet:
        _print_summary(result.summary, files)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``safevocab`` console script. Returns the process exit code."""
    parser = build_parser()
    # --- begin: `safevocab study` subcommand (implemented in trl_integration/study.py) ---
    from trl_integration.study import add_study_subparser

    add_study_subparser(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)))
    # --- end: `safevocab study` subcommand ---
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
