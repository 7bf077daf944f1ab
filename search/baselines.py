"""The trials every study starts with, so that it shows how much it beat them.

- ``as-configured``: the config file's own knobs.
- ``vllm-default``: what ``vllm serve`` picks with no scheduler flags (../shared/reference/engines.md, vLLM
  0.33): 256 running requests and a 2,048-token budget on A100-class and smaller GPUs, 1,024 and 8,192 on
  GPUs of 70 GiB or more that are not A100s; chunked prefill on, no prefill-chunk cap, no admission limit
  (``max-num-queued-reqs`` unset: vLLM queues every request).
- ``chunk-512``: vLLM's default with a 512-token step budget, the small-chunk setting often recommended to
  keep inter-token latency low while long prompts prefill.

Only continuous batching has the vLLM baselines (vLLM has no static batching). A knob a baseline does not set
keeps the config's value; a baseline whose value is not among a knob's choices is left out, with the reason.
"""
from __future__ import annotations

from typing import Any

from servetune.config import Config
from servetune.cost_models.catalog import resolve_gpu
from servetune.cost_models.gpus import GIB
from servetune.search.space import SearchSpace

LARGE_GPU_BYTES = 70 * GIB


def vllm_default_knobs(config: Config) -> dict[str, Any]:
    gpu = resolve_gpu(config.hardware.gpu)
    large = gpu.memory_bytes >= LARGE_GPU_BYTES and not gpu.name.startswith("a100")
    return {
        "scheduler.max_num_seqs": 1024 if large else 256,
        "scheduler.max_num_batched_tokens": 8192 if large else 2048,
        "scheduler.enable_chunked_prefill": True,
        "scheduler.long_prefill_token_threshold": 0,
        "scheduler.max_num_queued_reqs": None,
    }


def baselines(config: Config, space: SearchSpace) -> tuple[list[tuple[str, dict]], list[str]]:
    """([(name, knob values)] to enqueue, [why a baseline was left out])."""
    own = space.values_in(config)
    candidates = [("as-configured", own)]
    if config.scheduler.policy == "continuous":
        vllm = vllm_default_knobs(config)
        candidates += [("vllm-default", vllm), ("chunk-512", {**vllm, "scheduler.max_num_batched_tokens": 512})]
    chosen, skipped = [], []
    for name, settings in candidates:
        values = {key: settings.get(key, own[key]) for key in space.keys}
        outside = space.outside_choices(values)
        if outside:
            skipped.append(f"baseline {name} left out: {', '.join(outside)} not among the knob's choices")
        else:
            chosen.append((name, values))
    return chosen, skipped
