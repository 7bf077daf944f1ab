"""The compiled engines kept on disk (issue 46): one folder per servetune, JAX and jaxlib version, used by simulate
as by tune, and `servetune cache info|clear`."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from servetune.cli import main
from servetune.compile_cache import CACHE_ENV, cache_folder

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_each_installation_has_its_own_folder(tmp_path: Path):
    name = cache_folder(tmp_path).name
    for package in ("servetune", "jax", "jaxlib"):
        assert f"{package}-{importlib.metadata.version(package)}" in name
    assert cache_folder(tmp_path).parent == tmp_path


def test_info_counts_each_versions_programs_and_clear_removes_them(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert main(["cache", "info"]) == 0
    assert "none yet" in capsys.readouterr().out
    current = cache_folder(tmp_path)
    other = tmp_path / "servetune-0.0.1_jax-0.4.0_jaxlib-0.4.0"
    for folder, count in ((current, 3), (other, 2)):
        folder.mkdir(parents=True)
        for index in range(count):
            (folder / f"program-{index}").write_bytes(b"x" * 1000)
    (tmp_path / "loose-program").write_bytes(b"x")   # where servetune kept them before the folders
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"{current.name}: 3 programs" in out and "this installation's" in out
    assert f"{other.name}: 2 programs" in out and "another version's" in out
    assert "1 programs" in out and "an earlier servetune's" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 6 compiled programs" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_simulate_keeps_its_engine_on_disk(tmp_path: Path):
    # As a user runs it: no JAX cache of the tests' own (conftest.py) in the environment.
    environment = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}
    environment[CACHE_ENV] = str(tmp_path)
    command = [sys.executable, "-m", "servetune.cli", "simulate", str(EXAMPLES / "chat.yaml"),
               "--set", "workload.num_requests=100"]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert any(cache_folder(tmp_path).iterdir())
