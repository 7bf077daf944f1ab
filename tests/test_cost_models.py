"""The roofline step-time model, KV capacity, the catalogues, the factory and the cost CLI."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from servetune.config import Config, CostModelConfig, HardwareConfig, SchedulerConfig
from servetune.cost_models import linear
from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_cli import register
from servetune.cost_models.factory import build_cost_model, derive_num_kv_blocks
from servetune.cost_models.gpus import GIB, GPUS
from servetune.cost_models.memory import NON_TORCH_RESERVE_BYTES, kv_capacity
from servetune.cost_models.models import MODELS, heads_per_gpu
from servetune.cost_models.profile import SHIPPED_PROFILES_DIR, load_profile
from servetune.cost_models.roofline import (Calibration, build_roofline_params, smooth_max, step_costs,
                                            step_time_s)
from servetune.errors import UserError
from servetune.types import StepBatch

LLAMA_7B = resolve_model("llama-2-7b")
A100 = resolve_gpu("a100-80gb")
# Overheads off and a near-sharp roofline, so closed forms hold exactly enough to test.
NO_OVERHEADS = dataclasses.replace(Calibration(), kernel_overhead_s=1e-30, attention_overhead_s=1e-30,
                                   per_step_overhead_s=1e-30, per_request_overhead_s=1e-30,
                                   allreduce_latency_s=1e-30, roofline_sharpness=50.0,
                                   allreduce_base_latency_s=1e-30, host_multi_gpu_overhead_s=1e-30,
                                   eager_launch_overhead_s=1e-30)


def batch(prefill_seqs=0, prefill_tokens=0, prefill_cached=0, decodes=0, context=0) -> StepBatch:
    """One prefill chunk per prefill seq of ``prefill_tokens / prefill_seqs`` tokens on ``prefill_cached``,
    and ``decodes`` decodes each with ``context`` cached tokens."""
    q = prefill_tokens / max(prefill_seqs, 1)
    values = (prefill_seqs, prefill_tokens, prefill_seqs * (prefill_cached + q),
              prefill_seqs * q * (prefill_cached + q / 2), prefill_seqs * q * q / 2, decodes, decodes * (context + 1))
    return StepBatch(*(jnp.float32(v) for v in values))


def seconds(params, step) -> float:
    return float(step_time_s(params, step))


# --------------------------------------------------------------------------- closed forms


def test_batch_one_decode_is_bound_by_reading_the_weights():
    params = build_roofline_params(LLAMA_7B, A100, 1, NO_OVERHEADS)
    weight_bytes = 2 * (LLAMA_7B.num_layers * LLAMA_7B.layer_params + LLAMA_7B.embedding_params)  # + LM head
    expected = weight_bytes / (A100.memory_bytes_per_s * NO_OVERHEADS.matmul_memory_efficiency)
    costs = step_costs(params, batch(decodes=1, context=16))
    assert float(costs.weight_bytes) == pytest.approx(weight_bytes, rel=1e-6)
    assert float(costs.memory_bound_s) > 20 * float(costs.compute_bound_s)
    # activations and a 17-token KV add well under 1%
    assert float(costs.total_s) == pytest.approx(expected, rel=0.01)


def test_long_prefill_is_compute_bound_at_the_matmul_rate():
    params = build_roofline_params(LLAMA_7B, A100, 1, NO_OVERHEADS)
    tokens = 8192
    costs = step_costs(params, batch(prefill_seqs=1, prefill_tokens=tokens))
    assert float(costs.compute_bound_s) > 3 * float(costs.memory_bound_s)
    matmul_flops = 2 * LLAMA_7B.num_layers * LLAMA_7B.layer_params * tokens + 2 * LLAMA_7B.embedding_params
    assert float(costs.matmul_flops) == pytest.approx(matmul_flops, rel=1e-6)
    assert float(costs.matmul_s) == pytest.approx(
        matmul_flops / (A100.peak_flops_per_s * NO_OVERHEADS.matmul_compute_efficiency), rel=0.01)


def test_doubling_bandwidth_halves_a_memory_bound_step():
    fast = dataclasses.replace(A100, memory_bytes_per_s=2 * A100.memory_bytes_per_s)
    step = batch(decodes=8, context=512)
    slow_s = seconds(build_roofline_params(LLAMA_7B, A100, 1, NO_OVERHEADS), step)
    fast_s = seconds(build_roofline_params(LLAMA_7B, fast, 1, NO_OVERHEADS), step)
    assert fast_s == pytest.approx(slow_s / 2, rel=1e-3)


def test_doubling_peak_flops_halves_a_compute_bound_step_without_overheads():
    fast = dataclasses.replace(A100, peak_flops_per_s=2 * A100.peak_flops_per_s)
    step = batch(prefill_seqs=1, prefill_tokens=16384)
    slow = step_costs(build_roofline_params(LLAMA_7B, A100, 1, NO_OVERHEADS), step)
    quick = step_costs(build_roofline_params(LLAMA_7B, fast, 1, NO_OVERHEADS), step)
    assert float(quick.matmul_s + quick.attention_prefill_s) == pytest.approx(
        float(slow.matmul_s + slow.attention_prefill_s) / 2, rel=0.01)


def test_decode_attention_reads_every_cached_kv_byte_with_gqa():
    # Llama-3-8B: 8 KV heads of 128 over 32 layers, 2 bytes: 2 * 32 * 8 * 128 * 2 = 131,072 B per token.
    model = resolve_model("llama-3-8b")
    params = build_roofline_params(model, A100, 1, NO_OVERHEADS)
    costs = step_costs(params, batch(decodes=4, context=999))
    assert float(costs.kv_bytes) == pytest.approx(4 * 1000 * 131_072, rel=1e-6)
    # its query heads still count: 4 * 32 heads * 128 FLOPs per attended token per layer
    assert float(costs.attention_flops) == pytest.approx(4 * 1000 * 32 * 4 * 32 * 128, rel=1e-6)


def test_a_causal_block_pair_costs_the_ratio_times_a_cached_prefix_pair():
    """Hand count: a chunk of q on c cached does 4 · heads · head_dim FLOPs per layer for each of its q·c prefix
    pairs and ``attention_causal_pair_ratio`` times that for each of its q²/2 causal pairs."""
    step = batch(prefill_seqs=1, prefill_tokens=1024, prefill_cached=2048, decodes=3, context=100)
    per_pair = 32 * 4 * 32 * 128           # Llama-2-7B: 32 layers, 32 heads of 128
    decode_pairs = 3 * 101
    for ratio in (1.0, 3.0, 0.5):
        params = build_roofline_params(LLAMA_7B, A100, 1, Calibration(attention_causal_pair_ratio=ratio))
        flops = float(step_costs(params, step).attention_flops)
        assert flops == pytest.approx(per_pair * (1024 * 2048 + ratio * 1024 * 1024 / 2 + decode_pairs), rel=1e-6)
    # at ratio 1 the causal count is not read at all: the step costs exactly what it did before it existed
    params = build_roofline_params(LLAMA_7B, A100, 1)
    moved = dataclasses.replace(step, prefill_causal_pairs=jnp.float32(0.0))
    assert seconds(params, moved) == seconds(params, step)


def test_gated_mlp_has_three_matrices_and_gqa_shrinks_kv_projections():
    mistral = resolve_model("mistral-7b")    # h 4096, 32 heads, 8 KV heads, ffn 14336, gated
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    assert mistral.layer_params == attention + 3 * 4096 * 14336
    opt = resolve_model("opt-13b")           # plain MLP: two matrices
    assert opt.layer_params == 4 * 5120 * 5120 + 2 * 5120 * 20480


def test_catalogue_parameter_counts_match_published_sizes():
    published_billions = {"llama-2-7b": 6.74, "llama-2-13b": 13.02, "llama-2-70b": 68.98, "llama-3-8b": 8.03,
                          "llama-3-70b": 70.55, "mistral-7b": 7.24, "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.7,
                          "codellama-34b": 33.7, "phi-2": 2.78, "opt-13b": 12.85, "opt-66b": 65.7}
    for name, billions in published_billions.items():
        assert MODELS[name].total_params / 1e9 == pytest.approx(billions, rel=0.01), name


def test_catalogues_are_complete_and_sane():
    for name in ["llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3.1-8b", "llama-3-70b",
                 "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b",
                 "codellama-34b", "internlm-20b", "phi-2", "opt-13b", "opt-66b"]:
        model = resolve_model(name)
        assert model.num_heads % model.num_kv_heads == 0 and model.source
    for name in ["a100-40gb", "a100-80gb", "a100-40gb-pcie", "a100-80gb-pcie", "h100-80gb", "h100-80gb-pcie",
                 "h200", "l40s", "l4", "a10g", "a40"]:
        gpu = resolve_gpu(name)
        # every datacentre GPU here: 50-1000 dense TFLOP/s, 0.3-5 TB/s, 24-141 GB, ridge point 100-600 FLOP/B
        assert 50e12 <= gpu.peak_flops_per_s <= 1000e12
        assert 0.3e12 <= gpu.memory_bytes_per_s <= 5e12
        assert 24 * GIB <= gpu.memory_bytes <= 141 * GIB
        assert 100 <= gpu.peak_flops_per_s / gpu.memory_bytes_per_s <= 600
        assert gpu.interconnect_bytes_per_s >= 64e9 and gpu.source
    assert resolve_gpu("H100").name == "h100-80gb" and resolve_gpu("a100").name == "a100-80gb"
    assert resolve_model("meta-llama/Llama-2-7b-hf") is MODELS["llama-2-7b"]
    assert resolve_model("codellama/CodeLlama-34b-Instruct-hf") is MODELS["codellama-34b"]
    assert len(GPUS) == 14   # B200, H20 and MI300X: tests/test_gpu_definitions.py checks their datasheet figures


def test_catalogue_context_lengths_match_config_json():
    # max_position_embeddings of meta-llama/Llama-2-7b-hf/config.json: 4096 (verbatim copy in scaleapi/llm-engine,
    # model-engine/tests/unit/domain/test_llm_use_cases.py; transformers' load log of snapshot 8a0442e8).
    assert MODELS["llama-2-7b"].max_model_len == 4096
    # meta-llama/Llama-3.1-8B/config.json: 131072 with rope_scaling rope_type "llama3", which vLLM does not
    # multiply in (verbatim copy: NVIDIA/TensorRT-LLM tests/unittest/_torch/modeling/test_modeling_llama.py).
    assert MODELS["llama-3.1-8b"].max_model_len == 131072
    # mistralai/Mistral-7B-v0.1/config.json: 32768 (verbatim copy: mlc-ai/mlc-llm model_preset.py)
    assert MODELS["mistral-7b"].max_model_len == 32768
    for model in MODELS.values():
        assert model.max_model_len is not None and model.max_model_len >= 2048, model.name
    # aliases share their base entry, and so its context length
    assert resolve_model("meta-llama/Llama-2-7b-chat-hf").max_model_len == 4096


def test_unknown_names_raise_user_errors_with_suggestions():
    with pytest.raises(UserError, match=r"model: got 'llama2-7b', expected a known model \(did you mean llama-2-7b, "
                                        r".*known models: .*opt-13b"):
        resolve_model("llama2-7b")
    with pytest.raises(UserError, match=r"GPU: got 'h1000', expected a known GPU \(did you mean h100-80gb"):
        resolve_gpu("h1000")


def test_tensor_parallel_head_sharding():
    assert heads_per_gpu(resolve_model("llama-2-70b"), 8) == (8, 1)
    assert heads_per_gpu(resolve_model("qwen2.5-7b"), 4) == (7, 1)    # 28 q heads, 4 KV heads
    assert heads_per_gpu(resolve_model("qwen2.5-7b"), 1) == (28, 4)
    with pytest.raises(UserError, match="tp: got 8, expected a divisor of qwen2.5-7b's 28 attention heads"):
        heads_per_gpu(resolve_model("qwen2.5-7b"), 8)
    with pytest.raises(UserError, match="tp: got 3, expected a divisor of llama-2-7b's 32 attention heads"):
        heads_per_gpu(LLAMA_7B, 3)
    # 28 query heads split over 7, but Qwen2.5-7B's 4 KV heads neither split over 7 GPUs nor replicate evenly
    with pytest.raises(UserError, match="tp: got 7, expected a multiple of qwen2.5-7b's 4 key/value heads"):
        heads_per_gpu(resolve_model("qwen2.5-7b"), 7)


def test_tensor_parallelism_adds_two_all_reduces_per_layer():
    model = resolve_model("llama-2-70b")
    step = batch(prefill_seqs=1, prefill_tokens=1024)
    alone = step_costs(build_roofline_params(model, A100, 1, NO_OVERHEADS), step)
    assert float(alone.communication_s) == 0.0
    tp4 = step_costs(build_roofline_params(model, A100, 4, NO_OVERHEADS), step)
    # ring all-reduce: each GPU sends 2(n-1)/n of tokens * hidden * 2 bytes, 2 per layer, 80 layers
    assert float(tp4.allreduce_bytes) == pytest.approx(2 * 80 * 1.5 * 1024 * 8192 * 2, rel=1e-6)
    link = A100.interconnect_bytes_per_s / 2 * NO_OVERHEADS.allreduce_efficiency
    assert float(tp4.communication_s) == pytest.approx(float(tp4.allreduce_bytes) / link, rel=1e-4)
    assert float(tp4.matmul_s) == pytest.approx(float(alone.matmul_s) / 4, rel=0.02)


# --------------------------------------------------------------------------- monotonicity


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(StepBatch)])
def test_step_time_never_decreases_when_any_input_grows(field):
    params = build_roofline_params(LLAMA_7B, A100, 2)
    base = batch(prefill_seqs=2, prefill_tokens=600, prefill_cached=300, decodes=20, context=700)
    grown = dataclasses.replace(base, **{field: getattr(base, field) * jnp.linspace(0.0, 3.0, 31)})
    times = np.asarray(step_time_s(params, grown))    # the other fields broadcast against the grown one
    assert times.shape == (31,) and np.all(np.diff(times) >= 0)


def test_step_time_grows_with_model_size_and_shrinks_with_a_faster_gpu():
    step = batch(prefill_seqs=1, prefill_tokens=256, decodes=16, context=512)
    seven, thirteen = (seconds(build_roofline_params(resolve_model(m), A100, 1), step)
                       for m in ("llama-2-7b", "llama-2-13b"))
    assert thirteen > seven
    assert seconds(build_roofline_params(LLAMA_7B, resolve_gpu("h100-80gb"), 1), step) < seven


def test_smooth_max_lies_between_the_max_and_the_sum():
    a, b = jnp.float32(3.0), jnp.float32(4.0)
    assert float(smooth_max(a, b, 2.0)) == pytest.approx(5.0)
    assert float(smooth_max(a, b, 1.0)) == pytest.approx(7.0)
    assert float(smooth_max(a, b, 60.0)) == pytest.approx(4.0, rel=1e-3)
    assert float(smooth_max(jnp.float32(0.0), jnp.float32(0.0), 2.0)) == 0.0


# --------------------------------------------------------------------------- vectorisation


def test_step_time_broadcasts_jits_and_vmaps_over_configs():
    params = [build_roofline_params(LLAMA_7B, A100, 1), build_roofline_params(resolve_model("llama-3-8b"), A100, 1)]
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *params)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(stacked))
    steps = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (5,)), batch(decodes=8, context=100))
    times = jax.jit(jax.vmap(step_time_s, in_axes=(0, None)))(stacked, steps)
    assert times.shape == (2, 5) and times.dtype == jnp.float32
    assert float(times[0, 0]) == pytest.approx(seconds(params[0], batch(decodes=8, context=100)), rel=1e-6)


# --------------------------------------------------------------------------- KV capacity


def test_kv_capacity_for_llama_2_7b_on_an_a100_80gb_by_hand():
    capacity = kv_capacity(LLAMA_7B, A100, tp=1, gpu_memory_utilization=0.9, block_size=16,
                           max_num_batched_tokens=2048, max_num_seqs=256)
    # weights: (32 layers * 202,375,168 + 2 * 32000 * 4096) params * 2 B = 13,476,298,752 B
    assert capacity.weight_bytes == 13_476_298_752
    # KV per token: 2 (K, V) * 32 layers * 32 heads * 128 dims * 2 B = 524,288 B
    assert capacity.kv_bytes_per_token == 524_288
    # reserve: 2048 tokens * (2*4096 + 2*11008 + 11008 = 41,216 values) * 2 B = 168,820,736
    #        + 256 seqs * 32000 vocab * 4 B * 2 copies = 65,536,000, + 1 GiB = 1,308,098,560
    assert capacity.activation_reserve_bytes == 168_820_736 + 65_536_000 + NON_TORCH_RESERVE_BYTES
    # usable 80 GiB * 0.9 = 77,309,411,328; KV = 77,309,411,328 - 13,476,298,752 - 1,308,098,560
    #      = 62,525,014,016 B; blocks = floor(62,525,014,016 / (16 * 524,288)) = floor(7453.7) = 7453
    assert capacity.num_kv_blocks == 7453
    assert capacity.token_capacity == 7453 * 16


def test_kv_capacity_shards_over_tensor_parallelism_and_refuses_what_does_not_fit():
    model = resolve_model("llama-2-70b")
    tp4 = kv_capacity(model, A100, 4, 0.92, 16, 2048, 256)
    # 8 KV heads over 4 GPUs: 2 per GPU, 80 layers: 2 * 80 * 2 * 128 * 2 B = 81,920 B per token per GPU
    assert tp4.kv_bytes_per_token == 81_920
    with pytest.raises(UserError, match="gpu: got 'a100-80gb', expected a GPU that holds llama-2-70b at tp=1: its "
                                        "weights take 128.5 GiB per GPU"):
        kv_capacity(model, A100, 1, 0.92, 16, 2048, 256)
    assert kv_capacity(LLAMA_7B, A100, 1, 0.95, 16, 2048, 256).num_kv_blocks > \
        kv_capacity(LLAMA_7B, A100, 1, 0.90, 16, 2048, 256).num_kv_blocks


# --------------------------------------------------------------------------- factory


def config(**cost) -> Config:
    return Config(model="llama-2-7b", hardware=HardwareConfig(gpu="a100-80gb", tp=1),
                  cost_model=CostModelConfig(**cost))


def test_factory_builds_every_kind_with_float32_params():
    fn, params = build_cost_model(config(kind="linear", base_s=0.01, per_token_s=1e-4, per_context_token_s=0.0))
    assert fn is linear.step_time_s
    assert float(fn(params, batch(decodes=10, context=5))) == pytest.approx(0.011)
    roofline_fn, roofline_params = build_cost_model(config(kind="roofline"))
    calibrated_fn, calibrated_params = build_cost_model(config(kind="calibrated",
                                                               profile="llama-2-7b_a100-80gb.json"))
    for params in (roofline_params, calibrated_params):
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))
    step = batch(decodes=32, context=1024)
    assert 0.005 < float(roofline_fn(roofline_params, step)) < 0.05
    assert float(calibrated_fn(calibrated_params, step)) != float(roofline_fn(roofline_params, step))
    with pytest.raises(UserError, match="profile: got 'no-such-profile.json', expected an existing calibrate output"):
        build_cost_model(config(kind="calibrated", profile="no-such-profile.json"))


def test_derive_num_kv_blocks_uses_the_scheduler_limits():
    base = Config(hardware=HardwareConfig(gpu="a100-80gb", tp=1, gpu_memory_utilization=0.9),
                  scheduler=SchedulerConfig(block_size=16, max_num_batched_tokens=2048, max_num_seqs=256))
    assert derive_num_kv_blocks(base) == 7453
    assert derive_num_kv_blocks(dataclasses.replace(base, scheduler=SchedulerConfig(block_size=32))) < 7453


# --------------------------------------------------------------------------- CLI


def run_cli(capsys, *argv) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="servetune")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    code = args.func(args)
    return code, capsys.readouterr().out


def test_cost_json_has_the_step_time_and_its_breakdown(capsys):
    code, out = run_cli(capsys, "cost", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--prefill-tokens", "512",
                        "--decode-batch", "16", "--context", "2000", "--json")
    result = json.loads(out)
    assert code == 0 and result["step_time_ms"] > 0 and result["bound"] in ("compute", "memory")
    assert sum(result["breakdown_ms"].values()) == pytest.approx(result["step_time_ms"], rel=1e-5)
    assert {"weight_bytes", "kv_bytes_read", "matmul_flops", "attention_flops"} <= set(result["work"])


def test_cost_table_and_calibrated_profile(capsys):
    code, out = run_cli(capsys, "cost", "--decode-batch", "32", "--context", "1024",
                        "--profile", "llama-2-7b_a100-80gb.json")
    assert code == 0 and "memory-bound" in out and "weights read" in out


def test_cost_rejects_an_empty_step(capsys):
    with pytest.raises(UserError, match="empty step"):
        run_cli(capsys, "cost", "--model", "llama-2-7b")


def test_memory_models_and_gpus_commands(capsys, monkeypatch):
    code, out = run_cli(capsys, "memory", "--model", "llama-3-70b", "--gpu", "h100-80gb", "--tp", "4",
                        "--gpu-memory-utilization", "0.92", "--json")
    result = json.loads(out)
    assert code == 0 and result["token_capacity"] == result["num_kv_blocks"] * 16 > 100_000
    code, out = run_cli(capsys, "models", "--json")
    rows = json.loads(out)
    assert code == 0 and {row["name"] for row in rows} == set(MODELS)
    assert all(row["max_model_len"] == MODELS[row["name"]].max_model_len for row in rows)
    monkeypatch.setenv("COLUMNS", "120")    # wide enough for every column uncut
    code, out = run_cli(capsys, "models")
    assert code == 0 and "context" in out and "131072" in out
    code, out = run_cli(capsys, "gpus")
    assert code == 0 and "h200" in out


# --------------------------------------------------------------------------- calibrated profiles


def _profile(tmp_path, **changes) -> Path:
    document = json.loads((SHIPPED_PROFILES_DIR / "llama-2-7b_a100-80gb.json").read_text())
    document.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return path


def _with_value(tmp_path, name: str, value) -> Path:
    calibration = json.loads((SHIPPED_PROFILES_DIR / "llama-2-7b_a100-80gb.json").read_text())["calibration"]
    return _profile(tmp_path, calibration={**calibration, name: value})


@pytest.mark.parametrize("name,value,expected", [
    # Values calibrate's fit cannot produce, which would make float32 step times infinite, zero or NaN.
    ("matmul_compute_efficiency", 2.0, "a number in (0, 1]"),
    ("allreduce_efficiency", 0, "a number in (0, 1]"),
    ("roofline_sharpness", 0.5, "a number in [1, 100]"),
    ("kernel_overhead_s", 1e300, "seconds in (0, 1]"),
    ("per_step_overhead_s", "1ms", "seconds in (0, 1]"),
    ("attention_overhead_s", float("nan"), "seconds in (0, 1]"),
])
def test_a_profile_value_outside_what_calibrate_fits_is_refused_naming_it(tmp_path, name, value, expected):
    path = _with_value(tmp_path, name, value)
    with pytest.raises(UserError) as raised:
        load_profile(path)
    assert str(raised.value) == f"{path}: calibration.{name}: got {json.dumps(value)}, expected {expected}"


def test_a_file_that_is_no_profile_names_the_key_and_the_format(tmp_path):
    path = _profile(tmp_path, servetune_cost_profile=None)
    with pytest.raises(UserError, match=r"profile.json: servetune_cost_profile: got null, expected 1: a servetune cost "
                                        r"profile \(as calibrate writes it\)$"):
        load_profile(path)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="nesting too deep"):
        load_profile(tmp_path / "deep.json")
