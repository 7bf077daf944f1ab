"""The simulation config: plain frozen dataclasses mirroring the YAML sections, each field's type, range
(``Field(ge=..., le=...)``) and choices (``Literal``) written beside it.

Knob names follow vLLM's flags so that exported configs are obvious. ``servetune.config_loader`` validates a
file against these classes with pydantic (unknown keys refused, every bad field reported at once) and adds the
rules that relate fields; everything downstream receives an already-valid ``Config``. The classes stay stdlib
dataclasses: building or ``dataclasses.replace``-ing one validates nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional

from pydantic import ConfigDict, Field, Strict

# ---------------------------------------------------------------------------------------------------------
# What the engine's numbers hold (envs/sim/engine.py). Token and block counts are int32 and the engine adds them up
# (a request's tokens and its blocks, a step's budget, the contexts of a batch, a tenant's service over a run);
# times are float32, the clock and arrivals a float32 pair good to about t / 2^48. The config loader and the
# trace readers refuse anything beyond these bounds, so no sum wraps and the clock keeps its resolution.

MAX_TOKEN_COUNT = 2**24        # one request's prompt or output tokens, and max_model_len (16.8M: a 10M-token
                               # context fits): a request, a step's budget and a block's rounding stay below 2^26
MAX_KV_TOKENS = 2**28          # num_kv_blocks * block_size: the cache bounds every sum of contexts the engine forms
MAX_NUM_SEQS = 2**16           # running requests, and static batches (the slot table is the power of two above)
MAX_NUM_REQUESTS = 10**7       # requests in a workload, and the counts derived from them (queue limits, bursts)
# A workload's prompt and output tokens in all: the engine counts a tenant's service (a decode token counts
# twice) in int32 against a sentinel of 2^30 (engine.NO_LIMIT), which leaves room to recompute every token once.
MAX_WORKLOAD_TOKENS = 2**28
MAX_CLOCK_S = 1e8              # seconds of simulated time (3 years; a week-long trace is 6e5): the clock's pair
                               # then resolves 0.4 us
MAX_RATE = 1e6                 # requests per second
MIN_RATE = 1e-6                # requests per second, and the smallest rate or time scale: below it nothing arrives
                               # within MAX_CLOCK_S
MAX_SCALE = 1e6                # rate_scale and time_scale
MAX_SEED = 2**32 - 1           # NumPy's and Optuna's seeds are 32-bit

# ---------------------------------------------------------------------------------------------------------
# Field types. Values are taken as written, never coerced: `true` is no count, '12' no number, 1.5 no integer;
# an integer widens to a float. VALIDATION (the roots' pydantic config, which the sections inherit) refuses
# unknown keys, NaN and infinities.

VALIDATION = ConfigDict(extra="forbid", allow_inf_nan=False)
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), Field(pattern=r"\S")]      # not empty or blank

# The ranges many fields share: the engine's bounds above, so that no count wraps and the clock keeps its resolution.
TokenCount = Annotated[Int, Field(ge=1, le=MAX_TOKEN_COUNT)]
ModelLen = Annotated[Int, Field(ge=2, le=MAX_TOKEN_COUNT)]   # a prompt token and an output token
Requests = Annotated[Int, Field(ge=1, le=MAX_NUM_REQUESTS)]
Seed = Annotated[Int, Field(ge=0, le=MAX_SEED)]            # NumPy's default_rng takes no negative seeds
Seconds = Annotated[Float, Field(gt=0, le=MAX_CLOCK_S)]
SecondsOrZero = Annotated[Float, Field(ge=0, le=MAX_CLOCK_S)]
Milliseconds = Annotated[Float, Field(gt=0, le=MAX_CLOCK_S * 1000)]
Rate = Annotated[Float, Field(ge=MIN_RATE, le=MAX_RATE)]
Scale = Annotated[Float, Field(ge=MIN_RATE, le=MAX_SCALE)]
Fraction = Annotated[Float, Field(gt=0, le=1)]
LogSpread = Annotated[Float, Field(ge=0, le=20)]   # a log-normal spread of e^20 per sigma spans every length there is
# vLLM's --request-rate and --burstiness, whose `inf` means something (every request at 0; gaps of exactly
# 1/rate): infinity is allowed, NaN fails the bound. The loader keeps a finite request_rate within MAX_RATE.
RateOrInf = Annotated[Float, Field(ge=MIN_RATE, allow_inf_nan=True, description=(
    f"a number in [{MIN_RATE:g}, {MAX_RATE:g}], or .inf (every request at 0) or null (vLLM's default, .inf)"))]
Burstiness = Annotated[Float, Field(ge=1e-6, allow_inf_nan=True, description=(
    "a number ≥ 1e-06 (the gamma shape of the gaps; 1 is Poisson), or .inf (gaps of exactly 1/rate) or null "
    "(vLLM's default, 1.0)"))]   # as gamma's cv ≤ 1e3: shape ≥ 1e-6


# The numbers of a GPU of the user's own. The bounds leave room far beyond the catalogue's largest (192 GiB on the
# MI300X; 8 TB/s and 4.5 dense PFLOP/s of FP8 on the B200, cost_models/gpus.py) while keeping a step's time a
# float32 number of seconds well inside the simulated clock.
GpuMemoryGib = Annotated[Float, Field(ge=1, le=2**16)]
GpuTeraRate = Annotated[Float, Field(ge=0.1, le=1e6)]   # TFLOP/s or TOP/s
GpuGigaBytesPerS = Annotated[Float, Field(ge=1, le=1e6)]
LowPrecisionRate = Optional[Annotated[Float, Field(ge=0.1, le=1e6, description=(
    "a number in [0.1, 1e+06], or null for a GPU without such tensor cores"))]]
GpuName = Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description=(
    "a name of at most 64 letters, digits, '.', '_' and '-', starting with a letter or digit, such as my-gpu"))]


@dataclass(frozen=True)
class GpuDefinition:
    """``hardware.gpu`` as a mapping, or the YAML/JSON file holding one: a GPU the catalogue lacks, in the units
    and under the names ``servetune gpus --json`` prints. Rates are dense tensor-core peaks (a datasheet's
    2:4-sparsity figure halved); ``interconnect_gb_per_s`` is one GPU's link bandwidth in both directions
    together, as datasheets quote NVLink. Every number is required; fp8_tflops and int8_tops take null for a GPU
    without such tensor cores (its FP8/INT8 matmuls then run at the BF16 rate)."""
    __pydantic_config__ = VALIDATION
    name: GpuName
    memory_gib: GpuMemoryGib                 # device memory, GiB
    memory_gb_per_s: GpuGigaBytesPerS        # HBM/GDDR bandwidth, GB/s (10^9 bytes)
    bf16_tflops: GpuTeraRate                 # dense BF16/FP16 tensor TFLOP/s
    fp8_tflops: LowPrecisionRate             # dense FP8 tensor TFLOP/s
    int8_tops: LowPrecisionRate              # dense INT8 tensor TOP/s
    interconnect_gb_per_s: GpuGigaBytesPerS  # per-GPU bidirectional link bandwidth (NVLink, else PCIe), GB/s
    description: Optional[Text] = None       # what it is and where its numbers come from (null: the name)


@dataclass(frozen=True)
class HardwareConfig:
    # A catalogue name (`servetune gpus`), the path of a YAML or JSON file holding a GpuDefinition (relative to the
    # config's folder), or a GpuDefinition's mapping; the loader turns a file or a mapping into a GpuDefinition.
    gpu: Annotated[Any, Field(description=(
        "a catalogue GPU name (servetune gpus), the path of a .yaml/.yml/.json file defining a GPU, or a mapping "
        "{name, memory_gib, memory_gb_per_s, bf16_tflops, fp8_tflops, int8_tops, interconnect_gb_per_s}"
    ))] = "a100-80gb"
    tp: Annotated[Int, Field(ge=1, le=1024)] = 1
    # vLLM's --enable-expert-parallel: an MoE model's GPUs hold whole experts, ceil(experts / tp) on the fullest,
    # instead of a 1/tp slice of every expert (cost_models/sharding.py); refused for a model without experts
    enable_expert_parallel: Bool = False
    gpu_memory_utilization: Fraction = 0.92   # fraction of GPU memory the engine may use (vLLM's flag)

    @property
    def gpu_name(self) -> str:
        """The GPU as messages name it: the catalogue name as written, or a defined GPU's own name."""
        return self.gpu.name if isinstance(self.gpu, GpuDefinition) else str(self.gpu)


@dataclass(frozen=True)
class CostModelConfig:
    # Left out of a file: calibrated, with the shipped profile measured on the config's GPU, when there is one;
    # else the roofline on the GPU's datasheet (servetune.config_loader). Linear only when asked for. This value is
    # the default GPU's, the A100-80GB's.
    kind: Literal["linear", "roofline", "calibrated"] = "calibrated"
    # calibrated: path of a fitted profile JSON, or a shipped profile's file name; null: the one shipped for the
    # config's GPU (`servetune gpus` says which GPUs have one)
    profile: Optional[Text] = None
    # calibrated: a profile measured on another GPU than the config's is refused unless this is true, and then
    # used with a warning that names both
    allow_other_gpu: Bool = False
    # A step costs at most an hour, and a token or a context token a second: far beyond any GPU, within float32.
    base_s: Annotated[Float, Field(ge=0, le=3600)] = 0.010
    per_token_s: Annotated[Float, Field(ge=0, le=1)] = 0.00003
    per_context_token_s: Annotated[Float, Field(ge=0, le=1)] = 0.0000002


@dataclass(frozen=True)
class ArrivalsConfig:
    kind: Literal["poisson", "gamma", "onoff", "piecewise", "servegen", "trace", "vllm"] = "poisson"
    rate: Optional[Rate] = 4.0       # poisson, gamma: requests per second; onoff: the rate while on
    # gamma: coefficient of variation of the gaps (1 is Poisson; > 1 bursty)
    cv: Optional[Annotated[Float, Field(ge=1e-3, le=1e3)]] = None
    on_s: Optional[Seconds] = None   # onoff: seconds of arrivals at `rate` ...
    off_s: Optional[SecondsOrZero] = None   # ... then seconds of silence, repeating
    profile: Any = None              # piecewise: [[start_s, rate], ...], each rate held until the next start
    time_scale: Scale = 1.0          # piecewise, servegen: the profile plays this many times faster
    path: Optional[Text] = None      # trace, servegen: file path, relative to the config file's folder
    format: Optional[Literal["azure", "processed", "servetune", "mooncake"]] = None   # trace: TRACE_PARSERS
    # trace, instead of format: a CSV or JSONL log of the user's own, read through {timestamp: NAME,
    # prompt_tokens: NAME, output_tokens: NAME} (ColumnsConfig: its column or key names); timestamp_unit s, ms or iso8601
    # (auto: ISO 8601 when the first timestamp is a date-time, else seconds)
    columns: Any = None
    timestamp_unit: Literal["auto", "s", "ms", "iso8601"] = "auto"
    rate_scale: Scale = 1.0          # trace: 2.0 doubles the arrival rate; servegen: multiplies every rate
    window_start_s: SecondsOrZero = 0.0    # trace: replay from this second of the trace's clock ...
    window_s: Optional[Seconds] = None     # ... for this many seconds (null: to the end)
    jitter_s: SecondsOrZero = 0.0    # trace: spread each timestamp uniformly over [t, t + jitter_s)
    # vllm: `vllm bench serve`'s --request-rate (null: its default, .inf, every request at 0) and --burstiness
    # (null: its default 1.0, Poisson; the gamma shape of the gaps; .inf: gaps of exactly 1/rate)
    request_rate: Optional[RateOrInf] = None
    burstiness: Optional[Burstiness] = None
    # vllm: --ramp-up-strategy, --ramp-up-start-rps and --ramp-up-end-rps as {strategy, start_rps, end_rps}
    # (RampUpConfig; request_rate then left out): request i's rate moves from start to end
    ramp_up: Any = None
    # vllm: --max-concurrency (null: none): at most this many requests in flight; a request due while all are
    # is sent when one ends, completed or refused (vllm/benchmarks/serve.py's semaphore)
    max_concurrency: Optional[Annotated[Int, Field(ge=1, le=MAX_NUM_REQUESTS)]] = None


@dataclass(frozen=True)
class RampUpConfig:
    """``arrivals: {kind: vllm, ramp_up: ...}``: vLLM's ramp-up (vllm/benchmarks/serve.py:406-428, 2077-2094)."""
    __pydantic_config__ = VALIDATION
    strategy: Literal["linear", "exponential"]
    start_rps: Rate
    end_rps: Rate


@dataclass(frozen=True)
class ColumnsConfig:
    """``arrivals: {kind: trace, columns: ...}``: the column (CSV header) or key (JSONL) names of a user's own
    request log (envs/workload/traces.py, load_column_trace)."""
    __pydantic_config__ = VALIDATION
    timestamp: Text
    prompt_tokens: Text
    output_tokens: Text


@dataclass(frozen=True)
class RangeRatioConfig:
    """``lengths: {kind: dataset, name: random, range_ratio: {input, output}}``: vLLM's per-side range ratios
    (vllm/benchmarks/datasets/utils.py:19-36)."""
    __pydantic_config__ = VALIDATION
    input: Annotated[Float, Field(ge=0, lt=1)]
    output: Annotated[Float, Field(ge=0, lt=1)]


@dataclass(frozen=True)
class LengthsConfig:
    kind: Literal["fixed", "uniform", "geometric", "lognormal", "empirical", "trace", "dataset"] = "fixed"
    prompt_tokens: Any = 512         # fixed: int; uniform: [low, high] inclusive; geometric: the mean;
    output_tokens: Any = 128         # lognormal: {median: m, sigma: s} (LognormalConfig); empirical, trace,
                                     # dataset: unused
    path: Optional[Text] = None      # empirical: a CSV with num_prefill_tokens,num_decode_tokens columns; dataset
                                     # sharegpt, burstgpt, custom: the dataset file (envs/workload/datasets.py)
    # dataset: the `vllm bench serve --dataset-name` whose lengths these are, read as vLLM reads them
    name: Literal["random", "sharegpt", "burstgpt", "custom"] = "random"   # vLLM's default --dataset-name
    input_len: Optional[TokenCount] = None     # random: --random-input-len (null: vLLM's 1024)
    output_len: Optional[TokenCount] = None    # random: --random-output-len (null: 128); sharegpt, custom: every
                                               # request's output (null: the dataset's own)
    range_ratio: Any = None          # random: --random-range-ratio, a number in [0, 1) or {input: r, output: r}
                                     # (RangeRatioConfig)
    tokenizer: Optional[Text] = None   # random, sharegpt, custom: a local Hugging Face tokenizer folder that
                                       # counts tokens (null, or neither tokenizers nor transformers installed:
                                       # estimated from characters; envs/workload/datasets.py)


@dataclass(frozen=True)
class LognormalConfig:
    """One side of ``lengths: {kind: lognormal}``, as written: the loader makes it envs/workload/lengths.py's
    ``LognormalSpec``, ``round(median · exp(sigma · Z))``."""
    __pydantic_config__ = VALIDATION
    median: Annotated[Float, Field(ge=1, le=MAX_TOKEN_COUNT)]
    sigma: LogSpread


@dataclass(frozen=True)
class TenantConfig:
    """One tenant (or request class) of a generated workload."""
    name: Text = "default"
    share: Annotated[Float, Field(gt=0, le=1e6)] = 1.0   # its fraction of the arrivals (shares are normalised)
    arrivals: Optional[ArrivalsConfig] = None  # its own arrival process (a client with its own day); set it
                                     # for every tenant or none: the streams merge, and share is unused
    # lower is served first by the priority order; the trace readers' int32 range
    priority: Annotated[Int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    lengths: Optional[LengthsConfig] = None   # null: the workload's lengths
    slo: Optional[SloConfig] = None           # null: the config's slo; a class SLO sets edf deadlines
    # its requests start with one of `prefix_groups` shared prefixes of `prefix_tokens` (a system prompt, a document)
    prefix_tokens: Annotated[Int, Field(ge=0, le=MAX_TOKEN_COUNT - 1)] = 0
    prefix_groups: Requests = 1
    max_rate: Optional[Rate] = None  # admission: a token bucket refilling at this many requests/s ...
    max_burst: Requests = 1          # ... holding this many; an arrival finding it empty is rejected


@dataclass(frozen=True)
class SessionsConfig:
    """Closed-loop agent sessions: the arrival process starts sessions; each next call of a session arrives
    ``think_s`` after the previous call finished (or was rejected)."""
    calls: Requests = 2              # calls per session; num_requests counts calls and is a multiple of it
    think_s: Any = 1.0               # the tool's time between calls: a number > 0, or [low, high] drawn uniformly
    history: Bool = False            # each call's prompt also carries the session's earlier prompts and answers


@dataclass(frozen=True)
class WorkloadConfig:
    arrivals: ArrivalsConfig = field(default_factory=ArrivalsConfig)
    lengths: Optional[LengthsConfig] = field(default_factory=LengthsConfig)
    num_requests: Optional[Requests] = 2000
    seed: Seed = 0
    max_model_len: Optional[ModelLen] = None   # prompt + output cut to this many tokens; cuts are counted
    # null: one tenant. A field's description, when it has one, is what the loader says a bad value should be.
    tenants: Optional[Annotated[tuple[TenantConfig, ...], Field(min_length=1, description=(
        "a non-empty list of tenants, such as [{name: chat, share: 0.8}, {name: batch, share: 0.2}]"))]] = None
    sessions: Optional[SessionsConfig] = None   # null: open-loop arrivals, every request on its own

    @property
    def tenant_arrivals(self) -> bool:
        """Whether each tenant brings its own arrival process (``workload.arrivals`` then unused)."""
        return bool(self.tenants) and all(tenant.arrivals is not None for tenant in self.tenants)


@dataclass(frozen=True)
class SchedulerConfig:
    policy: Literal["continuous", "static"] = "continuous"
    # Left out of a file, these two are vLLM 0.33's for the config's GPU (servetune/vllm_defaults.py); these values
    # are its A100's, the default GPU's.
    max_num_seqs: Annotated[Int, Field(ge=1, le=MAX_NUM_SEQS)] = 256
    max_num_batched_tokens: TokenCount = 2048
    enable_chunked_prefill: Bool = True
    long_prefill_token_threshold: Annotated[Int, Field(ge=0, le=MAX_TOKEN_COUNT)] = 0
    block_size: TokenCount = 16
    # vLLM's num_gpu_blocks (block 0 is its null block, so one fewer usable); null: derived from the model, GPU,
    # TP and gpu_memory_utilization
    num_kv_blocks: Optional[Annotated[Int, Field(ge=1, le=MAX_KV_TOKENS)]] = None
    watermark: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    # vLLM's API server refuses arrivals beyond this many unfinished
    max_num_queued_reqs: Optional[Annotated[Int, Field(ge=0, le=MAX_NUM_REQUESTS)]] = None
    max_model_len: Optional[ModelLen] = None   # prompts this long are refused at arrival, outputs cut to fit; null:
                                           # the workload's, else the model's context, else what the KV holds
    async_scheduling: Optional[Bool] = None  # null: vLLM 0.33's default, on for continuous batching
    reserve_full_prompt: Bool = True       # vLLM's scheduler_reserve_full_isl: admit only if the whole prompt fits
    batch_size: Annotated[Int, Field(ge=1, le=MAX_NUM_SEQS)] = 32   # static only
    max_wait_s: SecondsOrZero = 1.0  # static only
    queue_order: Literal["fcfs", "priority", "sjf", "fair", "edf", "weighted"] = "fcfs"
    priority_weights: Any = None     # weighted: {feature: weight} over the features in envs/sim/queue_order.py
    length_prediction_noise: LogSpread = 0.0   # sjf: sigma of the predictor's log error (0: the true length)
    enable_prefix_caching: Bool = True    # vLLM 0.33's default (vllm/config/cache.py)
    # Tokens every layer attends to (vLLM's CacheConfig.sliding_window, set when all of the model's layers slide:
    # one SlidingWindowSpec group whose blocks behind the window are freed); 0: full attention. Unset, it is
    # filled from the model when the config resolves (servetune.pipeline.fill_derived); a value set by hand must
    # be the model's.
    sliding_window: Optional[Annotated[Int, Field(ge=0, le=MAX_TOKEN_COUNT)]] = None

    @property
    def usable_kv_blocks(self) -> int:
        """Blocks requests can hold: vLLM's block pool keeps block 0 back as its null block
        (vllm/v1/core/block_pool.py). Only on a resolved config (servetune.pipeline.resolve), whose
        num_kv_blocks is a number."""
        if self.num_kv_blocks is None:
            raise ValueError("scheduler.num_kv_blocks is derived when the config resolves; resolve it first")
        return self.num_kv_blocks - 1

    @property
    def model_len_limit(self) -> int:
        """The longest request (prompt + output tokens) the engine accepts: ``max_model_len``, or when unset
        the most the KV cache holds -- vLLM refuses to start with a max_model_len its cache cannot hold."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.usable_kv_blocks * self.block_size

    def vllm_refusal(self) -> Optional[str]:
        """Why vLLM 0.33 would refuse to start with these knobs (vllm/config/scheduler.py,
        verify_max_model_len; vllm/v1/core/kv_cache_utils.py for the cache), or None."""
        model_len = self.model_len_limit
        if self.max_num_batched_tokens < self.max_num_seqs:
            return (f"scheduler.max_num_batched_tokens: {self.max_num_batched_tokens} is below max_num_seqs "
                    f"{self.max_num_seqs}; vLLM requires max_num_batched_tokens >= max_num_seqs")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < model_len:
            return (f"scheduler.max_num_batched_tokens: {self.max_num_batched_tokens} is below max_model_len "
                    f"{model_len} with chunked prefill off; vLLM requires max_num_batched_tokens >= max_model_len "
                    f"unless enable_chunked_prefill is true")
        if self.long_prefill_token_threshold > model_len:
            return (f"scheduler.long_prefill_token_threshold: {self.long_prefill_token_threshold} is above "
                    f"max_model_len {model_len}; vLLM requires long_prefill_token_threshold <= max_model_len")
        # With a window a request holds at most admission_blocks_cap blocks, and vLLM's start-up check asks for
        # that many (SlidingWindowSpec.max_memory_usage_bytes, vllm/v1/kv_cache_interface.py:946-955, checked by
        # check_enough_kv_cache_memory, vllm/v1/core/kv_cache_planning.py:151-180).
        needed = self.admission_blocks_cap or -(-model_len // self.block_size)
        if needed > self.usable_kv_blocks:
            held = (f"tokens under the {self.window}-token sliding window hold up to" if self.window else
                    "tokens need")
            return (f"scheduler.max_model_len: {model_len} {held} {needed} KV blocks of {self.block_size}, but "
                    f"num_kv_blocks {self.num_kv_blocks} leaves {self.usable_kv_blocks} usable (one is vLLM's null "
                    f"block); vLLM refuses to start when the KV cache cannot hold max_model_len")
        return None

    @property
    def window(self) -> int:
        """The sliding window in tokens, 0 for full attention (also on a config not yet resolved)."""
        return self.sliding_window or 0

    def skipped_blocks(self, processed_tokens: int) -> int:
        """Leading blocks wholly behind the window of the next token once ``processed_tokens`` are computed:
        vLLM's ``SlidingWindowManager.get_num_skipped_tokens`` (max(0, computed - window + 1), in
        vllm/v1/core/single_type_kv_cache_manager.py:1148-1183) in whole blocks (``remove_skipped_blocks``,
        :682-720). 0 under full attention."""
        if not self.window:
            return 0
        return max(0, processed_tokens - self.window + 1) // self.block_size

    @property
    def admission_blocks_cap(self) -> Optional[int]:
        """With a sliding window, the most blocks the whole-prompt admission check asks for:
        ``SlidingWindowSpec.max_admission_blocks_per_request`` (vllm/v1/kv_cache_interface.py:918-944), the window
        less one plus every batch in flight's token budget (``VllmConfig.max_in_flight_tokens``,
        vllm/config/vllm.py:601-609), at most max_model_len, in blocks plus one; applied by
        ``get_num_blocks_to_allocate`` (single_type_kv_cache_manager.py:214-227) only for that check
        (kv_cache_manager.py:531-548). None under full attention."""
        if not self.window:
            return None
        in_flight = (2 if self.pipelined else 1) * self.max_num_batched_tokens
        return -(-min(self.window - 1 + in_flight, self.model_len_limit) // self.block_size) + 1

    @property
    def pipelined(self) -> bool:
        """Async scheduling: step k + 1 is scheduled while step k runs (vLLM 0.33's default). Static
        batching, which no vLLM engine runs, is always synchronous."""
        if self.policy == "static":
            return False
        return True if self.async_scheduling is None else self.async_scheduling


@dataclass(frozen=True)
class SloConfig:
    ttft_ms: Optional[Milliseconds] = None
    itl_ms: Optional[Milliseconds] = None
    tpot_ms: Optional[Milliseconds] = None
    e2el_ms: Optional[Milliseconds] = None
    attainment_target: Fraction = 0.9


# The routers a cluster's requests pass through (envs/sim/cluster.py), and the replica signals the weighted router
# scores: its score is w_queue queue + w_running running + w_kv kv_utilization + w_outstanding outstanding
# - w_prefix_hit prefix_hit (the hit subtracted, so that every positive weight says "prefer less load, more cached
# prompt"); the lowest score wins. queue, running and kv_utilization are the replica's metrics as of its last
# completed step; outstanding (requests sent and not finished) and prefix_hit are the router's own reckoning.
ROUTERS = ("round_robin", "random", "least_outstanding", "least_kv", "power_of_two", "prefix_affinity", "weighted")
ROUTER_FEATURES = ("queue", "running", "kv_utilization", "prefix_hit", "outstanding")
# The routers that decide from the workload and their own draws alone, before the run.
STATE_FREE_ROUTERS = ("round_robin", "random", "prefix_affinity")


GroupName = Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description=(
    "a name of at most 64 letters, digits, '.', '_' and '-', starting with a letter or digit, such as h100-pool"))]


@dataclass(frozen=True)
class ReplicaGroupConfig:
    """One item of ``cluster.replicas`` as a list: ``count`` replicas of one engine, each on ``hardware`` with
    ``cost_model`` and ``scheduler``. A section left out is the config's top-level one; a section given is
    merged over it key by key (a cost_model of another kind starts from that kind's defaults instead: the
    top-level one's coefficients or profile are not its own). The loader fills every section and the name, so a
    loaded group holds the engine it simulates."""
    __pydantic_config__ = VALIDATION
    # `count`, not `replicas`: the group is already an item of cluster.replicas, and cluster.replicas[1].count
    # reads as what it is, how many replicas of this group
    count: Annotated[Int, Field(ge=1, le=4096)]
    # names the group in run.json, the console and exported file names; null: its GPU's name (with `-<index>`
    # when groups share a GPU)
    name: Optional[GroupName] = None
    hardware: Any = None             # a mapping merged over the top-level hardware (HardwareConfig once loaded)
    cost_model: Any = None           # ... over the top-level cost_model (CostModelConfig once loaded)
    scheduler: Any = None            # ... over the top-level scheduler (SchedulerConfig once loaded)


@dataclass(frozen=True)
class ClusterConfig:
    """Replicas of the engine behind one router: ``replicas`` identical ones, each running the config's
    ``scheduler`` on its ``hardware``, or a list of replica groups (ReplicaGroupConfig), each its own engine."""
    # a number of identical replicas, or a list of replica groups (a tuple of ReplicaGroupConfig once loaded)
    replicas: Annotated[Any, Field(description=(
        "a number of replicas, 1 to 4096, or a list of replica groups "
        "[{count, name, hardware, cost_model, scheduler}, ...]"))] = 1
    router: Literal[ROUTERS] = "round_robin"
    # weighted: {feature: weight} over ROUTER_FEATURES; a replica's score is the weighted sum of its load signals
    # less the weighted prefix_hit, the lowest score taking the request
    router_weights: Any = None
    # the router sees each replica's load as of its last report, every signal_delay_s seconds (0: as it is)
    signal_delay_s: SecondsOrZero = 0.0
    seed: Seed = 0                   # random and power_of_two: the router's draws

    @property
    def has_groups(self) -> bool:
        """Whether ``replicas`` is a list of replica groups (even a list of one)."""
        return isinstance(self.replicas, tuple)

    @property
    def num_replicas(self) -> int:
        """Replicas in all: ``replicas``, or the groups' counts summed."""
        return sum(group.count for group in self.replicas) if self.has_groups else self.replicas


@dataclass(frozen=True)
class SimulationConfig:
    horizon_s: Optional[Seconds] = None  # stop the clock here; requests still in flight are unfinished


@dataclass(frozen=True)
class KnobConfig:
    """One searched knob: a range (``low``..``high``, optionally on a log scale or in steps) or ``choices``."""
    __pydantic_config__ = VALIDATION
    low: Any = None                  # low, high, step: numbers of the knob's own type (int or float)
    high: Any = None
    log: Bool = False
    step: Any = None
    choices: Any = None              # a list of values; the loader keeps it as a tuple


@dataclass(frozen=True)
class SearchConfig:
    """What ``servetune tune`` searches and how; the command line overrides any of it."""
    knobs: Any = None                # {scheduler.max_num_seqs: {low: 1, high: 512, log: true}, ...}; null: defaults
                                     # per policy (search/study/space.py); kept as a tuple of (key, KnobConfig) pairs
    objectives: Any = ("goodput",)   # any of goodput, p99_ttft, p99_itl, gpus
    sampler: Literal["tpe", "cmaes", "nsga2", "gp", "random", "grid"] = "tpe"
    trials: Requests = 100
    batch_size: Annotated[Int, Field(ge=1, le=4096)] = 8   # trials simulated together in one vmapped call
    seed: Seed = 0                   # the sampler's seed: the same seed gives the same study
    workload_seeds: Any = None       # [0, 1, 2]: every trial runs each seed, reports the mean and keeps the spread
    scenarios: Any = None            # [{workload.arrivals.rate: 6.0}, ...]: every trial runs each variant of the config
    aggregate: Literal["mean", "worst"] = "mean"   # how the scenarios' results combine
    baselines: Bool = True           # enqueue vLLM's default and well-known settings as the first trials


# The integer scheduler knobs the environments' action sets, in action order (envs/gym/actions.py).
STEERABLE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "max_num_queued_reqs")


@dataclass(frozen=True)
class RlConfig:
    """What ``servetune train-rl`` trains on and how; the command line overrides timesteps, num_envs and seed.

    The first five fields are ServeControl-v0's options (envs/gym/adapters.py), so that a trained policy and the
    environment it is evaluated in see the same world; then the learner: ``algo``, the network and what it
    reads, PPO's fields (search/rl/ppo.py) and the evolution strategy's (``es_*``, search/rl/es.py).
    """
    interval_s: Annotated[Float, Field(ge=1e-3, le=MAX_CLOCK_S)] = 1.0   # simulated seconds between decisions
    episode_s: Optional[Seconds] = None  # null: simulation.horizon_s (with neither, until every request is served)
    # workload variants trained on: seeds seed, seed + 1, ... (or trace windows)
    num_workloads: Annotated[Int, Field(ge=1, le=4096)] = 8
    # reward = good - miss_penalty * (late + rejected), per interval
    miss_penalty: Annotated[Float, Field(ge=0, le=1e6)] = 1.0
    bounds: Any = None               # {max_num_seqs: [1, 64], ...}: the action's knob ranges (envs/gym/actions.py)
    algo: Literal["ppo", "es"] = "ppo"   # ppo | es (evolution strategies over the policy's weights)
    features: Any = None             # observation names the policy reads (null: all of them)
    timesteps: Annotated[Int, Field(ge=1, le=10**12)] = 2_000_000   # environment steps (control intervals) in all
    num_envs: Annotated[Int, Field(ge=1, le=2**16)] = 256   # environments stepped together (vmapped)
    num_steps: Annotated[Int, Field(ge=1, le=2**16)] = 64   # steps per environment per update (the rollout)
    update_epochs: Annotated[Int, Field(ge=1, le=10**4)] = 4
    num_minibatches: Annotated[Int, Field(ge=1, le=2**20)] = 8
    learning_rate: Fraction = 3e-4
    anneal_lr: Bool = True           # linearly to 0 over the run
    gamma: Annotated[Float, Field(ge=0, le=1)] = 0.99
    gae_lambda: Annotated[Float, Field(ge=0, le=1)] = 0.95
    clip_eps: Annotated[Float, Field(gt=0, le=10)] = 0.2
    ent_coef: Annotated[Float, Field(ge=0, le=1e3)] = 0.0
    vf_coef: Annotated[Float, Field(ge=0, le=1e3)] = 0.5
    max_grad_norm: Annotated[Float, Field(gt=0, le=1e6)] = 0.5
    hidden: Any = (64, 64)           # widths of the actor's and the critic's hidden layers
    # the first policy's log spread in action units (Stable-Baselines3's name); lower keeps early samples near a
    # tuned config's knobs; e^log_std must stay a float32 number above 0
    log_std_init: Annotated[Float, Field(ge=-20, le=5)] = -0.5
    # es: perturbations per generation, in antithetic pairs (even), and their standard deviation in weight units
    es_population: Annotated[Int, Field(ge=2, le=2**16)] = 32
    es_sigma: Annotated[Float, Field(gt=0, le=1e3)] = 0.05
    es_learning_rate: Fraction = 0.03   # es: Adam's step on the weights
    es_days: Annotated[Int, Field(ge=1, le=4096)] = 4   # es: training workloads every candidate of a generation plays
    seed: Seed = 0                   # network initialisation and action sampling
    checkpoint_every: Annotated[Int, Field(ge=1, le=10**9)] = 10   # updates between checkpoints


@dataclass(frozen=True)
class Config:
    __pydantic_config__ = VALIDATION   # the sections inherit it
    model: Text = "llama-2-7b"
    # vLLM's --quantization: null reads it from the model's config.json (quantization_config); fp8 quantises a
    # BF16 checkpoint on loading; awq and gptq stand for a 4-bit AWQ/GPTQ checkpoint of the model; compressed-tensors
    # and mxfp4 only restate a config.json's (cost_models/models.py, QUANTIZATION_PRESETS)
    quantization: Optional[Literal["fp8", "awq", "gptq", "compressed-tensors", "mxfp4"]] = None
    # vLLM's --kv-cache-dtype: auto is the model's dtype (FP8 where a compressed-tensors checkpoint says so); the
    # fp8 ones store a byte per value
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    cluster: Optional[ClusterConfig] = None   # null: one engine, no router
    search: SearchConfig = field(default_factory=SearchConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    source: Optional[str] = field(default=None, compare=False)  # file the config came from, for messages
    # The values the loader filled in because the file left them out, as (key, value, where the value comes from),
    # and what it warns of: said to the user (servetune simulate prints them), never part of the problem.
    defaulted: tuple = field(default=(), compare=False)
    warnings: tuple = field(default=(), compare=False)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for name in LOADER_NOTES:
            data.pop(name)
        return data


# Config's fields that say how it was loaded, not what it describes.
LOADER_NOTES = ("source", "defaulted", "warnings")
