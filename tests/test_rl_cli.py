"""The RL commands end to end: train-rl writes its folder, eval-policy compares on held-out episodes, export
--policy writes the static config the policy holds most; bad input exits 2 with one line; a policy moves with
its project."""
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from servetune.cli import main
from servetune.config_loader import load_config
from servetune.search.rl.policy_file import load_policy
from servetune.search.rl import evaluate
from servetune.search.rl.evaluate import actor_arrays, heldout_world, play
from servetune.search.rl.train import (
    CHECKPOINT_FILE, CURVE_FILE, HISTORY_FILE, POLICY_FILE, control_world, policy_hash,
)

CHAT = "examples/chat.yaml"
SMALL = ["--set", "rl.episode_s=10", "--set", "rl.bounds={max_num_seqs: [1, 32]}", "--set", "rl.num_steps=10",
         "--set", "rl.num_minibatches=2", "--set", "rl.num_workloads=2", "--set", "rl.checkpoint_every=1"]
CONFIG_OVERRIDES = SMALL[1::2]
# eval-policy's best static config by goodput at the configured load, not by chat.yaml's capacity: a capacity study
# bisects every trial's rate over a dozen rounds of simulations of ever fewer trials, each new batch width its own
# compiled engine, and no test here reads the capacity. The search section is outside the policy's hash.
STATIC_BY_GOODPUT = ["--set", "search.objectives=[goodput]"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "chat"
    code = main(["train-rl", CHAT, *SMALL, "--timesteps", "80", "--num-envs", "4", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    return out


def test_train_rl_writes_policy_checkpoint_history_and_curve(trained):
    for name in (POLICY_FILE, CHECKPOINT_FILE, HISTORY_FILE, CURVE_FILE):
        assert (trained / name).stat().st_size > 0, name
    history = json.loads((trained / HISTORY_FILE).read_text())
    assert history["steps_per_update"] == 40 and history["num_updates"] == 2
    assert [row["timesteps"] for row in history["history"]] == [40, 80]
    assert history["env_steps_per_s"] > 0
    # 10-step episodes in 10-step rollouts: each of the 4 envs ends one per update.
    assert all(row["episodes"] == 4 and 0 <= row["slo_attainment"] <= 1 for row in history["history"])
    policy = load_policy(trained / POLICY_FILE)
    config = load_config(CHAT, CONFIG_OVERRIDES)
    assert policy.config_hash == policy_hash(config)
    assert policy.action_names == ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                                   "max_num_queued_reqs")
    assert policy.observation_names[0] == "queue_len" and policy.interval_s == 1.0
    assert 1 <= policy(np.zeros(len(policy.observation_names)))["max_num_seqs"] <= 32
    assert json.loads(policy.metadata["software"]) == {
        name: importlib.metadata.version(name) for name in ("servetune", "jax", "optuna")}
    # The config is named from the policy's folder, so that the two move together.
    assert not Path(policy.metadata["config_path"]).is_absolute()
    assert Path(policy.config_source).resolve() == Path(CHAT).resolve()


def test_resume_continues_from_the_checkpoint(trained, tmp_path):
    out = tmp_path / "again"
    assert main(["train-rl", CHAT, *SMALL, "--timesteps", "40", "--num-envs", "4", "--out", str(out),
                 "--no-progress"]) == 0
    assert main(["train-rl", CHAT, *SMALL, "--timesteps", "80", "--num-envs", "4", "--out", str(out),
                 "--no-progress", "--resume"]) == 0
    rows = json.loads((out / HISTORY_FILE).read_text())["history"]
    assert [row["update"] for row in rows] == [1, 2]


def test_eval_policy_compares_on_held_out_episodes(trained, tmp_path, capsys, monkeypatch, recwarn):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "eval.json"
    # A static search space narrower than vLLM's default 256 running requests: the study widens it to hold the
    # baselines rather than record them out of range.
    narrow = ["--set", "search.knobs={scheduler.max_num_seqs: {low: 1, high: 32}}"]
    rollouts_before = evaluate._run._cache_size()
    code = main(["eval-policy", str(trained / POLICY_FILE), CHAT, *SMALL, *narrow, *STATIC_BY_GOODPUT,
                 "--seeds", "2", "--static-trials", "4", "--storage", str(tmp_path / "s.db"), "--out", str(out)])
    assert code == 0
    # Five contenders, two worlds (the policy's knob bounds and the default ones): two compiled rollouts.
    assert evaluate._run._cache_size() - rollouts_before <= 2
    printed = capsys.readouterr()
    assert not [w for w in recwarn if "Fixed parameter" in str(w.message)], [str(w.message) for w in recwarn]
    # Progress where the output is no terminal: the study's bar, then a line per contender.
    assert "study chat-static" in printed.err
    for name in ("policy", "reactive", "best-static", "as-configured", "vllm-default"):
        assert f"playing 2 held-out episodes: {name}" in printed.err
    assert "…" not in printed.out and max(len(line) for line in printed.out.splitlines()) <= 80, printed.out
    assert "policy vs best static" in printed.out
    document = json.loads(out.read_text())
    assert set(document["contenders"]) == {"policy", "reactive", "best-static", "as-configured", "vllm-default"}
    for name, result in document["contenders"].items():
        values = result["request_goodput"]["values"]
        assert len(values) == 2 and all(v >= 0 for v in values), name
        assert result["request_goodput"]["mean"] == pytest.approx(np.mean(values))
    policy, static = (document["contenders"][n]["request_goodput"]["values"] for n in ("policy", "best-static"))
    assert document["gain_over_best_static"]["values"] == pytest.approx([a / b - 1 for a, b in zip(policy, static)])


def test_held_out_episodes_are_the_workloads_after_the_training_ones(trained):
    config = load_config(CHAT, CONFIG_OVERRIDES)
    training = control_world(config)          # seeds 0 and 1
    held_out = heldout_world(config, 2)       # seeds 2 and 3
    seed_two = control_world(load_config(CHAT, [*CONFIG_OVERRIDES, "workload.seed=2"]), 1)
    np.testing.assert_array_equal(held_out.workloads[0].arrival_s, seed_two.workloads[0].arrival_s)
    for trained_on in training.workloads:
        for unseen in held_out.workloads:
            assert not np.array_equal(trained_on.arrival_s, unseen.arrival_s)
    policy = load_policy(trained / POLICY_FILE)
    played = play(held_out, "policy", actor_arrays(policy))
    assert len(played.metrics) == 2
    for metrics in played.metrics:
        assert metrics["completed"] + metrics["rejected"] + metrics["unfinished"] == metrics["arrived"]
    assert sum(played.knob_counts.values()) == 2 * 10   # every interval of both 10 s episodes


def test_export_policy_writes_the_most_held_config_with_a_warning(trained, tmp_path, capsys):
    out = tmp_path / "policy.vllm.yaml"
    assert main(["export", "--policy", str(trained / POLICY_FILE), "--engine", "vllm", "--seeds", "2",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "vllm cannot host a live policy" in err
    text = out.read_text()
    assert "# warning: vllm cannot host a live policy" in text
    keys = yaml.safe_load(text)
    assert 1 <= keys["max-num-seqs"] <= 32 and keys["max-num-batched-tokens"] >= keys["max-num-seqs"]


@pytest.mark.parametrize("argv, message", [
    (["export", "--engine", "vllm"], "give --study"),
    (["eval-policy", "missing.safetensors", CHAT], "no such policy file"),
    (["train-rl", CHAT, "--out", "x", "--timesteps", "0"], "--timesteps: got 0"),
    (["train-rl", CHAT, "--out", "x", "--num-envs", "3", "--set", "rl.num_minibatches=5"], "rl.num_minibatches"),
    (["train-rl", "examples/static.yaml", "--out", "x"], "the environments steer continuous batching"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_eval_policy_refuses_a_policy_trained_on_another_config(trained, capsys):
    assert main(["eval-policy", str(trained / POLICY_FILE), CHAT]) == 2
    assert "trained on another config" in capsys.readouterr().err


def test_eval_policy_says_how_to_get_past_an_older_study_of_its_name(trained, tmp_path, capsys):
    from servetune.search.study.optimize import open_study
    storage = str(tmp_path / "s.db")
    other = load_config(CHAT, ["workload.arrivals.rate=9"])
    open_study(other, "chat-static", storage)   # the name eval-policy gives its study of examples/chat.yaml
    argv = ["eval-policy", str(trained / POLICY_FILE), CHAT, *SMALL, "--seeds", "1", "--static-trials", "2",
            "--storage", storage]
    assert main(argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]   # after the line announcing the study
    assert error.startswith("servetune: error: --study chat-static")
    assert "made from another config" in error and "pass --storage with another file" in error


def test_outputs_and_storages_are_checked_before_training_or_evaluating(trained, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    cases = [
        (["train-rl", CHAT, "--out", str(tmp_path / "a-file")], f"--out {tmp_path / 'a-file'}: is a file"),
        (["eval-policy", str(trained / POLICY_FILE), CHAT, *SMALL, "--out", str(tmp_path / "no" / "e.json")],
         f"--out {tmp_path / 'no' / 'e.json'}: no such folder"),
        (["eval-policy", str(trained / POLICY_FILE), CHAT, *SMALL, "--study", "s", "--storage",
          str(tmp_path / "absent.db")], f"--storage {tmp_path / 'absent.db'}: no such file"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_a_policy_trained_in_one_clone_is_evaluated_and_exported_in_another(tmp_path, capsys):
    """The policy's project copied to another path and the original removed: eval-policy accepts the policy on
    the copy's config, and export --policy reads the copy's files (no absolute path of the trainer's)."""
    here = tmp_path / "clone-a" / "project"
    (here / "lengths").mkdir(parents=True)
    (here / "lengths" / "sample.csv").write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{128 * (i % 4 + 1)},{32 * (i % 3 + 1)}\n" for i in range(50)))
    data = yaml.safe_load(Path(CHAT).read_text())
    data["workload"]["lengths"] = {"kind": "empirical", "path": "lengths/sample.csv"}
    (here / "chat.yaml").write_text(yaml.safe_dump(data))
    out = here / "rl"
    assert main(["train-rl", str(here / "chat.yaml"), *SMALL, "--timesteps", "40", "--num-envs", "4",
                 "--out", str(out), "--no-progress"]) == 0
    there = tmp_path / "clone-b" / "elsewhere" / "project"
    shutil.copytree(here, there)
    shutil.rmtree(tmp_path / "clone-a")
    policy = load_policy(there / "rl" / POLICY_FILE)
    # What the file records to find its config and files again (config_source is only the name typed).
    assert str(tmp_path) not in policy.metadata["config"] + policy.metadata["config_path"]
    assert policy.config_hash == policy_hash(load_config(there / "chat.yaml", CONFIG_OVERRIDES))
    capsys.readouterr()
    assert main(["eval-policy", str(there / "rl" / POLICY_FILE), str(there / "chat.yaml"), *SMALL, *STATIC_BY_GOODPUT,
                 "--seeds", "1", "--static-trials", "1", "--storage", str(tmp_path / "s.db")]) == 0, \
        capsys.readouterr().err
    exported = tmp_path / "p.vllm.yaml"
    assert main(["export", "--policy", str(there / "rl" / POLICY_FILE), "--seeds", "1", "--out",
                 str(exported)]) == 0, capsys.readouterr().err
    assert yaml.safe_load(exported.read_text())["max-num-seqs"] >= 1
    # A changed length sample is another problem: the copy's policy no longer matches it.
    (there / "lengths" / "sample.csv").write_text("num_prefill_tokens,num_decode_tokens\n100,10\n")
    assert main(["export", "--policy", str(there / "rl" / POLICY_FILE), "--seeds", "1"]) == 2
    assert "no longer hashes as it did in training" in capsys.readouterr().err
