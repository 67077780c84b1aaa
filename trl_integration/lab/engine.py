"""The mismatch lab's engine: score the same tokens on a training and a rollout side and check the exact bound.

Two "engines" score the same tokens by teacher forcing:

- the *training* side: the model in ``compare``'s first dtype (default ``float32``);
- the *rollout* side: the model in the second dtype (default ``bfloat16``), optionally with its weights rounded to
  ``mantissa_bits`` mantissa bits and an injected logit perturbation ``delta`` (``noise=EPS``: ``|delta_i| <= EPS``
  on the transformed logits; seeded noise, the deterministic ``lift``, or the ``tail``: ``EPS`` on the tokens
  ``rule`` cuts).

For every scored token ``y`` with training probability ``p = pi(y)`` it records ``log r = log pi(y) - log mu(y)``
and the size of the logit perturbation at that position, ``eps_t = (max_i delta_i - min_i delta_i) / 2``
(`safevocab.mismatch.logit_perturbation_eps`, shift-invariant), and reports:

- ``eps_max``: the largest ``eps_t`` (the empirical ε of the logit gap);
- ``frac_within_bound``: the share of tokens with ``|log r| <= log(p + (1 - p) e^{2 eps})``
  (`safevocab.bounds.logprob_mismatch_bound`) for the reference ``eps``: ``eps`` if given, else the
  injected ``noise`` when it is the only source of mismatch (then it must be 100%), else ``eps_max``;
- mean ``|log r|`` and signed ``log r`` by training-probability bucket;
- ``frac_ratio_outside_0.9_1.1`` and ``frac_ratio_outside_0.8_1.25``: the shares of the importance ratios
  ``r = pi / mu`` outside ``[0.9, 1.1]`` and ``[0.8, 1.25]`` (:mod:`trl_integration.lab.bands`);
- with a ``rule``: how often the two sides pick different safe sets, how much the renormalised
  ``log pi_S`` shrinks the mismatch on the tokens both sides keep, and where the k3 estimate of ``KL(mu || pi)``
  lies: ``k3_share_outside``, the share of the summed per-token k3 terms ``r - log r - 1`` (``r = pi / mu``)
  carried by the scored tokens outside the training side's safe set (below the cut: the tokens DVP masks out of
  the loss), and ``k3_removable``, ``1 - sum_kept k3(log pi_S - log mu_S) / sum_all k3(log pi - log mu)``: the share
  of the k3 sum that masking those tokens and renormalising both sides over their sets removes; and ``kept_sets``:
  each side's kept-set size and pruned mass per position (median, p90, p99, max) and the share of positions where
  the two sides' sets differ (:mod:`trl_integration.lab.kept_sets`); and the shares of ``sum |log r|``, of the
  out-of-band ratios and of each bucket's gap carried by the tokens outside the training side's safe set
  (``abs_diff_share_outside``, ``ratio_outside_0.9_1.1_share_outside``, ... :func:`~trl_integration.lab.bands.cut_shares`);
- verl's sequence statistics (k3 KL, chi², log-ppl gap) with each text as a sequence.

The command ``safevocab diagnose`` (:mod:`trl_integration.commands.diagnose`) runs it on texts or prompts; with
``max_new_tokens > 0`` the inputs are prompts: the rollout side samples continuations (``num_samples`` each, full
distribution, with the noise when given) and only the sampled tokens are scored.

What it does not include: both sides here are full (teacher-forced) forwards, so the KV-cache and kernel
differences of a real sampler are not part of the measured gap (the trainer's ``mismatch/*`` metrics measure
those); and in sampling mode the rollout side's noise used for scoring is a fresh draw of the same
distribution, not the exact draw used while sampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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
from safevocab.mismatch.formulas import k3_terms
from safevocab.rules import NoPruning, parse_rule
from trl_integration.grpo.config import DEFAULT_RULE
from trl_integration.lab.bands import cut_shares, ratio_band_fracs
from trl_integration.lab.kept_sets import KEPT_SET_COLUMNS, kept_set_stats
from trl_integration.lab.sides import check_mantissa_bits, model_in, rollout_side
from trl_integration.options import NOISE_KINDS
from trl_integration.rollout.perturbations import tail_rule

__all__ = ["BOUND_TOLERANCE", "DiagnoseResult", "run_diagnose"]

#: Absolute slack (nats) in the bound checks, for float64 rounding of the two log-softmaxes.
BOUND_TOLERANCE = 1e-9


@dataclass
class DiagnoseResult:
    """Result of `run_diagnose`.

    Attributes:
        summary: the JSON-serialisable summary (what ``summary.json`` holds).
        tokens: per scored token, 1-D float64/bool CPU tensors: ``p`` (training probability), ``train_logp``,
            ``rollout_logp``, ``log_r`` (``train - rollout``), ``eps_t`` and ``bound`` (at the reference eps);
            with a rule also ``kept`` (both sides keep the token), ``same_set``, ``pruned_log_r`` and
            ``in_train_set`` (the training side keeps it), and each side's kept-set size and log kept mass
            (:data:`~trl_integration.lab.kept_sets.KEPT_SET_COLUMNS`, summarised in ``summary["rule"]["kept_sets"]``).
        sequences: per scored sequence, in the order of ``tokens``: its token ids without padding (1-D int64, CPU)
            and which of its next-token targets ``ids[1:]`` were scored (1-D bool, one shorter): what the
            batch-shape control (:mod:`trl_integration.lab.batch_shape`) scores again.
    """

    summary: dict
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    sequences: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _forward_logits(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    # Explicit positions: correct under left padding (sampling mode) as well as right padding.
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn, position_ids=pos).logits


def _sample(
    model, tokenizer, prompts, *, max_new_tokens, num_samples, temperature, noise, noise_kind, noise_rule, seed, device
):
    """Sample continuations on the rollout side; returns ``(ids, attn, counted)`` with ``counted`` marking the
    sampled tokens as targets (``[B, L-1]``, aligned with ``ids[:, 1:]``)."""
    from transformers import LogitsProcessorList

    from trl_integration.rollout.perturbations import LogitNoiseProcessor

    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
    processors = LogitsProcessorList()
    if noise > 0:
        processors.append(LogitNoiseProcessor(noise, noise_kind, seed=seed, temperature=temperature, rule=noise_rule))
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
    mantissa_bits: int | None = None,
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
        noise_kind: ``"uniform"``, ``"clipped_gaussian"``, ``"lift"`` or ``"tail"`` (``EPS`` on the tokens ``rule``
            cuts at the rollout side's logits; needs a ``rule`` that prunes).
        mantissa_bits: round the rollout side's weights to this many mantissa bits (``None``: not rounded).
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

    from trl_integration.rollout.perturbations import logit_delta

    if not texts:
        raise ValueError("no texts to score")
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise={noise!r} is out of range: accepted a finite float >= 0")
    if noise_kind not in NOISE_KINDS:
        raise ValueError(f"noise_kind={noise_kind!r} is not accepted: accepted one of {NOISE_KINDS}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is out of range: accepted > 0")
    if eps is not None and not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps={eps!r} is out of range: accepted a finite float >= 0")
    check_mantissa_bits(mantissa_bits, compare[1])
    rule_obj = parse_rule(rule)
    use_rule = not isinstance(rule_obj, NoPruning)
    noise_rule = tail_rule(rule_obj) if noise > 0 and noise_kind == "tail" else None  # refuses 'none' for the tail
    train_dtype, rollout_dtype = compare
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    cache: dict = {}
    model_a = model_in(model, train_dtype, cache)
    model_b = rollout_side(model, rollout_dtype, mantissa_bits, cache)
    same_engine = model_a is model_b
    gen = torch.Generator(device=device).manual_seed(seed)

    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("train_logp", "rollout_logp", "eps_t", "eps_raw", "seq")}
    if use_rule:
        for k in ("kept", "same_set", "pruned_log_r", "jaccard", "train_logp_s", "train_in_set", *KEPT_SET_COLUMNS):
            cols[k] = []
    n_seq = 0
    sequences: list[tuple[torch.Tensor, torch.Tensor]] = []
    chunk_elems = 2**22  # float64 elements per chunk of [positions, V]
    batches = list(_batches(len(texts), batch_size))
    bar = tqdm(total=len(batches), desc="scoring", unit="batch", disable=not progress or len(batches) < 2)
    for start, stop in batches:
        chunk_texts = list(texts[start:stop])
        if max_new_tokens > 0:
            ids, attn, counted = _sample(
                model_b,
                tokenizer,
                chunk_texts,
                max_new_tokens=max_new_tokens,
                num_samples=num_samples,
                temperature=temperature,
                noise=noise,
                noise_kind=noise_kind,
                noise_rule=noise_rule,
                seed=seed + start,
                device=device,
            )
        else:
            enc = tokenizer(
                chunk_texts,
                return_tensors="pt",
                padding=True,
                padding_side="right",
                truncation=True,
                max_length=max_length,
            ).to(device)
            ids, attn = enc["input_ids"], enc["attention_mask"]
            counted = (attn[:, 1:] * attn[:, :-1]).bool()
        logits_a = _forward_logits(model_a, ids, attn)[:, :-1]
        logits_b = logits_a if same_engine else _forward_logits(model_b, ids, attn)[:, :-1]
        targets = ids[:, 1:]
        for i, real in enumerate(attn.bool()):  # the real tokens are contiguous (right or left padding)
            sequences.append((ids[i][real].cpu(), counted[i][real[:-1] & real[1:]].cpu()))
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(targets)
        za_all, zb_all, y_all, seq_all = logits_a[counted], logits_b[counted], targets[counted], rows[counted]
        vocab = za_all.shape[-1]
        step = max(1, chunk_elems // max(1, vocab))
        for i in range(0, za_all.shape[0], step):
            za = za_all[i : i + step].double() / temperature
            zb = zb_all[i : i + step].double() / temperature
            if noise > 0:
                zb = zb + logit_delta(zb, noise, noise_kind, generator=gen, rule=noise_rule)
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
                cols["train_in_set"].append(sa.in_safe.cpu())
                cols["same_set"].append((~dis.differs).cpu())
                cols["jaccard"].append(dis.jaccard.cpu())
                cols["pruned_log_r"].append((sa.logprobs - sb.logprobs).double().cpu())
                cols["train_logp_s"].append(sa.logprobs.double().cpu())
                for side, safe in (("train", sa), ("rollout", sb)):  # the kept sets' size and mass (lab/kept_sets)
                    cols[f"kept_size_{side}"].append(safe.safe_size.cpu())
                    cols[f"log_kept_mass_{side}"].append(safe.log_kept_mass.double().cpu())
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
        "rollout_mantissa_bits": mantissa_bits,
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
        **ratio_band_fracs(log_r),
        "bound_tightness_median": float(tightness.median()),
        "sequence_metrics": seq_metrics,
        "buckets": bucket_rows,
        "rule": None,
    }
    tokens = {
        "p": p,
        "train_logp": train_logp,
        "rollout_logp": rollout_logp,
        "log_r": log_r,
        "eps_t": eps_t,
        "bound": bound,
    }
    if use_rule:
        kept, same = tok["kept"], tok["same_set"]
        pruned = tok["pruned_log_r"]
        p_s = tok["train_logp_s"].exp().clamp(0.0, 1.0)
        pruned_bound = logprob_mismatch_bound(p_s, torch.tensor(eps_ref, dtype=torch.float64))
        both = kept & same
        k3_all = k3_terms(log_r)
        k3_total = float(k3_all.sum())
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
            "frac_within_pruned_bound": _mean((pruned.abs() <= pruned_bound + BOUND_TOLERANCE).double(), both),
            "k3_share_outside": _ratio(float(k3_all[~tok["train_in_set"]].sum()), k3_total),
            "k3_removable": _ratio(k3_total - float(k3_terms(pruned[kept]).sum()), k3_total),
            **cut_shares(log_r, ~tok["train_in_set"], p, buckets),
            "bucket_abs_diff_mean_kept_pruned": [
                _mean(pruned.abs(), kept & (p >= r["lo"]) & ((p < r["hi"]) if r["hi"] < 1 else (p <= 2.0)))
                for r in bucket_rows
            ],
        }
        kept_set_tokens = {k: tok[k] for k in KEPT_SET_COLUMNS}
        summary["rule"]["kept_sets"] = kept_set_stats(
            kept_set_tokens["kept_size_train"], kept_set_tokens["kept_size_rollout"],
            kept_set_tokens["log_kept_mass_train"], kept_set_tokens["log_kept_mass_rollout"], ~same,
        )  # fmt: skip
        tokens.update(
            kept=kept, same_set=same, pruned_log_r=pruned, in_train_set=tok["train_in_set"], **kept_set_tokens
        )
    return DiagnoseResult(summary=summary, tokens=tokens, sequences=sequences)


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
