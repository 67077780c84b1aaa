"""``report.md`` and ``results.json`` of ``safevocab study``: the settings, the exact command, the held-out metric
and reward tables per arm (mean ± std over seeds), on the DVP rule's support too when scored there, the differences
per evaluation seed, the contrasts (:mod:`~trl_integration.study.contrasts`), the mismatch and pruning diagnostics,
failed runs and the figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

from trl_integration.demo.model import TINY_MODEL_NAME, is_tiny_model
from trl_integration.study.aggregate import BASELINES, FINAL_REWARD_STEPS, eval_seeds, metric_name, scorings
from trl_integration.study.arms import ARM_DESCRIPTIONS
from trl_integration.study.contrasts import contrasts
from trl_integration.study.plots import has_entropy_series, plot_metric, plot_specs

__all__ = ["format_stat", "format_status", "render_report", "write_report", "write_json"]


def format_stat(stat: dict | None, digits: int = 3, signed: bool = False) -> str:
    """``"mean ± std"`` of an aggregated outcome (``"–"`` when undefined)."""
    if not stat or stat.get("mean") is None:
        return "–"
    fmt = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    text = fmt.format(stat["mean"])
    if stat.get("std") is not None:
        text += f" ± {stat['std']:.{digits}f}"
    return text


def format_paired(stat: dict | None, digits: int = 3) -> str:
    """``"+mean [low, high]"`` of a paired difference with its 95 % confidence interval (``"–"`` when undefined)."""
    if not stat or stat.get("mean") is None:
        return "–"
    text = f"{stat['mean']:+.{digits}f}"
    if stat.get("ci95"):
        low, high = stat["ci95"]
        text += f" [{low:+.{digits}f}, {high:+.{digits}f}]"
    return text


def _g(stat: dict | None) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    return f"{stat['mean']:.3g}"


def format_status(entry: dict) -> str:
    """``"ok/runs"`` of an arm, with its failed and not-run counts."""
    text = f"{entry['ok']}/{entry['runs']}"
    if entry["failed"]:
        text += f" (**{len(entry['failed'])} failed**)"
    if entry["not_run"]:
        text += f" ({len(entry['not_run'])} not run)"
    return text


def _settings_rows(results: dict) -> list[tuple[str, str]]:
    s = results["settings"]
    env = results.get("environment", {})
    task = results.get("task") or {
        "name": "arithmetic",
        "reward_funcs": ["arithmetic_reward"],
        "metric_name": "accuracy",
        "description": "",
    }
    batch = s["num_prompts_per_step"] * s["num_generations"]
    mismatch = []
    if s["noise"] > 0:
        mismatch.append(f"{s['noise_kind']} logit noise, ε = {s['noise']:g} (rollout_logit_noise)")
    if s.get("rollout_mantissa_bits") is not None:
        bits = s["rollout_mantissa_bits"]
        mismatch.append(f"rollout weights rounded to {bits} mantissa bits (rollout_mantissa_bits)")
    if s.get("rollout_perturbation"):
        mismatch.append(f"rollout perturbation {s['rollout_perturbation']}")
    if s.get("sampler_rule"):
        mismatch.append(
            f"rollouts sampled with {s['sampler_rule']} (sampler_rule; rule-none arms score the full softmax)"
        )
    mismatch.append(f"rollout_dtype {s['rollout_dtype']}")
    injected = s["noise"] > 0 or s.get("rollout_mantissa_bits") is not None or s.get("rollout_perturbation")
    injected = injected or s.get("sampler_rule")
    if not injected and s["rollout_dtype"] in ("auto", "float32"):
        mismatch.append("no injected mismatch (fp32 rollout and fp32 training)")
    model = results.get("model") or "bundled"
    if is_tiny_model(model):
        model = f"{TINY_MODEL_NAME} (bundled)"
    metric = task["metric_name"]
    about = f"; {task['description']}" if task.get("description") else ""
    return [
        ("model", str(model)),
        (
            "task",
            f"{task['name']} (train pool {s['train_num_prompts']} prompts, seed 0), reward "
            f"{', '.join(task['reward_funcs'])}{about}",
        ),
        ("mismatch", "; ".join(mismatch)),
        ("steps per run", str(s["steps"])),
        (
            "batch",
            f"{s['num_prompts_per_step']} prompts × {s['num_generations']} generations = {batch} completions "
            f"per step, max_completion_length {s['max_completion_length']}",
        ),
        (
            "optimiser",
            f"AdamW, lr {s['learning_rate']:g}, schedule {s['lr_scheduler_type']} (dvp_length_decay: "
            "x the length-decay factor, 1 until a surge), beta 0, loss dapo (trl default), temperature 1",
        ),
        ("DVP rule", s["dvp_rule"]),
        (
            "IS settings",
            f"tis: token_truncate, clip_max {s['is_clip_max']:g}; mis and dvp_mis: {s['mis_mode']}, "
            f"[{s['is_clip_min']:g}, {s['is_clip_max']:g}]",
        ),
        ("seeds", ", ".join(str(x) for x in s["seeds"])),
        ("held-out evaluation", _evaluation_text(s, metric)),
        (
            "software",
            f"torch {env.get('torch')}, transformers {env.get('transformers')}, trl {env.get('trl')}, "
            f"python {env.get('python')}, {env.get('torch_threads')} torch threads",
        ),
        ("code", _code_text(results.get("code"))),
        ("wall time", f"{results['wall_time_s']:.0f} s in total" if results.get("wall_time_s") is not None else "–"),
    ]


def _code_text(code: dict | None) -> str:
    """The commit a study ran from and whether its tree was clean (``results["code"]``)."""
    if not code or not code.get("commit"):
        return "not recorded"
    state = {True: "clean tree", False: "**uncommitted changes**", None: "tree state unknown"}[code.get("clean")]
    return f"git {code['commit'][:12]} ({state})"


def _evaluation_text(s: dict, metric: str) -> str:
    """The settings row of the held-out evaluation (older results lack the newer evaluation settings)."""
    steps = s.get("eval_steps")
    when = (f"at steps {', '.join(map(str, steps))}" if steps else
            f"at step 0 and every {s['eval_every']} steps")  # fmt: skip
    text = f"{metric} on {s['eval_num_prompts']} held-out prompts of the task, {when}"
    if s.get("eval_seeds"):
        text += f"; drawn with evaluation seeds {', '.join(map(str, s['eval_seeds']))} (the metric is their mean)"
    if s.get("eval_on_rule"):
        text += f"; on the full distribution and on the support of {s['dvp_rule']} (every arm alike)"
    return text


def _held_out_table(summ: dict, arms: list[str], metric: str, suffix: str) -> list[str]:
    """The held-out table of one scoring (``suffix``: ``""`` full distribution, ``"_rule"`` the rule's support)."""
    baselines = [b for b in BASELINES if b in arms]
    lines = [
        f"| arm | runs ok | final {metric} | late {metric} | best {metric} |"
        + "".join(f" Δ final vs {b} | Δ late vs {b} |" for b in baselines),
        "|---|---|---|---|---|" + "---|---|" * len(baselines),
    ]
    for arm in arms:
        e = summ[arm]
        deltas = "".join(
            " – | – |"
            if arm == b
            else f" {format_paired(e.get(f'final_metric{suffix}_vs_{b}'))} | "
            f"{format_paired(e.get(f'late_metric{suffix}_vs_{b}'))} |"
            for b in baselines
        )
        lines.append(
            f"| {arm} | {format_status(e)} | {format_stat(e[f'final_metric{suffix}'])} | "
            f"{format_stat(e[f'late_metric{suffix}'])} | {format_stat(e[f'best_metric{suffix}'])} |{deltas}"
        )
    return lines


def _scoring_name(suffix: str, rule: str) -> str:
    return f"rule's support ({rule})" if suffix else "full distribution"


def _eval_seed_lines(results: dict, arms: list[str], metric: str, hh: str) -> list[str]:
    """Δ late metric vs each baseline, for each evaluation seed alone (robustness to the evaluation draw)."""
    seeds = eval_seeds(results)
    baselines = [b for b in BASELINES if b in arms]
    if not seeds or not baselines:
        return []
    summ, rule = results["summary"], results["settings"]["dvp_rule"]
    lines = [f"{hh} Per evaluation seed", "",
             f"Δ late {metric} against each baseline, scored with each evaluation seed alone (mean over the training "
             "seeds [95 % CI]); the tables above use their mean.", "",
             "| arm | vs | scoring |" + "".join(f" eval seed {x} |" for x in seeds),
             "|---|---|---|" + "---|" * len(seeds)]  # fmt: skip
    for suffix in scorings(results):
        for arm in arms:
            for b in baselines:
                per_seed = summ[arm].get(f"late_metric{suffix}_vs_{b}_by_eval_seed")
                if arm == b or not per_seed:
                    continue
                cells = "".join(f" {format_paired(x, 4)} |" for x in per_seed)
                lines.append(f"| {arm} | {b} | {_scoring_name(suffix, rule)} |{cells}")
    return lines + [""]


def _contrast_lines(results: dict, metric: str, hh: str) -> list[str]:
    """The contrasts that ran (:mod:`~trl_integration.study.contrasts`), late metric, every scoring."""
    found = contrasts(results)
    if not found:
        return []
    rule = results["settings"]["dvp_rule"]
    lines = [f"{hh} Contrasts", "",
             f"Signed combinations of arms, paired by training seed: Δ late {metric}, mean [95 % CI] over the seeds "
             "where every arm of the contrast finished, its 90 % interval (an equivalence test within a margin d by "
             "two one-sided 5 % tests holds when it lies inside (−d, d)), the seeds' values, and the mean for each "
             "evaluation seed alone.", "",
             f"| contrast | definition | scoring | Δ late {metric} | 90 % CI | per training seed | "
             "per evaluation seed |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, c in found.items():
        for suffix in scorings(results):
            late = c[f"late_metric{suffix}"]
            per_seed = ", ".join(f"{d:+.4f}" for d in late["diffs"]) or "–"
            by_eval = c.get(f"late_metric{suffix}_by_eval_seed")
            per_eval = ", ".join("–" if x["mean"] is None else f"{x['mean']:+.4f}" for x in by_eval) if by_eval else "–"
            ci90 = f"[{late['ci90'][0]:+.4f}, {late['ci90'][1]:+.4f}]" if late.get("ci90") else "–"
            lines.append(
                f"| `{name}` | {c['formula']}: {c['description']} | {_scoring_name(suffix, rule)} | "
                f"{format_paired(late, 4)} | {ci90} | {per_seed} | {per_eval} |"
            )
    return lines + [""]


def render_report(
    results: dict, image_prefix: str = "", heading_level: int = 1, plots: bool = True, title: str | None = None
) -> str:
    """The Markdown of ``report.md``.

    Args:
        results: the dict `run_study` returns (or ``results.json`` loaded).
        image_prefix: prepended to the PNG file names in the image links (e.g. ``"img/study/eps0.5/"``).
        heading_level: level of the top heading (``1`` = ``#``); the sections are one level deeper.
        plots: include the figure links.
        title: the top heading's text (default: "safevocab study: arms × seeds × steps").
    """
    h = "#" * heading_level
    hh = "#" * (heading_level + 1)
    s = results["settings"]
    summ = results["summary"]
    arms = list(results["arms"])
    metric = metric_name(results)
    title = title or f"safevocab study: {len(arms)} arms × {len(s['seeds'])} seeds × {s['steps']} steps"
    lines = [f"{h} {title}", ""]
    lines += [f"{hh} Command", "", "```bash", results["command"], "```", ""]
    if results.get("command_full") and results["command_full"] != results["command"]:
        lines += ["With every flag explicit:", "", "```bash", results["command_full"], "```", ""]
    lines += [f"{hh} Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _settings_rows(results)]
    lines += ["", "Arms:", ""]
    for arm in arms:
        what = ARM_DESCRIPTIONS.get(arm, "custom arm")
        lines.append(f"- `{arm}`: {what} — `{_overrides_text(results['arms'][arm])}`")
    initial = [summ[a]["initial_metric"]["mean"] for a in arms if summ[a]["initial_metric"]["mean"] is not None]
    lines += ["", f"{hh} Held-out {metric}", ""]
    if initial:
        lines.append(f"Held-out {metric} before training: {initial[0]:.3f} (the same model for every run).")
        lines.append("")
    lines += [
        "Mean ± sample standard deviation over the seeds that finished. *final*: at the last step; *late*: the mean "
        "of the evaluations in the second half of training; *best*: the highest of the evaluations after step 0; "
        "*Δ vs X*: the difference to arm X with the same seed, averaged over seeds, with its 95 % confidence "
        "interval (Student's t over the paired differences).",
        "",
        *_held_out_table(summ, arms, metric, ""),
    ]
    if "_rule" in scorings(results):
        lines += ["", f"{hh} Held-out {metric} on the rule's support", "",
                  f"The same evaluations, with completions sampled on the safe vocabulary of {s['dvp_rule']} "
                  "(renormalised), every arm alike, as a DVP-trained policy is deployed.", "",
                  *_held_out_table(summ, arms, metric, "_rule")]  # fmt: skip
    lines += ["", *_eval_seed_lines(results, arms, metric, hh), *_contrast_lines(results, metric, hh)]
    lines = lines[:-1] if lines[-1] == "" else lines
    lines += [
        "",
        f"{hh} Training reward and mismatch",
        "",
        f"*final reward*: mean training-batch reward of the last {FINAL_REWARD_STEPS} steps (first "
        f"{FINAL_REWARD_STEPS} steps for *first reward*). The other columns are means over all steps: log-ppl gap "
        "`mismatch/log_ppl_abs_diff`, k3 KL `mismatch/k3_kl`, out-of-set `safevocab/out_of_set_frac`, "
        "IS clipped/masked `mismatch/is_clipped_frac` (IS arms only), gradient norm before clipping, the rule's "
        "pruned mass `safevocab/pruned_mass_mean` and the sequence total variation to the unpruned policy "
        "`safevocab/seq_tv_estimate` (arms with a rule only).",
        "",
        "| arm | first reward | final reward | log-ppl gap | k3 KL | out-of-set | IS clipped/masked | grad norm | "
        "length | pruned mass | seq TV | s / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        e = summ[arm]
        lines.append(
            f"| {arm} | {format_stat(e['first_reward'])} | {format_stat(e['final_reward'])} | {_g(e['log_ppl_gap'])} | "
            f"{_g(e['k3_kl'])} | {_g(e['out_of_set_frac'])} | {_g(e['is_clipped_frac'])} | {_g(e['grad_norm'])} | "
            f"{_g(e['mean_length'])} | {_g(e.get('pruned_mass'))} | {_g(e.get('seq_tv'))} | {_g(e['wall_time_s'])} |"
        )
    for arm in arms:
        if summ[arm].get("identical_to"):
            lines += [
                "",
                f"`{arm}` reproduced `{summ[arm]['identical_to']}` exactly: the same per-step reward, "
                f"gradient norm and held-out {metric} in every seed.",
            ]
    decays = [(a, summ[a]["length_decay"]) for a in arms if summ[a].get("length_decay")]
    for arm, d in decays:
        if d["surges_detected"] == 0:
            lines += [
                "",
                f"`{arm}`: the response-length surge detector never fired ({d['runs']} runs), so the LR "
                "stayed at its initial value.",
            ]
        else:
            lines += [
                "",
                f"`{arm}`: the surge detector fired in {d['surges_detected']} of {d['runs']} runs "
                f"(surge steps {d['surge_steps']}, decay periods {d['decay_periods']}).",
            ]
    lines += ["", *_collapse_lines(summ, arms, hh)]
    failed = [(r["arm"], r["seed"], r.get("error")) for r in results["runs"] if r["status"] == "failed"]
    not_run = [(r["arm"], r["seed"]) for r in results["runs"] if r["status"] == "not_run"]
    lines += ["", f"{hh} Failed runs", ""]
    if not failed and not not_run:
        lines.append("None: every (arm, seed) finished.")
    for arm, seed, err in failed:
        lines.append(f"- **{arm}, seed {seed}: failed** — `{err}` (traceback in results.json)")
    for arm, seed in not_run:
        lines.append(f"- {arm}, seed {seed}: not run (the study was interrupted; `--resume` trains what is missing)")
    if plots:
        lines += [
            "",
            f"{hh} Figures",
            "",
            f"One line per arm: the mean over seeds; the band spans the smallest to the largest seed. Training "
            f"metrics are smoothed with a trailing {s['smooth']}-step moving average (raw series in "
            "results.json).",
            "",
        ]
        specs = plot_specs(metric, rule="_rule" in scorings(results), entropy=has_entropy_series(results))
        for stem, (_, label, _) in specs.items():
            lines += [f"![{label}]({image_prefix}{stem}.png)", ""]
    return "\n".join(lines).rstrip() + "\n"


def _collapse_lines(summ: dict, arms: list[str], hh: str) -> list[str]:
    """The collapse table (:mod:`trl_integration.study.collapse`) with the policy's entropy at the start and the end."""
    lines = [
        f"{hh} Collapse and entropy",
        "",
        "Collapse (Study 4's registered criterion, `trl_integration.study.collapse`): a non-finite loss or gradient "
        "norm; a gradient norm above 10x its median over steps 1-50 for 10 consecutive steps; the 10-step mean "
        "training reward below half its running maximum for 50 steps after step 100; or the 10-step mean entropy of "
        "the full softmax below 0.1 nats for 10 steps. Counted over the runs that trained (failed runs included); "
        "*onsets*: seed: step (criterion). Entropy: the mean over the first and the last "
        f"{FINAL_REWARD_STEPS} steps, of the full softmax and over the trainer's kept set (nats; – where the runs "
        "did not log it).",
        "",
        "| arm | collapsed | onsets | entropy, full softmax: first → last | entropy, kept set: first → last |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        e = summ[arm]
        c = e.get("collapse") or {"runs": 0, "collapsed": 0, "by_seed": {}}
        onsets = ", ".join(
            f"{seed}: {r['step']} ({r['criterion']})" for seed, r in c["by_seed"].items() if r["collapsed"]
        )
        lines.append(
            f"| {arm} | {c['collapsed']} of {c['runs']} | {onsets or 'none'} | "
            f"{_g(e.get('entropy_full_first'))} → {_g(e.get('entropy_full_final'))} | "
            f"{_g(e.get('entropy_kept_first'))} → {_g(e.get('entropy_kept_final'))} |"
        )
    return lines


def _overrides_text(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


def write_report(results: dict, output_dir: str | os.PathLike, plots: bool = True) -> list[Path]:
    """Write ``results.json``, ``report.md`` and (with ``plots``) one PNG per entry of ``plot_specs(metric)``.

    Returns:
        The written paths, ``report.md`` first.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.md", out / "results.json"]
    if plots:
        specs = plot_specs(metric_name(results), rule="_rule" in scorings(results), entropy=has_entropy_series(results))
        for stem in specs:
            plot_metric(results, stem, out / f"{stem}.png")
            files.append(out / f"{stem}.png")
    results["files"] = [f.name for f in files]
    write_json(results, out / "results.json")
    (out / "report.md").write_text(render_report(results, plots=plots), encoding="utf-8")
    return files


def write_json(results: dict, path: Path) -> None:
    """Write ``results`` as strict JSON (``NaN`` is an error: undefined values are ``None``)."""
    path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n", encoding="utf-8")
