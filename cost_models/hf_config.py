"""Read a model's shapes from a Hugging Face ``config.json`` on disk (nothing is downloaded).

Understands the Llama/Mistral/Qwen key names (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``) and older ones: OPT's ``ffn_dim``, GPT-2/BLOOM's ``n_layer``,
``n_head``, ``n_embd``/``n_inner``, Falcon's ``multi_query``. Mixture-of-experts configs are refused: the
roofline counts every weight as active.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from servetune.cost_models.models import ModelSpec
from servetune.errors import UserError

# Families whose MLP is gated (gate and up projections, SiLU/GELU-gated): three matrices per layer.
GATED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "internlm", "internlm2", "gemma", "gemma2",
                     "gemma3", "baichuan", "yi", "deepseek", "olmo", "olmo2", "granite", "cohere", "starcoder2_gated"}
# Families with the original two-matrix MLP.
PLAIN_MODEL_TYPES = {"opt", "bloom", "gpt2", "gpt_neox", "gptj", "phi", "falcon", "gpt_bigcode", "starcoder2", "mpt"}
GATED_ACTIVATIONS = {"silu", "swiglu", "swish"}
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _first(config: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def _positive_int(config: dict, keys: tuple[str, ...], path: Path, default: Optional[int] = None) -> int:
    value = _first(config, keys)
    if value is None:
        if default is not None:
            return default
        raise UserError(f"{path}: no {' / '.join(keys)} key; is this a transformer config.json?")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{path}: {keys[0]} must be a positive integer, found {value!r}")
    return value


def _gated(config: dict) -> bool:
    model_type = str(config.get("model_type", "")).lower()
    if model_type in GATED_MODEL_TYPES:
        return True
    if model_type in PLAIN_MODEL_TYPES:
        return False
    # An unfamiliar family: SiLU-style activations are used in gated MLPs in practice.
    activation = str(_first(config, ("hidden_act", "activation_function", "hidden_activation")) or "").lower()
    return activation in GATED_ACTIVATIONS


def load_hf_config(path: Path) -> ModelSpec:
    """The ``ModelSpec`` a ``config.json`` describes (``path`` may be the file or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"model config {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read model config {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not valid JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object of model settings")
    experts = _first(config, EXPERT_COUNT_KEYS)
    if isinstance(experts, int) and experts > 1:
        raise UserError(f"{path}: mixture-of-experts models ({experts} experts) are not supported")

    layers = _positive_int(config, ("num_hidden_layers", "n_layer", "num_layers"), path)
    hidden = _positive_int(config, ("hidden_size", "n_embd", "d_model"), path)
    heads = _positive_int(config, ("num_attention_heads", "n_head", "num_heads"), path)
    kv_default = 1 if config.get("multi_query") else heads
    kv_heads = _positive_int(config, ("num_key_value_heads", "n_head_kv", "num_kv_heads"), path, kv_default)
    if hidden % heads and config.get("head_dim") is None:
        raise UserError(f"{path}: hidden size {hidden} is not a multiple of {heads} heads and no head_dim is given")
    head_dim = _positive_int(config, ("head_dim",), path, hidden // heads)
    if heads % kv_heads:
        raise UserError(f"{path}: {heads} attention heads cannot be grouped over {kv_heads} key/value heads")
    # GPT-2 and BLOOM leave the MLP width implicit at four times the hidden size.
    intermediate = _positive_int(config, ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"), path,
                                 4 * hidden)
    vocab = _positive_int(config, ("vocab_size", "padded_vocab_size"), path)
    # transformers' PretrainedConfig ties the embeddings unless the config says otherwise.
    tied = bool(config.get("tie_word_embeddings", True))
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab, gated_mlp=_gated(config),
                     tied_embeddings=tied, source=str(path))
