"""vLLM 0.33's start-up memory accounting against published start-ups (tests/fixtures/vllm_startups.csv) and by
hand; vLLM's refusals with its numbers; vllm serve's defaults by GPU."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.gpus import GIB
from servetune.cost_models.memory import StartupRefused, startup_memory
from servetune.cost_models.vllm_defaults import vllm_serve_defaults

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_memory  # noqa: E402

ROWS = bench_memory.v1_rows(bench_memory.read_rows())


@pytest.mark.parametrize("row", ROWS, ids=[row["id"] for row in ROWS])
def test_every_recorded_start_up_gets_vllms_verdict(row):
    assert bench_memory.predict(row).verdict == row["logged_verdict"]


@pytest.mark.parametrize("row", [r for r in ROWS if r["logged_weights_gib"]], ids=lambda r: r["id"])
def test_weights_are_what_vllm_logged_as_model_loading(row):
    assert bench_memory.predict(row).weights_gib == pytest.approx(float(row["logged_weights_gib"]), rel=0.01)


def test_held_out_start_ups_are_within_five_percent():
    outcomes = [bench_memory.predict(row) for row in ROWS]
    count, median, _, wrong = bench_memory.summary(outcomes, "held_out")
    assert count >= 1 and wrong == 0 and median <= 0.05


def test_llama_3_1_8b_on_an_h100_by_hand():
    start = startup_memory(resolve_model("llama-3.1-8b"), resolve_gpu("h100-80gb"), 1, 0.9, 16, 8192, 1024,
                           max_model_len=131072)
    requested = math.ceil(79.22 * GIB * 0.9)
    weights = (32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) + 2 * 128256 * 4096) * 2
    peak = 8 * 1024 * 128256 * 4    # the sampler pass's 8 FP32 copies outweigh the forward's 0.8 GiB
    graphs = (51 - 1 + 51 - 1) * 2**20   # 51 sizes to 512 in both modes (1,024 seats), 1 MiB after the first
    available = requested - weights - peak - 0.2 * GIB - graphs
    assert (start.requested_bytes, start.weight_bytes, start.profile_peak_bytes) == (requested, weights, peak)
    assert start.available_kv_bytes == pytest.approx(available)
    assert start.num_kv_blocks == int(available // (16 * 131072))
    assert start.kv_tokens == start.num_kv_blocks * 16 and start.warning is None


def test_kv_cache_memory_bytes_replaces_the_profiled_budget():
    start = startup_memory(resolve_model("llama-3.1-8b"), resolve_gpu("h100-80gb"), 1, 0.9, 16, 8192, 1024,
                           max_model_len=8192, kv_cache_memory_bytes=10 * GIB)
    assert start.available_kv_bytes == 10 * GIB and start.num_kv_blocks == 10 * GIB // (16 * 131072)


def test_a_request_that_does_not_fit_is_refused_with_vllms_numbers():
    with pytest.raises(StartupRefused) as refused:
        startup_memory(resolve_model("llama-3.1-8b"), resolve_gpu("l4"), 1, 0.9, 16, 2048, 256,
                       max_model_len=131072)
    needed = 131072 * 131072   # 8,192 blocks of 16 tokens x 128 KiB
    assert refused.value.needed_bytes == needed
    assert "To serve at least one request with the model's max seq len (131072), (16.00 GiB KV cache is needed" \
        in refused.value.message
    assert f"the estimated maximum model length is {refused.value.estimated_max_len}." in refused.value.message
    assert 0 < refused.value.estimated_max_len * 131072 <= refused.value.available_bytes


def test_a_utilization_that_leaves_no_kv_cache_is_refused_in_one_line():
    with pytest.raises(StartupRefused, match=r'"Available KV cache memory: -\d+\.\d\d GiB", then "No available '
                                             r'memory for the cache blocks"'):
        startup_memory(resolve_model("llama-3.1-8b"), resolve_gpu("h100-80gb"), 1, 0.2, 16, 8192, 1024)


def test_a_gpu_without_reported_memory_falls_back_with_a_warning_naming_the_field():
    start = startup_memory(resolve_model("llama-3.1-8b"), resolve_gpu("a40"), 1, 0.9, 16, 2048, 256,
                           max_model_len=8192)
    assert start.device_bytes == 48 * GIB and "memory_gib_reported" in start.warning


@pytest.mark.parametrize("gpu, seqs, tokens", [("h100-80gb", 1024, 8192), ("a100-80gb", 256, 2048),
                                               ("l40s", 256, 2048), ("b200", 1024, 16384), ("h200", 1024, 8192)])
def test_vllm_serve_defaults_by_gpu(gpu, seqs, tokens):
    defaults = vllm_serve_defaults(resolve_gpu(gpu))
    assert (defaults.max_num_seqs, defaults.max_num_batched_tokens) == (seqs, tokens)
    assert (defaults.gpu_memory_utilization, defaults.block_size) == (0.9, 16)
