"""From a chosen config to the file an engine reads: vLLM's ``--config`` YAML, SGLang's ``--config`` YAML,
TensorRT-LLM's ``--extra_llm_api_options`` YAML, TGI's launcher arguments, or servetune's own policy file.

Keys and semantics follow ../shared/reference/engines.md (vLLM 0.33, SGLang 0.5.23, TensorRT-LLM 1.2, TGI);
the cache keys engines.md does not list are SGLang's ``page-size`` and ``max-total-tokens``
(python/sglang/srt/server_args.py: "the number of tokens in a page", "the maximum number of tokens in the
memory pool") and TensorRT-LLM's ``kv_cache_config.tokens_per_block`` and ``kv_cache_config.max_tokens``
(tensorrt_llm.llmapi.KvCacheConfig; blocks are a power of two tokens). Each engine writes only keys it
accepts. A knob in effect that the engine has no key for is listed in the export's warnings (and in the
file's header), never dropped silently; the list is computed from the config's fields, so a knob the
simulator gains later shows up there until an engine maps it.

Every file is checked against its engine's start-up rules before it is written, and one that would not start
the server is refused with a ``UserError``: the vLLM file is read back as vLLM would read it (the KV cache it
would size, the max_model_len it would take) and put to ``SchedulerConfig.vllm_refusal``, and a
max-model-len above the model's context length is refused as vLLM refuses it (vllm/config/model.py,
``_get_and_verify_max_len``).

The KV cache: when the config derives ``num_kv_blocks`` from ``gpu_memory_utilization``, the utilization is
exported; when it gives a block count, the export computes the smallest utilization (to 0.001) at which vLLM's
sizing rule (``cost_models/memory.py``) yields at least that many blocks, and for vLLM also pins the count with
``num-gpu-blocks-override`` (both count vLLM's null block). SGLang, TensorRT-LLM and TGI size their caches by
rules of their own, so each gets the simulated cache's usable tokens, (num_kv_blocks - 1) x block_size, as its
cache size in tokens.

Tensor parallelism goes to every engine under its own name, vLLM's ``tensor-parallel-size``
(vllm/config/parallel.py, ``ParallelConfig.tensor_parallel_size``), SGLang's ``tp-size``
(python/sglang/srt/server_args.py, ``--tensor-parallel-size``/``--tp-size``; its ``--config`` passes each key as
``--KEY``, python/sglang/srt/server_args_config_parser.py), TensorRT-LLM's ``tensor_parallel_size`` (the LlmArgs
field that trtllm-serve's ``--tp_size`` sets and its YAML overwrites, tensorrt_llm/commands/serve.py,
``get_llm_args``) and TGI's ``--num-shard`` (text-generation-launcher's arguments,
https://huggingface.co/docs/text-generation-inference/reference/launcher). The first three default to one GPU, so
they get the key only above one; TGI shards over every GPU it sees unless told, so it always gets it.

The model's precision goes to vLLM as ``quantization`` (only for FP8 quantisation of a BF16 checkpoint on loading;
vLLM reads a quantised checkpoint's method from its config.json) and ``kv-cache-dtype``, expert parallelism as
``enable-expert-parallel``; SGLang and TensorRT-LLM list the precision among the knobs they do not express.
vLLM's expert parallelism (with one data-parallel rank) spreads each MoE layer's experts over the ``tp`` GPUs,
none split; SGLang gets the same as ``ep-size`` = tp (python/sglang/srt/server_args.py, ``--expert-parallel-size``
/ ``--ep-size``: each TP rank's expert group is tp_rank // (tp / ep), so ep = tp gives every GPU its own experts),
and TensorRT-LLM as ``moe_expert_parallel_size`` = tp with ``moe_tensor_parallel_size`` 1 (LlmArgs,
tensorrt_llm/llmapi/llm_args.py; tensorrt_llm/mapping.py requires moe_tp x moe_ep = tp).

A cluster (``cluster.replicas`` above one) exports the engine's file for one replica (the replicas are identical:
one replica group) with the replicas and the router beside it. vLLM takes the replicas as ``data-parallel-size``
(vllm/engine/arg_utils.py, ``--data-parallel-size``/``-dp``, ``ParallelConfig.data_parallel_size``), and its
internal load balancer (vllm/v1/engine/core_client.py, ``DPLBAsyncMPClient.get_core_engine_for_request``, at
vllm-project/vllm 00080ee) sends each request to the engine with the lowest max(its own requests in flight,
waiting + running): least_outstanding, which the export maps there. It also penalises waiting requests on an
engine above 50% KV cache use and reads the engines' counts from snapshots (every 100 ms), which the warnings say;
any other router is a warning naming it. For llm-d's inference scheduler (llm-d/llm-d-inference-scheduler,
docs/architecture.md and deploy/config/epp-config.yaml) least_outstanding is its ``active-request-scorer`` ("pods
with fewer active requests receive higher scores") under ``max-score-picker`` and ``single-profile-handler``, an
``EndpointPickerConfig`` written beside the engine's file (``Exported.companions``); llm-d's scorers score each
signal in [0, 1] before weighting them, so no other router is mapped to them, and a warning says so. Other
engines have no data-parallel balancer here: the replicas and the router are warnings.

A cluster of replica groups (``cluster.replicas`` as a list) has no one engine file: the export's file is the
router's settings (router, weights, signal delay, and each group's replicas, GPU, tp and engine file), and each
group's engine file goes beside it, named by the group (x.vllm.yaml -> x.vllm.<group>.yaml), the group's engine
exported as a single engine's is, with its own warnings prefixed by the group's name. vLLM's data-parallel
balancer runs engines of one configuration, so no group's file has data-parallel-size; a least_outstanding
router is still written as llm-d's EndpointPickerConfig, whose pods may serve different files. servetune's own
policy file records the whole cluster in one file.

The admission limit ``max_num_queued_reqs`` counts unfinished requests, waiting and running, as vLLM's
``max-num-queued-reqs`` does (vllm/v1/engine/async_llm.py); TGI's ``--max-concurrent-requests`` counts the
same; SGLang's ``max-queued-requests`` counts waiting requests only (so it gets the limit less its running
seats, with a warning).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from servetune.config import Config, SchedulerConfig
from servetune.errors import UserError, show_yaml

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
           "scheduler.reserve_full_prompt": True, "quantization": None, "kv_cache_dtype": "auto",
           "hardware.enable_expert_parallel": False,
           # No engine takes the window as a flag: vLLM reads it from the model's config.json (null: full attention).
           "scheduler.sliding_window": None,
           # A cluster's router settings change nothing without a delay or weights.
           "cluster.signal_delay_s": 0.0, "cluster.router_weights": None}

# vLLM 0.33's scheduler and cache keys (engines.md up to max-model-len, the rest as vllm/engine/arg_utils.py spells
# them, a `false` written as --no-KEY); its SchedulerConfig refuses any other key at start-up.
VLLM_KEYS = ("max-num-seqs", "max-num-batched-tokens", "enable-chunked-prefill", "long-prefill-token-threshold",
             "scheduling-policy", "max-num-queued-reqs", "max-num-queued-tokens", "watermark", "block-size",
             "gpu-memory-utilization", "enable-prefix-caching", "max-model-len", "async-scheduling",
             "scheduler-reserve-full-isl", "num-gpu-blocks-override", "quantization", "kv-cache-dtype",
             "enable-expert-parallel", "tensor-parallel-size", "data-parallel-size")
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
    # Files that go beside the engine's: (suffix replacing the file's last one, text), such as llm-d's router
    # config for a cluster.
    companions: tuple[tuple[str, str], ...] = ()


def in_effect(config: Config) -> dict[str, Any]:
    """The knobs that shape this config's scheduling, by dotted key."""
    skip = CONTINUOUS_ONLY if config.scheduler.policy == "static" else STATIC_ONLY
    knobs = {f"scheduler.{f.name}": getattr(config.scheduler, f.name) for f in dataclasses.fields(SchedulerConfig)}
    knobs["hardware.tp"] = config.hardware.tp
    knobs["hardware.enable_expert_parallel"] = config.hardware.enable_expert_parallel
    knobs["quantization"], knobs["kv_cache_dtype"] = config.quantization, config.kv_cache_dtype
    if replicas(config) > 1:
        # The router's draws are no setting of an engine, so the seed is left out.
        knobs.update({f"cluster.{name}": getattr(config.cluster, name)
                      for name in ("replicas", "router", "router_weights", "signal_delay_s")})
    return {key: value for key, value in knobs.items() if key not in skip}


def replicas(config: Config) -> int:
    return 1 if config.cluster is None else config.cluster.num_replicas


def _has_groups(config: Config) -> bool:
    return config.cluster is not None and config.cluster.has_groups


def _model_context_length(config: Config) -> Optional[int]:
    # Imported here: the command line lists the engines without importing the simulator.
    from servetune.pipeline import model_context_length

    return model_context_length(config)


def _checkpoint_quantization(config: Config) -> Optional[str]:
    """The quantisation method the model's own config.json names (None: BF16 weights)."""
    from servetune.cost_models.catalog import resolve_model
    from servetune.cost_models.factory import _config_dir

    weights = resolve_model(config.model, _config_dir(config)).quantization
    return None if weights is None else weights.method


def _vllm_precision(config: Config) -> tuple[dict, list[str]]:
    """vLLM's --quantization, only where vLLM needs it: to quantise a BF16 checkpoint to FP8 on loading (AWQ and
    GPTQ stand for such a checkpoint, whose config.json vLLM reads; forcing --quantization awq there would pick
    the slower non-Marlin kernel); and --kv-cache-dtype unless auto."""
    keys, warnings = {}, []
    if config.quantization is not None and _checkpoint_quantization(config) is None:
        if config.quantization == "fp8":
            keys["quantization"] = "fp8"
        else:
            warnings.append(f"vllm: quantization {config.quantization} simulated a {config.quantization.upper()} "
                            f"checkpoint of {config.model}: serve one, whose config.json gives vLLM the method")
    if config.kv_cache_dtype != "auto":
        keys["kv-cache-dtype"] = config.kv_cache_dtype
    return keys, warnings


def _derived_kv_blocks(config: Config) -> int:
    from servetune.cost_models.factory import derive_num_kv_blocks

    return derive_num_kv_blocks(config)


def _usable_kv_tokens(scheduler: SchedulerConfig) -> int:
    """Tokens the simulated cache holds for requests (vLLM's null block left out)."""
    return scheduler.usable_kv_blocks * scheduler.block_size


def _unexpressed(config: Config, expressed: set[str], engine: str,
                 policies: tuple[str, ...] = ("continuous",)) -> list[str]:
    """Warnings for the knobs in effect that ``expressed`` leaves out; ``policies``: the batching policies the
    engine can run (``scheduler.policy`` is expressed when it is one of them)."""
    # Every engine defaults to the model's context length, so a max_model_len equal to it needs no key.
    defaults = {**NEUTRAL, "scheduler.max_model_len": _model_context_length(config)}
    unexpressed = []
    for key, value in in_effect(config).items():
        covered = value in policies if key == "scheduler.policy" else key in expressed
        if not covered and not (key in defaults and defaults[key] == value):
            unexpressed.append(f"{engine} cannot express {key}={show_yaml(value, quote_text=False)}")
    return unexpressed


def memory_utilization_for(config: Config) -> float:
    """The gpu_memory_utilization (rounded up to 0.001) at which vLLM's sizing gives at least the config's
    num_kv_blocks; a UserError when even all of the GPU's memory does not."""
    wanted = config.scheduler.num_kv_blocks

    def blocks_at(utilization: float) -> int:
        hardware = dataclasses.replace(config.hardware, gpu_memory_utilization=utilization)
        return _derived_kv_blocks(dataclasses.replace(config, hardware=hardware))

    try:
        most = blocks_at(1.0)
    except UserError:
        most = 0
    if most < wanted:
        raise UserError(f"scheduler.num_kv_blocks: got {wanted}, expected at most {most}: that is what "
                        f"{config.model} leaves room for on {config.hardware.gpu_name} x{config.hardware.tp} "
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
    precision, precision_warnings = _vllm_precision(policy.config)
    keys.update(precision)
    if policy.config.hardware.tp > 1:
        keys["tensor-parallel-size"] = policy.config.hardware.tp
    if policy.config.hardware.enable_expert_parallel:
        keys["enable-expert-parallel"] = True
    cluster_expressed, cluster_warnings = _vllm_data_parallel(policy.config, keys)
    expressed = {*cluster_expressed,
                 "scheduler.max_num_seqs", "scheduler.batch_size", "scheduler.max_num_batched_tokens",
                 "scheduler.enable_chunked_prefill", "scheduler.long_prefill_token_threshold", "scheduler.block_size",
                 "scheduler.num_kv_blocks", "scheduler.watermark", "scheduler.max_num_queued_reqs",
                 "scheduler.enable_prefix_caching", "scheduler.max_model_len", "scheduler.async_scheduling",
                 "scheduler.reserve_full_prompt", "quantization", "kv_cache_dtype", "hardware.tp",
                 "hardware.enable_expert_parallel"}
    if s.queue_order == "priority":
        expressed.add("scheduler.queue_order")
    warnings = _unexpressed(policy.config, expressed, "vllm") + precision_warnings + cluster_warnings
    if s.max_model_len is None:
        warnings.append(f"vllm: max-model-len is left to vLLM, which derives it from the model's config; knowing no "
                        f"context length for {policy.config.model}, the simulation took requests of up to "
                        f"{s.model_len_limit} tokens, all the KV cache holds")
    check_vllm(keys, policy.config)
    return keys, warnings


# vLLM's data-parallel balancer picks by its engines' load: least_outstanding (see the module's docstring).
VLLM_BALANCER_ROUTER = "least_outstanding"


def _vllm_data_parallel(config: Config, keys: dict) -> tuple[set[str], list[str]]:
    """A cluster's replicas as vLLM's data-parallel engines (``keys`` gains data-parallel-size): the cluster keys
    expressed, and warnings for how vLLM's balancer differs from the simulated router."""
    if replicas(config) == 1:
        return set(), []
    cluster = config.cluster
    keys["data-parallel-size"] = cluster.replicas
    if cluster.router != VLLM_BALANCER_ROUTER:
        return {"cluster.replicas", "cluster.router"}, [
            f"vllm cannot express cluster.router={cluster.router}: its data-parallel load balancer sends each "
            f"request to the engine with the fewest waiting + running requests ({VLLM_BALANCER_ROUTER}); for "
            f"{cluster.router}, start {cluster.replicas} engines without data-parallel-size behind a router of "
            "your own"]
    return {"cluster.replicas", "cluster.router"}, [
        "vllm: its data-parallel load balancer also penalises waiting requests on an engine above 50% KV cache use "
        "(up to 3x their count at 100%), which the simulated least_outstanding router did not"]


def llm_d_router(config: Config) -> tuple[Optional[str], list[str]]:
    """llm-d's EndpointPickerConfig for the cluster's router (None when it has none), and warnings."""
    if replicas(config) == 1:
        return None, []
    cluster = config.cluster
    if cluster.router != VLLM_BALANCER_ROUTER:
        return None, [f"llm-d: no EndpointPickerConfig written for cluster.router={cluster.router}: servetune maps "
                      f"only {VLLM_BALANCER_ROUTER} to llm-d's scorers (its active-request-scorer); they score each "
                      "signal in [0, 1] before weighting, so a weighted sum of raw signals has no exact counterpart"]
    document = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "active-request-scorer"}, {"type": "max-score-picker"},
                    {"type": "single-profile-handler"}],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "active-request-scorer", "weight": 1},
                                                               {"pluginRef": "max-score-picker"}]}],
    }
    pods = ("each a vLLM pod serving its replica group's engine file" if cluster.has_groups else
            "each a vLLM pod serving the engine file without data-parallel-size")
    header = (f"# servetune export for llm-d's inference scheduler (EPP --configFile): {cluster.router} over "
              f"{cluster.num_replicas} replicas, {pods}\n")
    warnings = []
    if cluster.signal_delay_s:
        warnings.append(f"llm-d cannot express cluster.signal_delay_s={cluster.signal_delay_s:g}: the "
                        "active-request-scorer counts the requests it routed itself, with no delay")
    return header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False), warnings


def check_max_model_len(engine: str, key: str, value: Optional[int], config: Config) -> None:
    """A UserError when ``value`` (the engine's ``key``) exceeds the model's context length, which vLLM refuses
    to start with (vllm/config/model.py, ``_get_and_verify_max_len``) and SGLang and TensorRT-LLM refuse too."""
    context = _model_context_length(config)
    if value is not None and context is not None and value > context:
        raise UserError(f"{engine}: {key} {value} is above {config.model}'s context length {context} "
                        f"(max_position_embeddings in its config.json), which the engine refuses to start with; "
                        f"set scheduler.max_model_len (or workload.max_model_len) to at most {context}")


def vllm_reads(keys: dict, config: Config) -> SchedulerConfig:
    """The scheduler vLLM runs from a file of these keys on ``config``'s model and GPU: the KV cache it sizes at
    the file's gpu-memory-utilization and parallelism (unless the file pins the block count), and the model's
    context length where the file gives no max-model-len."""
    scheduler = SchedulerConfig(
        max_num_seqs=keys["max-num-seqs"], max_num_batched_tokens=keys["max-num-batched-tokens"],
        enable_chunked_prefill=keys["enable-chunked-prefill"],
        long_prefill_token_threshold=keys.get("long-prefill-token-threshold", 0), block_size=keys["block-size"],
        watermark=keys.get("watermark", 0.0), max_num_queued_reqs=keys.get("max-num-queued-reqs"),
        max_model_len=keys.get("max-model-len", _model_context_length(config)),
        num_kv_blocks=keys.get("num-gpu-blocks-override"))
    if scheduler.num_kv_blocks is None:
        hardware = dataclasses.replace(config.hardware, gpu_memory_utilization=keys["gpu-memory-utilization"],
                                       tp=keys.get("tensor-parallel-size", 1),
                                       enable_expert_parallel=keys.get("enable-expert-parallel", False))
        blocks = _derived_kv_blocks(dataclasses.replace(config, hardware=hardware, scheduler=scheduler))
        scheduler = dataclasses.replace(scheduler, num_kv_blocks=blocks)
    return scheduler


def check_vllm(keys: dict, config: Config) -> None:
    """vLLM 0.33's start-up checks on a file of these keys for ``config``'s model and hardware; a UserError
    naming the first one broken."""
    unknown = sorted(set(keys) - set(VLLM_KEYS))
    if unknown:
        raise UserError(f"vllm: {unknown[0]} is not a vLLM 0.33 key; expected one of {', '.join(VLLM_KEYS)}")
    if not 0 < keys["gpu-memory-utilization"] <= 1:
        raise UserError(f"vllm: gpu-memory-utilization {keys['gpu-memory-utilization']} outside (0, 1]")
    if not 0 <= keys.get("watermark", 0) < 1:
        raise UserError(f"vllm: watermark {keys['watermark']} outside [0, 1)")
    check_max_model_len("vllm", "max-model-len", keys.get("max-model-len"), config)
    try:
        refusal = vllm_reads(keys, config).vllm_refusal()
    except UserError as error:   # the weights leave no room for a KV block on the file's GPUs
        refusal = str(error)
    if refusal is not None:
        raise UserError(f"vllm: the exported file would not start vLLM: {refusal}")


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
        # The simulated cache: pages of block_size tokens, and its usable tokens as the pool (SGLang keeps a
        # padding slot of its own beside them, as vLLM keeps its null block).
        "page-size": s.block_size,
        "max-total-tokens": _usable_kv_tokens(s),
        "disable-radix-cache": not s.enable_prefix_caching,
    }
    if policy.config.hardware.tp > 1:
        keys["tp-size"] = policy.config.hardware.tp
        if policy.config.hardware.enable_expert_parallel:
            keys["ep-size"] = policy.config.hardware.tp
    if s.queue_order == "priority":
        # SGLang serves higher values first unless told otherwise; servetune (like vLLM) serves lower first.
        keys["enable-priority-scheduling"] = True
        keys["schedule-low-priority-values-first"] = True
    warnings = []
    if s.max_num_queued_reqs is not None:
        # SGLang refuses an arrival when the waiting requests, the arrival among them, would exceed its limit;
        # the simulation (as vLLM) when the unfinished ones would. With every seat taken the two agree at the
        # limit less the seats; at least 1, since 0 would refuse every arrival before it could be scheduled.
        seats = keys["max-running-requests"]
        keys["max-queued-requests"] = max(s.max_num_queued_reqs - seats, 1)
        warnings.append(f"sglang: max-queued-requests counts waiting requests only, so the simulated limit of "
                        f"{s.max_num_queued_reqs} unfinished (waiting + running) requests is written as "
                        f"{keys['max-queued-requests']} waiting beside {seats} running; while fewer run, sglang "
                        "queues more than the simulation did")
    expressed = {"scheduler.max_num_seqs", "scheduler.batch_size", "scheduler.max_num_batched_tokens",
                 "scheduler.enable_chunked_prefill", "scheduler.num_kv_blocks", "scheduler.block_size",
                 "scheduler.max_num_queued_reqs", "scheduler.enable_prefix_caching", "hardware.tp",
                 "hardware.enable_expert_parallel"}
    if s.queue_order == "priority":
        expressed.add("scheduler.queue_order")
    warnings = _unexpressed(policy.config, expressed, "sglang") + warnings
    check_sglang(keys)
    return keys, warnings


def check_sglang(keys: dict) -> None:
    """SGLang's start-up checks on these keys (python/sglang/srt/server_args.py); a UserError naming the first
    one broken."""
    if keys["max-running-requests"] < 1:
        raise UserError(f"sglang: max-running-requests {keys['max-running-requests']} < 1; SGLang requires > 0")
    if not 0 < keys["mem-fraction-static"] < 1:
        raise UserError(f"sglang: mem-fraction-static {keys['mem-fraction-static']} outside (0, 1), which SGLang "
                        "requires (the simulated cache needs all of the GPU's memory)")
    if keys["max-total-tokens"] < keys["page-size"]:
        raise UserError(f"sglang: max-total-tokens {keys['max-total-tokens']} holds no page of "
                        f"{keys['page-size']} tokens")


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
    # The simulated cache: blocks of block_size tokens, and its usable tokens as the most the cache holds (the
    # smaller of max_tokens and free_gpu_memory_fraction's share is what TensorRT-LLM allocates).
    keys["kv_cache_config"] = {"enable_block_reuse": s.enable_prefix_caching, "tokens_per_block": s.block_size,
                               "max_tokens": _usable_kv_tokens(s)}
    if policy.config.hardware.tp > 1:
        keys["tensor_parallel_size"] = policy.config.hardware.tp
        if policy.config.hardware.enable_expert_parallel:
            keys["moe_expert_parallel_size"] = policy.config.hardware.tp
            keys["moe_tensor_parallel_size"] = 1
    expressed = {"scheduler.max_num_seqs", "scheduler.max_num_batched_tokens", "scheduler.enable_chunked_prefill",
                 "scheduler.batch_size", "scheduler.enable_prefix_caching", "scheduler.block_size",
                 "scheduler.num_kv_blocks", "hardware.tp", "hardware.enable_expert_parallel"}
    warnings = _unexpressed(policy.config, expressed, "trtllm", policies=("continuous", "static"))
    check_trtllm(keys)
    return keys, warnings


def check_trtllm(keys: dict) -> None:
    """TensorRT-LLM's checks on these keys (tensorrt_llm.llmapi.KvCacheConfig); a UserError naming the first
    one broken."""
    block = keys["kv_cache_config"]["tokens_per_block"]
    if block & (block - 1):
        raise UserError(f"trtllm: kv_cache_config.tokens_per_block {block} is not a power of two, which "
                        "TensorRT-LLM's KV cache requires; search scheduler.block_size over powers of two")


def _tgi(policy: Policy) -> tuple[dict, list[str]]:
    s = policy.config.scheduler
    keys = {
        "--max-batch-size": _concurrency(s),
        "--max-batch-prefill-tokens": s.max_num_batched_tokens,
        # TGI sizes its KV cache in tokens: the simulated cache's usable ones.
        "--max-batch-total-tokens": _usable_kv_tokens(s),
        "--num-shard": policy.config.hardware.tp,
    }
    if s.max_num_queued_reqs is not None:
        # TGI's router holds a permit per request from arrival to its last token: waiting and running, the
        # requests the simulated limit counts.
        keys["--max-concurrent-requests"] = s.max_num_queued_reqs
    expressed = {"scheduler.max_num_seqs", "scheduler.batch_size", "scheduler.max_num_batched_tokens",
                 "scheduler.num_kv_blocks", "scheduler.block_size", "scheduler.max_num_queued_reqs", "hardware.tp"}
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
        # Weights as a {signal: weight} mapping too; null without a cluster. Replica groups as lists, as YAML holds
        # them.
        "cluster": None if config.cluster is None else json.loads(json.dumps({
            **dataclasses.asdict(config.cluster),
            "router_weights": None if config.cluster.router_weights is None else dict(config.cluster.router_weights)})),
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
    """The engine's file; ``caveats``: warnings about the policy itself, ahead of the engine's own. A cluster of
    replica groups exports the router's settings as the file and each group's engine file beside it
    (``_export_groups``), except to servetune's own policy file, which records the whole cluster."""
    if engine not in ENGINE_WRITERS:
        raise UserError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    if engine != "servetune" and _has_groups(policy.config):
        return _export_groups(policy, engine, file_name, caveats)
    if engine != "servetune":   # servetune's own file records what was simulated, whatever an engine accepts
        # Requests this long were simulated, which no engine serves on this model.
        check_max_model_len(engine, "scheduler.max_model_len", policy.config.scheduler.max_model_len,
                            policy.config)
    keys, warnings = ENGINE_WRITERS[engine](policy)
    companions = []
    if engine == "vllm":
        router_config, router_warnings = llm_d_router(policy.config)
        warnings += router_warnings
        if router_config is not None:
            companions.append((".llm-d-epp.yaml", router_config))
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
    return Exported(comments + body, tuple(warnings), tuple(companions))


def _num(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"


# ---------------------------------------------------------------------------------------------------------
# Replica groups: no engine starts a pool of mixed engines from one file.

def group_file_suffix(group_name: str, file_name: str) -> str:
    """The suffix that replaces ``file_name``'s last one for a group's engine file: x.vllm.yaml ->
    x.vllm.<group>.yaml (group names are file-name safe: letters, digits, '.', '_' and '-')."""
    return f".{group_name}{Path(file_name).suffix}"


def _export_groups(policy: Policy, engine: str, file_name: str, caveats: tuple[str, ...]) -> Exported:
    """One engine file per replica group (a single engine's export of the group's own sections, named by the
    group), and as the file itself the router's settings: the router, its weights and delay, and each group's
    replicas, GPUs and file. vLLM's data-parallel balancer runs engines of one configuration, so no group gets
    data-parallel-size; for vLLM a least_outstanding router is also written as llm-d's EndpointPickerConfig."""
    from servetune.pipeline import replica_engines

    config, cluster = policy.config, policy.config.cluster
    companions, warnings, groups = [], list(caveats), []
    for group in replica_engines(config):
        given = group.config.scheduler.num_kv_blocks != _derived_kv_blocks(group.config)
        exported = export(Policy(group.config, given, provenance=policy.provenance), engine,
                          str(Path(file_name).with_suffix(group_file_suffix(group.name, file_name))))
        suffix = group_file_suffix(group.name, file_name)
        companions.append((suffix, exported.text))
        warnings += [f"replica group {group.name}: {warning}" for warning in exported.warnings]
        groups.append({"name": group.name, "replicas": group.count, "gpu": group.config.hardware.gpu_name,
                       "tp": group.config.hardware.tp, "cost_model": group.config.cost_model.kind,
                       "engine_file": str(Path(file_name).with_suffix(suffix))})
    router = {"router": cluster.router, "router_weights": None if cluster.router_weights is None
              else dict(cluster.router_weights), "signal_delay_s": cluster.signal_delay_s}
    if engine == "vllm":
        router_config, router_warnings = llm_d_router(config)
        warnings += router_warnings
        if router_config is not None:
            companions.append((".llm-d-epp.yaml", router_config))
        behind = ("llm-d's inference scheduler with the EndpointPickerConfig beside this file" if router_config
                  else f"a {cluster.router} router of your own")
        warnings.append(f"vllm: its data-parallel load balancer runs engines of one configuration, so it cannot "
                        f"balance over replica groups: start each group's replicas as engines of its file (without "
                        f"data-parallel-size) behind {behind}")
    else:
        warnings += [f"{engine} cannot express cluster.{key}={show_yaml(value, quote_text=False)}: it has no router "
                     "over engines; start each group's replicas behind one" for key, value in router.items()
                     if not (f"cluster.{key}" in NEUTRAL and NEUTRAL[f"cluster.{key}"] == value)]
    header = [f"servetune export for {engine}: the router's settings over {cluster.num_replicas} replicas in "
              f"{len(groups)} replica groups; each group's engine file is beside this one "
              f"({USAGE[engine].format(file='ENGINE_FILE')})"]
    if policy.provenance:
        p = policy.provenance
        origin = (f"RL policy {p['policy']}" if "policy" in p else f"study {p.get('study')} trial {p.get('trial')}")
        header.append(f"from {origin} (config {p.get('config_source')}, hash {p.get('config_hash')})")
    if policy.predicted:
        m = policy.predicted
        header.append(f"predicted for the cluster: goodput {_num(m.get('request_goodput'))} req/s, SLO attainment "
                      f"{_num(m.get('slo_attainment'))}, p99 TTFT {_num(m.get('p99_ttft_ms'))} ms")
    header += [f"warning: {w}" for w in warnings]
    body = yaml.safe_dump({**router, "replica_groups": groups}, sort_keys=False, default_flow_style=False)
    return Exported("".join(f"# {line}\n" for line in header) + body, tuple(warnings), tuple(companions))
