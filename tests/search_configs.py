"""Small configs and a worker process for the search tests (tests/test_search_*.py).

The study config is overloaded on purpose (20 req/s of uniform 64-2,048-token prompts into a 16-request
engine): which knobs win matters, and only 3 of its 192 grid points come within 2% of the best goodput.
All its max_num_seqs values share one engine slot count (16), so its tests compile few engines.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from servetune.config_loader import config_from_dict

STUDY_KNOBS = {
    "scheduler.max_num_seqs": {"low": 9, "high": 16},
    "scheduler.max_num_batched_tokens": {"choices": [256, 512, 1024, 2048]},
    "scheduler.enable_chunked_prefill": {"choices": [True, False]},
    "scheduler.long_prefill_token_threshold": {"choices": [0, 128, 256]},
}


def study_data(**search) -> dict:
    return {
        "cost_model": {"kind": "linear", "base_s": 0.010, "per_token_s": 0.00003, "per_context_token_s": 0.0000002},
        "workload": {"arrivals": {"kind": "poisson", "rate": 20.0}, "num_requests": 200, "seed": 1,
                     "lengths": {"kind": "uniform", "prompt_tokens": [64, 2048], "output_tokens": [16, 256]}},
        "scheduler": {"max_num_seqs": 16, "num_kv_blocks": 4096},
        "slo": {"ttft_ms": 1000, "itl_ms": 50},
        "search": {"knobs": STUDY_KNOBS, "baselines": False, **search},
    }


def study_config(**search):
    return config_from_dict(study_data(**search), source="study.yaml")


def write_config(folder: Path, data: dict) -> Path:
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# A search worker as its own process, as `servetune tune` runs one: python -c WORKER CONFIG STUDY STORAGE.
WORKER = """
import sys
from servetune.config_loader import load_config
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.study.optimize import run_study
use_persistent_compilation_cache()
run_study(load_config(sys.argv[1]), sys.argv[2], sys.argv[3], show_progress=False)
"""


def worker_command(config_path: Path, study: str, storage: str) -> list[str]:
    return [sys.executable, "-c", WORKER, str(config_path), study, storage]
