"""The search commands end to end through their parser: tune, capacity of the study's best, sweep; where they
write and what they check before simulating; studies and hashes of a project copied or moved elsewhere."""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
from pathlib import Path

import optuna
import pytest
import yaml

from search_configs import write_config
from servetune.config_loader import load_config
from servetune.errors import UserError
from servetune.search import cli as search_cli
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.provenance import config_data, config_hash
from servetune.search.study.optimize import best_trials, load_study

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


def _fits_80_columns(printed: str) -> None:
    assert "…" not in printed, printed   # rich's mark of a cut cell
    assert max(len(line) for line in printed.splitlines()) <= 80, printed


def test_tune_then_capacity_of_its_best_then_a_sweep(parser, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    config = write_config(tmp_path, _chat_data())
    storage = str(tmp_path / "s.db")
    assert _run(parser, ["tune", str(config), "--trials", "6", "--sampler", "random", "--storage", storage,
                         "--study", "cli", "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    study, _ = load_study("cli", storage)
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 6
    assert printed["best"][0]["trial"] == best_trials(study)[0].number
    assert printed["best"][0]["request_goodput"] == best_trials(study)[0].value
    # The same study again, as a table: it holds its 6 trials already, so nothing is simulated.
    assert _run(parser, ["tune", str(config), "--trials", "6", "--storage", storage, "--study", "cli",
                         "--no-progress"]) == 0
    _fits_80_columns(capsys.readouterr().out)

    assert _run(parser, ["capacity", "--study", "cli", "--storage", storage, "--json"]) == 0
    capacity = json.loads(capsys.readouterr().out)
    assert capacity["slo_attainment"] >= capacity["target"] == 0.9
    assert capacity["of"] == f"study cli trial {printed['best'][0]['trial']}"

    # Without --out the sweep writes to the current folder, never to a results/ folder there.
    monkeypatch.chdir(tmp_path)
    assert _run(parser, ["sweep", str(config), "--param", "scheduler.max_num_batched_tokens",
                         "--values", "256,1024"]) == 0
    _fits_80_columns(capsys.readouterr().out)
    out = tmp_path / "sweep-study-max_num_batched_tokens.csv"
    with open(out) as f:
        assert [row["scheduler.max_num_batched_tokens"] for row in csv.DictReader(f)] == ["256", "1024"]
    assert out.with_suffix(".png").exists()
    assert not (tmp_path / "results").exists()


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


# ---------------------------------------------------------------------------------------------------------
# Outputs and storages are checked before any simulation; reading a study never creates its storage.

def _refuse_to_simulate(monkeypatch) -> None:
    import servetune.search.evaluate

    def evaluate(*_):
        raise AssertionError("simulated before checking the paths")

    monkeypatch.setattr(servetune.search.evaluate.BatchEvaluator, "evaluate", evaluate)


def _unwritable_folder(tmp_path: Path) -> Path:
    if os.geteuid() == 0:   # root is not stopped by permission bits; /sys takes no new files
        return Path("/sys")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return folder


@pytest.mark.parametrize("where, words", [("nope/t.db", "no such folder"), ("folder.db", "is a folder"),
                                          (None, "cannot write it")])
def test_tune_refuses_a_storage_it_cannot_write_and_creates_no_folder(parser, where, words, tmp_path,
                                                                       monkeypatch):
    _refuse_to_simulate(monkeypatch)
    (tmp_path / "folder.db").mkdir()
    storage = str(tmp_path / where) if where else str(_unwritable_folder(tmp_path) / "t.db")
    with pytest.raises(UserError, match=f"--storage {storage}: {words}"):
        _run(parser, ["tune", "examples/chat.yaml", "--storage", storage, "--no-progress"])
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("argv", [["export", "--study", "chat"], ["capacity", "--study", "chat"]])
def test_reading_a_study_never_creates_its_storage(parser, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "absent.db"
    with pytest.raises(UserError, match=f"--storage {storage}: no such file, expected a study storage"):
        _run(parser, [*argv, "--storage", str(storage)])
    with pytest.raises(UserError, match="the default storage results/studies.db: no such file"):
        _run(parser, argv)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, flag", [
    (["sweep", "examples/chat.yaml", "--param", "scheduler.max_num_seqs", "--values", "8,16", "--out"], "--out"),
    (["export", "--study", "chat", "--storage", "absent.db", "--out"], "--out"),
])
def test_an_output_path_is_checked_before_any_work(parser, argv, flag, tmp_path, monkeypatch):
    _refuse_to_simulate(monkeypatch)
    out = tmp_path / "no" / "such" / "file.csv"
    with pytest.raises(UserError, match=f"{flag} {out}: no such folder"):
        _run(parser, [*argv, str(out)])
    with pytest.raises(UserError, match=f"{flag} {tmp_path}: is a folder"):
        _run(parser, [*argv, str(tmp_path)])


def _project(folder: Path) -> Path:
    """A small project: a config that reads a length sample from its own folder."""
    (folder / "lengths").mkdir(parents=True)
    (folder / "lengths" / "sample.csv").write_text(
        "num_prefill_tokens,num_decode_tokens\n" + "".join(f"{64 * (i % 5 + 1)},{16 * (i % 3 + 1)}\n"
                                                            for i in range(40)))
    data = _chat_data()
    data["workload"]["lengths"] = {"kind": "empirical", "path": "lengths/sample.csv"}
    data["workload"]["num_requests"] = 100
    return write_config(folder, data)


def test_a_copy_of_a_project_elsewhere_has_the_same_hash_and_records_no_absolute_path(tmp_path):
    here, there = load_config(_project(tmp_path / "a")), load_config(_project(tmp_path / "b" / "deeper"))
    assert config_hash(here) == config_hash(there)
    recorded = json.dumps(config_data(here))
    assert str(tmp_path) not in recorded and "lengths/sample.csv" in recorded
    # The hash follows the file's content, not its name.
    (tmp_path / "b" / "deeper" / "lengths" / "sample.csv").write_text(
        "num_prefill_tokens,num_decode_tokens\n100,10\n")
    assert config_hash(load_config(tmp_path / "b" / "deeper" / "study.yaml")) != config_hash(here)


def test_a_moved_project_resumes_its_study(parser, tmp_path):
    before = tmp_path / "before"
    config = _project(before)
    argv = ["--sampler", "random", "--study", "moved", "--no-progress", "--json"]
    assert _run(parser, ["tune", str(config), "--trials", "2", "--storage", str(before / "s.db"), *argv]) == 0
    after = tmp_path / "elsewhere" / "after"
    after.parent.mkdir()
    shutil.move(before, after)
    assert _run(parser, ["tune", str(after / "study.yaml"), "--trials", "4", "--storage", str(after / "s.db"),
                         *argv]) == 0
    study = optuna.load_study(study_name="moved", storage=f"sqlite:///{after / 's.db'}")
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 4
    assert str(tmp_path) not in json.dumps(study.user_attrs["config"])
    # Reading the study back finds the files its config names in the moved folder (the first folder is gone).
    assert _run(parser, ["export", "--study", "moved", "--storage", str(after / "s.db"), "--engine", "vllm",
                         "--out", str(after / "moved.vllm.yaml")]) == 0
