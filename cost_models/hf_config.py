"""Read a model's shapes from a Hugging Face ``config.json`` on disk (nothing is downloaded).

Understands the Llama/Mistral/Qwen key names (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``) and older ones: OPT's ``ffn_dim``, GPT-2/BLOOM's ``n_layer``,
``n_head``, ``n_embd``/``n_inner``, Falcon's ``multi_query``; a multimodal config's ``text_config`` (Llama 4),
which vLLM reads as the model's. The context length is derived as vLLM derives its default ``max_model_len``
(see ``derived_max_model_len``).

The families of docs/cost-models.md, "Model families", as vLLM 0.33 reads their configs:

* mixture of experts: the expert count (``num_local_experts``: Mixtral, gpt-oss, Llama 4; ``num_experts``:
  Qwen-MoE; ``n_routed_experts``: DeepSeek), experts per token (``num_experts_per_tok``, gpt-oss's
  ``experts_per_token``), the expert width (``moe_intermediate_size``, else ``intermediate_size``), shared
  experts (DeepSeek's ``n_shared_experts`` of ``moe_intermediate_size``, Qwen2-MoE's
  ``shared_expert_intermediate_size``, Llama 4's one of ``intermediate_size``) and which layers route
  (``first_k_dense_replace``/``moe_layer_freq``: DeepseekV2DecoderLayer; ``decoder_sparse_step``/
  ``mlp_only_layers``: Qwen3MoeDecoderLayer; ``interleave_moe_layer_step``: Llama4DecoderLayer); a dense layer's
  MLP is ``intermediate_size`` wide (Llama 4: ``intermediate_size_mlp``);
* multi-head latent attention: ``kv_lora_rank``, ``q_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``,
  ``v_head_dim``;
* local attention: ``layer_types`` (``sliding_attention`` layers, window ``sliding_window``; transformers 5's
  ``chunked_attention``), else Llama 4's ``attention_chunk_size`` on its RoPE layers (``no_rope_layers``), else a
  ``sliding_window`` on every layer (Mistral) or, where ``use_sliding_window`` says so, on the layers from
  ``max_window_layers`` on (Qwen2/Qwen3); a window of 0 or null is none;
* quantisation: ``quantization_config`` (``quant_method`` fp8, awq, gptq, compressed-tensors or mxfp4, with their
  bits, group sizes and block sizes; compressed-tensors' ``kv_cache_scheme`` sets an FP8 KV cache, as vLLM's
  ``--kv-cache-dtype auto`` takes it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from servetune.cost_models.models import LocalAttention, MlaSpec, ModelSpec, MoeSpec, Quantization
from servetune.errors import UserError, parse_json, reading_user_file, show_json

# Families whose MLP is gated (gate and up projections, SiLU/GELU-gated): three matrices per layer.
GATED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "internlm", "internlm2", "gemma", "gemma2",
                     "gemma3", "baichuan", "yi", "deepseek", "olmo", "olmo2", "granite", "cohere", "starcoder2_gated",
                     "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "llama4", "llama4_text", "gpt_oss"}
# Families with the original two-matrix MLP.
PLAIN_MODEL_TYPES = {"opt", "bloom", "gpt2", "gpt_neox", "gptj", "phi", "falcon", "gpt_bigcode", "starcoder2", "mpt"}
GATED_ACTIVATIONS = {"silu", "swiglu", "swish"}
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k")
# Families whose transformers configuration class unties the embeddings when config.json omits the key (their
# tie_word_embeddings default is False in transformers 5's MixtralConfig, Qwen3MoeConfig, DeepseekV3Config, ...);
# any other family takes PretrainedConfig's True.
UNTIED_MODEL_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "llama4",
                      "llama4_text"}
# Llama 4's MoE layers have a shared expert as wide as the routed ones (vLLM's Llama4MoE), which no key states.
SHARED_EXPERT_MODEL_TYPES = {"llama4", "llama4_text"}
# layer_types values: full attention, or a local kind (LocalAttention.kind) and the key holding its window.
FULL_ATTENTION_LAYER_TYPES = {"full_attention", "attention"}
LOCAL_LAYER_TYPES = {"sliding_attention": ("sliding", "sliding_window"),
                     "chunked_attention": ("chunked", "attention_chunk_size")}
# transformers' Llama4TextConfig: without no_rope_layers, every no_rope_layer_interval-th layer is a NoPE layer,
# which attends globally (vLLM's Llama4Attention uses chunked local attention on the RoPE layers only).
DEFAULT_NO_ROPE_LAYER_INTERVAL = 4
QUANT_METHODS = ("fp8", "awq", "gptq", "compressed-tensors", "mxfp4")

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




def _integer(config: dict, key: str, path, default: int, low: int, high: int = MAX_DIMENSION) -> int:
    value = config.get(key)
    if value is None:
        return default
    if not _is_integer(value, low, high):
        raise UserError(f"{path}: {key}: got {show_json(value)}, expected an integer in [{low}, {high}]")
    return value


def _integer_list(config: dict, key: str, path, low: int, high: int, length: Optional[int] = None) -> list[int]:
    value = config.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_integer(item, low, high) for item in value) \
            or (length is not None and value and len(value) != length):
        size = f"{length} " if length is not None else ""
        raise UserError(f"{path}: {key}: got {show_json(value)}, expected a list of {size}integers in [{low}, {high}]")
    return value


def _moe(config: dict, path, layers: int, intermediate: int, model_type: str) -> Optional[MoeSpec]:
    """The mixture-of-experts layers, or None for a dense model (no expert count, or 0)."""
    experts_key, experts = _first(config, EXPERT_COUNT_KEYS)
    if experts_key is None or experts == 0:
        return None
    experts = _positive_int(config, (experts_key,), path)
    per_token = _positive_int(config, EXPERTS_PER_TOKEN_KEYS, path)
    if per_token > experts:
        raise UserError(f"{path}: {_first(config, EXPERTS_PER_TOKEN_KEYS)[0]}: got {per_token}, expected at most "
                        f"the {experts} experts of {experts_key}")
    width = _positive_int(config, ("moe_intermediate_size",), path, intermediate)
    if config.get("first_k_dense_replace") is not None or config.get("moe_layer_freq") is not None:
        first = _integer(config, "first_k_dense_replace", path, 0, 0, layers)
        frequency = _integer(config, "moe_layer_freq", path, 1, 1, layers)
        routed = [i >= first and i % frequency == 0 for i in range(layers)]
    elif config.get("interleave_moe_layer_step") is not None:
        step = _integer(config, "interleave_moe_layer_step", path, 1, 1, layers)
        routed = [(i + 1) % step == 0 for i in range(layers)]
    else:
        step = _integer(config, "decoder_sparse_step", path, 1, 1, layers)
        dense = set(_integer_list(config, "mlp_only_layers", path, 0, layers - 1))
        routed = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if not any(routed):
        return None
    shared = _integer(config, "n_shared_experts", path, 0, 0) * width
    shared = _integer(config, "shared_expert_intermediate_size", path, shared, 0)
    if model_type in SHARED_EXPERT_MODEL_TYPES:
        shared = width
    return MoeSpec(num_experts=experts, experts_per_token=per_token, expert_intermediate_size=width,
                   num_moe_layers=sum(routed), shared_intermediate_size=shared)


def _mla(config: dict, path) -> Optional[MlaSpec]:
    if config.get("kv_lora_rank") is None:
        return None
    q_lora = None if config.get("q_lora_rank") is None else _positive_int(config, ("q_lora_rank",), path)
    return MlaSpec(kv_lora_rank=_positive_int(config, ("kv_lora_rank",), path),
                   qk_rope_head_dim=_positive_int(config, ("qk_rope_head_dim",), path),
                   qk_nope_head_dim=_positive_int(config, ("qk_nope_head_dim",), path),
                   v_head_dim=_positive_int(config, ("v_head_dim",), path), q_lora_rank=q_lora)


def _local_attention(config: dict, path, layers: int) -> Optional[LocalAttention]:
    """The layers attending to a window, as vLLM reads them (see the module docstring), or None."""
    types = config.get("layer_types")
    if types is not None:
        known = FULL_ATTENTION_LAYER_TYPES | set(LOCAL_LAYER_TYPES)
        if not isinstance(types, list) or len(types) != layers or not all(t in known for t in types):
            raise UserError(f"{path}: layer_types: got {show_json(types)}, expected a list of {layers} of "
                            f"{', '.join(sorted(known))} (other layer kinds are not modelled)")
        local = {t for t in types if t in LOCAL_LAYER_TYPES}
        if len(local) > 1:
            raise UserError(f"{path}: layer_types: got both {' and '.join(sorted(local))}, expected one kind of "
                            "local attention")
        if not local:
            return None
        layer_type = local.pop()
        kind, window_key = LOCAL_LAYER_TYPES[layer_type]
        window = _positive_int(config, (window_key,), path)
        return LocalAttention(kind, window, types.count(layer_type))
    if config.get("attention_chunk_size") is not None:
        chunk = _positive_int(config, ("attention_chunk_size",), path)
        rope_layers = _integer_list(config, "no_rope_layers", path, 0, 1, layers)
        if not rope_layers:
            interval = _integer(config, "no_rope_layer_interval", path, DEFAULT_NO_ROPE_LAYER_INTERVAL, 1)
            rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
        return LocalAttention("chunked", chunk, sum(rope_layers)) if any(rope_layers) else None
    if not config.get("sliding_window"):   # vLLM takes a window of 0 as none
        return None
    window = _positive_int(config, ("sliding_window",), path)
    if "use_sliding_window" not in config:
        return LocalAttention("sliding", window, layers)
    switch = config["use_sliding_window"]
    if not isinstance(switch, bool):
        raise UserError(f"{path}: use_sliding_window: got {show_json(switch)}, expected true or false")
    first = _integer(config, "max_window_layers", path, layers, 0)
    count = layers - min(first, layers)
    return LocalAttention("sliding", window, count) if switch and count else None


def _scheme_number(scheme: dict, key: str, where: str, allowed: tuple) -> int:
    value = scheme.get(key)
    if value not in allowed or type(value) is bool:
        raise UserError(f"{where}.{key}: got {show_json(value)}, expected one of "
                        f"{', '.join(show_json(a) for a in allowed)}")
    return value


def _compressed_tensors(settings: dict, where: str) -> Quantization:
    groups = settings.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise UserError(f"{where}.config_groups: got {show_json(groups)}, expected an object of quantisation "
                        "schemes")
    schemes = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise UserError(f"{at}.weights: got {show_json(weights)}, expected a scheme object")
        bits = _scheme_number(weights, "num_bits", f"{at}.weights", (4, 8))
        kind = _scheme_number(weights, "type", f"{at}.weights", ("int", "float"))
        strategy = weights.get("strategy")
        group_size = 0
        if strategy == "group":
            group_size = _positive_int(weights, ("group_size",), f"{at}.weights")
        elif strategy == "block":
            block = weights.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2
                    and all(_is_integer(b, 1, MAX_DIMENSION) for b in block)):
                raise UserError(f"{at}.weights.block_structure: got {show_json(block)}, expected [rows, columns]")
            group_size = block[0] * block[1]
        activations = group.get("input_activations")
        if activations is not None and not isinstance(activations, dict):
            raise UserError(f"{at}.input_activations: got {show_json(activations)}, expected a scheme object or null")
        activation_bits = 16 if activations is None else _scheme_number(activations, "num_bits",
                                                                         f"{at}.input_activations", (8,))
        schemes.add((bits, kind, activation_bits, group_size))
    if len(schemes) > 1:
        raise UserError(f"{where}.config_groups: got {len(schemes)} different schemes, expected one (servetune "
                        "gives every linear layer the same format)")
    bits, kind, activation_bits, group_size = schemes.pop()
    # a BF16 scale per group (compressed-tensors stores scales in the model's dtype)
    return Quantization("compressed-tensors", bits, kind, activation_bits, group_size=group_size,
                        scale_bytes=2 if group_size else 0)


def _quantization(config: dict, path) -> tuple[Optional[Quantization], str]:
    """The weights' format from ``quantization_config`` (None: BF16), and the KV cache's dtype under vLLM's
    ``--kv-cache-dtype auto`` (``auto``, or ``fp8`` when a compressed-tensors checkpoint has an FP8
    ``kv_cache_scheme``)."""
    settings = config.get("quantization_config")
    if settings is None:
        return None, "auto"
    where = f"{path}: quantization_config"
    if not isinstance(settings, dict):
        raise UserError(f"{where}: got {show_json(settings)}, expected a JSON object")
    method = settings.get("quant_method")
    if method not in QUANT_METHODS:
        raise UserError(f"{where}.quant_method: got {show_json(method)}, expected one of {', '.join(QUANT_METHODS)} "
                        "(the formats servetune models)")
    if method == "fp8":
        block = settings.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(_is_integer(b, 1, MAX_DIMENSION) for b in block)):
            raise UserError(f"{where}.weight_block_size: got {show_json(block)}, expected [rows, columns] or null")
        # an FP32 scale per block (DeepSeek-V3's weight_scale_inv), else per tensor or channel
        group = block[0] * block[1] if block else 0
        return Quantization("fp8", 8, "float", 8, group_size=group, scale_bytes=4 if group else 0), "auto"
    if method in ("awq", "gptq"):
        bits = _scheme_number(settings, "bits" if "bits" in settings else "w_bit", where, (2, 3, 4, 8))
        group = settings.get("group_size", settings.get("q_group_size", 128))
        if not (_is_integer(group, -1, MAX_DIMENSION) and group != 0):
            raise UserError(f"{where}.group_size: got {show_json(group)}, expected a positive integer or -1 (one "
                            "scale per output channel)")
        group = 0 if group == -1 else group
        # an FP16 scale and a packed zero point of `bits` per group
        return Quantization(method, bits, "int", 16, group_size=group, scale_bytes=2 + bits / 8 if group else 0), \
            "auto"
    if method == "mxfp4":
        return Quantization("mxfp4", 4, "float", 16, group_size=32, scale_bytes=1, experts_only=True), "auto"
    weights = _compressed_tensors(settings, where)
    kv_scheme = settings.get("kv_cache_scheme")
    if kv_scheme is None:
        return weights, "auto"
    if not (isinstance(kv_scheme, dict) and kv_scheme.get("num_bits") == 8 and kv_scheme.get("type") == "float"):
        raise UserError(f"{where}.kv_cache_scheme: got {show_json(kv_scheme)}, expected null or an FP8 scheme "
                        '({"num_bits": 8, "type": "float", ...})')
    return weights, "fp8"


def _text_config(config: dict, path: Path) -> tuple[dict, str]:
    """The settings vLLM reads the model's shapes from: a multimodal model's ``text_config``, else the config
    itself; and how messages should name them."""
    text = config.get("text_config")
    if text is None:
        return config, str(path)
    if not isinstance(text, dict):
        raise UserError(f"{path}: text_config: got {show_json(text)}, expected a JSON object")
    return text, f"{path}: text_config"


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
    ``original_max_position_embeddings`` instead. ``config`` holds the text model's settings (a multimodal
    config's ``text_config``, as vLLM reads them). Left out: transformers' per-class defaults for an absent key
    (LlamaConfig's 2048, ...) and vLLM's 2048 when no key is present (None here), a ``params.json`` in Mistral's
    format, the model-specific convertors (Falcon, Mamba, Gemma 4, ...), the sliding-window cap under
    ``--disable-sliding-window``, and the tokenizer's ``model_max_length`` and sentence-transformers'
    ``max_seq_length`` (pooling models only).
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
    weights, kv_cache_dtype = _quantization(config, path)
    config, path_in = _text_config(config, path)

    layers = _positive_int(config, ("num_hidden_layers", "n_layer", "num_layers"), path_in)
    hidden = _positive_int(config, ("hidden_size", "n_embd", "d_model"), path_in)
    heads = _positive_int(config, ("num_attention_heads", "n_head", "num_heads"), path_in)
    kv_default = 1 if config.get("multi_query") else heads
    kv_keys = ("num_key_value_heads", "n_head_kv", "num_kv_heads")
    kv_heads = _positive_int(config, kv_keys, path_in, kv_default)
    mla = _mla(config, path_in)
    if hidden % heads and config.get("head_dim") is None and mla is None:
        raise UserError(f"{path_in}: hidden_size: got {hidden}, expected a multiple of the {heads} attention heads "
                        "(or a head_dim key)")
    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla is not None \
        else _positive_int(config, ("head_dim",), path_in, hidden // heads)
    if heads % kv_heads:
        raise UserError(f"{path_in}: {_first(config, kv_keys)[0] or 'multi_query'}: got {kv_heads} key/value heads, "
                        f"expected a divisor of the {heads} attention heads")
    # GPT-2 and BLOOM leave the MLP width implicit at four times the hidden size.
    intermediate = _positive_int(config, ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"), path_in,
                                 4 * hidden)
    model_type = str(config.get("model_type", "")).lower()
    moe = _moe(config, path_in, layers, intermediate, model_type)
    dense_intermediate = _positive_int(config, ("intermediate_size_mlp",), path_in, intermediate)
    vocab = _positive_int(config, ("vocab_size", "padded_vocab_size"), path_in)
    # transformers' PretrainedConfig ties the embeddings unless the config (or the family's class) says otherwise.
    tied = config.get("tie_word_embeddings", model_type not in UNTIED_MODEL_TYPES)
    if not isinstance(tied, bool):
        raise UserError(f"{path_in}: tie_word_embeddings: got {show_json(tied)}, expected true or false")
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=dense_intermediate, vocab_size=vocab,
                     gated_mlp=_gated(config), tied_embeddings=tied, source=str(path),
                     max_model_len=derived_max_model_len(config, path_in), moe=moe, mla=mla,
                     local_attention=_local_attention(config, path_in, layers), quantization=weights,
                     kv_cache_dtype=kv_cache_dtype)
