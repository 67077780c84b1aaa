"""scripts/study3_analysis.py, the pre-registered analysis of Study 3, on hand-made results with known answers."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")

from test_study2_analysis import JITTER, SEEDS, _results, _run

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "study3_analysis.py"


@pytest.fixture(scope="module")
def analysis():
    spec = importlib.util.spec_from_file_location("study3_analysis", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: a seed-dependent wobble with mean 0 (no_remedy under bf16: no harm)
WOBBLE = (0.001, -0.001, 0.0005, -0.0005, 0.0)


def _study(values: dict[str, list[float]], **settings) -> dict:
    results = _results([_run(a, s, v, v) for a, vs in values.items() for s, v in zip(SEEDS, vs)])
    results["settings"].update(settings)
    return results


def _tail_values(eps: float, k3: float) -> dict[str, list[float]]:
    harm = -0.004 * (math.log10(k3) + 5)  # -0.004 per decade of k3
    values = {"no_remedy": [0.120 + j + harm for j in JITTER], "dvp": [0.117 + j for j in JITTER]}
    if eps == 1.07:
        values.update(tis=[0.118 + j for j in JITTER], dvp_tis=[0.117 + j for j in JITTER])
    return values


@pytest.fixture()
def files(analysis, tmp_path):
    trunc = _study(
        {
            "no_mismatch": [0.120 + j for j in JITTER],
            "no_remedy": [0.100 + 1.5 * j for j in JITTER],
            "tis": [0.110 + j for j in JITTER],
            "dvp": [0.1195 + j + w for j, w in zip(JITTER, WOBBLE)],
            "dvp_tis": [0.118 + j for j in JITTER],
        },
        noise=0.0,
        noise_kind="uniform",
    )
    bf16 = _study(
        {
            "no_mismatch": [0.120 + j for j in JITTER],
            "dvp_no_mismatch": [0.117 + j for j in JITTER],
            "no_remedy": [0.120 + j + w for j, w in zip(JITTER, WOBBLE)],
            "tis": [0.120 + j for j in JITTER],
            "dvp": [0.117 + j for j in JITTER],
            "dvp_tis": [0.117 + j for j in JITTER],
        },
        noise=0.0,
        noise_kind="uniform",
    )
    paths = {"trunc": tmp_path / "trunc.json", "bf16": tmp_path / "bf16.json"}
    paths["trunc"].write_text(json.dumps(trunc))
    paths["bf16"].write_text(json.dumps(bf16))
    tails = []
    for eps, k3 in analysis.DOSE_K3.items():
        path = tmp_path / f"tail-{eps:g}.json"
        path.write_text(json.dumps(_study(_tail_values(eps, k3), noise=eps, noise_kind="tail")))
        tails.append(path)
    return paths, tails


def _argv(paths, tails, *extra):
    return ["--trunc", str(paths["trunc"]), "--bf16", str(paths["bf16"]), "--tail", *map(str, tails), *extra]


def test_estimands_slopes_and_decisions_are_the_known_answers(analysis, files, tmp_path, capsys):
    paths, tails = files
    out = tmp_path / "out.json"
    assert analysis.main(_argv(paths, tails, "--json", str(out))) == 0
    report = json.loads(out.read_text())
    for scoring in ("rule", "full"):
        part = report[scoring]
        e, d = part["estimands"], part["decisions"]
        assert e["trunc"]["harm"]["mean"] == pytest.approx(-0.020)
        assert e["trunc"]["dvp_minus_tis"]["mean"] == pytest.approx(0.0095)
        assert e["trunc"]["dvp_residual_clean"]["mean"] == pytest.approx(-0.0005)
        assert "dvp_residual_harm" not in e["trunc"]  # trunc has no dvp_no_mismatch arm: DVP is matched there
        assert d["trunc"]["harm"]["decision"] == "harm detected" and d["trunc"]["harm"]["robust"]
        assert d["trunc"]["dvp_minus_tis"]["decision"] == "DVP above TIS"
        assert d["trunc"]["dvp_residual_clean"]["decision"] == "reaches the clean control (equivalent)"
        assert d["bf16"]["harm"]["decision"] == "no harm (equivalent to 0)"
        assert d["bf16"]["dvp_minus_tis"]["decision"] == "TIS above DVP, within the margin"
        assert d["bf16"]["dvp_residual_clean"]["decision"] == "below the clean control, within the margin"
        assert d["bf16"]["dvp_removal"]["decision"] == "DVP does not reduce the harm"  # there was none
        assert set(e) == {"trunc", "bf16", "tail@0.03", "tail@0.1", "tail@0.3", "tail@1.07"}
        assert "dvp_minus_tis" in e["tail@1.07"] and "dvp_minus_tis" not in e["tail@0.1"]
        assert d["tail@1.07"]["dvp_removal"]["decision"] == "DVP removes the harm"
        slopes = part["slopes"]
        assert slopes["harm"]["mean"] == pytest.approx(-0.004) and slopes["harm"]["n"] == 5
        assert slopes["dvp_interaction"]["mean"] == pytest.approx(0.004)
        assert slopes["harm"]["doses"] == [0.03, 0.1, 0.3, 1.07]
        assert d["dose"]["harm"]["decision"] == d["dose"]["dvp_interaction"]["decision"] == "dose-response detected"
        for condition, name in analysis.PRIMARY:
            assert "bonferroni" in d[condition][name], (condition, name)
    printed = capsys.readouterr().out
    assert (
        "| trunc | dvp_minus_tis | +0.0095 |" in printed
        and "| dose | slope of harm per decade of k3 | -0.0040" in printed
        and printed.count("Primary family") == 2
    )
    assert report["code"] == {"commits": {"not recorded": 105}, "dirty_runs": [], "mixed": False}


def test_ols_slope(analysis):
    assert analysis.ols_slope([0, 1, 2], [1, 3, 5]) == pytest.approx(2.0)
    assert analysis.ols_slope([-4.1, -3.1, -2.1, -0.9], [0.0, -0.1, -0.2, -0.32]) == pytest.approx(-0.1, abs=0.01)


def test_records_from_two_commits_are_refused_unless_told(analysis, files, capsys):
    paths, tails = files
    bf16 = json.loads(paths["bf16"].read_text())
    for run in bf16["runs"]:
        run["code"] = {"commit": "c" * 40, "clean": True}
    paths["bf16"].write_text(json.dumps(bf16))
    assert analysis.main(_argv(paths, tails)) == 2
    assert "the records come from 2 code versions" in capsys.readouterr().err
    assert analysis.main(_argv(paths, tails, "--allow_mixed_commits")) == 0


def test_a_tail_size_that_was_not_registered_is_refused(analysis, files, tmp_path, capsys):
    paths, tails = files
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(_study(_tail_values(0.5, 0.03), noise=0.5, noise_kind="tail")))
    assert analysis.main(_argv(paths, [*tails, odd])) == 2
    assert "--noise 0.5 --noise_kind tail is not one of the registered sizes" in capsys.readouterr().err


def test_plot_draws(analysis, files, tmp_path):
    pytest.importorskip("matplotlib")
    paths, tails = files
    png = tmp_path / "estimands.png"
    assert analysis.main(_argv(paths, tails, "--plot", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _real_lm_run(arm: str, seed: int, late: float) -> dict:
    """A finished run of the real-LM arm's shape: 60 steps, evaluations at steps 40, 50, 60 (all late) on both
    scorings, two evaluation seeds ±0.001 around ``late`` (the rule's support 0.01 above the full distribution)."""
    rule = late + 0.01
    return {
        "arm": arm,
        "seed": seed,
        "status": "ok",
        "eval": {
            "step": [40, 50, 60],
            "reward": [late] * 3,
            "reward_rule": [rule] * 3,
            "eval_seeds": [0, 1],
            "reward_by_seed": [[late - 0.001, late + 0.001]] * 3,
            "reward_rule_by_seed": [[rule - 0.001, rule + 0.001]] * 3,
        },
        "series": {  # the stock arms log the truncated sampler's mismatch, DVP and the control none
            "step": [30, 60],
            "reward": [0.1, 0.1],
            "mismatch/k3_kl": [0.04, 0.06] if arm in ("no_remedy", "tis") else [0.0, 0.0],
            "mismatch/log_ppl_diff": [0.2, 0.3 + seed / 1000] if arm in ("no_remedy", "tis") else [0.0, 0.0],
        },
    }


def test_the_real_lm_arms_registered_command_reads_its_shape(analysis, tmp_path, capsys):
    """The SmolLM2 arm (docs/results.md): --trunc alone, three seeds, no dvp_tis or dvp_no_mismatch arm; its trunc
    rows are its estimands, with Student's t on 2 degrees of freedom (95 % t = 4.303)."""
    seeds, jitter = (11, 12, 13), (0.0, 0.002, -0.002)
    values = {
        "no_mismatch": [0.120 + j for j in jitter],
        "no_remedy": [0.100 + 2 * j for j in jitter],  # harm -0.020, paired std 0.002
        "tis": [0.110 + j for j in jitter],
        "dvp": [0.119 + j + w for j, w in zip(jitter, (0.001, -0.0005, -0.0005))],  # residual -0.001 ± a wobble
    }
    results = _results([_real_lm_run(a, s, v) for a, vs in values.items() for s, v in zip(seeds, vs)])
    results["settings"].update(steps=60, noise=0.0, noise_kind="uniform")
    path, out = tmp_path / "smollm2-trunc.json", tmp_path / "smollm2-analysis.json"
    path.write_text(json.dumps(results))
    assert analysis.main(["--trunc", str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for scoring in ("rule", "full"):
        e, d = report[scoring]["estimands"], report[scoring]["decisions"]
        assert set(e) == {"trunc"} and not report[scoring]["slopes"]
        harm = e["trunc"]["harm"]
        assert harm["mean"] == pytest.approx(-0.020) and harm["n"] == 3 and harm["seeds"] == list(seeds)
        assert harm["ci95"][1] - harm["mean"] == pytest.approx(4.303 * 0.002 / math.sqrt(3), rel=1e-3)
        assert e["trunc"]["dvp_minus_tis"]["mean"] == pytest.approx(0.009)
        assert e["trunc"]["dvp_residual_clean"]["mean"] == pytest.approx(-0.001)
        assert e["trunc"]["tis_residual_harm"]["mean"] == pytest.approx(-0.010)
        assert e["trunc"]["dvp_gain"]["mean"] == pytest.approx(0.019)
        assert {"dvp_tis_minus_dvp", "dvp_residual_harm"}.isdisjoint(e["trunc"])  # arms not run
        assert d["trunc"]["harm"]["decision"] == "harm detected"
        assert d["trunc"]["dvp_minus_tis"]["decision"] == "DVP above TIS"
        assert d["trunc"]["dvp_residual_clean"]["decision"] == "reaches the clean control (equivalent)"
        assert "dose" not in d
    mechanism = report["mechanism"]["trunc"]
    assert mechanism["no_remedy"]["k3_kl"] == pytest.approx(0.05) and mechanism["no_remedy"]["n"] == 3
    assert mechanism["tis"]["log_ppl_diff"] == pytest.approx(0.25 + 0.012 / 2)  # mean over steps, then seeds
    assert mechanism["dvp"]["k3_kl"] == mechanism["no_mismatch"]["log_ppl_diff"] == 0.0
    printed = capsys.readouterr().out
    assert "| trunc | no_remedy | 0.05 | 0.256 | 3 |" in printed
    assert "| bf16 | harm | – | not run | not run |" in printed  # the plan's primary family: not this arm's
