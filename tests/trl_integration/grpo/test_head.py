"""The trainer's per-token log-probabilities equal ``safe_log_softmax`` on the model's materialised logits."""

from __future__ import annotations

import pytest
import torch
from trl_helpers import make_trainer

from safevocab import safe_log_softmax


def batch(vocab: int, seed: int = 0):
    """Left-padded prompts followed by right-padded completions, as trl builds them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # prompt padding
    mask[1, -3:] = 0  # completion padding
    ids[mask == 0] = 0
    return ids, mask, 7  # the last 7 positions are the completion


def reference(model, ids, mask, keep, rule, temperature):
    logits = model(input_ids=ids, attention_mask=mask).logits  # the model's own forward: softcap/scale applied
    return safe_log_softmax(
        logits[:, -keep - 1 : -1], ids[:, -keep:], rule, temperature=temperature, compute_entropy=True
    )


CASES = [
    ("llama", "min_p=0.05", 0.7, {}),
    ("llama", "top_k=5", 1.0, {}),
    ("llama", "top_p=0.9", 1.3, {}),
    ("llama", "top_k=10,min_p=0.02", 0.7, {}),
    ("llama", "none", 1.0, {}),
    ("llama", "min_prob=0.01", 1.0, {"safe_vocab_in_sampler": False}),
    ("gemma2", "min_p=0.05", 0.7, {}),  # final-logit softcap 5.0
    ("gemma2", "top_p=0.9", 1.0, {}),
]


@pytest.mark.parametrize("arch, spec, temperature, extra", CASES, ids=[f"{a}-{s}" for a, s, _, _ in CASES])
def test_logps_match_materialised(arch, spec, temperature, extra, tiny_model_dir, tiny_gemma2_dir, tmp_path):
    model_dir = tiny_model_dir if arch == "llama" else tiny_gemma2_dir
    trainer = make_trainer(model_dir, tmp_path, safe_vocab_rule=spec, temperature=temperature, **extra)
    model = trainer.model
    if arch == "gemma2":
        assert model._safevocab_head[2] == 5.0  # the softcap reached the safe head
    ids, mask, keep = batch(model.config.vocab_size)
    logps, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, compute_entropy=True)
    stats = trainer.last_scoring_stats
    ref = reference(model, ids, mask, keep, trainer.args.rule, temperature)
    valid = mask[:, -keep:].bool()
    torch.testing.assert_close(logps[valid], ref.logprobs[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[valid], ref.entropy[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(stats.log_kept_mass[valid], ref.log_kept_mass[valid], atol=2e-5, rtol=1e-5)
    assert torch.equal(stats.in_safe[valid], ref.in_safe[valid])
    assert torch.equal(stats.safe_size[valid], ref.safe_size[valid])
    if spec != "none":
        assert (ref.log_kept_mass[valid] < -1e-4).any(), "the rule should prune something on this model"
        assert not ref.in_safe[valid].all() or spec != "top_k=5", "random targets should fall outside top-5"


def test_gradients_match_materialised(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, safe_vocab_rule="top_k=10,min_p=0.02", temperature=0.8)
    model = trainer.model
    ids, mask, keep = batch(model.config.vocab_size, seed=1)
    valid = mask[:, -keep:].float()
    weights = torch.linspace(-1, 1, keep).expand(3, keep)

    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)
    (logps * valid * weights).sum().backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    ref = reference(model, ids, mask, keep, trainer.args.rule, 0.8)
    (ref.logprobs * valid * weights).sum().backward()
    materialised = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert fused.keys() == materialised.keys() and "lm_head.weight" in fused
    for name in fused:
        torch.testing.assert_close(fused[name], materialised[name], atol=1e-5, rtol=1e-4, msg=name)


def test_reference_model_uses_the_safe_head(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, safe_vocab_rule="min_p=0.05", beta=0.1)
    assert trainer.ref_model is not None
    ids, mask, keep = batch(trainer.model.config.vocab_size)
    with torch.no_grad():
        policy, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep)
    assert not trainer.last_scoring_stats.in_safe[mask[:, -keep:].bool()].all()
    torch.testing.assert_close(policy, ref)  # same weights at initialisation, same rule


def test_generation_forward_is_unchanged(tiny_model_dir, tmp_path):
    """Without ``fused_lm_head`` the patched forward is the model's own (generation relies on it)."""
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(tiny_model_dir, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids, mask, _ = batch(plain.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.model(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits
        )


def test_keep_logits_bytes_reaches_the_scoring_call_and_changes_no_gradient(tiny_model_dir, tmp_path, monkeypatch):
    """``safe_vocab_keep_logits_bytes`` is the scoring call's ``keep_logits_bytes`` (the no-grad metric passes keep
    nothing): the same gradients bit for bit as recomputing (tests/safevocab/test_keep_logits.py)."""
    import trl_integration.grpo.head as head
    from safevocab.fused.chunking import KeptLogits

    caps = []
    fused = head.fused_safe_logprobs

    def recording(*args, **kwargs):
        caps.append(kwargs.get("keep_logits_bytes", 0))
        return fused(*args, **kwargs)

    monkeypatch.setattr(head, "fused_safe_logprobs", recording)
    kept = []
    put = KeptLogits.put
    monkeypatch.setattr(KeptLogits, "put", lambda self, start, buffer: (kept.append(start), put(self, start, buffer)))
    grads = []
    for cap in (0, 2**30):
        trainer = make_trainer(tiny_model_dir, tmp_path, safe_vocab_rule="top_k=10", safe_vocab_keep_logits_bytes=cap)
        assert trainer.args.safe_vocab_keep_logits_bytes == cap
        ids, mask, keep = batch(trainer.model.config.vocab_size, seed=2)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
        (logps * mask[:, -keep:]).sum().backward()
        grads.append({n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert caps == [0, 2**30] and kept  # the second call kept its chunks
    assert grads[0].keys() == grads[1].keys() and "lm_head.weight" in grads[0]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
