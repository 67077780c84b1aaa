"""``safevocab study`` end to end on a few steps, and the main job (``safevocab-grpo`` with no model) on three.

The study tests run the real command through ``safevocab``'s entry point (``trl_integration.commands.main``), on the
bundled tiny model with a small batch, and check that the report folder is complete and well formed.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from trl_integration.commands import main as safevocab_main
from trl_integration.study import ARM_NAMES, PLOTS, StudySettings, arm_overrides, run_study

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: A study small enough for the fast test suite: 2 arms x 1 seed x 3 steps, batch 4 x 4, 12 held-out problems.
SMALL_STUDY = [
    "--arms", "no_remedy", "dvp",
    "--seeds", "0",
    "--steps", "3",
    "--eval_every", "2",
    "--eval_num_prompts", "12",
    "--num_prompts_per_step", "4",
    "--num_generations", "4",
    "--train_num_prompts", "64",
    "--smooth", "2",
    "--quiet",
]  # fmt: skip


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000, f"{path.name} is suspiciously small ({len(data)} bytes)"
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    # IHDR comes first: width and height are positive.
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


def table_rows(markdown: str, header_start: str) -> dict[str, list[str]]:
    """Rows of the Markdown table whose header line starts with ``header_start``, keyed by the first cell."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    assert set(lines[start + 1].replace("|", "").strip()) <= set("-: "), "no separator line under the header"
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def small_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    rc = safevocab_main(["study", *SMALL_STUDY, "--output_dir", str(out)])
    return rc, out


def test_study_writes_a_complete_report(small_study):
    rc, out = small_study
    assert rc == 0
    report = (out / "report.md").read_text(encoding="utf-8")
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))

    # The command and the settings are recorded.
    assert "safevocab study" in report and "--noise 0.5" in report
    assert results["settings"]["steps"] == 3 and results["settings"]["arms"] == ["no_remedy", "dvp"]

    # The accuracy table has a row per arm, with a number for final and best accuracy.
    rows = table_rows(report, "| arm | runs ok | final accuracy")
    assert list(rows) == ["no_remedy", "dvp"]
    for arm, cells in rows.items():
        assert cells[0] == "1/1", (arm, cells)
        for cell in cells[1:3]:
            value = float(cell.split("±")[0])
            assert 0.0 <= value <= 1.0
    # The reward table too.
    reward_rows = table_rows(report, "| arm | first reward | final reward")
    assert list(reward_rows) == ["no_remedy", "dvp"]
    assert all(0.0 <= float(cells[1]) <= 1.0 for cells in reward_rows.values())
    assert "None: every (arm, seed) finished." in report
    collapse_rows = table_rows(report, "| arm | collapsed | onsets")
    assert [cells[:2] for cells in collapse_rows.values()] == [["0 of 1", "none"]] * 2
    for stem in ("entropy_full", "entropy_kept"):
        assert_png(out / f"{stem}.png")
        assert f"]({stem}.png)" in report

    # One valid PNG per metric, each linked from the report.
    for stem in PLOTS:
        assert_png(out / f"{stem}.png")
        assert f"]({stem}.png)" in report

    # results.json: every run with its per-step series and its held-out evaluations.
    assert [(r["arm"], r["seed"], r["status"]) for r in results["runs"]] == [("no_remedy", 0, "ok"), ("dvp", 0, "ok")]
    for run in results["runs"]:
        series = run["series"]
        assert series["step"] == [1, 2, 3]
        for key in (
            "reward",
            "grad_norm",
            "completions/mean_length",
            "mismatch/log_ppl_abs_diff",
            "safevocab/out_of_set_frac",
            "learning_rate",
        ):
            assert len(series[key]) == 3 and all(isinstance(v, float) for v in series[key]), key
        # the policy's entropy, full and over the kept set (the dvp arm's kept set is smaller)
        full, kept = series["safevocab/entropy_full"], series["safevocab/entropy_kept"]
        assert len(full) == len(kept) == 3 and all(f >= k - 1e-6 for f, k in zip(full, kept))
        assert run["nonfinite"] == {} and run["parameters_finite"] is True and run["stopped_non_finite"] is False
        assert run["eval"]["step"] == [0, 2, 3]
        assert all(0.0 <= a <= 1.0 for a in run["eval"]["accuracy"])
        # The same model before training: the same step-0 accuracy in every arm.
        assert run["eval"]["accuracy"][0] == results["runs"][0]["eval"]["accuracy"][0]
    # The injected noise creates a measurable gap; the arms differ in what the report says they do.
    gap = results["summary"]["no_remedy"]["log_ppl_gap"]["mean"]
    assert gap is not None and gap > 1e-3
    assert results["arms"]["dvp"]["safe_vocab_rule"] == "min_p=0.01"
    assert results["arms"]["no_remedy"]["safe_vocab_rule"] == "none"


def test_study_is_deterministic_per_seed(small_study, tmp_path):
    """Re-running one arm alone reproduces its series exactly: runs do not leak state into each other."""
    _, out = small_study
    first = json.loads((out / "results.json").read_text(encoding="utf-8"))
    args = list(SMALL_STUDY)
    args[args.index("--arms") + 1 : args.index("--arms") + 3] = ["dvp"]
    assert safevocab_main(["study", *args, "--no_plots", "--output_dir", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    before = next(r for r in first["runs"] if r["arm"] == "dvp")
    after = again["runs"][0]
    assert after["series"]["reward"] == before["series"]["reward"]
    assert after["series"]["grad_norm"] == before["series"]["grad_norm"]
    assert after["eval"] == before["eval"]


def test_a_crashing_arm_is_reported_as_failed(tmp_path):
    settings = StudySettings(
        arms=["no_remedy", "dvp"],
        seeds=[0],
        steps=1,
        eval_every=1,
        eval_num_prompts=4,
        num_prompts_per_step=2,
        num_generations=2,
        train_num_prompts=16,
        output_dir=str(tmp_path),
    )
    # A deliberately broken arm: the config rejects the rule, so the run fails before training.
    results = run_study(settings, arm_configs={"dvp": {"safe_vocab_rule": "min_p=1.5"}}, progress=False, plots=True)
    statuses = {r["arm"]: r["status"] for r in results["runs"]}
    assert statuses == {"no_remedy": "ok", "dvp": "failed"}
    failed = next(r for r in results["runs"] if r["arm"] == "dvp")
    assert "min_p" in failed["error"] and failed["traceback"]
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    rows = table_rows(report, "| arm | runs ok | final accuracy")
    assert set(rows) == {"no_remedy", "dvp"}  # the failed arm keeps its row
    assert "1 failed" in rows["dvp"][0] and rows["dvp"][1] == "–"
    assert re.search(r"\*\*dvp, seed 0: failed\*\*.*min_p", report)
    assert results["summary"]["dvp"]["failed"] and results["summary"]["dvp"]["ok"] == 0
    for stem in PLOTS:  # the plots still draw (the failed arm is labelled in the legend)
        assert_png(tmp_path / f"{stem}.png")
    json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))  # strict JSON (no NaN)


def test_a_run_crashing_mid_training_keeps_what_it_logged(tmp_path, monkeypatch):
    import trl_integration.demo.arithmetic as arithmetic

    calls = []
    real_reward = arithmetic.arithmetic_reward

    def reward_that_breaks(*args, **kwargs):
        if kwargs:  # a call from the trainer (the held-out accuracy calls it positionally)
            calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("reward server went away")
        return real_reward(*args, **kwargs)

    monkeypatch.setattr(arithmetic, "arithmetic_reward", reward_that_breaks)
    settings = StudySettings(
        arms=["no_remedy"],
        seeds=[0],
        steps=3,
        eval_every=1,
        eval_num_prompts=4,
        num_prompts_per_step=2,
        num_generations=2,
        train_num_prompts=16,
        output_dir=str(tmp_path),
    )
    results = run_study(settings, progress=False, plots=False)
    (run,) = results["runs"]
    assert run["status"] == "failed" and "reward server went away" in run["error"]
    assert run["series"]["step"] == [1] and len(run["series"]["reward"]) == 1  # step 1 finished, step 2 crashed
    assert run["eval"]["step"] == [0, 1]
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "0/1 (**1 failed**)" in report and "reward server went away" in report
    assert not list(tmp_path.glob("*.png"))  # plots=False


def test_a_run_driven_to_nan_is_recorded_as_a_non_finite_collapse(tmp_path):
    settings = StudySettings(
        arms=["no_remedy"], seeds=[0], steps=4, eval_every=4, eval_num_prompts=4, num_prompts_per_step=2,
        num_generations=2, train_num_prompts=16, output_dir=str(tmp_path),
    )  # fmt: skip
    # A deliberately unstable arm: an absurd learning rate without gradient clipping sends the weights to inf/NaN.
    unstable = {**arm_overrides("no_remedy", settings), "learning_rate": 1e30, "max_grad_norm": 0.0}
    results = run_study(settings, arm_configs={"no_remedy": unstable}, progress=False, plots=False)
    (run,) = results["runs"]
    assert run["status"] == "failed" and run["stopped_non_finite"] is True
    collapse = results["summary"]["no_remedy"]["collapse"]
    assert collapse["collapsed"] == 1 and collapse["by_seed"]["0"]["criterion"] == "non_finite"
    json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))  # strict JSON: the NaN is in `nonfinite`


def test_arms_differ_only_in_what_they_name():
    s = StudySettings()
    # issue 19 added dvp_mis and no_mismatch, issue 33 dvp_no_mismatch (tests/trl_integration/study/test_tasks.py and
    # test_evaluation.py); the default study keeps the five
    assert set(ARM_NAMES) == {
        "no_remedy",
        "tis",
        "mis",
        "dvp",
        "dvp_length_decay",
        "dvp_mis",
        "dvp_tis",
        "no_mismatch",
        "dvp_no_mismatch",
    }
    assert s.arms == ["no_remedy", "tis", "mis", "dvp", "dvp_length_decay"]
    assert arm_overrides("no_remedy", s) == {"safe_vocab_rule": "none", "vllm_importance_sampling_correction": False}
    assert arm_overrides("tis", s)["vllm_importance_sampling_mode"] == "token_truncate"
    assert arm_overrides("mis", s)["vllm_importance_sampling_mode"] in ("token_mask", "sequence_mask")
    dvp, dvp_ld = arm_overrides("dvp", s), arm_overrides("dvp_length_decay", s)
    assert dvp["safe_vocab_rule"] == s.dvp_rule and dvp["vllm_importance_sampling_correction"] is False
    assert {k: v for k, v in dvp_ld.items() if not k.startswith("length_decay")} == dvp
    assert dvp_ld["length_decay"] is True and dvp_ld["length_decay_period"] == "auto"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arms", "no_remedy", "no_remedy"], "repeats"),
        (["--seeds", "1", "1"], "--seeds"),
        (["--steps", "0"], "--steps"),
        (["--noise", "-0.1"], "--noise"),
        (["--is_clip_min", "3"], "--is_clip_min"),
        (["--dvp_rule", "min_p=2"], "min_p"),
    ],
)
def test_bad_flags_exit_2_before_any_work(argv, message, tmp_path, capsys):
    assert safevocab_main(["study", *argv, "--output_dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_main_job_writes_its_summary(tmp_path):
    """The default main job (bundled model and task, every bundled default) for 3 steps."""
    from trl_integration.commands.grpo import run

    out = tmp_path / "main-job"
    trainer = run(["--max_steps", "3", "--eval_num_prompts", "20", "--output_dir", str(out)])
    assert trainer.state.global_step == 3
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "reward_first", "reward_last", "metrics_last_step"):
        assert key in summary, key
    for key in ("accuracy_before", "accuracy_after", "reward_first", "reward_last"):
        assert isinstance(summary[key], float) and 0.0 <= summary[key] <= 1.0, (key, summary[key])
    assert summary["steps"] == 3 and summary["rule"] == "min_p=0.001"
    assert "mismatch/log_ppl_abs_diff" in summary["metrics_last_step"]
    history = json.loads((out / "log_history.json").read_text())
    assert isinstance(history, list) and any("reward" in h for h in history)
    assert any("train_runtime" in h for h in history)


def test_paired_differences_carry_a_95_percent_interval():
    """Worked by hand: arm a's final metrics minus no_remedy's, seed by seed, are +0.1, +0.2, +0.3 (mean 0.2,
    sample std 0.1); t_{0.975, 2} = 4.303, so the interval is 0.2 ± 4.303 * 0.1 / sqrt(3) = [-0.0484, 0.4484].
    The late metric averages the evaluations after half the last step (steps 6 and 10 of 0, 2, 6, 10)."""
    from trl_integration.study.aggregate import summarize

    def run(arm, seed, evals):
        return {"arm": arm, "seed": seed, "status": "ok", "series": {}, "wall_time_s": 1.0,
                "eval": {"step": [0, 2, 6, 10], "accuracy": evals}}  # fmt: skip

    runs = []
    for seed, (base, gain) in enumerate([(0.5, 0.1), (0.4, 0.2), (0.6, 0.3)]):
        runs.append(run("no_remedy", seed, [0.3, 0.3, base - 0.1, base]))
        runs.append(run("a", seed, [0.3, 0.3, base - 0.1 + gain, base + gain]))
    summary = summarize({"arms": {"no_remedy": {}, "a": {}}, "runs": runs})
    diff = summary["a"]["final_metric_vs_no_remedy"]
    assert diff["n"] == 3 and abs(diff["mean"] - 0.2) < 1e-12 and abs(diff["std"] - 0.1) < 1e-12
    assert diff["ci95"] == pytest.approx([0.2 - 4.303 * 0.1 / 3**0.5, 0.2 + 4.303 * 0.1 / 3**0.5])
    assert summary["a"]["late_metric_vs_no_remedy"]["mean"] == pytest.approx(0.2)
    assert summary["no_remedy"]["late_metric"]["mean"] == pytest.approx(((0.4 + 0.5) + (0.3 + 0.4) + (0.5 + 0.6)) / 6)
    assert "final_metric_vs_no_mismatch" not in summary["a"]  # no such arm ran


@pytest.mark.parametrize("stem", ["heldout_reward", "reward"])
def test_figure_titles_fit_the_figure(stem):
    """Every line of a figure's title is inside the figure: the subtitle of a study with rounded rollout weights
    and a plug-in perturbation (the longest mismatch label) was one line, cut at both edges of the PNG."""
    import matplotlib.pyplot as plt

    from trl_integration.study.plots import draw_metric

    settings = {
        "noise": 2.0,
        "noise_kind": "lift",
        "rollout_mantissa_bits": 2,
        "rollout_dtype": "auto",
        "smooth": 2,
        "rollout_perturbation": "my_project.perturbations:heavier_tail",
    }
    runs = [
        {
            "arm": arm,
            "seed": 0,
            "status": "ok",
            "eval": {"step": [0, 2], "reward": [0.1, 0.2]},
            "series": {"step": [1, 2], "reward": [0.1, 0.3]},
        }
        for arm in ("no_remedy", "dvp")
    ]
    results = {
        "settings": settings,
        "arms": {"no_remedy": {}, "dvp": {}},
        "runs": runs,
        "summary": {"no_remedy": {}, "dvp": {}},
        "task": {"metric_name": "reward"},
    }
    fig = draw_metric(results, stem)
    try:
        renderer = fig.canvas.get_renderer()
        figure_box = fig.bbox
        title_box = fig.axes[0].title.get_window_extent(renderer)
        assert figure_box.x0 <= title_box.x0 and title_box.x1 <= figure_box.x1, (title_box, figure_box)
        assert title_box.y1 <= figure_box.y1, (title_box, figure_box)
    finally:
        plt.close(fig)
