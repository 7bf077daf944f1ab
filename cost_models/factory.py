"""From a simulation config to what the simulator needs: the step-time function with its parameters, and the
KV-cache size when the config leaves ``scheduler.num_kv_blocks`` out."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import jax.numpy as jnp

from servetune.config import Config
from servetune.cost_models import linear, roofline
from servetune.cost_models.catalog import as_config_fields, resolve_gpu, resolve_model
from servetune.cost_models.memory import kv_capacity
from servetune.cost_models.profile import find_profile, load_profile
from servetune.errors import InvalidValue


def _config_dir(config: Config) -> Optional[Path]:
    """The folder of the config file, against which its relative paths are read."""
    if config.source is None:
        return None
    source = Path(config.source)
    return source.parent if source.is_file() else None


def build_cost_model(config: Config) -> tuple[Callable, Any]:
    """``(step_time_s, params)`` for ``config.cost_model.kind``; params are a pytree of float32 arrays, so
    configs of one kind can be stacked and vmapped."""
    cost = config.cost_model
    if cost.kind == "linear":
        params = linear.LinearCostParams(base_s=jnp.float32(cost.base_s), per_token_s=jnp.float32(cost.per_token_s),
                                         per_context_token_s=jnp.float32(cost.per_context_token_s))
        return linear.step_time_s, params
    base_dir = _config_dir(config)
    with as_config_fields():
        if cost.kind == "roofline":
            calibration = roofline.Calibration()
        elif cost.kind == "calibrated":
            calibration, _ = load_profile(find_profile(cost.profile, base_dir, resolve_gpu(config.hardware.gpu).name))
        else:
            raise InvalidValue("cost_model.kind", cost.kind, "linear, roofline or calibrated")
        model = resolve_model(config.model, base_dir, config.quantization, config.kv_cache_dtype)
        gpu = resolve_gpu(config.hardware.gpu)
        scheduler = config.scheduler
        # vLLM 0.33 overlaps a step's host work with the GPU's previous step when scheduling is asynchronous,
        # and runs steps larger than its CUDA-graph capture size eagerly (docs/cost-models.md).
        capture = roofline.vllm_cudagraph_capture_size(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        return roofline.step_time_s, roofline.build_roofline_params(
            model, gpu, config.hardware.tp, calibration, async_scheduling=scheduler.pipelined,
            cudagraph_capture_size=capture, expert_parallel=config.hardware.enable_expert_parallel)


def derive_num_kv_blocks(config: Config) -> int:
    """KV blocks per GPU as vLLM would size them for this model, GPU, TP (and expert parallelism), memory share and
    batch limits; an ``InvalidValue`` named by its config field (hardware.gpu when the model does not fit) when
    there are none."""
    with as_config_fields():
        model = resolve_model(config.model, _config_dir(config), config.quantization, config.kv_cache_dtype)
        capacity = kv_capacity(model, resolve_gpu(config.hardware.gpu),
                               config.hardware.tp, config.hardware.gpu_memory_utilization, config.scheduler.block_size,
                               config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                               expert_parallel=config.hardware.enable_expert_parallel)
    return capacity.num_kv_blocks
