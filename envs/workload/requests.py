"""A workload: the requests a simulation serves, as host-side NumPy arrays sorted by arrival.

``build_workload`` makes one from the config's ``workload`` section: arrival times from a source
(``ARRIVAL_SOURCES`` in arrivals.py: Poisson, Gamma, on-off, piecewise, ServeGen, vllm bench serve's, or a
replayed trace), token counts from a length kind (``LENGTH_SAMPLERS`` in lengths.py, vllm bench serve's datasets
among them, or the trace's own), tenants with their priorities and shared prefixes, and cuts to
``max_model_len``, which are counted.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from servetune.config import (
    MAX_CLOCK_S, MAX_NUM_REQUESTS, MAX_TOKEN_COUNT, MAX_WORKLOAD_TOKENS, LengthsConfig, SessionsConfig, TenantConfig,
    WorkloadConfig,
)
from servetune.envs.workload.arrivals import ARRIVAL_SOURCES, Arrivals
from servetune.envs.workload.lengths import LENGTH_SAMPLERS
from servetune.errors import ConfigError, in_config

NO_PREFIX = -1


@dataclass(frozen=True)
class Workload:
    """Per-request arrays, one row per request in arrival order.

    Beyond arrival and token counts every request has a tenant (an index into ``tenant_names``), a priority
    (lower is served first under the priority order), a prefix group (``NO_PREFIX`` when it shares none)
    and a standard-normal draw that a noisy output-length predictor scales (see the sjf queue order).
    Those default to one tenant, priority 0, no prefix and no prediction error.

    A closed-loop workload also has ``session`` (the session of each request; a session's calls are
    consecutive rows in call order, sessions in order of their start) and ``think_s`` (for each call after
    a session's first, the seconds from its predecessor's finish or rejection to its arrival; 0 for first
    calls). Its ``arrival_s`` is then each call's session start: only a first call arrives then, the others
    when the simulation releases them (``RequestOutcomes.arrival_s``).
    """

    arrival_s: np.ndarray       # float64, non-decreasing, seconds on the workload's own clock
    prompt_tokens: np.ndarray   # int64, >= 1
    output_tokens: np.ndarray   # int64, >= 1
    description: str = ""
    tenant: Optional[np.ndarray] = None          # int64 in [0, len(tenant_names))
    priority: Optional[np.ndarray] = None        # int64
    prefix_id: Optional[np.ndarray] = None       # int64, NO_PREFIX or a group id >= 0
    prediction_z: Optional[np.ndarray] = None    # float64 standard normals
    tenant_names: tuple = ("default",)
    clipped: int = 0    # requests whose prompt or output was cut, to max_model_len or to MAX_TOKEN_COUNT
    # Mooncake-style prefix blocks, ragged: request i's block hashes are
    # hash_ids[hash_offsets[i]:hash_offsets[i + 1]], each covering hash_block_tokens prompt tokens.
    hash_offsets: Optional[np.ndarray] = None   # int64 [n + 1]; None when the workload has no block hashes
    hash_ids: Optional[np.ndarray] = None       # int64
    hash_block_tokens: int = 512
    session: Optional[np.ndarray] = None   # int64 session index per request; None: open-loop arrivals
    think_s: Optional[np.ndarray] = None   # float64 seconds, with session
    # vllm bench serve's --max-concurrency: at most this many requests in flight. ``arrival_s`` is then when the
    # benchmark would send each request; it is sent then, or when an earlier one ends and frees a seat.
    max_concurrency: Optional[int] = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        defaults = {"tenant": np.zeros(n, np.int64), "priority": np.zeros(n, np.int64),
                    "prefix_id": np.full(n, NO_PREFIX, np.int64), "prediction_z": np.zeros(n, np.float64)}
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        arrays = (self.prompt_tokens, self.output_tokens, self.tenant, self.priority, self.prefix_id,
                  self.prediction_z)
        if any(len(array) != n for array in arrays):
            raise ValueError("workload arrays must have equal lengths")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("workload arrivals must be sorted")
        if n and not (0 <= self.tenant.min() and self.tenant.max() < len(self.tenant_names)):
            raise ValueError("workload tenants must index tenant_names")
        if (self.session is None) != (self.think_s is None):
            raise ValueError("a closed-loop workload needs both session and think_s")
        if self.session is not None:
            if len(self.session) != n or len(self.think_s) != n:
                raise ValueError("workload arrays must have equal lengths")
            steps = np.diff(self.session)
            if n and (self.session[0] != 0 or np.any((steps != 0) & (steps != 1))):
                raise ValueError("a closed-loop workload's sessions must be numbered 0, 1, ... in row order")
            first_call = np.concatenate([[True], steps == 1]) if n else np.zeros(0, bool)
            if np.any(self.think_s[first_call] != 0) or np.any(self.think_s[~first_call] <= 0):
                raise ValueError("think_s must be 0 for a session's first call and positive for the others")
        if self.max_concurrency is not None:
            if self.session is not None:
                raise ValueError("a workload has sessions or a max_concurrency, not both")
            if not 1 <= self.max_concurrency <= MAX_NUM_REQUESTS:   # a seat per request at most
                raise ValueError(f"max_concurrency must be in [1, {MAX_NUM_REQUESTS}]")

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def closed_loop(self) -> bool:
        """Whether requests arrive as the run releases them: sessions' calls, or sends under max_concurrency."""
        return self.session is not None or self.max_concurrency is not None

    @classmethod
    def from_lists(cls, arrival_s, prompt_tokens, output_tokens, description: str = "") -> "Workload":
        return cls(
            np.asarray(arrival_s, dtype=np.float64),
            np.asarray(prompt_tokens, dtype=np.int64),
            np.asarray(output_tokens, dtype=np.int64),
            description,
        )


def take_rows(workload: Workload, rows: np.ndarray, arrival_s: np.ndarray) -> Workload:
    """``workload``'s requests ``rows`` (indices, in the order given), arriving at ``arrival_s``; every
    per-request array follows, the ragged block hashes included."""
    hash_offsets, hash_ids = workload.hash_offsets, workload.hash_ids
    if hash_offsets is not None:
        counts = np.diff(hash_offsets)[rows]
        new_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # Each kept hash's position in the old hash_ids: its row's old start plus its place within the row.
        positions = np.repeat(hash_offsets[rows] - new_offsets[:-1], counts) + np.arange(new_offsets[-1])
        hash_offsets, hash_ids = new_offsets, hash_ids[positions]
    return dataclasses.replace(
        workload, arrival_s=np.asarray(arrival_s, dtype=np.float64), prompt_tokens=workload.prompt_tokens[rows],
        output_tokens=workload.output_tokens[rows], tenant=workload.tenant[rows], priority=workload.priority[rows],
        prefix_id=workload.prefix_id[rows], prediction_z=workload.prediction_z[rows], hash_offsets=hash_offsets,
        hash_ids=hash_ids)


def cut_to_max_model_len(prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                         max_model_len: Optional[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(prompt, output, how many requests were cut): prompts cut to max_model_len - 1 (so one token can be
    generated), then outputs so that prompt + output <= max_model_len; each side also to MAX_TOKEN_COUNT."""
    prompt_limit = MAX_TOKEN_COUNT if max_model_len is None else min(max_model_len - 1, MAX_TOKEN_COUNT)
    prompt = np.minimum(prompt_tokens, prompt_limit)
    output_limit = MAX_TOKEN_COUNT if max_model_len is None else np.minimum(max_model_len - prompt, MAX_TOKEN_COUNT)
    output = np.minimum(output_tokens, output_limit)
    return prompt, output, int(np.count_nonzero((prompt != prompt_tokens) | (output != output_tokens)))


def _tenant_text(tenant: TenantConfig, share: float, lengths_text: str) -> str:
    prefix = (f", a {tenant.prefix_tokens}-token prefix, one of {tenant.prefix_groups}" if tenant.prefix_tokens
              else "")
    return f"{tenant.name} {share:.0%} (priority {tenant.priority}, {lengths_text}{prefix})"


def _tenant_streams(cfg: WorkloadConfig) -> tuple[Arrivals, np.ndarray]:
    """Each tenant's own arrival process, merged in time order (ties in tenant order), and the tenant of each
    arrival. A tenant's stream draws from its own generator, seeded by (seed, its index), so adding or changing
    one tenant leaves the others' arrivals as they were. With ``num_requests`` the merged stream's first that
    many arrive."""
    streams = [ARRIVAL_SOURCES[tenant.arrivals.kind](dataclasses.replace(cfg, arrivals=tenant.arrivals),
                                                     np.random.default_rng([cfg.seed, index]))
               for index, tenant in enumerate(cfg.tenants)]
    arrival_s = np.concatenate([stream.arrival_s for stream in streams])
    tenant_of = np.concatenate([np.full(len(stream.arrival_s), index, np.int64)
                                for index, stream in enumerate(streams)])
    order = np.argsort(arrival_s, kind="stable")[:cfg.num_requests]
    texts = [f"{tenant.name}: {stream.description}" for tenant, stream in zip(cfg.tenants, streams)]
    return Arrivals(arrival_s[order], None, f"merged arrivals of {'; '.join(texts)}"), tenant_of[order]


def _generated_requests(cfg: WorkloadConfig, arrivals: Arrivals, rng: np.random.Generator,
                        tenant_of: Optional[np.ndarray] = None) -> tuple[Workload, str]:
    """Requests for generated arrivals: tenants by share (unless ``tenant_of`` says whose stream each arrival
    came from), each tenant's lengths (plus its shared prefix) and prefix groups; with the description of the
    lengths and tenants."""
    n = len(arrivals.arrival_s)
    if not cfg.tenants:
        prompt, output, lengths_text = LENGTH_SAMPLERS[cfg.lengths.kind](cfg.lengths, n, rng)
        return Workload(arrivals.arrival_s, prompt, output), lengths_text
    tenants = cfg.tenants
    if tenant_of is None:
        shares = np.array([tenant.share for tenant in tenants])
        shares = shares / shares.sum()
        tenant_of = rng.choice(len(tenants), size=n, p=shares)
    else:
        shares = np.bincount(tenant_of, minlength=len(tenants)) / max(n, 1)   # each stream's part of the whole
    members = [tenant_of == index for index in range(len(tenants))]
    prompt, output = np.empty(n, np.int64), np.empty(n, np.int64)
    texts = []
    for tenant, share, mine in zip(tenants, shares, members):
        lengths = tenant.lengths or cfg.lengths
        prompt[mine], output[mine], lengths_text = LENGTH_SAMPLERS[lengths.kind](lengths, int(mine.sum()), rng)
        prompt[mine] += tenant.prefix_tokens
        texts.append(_tenant_text(tenant, share, lengths_text))
    # Prefix groups are drawn after every tenant's lengths, so adding a prefix leaves the lengths as they were.
    prefix_id = np.full(n, NO_PREFIX, np.int64)
    first_id = 0   # ids are global: (tenant, group) pairs numbered in config order
    for tenant, mine in zip(tenants, members):
        if tenant.prefix_tokens > 0:
            prefix_id[mine] = first_id + rng.integers(0, tenant.prefix_groups, size=int(mine.sum()))
            first_id += tenant.prefix_groups
    priority = np.array([tenant.priority for tenant in tenants], dtype=np.int64)[tenant_of]
    workload = Workload(arrivals.arrival_s, prompt, output, tenant=tenant_of.astype(np.int64), priority=priority,
                        prefix_id=prefix_id, tenant_names=tuple(tenant.name for tenant in tenants))
    return workload, f"{len(tenants)} tenants: {'; '.join(texts)}"


def _replayed_requests(cfg: WorkloadConfig, arrivals: Arrivals, rng: np.random.Generator) -> tuple[Workload, str]:
    """Requests for a replayed trace: its rows (tenants, priorities, prefixes and block hashes as the trace
    has them), with its lengths or sampled ones; config tenants give the trace's tenants of the same name
    their priority (and, through envs/workload/slos.py, their SLO)."""
    trace, n = arrivals.trace, len(arrivals.arrival_s)
    if cfg.lengths.kind == "trace":
        lengths_text = "the trace's lengths"
    else:
        prompt, output, lengths_text = LENGTH_SAMPLERS[cfg.lengths.kind](cfg.lengths, n, rng)
        trace = dataclasses.replace(trace, prompt_tokens=prompt, output_tokens=output)
    if not cfg.tenants:
        return trace, lengths_text
    # The config's tenants first, in config order, so that tenant i is the config's i-th whatever the trace
    # holds; then the trace's others, in its order.
    config_names = [tenant.name for tenant in cfg.tenants]
    names = config_names + [name for name in trace.tenant_names if name not in config_names]
    renumber = np.array([names.index(name) for name in trace.tenant_names], dtype=np.int64)
    tenant_of = renumber[trace.tenant]
    priority = trace.priority.copy()
    for index, tenant in enumerate(cfg.tenants):
        priority[tenant_of == index] = tenant.priority
    notes = [f"tenants {', '.join(config_names)} set priorities and SLOs by name"]
    absent = [name for name in config_names if name not in trace.tenant_names]
    if absent:
        notes.append(f"{', '.join(absent)} not in the trace")
    if any(tenant.share != 1.0 or tenant.lengths is not None or tenant.prefix_tokens or tenant.prefix_groups != 1
           for tenant in cfg.tenants):
        notes.append("their shares, lengths and prefixes are unused: the trace says who sent what")
    workload = dataclasses.replace(trace, tenant=tenant_of, priority=priority, tenant_names=tuple(names))
    return workload, f"{lengths_text}; {'; '.join(notes)}"


# Generated shared prefixes are hashed in units of a KV block (vLLM's default block size), so a prefix
# cache can hit all of a system prompt but the partial block at its end.
GENERATED_HASH_BLOCK_TOKENS = 16


def _prefix_block_hashes(workload: Workload, tenants) -> Workload:
    """Block hashes for generated prefixes: a request of prefix group g starts with g's units (ids shared
    by the group), then units of its own; requests without a group have only their own."""
    unit = GENERATED_HASH_BLOCK_TOKENS
    prefix_tokens = np.array([tenant.prefix_tokens for tenant in tenants], dtype=np.int64)[workload.tenant]
    shared = np.where(workload.prefix_id >= 0, np.minimum(prefix_tokens, workload.prompt_tokens) // unit, 0)
    units = -(-workload.prompt_tokens // unit)
    offsets = np.concatenate([[0], np.cumsum(units)])
    # A group's j-th unit is group * stride + j; a request's own units follow every group's, all distinct.
    stride = int(shared.max(initial=0)) + 1
    first_own = (int(workload.prefix_id.max(initial=0)) + 1) * stride
    within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], units)
    is_shared = within < np.repeat(shared, units)
    ids = np.where(is_shared, np.repeat(workload.prefix_id, units) * stride + within,
                   first_own + np.arange(offsets[-1]))
    return dataclasses.replace(workload, hash_offsets=offsets, hash_ids=ids.astype(np.int64),
                               hash_block_tokens=unit)


def _sessions_text(sessions: SessionsConfig, starts_text: str) -> str:
    think = sessions.think_s
    think_text = f"{think:g} s" if isinstance(think, float) else f"{think[0]:g}-{think[1]:g} s"
    history = ", prompts carrying the session's history" if sessions.history else ""
    return f"sessions of {sessions.calls} calls, {think_text} between calls{history}, started by {starts_text.replace(' req/s', ' sessions/s')}"


def _with_history(workload: Workload, calls: int) -> np.ndarray:
    """Each call's prompt after the session's earlier prompts and answers, as an agent resends its conversation."""
    own = workload.prompt_tokens.reshape(-1, calls)
    turns = own + workload.output_tokens.reshape(-1, calls)
    earlier = np.cumsum(turns, axis=1) - turns
    return (own + earlier).reshape(-1)


def _think_times(sessions: SessionsConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """Per call, the seconds from its predecessor's end to its arrival (0 for first calls), rounded to float32
    as the engine holds them, so that both simulators add the same think time."""
    think = sessions.think_s
    draws = np.full(n, think) if isinstance(think, float) else rng.uniform(think[0], think[1], size=n)
    draws = draws.astype(np.float32).astype(np.float64)
    draws[::sessions.calls] = 0.0
    return draws


def _check_engine_range(workload: Workload, cfg: WorkloadConfig) -> None:
    """Refuse a workload the engine cannot hold: arrivals past its clock's range (a rate so low, or a scale so
    slow, that they come after MAX_CLOCK_S) or more tokens than its int32 counters take. Only the drawn workload
    tells, so this runs on it rather than on the config."""
    late = np.flatnonzero(~(workload.arrival_s <= MAX_CLOCK_S))
    if len(late):
        first = int(late[0])
        key = f"workload.tenants[{workload.tenant[first]}].arrivals" if cfg.tenant_arrivals else "workload.arrivals"
        raise ConfigError(
            f"{key}: request {first + 1} of {workload.num_requests} arrives at {workload.arrival_s[first]:.4g} s, "
            f"expected every arrival within {MAX_CLOCK_S:g} s of simulated time (the engine's clock); raise the "
            f"rate or rate_scale, or lower workload.num_requests")
    tokens = int(workload.prompt_tokens.sum() + workload.output_tokens.sum())
    if tokens > MAX_WORKLOAD_TOKENS:
        raise ConfigError(
            f"workload: {workload.num_requests:,} requests of {tokens:,} prompt and output tokens in all, "
            f"expected at most {MAX_WORKLOAD_TOKENS:,} (the engine counts a run's tokens in int32); lower "
            f"workload.num_requests or the lengths")


def build_workload(cfg: WorkloadConfig, source: Optional[str] = None) -> Workload:
    """The workload a validated config describes; the same config (and seed) always gives the same arrays.
    ``source`` (the config's file) starts the message of a ``ConfigError`` when the drawn workload is beyond
    the engine's range."""
    with in_config(source):
        workload = _build_workload(cfg)
        _check_engine_range(workload, cfg)
    return workload


def _build_workload(cfg: WorkloadConfig) -> Workload:
    # One generator, drawn in a fixed order: arrivals, tenants, lengths, prefix groups, and the length
    # predictor's normals last, so a seed fixes the whole workload and a workload without tenants or a
    # predictor draws exactly what it did before those existed.
    rng = np.random.default_rng(cfg.seed)
    cfg = cfg if cfg.lengths is not None else dataclasses.replace(cfg, lengths=LengthsConfig(kind="trace"))
    sessions, tenant_of = cfg.sessions, None
    if cfg.tenant_arrivals:
        arrivals, tenant_of = _tenant_streams(cfg)
    elif sessions is None:
        arrivals = ARRIVAL_SOURCES[cfg.arrivals.kind](cfg, rng)
    else:
        starts = ARRIVAL_SOURCES[cfg.arrivals.kind](
            dataclasses.replace(cfg, num_requests=None if cfg.num_requests is None
                                else cfg.num_requests // sessions.calls), rng)
        arrivals = starts._replace(arrival_s=np.repeat(starts.arrival_s, sessions.calls),
                                   description=_sessions_text(sessions, starts.description))
    if arrivals.trace is None:
        workload, requests_text = _generated_requests(cfg, arrivals, rng, tenant_of)
    else:
        workload, requests_text = _replayed_requests(cfg, arrivals, rng)
    if sessions is not None and sessions.history:
        workload = dataclasses.replace(workload, prompt_tokens=_with_history(workload, sessions.calls))
    prompt, output, clipped = cut_to_max_model_len(workload.prompt_tokens, workload.output_tokens, cfg.max_model_len)
    if cfg.max_model_len is not None:
        requests_text += f", max_model_len {cfg.max_model_len} ({clipped} requests cut)"
    elif clipped:
        requests_text += f", {clipped} requests cut to the {MAX_TOKEN_COUNT}-token limit"
    if cfg.arrivals.max_concurrency is not None:
        workload = dataclasses.replace(workload, max_concurrency=cfg.arrivals.max_concurrency)
        requests_text += f", at most {cfg.arrivals.max_concurrency} in flight (--max-concurrency)"
    if sessions is not None:
        workload = dataclasses.replace(workload, session=np.repeat(np.arange(workload.num_requests // sessions.calls),
                                                                   sessions.calls),
                                       think_s=_think_times(sessions, workload.num_requests, rng))
    workload = dataclasses.replace(
        workload, prompt_tokens=prompt, output_tokens=output, clipped=clipped,
        prediction_z=rng.standard_normal(workload.num_requests),
        description=f"{arrivals.description}, {workload.num_requests} requests, {requests_text} (seed {cfg.seed})",
    )
    if arrivals.trace is None and any(tenant.prefix_tokens for tenant in cfg.tenants or ()):
        workload = _prefix_block_hashes(workload, cfg.tenants)
    return workload
