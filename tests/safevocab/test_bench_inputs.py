"""``safevocab.bench.inputs``: the targets are draws from the pruned policy, and the ``lm`` logit profile keeps tens to
hundreds of tokens where the ``synthetic`` one keeps thousands."""

import pytest
import torch

from safevocab.bench.inputs import draw_logit_factors, kept_set_sizes, sample_targets


def test_targets_are_draws_from_the_pruned_softmax():
    # Gumbel-max on the device against the exact pruned distribution (independent: softmax of the kept logits).
    torch.manual_seed(0)
    weight = torch.randn(6, 4) * 2
    hidden = torch.randn(1, 4).expand(20000, 4).contiguous()
    gen = torch.Generator().manual_seed(1)
    draws = sample_targets(hidden, weight, "top_k=3", gen)
    z = hidden[0] @ weight.t()
    kept = z.topk(3).indices
    expected = torch.zeros(6).index_put_((kept,), torch.softmax(z[kept], -1))
    observed = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert set(draws.unique().tolist()) <= set(kept.tolist())
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)


def test_lm_logits_profile_keeps_tens_to_hundreds_of_tokens_where_the_synthetic_one_keeps_thousands():
    # Issue 41 point 5: the bench's LM-like profile (a Zipf prior plus a context term) at the GPU bench's vocabulary.
    sizes = {}
    for profile in ("synthetic", "lm"):
        gen = torch.Generator().manual_seed(0)
        hidden, weight = draw_logit_factors(256, 64, 151936, profile=profile, generator=gen, device="cpu")
        sizes[profile] = {rule: kept_set_sizes(hidden, weight, rule) for rule in ("min_p=0.01", "top_p=0.9")}
    for rule in ("min_p=0.01", "top_p=0.9"):
        assert 5 <= sizes["lm"][rule]["median"] <= 100 and sizes["lm"][rule]["p99"] <= 1000, sizes["lm"]
        assert sizes["synthetic"][rule]["median"] > 10 * sizes["lm"][rule]["median"], sizes
    with pytest.raises(ValueError, match="profile='zipf'"):
        draw_logit_factors(2, 4, 8, profile="zipf", generator=torch.Generator(), device="cpu")
