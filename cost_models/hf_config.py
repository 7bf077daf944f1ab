"""Read a model's shapes from a Hugging Face ``config.json`` on disk (nothing is downloaded).

Understands the Llama/Mistral/Qwen key names (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``) and older ones: OPT's ``ffn_dim``, GPT-2/BLOOM's ``n_layer``,
``n_head``, ``n_embd``/``n_inner``, Falcon's ``multi_query``. Mixture-of-experts configs are refused: the
roofline counts every weight as active. The context length is derived as vLLM derives its default
``max_model_len`` (see ``derived_max_model_len``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from servetune.cost_models.models import ModelSpec
from servetune.errors import UserError, parse_json, reading_user_file, show_json

# Families whose MLP is gated (gate and up projections, SiLU/GELU-gated): three matrices per layer.
GATED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "internlm", "internlm2", "gemma", "gemma2",
                     "gemma3", "baichuan", "yi", "deepseek", "olmo", "olmo2", "granite", "cohere", "starcoder2_gated"}
# Families with the original two-matrix MLP.
PLAIN_MODEL_TYPES = {"opt", "bloom", "gpt2", "gpt_neox", "gptj", "phi", "falcon", "gpt_bigcode", "starcoder2", "mpt"}
GATED_ACTIVATIONS = {"silu", "swiglu", "swish"}
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

# vLLM 0.33's keys for a model's length, in its order (ModelArchConfigConvertor.derive_max_model_len_and_key in
# vllm/transformers_utils/model_arch_config_convertor.py): the smallest one present wins, then Command-R's
# model_max_length, when present, replaces it.
MAX_LEN_KEYS = ("max_position_embeddings",  # OPT, Llama, Mistral, Qwen, ...
                "n_positions",              # GPT-2
                "max_seq_len",              # MPT
                "seq_length",               # ChatGLM2
                "model_max_length",         # Command-R
                "max_target_positions",     # Whisper
                "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose factor vLLM does not multiply in (_get_and_verify_max_len in vllm/config/model.py): their
# max_position_embeddings is already the extended length. Every other type with a factor (linear, dynamic, ...)
# multiplies it.
UNSCALED_ROPE_TYPES = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}

# Bounds far beyond any model, so that sizes computed from a hostile file stay ordinary numbers: a config.json is a
# few kilobytes, a dimension (layers, widths, heads, vocabulary) at most millions, a RoPE factor at most hundreds.
MAX_FILE_BYTES = 16 * 2**20
MAX_DIMENSION = 2**24
MAX_LENGTH = 2**53
MAX_ROPE_FACTOR = 1e6


def _first(config: dict, keys: tuple[str, ...]) -> tuple[Optional[str], Any]:
    """(the first of ``keys`` the config sets, its value), or (None, None)."""
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    return None, None


def _is_integer(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high   # bool is an int subclass, but `true` is no count


def _positive_int(config: dict, keys: tuple[str, ...], path: Path, default: Optional[int] = None) -> int:
    key, value = _first(config, keys)
    if key is None:
        if default is not None:
            return default
        raise UserError(f"{path}: {' / '.join(keys)}: missing, expected a positive integer (is this a transformer "
                        "config.json?)")
    if not _is_integer(value, 1, MAX_DIMENSION):
        raise UserError(f"{path}: {key}: got {show_json(value)}, expected an integer in [1, {MAX_DIMENSION}]")
    return value




def _max_len_value(config: dict, key: str, path: Path) -> Optional[int]:
    value = config.get(key)
    if value is None:
        return None
    if not _is_integer(value, 2, MAX_LENGTH):
        raise UserError(f"{path}: {key}: got {show_json(value)}, expected an integer in [2, {MAX_LENGTH}]")
    return value


def _rope_parameters(config: dict, path: Path) -> list[dict]:
    """The RoPE settings: ``rope_parameters`` (transformers 5) or ``rope_scaling``, one dict per layer type
    where they are nested that way."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not rope:
        return []
    if not isinstance(rope, dict):
        key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        raise UserError(f"{path}: {key}: got {show_json(rope)}, expected a JSON object")
    if all(isinstance(v, dict) for v in rope.values()):
        return [v for v in rope.values() if v]
    return [rope]


def derived_max_model_len(config: dict, path: Path) -> Optional[int]:
    """vLLM's default ``max_model_len`` for this config, or None when it names no length.

    Follows vLLM 0.33 (``derive_max_model_len_and_key`` and ``_get_and_verify_max_len``) for the common cases: the
    smallest of ``MAX_LEN_KEYS`` present (``model_max_length`` overriding), times the RoPE ``factor`` unless the
    RoPE type is in ``UNSCALED_ROPE_TYPES`` (none for Gemma 3, whose length is already scaled), and for LongRoPE
    ``original_max_position_embeddings`` instead. Left out: a nested ``text_config`` (vLLM reads the text
    model's settings there), transformers' per-class defaults for an absent key (LlamaConfig's 2048, ...) and
    vLLM's 2048 when no key is present (None here), a ``params.json`` in Mistral's format, the model-specific
    convertors (Falcon, Mamba, Gemma 4, ...), the sliding-window cap under ``--disable-sliding-window``, and the
    tokenizer's ``model_max_length`` and sentence-transformers' ``max_seq_length`` (pooling models only).
    """
    lengths = {key: value for key in MAX_LEN_KEYS if (value := _max_len_value(config, key, path)) is not None}
    if not lengths:
        return None
    derived = lengths.get("model_max_length") or min(lengths.values())
    ropes = _rope_parameters(config, path)
    rope_types = [str(rope.get("rope_type") or rope.get("type") or "default") for rope in ropes]
    if ropes and "gemma3" not in str(config.get("model_type", "")):
        factor = 1.0
        for rope, rope_type in zip(ropes, rope_types):
            if rope_type not in UNSCALED_ROPE_TYPES:
                factor = rope.get("factor", factor)
        if factor is None:   # vLLM falls back to 1 for a null factor
            factor = 1.0
        if type(factor) not in (int, float) or not 0 < factor <= MAX_ROPE_FACTOR:   # NaN fails too
            raise UserError(f"{path}: rope_scaling.factor: got {show_json(factor)}, expected a number in (0, "
                            f"{MAX_ROPE_FACTOR:g}]")
        derived *= factor
    if any(rope_type in ("longrope", "su") for rope_type in rope_types):
        # vLLM defaults LongRoPE models to their pre-extension length, for speed on short sequences.
        original = _max_len_value(config, "original_max_position_embeddings", path)
        derived = original if original is not None else derived
    return int(derived)


def _gated(config: dict) -> bool:
    model_type = str(config.get("model_type", "")).lower()
    if model_type in GATED_MODEL_TYPES:
        return True
    if model_type in PLAIN_MODEL_TYPES:
        return False
    # An unfamiliar family: SiLU-style activations are used in gated MLPs in practice.
    activation = str(_first(config, ("hidden_act", "activation_function", "hidden_activation"))[1] or "").lower()
    return activation in GATED_ACTIVATIONS


def load_hf_config(path: Path) -> ModelSpec:
    """The ``ModelSpec`` a ``config.json`` describes (``path`` may be the file or the folder holding it)."""
    path = Path(path)
    expected = "a Hugging Face config.json"
    with reading_user_file(path, "model config", expected, UserError):
        folder = path.is_dir()
    path = path / "config.json" if folder else path
    with reading_user_file(path, "model config", expected, UserError):
        if path.stat().st_size > MAX_FILE_BYTES:
            raise UserError(f"{path}: {path.stat().st_size:,} bytes, expected {expected} of at most "
                            f"{MAX_FILE_BYTES:,}")
        text = path.read_text(encoding="utf-8")
    config = parse_json(text, path, expected)
    if not isinstance(config, dict):
        raise UserError(f"{path}: got {show_json(config)}, expected {expected}: a JSON object of model settings")
    experts_key, experts = _first(config, EXPERT_COUNT_KEYS)
    if isinstance(experts, int) and experts > 1:
        raise UserError(f"{path}: {experts_key}: got {experts}, expected no experts (mixture-of-experts models are "
                        "not supported: the roofline counts every weight as active)")

    layers = _positive_int(config, ("num_hidden_layers", "n_layer", "num_layers"), path)
    hidden = _positive_int(config, ("hidden_size", "n_embd", "d_model"), path)
    heads = _positive_int(config, ("num_attention_heads", "n_head", "num_heads"), path)
    kv_default = 1 if config.get("multi_query") else heads
    kv_keys = ("num_key_value_heads", "n_head_kv", "num_kv_heads")
    kv_heads = _positive_int(config, kv_keys, path, kv_default)
    if hidden % heads and config.get("head_dim") is None:
        raise UserError(f"{path}: hidden_size: got {hidden}, expected a multiple of the {heads} attention heads "
                        "(or a head_dim key)")
    head_dim = _positive_int(config, ("head_dim",), path, hidden // heads)
    if heads % kv_heads:
        raise UserError(f"{path}: {_first(config, kv_keys)[0] or 'multi_query'}: got {kv_heads} key/value heads, "
                        f"expected a divisor of the {heads} attention heads")
    # GPT-2 and BLOOM leave the MLP width implicit at four times the hidden size.
    intermediate = _positive_int(config, ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"), path,
                                 4 * hidden)
    vocab = _positive_int(config, ("vocab_size", "padded_vocab_size"), path)
    # transformers' PretrainedConfig ties the embeddings unless the config says otherwise.
    tied = config.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise UserError(f"{path}: tie_word_embeddings: got {show_json(tied)}, expected true or false")
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab, gated_mlp=_gated(config),
                     tied_embeddings=tied, source=str(path), max_model_len=derived_max_model_len(config, path))
