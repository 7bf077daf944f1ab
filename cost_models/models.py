"""The model catalogue: transformer shapes that fix a model's weights, FLOPs and KV-cache size.

Every entry is copied from the model's Hugging Face ``config.json`` (repository named in ``source``):
``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (absent = same as
heads), ``intermediate_size`` (OPT: ``ffn_dim``), ``vocab_size``, ``tie_word_embeddings``, and the MLP
kind (SiLU-gated for Llama/Mistral/Qwen/InternLM, plain two-matrix for OPT and phi-2), and the context length
``max_model_len``: ``max_position_embeddings`` as vLLM turns it into its default ``max_model_len`` (see
``hf_config.derived_max_model_len``; none of these checkpoints has a RoPE scaling that changes it).

Parameter counts leave out biases, norms and OPT's learned position table: each is under 0.1% of the
weights. Look names up with ``catalog.resolve_model``, which also reads a ``config.json`` (see ``hf_config``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servetune.errors import InvalidValue

# vLLM serves these checkpoints in BF16/FP16 (an FP32 checkpoint is cast down), 2 bytes per value.
DTYPE_BYTES = 2


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool          # gate and up projections (SwiGLU): three MLP matrices instead of two
    tied_embeddings: bool    # the LM head reuses the input embedding matrix
    source: str
    # vLLM's default max_model_len: the context length config.json allows (prompt + output tokens);
    # None where it is not known.
    max_model_len: Optional[int] = None

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
    def layer_params(self) -> int:
        attention = self.hidden_size * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden_size
        return attention + self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.num_layers * self.layer_params + self.embedding_params + lm_head


def _hf(repo: str) -> str:
    return f"huggingface.co/{repo}/blob/main/config.json"


def _spec(name, repo, layers, hidden, heads, kv_heads, intermediate, vocab, max_len, gated=True,
          tied=False) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv_heads, hidden // heads, intermediate, vocab, gated, tied,
                     _hf(repo), max_len)


# The context length (the ninth value) is each config.json's max_position_embeddings. Llama 3.1's rope_scaling is
# rope_type "llama3", which vLLM does not multiply in (max_position_embeddings is already the extended length);
# the others have no rope_scaling (OPT has learned absolute positions). Mistral's sliding_window (4096) does not
# cap it: vLLM only does so under --disable-sliding-window. Copies of these config.json values checked against:
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
        _spec("mistral-7b", "mistralai/Mistral-7B-v0.1", 32, 4096, 32, 8, 14336, 32000, 32768),
        _spec("qwen2.5-7b", "Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, 131072),
        _spec("qwen2.5-14b", "Qwen/Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, 131072),
        _spec("qwen2.5-32b", "Qwen/Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, 131072),
        _spec("qwen2.5-72b", "Qwen/Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, 131072),
        _spec("codellama-34b", "codellama/CodeLlama-34b-hf", 48, 8192, 64, 8, 22016, 32000, 16384),
        _spec("internlm-20b", "internlm/internlm-20b", 60, 5120, 40, 40, 13824, 103168, 4096),
        _spec("phi-2", "microsoft/phi-2", 32, 2560, 32, 32, 10240, 51200, 2048, gated=False),
        _spec("opt-13b", "facebook/opt-13b", 40, 5120, 40, 40, 20480, 50272, 2048, gated=False, tied=True),
        _spec("opt-66b", "facebook/opt-66b", 64, 9216, 72, 72, 36864, 50272, 2048, gated=False, tied=True),
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
