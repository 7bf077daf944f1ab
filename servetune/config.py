"""The simulation config: plain frozen dataclasses mirroring the YAML sections.

Knob names follow vLLM's flags so that exported configs are obvious. Loading and validation live in
``servetune.config_loader``; everything downstream receives an already-valid ``Config``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

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


@dataclass(frozen=True)
class HardwareConfig:
    gpu: str = "a100-80gb"
    tp: int = 1
    gpu_memory_utilization: float = 0.92   # fraction of GPU memory the engine may use (vLLM's flag)


@dataclass(frozen=True)
class CostModelConfig:
    kind: str = "linear"             # linear | roofline | calibrated
    profile: Optional[str] = None    # calibrated: path of a fitted profile JSON
    base_s: float = 0.010
    per_token_s: float = 0.00003
    per_context_token_s: float = 0.0000002


@dataclass(frozen=True)
class ArrivalsConfig:
    kind: str = "poisson"            # poisson | gamma | onoff | piecewise | servegen | trace
    rate: Optional[float] = 4.0      # poisson, gamma: requests per second; onoff: the rate while on
    cv: Optional[float] = None       # gamma: coefficient of variation of the gaps (1 is Poisson; > 1 bursty)
    on_s: Optional[float] = None     # onoff: seconds of arrivals at `rate` ...
    off_s: Optional[float] = None    # ... then seconds of silence, repeating
    profile: Any = None              # piecewise: [[start_s, rate], ...], each rate held until the next start
    time_scale: float = 1.0          # piecewise, servegen: the profile plays this many times faster
    path: Optional[str] = None       # trace, servegen: file path, relative to the config file's folder
    format: Optional[str] = None     # trace: azure | mooncake | processed | servetune
    rate_scale: float = 1.0          # trace: 2.0 doubles the arrival rate; servegen: multiplies every rate
    window_start_s: float = 0.0      # trace: replay from this second of the trace's clock ...
    window_s: Optional[float] = None  # ... for this many seconds (null: to the end)
    jitter_s: float = 0.0            # trace: spread each timestamp uniformly over [t, t + jitter_s)


@dataclass(frozen=True)
class LengthsConfig:
    kind: str = "fixed"              # fixed | uniform | geometric | lognormal | empirical | trace
    prompt_tokens: Any = 512         # fixed: int; uniform: [low, high] inclusive; geometric: the mean;
    output_tokens: Any = 128         # lognormal: {median: m, sigma: s}; empirical, trace: unused
    path: Optional[str] = None       # empirical: a CSV with num_prefill_tokens,num_decode_tokens columns


@dataclass(frozen=True)
class TenantConfig:
    """One tenant (or request class) of a generated workload."""
    name: str = "default"
    share: float = 1.0               # its fraction of the arrivals (shares are normalised)
    arrivals: Optional[ArrivalsConfig] = None  # its own arrival process (a client with its own day); set it
                                     # for every tenant or none: the streams merge, and share is unused
    priority: int = 0                # lower is served first by the priority order
    lengths: Optional[LengthsConfig] = None   # null: the workload's lengths
    slo: Optional["SloConfig"] = None         # null: the config's slo; a class SLO sets edf deadlines
    prefix_tokens: int = 0           # its requests start with one of `prefix_groups` shared prefixes
    prefix_groups: int = 1           # of this many tokens (a system prompt, a RAG document)
    max_rate: Optional[float] = None  # admission: a token bucket refilling at this many requests/s ...
    max_burst: int = 1               # ... holding this many; an arrival finding it empty is rejected


@dataclass(frozen=True)
class SessionsConfig:
    """Closed-loop agent sessions: the arrival process starts sessions; each next call of a session arrives
    ``think_s`` after the previous call finished (or was rejected)."""
    calls: int = 2                   # calls per session; num_requests counts calls and is a multiple of it
    think_s: Any = 1.0               # the tool's time between calls: a number > 0, or [low, high] drawn uniformly
    history: bool = False            # each call's prompt also carries the session's earlier prompts and answers


@dataclass(frozen=True)
class WorkloadConfig:
    arrivals: ArrivalsConfig = field(default_factory=ArrivalsConfig)
    lengths: Optional[LengthsConfig] = field(default_factory=LengthsConfig)
    num_requests: Optional[int] = 2000
    seed: int = 0
    max_model_len: Optional[int] = None   # prompt + output cut to this many tokens; cuts are counted
    tenants: Any = None              # a list of TenantConfig mappings; null: one tenant
    sessions: Optional[SessionsConfig] = None   # null: open-loop arrivals, every request on its own

    @property
    def tenant_arrivals(self) -> bool:
        """Whether each tenant brings its own arrival process (``workload.arrivals`` then unused)."""
        return bool(self.tenants) and all(tenant.arrivals is not None for tenant in self.tenants)


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "continuous"       # continuous | static
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    num_kv_blocks: Optional[int] = None    # vLLM's num_gpu_blocks (block 0 is its null block, so one fewer usable);
                                           # null: derived from the model, GPU, TP and gpu_memory_utilization
    watermark: float = 0.0
    max_num_queued_reqs: Optional[int] = None   # vLLM's API server refuses arrivals beyond this many unfinished
    max_model_len: Optional[int] = None    # prompts this long are refused at arrival, outputs cut to fit; null:
                                           # the workload's, else the model's context, else what the KV holds
    async_scheduling: Optional[bool] = None  # null: vLLM 0.33's default, on for continuous batching
    reserve_full_prompt: bool = True       # vLLM's scheduler_reserve_full_isl: admit only if the whole prompt fits
    batch_size: int = 32             # static only
    max_wait_s: float = 1.0          # static only
    queue_order: str = "fcfs"        # fcfs | priority | sjf | fair | edf | weighted
    priority_weights: Any = None     # weighted: {feature: weight} over the features in envs/sim/queue_order.py
    length_prediction_noise: float = 0.0   # sjf: sigma of the predictor's log error (0: the true length)
    enable_prefix_caching: bool = False

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
        if -(-model_len // self.block_size) > self.usable_kv_blocks:
            return (f"scheduler.max_model_len: {model_len} tokens need {-(-model_len // self.block_size)} KV blocks "
                    f"of {self.block_size}, but num_kv_blocks {self.num_kv_blocks} leaves {self.usable_kv_blocks} "
                    f"usable (one is vLLM's null block); vLLM refuses to start when the KV cache cannot hold "
                    f"max_model_len")
        return None

    @property
    def pipelined(self) -> bool:
        """Async scheduling: step k + 1 is scheduled while step k runs (vLLM 0.33's default). Static
        batching, which no vLLM engine runs, is always synchronous."""
        if self.policy == "static":
            return False
        return True if self.async_scheduling is None else self.async_scheduling


@dataclass(frozen=True)
class SloConfig:
    ttft_ms: Optional[float] = None
    itl_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    e2el_ms: Optional[float] = None
    attainment_target: float = 0.9


@dataclass(frozen=True)
class SimulationConfig:
    horizon_s: Optional[float] = None  # stop the clock here; requests still in flight are unfinished


@dataclass(frozen=True)
class KnobConfig:
    """One searched knob: a range (``low``..``high``, optionally on a log scale or in steps) or ``choices``."""
    low: Any = None                  # low, high, step: numbers of the knob's own type (int or float)
    high: Any = None
    log: bool = False
    step: Any = None
    choices: Any = None              # a list of values; the loader keeps it as a tuple


@dataclass(frozen=True)
class SearchConfig:
    """What ``servetune tune`` searches and how; the command line overrides any of it."""
    knobs: Any = None                # {scheduler.max_num_seqs: {low: 1, high: 512, log: true}, ...}; null: defaults
                                     # per policy (search/study/space.py); kept as a tuple of (key, KnobConfig) pairs
    objectives: Any = ("goodput",)   # any of goodput, p99_ttft, p99_itl, gpus
    sampler: str = "tpe"             # tpe | cmaes | nsga2 | gp | random | grid
    trials: int = 100
    batch_size: int = 8              # trials simulated together in one vmapped call
    seed: int = 0                    # the sampler's seed: the same seed gives the same study
    workload_seeds: Any = None       # [0, 1, 2]: every trial runs each seed, reports the mean and keeps the spread
    scenarios: Any = None            # [{workload.arrivals.rate: 6.0}, ...]: every trial runs each variant of the config
    aggregate: str = "mean"          # mean | worst: how the scenarios' results combine
    baselines: bool = True           # enqueue vLLM's default and well-known settings as the first trials


# The integer scheduler knobs the environments' action sets, in action order (envs/gym/actions.py).
STEERABLE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "max_num_queued_reqs")


@dataclass(frozen=True)
class RlConfig:
    """What ``servetune train-rl`` trains on and how; the command line overrides timesteps, num_envs and seed.

    The first five fields are ServeControl-v0's options (envs/gym/adapters.py), so that a trained policy and the
    environment it is evaluated in see the same world; then the learner: ``algo``, the network and what it
    reads, PPO's fields (search/rl/ppo.py) and the evolution strategy's (``es_*``, search/rl/es.py).
    """
    interval_s: float = 1.0          # simulated seconds between decisions
    episode_s: Optional[float] = None  # null: simulation.horizon_s (with neither, until every request is served)
    num_workloads: int = 8           # workload variants trained on: seeds seed, seed + 1, ... (or trace windows)
    miss_penalty: float = 1.0        # reward = good - miss_penalty * (late + rejected), per interval
    bounds: Any = None               # {max_num_seqs: [1, 64], ...}: the action's knob ranges (envs/gym/actions.py)
    algo: str = "ppo"                # ppo | es (evolution strategies over the policy's weights)
    features: Any = None             # observation names the policy reads (null: all of them)
    timesteps: int = 2_000_000       # environment steps (control intervals) in all
    num_envs: int = 256              # environments stepped together (vmapped)
    num_steps: int = 64              # steps per environment per update (the rollout)
    update_epochs: int = 4
    num_minibatches: int = 8
    learning_rate: float = 3e-4
    anneal_lr: bool = True           # linearly to 0 over the run
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: Any = (64, 64)           # widths of the actor's and the critic's hidden layers
    log_std_init: float = -0.5       # the first policy's log spread in action units (Stable-Baselines3's name);
                                     # lower keeps early samples near a tuned config's knobs
    es_population: int = 32          # es: perturbations per generation, in antithetic pairs (even)
    es_sigma: float = 0.05           # es: the perturbations' standard deviation, in weight units
    es_learning_rate: float = 0.03   # es: Adam's step on the weights
    es_days: int = 4                 # es: training workloads every candidate of a generation plays
    seed: int = 0                    # network initialisation and action sampling
    checkpoint_every: int = 10       # updates between checkpoints


@dataclass(frozen=True)
class Config:
    model: str = "llama-2-7b"
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    source: Optional[str] = field(default=None, compare=False)  # file the config came from, for messages

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("source")
        return data
