"""From a chosen config to the file an engine reads: vLLM's ``--config`` YAML, SGLang's ``--config`` YAML,
TensorRT-LLM's ``--extra_llm_api_options`` YAML, TGI's launcher arguments, or servetune's own policy file.

Keys and semantics follow ../shared/reference/engines.md (vLLM 0.33, SGLang 0.5.23, TensorRT-LLM 1.2, TGI).
Each engine writes only keys it accepts. A knob in effect that the engine has no key for is listed in the
export's warnings (and in the file's header), never dropped silently; the list is computed from the config's
fields, so a knob the simulator gains later shows up there until an engine maps it. A value an engine would
refuse (vLLM's max-num-batched-tokens below max-num-seqs, a KV cache larger than the GPU) is refused here with
a ``UserError``, since the file would not start the server.

The KV cache: when the config derives ``num_kv_blocks`` from ``gpu_memory_utilization``, the utilization is
exported; when it gives a block count, the export computes the smallest utilization (to 0.001) at which vLLM's
sizing rule (``cost_models/memory.py``) yields at least that many blocks, and for vLLM also pins the count with
``num-gpu-blocks-override`` (both count vLLM's null block); TGI gets its total token count directly.
"""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Optional

import yaml

from servetune.config import Config, SchedulerConfig
from servetune.cost_models.factory import derive_num_kv_blocks
from servetune.errors import UserError
from servetune.pipeline import model_context_length

ENGINES = ("vllm", "sglang", "trtllm", "tgi", "servetune")
POLICY_FORMAT_VERSION = 1

# Knobs that only one batching policy reads; every other scheduler field is in effect under both.
STATIC_ONLY = ("scheduler.batch_size", "scheduler.max_wait_s")
CONTINUOUS_ONLY = ("scheduler.max_num_seqs", "scheduler.long_prefill_token_threshold", "scheduler.async_scheduling")
# Values at which a knob changes nothing, so an engine without the knob loses nothing. The last two are vLLM 0.33's
# own defaults for how its scheduler steps, which another engine replaces with its own.
NEUTRAL = {"scheduler.long_prefill_token_threshold": 0, "scheduler.watermark": 0.0,
           "scheduler.max_num_queued_reqs": None, "hardware.tp": 1, "scheduler.queue_order": "fcfs",
           "scheduler.priority_weights": None, "scheduler.length_prediction_noise": 0.0,
           "scheduler.enable_prefix_caching": False, "scheduler.async_scheduling": None,
           "scheduler.reserve_full_prompt": True}

# vLLM 0.33's scheduler and cache keys (engines.md; the last three as vllm/engine/arg_utils.py spells them, a
# `false` written as --no-KEY); its SchedulerConfig refuses any other key at start-up.
VLLM_KEYS = ("max-num-seqs", "max-num-batched-tokens", "enable-chunked-prefill", "long-prefill-token-threshold",
             "scheduling-policy", "max-num-queued-reqs", "max-num-queued-tokens", "watermark", "block-size",
             "gpu-memory-utilization", "enable-prefix-caching", "max-model-len", "async-scheduling",
             "scheduler-reserve-full-isl", "num-gpu-blocks-override")
# How each engine orders requests by priority (used when servetune's queue orders carry priorities):
# servetune follows vLLM, lower value first.
PRIORITY_ORDER = {"vllm": "lower value served first", "sglang": "higher value served first (negate servetune's)",
                  "trtllm": "no request priorities", "tgi": "no request priorities"}


def _priority_direction(engine: str, config: Config) -> str:
    if engine == "sglang" and config.scheduler.queue_order == "priority":
        return "lower value served first (schedule-low-priority-values-first, as servetune's priority order)"
    return PRIORITY_ORDER[engine]


@dataclass(frozen=True)
class Policy:
    """What an export describes: a resolved config and, when it came from a study, its predictions."""
    config: Config                 # resolved: num_kv_blocks is a number
    kv_blocks_given: bool          # the block count was set directly (not derived from memory utilization)
    predicted: Optional[dict] = None     # the trial's metrics
    spread: Optional[dict] = None        # {metric: {mean, std, min, max, runs}} over seeds (and scenarios)
    provenance: Optional[dict] = None    # config hash, source, workload, cost model, study, trial, ...


@dataclass(frozen=True)
class Exported:
    text: str
    warnings: tuple[str, ...]


def in_effect(config: Config) -> dict[str, Any]:
    """The knobs that shape this config's scheduling, by dotted key."""
    skip = CONTINUOUS_ONLY if config.scheduler.policy == "static" else STATIC_ONLY
    knobs = {f"scheduler.{f.name}": getattr(config.scheduler, f.name) for f in dataclasses.fields(SchedulerConfig)}
    knobs["hardware.tp"] = config.hardware.tp
    return {key: value for key, value in knobs.items() if key not in skip}


def _unexpressed(config: Config, expressed: set[str], engine: str,
                 policies: tuple[str, ...] = ("continuous",)) -> list[str]:
    """Warnings for the knobs in effect that ``expressed`` leaves out; ``policies``: the batching policies the
    engine can run (``scheduler.policy`` is expressed when it is one of them)."""
    # Every engine defaults to the model's context length, so a max_model_len equal to it needs no key.
    defaults = {**NEUTRAL, "scheduler.max_model_len": model_context_length(config)}
    unexpressed = []
    for key, value in in_effect(config).items():
        covered = value in policies if key == "scheduler.policy" else key in expressed
        if not covered and not (key in defaults and defaults[key] == value):
            unexpressed.append(f"{engine} cannot express {key}={_show(value)}")
    return unexpressed


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else f"{value}"


def memory_utilization_for(config: Config) -> float:
    """The gpu_memory_utilization (rounded up to 0.001) at which vLLM's sizing gives at least the config's
    num_kv_blocks; a UserError when even all of the GPU's memory does not."""
    wanted = config.scheduler.num_kv_blocks

    def blocks_at(utilization: float) -> int:
        hardware = dataclasses.replace(config.hardware, gpu_memory_utilization=utilization)
        return derive_num_kv_blocks(dataclasses.replace(config, hardware=hardware))

    try:
        most = blocks_at(1.0)
    except UserError:
        most = 0
    if most < wanted:
        raise UserError(f"scheduler.num_kv_blocks: got {wanted}, expected at most {most}: that is what "
                        f"{config.model} leaves room for on {config.hardware.gpu} x{config.hardware.tp} "
                        "with all of its memory, so no engine can be configured to hold it")
    low, high = 0, 1000   # thousandths: blocks_at(high / 1000) ≥ wanted holds throughout
    while high - low > 1:
        middle = (low + high) // 2
        try:
            enough = blocks_at(middle / 1000) >= wanted
        except UserError:   # the weights alone exceed this share of memory
            enough = False
        low, high = (low, middle) if enough else (middle, high)
    return high / 1000


def _memory_share(policy: Policy) -> float:
    return memory_utilization_for(policy.config) if policy.kv_blocks_given \
        else policy.config.hardware.gpu_memory_utilization


# ---------------------------------------------------------------------------------------------------------
# Engines.

def _concurrency(scheduler) -> int:
    """The most requests the policy runs at once: max_num_seqs, or a static batch's size."""
    return scheduler.max_num_seqs if scheduler.policy == "continuous" else scheduler.batch_size


def _vllm(policy: Policy) -> tuple[dict, list[str]]:
    s = policy.config.scheduler
    keys = {
        "max-num-seqs": _concurrency(s),
        "max-num-batched-tokens": s.max_num_batched_tokens,
        "enable-chunked-prefill": s.enable_chunked_prefill,
        # vLLM's two policies are servetune's fcfs and priority orders (lower first, ties by arrival).
        "scheduling-policy": "priority" if s.queue_order == "priority" else "fcfs",
        "block-size": s.block_size,
        "gpu-memory-utilization": _memory_share(policy),
        # On by default in vLLM: say it either way, since the simulation did or did not count on it.
        "enable-prefix-caching": s.enable_prefix_caching,
    }
    if s.enable_chunked_prefill and s.long_prefill_token_threshold:
        keys["long-prefill-token-threshold"] = s.long_prefill_token_threshold
    if s.max_model_len is not None:
        keys["max-model-len"] = s.max_model_len
    if policy.kv_blocks_given:
        # vLLM's num_gpu_blocks counts its null block, as num_kv_blocks does: the same number of usable blocks.
        keys["num-gpu-blocks-override"] = s.num_kv_blocks
    # Both on by default in vLLM 0.33; said either way, since the simulation counted on them or not.
    keys["async-scheduling"] = s.pipelined
    keys["scheduler-reserve-full-isl"] = s.reserve_full_prompt
    if s.max_num_queued_reqs is not None:
        keys["max-num-queued-reqs"] = s.max_num_queued_reqs
    if s.watermark:
        keys["watermark"] = s.watermark
    expressed = {"scheduler.max_num_seqs", "scheduler.batch_size", "scheduler.max_num_batched_tokens",
                 "scheduler.enable_chunked_prefill", "scheduler.long_prefill_token_threshold", "scheduler.block_size",
                 "scheduler.num_kv_blocks", "scheduler.watermark", "scheduler.max_num_queued_reqs",
                 "scheduler.enable_prefix_caching", "scheduler.max_model_len", "scheduler.async_scheduling",
                 "scheduler.reserve_full_prompt"}
    if s.queue_order == "priority":
        expressed.add("scheduler.queue_order")
    warnings = _unexpressed(policy.config, expressed, "vllm")
    if s.max_model_len is None:
        warnings.append(f"vllm: max-model-len is left to vLLM, which derives it from the model's config; knowing no "
                        f"context length for {policy.config.model}, the simulation took requests of up to "
                        f"{s.model_len_limit} tokens, all the KV cache holds")
    check_vllm(keys)
    return keys, warnings


def check_vllm(keys: dict) -> None:
    """vLLM's start-up checks on these keys (engines.md); a UserError naming the first one broken."""
    unknown = sorted(set(keys) - set(VLLM_KEYS))
    if unknown:
        raise UserError(f"vllm: {unknown[0]} is not a vLLM 0.33 key; expected one of {', '.join(VLLM_KEYS)}")
    seqs, tokens = keys["max-num-seqs"], keys["max-num-batched-tokens"]
    if tokens < seqs:
        raise UserError(f"vllm: max-num-batched-tokens {tokens} < max-num-seqs {seqs}; vLLM requires "
                        "max-num-batched-tokens ≥ max-num-seqs (search max_num_batched_tokens from at least "
                        f"{seqs}, or max_num_seqs up to {tokens})")
    if not keys["enable-chunked-prefill"] and tokens < keys.get("max-model-len", 0):
        raise UserError(f"vllm: max-num-batched-tokens {tokens} < max-model-len {keys['max-model-len']} with "
                        "chunked prefill off; vLLM requires max-num-batched-tokens ≥ max-model-len then")
    if "max-model-len" in keys and "num-gpu-blocks-override" in keys:
        needed = -(-keys["max-model-len"] // keys["block-size"])
        usable = keys["num-gpu-blocks-override"] - 1   # less vLLM's null block
        if needed > usable:
            raise UserError(f"vllm: max-model-len {keys['max-model-len']} needs {needed} KV blocks, but "
                            f"num-gpu-blocks-override {keys['num-gpu-blocks-override']} leaves {usable} usable; vLLM "
                            "refuses to start when the KV cache cannot hold max-model-len")
    if not 0 <= keys.get("watermark", 0) < 1:
        raise UserError(f"vllm: watermark {keys['watermark']} outside [0, 1)")
    if not 0 < keys["gpu-memory-utilization"] <= 1:
        raise UserError(f"vllm: gpu-memory-utilization {keys['gpu-memory-utilization']} outside (0, 1]")


def _sglang(policy: Policy) -> tuple[dict, list[str]]:
    s = policy.config.scheduler
    keys = {
        "max-running-requests": _concurrency(s),
        # SGLang's chunk size caps the prefill tokens of one step; -1 turns chunking off.
        "chunked-prefill-size": s.max_num_batched_tokens if s.enable_chunked_prefill else -1,
        "max-prefill-tokens": s.max_num_batched_tokens,
        # Chunks share steps with decodes, as in the simulated (and vLLM's) mixed batches.
        "enable-mixed-chunk": s.enable_chunked_prefill,
        "schedule-policy": "priority" if s.queue_order == "priority" else "fcfs",
        "mem-fraction-static": _memory_share(policy),
        "disable-radix-cache": not s.enable_prefix_caching,
    }
    if s.queue_order == "priority":
        # SGLang serves higher values first unless told otherwise; servetune (like vLLM) serves lower first.
        keys["enable-priority-scheduling"] = True
        keys["schedule-low-priority-values-first"] = True
    if s.max_num_queued_reqs is not None:
        keys["max-queued-requests"] = s.max_num_queued_reqs
    expressed = {"scheduler.max_num_seqs", "scheduler.batch_size", "scheduler.max_num_batched_tokens",
                 "scheduler.enable_chunked_prefill", "scheduler.num_kv_blocks", "scheduler.max_num_queued_reqs",
                 "scheduler.enable_prefix_caching"}
    if s.queue_order == "priority":
        expressed.add("scheduler.queue_order")
    warnings = _unexpressed(policy.config, expressed, "sglang")
    if keys["max-running-requests"] < 1:
        raise UserError(f"sglang: max-running-requests {keys['max-running-requests']} < 1")
    return keys, warnings


def _trtllm(policy: Policy) -> tuple[dict, list[str]]:
    s = policy.config.scheduler
    continuous = s.policy == "continuous"
    keys = {
        "max_batch_size": _concurrency(s),
        "max_num_tokens": s.max_num_batched_tokens,
        "enable_chunked_prefill": s.enable_chunked_prefill,
        # Admission reserves a request's prompt and preempts when decodes run out of blocks, as
        # MAX_UTILIZATION does; GUARANTEED_NO_EVICT would reserve every request's whole output up front.
        "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION" if continuous else "STATIC_BATCH"},
    }
    if s.enable_chunked_prefill:
        keys["scheduler_config"]["context_chunking_policy"] = "FIRST_COME_FIRST_SERVED"
    keys["kv_cache_config"] = {"enable_block_reuse": s.enable_prefix_caching}
    expressed = {"scheduler.max_num_seqs", "scheduler.max_num_batched_tokens", "scheduler.enable_chunked_prefill",
                 "scheduler.batch_size", "scheduler.enable_prefix_caching"}
    warnings = _unexpressed(policy.config, expressed, "trtllm", policies=("continuous", "static"))
    return keys, warnings


def _tgi(policy: Policy) -> tuple[dict, list[str]]:
    s = policy.config.scheduler
    keys = {
        "--max-batch-size": _concurrency(s),
        "--max-batch-prefill-tokens": s.max_num_batched_tokens,
        # TGI sizes its KV cache in tokens; the simulated cache holds num_kv_blocks · block_size.
        "--max-batch-total-tokens": s.num_kv_blocks * s.block_size,
    }
    if s.max_num_queued_reqs is not None:
        keys["--max-concurrent-requests"] = keys["--max-batch-size"] + s.max_num_queued_reqs
    expressed = {"scheduler.max_num_seqs", "scheduler.batch_size", "scheduler.max_num_batched_tokens",
                 "scheduler.num_kv_blocks", "scheduler.block_size", "scheduler.max_num_queued_reqs"}
    warnings = _unexpressed(policy.config, expressed, "tgi")
    if s.max_num_queued_reqs is None:
        warnings.append("tgi always caps requests in flight (--max-concurrent-requests, default 128) where the "
                        "simulation queued without limit; raise it if the load needs more")
    if keys["--max-batch-prefill-tokens"] > keys["--max-batch-total-tokens"]:
        raise UserError(f"tgi: --max-batch-prefill-tokens {keys['--max-batch-prefill-tokens']} > "
                        f"--max-batch-total-tokens {keys['--max-batch-total-tokens']}; TGI requires the prefill "
                        "budget to fit in the KV cache")
    return keys, warnings


def _servetune(policy: Policy) -> tuple[dict, list[str]]:
    config = policy.config
    document = {
        "servetune_policy": POLICY_FORMAT_VERSION,
        # Weights as a {feature: weight} mapping, the form a config file gives them in.
        "scheduler": {**dataclasses.asdict(config.scheduler),
                      "priority_weights": None if config.scheduler.priority_weights is None
                      else dict(config.scheduler.priority_weights)},
        "hardware": dataclasses.asdict(config.hardware),
        "priority_order": PRIORITY_ORDER["vllm"],
        "predicted": policy.predicted,
        "spread": policy.spread,
        "provenance": policy.provenance,
    }
    return document, []


ENGINE_WRITERS: dict[str, Callable[[Policy], tuple[dict, list[str]]]] = {
    "vllm": _vllm, "sglang": _sglang, "trtllm": _trtllm, "tgi": _tgi, "servetune": _servetune,
}
USAGE = {
    "vllm": "vllm serve MODEL --config {file}",
    "sglang": "python -m sglang.launch_server --model-path MODEL --config {file}",
    "trtllm": "trtllm-serve MODEL --extra_llm_api_options {file}",
    "tgi": "text-generation-launcher --model-id MODEL $(grep -v '^#' {file})",
    "servetune": "servetune reads this file; it records the knobs, predictions and provenance",
}


def export(policy: Policy, engine: str, file_name: str = "FILE", caveats: tuple[str, ...] = ()) -> Exported:
    """The engine's file; ``caveats``: warnings about the policy itself, ahead of the engine's own."""
    if engine not in ENGINE_WRITERS:
        raise UserError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    keys, warnings = ENGINE_WRITERS[engine](policy)
    warnings = [*caveats, *warnings]
    header = [f"servetune export for {engine}: {USAGE[engine].format(file=file_name)}"]
    if policy.provenance:
        p = policy.provenance
        origin = (f"RL policy {p['policy']}" if "policy" in p else f"study {p.get('study')} trial {p.get('trial')}")
        header.append(f"from {origin} (config {p.get('config_source')}, hash {p.get('config_hash')})")
    if policy.predicted and engine != "servetune":
        m = policy.predicted
        header.append(f"predicted: goodput {_num(m.get('request_goodput'))} req/s, SLO attainment "
                      f"{_num(m.get('slo_attainment'))}, p99 TTFT {_num(m.get('p99_ttft_ms'))} ms, "
                      f"p99 ITL {_num(m.get('p99_itl_ms'))} ms")
    if engine in ("vllm", "sglang"):
        header.append(f"request priority: {_priority_direction(engine, policy.config)}")
    header += [f"warning: {w}" for w in warnings]
    comments = "".join(f"# {line}\n" for line in header)
    if engine == "tgi":
        body = "".join(f"{flag} {shlex.quote(str(value))}\n" for flag, value in keys.items())
    else:
        body = yaml.safe_dump(keys, sort_keys=False, default_flow_style=False)
    return Exported(comments + body, tuple(warnings))


def _num(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"
