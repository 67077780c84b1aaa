"""Dataset mixtures in ``safevocab-grpo`` (``datasets:`` in the ``--config`` YAML), as trl's grpo script takes them.

The expected mixtures are worked out by hand from trl's documented rule (``DatasetConfig.fraction``: fractions are
normalised, the mixture is the largest size N at which no dataset is oversampled, and the first round(share * N)
rows of each are kept), not by calling trl.
"""

from __future__ import annotations

import json

import pytest
import yaml

from trl_integration.commands import grpo


def _jsonl(path, prefix, n):
    path.write_text("".join(json.dumps({"prompt": f"{prefix}{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


def _parse(config):
    parser = grpo.make_parser()
    script_args, _, _, dataset_args, _, _ = parser.parse_args_and_config(
        args=["--config", str(config), "--output_dir", "unused"], return_remaining_strings=True,
        separate_remaining_strings=True,
    )  # fmt: skip
    return script_args, dataset_args


def test_fractions_give_trls_shares(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", "a", 30)
    b = _jsonl(tmp_path / "b.jsonl", "b", 30)
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump({"datasets": [
        {"path": "json", "data_files": a, "fraction": 3}, {"path": "json", "data_files": b, "fraction": 1},
    ]}))  # fmt: skip
    train, test = grpo.load_train_dataset(*_parse(config))
    # shares 3/4 and 1/4; N = min(30 / 0.75, 30 / 0.25) = 40 -> the first 30 rows of a, the first 10 of b
    assert list(train["prompt"]) == [f"a{i}" for i in range(30)] + [f"b{i}" for i in range(10)]
    assert test is None


def test_without_fractions_the_datasets_are_concatenated_and_split(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", "a", 12)
    b = _jsonl(tmp_path / "b.jsonl", "b", 8)
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump({"datasets": [{"path": "json", "data_files": a, "columns": ["prompt"]},
                                                   {"path": "json", "data_files": b, "columns": ["prompt"]}],
                                      "test_split_size": 0.25}))  # fmt: skip
    train, test = grpo.load_train_dataset(*_parse(config))
    assert len(train) == 15 and len(test) == 5 and train.column_names == ["prompt"]
    assert sorted(list(train["prompt"]) + list(test["prompt"])) == sorted(
        [f"a{i}" for i in range(12)] + [f"b{i}" for i in range(8)]
    )


def test_a_mixture_trains_and_replaces_dataset_name(tmp_path, capsys, monkeypatch):
    """One step on the mixture: every prompt the reward sees comes from the mixture's files (not from
    --dataset_name synthetic, which is named too and ignored with a notice, as trl's script does)."""
    a = _jsonl(tmp_path / "a.jsonl", "17+", 10)
    b = _jsonl(tmp_path / "b.jsonl", "25+", 10)
    config = tmp_path / "mix.yaml"
    config.write_text(
        yaml.safe_dump({"datasets": [{"path": "json", "data_files": a}, {"path": "json", "data_files": b}]})
    )
    (tmp_path / "seen_reward.py").write_text(  # records every prompt it is shown, in a file beside it
        "import json, os\ndef reward(completions, prompts, **kw):\n"
        "    with open(os.path.join(os.path.dirname(__file__), 'seen.jsonl'), 'a') as f:\n"
        "        f.writelines(json.dumps(p) + '\\n' for p in prompts)\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    import importlib
    import sys

    monkeypatch.chdir(tmp_path)  # the command imports a dotted reward from the working directory, as trl's does
    importlib.invalidate_caches()
    try:
        from trl_integration.demo.model import tiny_model_path

        grpo.run(["--config", str(config), "--model_name_or_path", str(tiny_model_path()), "--dataset_name",
                  "synthetic", "--reward_funcs", "seen_reward.reward", "--max_steps", "1",
                  "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
                  "--report_to", "none", "--save_strategy", "no", "--output_dir", str(tmp_path / "out")])  # fmt: skip
    finally:
        sys.modules.pop("seen_reward", None)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert seen and all(p.startswith(("17+", "25+")) for p in seen), seen
    assert "the mixture is used and --dataset_name is ignored" in capsys.readouterr().out  # a notice: stdout (issue 31)


@pytest.mark.parametrize("entries, message", [
    ([{"path": "json", "data_files": "x.jsonl", "fraction": 0}], "datasets[0].fraction"),
    ([{"path": "./no/such/dir"}], "datasets[0].path"),
])  # fmt: skip
def test_bad_mixtures_are_refused_before_loading(entries, message, tmp_path):
    from trl_integration.commands.preflight import check_mixture

    (tmp_path / "x.jsonl").write_text('{"prompt": "p"}\n')
    config = tmp_path / "bad.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "datasets": [
                    {**e, "data_files": str(tmp_path / e["data_files"])} if "data_files" in e else e for e in entries
                ]
            }
        )
    )
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_mixture(_parse(config)[1])
