"""Reading model shapes from Hugging Face config.json files (fixtures in tests/fixtures/hf)."""
from __future__ import annotations

from pathlib import Path

import pytest

from servetune.config import Config, CostModelConfig
from servetune.cost_models.catalog import resolve_model
from servetune.cost_models.factory import build_cost_model, derive_num_kv_blocks
from servetune.cost_models.models import MODELS
from servetune.errors import UserError

HF = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize("file, catalogue_name", [("llama-2-7b.json", "llama-2-7b"),
                                                  ("mistral-7b.json", "mistral-7b"),
                                                  ("qwen2.5-7b.json", "qwen2.5-7b"),
                                                  ("opt-13b.json", "opt-13b")])
def test_config_json_gives_the_catalogue_shapes(file, catalogue_name):
    parsed, entry = resolve_model(str(HF / file)), MODELS[catalogue_name]
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "gated_mlp", "tied_embeddings"):
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


@pytest.mark.parametrize("file, message", [("broken.json", "not valid JSON"),
                                           ("not-a-transformer.json", "no num_hidden_layers"),
                                           ("mixtral.json", "mixture-of-experts"),
                                           ("missing.json", "does not exist")])
def test_bad_config_files_are_user_errors(file, message):
    with pytest.raises(UserError, match=message):
        resolve_model(str(HF / file))
