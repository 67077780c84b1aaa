"""The ``tail`` rollout perturbation: ``eps`` on exactly the tokens a safe-vocabulary rule cuts at the rollout's own
logits, 0 elsewhere. Checked against a hand computation of the ``min_p`` set in float64 (numpy, not the library's
rule), boundary ties included; through real ``generate``; as the trainer's noise kind, its config field and its
plug-in form; and in ``safevocab diagnose``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import trl_helpers
from trl_helpers import PROMPTS, build_model, build_tokenizer, grpo_kwargs

from safevocab import NoPruning
from trl_integration import SafeVocabGRPOConfig
from trl_integration.commands import main
from trl_integration.lab import run_diagnose
from trl_integration.plugins import load_callable
from trl_integration.rollout.perturbations import LogitNoiseProcessor, tail_perturbation
from trl_integration.rollout.recorder import RolloutLogprobRecorder, recording_generate

#: min_p = e^-4: ln(1 / rho) = 4 exactly in float64 and float32, so a logit exactly 4 below the top is a true tie.
RHO_EXACT = math.exp(-4.0)


def hand_min_p_cut(z: np.ndarray, rho: float) -> np.ndarray:
    """The tokens ``min_p=rho`` cuts, by its definition in float64: ``z_max - z_i > ln(1/rho)`` (a ``-inf`` logit is
    cut; the boundary ``z_i = z_max + ln rho`` is kept)."""
    z = z.astype(np.float64)
    return (z.max(-1, keepdims=True) - z) > -math.log(rho)


def logits_with_ties(rho: float, temperature: float, rows: int = 64, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    """fp32 scores (the sampler's, before the temperature) of random logits ``z = scores / T`` with, in every row,
    ``-inf`` entries, two tokens tied at the maximum and, for ``RHO_EXACT``, tokens exactly on the boundary and one
    float32 step either side of it."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3.0
    z[:, :2] = -torch.inf
    top = 1.5  # dyadic: z_max - 4 is exact in float32
    z = z.clamp(max=top - 0.25)
    z[:, 2] = z[:, 3] = top  # two tokens share the maximum
    if rho == RHO_EXACT:
        edge = torch.tensor(top - 4.0, dtype=torch.float32)
        z[:, 4] = float(edge)  # on the boundary: kept
        z[:, 5] = float(torch.nextafter(edge, torch.tensor(-math.inf)))  # one step below: cut
        z[:, 6] = float(torch.nextafter(edge, torch.tensor(math.inf)))  # one step above: kept
    return (z * temperature).float()  # temperature a power of 2: z = scores / T is exact in float32


@pytest.mark.parametrize("rho", [0.01, 0.1, RHO_EXACT])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_tail_lifts_exactly_the_complement_of_the_min_p_set(rho, temperature):
    assert -math.log(RHO_EXACT) == 4.0  # the premise of the boundary ties
    eps = 0.7
    scores = logits_with_ties(rho, temperature)
    z = scores / temperature
    cut = hand_min_p_cut(z.numpy(), rho)
    if rho == RHO_EXACT:
        assert not cut[:, 4].any() and cut[:, 5].all() and not cut[:, 6].any()  # the ties, by hand
    assert cut[:, :2].all() and not cut[:, 2:4].any()

    delta = tail_perturbation(z, eps, f"min_p={rho!r}").numpy()
    np.testing.assert_array_equal(delta > 0, cut)  # lifted = cut, token for token
    assert set(np.unique(delta)) == {0.0, np.float32(eps)}  # exactly eps or exactly 0

    # The processor the rollouts run: scores + T * delta, on exactly the finite cut tokens.
    out = LogitNoiseProcessor(eps, "tail", temperature=temperature, rule=f"min_p={rho!r}")(None, scores.clone())
    finite = np.isfinite(scores.numpy())
    changed = out.numpy() != scores.numpy()
    np.testing.assert_array_equal(changed[finite], cut[finite])
    np.testing.assert_allclose((out - scores).numpy()[changed], temperature * eps, rtol=1e-6)
    assert np.isneginf(out.numpy()[~finite]).all()  # a -inf logit stays -inf


def test_tail_under_other_rules_lifts_their_complement():
    """top_k=5 cuts every token below the 5th largest logit (ties with it kept); an intersection cuts the union."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(16, 200, generator=g)
    kth = np.sort(z.numpy(), axis=-1)[:, -5][:, None]
    np.testing.assert_array_equal(tail_perturbation(z, 1.0, "top_k=5").numpy() > 0, z.numpy() < kth)
    both = tail_perturbation(z, 1.0, "top_k=5,min_p=0.1").numpy() > 0
    np.testing.assert_array_equal(both, (z.numpy() < kth) | hand_min_p_cut(z.numpy(), 0.1))


@pytest.mark.parametrize("rule", [None, "none", NoPruning()])
def test_tail_refuses_a_rule_that_cuts_nothing(rule):
    with pytest.raises(ValueError, match="kind='tail'") as err:
        LogitNoiseProcessor(1.0, "tail", rule=rule)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="kind='tail'"):
        tail_perturbation(torch.zeros(2, 5), 1.0, rule)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return build_model(tok, head_scale=4.0).eval(), tok


def test_generate_samples_from_and_records_the_tail_distribution(tiny):
    """Through real ``generate``: each sampled token's recorded log mu is the softmax of the clean logits plus eps on
    the hand-computed min_p cut (float64, numpy)."""
    model, tok = tiny
    enc = tok(PROMPTS[:4], return_tensors="pt", padding=True)
    eps, temperature, rho = 1.5, 0.8, 0.5
    recorder = RolloutLogprobRecorder(NoPruning(), temperature)
    noise = LogitNoiseProcessor(eps, "tail", temperature=temperature, rule=f"min_p={rho}")
    torch.manual_seed(0)
    with recording_generate(model, recorder, None, [noise]):
        out = model.generate(
            **enc, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=6, pad_token_id=tok.pad_token_id
        )
    steps = recorder.logprobs.shape[1]
    new = out[:, -steps:]
    attn = torch.cat([enc["attention_mask"], torch.ones_like(new)], 1)
    with torch.no_grad():
        logits = model(input_ids=out, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    z = logits[:, -steps - 1 : -1].double().numpy() / temperature
    lifted = z + eps * hand_min_p_cut(z, rho)
    log_softmax = lambda a: a - np.logaddexp.reduce(a, axis=-1, keepdims=True)  # noqa: E731
    expected = np.take_along_axis(log_softmax(lifted), new.numpy()[..., None], -1)[..., 0]
    np.testing.assert_allclose(recorder.logprobs.double().numpy(), expected, atol=2e-5)
    train = np.take_along_axis(log_softmax(z), new.numpy()[..., None], -1)[..., 0]
    was_cut = np.take_along_axis(hand_min_p_cut(z, rho), new.numpy()[..., None], -1)[..., 0]
    gap = recorder.logprobs.double().numpy() - train
    assert was_cut.any() and (~was_cut).any()
    assert gap[was_cut].min() > 0.1 and gap[~was_cut].max() < 0  # the cut tokens gained, the kept ones lost


def loss_tokens(trainer):
    g = trainer.last_generation
    m = g["loss_mask"].bool()
    return g["train_logps"][m].double(), g["rollout_logps"][m].double()


def sampled_rollout_logps(trainer):
    g = trainer.last_generation
    return g["rollout_logps"][g["completion_mask"].bool()].double()


def make_trainer(model_dir, tmp_path, perturbation=None, **config):
    return trl_helpers.make_trainer(
        model_dir, tmp_path, trainer_kwargs={"rollout_perturbation": perturbation}, **config
    )


def test_trainer_noise_kind_rule_default_and_plugin_agree(tiny_model_dir, tmp_path):
    """rollout_logit_noise_kind='tail' with rollout_tail_rule, with the rule defaulting to safe_vocab_rule, and the
    same perturbation as a plug-in factory sample and record the same tokens; the mismatch is real."""
    common = dict(rollout_logprobs=True, max_steps=1, rollout_noise_seed=3, safe_vocab_out_of_set="mask_token")
    runs = {
        "tail rule": lambda: make_trainer(
            tiny_model_dir,
            tmp_path / "0",
            rollout_logit_noise=0.5,
            rollout_logit_noise_kind="tail",
            rollout_tail_rule="min_p=0.1",
            safe_vocab_rule="none",
            **common,
        ),
        "plug-in": lambda: make_trainer(
            tiny_model_dir,
            tmp_path / "1",
            rollout_perturbation="rollout_plugins:tail_half",
            safe_vocab_rule="none",
            **common,
        ),
    }
    results, trainers = {}, {}
    for name, build in runs.items():
        trainer = trainers[name] = build()
        assert trainer.args.safe_vocab_rule == "none"
        trainer.train()
        results[name] = loss_tokens(trainer)
    reference = trainers["tail rule"]
    train, rollout = results["tail rule"]
    assert (rollout - train).abs().max() > 1e-2
    assert torch.equal(results["plug-in"][0], train) and torch.equal(results["plug-in"][1], rollout)
    # rollout_tail_rule unset: the rule is safe_vocab_rule's (here scoring with it, sampling the full distribution)
    with pytest.warns(UserWarning, match="safe_vocab_in_sampler=False"):
        default = make_trainer(
            tiny_model_dir,
            tmp_path / "2",
            rollout_logit_noise=0.5,
            rollout_logit_noise_kind="tail",
            safe_vocab_rule="min_p=0.1",
            safe_vocab_in_sampler=False,
            **common,
        )
    assert default.args.rollout_tail_rule is None
    default.train()
    assert torch.equal(sampled_rollout_logps(default), sampled_rollout_logps(reference))  # the same rollouts


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rollout_logit_noise=1.0, rollout_logit_noise_kind="tail", safe_vocab_rule="none"),
         r"^rollout_logit_noise_kind='tail' lifts the tokens a rule cuts, but its rule is safe_vocab_rule "
         r"\(rollout_tail_rule unset\)='none'"),
        (dict(rollout_logit_noise=1.0, rollout_logit_noise_kind="tail", rollout_tail_rule="none"),
         r"its rule is rollout_tail_rule='none'"),
        (dict(rollout_tail_rule="min_p=2"), "min_p"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        SafeVocabGRPOConfig(**grpo_kwargs(tmp_path, **kwargs))
    assert "\n" not in str(err.value)


def test_config_accepts_tail_and_keeps_the_rule_canonical(tmp_path):
    from trl_integration.commands.grpo import make_parser

    _, cfg, _, _ = make_parser().parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--model_name_or_path", "m", "--use_cpu", "true",
              "--rollout_logit_noise", "1", "--rollout_logit_noise_kind", "tail", "--rollout_tail_rule", "min_p=1e-2"]
    )  # fmt: skip
    assert cfg.rollout_logit_noise_kind == "tail" and cfg.rollout_tail_rule == "min_p=0.01"
    assert cfg.rollout_logprobs is True


def test_the_shipped_plugin_is_the_built_in_tail():
    factory = load_callable("examples.tail_perturbation:tail_perturbation", "--rollout_perturbation")
    processor = factory(0)
    from examples import tail_perturbation as example

    assert processor.kind == "tail" and processor.eps == example.EPS and str(processor.rule) == example.RULE
    scores = torch.randn(8, 400, generator=torch.Generator().manual_seed(2)) * 3
    cut = hand_min_p_cut(scores.numpy(), 0.01)
    assert example.RULE == "min_p=0.01" and example.TEMPERATURE == 1.0
    lift = (processor(None, scores.clone()) - scores).numpy()
    np.testing.assert_array_equal(lift > 0, cut)  # exactly the cut tokens
    np.testing.assert_allclose(lift[cut], example.EPS, rtol=1e-6)  # by EPS, up to the float32 rounding of the sum


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tail-perturbation-model")
    tiny[0].save_pretrained(path)
    tiny[1].save_pretrained(path)
    return str(path)


def k3(log_r: np.ndarray) -> np.ndarray:
    return np.exp(log_r) - log_r - 1.0


def test_diagnose_measures_the_tail_and_the_k3_share_below_the_cut(tiny, model_dir, tmp_path, capsys):
    model, tok = tiny
    result = run_diagnose(
        model,
        tok,
        ["hello", "the cat", "abc"],
        compare=(torch.float32, torch.float32),
        noise=1.0,
        noise_kind="tail",
        rule="min_p=0.5",
        max_new_tokens=6,
        num_samples=4,
        progress=False,
    )
    t = {k: v.numpy() for k, v in result.tokens.items()}
    terms = k3(t["log_r"])
    rule = result.summary["rule"]
    assert rule["k3_share_outside"] == pytest.approx(terms[~t["in_train_set"]].sum() / terms.sum(), rel=1e-9)
    removed = 1.0 - k3(t["pruned_log_r"][t["kept"]]).sum() / terms.sum()
    assert rule["k3_removable"] == pytest.approx(removed, rel=1e-9)
    assert 0.0 < rule["k3_share_outside"] < 1.0 and (~t["in_train_set"]).any()
    # the lifted tokens are the cut ones: their rollout log-probability rose relative to the kept ones'
    assert result.summary["sequence_metrics"]["k3_kl"] > 1e-3

    out = tmp_path / "diag"
    rc = main(
        [
            "diagnose",
            "--model",
            model_dir,
            "--prompts",
            "hello",
            "abc",
            "--max_new_tokens",
            "4",
            "--noise",
            "1",
            "--noise_kind",
            "tail",
            "--rule",
            "min_p=0.5",
            "--no_plots",
            "--output_dir",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["noise_kind"] == "tail" and summary["tail"]["sources"]
    assert "k3 below the cut" in capsys.readouterr().out
    assert (
        main(
            [
                "diagnose",
                "--model",
                model_dir,
                "--noise",
                "1",
                "--noise_kind",
                "tail",
                "--rule",
                "none",
                "--output_dir",
                str(tmp_path / "no"),
            ]
        )
        == 2
    )
    assert "--noise_kind tail lifts the tokens --rule cuts" in capsys.readouterr().err
