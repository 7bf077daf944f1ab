"""How vLLM splits one layer's weights over the GPUs of a tensor-parallel group: the matrix multiplies each
GPU holds, by part of the layer.

Tensor parallelism (TP) splits every projection over the ``tp`` GPUs (attention by heads, MLPs by their
width); what cannot be split is replicated: key/value heads when there are fewer than ``tp``
(``models.heads_per_gpu``), MLA's down-projections ``q_a_proj`` and ``kv_a_proj_with_mqa`` (ReplicatedLinear in
vLLM's DeepseekV2Attention), and an MoE layer's router. A routed expert is split like a dense MLP, so each GPU
holds a 1/tp slice of every expert; with expert parallelism (vLLM's ``--enable-expert-parallel``, whose expert
group is the TP group when there is no data parallelism: ``FusedMoEParallelConfig``) each GPU instead holds
whole experts, ``ceil(experts / tp)`` on the fullest (``determine_expert_map`` gives the first ``experts % tp``
GPUs one more).
Shared experts are always split by TP.
"""
from __future__ import annotations

from dataclasses import dataclass

from servetune.cost_models.models import ModelSpec, heads_per_gpu
from servetune.errors import InvalidValue

Shapes = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LayerShard:
    """One layer's matrix multiplies on one GPU, as ``(K, N)`` of ``y[T, N] = x[T, K] @ W[K, N]``."""
    attention: Shapes
    dense_mlp: Shapes         # the MLP of a dense layer
    router: Shapes            # an MoE layer's gate, replicated (none in a dense model)
    shared_experts: Shapes    # an MoE layer's shared experts (none: no shared expert)
    expert: Shapes            # the part of one routed expert this GPU holds
    experts_held: int         # routed experts this GPU holds that part of

    @staticmethod
    def weights(shapes: Shapes) -> int:
        return sum(k * n for k, n in shapes)

    @staticmethod
    def activations(shapes: Shapes) -> int:
        """Values each token's pass through ``shapes`` reads and writes (inputs and outputs)."""
        return sum(k + n for k, n in shapes)


def _mlp(hidden: int, width: int, gated: bool) -> Shapes:
    """A (possibly gated) MLP of ``width`` on one GPU: fused gate+up (or up), then down."""
    return ((hidden, (2 if gated else 1) * width), (width, hidden)) if width else ()


def attention_shapes(model: ModelSpec, tp: int) -> Shapes:
    """The attention projections one GPU holds: fused QKV and output, or MLA's five."""
    q_heads, kv_heads = heads_per_gpu(model, tp)
    h, d = model.hidden_size, model.head_dim
    if model.mla is None:
        return ((h, (q_heads + 2 * kv_heads) * d), (q_heads * d, h))
    m = model.mla
    queries = ((h, q_heads * d),) if m.q_lora_rank is None else ((h, m.q_lora_rank), (m.q_lora_rank, q_heads * d))
    return (*queries, (h, m.latent_dim), (m.kv_lora_rank, q_heads * (m.qk_nope_head_dim + m.v_head_dim)),
            (q_heads * m.v_head_dim, h))


class NoExperts(InvalidValue):
    """Expert parallelism asked of a dense model. A config key is answered with the value it refuses
    (``got true, expected false: ...``); a command-line switch has no value to show, so the command line gives
    ``dense``, the reason alone."""

    def __init__(self, model_name: str) -> None:
        self.dense = (f"{model_name} is a dense model, with no experts to shard (expert parallelism is for "
                      "mixture-of-experts models)")
        super().__init__("enable_expert_parallel", True, f"false: {self.dense}")


def layer_shard(model: ModelSpec, tp: int, expert_parallel: bool = False) -> LayerShard:
    """What one of ``tp`` GPUs holds of each kind of layer; an ``InvalidValue`` (named ``tp``) for a split vLLM
    refuses, or (named ``enable_expert_parallel``) for expert parallelism on a model without experts."""
    h, gated = model.hidden_size, model.gated_mlp
    attention = attention_shapes(model, tp)
    dense = _mlp(h, model.intermediate_size // tp, gated) if model.num_moe_layers < model.num_layers else ()
    moe = model.moe
    if moe is None and expert_parallel:
        # vLLM's flag changes only the expert layers, so on a dense model it would be silently ignored: refused
        # here, so that no config claims a deployment it does not describe.
        raise NoExperts(model.name)
    if moe is None:
        return LayerShard(attention, dense, (), (), (), 0)
    for name, width in (("expert", moe.expert_intermediate_size), ("shared expert", moe.shared_intermediate_size)):
        if width % tp and not (name == "expert" and expert_parallel):
            raise InvalidValue("tp", tp, f"a divisor of {model.name}'s {name} width {width} (vLLM splits it evenly "
                                         "over the GPUs)")
    if expert_parallel:
        expert, held = _mlp(h, moe.expert_intermediate_size, gated), -(-moe.num_experts // tp)
    else:
        expert, held = _mlp(h, moe.expert_intermediate_size // tp, gated), moe.num_experts
    return LayerShard(attention, dense, ((h, moe.num_experts),), _mlp(h, moe.shared_intermediate_size // tp, gated),
                      expert, held)
