"""Model families beyond the dense BF16 transformer: mixture of experts, multi-head latent attention, local
(sliding-window, chunked) attention and quantised weights and KV caches, as config.json files describe them
(fixtures in tests/fixtures/models, sources in its README) and as the memory model and the roofline price them.
Checked against the model cards' parameter counts, the papers' KV-cache formulas, vLLM 0.33's rules, a Monte
Carlo of uniform routing, hand-computed costs, and the step costs the code gave before these families existed."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from servetune.config import Config, CostModelConfig, HardwareConfig
from servetune.config_loader import config_from_dict
from servetune.cost_cli import register
from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.factory import derive_num_kv_blocks
from servetune.cost_models.gpus import GIB
from servetune.cost_models.memory import kv_bytes_per_token, kv_capacity, weight_bytes_per_gpu, window_reserve_bytes
from servetune.cost_models.models import MODELS, QUANTIZATION_PRESETS, LocalAttention, with_serving_options
from servetune.cost_models.profile import SHIPPED_PROFILES_DIR, load_profile
from servetune.cost_models.roofline import Calibration, build_roofline_params, experts_touched, step_costs
from servetune.errors import ConfigError, InvalidValue, UserError
from servetune.types import StepBatch

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b", "llama-4-scout"]
H100, H200, A100 = resolve_gpu("h100-80gb"), resolve_gpu("h200"), resolve_gpu("a100-80gb")
# Overheads off and a near-sharp roofline, so that closed forms hold (as in test_cost_models.py).
NO_OVERHEADS = dataclasses.replace(Calibration(), kernel_overhead_s=1e-30, attention_overhead_s=1e-30,
                                   per_step_overhead_s=1e-30, per_request_overhead_s=1e-30,
                                   allreduce_latency_s=1e-30, roofline_sharpness=50.0,
                                   allreduce_base_latency_s=1e-30, host_multi_gpu_overhead_s=1e-30,
                                   eager_launch_overhead_s=1e-30)


def batch(prefill_tokens=0, cached=0, decodes=0, context=0) -> StepBatch:
    """One prefill chunk of ``prefill_tokens`` on ``cached`` cached tokens, and ``decodes`` decodes of
    ``context`` cached tokens each."""
    prefills = 1 if prefill_tokens else 0
    values = (prefills, prefill_tokens, prefills * (cached + prefill_tokens),
              prefills * prefill_tokens * (cached + prefill_tokens / 2), prefills * prefill_tokens**2 / 2, decodes,
              decodes * (context + 1))
    return StepBatch(*(jnp.float32(v) for v in values))


def with_changes(tmp_path: Path, fixture: str, **changes) -> Path:
    """A fixture's config.json with keys changed (None removes one), written to tmp_path."""
    config = json.loads((FIXTURES / fixture / "config.json").read_text())
    target = config.get("text_config", config)
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    path = tmp_path / fixture / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------------------------- config.json and counts


@pytest.mark.parametrize("name", FAMILIES)
def test_each_config_json_gives_its_catalogue_entry(name):
    parsed, entry = resolve_model(str(FIXTURES / name)), MODELS[name]
    for field in dataclasses.fields(entry):
        if field.name not in ("name", "source"):
            assert getattr(parsed, field.name) == getattr(entry, field.name), field.name
    assert parsed.name == name


# (model, total, active): the model cards' figures, in billions.
# Mixtral-8x7B: Mistral AI, "Mixtral of experts" (mistral.ai/news/mixtral-of-experts): 46.7B total, 12.9B per token.
# Qwen3-30B-A3B: its Hugging Face model card: 30.5B in total, 3.3B activated.
# DeepSeek-V3: its model card and technical report (arXiv 2412.19437): 671B total, 37B activated per token (the
#   card's 685B adds the 14B multi-token-prediction module, which vLLM loads only for speculative decoding).
# Llama-4-Scout: Meta's model card: 17B active, 109B total (with the vision encoder, which servetune leaves out).
PUBLISHED = [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3), ("deepseek-v3", 671, 37),
             ("llama-4-scout", 109, 17)]


@pytest.mark.parametrize("name, total, active", PUBLISHED)
def test_parameter_counts_match_the_model_cards_within_two_percent(name, total, active):
    model = resolve_model(str(FIXTURES / name))
    assert model.total_params / 1e9 == pytest.approx(total, rel=0.02)
    assert model.active_params / 1e9 == pytest.approx(active, rel=0.02)


def test_gpt_oss_counts_match_openais_table_component_by_component():
    """OpenAI's gpt-oss model card (arXiv 2508.10925), Table 1, 120b / 20b: MLP 114.71B / 19.12B, attention 0.96B
    / 0.64B, embedding + unembedding 1.16B, total 116.83B / 20.91B, active 5.13B / 3.61B. Its active count leaves
    the embedding table out (114.71 x 4/128 + 0.96 + 1.16/2 = 5.13)."""
    for name, mlp, attention, total, active in (("gpt-oss-120b", 114.71, 0.96, 116.83, 5.13),
                                                ("gpt-oss-20b", 19.12, 0.64, 20.91, 3.61)):
        model = resolve_model(str(FIXTURES / name))
        experts = model.num_moe_layers * model.moe.num_experts * model.expert_params
        assert experts / 1e9 == pytest.approx(mlp, rel=0.002)   # the card's MLP adds biases
        assert model.num_layers * model.attention_params / 1e9 == pytest.approx(attention, rel=0.01)
        assert 2 * model.embedding_params / 1e9 == pytest.approx(1.16, rel=0.01)
        assert model.total_params / 1e9 == pytest.approx(total, rel=0.002)
        assert (model.active_params - model.embedding_params) / 1e9 == pytest.approx(active, rel=0.002)


def test_qwen3_moe_count_without_embeddings_matches_its_card():
    # Qwen3-30B-A3B's model card: "Number of Parameters (Non-Embedding): 29.9B"
    model = resolve_model(str(FIXTURES / "qwen3-30b-a3b"))
    assert (model.total_params - 2 * model.embedding_params) / 1e9 == pytest.approx(29.9, rel=0.005)


def test_which_layers_route_follows_vllms_rules(tmp_path):
    # DeepseekV2DecoderLayer: MoE iff layer >= first_k_dense_replace and layer % moe_layer_freq == 0
    assert resolve_model(str(FIXTURES / "deepseek-v3")).moe.num_moe_layers == 61 - 3
    every_other = resolve_model(str(with_changes(tmp_path, "deepseek-v3", moe_layer_freq=2)))
    assert every_other.moe.num_moe_layers == len(range(4, 61, 2))
    # Qwen3MoeDecoderLayer: MoE iff layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
    qwen = resolve_model(str(with_changes(tmp_path, "qwen3-30b-a3b", decoder_sparse_step=2, mlp_only_layers=[1, 2])))
    assert qwen.moe.num_moe_layers == 24 - 1   # odd layers, less layer 1
    # Llama 4: MoE iff (layer + 1) % interleave_moe_layer_step == 0 (Maverick's 2); dense layers are
    # intermediate_size_mlp wide, the shared expert intermediate_size
    maverick_like = resolve_model(str(with_changes(tmp_path, "llama-4-scout", interleave_moe_layer_step=2)))
    assert maverick_like.moe.num_moe_layers == 24 and maverick_like.intermediate_size == 16384
    assert maverick_like.moe.shared_intermediate_size == maverick_like.moe.expert_intermediate_size == 8192
    # Mixtral: every layer, no shared expert; its config.json leaves tie_word_embeddings to MixtralConfig (false)
    mixtral = resolve_model(str(FIXTURES / "mixtral-8x7b"))
    assert (mixtral.moe.num_moe_layers, mixtral.moe.shared_intermediate_size, mixtral.tied_embeddings) == (32, 0,
                                                                                                          False)


def test_local_attention_layers_as_vllm_reads_them(tmp_path):
    gpt_oss = resolve_model(str(FIXTURES / "gpt-oss-120b")).local_attention
    assert (gpt_oss.kind, gpt_oss.window, gpt_oss.num_layers) == ("sliding", 128, 18)
    # Llama 4: chunked attention on the RoPE layers, every fourth one NoPE and global by default
    scout = resolve_model(str(FIXTURES / "llama-4-scout")).local_attention
    assert (scout.kind, scout.window, scout.num_layers) == ("chunked", 8192, 36)
    explicit = resolve_model(str(with_changes(tmp_path, "llama-4-scout", no_rope_layers=[1, 0] * 24)))
    assert explicit.local_attention.num_layers == 24
    # Mistral: a sliding_window without layer_types is every layer's (vLLM's CacheConfig.sliding_window)
    mistral = resolve_model(str(Path(__file__).parent / "fixtures" / "hf" / "mistral-7b.json")).local_attention
    assert (mistral.window, mistral.num_layers) == (4096, 32)
    # Qwen: only with use_sliding_window, on the layers from max_window_layers on
    assert resolve_model(str(FIXTURES / "qwen3-30b-a3b")).local_attention is None
    qwen = resolve_model(str(with_changes(tmp_path, "qwen3-30b-a3b", use_sliding_window=True, sliding_window=4096,
                                          max_window_layers=40)))
    assert qwen.local_attention.num_layers == 8
    # vLLM takes a window of 0 as none
    assert resolve_model(str(with_changes(tmp_path, "mixtral-8x7b", sliding_window=0))).local_attention is None


def test_quantization_configs(tmp_path):
    # DeepSeek-V3: FP8 in 128 x 128 blocks with an FP32 scale each, activations FP8 too (W8A8)
    deepseek = resolve_model(str(FIXTURES / "deepseek-v3")).quantization
    assert (deepseek.method, deepseek.activation_bits) == ("fp8", 8)
    assert deepseek.bytes_per_weight == 1 + 4 / (128 * 128)
    # gpt-oss: "the MoE weights ... quantized to 4.25 bits per parameter" (OpenAI's model card)
    mxfp4 = resolve_model(str(FIXTURES / "gpt-oss-20b")).quantization
    assert mxfp4.bytes_per_weight * 8 == 4.25 and mxfp4.experts_only and mxfp4.activation_bits == 16
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    parsed = resolve_model(str(with_changes(tmp_path, "mixtral-8x7b", quantization_config=awq))).quantization
    assert parsed.bytes_per_weight == 0.5 + 2.5 / 128 and parsed.activation_bits == 16
    gptq = {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False}
    assert resolve_model(str(with_changes(tmp_path, "mixtral-8x7b", quantization_config=gptq))
                         ).quantization.bytes_per_weight == 1
    # compressed-tensors W8A8 INT8 (llm-compressor's scheme: per-channel int8 weights, per-token int8
    # activations) with an FP8 KV cache, which vLLM's --kv-cache-dtype auto then takes
    w8a8 = {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                                          "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    model = resolve_model(str(with_changes(tmp_path, "mixtral-8x7b", quantization_config=w8a8)))
    assert (model.quantization.weight_type, model.quantization.activation_bits, model.kv_cache_dtype) == \
        ("int", 8, "fp8")


@pytest.mark.parametrize("fixture, changes, message", [
    ("mixtral-8x7b", {"num_experts_per_tok": 9}, "num_experts_per_tok: got 9, expected at most the 8 experts"),
    ("gpt-oss-20b", {"layer_types": ["sliding_attention"] * 3},
     "layer_types: got .*, expected a list of 24 of attention, chunked_attention, full_attention"),
    ("gpt-oss-20b", {"quantization_config": {"quant_method": "bitsandbytes"}},
     'quantization_config.quant_method: got "bitsandbytes", expected one of fp8, awq, gptq'),
    ("deepseek-v3", {"moe_layer_freq": [0, 1]}, r"moe_layer_freq: got \[0, 1\], expected an integer"),
    ("llama-4-scout", {"num_hidden_layers": "48"}, "text_config: num_hidden_layers: got \"48\""),
    ("mixtral-8x7b", {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "a": {"weights": {"num_bits": 8, "type": "int"}}, "b": {"weights": {"num_bits": 4, "type": "int"}}}}},
     "config_groups: got 2 different schemes, expected one"),
])
def test_a_config_json_servetune_cannot_model_is_a_user_error_naming_the_key(tmp_path, fixture, changes, message):
    with pytest.raises(UserError, match=message):
        resolve_model(str(with_changes(tmp_path, fixture, **changes)))


def test_context_lengths_of_the_new_families(tmp_path):
    # RoPE types llama3 (Llama 4), yarn (gpt-oss, DeepSeek) are already in max_position_embeddings; Llama 4's
    # is in its text_config, which vLLM reads (hf_text_config)
    lengths = {name: resolve_model(str(FIXTURES / name)).max_model_len for name in FAMILIES}
    assert lengths == {"mixtral-8x7b": 32768, "qwen3-30b-a3b": 40960, "deepseek-v3": 163840, "gpt-oss-20b": 131072,
                       "gpt-oss-120b": 131072, "llama-4-scout": 10485760}
    linear = with_changes(tmp_path, "llama-4-scout", max_position_embeddings=8192,
                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert resolve_model(str(linear)).max_model_len == 16384


# ---------------------------------------------------------------------------------- serving options


def test_quantization_override_follows_vllms_refusals():
    mixtral, deepseek = MODELS["mixtral-8x7b"], MODELS["deepseek-v3"]
    assert with_serving_options(mixtral, "fp8").quantization == QUANTIZATION_PRESETS["fp8"]
    assert with_serving_options(deepseek, "fp8").quantization == deepseek.quantization   # its own method: a no-op
    with pytest.raises(InvalidValue, match="null or fp8: deepseek-v3's checkpoint is quantised with fp8"):
        with_serving_options(deepseek, "awq")
    with pytest.raises(InvalidValue, match="mxfp4 needs a checkpoint's quantization_config"):
        with_serving_options(mixtral, "mxfp4")
    assert with_serving_options(mixtral, kv_cache_dtype="fp8_e5m2").kv_dtype_bytes == 1


@pytest.mark.parametrize("key, value, message", [
    ("quantization", "int4", "quantization: got 'int4', expected one of fp8, awq, gptq, compressed-tensors, mxfp4"),
    ("kv_cache_dtype", "fp16", "kv_cache_dtype: got 'fp16', expected one of auto, fp8, fp8_e4m3, fp8_e5m2"),
    ("quantization", "compressed-tensors", "quantization: got 'compressed-tensors', expected null or one of fp8"),
])
def test_the_config_keys_refuse_what_vllm_would(key, value, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": "mixtral-8x7b", "hardware": {"gpu": "h100-80gb", "tp": 2}, key: value})


@pytest.mark.parametrize("model, value, message", [
    ("llama-3-8b", True, "hardware.enable_expert_parallel: got true, expected false: llama-3-8b is a dense model, "
                         "with no experts to shard"),
    ("mixtral-8x7b", "yes", "hardware.enable_expert_parallel: got 'yes', expected true or false"),
])
def test_the_expert_parallel_key_is_a_switch_for_models_with_experts(model, value, message):
    with pytest.raises(ConfigError) as error:
        config_from_dict({"model": model, "hardware": {"gpu": "h100-80gb", "tp": 2, "enable_expert_parallel": value}})
    assert len(error.value.lines) == 1 and message in error.value.lines[0]


# ---------------------------------------------------------------------------------- memory


def test_kv_bytes_per_token():
    # Mixtral: K and V of 8 heads of 128 in 32 layers, 2 bytes: 131,072 B; TP 2 halves the heads; FP8 a byte each
    mixtral = MODELS["mixtral-8x7b"]
    assert kv_bytes_per_token(mixtral, 1) == 131_072 and kv_bytes_per_token(mixtral, 2) == 65_536
    assert kv_bytes_per_token(with_serving_options(mixtral, kv_cache_dtype="fp8"), 2) == 32_768
    # MLA caches (d_c + d_h^R) values per token and layer (DeepSeek-V2, arXiv 2405.04434, Table 1): DeepSeek-V3's
    # 512 + 64 in 61 layers, 2 bytes: 70,272 B, on every GPU (vLLM's MLA has one KV head, not split by TP)
    deepseek = MODELS["deepseek-v3"]
    assert kv_bytes_per_token(deepseek, 1) == kv_bytes_per_token(deepseek, 8) == 70_272
    assert kv_bytes_per_token(with_serving_options(deepseek, kv_cache_dtype="fp8"), 8) == 35_136


def test_weights_per_gpu():
    # vLLM's blog post on serving gpt-oss (vllm-project.github.io): MXFP4 on the MoE weights alone "reduces the
    # model sizes to 63 GB (120B) and 14 GB (20B)"
    assert weight_bytes_per_gpu(MODELS["gpt-oss-120b"], 1) / 1e9 == pytest.approx(63, rel=0.05)
    assert weight_bytes_per_gpu(MODELS["gpt-oss-20b"], 1) / 1e9 == pytest.approx(14, rel=0.05)
    # DeepSeek-V3 in FP8: about a byte per parameter, an eighth per GPU at TP 8 (1.5% more: BF16 embeddings and
    # routers, and the MLA down-projections every GPU holds whole): more than an 80 GB H100 holds, so it needs
    # H200s (141 GB) there
    deepseek = MODELS["deepseek-v3"]
    assert 1.0 < weight_bytes_per_gpu(deepseek, 8) / (deepseek.total_params / 8) < 1.02
    with pytest.raises(InvalidValue, match="expected a GPU that holds deepseek-v3 at tp=8"):
        kv_capacity(deepseek, H100, 8, 0.9, 16, 2048, 256)
    assert kv_capacity(deepseek, H200, 8, 0.9, 16, 2048, 256).num_kv_blocks > 0
    # --quantization fp8 on a BF16 checkpoint: the layers' weights in a byte, embeddings and LM head in two
    llama = resolve_model("llama-2-7b", quantization="fp8")
    assert weight_bytes_per_gpu(llama, 1) == llama.num_layers * llama.layer_params + 2 * 2 * llama.embedding_params


def test_expert_parallelism_holds_whole_experts_unevenly_split(tmp_path):
    # 6 experts over 4 GPUs: vLLM gives the remainder to some GPUs, so the fullest holds 2 whole experts,
    # where TP gives every GPU a quarter of all 6
    six = resolve_model(str(with_changes(tmp_path, "mixtral-8x7b", num_local_experts=6)))
    expert_bytes = 3 * 4096 * 14336 * 2
    per_layer = weight_bytes_per_gpu(six, 4, expert_parallel=True) - weight_bytes_per_gpu(six, 4)
    assert per_layer == 32 * (2 - 6 / 4) * expert_bytes
    # TP splits each expert's width, EP does not
    with pytest.raises(InvalidValue, match="a divisor of .*'s expert width 100"):
        weight_bytes_per_gpu(dataclasses.replace(six, moe=dataclasses.replace(six.moe, expert_intermediate_size=100)),
                             8)


# Llama-3-8B (meta-llama/Meta-Llama-3-8B's config.json): 32 layers, hidden 4096, 32 query and 8 key/value heads of
# 128, a gated MLP of 14336, a vocabulary of 128256 in an untied input table and LM head.
LLAMA3_LAYER = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336   # fused QKV, output, gate/up, down
LLAMA3_EMBEDDINGS = 2 * 128256 * 4096


def test_memory_takes_vllms_precision_flags(capsys):
    def memory(*flags: str) -> dict:
        code, out = run_cli(capsys, "memory", "--model", "llama-3-8b", "--gpu", "h100-80gb", *flags, "--json")
        assert code == 0
        return json.loads(out)

    bf16, fp8_kv, fp8_weights = memory(), memory("--kv-cache-dtype", "fp8"), memory("--quantization", "fp8")
    # 2 (K and V) x layers x KV heads x head_dim x bytes per value
    assert bf16["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
    assert fp8_kv["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 1 == 65_536
    # the same bytes left for the cache hold twice the tokens, to a block's rounding
    assert fp8_kv["kv_cache_bytes"] == bf16["kv_cache_bytes"]
    assert fp8_kv["num_kv_blocks"] in (2 * bf16["num_kv_blocks"], 2 * bf16["num_kv_blocks"] + 1)
    assert fp8_kv["token_capacity"] == 16 * fp8_kv["num_kv_blocks"]
    # BF16: two bytes a weight; FP8: one byte a layer weight, the embeddings and LM head staying BF16
    assert bf16["weight_bytes_per_gpu"] == 2 * (32 * LLAMA3_LAYER + LLAMA3_EMBEDDINGS) == 16_059_990_016
    assert fp8_weights["weight_bytes_per_gpu"] == 32 * LLAMA3_LAYER + 2 * LLAMA3_EMBEDDINGS == 9_080_668_160
    # and what FP8 weights free goes to the cache
    assert fp8_weights["kv_cache_bytes"] - bf16["kv_cache_bytes"] == pytest.approx(32 * LLAMA3_LAYER)
    assert fp8_weights["precision"] == {"weights": "fp8 (W8A8)", "kv_cache_dtype": "auto"}


def test_the_expert_parallel_key_sizes_the_cache_and_prices_the_steps(tmp_path, capsys):
    from servetune.cost_models.factory import build_cost_model

    # Mixtral's shapes with 6 experts over 4 GPUs: under expert parallelism the fullest GPU holds 2 whole experts
    # (vLLM's determine_expert_map gives the first 6 % 4 GPUs one more than 6 // 4), under TP a quarter of all 6.
    path = with_changes(tmp_path, "mixtral-8x7b", num_local_experts=6)
    h, width, layers = 4096, 14336, 32
    attention = h * (8 + 2 * 2) * 128 + 8 * 128 * h      # 32/4 query and 8/4 key/value heads of 128 a GPU
    router = h * 6                                       # replicated
    embeddings = 2 * 32000 * h // 4                      # vocabulary-parallel input table and LM head
    expert = 3 * h * width                               # one whole gated expert
    ep_weights = 2 * (layers * (attention + router + 2 * expert) + embeddings)
    code, out = run_cli(capsys, "memory", "--model", str(path), "--gpu", "h100-80gb", "--tp", "4",
                        "--enable-expert-parallel", "--json")
    assert code == 0 and json.loads(out)["weight_bytes_per_gpu"] == ep_weights == 23_352_311_808

    def config(expert_parallel: bool) -> Config:
        return config_from_dict({"model": str(path), "cost_model": {"kind": "roofline"},
                                 "hardware": {"gpu": "h100-80gb", "tp": 4, "enable_expert_parallel": expert_parallel}})

    # The cache vLLM sizes at the defaults (utilization 0.92, and on an H100 8,192 batched tokens and 1,024 seats,
    # blocks of 16): each
    # token's MoE activations are the residual stream twice and, for each of its 2 experts with the share 2/6 of
    # them this GPU holds, gate/up, activation and output; the sampler's FP32 logits and probabilities; 1 GiB.
    activations = math.ceil(2 * h + 2 * (2 / 6) * (2 * width + width + h)) * 2 * 8192
    reserve = activations + 1024 * 32000 * 4 * 2 + GIB
    block_bytes = 16 * 2 * layers * (8 // 4) * 128 * 2
    assert derive_num_kv_blocks(config(True)) == int((80 * GIB * 0.92 - ep_weights - reserve) // block_bytes)
    assert derive_num_kv_blocks(config(True)) < derive_num_kv_blocks(config(False))
    # A prefill of 2048 tokens reaches every expert: it reads the 2 whole experts a GPU holds, not 6 quarters.
    prefill = batch(prefill_tokens=2048)
    routed = {ep: float(step_costs(build_cost_model(config(ep))[1], prefill).routed_weight_bytes)
              for ep in (True, False)}
    assert routed[True] == pytest.approx(2 * layers * 2 * expert, rel=1e-6)
    assert routed[False] == pytest.approx(2 * layers * 6 * expert / 4, rel=1e-6)


def test_the_expert_parallel_key_enters_the_config_hash_only_when_set():
    from servetune.search.provenance import config_hash, content_data

    def config(**hardware) -> Config:
        return config_from_dict({"model": "mixtral-8x7b", "hardware": {"gpu": "h100-80gb", "tp": 2, **hardware}})

    # left out at its default, so that studies and policies recorded before the key existed keep their hashes
    assert "enable_expert_parallel" not in content_data(config())["hardware"]
    assert config_hash(config(enable_expert_parallel=False)) == config_hash(config())
    assert config_hash(config(enable_expert_parallel=True)) != config_hash(config())


def test_fp8_kv_cache_doubles_the_blocks_and_sliding_layers_are_sized_the_hybrid_way():
    def config(**top):
        return Config(hardware=HardwareConfig(gpu="h100-80gb", tp=2), cost_model=CostModelConfig(kind="roofline"),
                      **{"model": "mixtral-8x7b", **top})
    auto, fp8 = derive_num_kv_blocks(config()), derive_num_kv_blocks(config(kv_cache_dtype="fp8"))
    assert fp8 in (2 * auto, 2 * auto + 1)
    # gpt-oss-120b: vLLM's hybrid manager puts the 18 full-attention and the 18 sliding layers in two groups of
    # 18, each block of the shared pool 18 layers' pages (kv_cache_planning._get_kv_cache_bytes_per_block); a
    # sliding request holds only its window's blocks. The engine charges the full group's blocks and the windows
    # are reserved for every seat: what vLLM's pool holds is the engine's blocks plus the reserve's.
    model, page = MODELS["gpt-oss-120b"], 16 * 2 * 8 * 64 * 2
    capacity = kv_capacity(model, H100, 1, 0.9, 16, 2048, 256)
    vllm_blocks = int(capacity.kv_cache_bytes // (18 * page))
    reserve = 18 * 2 * 8 * 64 * 2 * (256 * (math.ceil(128 / 16) + 1) * 16 + 2048)
    assert capacity.window_reserve_bytes == reserve and capacity.kv_bytes_per_token == 18 * 2 * 8 * 64 * 2
    assert capacity.num_kv_blocks == int((capacity.kv_cache_bytes - reserve) // (18 * page)) < vllm_blocks
    assert capacity.num_kv_blocks > int(capacity.kv_cache_bytes // (36 * page))   # charging every layer
    # Llama 4 Scout's 8192-token chunks on 36 of 48 layers: reserving them for 256 seats costs more than it
    # saves, so every layer is charged for every token, as before
    scout = kv_capacity(MODELS["llama-4-scout"], H100, 4, 0.9, 16, 2048, 256)
    assert scout.window_reserve_bytes == 0
    assert scout.kv_bytes_per_token == kv_bytes_per_token(MODELS["llama-4-scout"], 4)


# ---------------------------------------------------------------------------------- roofline


@pytest.mark.parametrize("experts, per_token, tokens", [(8, 2, 1), (8, 2, 3), (256, 8, 16), (128, 4, 64)])
def test_expected_experts_touched_matches_a_monte_carlo_of_uniform_routing(experts, per_token, tokens):
    rng = np.random.default_rng(0)
    trials = 4000
    choices = np.argsort(rng.random((trials, tokens, experts)), axis=-1)[..., :per_token]   # k distinct experts
    distinct = np.array([len(np.unique(trial)) for trial in choices])
    expected = experts * float(experts_touched(1 - per_token / experts, tokens))
    standard_error = distinct.std() / math.sqrt(trials) + 1e-9
    assert abs(distinct.mean() - expected) < 4 * standard_error + 1e-6


def test_an_moe_decode_reads_the_dense_part_and_the_experts_its_tokens_touch():
    mixtral = MODELS["mixtral-8x7b"]
    params = build_roofline_params(mixtral, H200, 1, NO_OVERHEADS)
    h, layers = 4096, 32
    attention, router, expert = h * (4096 + 2 * 1024) + 4096 * h, h * 8, 3 * h * 14336
    lm_head = 32000 * h
    one = step_costs(params, batch(decodes=1, context=100))
    # one token: its 2 experts in each layer
    assert float(one.weight_bytes) == pytest.approx(2 * (layers * (attention + router + 2 * expert) + lm_head),
                                                    rel=1e-6)
    assert float(one.routed_weight_bytes) == pytest.approx(2 * layers * 2 * expert, rel=1e-6)
    # 64 tokens touch all 8 experts (8 x (1 - (6/8)^64) rounds to 8 in float32)
    many = step_costs(params, batch(decodes=64, context=100))
    assert float(many.routed_weight_bytes) == pytest.approx(2 * layers * 8 * expert, rel=1e-6)
    # FLOPs follow the active parameters: 2 per active weight and token (the LM head once per sequence, the
    # embedding lookup no matmul)
    assert float(many.matmul_flops) == pytest.approx(2 * 64 * (mixtral.active_params - mixtral.embedding_params),
                                                     rel=1e-6)


def test_expert_parallelism_and_the_load_spread():
    qwen = MODELS["qwen3-30b-a3b"]
    step = batch(prefill_tokens=4096)
    tp = step_costs(build_roofline_params(qwen, H100, 4, NO_OVERHEADS), step)
    ep = step_costs(build_roofline_params(qwen, H100, 4, NO_OVERHEADS, expert_parallel=True), step)
    skewed = step_costs(build_roofline_params(qwen, H100, 4, NO_OVERHEADS, expert_parallel=True,
                                              expert_load_imbalance=0.5), step)
    # the mean GPU's work is the same whether it holds a quarter of each expert or a quarter of the experts
    assert float(ep.matmul_flops) == pytest.approx(float(tp.matmul_flops), rel=1e-6)
    assert float(ep.routed_weight_bytes) == pytest.approx(float(tp.routed_weight_bytes), rel=1e-6)
    # the busiest GPU under EP multiplies 1.5x its share of routed tokens: 2 x 8 x 3 x 2048 x 768 / 4 per token
    routed = 2 * 48 * 8 * 3 * 2048 * 768 / 4 * 4096
    assert float(skewed.matmul_flops - ep.matmul_flops) == pytest.approx(0.5 * routed, rel=1e-5)
    with pytest.raises(InvalidValue, match="expert_load_imbalance"):
        build_roofline_params(qwen, H100, 4, expert_parallel=True, expert_load_imbalance=-0.1)


def test_mla_decodes_in_the_latent_space_and_prefills_expanded():
    deepseek = MODELS["deepseek-v3"]
    params = build_roofline_params(deepseek, H200, 8, NO_OVERHEADS)
    heads, layers = 128 // 8, 61
    decode = step_costs(params, batch(decodes=4, context=999))
    # q.k over 512 + 64 latent values and p.v over 512, per head; the latent read once per token and layer
    assert float(decode.attention_flops) == pytest.approx(4 * 1000 * layers * heads * 2 * (576 + 512), rel=1e-6)
    assert float(decode.kv_bytes) == pytest.approx(4 * 1000 * layers * 576 * 2, rel=1e-6)
    # a 512-token chunk on 1000 cached tokens: ordinary attention with 192-wide keys and 128-wide values, and the
    # cached latents expanded by kv_b_proj (512 -> 16 heads x (128 + 128))
    prefill = step_costs(params, batch(prefill_tokens=512, cached=1000))
    pairs = 512 * (1000 + 256)
    expected = layers * heads * 2 * (192 + 128) * pairs + layers * 2 * 512 * heads * 256 * 1000
    assert float(prefill.attention_flops) == pytest.approx(expected, rel=1e-5)


def test_local_attention_reads_at_most_the_window():
    gpt_oss = MODELS["gpt-oss-120b"]
    params = build_roofline_params(gpt_oss, H100, 1, NO_OVERHEADS)
    per_token_layer = 2 * 8 * 64 * 2
    long = step_costs(params, batch(decodes=8, context=7999))
    assert float(long.kv_bytes) == pytest.approx(8 * per_token_layer * (18 * 8000 + 18 * 128), rel=1e-6)
    short = step_costs(params, batch(decodes=8, context=99))   # within the window: every layer reads it all
    assert float(short.kv_bytes) == pytest.approx(8 * per_token_layer * 36 * 100, rel=1e-6)
    # a prefill chunk: the sliding layers read the window before it and the chunk
    chunk = step_costs(params, batch(prefill_tokens=1000, cached=5000))
    assert float(chunk.kv_bytes) == pytest.approx(per_token_layer * (18 * 6000 + 18 * (128 + 1000)), rel=1e-6)
    scout = step_costs(build_roofline_params(MODELS["llama-4-scout"], H100, 4, NO_OVERHEADS),
                       batch(decodes=2, context=19999))
    assert float(scout.kv_bytes) == pytest.approx(2 * 2 * 2 * 128 * 2 * (12 * 20000 + 36 * 8192), rel=1e-6)


def test_w8a8_multiplies_at_the_fp8_rate_where_the_gpu_has_one():
    llama = MODELS["llama-3-70b"]
    fp8 = with_serving_options(llama, "fp8")
    prefill = batch(prefill_tokens=16384)

    def matmul_compute_s(model, gpu):
        costs = step_costs(build_roofline_params(model, gpu, 4, NO_OVERHEADS), prefill)
        return float(costs.matmul_s), float(costs.matmul_flops)

    bf16_s, flops = matmul_compute_s(llama, H100)
    fp8_s, fp8_flops = matmul_compute_s(fp8, H100)
    lm_head_flops = 2 * 8192 * 128256 / 4
    layer_flops = flops - lm_head_flops
    # H100 SXM: 1,979 dense FP8 TFLOP/s against 989 BF16 (NVIDIA's datasheet, cost_models/gpus.py)
    assert fp8_flops == flops
    assert fp8_s / bf16_s == pytest.approx((layer_flops * 989 / 1979 + lm_head_flops) / flops, rel=0.01)
    # the A100 has no FP8 tensor cores: vLLM's Marlin kernels multiply in BF16, only the weights shrink
    a100_bf16, _ = matmul_compute_s(llama, A100)
    a100_fp8, _ = matmul_compute_s(fp8, A100)
    assert a100_fp8 == pytest.approx(a100_bf16, rel=0.01)
    decode = batch(decodes=1, context=10)
    bytes_bf16 = float(step_costs(build_roofline_params(llama, A100, 4, NO_OVERHEADS), decode).weight_bytes)
    bytes_fp8 = float(step_costs(build_roofline_params(fp8, A100, 4, NO_OVERHEADS), decode).weight_bytes)
    assert bytes_fp8 / bytes_bf16 == pytest.approx(0.5, abs=0.03)   # the BF16 LM head keeps a few percent


# Step times the cost model gave before the model families existed (commit f96f66f), for decodes of 8 x 1024
# tokens, a 512-token prefill, a mixed step, 256 x 30000-token decodes and a long prefill beside 3 decodes: the
# families must leave dense BF16 models' step costs and KV caches bit for bit as they were. The rows with a shipped
# profile were recorded again when the profiles were refitted with attention_causal_pair_ratio (issue 16).
RECORDED_STEPS = [
    ("llama-2-7b", "a100-80gb", 1, True, None,
     [0.012276609428226948, 0.03531713783740997, 0.39303672313690186, 2.488650321960449, 0.8133897185325623]),
    ("llama-2-7b", "a100-80gb", 1, True, "llama-2-7b_a100-80gb.json",
     [0.012380292639136314, 0.037548404186964035, 0.4070132374763489, 2.4356091022491455, 1.0186768770217896]),
    ("llama-3-70b", "h100-80gb", 4, True, "llama-2-7b_h100-80gb.json",
     [0.02167704701423645, 0.0505736842751503, 0.23929482698440552, 0.27098119258880615, 0.49662894010543823]),
]
RECORDED_BLOCKS = [("llama-2-7b", "a100-80gb", 1, 7457), ("llama-3-70b", "h100-80gb", 4, 31031),
                   ("mistral-7b", "h100-80gb", 1, 29330), ("qwen2.5-7b", "l4", 1, 7052)]


RECORDED_ROWS = [(0, 0, 0, 0, 0, 8, 8 * 1025), (1, 512, 512, 512 * 256, 512 * 256, 0, 0),
                 (2, 3000, 5000, 4e6, 2 * 1500 * 750, 64, 64 * 9000), (0, 0, 0, 0, 0, 256, 256 * 30000),
                 (1, 2048, 100000, 2048 * 99000, 2048 * 1024, 3, 3 * 100)]


def recorded_step_times(model, gpu, tp, async_scheduling, profile) -> np.ndarray:
    steps = StepBatch(*(jnp.array([row[i] for row in RECORDED_ROWS], jnp.float32) for i in range(7)))
    calibration = load_profile(SHIPPED_PROFILES_DIR / profile)[0] if profile else Calibration()
    params = build_roofline_params(MODELS[model], resolve_gpu(gpu), tp, calibration,
                                   async_scheduling=async_scheduling, cudagraph_capture_size=512)
    return np.asarray(step_costs(params, steps).total_s)


@pytest.mark.parametrize("model, gpu, tp, async_scheduling, profile, recorded", RECORDED_STEPS)
def test_dense_step_costs_are_bit_for_bit_as_recorded(model, gpu, tp, async_scheduling, profile, recorded):
    assert np.array_equal(recorded_step_times(model, gpu, tp, async_scheduling, profile),
                          np.array(recorded, np.float32))


def test_mistral_7b_attends_within_its_4096_token_window():
    # mistralai/Mistral-7B-v0.1's config.json: "sliding_window": 4096 on all 32 layers (test_hf_config.py holds the
    # entry equal to the file)
    mistral = MODELS["mistral-7b"]
    assert mistral.local_attention == LocalAttention("sliding", 4096, 32)
    params = build_roofline_params(mistral, H100, 1, NO_OVERHEADS)
    per_token = 32 * 2 * 8 * 128 * 2   # layers x K and V x KV heads x head_dim x BF16 bytes
    # decodes on 9,000 cached tokens read the last 4,096 (the query's own included); within the window, all of it
    assert float(step_costs(params, batch(decodes=8, context=8999)).kv_bytes) == pytest.approx(
        8 * 4096 * per_token, rel=1e-6)
    assert float(step_costs(params, batch(decodes=8, context=1024)).kv_bytes) == pytest.approx(
        8 * 1025 * per_token, rel=1e-6)
    # the steps whose contexts stay within the window cost what they did before the entry had it (commit f96f66f);
    # the three beyond it (contexts 9,000, 30,000 and 100,000) cost less
    times = recorded_step_times("mistral-7b", "h100-80gb", 1, False, None)
    before_window = np.array([0.008299155160784721, 0.01565658487379551, 0.1052171140909195,
                              0.38902369141578674, 0.26481062173843384], np.float32)
    assert np.array_equal(times[:2], before_window[:2]) and np.all(times[2:] < before_window[2:])


def _mistral(**scheduler) -> Config:
    return config_from_dict({"model": "mistral-7b", "cost_model": {"kind": "roofline"},
                             "hardware": {"gpu": "h100-80gb"},
                             "scheduler": {"max_num_batched_tokens": 2048, "num_kv_blocks": 2000, **scheduler}})


def test_a_model_whose_every_layer_slides_fills_its_window_when_the_config_resolves():
    from servetune.pipeline import fill_derived, resolve

    assert fill_derived(_mistral()).scheduler.sliding_window == 4096   # its config.json's, on all 32 layers
    # gpt-oss slides on half its layers: vLLM keeps the full-attention layers' blocks, so no window is freed
    assert fill_derived(config_from_dict({"model": "gpt-oss-20b", "cost_model": {"kind": "roofline"},
                                          "hardware": {"gpu": "h100-80gb"}})).scheduler.sliding_window is None
    assert fill_derived(config_from_dict({"model": "llama-2-7b"})).scheduler.sliding_window is None
    assert resolve(_mistral(sliding_window=4096)).scheduler.sliding_window == 4096
    with pytest.raises(ConfigError, match="sliding_window: got 512, but mistral-7b has a 4096-token sliding window"):
        fill_derived(_mistral(sliding_window=512))
    with pytest.raises(ConfigError, match="sliding_window: got 512, but llama-2-7b has no window"):
        fill_derived(config_from_dict({"model": "llama-2-7b", "scheduler": {"sliding_window": 512}}))
    with pytest.raises(ConfigError, match="enable_prefix_caching: true is not simulated under mistral-7b's 4096-token"):
        resolve(_mistral(enable_prefix_caching=True))


def test_vllm_refuses_a_cache_smaller_than_one_request_under_the_window():
    from servetune.pipeline import fill_derived, vllm_refusal

    # SlidingWindowSpec.max_admission_blocks_per_request: min(4096 - 1 + 2 x 2048 in flight (async), 32768) tokens
    # = 8191, in blocks of 16: 512, plus one = 513; the null block makes 514 the fewest vLLM starts with
    assert vllm_refusal(fill_derived(_mistral(num_kv_blocks=514))) is None
    refusal = vllm_refusal(fill_derived(_mistral(num_kv_blocks=513)))
    assert refusal is not None and "max_model_len: 32768 tokens under the 4096-token sliding window hold up to 513 KV blocks" in refusal
    # (full attention would ask for ceil(32768 / 16) = 2048 blocks of this max_model_len)


def test_mistral_7b_kv_cache_by_hand():
    """Every layer slides, so vLLM's pool (one KV group, all 32 layers per block) has the blocks a full-attention
    model of these shapes would; vLLM's SlidingWindowManager.remove_skipped_blocks frees the blocks before token
    computed - 4096 + 1, so a request holds at most ceil(4096 / 16) + 1 = 257 blocks of 16 tokens."""
    mistral, gib = MODELS["mistral-7b"], 2**30
    per_token = 32 * 2 * 8 * 128 * 2
    layer = 4096 * (4096 + 2 * 8 * 128) + 4096 * 4096 + 3 * 4096 * 14336
    weights = (32 * layer + 2 * 32000 * 4096) * 2
    # one token's MLP activations x 2,048 batched tokens, FP32 logits and probabilities for 128 seats, 1 GiB
    reserve = (2 * 4096 + 2 * 14336 + 14336) * 2 * 2048 + 128 * 32000 * 4 * 2 + gib
    blocks = int((80 * gib * 0.9 - weights - reserve) // (16 * per_token))
    capacity = kv_capacity(mistral, H100, 1, 0.9, 16, 2048, 128)
    assert (capacity.num_kv_blocks, capacity.kv_bytes_per_token) == (blocks, per_token)
    assert capacity.window_reserve_bytes == 0
    # one seat's window in the hybrid manager's terms: 257 blocks of 16 tokens on every layer
    assert window_reserve_bytes(mistral, 1, 16, max_num_batched_tokens=0, max_num_seqs=1) == 257 * 16 * per_token


@pytest.mark.parametrize("model, gpu, tp, recorded", RECORDED_BLOCKS)
def test_dense_kv_caches_are_as_recorded(model, gpu, tp, recorded):
    assert kv_capacity(MODELS[model], resolve_gpu(gpu), tp, 0.9, 16, 2048, 128).num_kv_blocks == recorded


# ---------------------------------------------------------------------------------- commands and exports


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    code = args.func(args)
    return code, capsys.readouterr().out


def test_cost_shows_the_moe_breakdown_and_models_lists_the_families(capsys, monkeypatch):
    code, out = run_cli(capsys, "cost", "--model", "mixtral-8x7b", "--gpu", "h100-80gb", "--tp", "2",
                        "--decode-batch", "1", "--kv-cache-dtype", "fp8", "--json")
    result = json.loads(out)
    assert code == 0 and result["moe"]["experts_touched_per_layer"] == pytest.approx(2.0)
    assert result["moe"]["active_params"] == MODELS["mixtral-8x7b"].active_params
    assert result["precision"] == {"weights": "bf16", "kv_cache_dtype": "fp8"}
    monkeypatch.setenv("COLUMNS", "120")
    code, out = run_cli(capsys, "cost", "--model", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--decode-batch", "16")
    assert code == 0 and "of which routed experts" in out and "fp8 (W8A8)" in out
    code, out = run_cli(capsys, "models", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["deepseek-v3"]["mla"]["kv_lora_rank"] == 512 and rows["gpt-oss-20b"]["weights"] == "mxfp4"
    assert rows["llama-4-scout"]["experts"] == "16/1+1" and rows["llama-2-7b"]["moe"] is None
    with pytest.raises(UserError, match="--expert-load-imbalance is for --enable-expert-parallel"):
        run_cli(capsys, "cost", "--model", "qwen3-30b-a3b", "--decode-batch", "1", "--expert-load-imbalance", "0.2")


def test_the_vllm_export_carries_the_precision_flags():
    from servetune.pipeline import resolve
    from servetune.search.export import Policy, export

    def exported(engine: str, **top):
        config = resolve(config_from_dict({"model": "mixtral-8x7b", "hardware": {"gpu": "h100-80gb", "tp": 2},
                                           "cost_model": {"kind": "roofline"}, **top}))
        return export(Policy(config, kv_blocks_given=False), engine)

    fp8 = exported("vllm", quantization="fp8", kv_cache_dtype="fp8")
    assert "quantization: fp8\n" in fp8.text and "kv-cache-dtype: fp8\n" in fp8.text   # vLLM 0.33's flags
    # an AWQ checkpoint carries its method in its config.json: no flag, a reminder to serve one
    awq = exported("vllm", quantization="awq")
    assert "quantization:" not in awq.text and any("serve one" in warning for warning in awq.warnings)
    assert "sglang cannot express kv_cache_dtype=fp8" in exported("sglang", kv_cache_dtype="fp8").warnings
    # DeepSeek-V3's own FP8 needs no flag: vLLM reads it from the checkpoint
    deepseek = resolve(config_from_dict({"model": "deepseek-v3", "quantization": "fp8",
                                         "cost_model": {"kind": "roofline"}, "hardware": {"gpu": "h200", "tp": 8}}))
    assert "quantization:" not in export(Policy(deepseek, kv_blocks_given=False), "vllm").text


def test_every_export_carries_expert_parallelism():
    from servetune.pipeline import resolve
    from servetune.search.export import Policy, export

    def exported(engine: str, expert_parallel: bool):
        config = resolve(config_from_dict({"model": "mixtral-8x7b", "cost_model": {"kind": "roofline"},
                                           "hardware": {"gpu": "h100-80gb", "tp": 2,
                                                        "enable_expert_parallel": expert_parallel}}))
        return export(Policy(config, kv_blocks_given=True), engine)

    on = exported("vllm", True)
    assert yaml.safe_load(on.text)["enable-expert-parallel"] is True   # vLLM 0.33's --enable-expert-parallel
    # vLLM's expert-parallel group is its tensor-parallel one (vllm/config/parallel.py), so the file needs the
    # degree too: without it vLLM would start on one GPU with nothing to spread the experts over.
    assert yaml.safe_load(on.text)["tensor-parallel-size"] == 2
    assert not any("enable_expert_parallel" in warning for warning in on.warnings)
    assert "enable-expert-parallel" not in exported("vllm", False).text
    # The same placement, every GPU holding its own experts, in the other engines' own words: SGLang's
    # --ep-size degree (python/sglang/srt/server_args.py) and TensorRT-LLM's LlmArgs fields
    # (tensorrt_llm/llmapi/llm_args.py), whose MoE TP x EP must make the TP degree (tensorrt_llm/mapping.py).
    sglang, trtllm = exported("sglang", True), exported("trtllm", True)
    assert yaml.safe_load(sglang.text)["ep-size"] == 2 and yaml.safe_load(sglang.text)["tp-size"] == 2
    trt_keys = yaml.safe_load(trtllm.text)
    assert (trt_keys["moe_expert_parallel_size"], trt_keys["moe_tensor_parallel_size"]) == (2, 1)
    assert trt_keys["moe_expert_parallel_size"] * trt_keys["moe_tensor_parallel_size"] == trt_keys["tensor_parallel_size"]
    for file in (sglang, trtllm):
        assert not any("enable_expert_parallel" in warning for warning in file.warnings), file.warnings
    assert "ep-size" not in exported("sglang", False).text
    assert "moe_expert_parallel_size" not in exported("trtllm", False).text


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_simulate_runs_an_moe_model_with_an_fp8_kv_cache(expert_parallel):
    from servetune.pipeline import simulate_config

    # the shapes of test_gpu_definitions.py's small run, so that the compiled engine is shared
    config = config_from_dict({"model": "mixtral-8x7b", "kv_cache_dtype": "fp8", "cost_model": {"kind": "roofline"},
                               "hardware": {"gpu": "h100-80gb", "tp": 2, "enable_expert_parallel": expert_parallel},
                               "workload": {"arrivals": {"kind": "poisson", "rate": 40.0}, "num_requests": 12,
                                            "lengths": {"kind": "fixed", "prompt_tokens": 96, "output_tokens": 12}},
                               "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}})
    report = simulate_config(config)
    assert report.metrics["completed"] == 12
    # a decode step reads at least one token's active weights, 12.9B parameters in BF16 split over 2 GPUs: at an
    # H100's 3.35 TB/s, 3.9 ms, which no inter-token gap can beat
    active_s = MODELS["mixtral-8x7b"].active_params * 2 / 2 / 3.35e12
    assert active_s * 1e3 < report.metrics["median_itl_ms"]
    assert report.config.scheduler.num_kv_blocks == derive_num_kv_blocks(config)


def test_keys_added_since_the_shipped_results_leave_their_config_hashes_unchanged():
    """results/*.policy.yaml record the hash of the config they were tuned on; a key added later with its
    default value (scheduler.sliding_window among them) must not change it."""

    from servetune.config_loader import load_config
    from servetune.search.provenance import config_hash

    for scenario in ("chat", "static", "azure_conv"):
        recorded = yaml.safe_load(Path(f"results/{scenario}.policy.yaml").read_text())
        provenance = recorded["provenance"]
        assert config_hash(load_config(f"examples/{scenario}.yaml")) == provenance["config_hash"], scenario
