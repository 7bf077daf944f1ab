"""The Python API (servetune/api.py) gives what the commands give: the same metrics and request rows as
``servetune simulate --out --requests-out``, the same best trials and baselines as ``servetune tune --json``,
the same one-line errors, and the policy file eval-policy accepts."""
from __future__ import annotations

import csv
import json

import numpy as np
import optuna
import pytest

from search_configs import write_config
from servetune import api
from servetune.cli import main
from servetune.errors import ConfigError
from servetune.search.rl.cli import check_policy_config
from servetune.search.study.optimize import best_trials

optuna.logging.set_verbosity(optuna.logging.WARNING)

CHAT = "examples/chat.yaml"
# Small, and loaded enough that some requests are rejected (a queue limit) and some preempted (a small cache).
SMALL = ["workload.num_requests=120", "workload.arrivals.rate=20", "scheduler.num_kv_blocks=400",
         "scheduler.max_num_queued_reqs=30"]


def _sets(overrides) -> list[str]:
    return [word for item in overrides for word in ("--set", item)]


def test_public_names_are_documented():
    assert set(api.__all__) == {"Simulation", "load_config", "simulate", "tune", "load_policy"}
    for name in api.__all__:
        assert getattr(api, name).__doc__, name


def test_load_config_applies_overrides_and_raises_the_cli_error(capsys):
    config = api.load_config(CHAT, ["scheduler.max_num_seqs=32", "workload.num_requests=500"])
    assert (config.scheduler.max_num_seqs, config.workload.num_requests, config.source) == (32, 500, CHAT)
    with pytest.raises(ConfigError) as error:
        api.load_config(CHAT, ["scheduler.max_num_seqs=-3"])
    assert main(["simulate", CHAT, "--set", "scheduler.max_num_seqs=-3"]) == 2
    assert str(error.value) in capsys.readouterr().err


def test_simulate_gives_the_cli_run_json_and_requests_csv(tmp_path, capsys):
    out, rows = tmp_path / "run.json", tmp_path / "requests.csv"
    assert main(["simulate", CHAT, *_sets(SMALL), "--out", str(out), "--requests-out", str(rows)]) == 0
    capsys.readouterr()
    document = json.loads(out.read_text())

    run = api.simulate(CHAT, SMALL)
    # The same numbers as run.json, key for key (through JSON, as the file holds them); only the date the run
    # was made may differ.
    parts = {"segments", "timing", "workload", "config", "software"}
    assert set(run.metrics) == set(document) - parts
    assert ({k: v for k, v in json.loads(json.dumps(run.metrics)).items() if k != "date"}
            == {k: v for k, v in document.items() if k not in parts | {"date"}})
    assert json.loads(json.dumps(run.segments)) == document["segments"]
    assert json.loads(json.dumps(run.config.to_dict())) == document["config"]
    assert run.metrics["rejected"] > 0 and run.metrics["preemptions"] > 0   # the small config exercises both
    assert set(run.timing) == set(document["timing"])

    # The same rows as requests.csv, column for column.
    with open(rows, newline="") as f:
        table = list(csv.DictReader(f))
    assert list(run.requests) == list(table[0])
    assert all(len(column) == len(table) for column in run.requests.values())
    for name, column in run.requests.items():
        written = [row[name] for row in table]
        if column.dtype.kind == "f":
            assert ["" if np.isnan(v) else f"{v:.6f}" for v in column] == written, name
        else:
            assert [str(v) for v in column] == written, name

    # A Config, loaded once, simulates the same as its path.
    again = api.simulate(api.load_config(CHAT, SMALL))
    assert ({k: v for k, v in again.metrics.items() if k != "date"}
            == {k: v for k, v in run.metrics.items() if k != "date"})


def test_simulate_refuses_what_the_cli_refuses():
    with pytest.raises(ConfigError, match="vLLM requires max_num_batched_tokens >= max_model_len"):
        api.simulate(CHAT, ["scheduler.enable_chunked_prefill=false"])   # vLLM would not start
    with pytest.raises(Exception, match="window_s"):
        api.simulate(CHAT, SMALL, window_s=0.0)


def _tiny_study(tmp_path):
    data = {
        "cost_model": {"kind": "linear", "base_s": 0.010, "per_token_s": 0.00003, "per_context_token_s": 0.0000002},
        "workload": {"arrivals": {"kind": "poisson", "rate": 20.0}, "num_requests": 100, "seed": 1,
                     "lengths": {"kind": "uniform", "prompt_tokens": [64, 1024], "output_tokens": [16, 128]}},
        "scheduler": {"max_num_seqs": 16, "num_kv_blocks": 4096},
        "slo": {"ttft_ms": 1000, "itl_ms": 50},
        "search": {"knobs": {"scheduler.max_num_seqs": {"choices": [8, 16]},
                             "scheduler.max_num_batched_tokens": {"choices": [256, 1024, 2048]}},
                   "batch_size": 4, "sampler": "random", "seed": 3},
    }
    return write_config(tmp_path, data)


def test_tune_gives_the_cli_study(tmp_path, capsys):
    config = str(_tiny_study(tmp_path))
    assert main(["tune", config, "--trials", "4", "--study", "tiny", "--storage", str(tmp_path / "cli.db"),
                 "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)

    study = api.tune(config, "tiny", storage=str(tmp_path / "api.db"), trials=4)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) == 4
    assert {t.user_attrs.get("baseline") for t in complete} >= {"vllm-default"}   # baselines first, as the CLI
    best = best_trials(study)
    assert [(t.number, t.params, t.values) for t in best] == \
           [(row["trial"], row["params"], row["values"]) for row in printed["best"]]
    assert best[0].user_attrs["request_goodput"] == printed["best"][0]["request_goodput"]
    baselines = {row["baseline"]: row["values"] for row in printed["baselines"]}
    assert {t.user_attrs["baseline"]: t.values for t in complete if "baseline" in t.user_attrs} == baselines

    # The flags' twins: a bad count is refused before anything runs, and an existing study is resumed.
    with pytest.raises(Exception, match="trials: got 0"):
        api.tune(config, "tiny", storage=str(tmp_path / "api.db"), trials=0)
    assert len(api.tune(config, "tiny", storage=str(tmp_path / "api.db"), trials=4).trials) == len(study.trials)


def test_load_policy_reads_the_shipped_policy_that_eval_policy_accepts():
    policy = api.load_policy("results/rl/diurnal/policy.safetensors")
    # eval-policy's own check: the policy was trained on the config its file names (examples/diurnal.yaml).
    config = api.load_config(policy.config_source)
    check_policy_config(policy, config, allow_other=False)
    knobs = policy(np.zeros(len(policy.observation_names), np.float32))
    assert isinstance(knobs["max_num_seqs"], int) and knobs["max_num_seqs"] >= 1
    assert set(knobs) >= {"max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                          "max_num_queued_reqs"}
