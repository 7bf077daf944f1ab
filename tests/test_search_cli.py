"""The search commands end to end through their parser: tune, capacity of the study's best, sweep."""
from __future__ import annotations

import argparse
import csv
import json

import optuna
import pytest
import yaml

from search_configs import write_config
from servetune.errors import UserError
from servetune.search import cli as search_cli
from servetune.search.evaluate import use_persistent_compilation_cache
from servetune.search.study import best_trials, load_study

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def parser():
    use_persistent_compilation_cache()
    parser = argparse.ArgumentParser()
    search_cli.register(parser.add_subparsers())
    return parser


def _run(parser, argv) -> int:
    args = parser.parse_args(argv)
    return args.func(args)


def _chat_data() -> dict:
    data = yaml.safe_load(open("examples/chat.yaml"))
    data["workload"]["num_requests"] = 200
    data["search"] = {"knobs": {"scheduler.max_num_seqs": {"choices": [8, 16]},
                                "scheduler.max_num_batched_tokens": {"choices": [256, 1024, 2048]}},
                      "batch_size": 4, "baselines": False}
    return data


def test_tune_then_capacity_of_its_best_then_a_sweep(parser, tmp_path, capsys):
    config = write_config(tmp_path, _chat_data())
    storage = str(tmp_path / "s.db")
    assert _run(parser, ["tune", str(config), "--trials", "6", "--sampler", "random", "--storage", storage,
                         "--study", "cli", "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    study, _ = load_study("cli", storage)
    assert len(study.trials) == 6
    assert printed["best"][0]["trial"] == best_trials(study)[0].number
    assert printed["best"][0]["request_goodput"] == best_trials(study)[0].value

    assert _run(parser, ["capacity", "--study", "cli", "--storage", storage, "--json"]) == 0
    capacity = json.loads(capsys.readouterr().out)
    assert capacity["slo_attainment"] >= capacity["target"] == 0.9
    assert capacity["of"] == f"study cli trial {printed['best'][0]['trial']}"

    out = tmp_path / "sweep.csv"
    assert _run(parser, ["sweep", str(config), "--param", "scheduler.max_num_batched_tokens",
                         "--values", "256,1024", "--out", str(out)]) == 0
    with open(out) as f:
        assert [row["scheduler.max_num_batched_tokens"] for row in csv.DictReader(f)] == ["256", "1024"]
    assert out.with_suffix(".png").exists()


@pytest.mark.parametrize("argv,message", [
    (["sweep", "examples/chat.yaml", "--param", "scheduler.max_num_seqs", "--values", "8,0"],
     "--set scheduler.max_num_seqs=0"),
    (["tune", "examples/chat.yaml", "--objectives", "goodput,p50"], "--objectives goodput,p50: got 'p50'"),
    (["tune", "examples/chat.yaml", "--trials", "0"], "--trials: got 0, expected an integer ≥ 1"),
    (["tune", "examples/chat.yaml", "--storage", "results/x.txt"], "--storage results/x.txt: expected a database URL"),
    (["capacity"], "capacity: give a config file or --study"),
])
def test_bad_input_is_one_clear_user_error(parser, argv, message):
    with pytest.raises(UserError) as error:
        _run(parser, argv)
    assert message in str(error.value)
