"""The model catalogue: transformer shapes that fix a model's weights, FLOPs and KV-cache size.

Every entry is copied from the model's Hugging Face ``config.json`` (repository named in ``source``):
``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (absent = same as
heads), ``intermediate_size`` (OPT: ``ffn_dim``), ``vocab_size``, ``tie_word_embeddings``, and the MLP
kind (SiLU-gated for Llama/Mistral/Qwen/InternLM, plain two-matrix for OPT and phi-2), and the context length
``max_model_len``: ``max_position_embeddings`` as vLLM turns it into its default ``max_model_len`` (see
``hf_config.derived_max_model_len``; none of these checkpoints has a RoPE scaling that changes it).

Beyond the dense transformer a model may have mixture-of-experts layers (``MoeSpec``), multi-head latent
attention (``MlaSpec``), layers that attend only to a recent window (``LocalAttention``) and quantised weights
(``Quantization``); ``kv_cache_dtype`` is vLLM's ``--kv-cache-dtype``. docs/cost-models.md, "Model families",
gives each one's formulas and sources.

Parameter counts leave out biases, norms and OPT's learned position table: each is under 0.1% of the
weights. Look names up with ``catalog.resolve_model``, which also reads a ``config.json`` (see ``hf_config``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from servetune.errors import InvalidValue

# vLLM serves these checkpoints in BF16/FP16 (an FP32 checkpoint is cast down), 2 bytes per value.
DTYPE_BYTES = 2
# vLLM's --kv-cache-dtype values servetune models (vllm/config/cache.py CacheDType): auto is the model's dtype;
# the FP8 formats store one byte per value.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_BYTES = 1


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts layers: each routes every token to ``experts_per_token`` of ``num_experts``
    gated MLPs of width ``expert_intermediate_size`` (plus, always, the shared experts, of total width
    ``shared_intermediate_size``); the other ``num_layers - num_moe_layers`` layers have a dense MLP of the
    model's ``intermediate_size``."""
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_moe_layers: int
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are cached as one compressed latent of
    ``kv_lora_rank`` values plus a shared rotary key of ``qk_rope_head_dim`` per token and layer, expanded per
    head by ``kv_b_proj``; queries go through a ``q_lora_rank`` bottleneck (None: projected directly)."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int]

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the latent and the rotary key, no per-head K or V."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LocalAttention:
    """``num_layers`` of the model's layers attend to at most ``window`` tokens: the last ``window``
    (``sliding``, Mistral, gpt-oss) or those of the query's own ``window``-token chunk (``chunked``, Llama 4's
    RoPE layers); the rest attend to the whole context."""
    kind: Literal["sliding", "chunked"]
    window: int
    num_layers: int


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's weights are stored and multiplied (the layers' linear weights; embeddings, LM head
    and MoE routers stay BF16). ``method`` is vLLM's name for it (config.json's ``quant_method``, or vLLM's
    ``--quantization``)."""
    method: str
    weight_bits: int                   # 8 or 4
    weight_type: Literal["int", "float"]
    activation_bits: int               # 8: W8A8, the matmuls run on FP8/INT8 tensor cores; 16: weight-only
    group_size: int = 0                # weights sharing one scale; 0: per channel or per tensor (negligible)
    scale_bytes: float = 0.0           # bytes of scale (and zero point) per group
    experts_only: bool = False         # only the routed experts' weights (gpt-oss's MXFP4)

    @property
    def bytes_per_weight(self) -> float:
        return self.weight_bits / 8 + (self.scale_bytes / self.group_size if self.group_size else 0.0)

    @property
    def describe(self) -> str:
        kind = f"W{self.weight_bits}A{self.activation_bits}" if self.activation_bits == 8 \
            else f"{'FP' if self.weight_type == 'float' else 'INT'}{self.weight_bits} weight-only"
        where = ", routed experts only" if self.experts_only else ""
        return f"{self.method} ({kind}{where})"


# vLLM's --quantization values a config may set for a model whose config.json names no quantization:
# fp8 is vLLM's online quantisation of a BF16 checkpoint (Fp8Config: a scale per weight tensor, activations
# quantised dynamically, vllm/model_executor/layers/quantization/fp8.py); awq and gptq describe an AWQ or GPTQ
# checkpoint of the model in those tools' usual layout: 4-bit integers in groups of 128 weights sharing an FP16
# scale and a 4-bit zero point (AutoAWQ's and AutoGPTQ's defaults).
QUANTIZATION_PRESETS: dict[str, Quantization] = {
    "fp8": Quantization("fp8", 8, "float", 8),
    "awq": Quantization("awq", 4, "int", 16, group_size=128, scale_bytes=2.5),
    "gptq": Quantization("gptq", 4, "int", 16, group_size=128, scale_bytes=2.5),
}
# Methods only a checkpoint's quantization_config can describe (their layout varies by checkpoint).
QUANTIZATION_FROM_CHECKPOINT = ("compressed-tensors", "mxfp4")
QUANTIZATION_METHODS = (*QUANTIZATION_PRESETS, *QUANTIZATION_FROM_CHECKPOINT)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int            # of queries and keys (MLA: qk_nope_head_dim + qk_rope_head_dim)
    intermediate_size: int   # a dense layer's MLP width
    vocab_size: int
    gated_mlp: bool          # gate and up projections (SwiGLU): three MLP matrices instead of two
    tied_embeddings: bool    # the LM head reuses the input embedding matrix
    source: str
    # vLLM's default max_model_len: the context length config.json allows (prompt + output tokens);
    # None where it is not known.
    max_model_len: Optional[int] = None
    moe: Optional[MoeSpec] = None
    mla: Optional[MlaSpec] = None
    local_attention: Optional[LocalAttention] = None
    quantization: Optional[Quantization] = None   # None: BF16 weights
    kv_cache_dtype: str = "auto"                  # vLLM's --kv-cache-dtype (KV_CACHE_DTYPES)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        if self.mla is None:
            return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        m = self.mla
        queries = (h * self.q_dim if m.q_lora_rank is None
                   else h * m.q_lora_rank + m.q_lora_rank * self.q_dim)
        keys_values = h * m.latent_dim + m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return queries + keys_values + self.num_heads * m.v_head_dim * h

    @property
    def layer_params(self) -> int:
        """A dense layer's weights: attention and its MLP."""
        return self.attention_params + self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.moe.num_moe_layers

    @property
    def expert_params(self) -> int:
        """One routed expert's weights (0 for a dense model)."""
        return 0 if self.moe is None else self.mlp_matrices * self.hidden_size * self.moe.expert_intermediate_size

    @property
    def moe_fixed_params(self) -> int:
        """An MoE layer's weights besides attention that every token uses: its router and shared experts."""
        if self.moe is None:
            return 0
        return self.hidden_size * self.moe.num_experts + \
            self.mlp_matrices * self.hidden_size * self.moe.shared_intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _params(self, routed_experts: int) -> int:
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        dense_layers = self.num_layers - self.num_moe_layers
        moe_layers = self.num_moe_layers * (self.attention_params + self.moe_fixed_params
                                            + routed_experts * self.expert_params)
        return dense_layers * self.layer_params + moe_layers + self.embedding_params + lm_head

    @property
    def total_params(self) -> int:
        return self._params(0 if self.moe is None else self.moe.num_experts)

    @property
    def active_params(self) -> int:
        """Weights one token's forward pass uses: everything but the routed experts it is not sent to (the
        embedding table included, as Mistral, Qwen, DeepSeek and Meta count their active parameters)."""
        return self._params(0 if self.moe is None else self.moe.experts_per_token)

    @property
    def kv_dtype_bytes(self) -> int:
        return FP8_BYTES if self.kv_cache_dtype.startswith("fp8") else DTYPE_BYTES


def with_serving_options(model: ModelSpec, quantization: Optional[str] = None,
                         kv_cache_dtype: str = "auto") -> ModelSpec:
    """``model`` as vLLM serves it with ``--quantization quantization`` (None: as its config.json says) and
    ``--kv-cache-dtype kv_cache_dtype`` (auto: the model's own). An ``InvalidValue`` for a method vLLM would
    refuse: one other than the checkpoint's (vLLM: "Quantization method specified in the model config ... does not
    match"), or one that only a checkpoint's quantization_config can describe."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidValue("kv_cache_dtype", kv_cache_dtype, f"one of {', '.join(KV_CACHE_DTYPES)}")
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise InvalidValue("quantization", quantization, f"null or one of {', '.join(QUANTIZATION_METHODS)}")
    weights = model.quantization
    if quantization is not None:
        if weights is not None and weights.method != quantization:
            raise InvalidValue("quantization", quantization,
                               f"null or {weights.method}: {model.name}'s checkpoint is quantised with "
                               f"{weights.method}, and vLLM refuses another method")
        if weights is None and quantization in QUANTIZATION_FROM_CHECKPOINT:
            raise InvalidValue("quantization", quantization,
                               f"null or one of {', '.join(QUANTIZATION_PRESETS)}: {quantization} needs a "
                               f"checkpoint's quantization_config, and {model.name}'s config.json has none")
        weights = weights or QUANTIZATION_PRESETS[quantization]
    kv = model.kv_cache_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return dataclasses.replace(model, quantization=weights, kv_cache_dtype=kv)


def _hf(repo: str) -> str:
    return f"huggingface.co/{repo}/blob/main/config.json"


def _spec(name, repo, layers, hidden, heads, kv_heads, intermediate, vocab, max_len, gated=True,
          tied=False, head_dim=None, **families) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv_heads, head_dim or hidden // heads, intermediate, vocab, gated,
                     tied, _hf(repo), max_len, **families)


# The context length (the ninth value) is each config.json's max_position_embeddings. Llama 3.1's rope_scaling is
# rope_type "llama3", which vLLM does not multiply in (max_position_embeddings is already the extended length);
# the others have no rope_scaling (OPT has learned absolute positions). Mistral's sliding_window (4096) does not
# cap it: vLLM only does so under --disable-sliding-window.
# Copies of these config.json values checked against:
#   Llama 2: verbatim configs in scaleapi/llm-engine model-engine/tests/unit/domain/test_llm_use_cases.py
#     (7b, 13b, 70b: 4096) and transformers' load log of meta-llama/Llama-2-7b-hf (snapshot 8a0442e8): 4096.
#     (mlc-ai/mlc-llm's model_preset.py says 2048 for Llama 2, with the same transformers_version: seemingly an
#     older revision of the files; every other copy, the hub snapshot's load log included, says 4096.)
#   Llama 3 / 3.1, CodeLlama-34b, Qwen2.5 base, phi-2: Lightning-AI/litgpt litgpt/config.py block_size, each
#     entry citing the config.json; Llama 3.1-8B verbatim in NVIDIA/TensorRT-LLM
#     tests/unittest/_torch/modeling/test_modeling_llama.py (131072, rope_type llama3); Llama 3 8B/70B and
#     CodeLlama-34b verbatim in the llm-engine test above (8192, 8192, 16384).
#   Mistral-7B-v0.1: verbatim in mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py (32768); litgpt notes it
#     "should be 32768".
#   Qwen2.5 base (7B/14B/32B/72B): 131072. The -Instruct repositories say 32768 (YaRN left to the user), so an
#     Instruct alias below shares the base shapes but vLLM would default to 32768 for it.
#   internlm-20b: microsoft/vidur data/model_configs/internlm/internlm-20b.yml and a printed copy of the
#     config.json (4096; its "rotary": {"type": "dynamic"} is not a key vLLM reads). vLLM dropped
#     InternLMForCausalLM in 0.23, so this is what the derivation gives, not a model vLLM 0.33 serves.
#   phi-2: microsoft/vidur data/model_configs/microsoft/phi-2.yml (2048, rope_scaling null).
#   OPT-13b/66b: EasyDeL 0.0.8 EasyDel/configs/configs.py, verbatim OPT configs (2048).
# gpt-oss's quantization_config: quant_method mxfp4 on the routed experts only (vLLM's Mxfp4Config leaves every
# linear layer unquantised, vllm/model_executor/layers/quantization/mxfp4.py); 4-bit values with one 8-bit scale
# per 32 (OCP Microscaling Formats v1.0), multiplied by BF16 activations on Hopper.
_MXFP4 = Quantization("mxfp4", 4, "float", 16, group_size=32, scale_bytes=1, experts_only=True)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        _spec("llama-2-7b", "meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 11008, 32000, 4096),
        _spec("llama-2-13b", "meta-llama/Llama-2-13b-hf", 40, 5120, 40, 40, 13824, 32000, 4096),
        _spec("llama-2-70b", "meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 28672, 32000, 4096),
        _spec("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192),
        _spec("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072),
        _spec("llama-3-70b", "meta-llama/Meta-Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, 8192),
        _spec("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, 131072),
        # mistralai/Mistral-7B-v0.1, whose config.json has "sliding_window": 4096 and no layer_types: every layer
        # attends to the last 4,096 tokens, as vLLM serves it and as hf_config reads the file
        # (tests/fixtures/hf/mistral-7b.json). The file as transformers 4.41.1 prints it:
        # huggingface.co/mistralai/Mistral-7B-v0.1/discussions/153. Not v0.2 and later, which set
        # "sliding_window": null (huggingface.co/mistralai/Mistral-7B-Instruct-v0.1/discussions/94).
        _spec("mistral-7b", "mistralai/Mistral-7B-v0.1", 32, 4096, 32, 8, 14336, 32000, 32768,
              local_attention=LocalAttention("sliding", 4096, 32)),
        _spec("qwen2.5-7b", "Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, 131072),
        _spec("qwen2.5-14b", "Qwen/Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, 131072),
        _spec("qwen2.5-32b", "Qwen/Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, 131072),
        _spec("qwen2.5-72b", "Qwen/Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, 131072),
        _spec("codellama-34b", "codellama/CodeLlama-34b-hf", 48, 8192, 64, 8, 22016, 32000, 16384),
        _spec("internlm-20b", "internlm/internlm-20b", 60, 5120, 40, 40, 13824, 103168, 4096),
        _spec("phi-2", "microsoft/phi-2", 32, 2560, 32, 32, 10240, 51200, 2048, gated=False),
        _spec("opt-13b", "facebook/opt-13b", 40, 5120, 40, 40, 20480, 50272, 2048, gated=False, tied=True),
        _spec("opt-66b", "facebook/opt-66b", 64, 9216, 72, 72, 36864, 50272, 2048, gated=False, tied=True),
        # Mixture-of-experts models (the config.json fields they come from: hf_config.py; copies of each under
        # tests/fixtures/models/, whose README names where the copies were checked).
        _spec("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 32, 4096, 32, 8, 14336, 32000, 32768,
              moe=MoeSpec(num_experts=8, experts_per_token=2, expert_intermediate_size=14336, num_moe_layers=32)),
        # Qwen3-MoE: decoder_sparse_step 1 and no mlp_only_layers, so every layer is an MoE layer.
        _spec("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 2048, 32, 4, 6144, 151936, 40960, head_dim=128,
              moe=MoeSpec(num_experts=128, experts_per_token=8, expert_intermediate_size=768, num_moe_layers=48)),
        # DeepSeek-V3: first_k_dense_replace 3 (layers 0-2 dense, 18432 wide), one shared expert of
        # moe_intermediate_size; MLA; FP8 weights in 128 x 128 blocks, each with an FP32 scale
        # (quantization_config weight_block_size). Its multi-token-prediction layer (num_nextn_predict_layers)
        # is left out: vLLM loads it only for speculative decoding. YaRN's factor 40 is already in
        # max_position_embeddings 163840.
        _spec("deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 7168, 128, 128, 18432, 129280, 163840, head_dim=192,
              moe=MoeSpec(num_experts=256, experts_per_token=8, expert_intermediate_size=2048, num_moe_layers=58,
                          shared_intermediate_size=2048),
              mla=MlaSpec(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                          q_lora_rank=1536),
              quantization=Quantization("fp8", 8, "float", 8, group_size=128 * 128, scale_bytes=4)),
        # gpt-oss: layer_types alternate sliding_attention (window 128) and full_attention; the experts'
        # weights are MXFP4 (4-bit floats, a shared 8-bit exponent per 32, the OCP MX format), everything else
        # BF16 (quantization_config.modules_to_not_convert); YaRN's factor is already in 131072.
        _spec("gpt-oss-20b", "openai/gpt-oss-20b", 24, 2880, 64, 8, 2880, 201088, 131072, head_dim=64,
              moe=MoeSpec(num_experts=32, experts_per_token=4, expert_intermediate_size=2880, num_moe_layers=24),
              local_attention=LocalAttention("sliding", 128, 12), quantization=_MXFP4),
        _spec("gpt-oss-120b", "openai/gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 131072, head_dim=64,
              moe=MoeSpec(num_experts=128, experts_per_token=4, expert_intermediate_size=2880, num_moe_layers=36),
              local_attention=LocalAttention("sliding", 128, 18), quantization=_MXFP4),
        # Llama 4 Scout (text_config): interleave_moe_layer_step 1 (every layer MoE), a shared expert of
        # intermediate_size beside the 16 routed ones (vLLM's Llama4MoE), intermediate_size_mlp 16384 for dense
        # layers (none here); attention_chunk_size 8192 on the RoPE layers: no_rope_layers' default leaves every
        # fourth layer global (transformers' Llama4TextConfig). rope_type llama3 is already in 10485760.
        _spec("llama-4-scout", "meta-llama/Llama-4-Scout-17B-16E", 48, 5120, 40, 8, 16384, 202048, 10485760,
              head_dim=128,
              moe=MoeSpec(num_experts=16, experts_per_token=1, expert_intermediate_size=8192, num_moe_layers=48,
                          shared_intermediate_size=8192),
              local_attention=LocalAttention("chunked", 8192, 36)),
    ]
}

# Hugging Face repository names normalise to these; fine-tuned variants share their base model's shapes.
MODEL_ALIASES: dict[str, str] = {
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama-3-70b": "llama-3-70b",
    "meta-llama-3.1-70b": "llama-3.1-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "codellama-34b-instruct": "codellama-34b",
    "llama-2-7b-chat": "llama-2-7b",
    "llama-2-13b-chat": "llama-2-13b",
    "llama-2-70b-chat": "llama-2-70b",
    "meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama-3-70b-instruct": "llama-3-70b",
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "llama-3.1-70b-instruct": "llama-3.1-70b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen2.5-14b-instruct": "qwen2.5-14b",
    "qwen2.5-32b-instruct": "qwen2.5-32b",
    "qwen2.5-72b-instruct": "qwen2.5-72b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "qwen3-30b-a3b-base": "qwen3-30b-a3b",
    "deepseek-v3-base": "deepseek-v3",
    "llama-4-scout-17b-16e": "llama-4-scout",
    "llama-4-scout-17b-16e-instruct": "llama-4-scout",
}


def heads_per_gpu(model: ModelSpec, tp: int) -> tuple[int, int]:
    """Query and key/value heads each GPU holds under tensor parallelism ``tp``, as vLLM shards them:
    query heads split evenly; key/value heads split when there are at least ``tp`` of them, otherwise
    each is replicated so that every GPU holds one. An ``InvalidValue`` for a ``tp`` vLLM refuses.
    """
    kv = model.num_kv_heads
    if tp < 1:
        raise InvalidValue("tp", tp, "an integer ≥ 1")
    if model.num_heads % tp:
        raise InvalidValue("tp", tp, f"a divisor of {model.name}'s {model.num_heads} attention heads (vLLM splits "
                                     "them evenly over the GPUs)")
    if kv >= tp and kv % tp:
        raise InvalidValue("tp", tp, f"a divisor of {model.name}'s {kv} key/value heads (vLLM splits them evenly "
                                     "over the GPUs)")
    if kv < tp and tp % kv:
        raise InvalidValue("tp", tp, f"a multiple of {model.name}'s {kv} key/value heads (vLLM replicates each "
                                     "over the same number of GPUs)")
    return model.num_heads // tp, max(kv // tp, 1)
