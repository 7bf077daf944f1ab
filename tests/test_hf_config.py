"""Reading model shapes from Hugging Face config.json files (fixtures in tests/fixtures/hf)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servetune.config import Config, CostModelConfig
from servetune.cost_models.catalog import resolve_model
from servetune.cost_models.factory import build_cost_model, derive_num_kv_blocks
from servetune.cost_models.models import MODELS
from servetune.errors import UserError

HF = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize("file, catalogue_name", [("llama-2-7b.json", "llama-2-7b"),
                                                  ("llama-3.1-8b.json", "llama-3.1-8b"),
                                                  ("mistral-7b.json", "mistral-7b"),
                                                  ("qwen2.5-7b.json", "qwen2.5-7b"),
                                                  ("opt-13b.json", "opt-13b"),
                                                  ("phi-2", "phi-2")])
def test_config_json_gives_the_catalogue_shapes(file, catalogue_name):
    parsed, entry = resolve_model(str(HF / file)), MODELS[catalogue_name]
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "gated_mlp", "tied_embeddings", "max_model_len", "local_attention"):
        assert getattr(parsed, field) == getattr(entry, field), field
    assert parsed.total_params == entry.total_params


def test_bloom_keys_and_implicit_mlp_width():
    bloom = resolve_model(str(HF / "bloom-7b1.json"))
    assert (bloom.num_layers, bloom.num_heads, bloom.num_kv_heads, bloom.head_dim) == (30, 32, 32, 128)
    assert bloom.intermediate_size == 4 * 4096 and not bloom.gated_mlp and bloom.tied_embeddings
    assert bloom.total_params / 1e9 == pytest.approx(7.07, rel=0.01)   # BLOOM-7b1: 7.07B parameters


def test_a_folder_holding_config_json_and_null_kv_heads():
    phi = resolve_model(str(HF / "phi-2"))
    assert phi.name == "phi-2" and phi.num_kv_heads == 32 and phi.head_dim == 80 and not phi.gated_mlp


def test_relative_paths_start_at_the_config_folder():
    assert resolve_model("./llama-2-7b.json", base_dir=HF).num_layers == 32


def test_config_model_path_flows_through_the_factory():
    config = Config(model=str(HF / "mistral-7b.json"), cost_model=CostModelConfig(kind="roofline"))
    _, params = build_cost_model(config)
    assert float(params.num_layers) == 32
    assert derive_num_kv_blocks(config) > 0


@pytest.mark.parametrize("file, message", [
    ("broken.json", "not valid JSON"),
    ("not-a-transformer.json", "num_hidden_layers / n_layer / num_layers: missing, expected a positive integer"),
    # an expert count without the experts each token goes to
    ("mixtral.json", "num_experts_per_tok / experts_per_token / moe_top_k: missing, expected a positive integer"),
    ("missing.json", "missing.json: no such model config"),
    ("bad-context-length.json", "max_position_embeddings: got \"4k\", expected an integer in \\[2, 9007199254740992\\]"),
])
def test_bad_config_files_are_user_errors(file, message):
    with pytest.raises(UserError, match=message):
        resolve_model(str(HF / file))


# ---------------------------------------------------------------------------- context length (max_model_len)


def _with(tmp_path: Path, **changes) -> Path:
    """The Llama-2-7b fixture with keys changed (None removes one), written to tmp_path."""
    config = json.loads((HF / "llama-2-7b.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_max_position_embeddings_is_the_context_length():
    assert resolve_model(str(HF / "llama-2-7b.json")).max_model_len == 4096
    # Mistral's 4096-token sliding window does not cap it (vLLM caps only under --disable-sliding-window)
    assert resolve_model(str(HF / "mistral-7b.json")).max_model_len == 32768
    # Llama 3.1's "llama3" RoPE scaling is already in max_position_embeddings: not multiplied again
    assert resolve_model(str(HF / "llama-3.1-8b.json")).max_model_len == 131072


def test_no_length_key_gives_none(tmp_path):
    assert resolve_model(str(_with(tmp_path, max_position_embeddings=None))).max_model_len is None
    assert resolve_model(str(HF / "bloom-7b1.json")).max_model_len is None


@pytest.mark.parametrize("value", ["4096", 4096.0, 1, 0, -8, True, [4096]])
def test_an_invalid_context_length_is_a_user_error(tmp_path, value):
    with pytest.raises(UserError, match=r"config\.json: max_position_embeddings: got .*, expected an integer in "
                                        r"\[2, 9007199254740992\]"):
        resolve_model(str(_with(tmp_path, max_position_embeddings=value)))


def test_the_other_length_keys_in_vllms_order(tmp_path):
    # GPT-2 style n_positions alone; with several keys the smallest wins
    assert resolve_model(str(_with(tmp_path, max_position_embeddings=None, n_positions=1024))).max_model_len == 1024
    assert resolve_model(str(_with(tmp_path, seq_length=2048))).max_model_len == 2048
    # Command-R's model_max_length replaces the others, even when larger
    assert resolve_model(str(_with(tmp_path, model_max_length=131072))).max_model_len == 131072
    with pytest.raises(UserError, match='seq_length: got "long", expected an integer in'):
        resolve_model(str(_with(tmp_path, seq_length="long")))


@pytest.mark.parametrize("rope, expected", [
    ({"type": "linear", "factor": 4.0}, 16384),             # legacy "type" key: linear scaling multiplies
    ({"rope_type": "dynamic", "factor": 2.0}, 8192),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),  # already scaled
    ({"rope_type": "llama3", "factor": 8.0}, 4096),
    ({"rope_type": "default", "rope_theta": 10000.0}, 4096),  # transformers 5 rope_parameters, no factor
    ({"rope_type": "linear", "factor": None}, 4096),          # vLLM treats a null factor as 1
])
def test_rope_scaling_as_vllm_applies_it(tmp_path, rope, expected):
    assert resolve_model(str(_with(tmp_path, rope_scaling=rope))).max_model_len == expected


def test_longrope_defaults_to_the_original_length(tmp_path):
    path = _with(tmp_path, max_position_embeddings=131072, original_max_position_embeddings=4096,
                 rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})
    assert resolve_model(str(path)).max_model_len == 4096


def test_an_invalid_rope_factor_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r'rope_scaling.factor: got "x", expected a number in \(0, 1e\+06\]'):
        resolve_model(str(_with(tmp_path, rope_scaling={"type": "linear", "factor": "x"})))
