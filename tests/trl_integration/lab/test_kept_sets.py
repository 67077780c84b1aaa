"""``safevocab diagnose``'s kept-set statistics (issue 40, point 4) on the bundled tiny model: each side's kept-set
size and pruned mass per position, against a direct computation of the rule on the two sides' logits; the summary's
distributions, the console lines and ``kept_sets.png``."""

from __future__ import annotations

import json

import pytest
import torch

from trl_integration.commands import main
from trl_integration.lab import default_texts, run_diagnose
from trl_integration.lab.kept_sets import kept_set_stats
from trl_integration.lab.sides import model_in

MIN_P = 0.05
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def direct_kept_sets(model, tokenizer, texts, dtype):
    """Per scored position: min_p's kept-set size and pruned mass on ``model`` in ``dtype`` (float64 softmax)."""
    side = model_in(model, dtype, {})  # the lab's cast of the weights (buffers such as RoPE's keep float32)
    sizes, masses = [], []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            p = side(ids).logits[0, :-1].double().softmax(-1)
        kept = p >= MIN_P * p.max(-1, keepdim=True).values
        sizes.append(kept.sum(-1))
        masses.append(1 - (p * kept).sum(-1))
    return torch.cat(sizes), torch.cat(masses)


def test_kept_set_sizes_and_pruned_mass_match_the_rule_on_each_side(bundled_tiny):
    model, tokenizer = bundled_tiny
    texts = default_texts(6)
    res = run_diagnose(model, tokenizer, texts, rule=f"min_p={MIN_P}", batch_size=1, progress=False)
    stats = res.summary["rule"]["kept_sets"]
    for dtype, side in ((torch.float32, "train"), (torch.bfloat16, "rollout")):
        sizes, masses = direct_kept_sets(model, tokenizer, texts, dtype)
        assert torch.equal(res.tokens[f"kept_size_{side}"].long(), sizes.long()), side
        pruned = -torch.expm1(res.tokens[f"log_kept_mass_{side}"])
        torch.testing.assert_close(pruned, masses, atol=1e-5, rtol=1e-4)
        assert stats[f"kept_size_{side}"]["p50"] == pytest.approx(float(sizes.double().median().item()), abs=0.5)
        assert stats[f"kept_size_{side}"]["max"] == float(sizes.max())
        assert stats[f"pruned_mass_{side}"]["mean"] == pytest.approx(float(masses.mean()), abs=1e-5)
    assert stats["n"] == res.summary["n_tokens"]
    assert stats["set_differ_frac"] == pytest.approx(res.summary["rule"]["set_differ_frac"])
    assert 0 < stats["pruned_mass_train"]["mean"] < 1 and stats["kept_size_train"]["p99"] >= 1


def test_kept_set_stats_quantiles_and_errors():
    size = torch.arange(1, 101)
    log_kept = torch.log1p(-torch.full((100,), 0.25))
    stats = kept_set_stats(size, size, log_kept, log_kept, torch.zeros(100, dtype=torch.bool))
    assert stats["kept_size_train"]["p50"] == pytest.approx(50.5)
    assert stats["kept_size_train"]["p99"] == pytest.approx(99.01)
    assert stats["pruned_mass_rollout"]["p90"] == pytest.approx(0.25)
    assert stats["set_differ_frac"] == 0.0
    with pytest.raises(ValueError, match=r"position counts \[99, 100\]: expected one count >= 1"):
        kept_set_stats(size[:99], size, log_kept, log_kept, torch.zeros(100, dtype=torch.bool))


def test_the_command_writes_prints_and_plots_them(bundled_tiny, tmp_path, capsys):
    rc = main(["diagnose", "--rule", f"min_p={MIN_P}", "--no_tail", "--output_dir", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["rule"]["kept_sets"]) >= {"kept_size_train", "pruned_mass_train", "set_differ_frac"}
    assert (tmp_path / "kept_sets.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "kept-set size (training side)" in out and "sampler/trainer sets differ" in out
