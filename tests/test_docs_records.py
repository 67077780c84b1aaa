"""Figures the docs quote from a record in ``docs/data`` agree with the record (issue 53: docs numbers that are
today's). Each entry names the page, the record (JSON under ``docs/data``) and the sentence as the page writes it,
with the record's values formatted in (``{r[...]}``): a figure re-measured in the record but not in the page, or the
other way round, fails here."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def signed(value: float, digits: int = 4) -> str:
    """A difference as the study pages write it: a sign, and U+2212 for a minus."""
    return f"{value:+.{digits}f}".replace("-", "\u2212")


QUOTED = [
    ("real_model.md", "real_model/vllm_smoke.json",
     "mean {r[steps][0][is_ratio_mean]:.6f} at step 1 and {r[steps][1][is_ratio_mean]:.6f} at step 2"),
    ("real_model.md", "real_model/vllm_smoke.json", "k3 {r[steps][0][k3_kl]:.1e} then {r[steps][1][k3_kl]:.1e}"),
    ("real_model.md", "real_model/vllm_smoke.json", "peak RSS {r[peak_rss_gib]:.2f} GiB"),
    ("real_model.md", "real_model/vllm_smoke.json", "{r[wall_s]} s in all"),
    ("real_model.md", "real_model/replay_smoke.json",
     "ratio mean {r[steps][0][is_ratio_mean]:.6f} at step 1 and {r[steps][1][is_ratio_mean]:.6f} at step 2"),
    ("real_model.md", "real_model/replay_smoke.json", "k3 {r[steps][0][k3_kl]:.1e} then {r[steps][1][k3_kl]:.1e}"),
    ("real_model.md", "real_model/replay_smoke.json",
     "pruned mass {r[steps][0][pruned_mass_mean]:.3f} and {r[steps][1][pruned_mass_mean]:.3f}"),
]  # fmt: skip

#: Study 3's outcome figures that the front pages quote (docs/data/study3/analysis.json).
STUDY3 = [
    ("results.md", ("full", "trunc", "tis_gain")),
    ("index.md", ("full", "trunc", "tis_gain")),
]


#: Study 4 (b)'s primary estimand, DVP − TIS late on the rule's support (docs/data/study4/analysis.json, the plan's
#: analysis): the outcome quotes it with its interval, the front pages rounded to three places.
STUDY4 = [("results.md", 4), ("index.md", 3), ("../README.md", 3)]


def record(name: str) -> dict:
    path = DOCS / "data" / name
    return json.loads(gzip.open(path).read() if path.suffix == ".gz" else path.read_text())


@pytest.mark.parametrize(("page", "name", "template"), QUOTED)
def test_a_quoted_figure_is_the_records(page, name, template):
    sentence = template.format(r=record(name))
    assert sentence in " ".join((DOCS / page).read_text().split()), f"{page} does not say: {sentence}"


@pytest.mark.parametrize(("page", "where"), STUDY3)
def test_study3s_quoted_gain_of_tis_is_the_analysis(page, where):
    scoring, condition, estimand = where
    stats = record("study3/analysis.json")[scoring]["estimands"][condition][estimand]
    text = " ".join((DOCS / page).read_text().split())
    assert signed(stats["mean"]).replace("\u2212", "-") in text.replace("\u2212", "-")
    if page == "results.md":  # the interval as well
        low, high = stats["ci95"]
        assert f"[{signed(low)}, {signed(high)}]".replace("\u2212", "-") in text.replace("\u2212", "-")


@pytest.mark.parametrize(("page", "digits"), STUDY4)
def test_study4s_quoted_dvp_against_tis_is_the_analysis(page, digits):
    stats = record("study4/analysis.json")["top_p"]["rule"]["late"]["dvp_minus_tis"]
    text = " ".join((DOCS / page).read_text().split()).replace("\u2212", "-")
    low, high = stats["ci95"]
    quoted = f"{signed(stats['mean'], digits)} [{signed(low, digits)}, {signed(high, digits)}]"
    assert quoted.replace("\u2212", "-") in text, f"{page} does not say: {quoted}"
