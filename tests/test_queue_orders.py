"""The scored queue orders (priority, sjf, fair, edf, weighted): engine against reference, and the orders
against queueing theory and the fairness bound they promise.

The differential part draws random multi-tenant workloads with priorities, predicted lengths and class
TTFT SLOs, and random knobs (the same draws as tests/test_differential.py), under every order.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from servetune.cost_models.linear import step_time_s
from servetune.envs.sim.outcome import REJECT_TENANT_RATE
from servetune.envs.sim.queue_order import FEATURES
from servetune.envs.sim.reference import simulate_reference
from servetune.envs.sim.simulator import simulate_many
from servetune.envs.workload.requests import Workload
from test_differential import assert_agree, draw_cost, draw_scheduler, draw_workload

ORDERS = ("priority", "sjf", "fair", "edf", "weighted")
NUM_WORKLOADS = 40
NUM_LONG_WORKLOADS = 10
CONFIGS_PER_WORKLOAD = 16
FIRST_SEED = 40_000


@dataclasses.dataclass(frozen=True)
class OrderCase:
    seed: int
    index: int
    workload: Workload
    scheduler: object
    cost: object
    horizon_s: object
    ttft_slo_ms: np.ndarray
    rate_limited: np.ndarray

    def describe(self) -> str:
        w = self.workload
        rows = ", ".join(f"({float(a)!r}, {p}, {o}, t{t}, p{q})" for a, p, o, t, q in
                         zip(w.arrival_s, w.prompt_tokens, w.output_tokens, w.tenant, w.priority))
        return (f"seed {self.seed} config {self.index}; horizon_s={self.horizon_s!r}\n  {self.scheduler}\n"
                f"  {self.cost}\n  requests (arrival_s, P, O, tenant, priority): [{rows}]")


def draw_weights(rng: np.random.Generator) -> dict:
    """Small integer weights (so both simulators' scores are exact) on a random subset of features."""
    chosen = rng.choice(FEATURES, size=int(rng.integers(1, 4)), replace=False)
    return {name: float(rng.choice([-2, -1, 1, 2, 4])) for name in chosen}


def draw_prefixes(rng: np.random.Generator, workload: Workload) -> Workload:
    """Block hashes of `unit`-token prefix units: most requests share a leading run with an earlier one."""
    unit = int(rng.choice([1, 2, 4, 8]))
    per_request, next_id = [], 0
    for prompt in workload.prompt_tokens:
        units = -(-int(prompt) // unit)
        shared = []
        if per_request and rng.random() < 0.7:
            parent = per_request[int(rng.integers(len(per_request)))]
            shared = parent[:int(rng.integers(0, len(parent) + 1))][:units]
        fresh = list(range(next_id, next_id + units - len(shared)))
        next_id += len(fresh)
        per_request.append(shared + fresh)
    offsets = np.concatenate([[0], np.cumsum([len(u) for u in per_request])])
    ids = np.concatenate([np.asarray(u, np.int64) for u in per_request])
    return dataclasses.replace(workload, hash_offsets=offsets, hash_ids=ids, hash_block_tokens=unit)


def draw_long_workload(rng: np.random.Generator, pieces: int = 5) -> Workload:
    """Several small workloads one after another: a queue long enough that the pool keeps admitted
    entries between compactions."""
    parts = [draw_workload(rng) for _ in range(pieces)]
    offsets = np.cumsum([0.0] + [float(p.arrival_s[-1] - p.arrival_s[0]) + 0.01 for p in parts[:-1]])
    start = parts[0].arrival_s[0]
    arrivals = np.concatenate([p.arrival_s - p.arrival_s[0] + start + o for p, o in zip(parts, offsets)])
    return Workload.from_lists(arrivals, np.concatenate([p.prompt_tokens for p in parts]),
                               np.concatenate([p.output_tokens for p in parts]))


def draw_group(seed: int, long: bool = False) -> list[OrderCase]:
    rng = np.random.default_rng(seed)
    base = draw_long_workload(rng) if long else draw_workload(rng)
    n = base.num_requests
    num_tenants = int(rng.integers(1, 4))
    workload = dataclasses.replace(
        base, tenant=rng.integers(0, num_tenants, n), priority=rng.integers(-1, 3, n),
        prediction_z=rng.normal(size=n), tenant_names=tuple(f"t{k}" for k in range(num_tenants)))
    caching = bool(rng.random() < 0.5)
    if caching:
        workload = draw_prefixes(rng, workload)
    ttft_slo_ms = rng.choice([100.0, 400.0, 1500.0, np.inf], size=num_tenants)[workload.tenant]
    horizon_s = None
    if rng.random() < 0.3:
        horizon_s = float(rng.uniform(workload.arrival_s[0], workload.arrival_s[-1] + 3.0))
    noise = float(rng.choice([0.0, 0.5]))
    # Some groups have tenants' rate limits refusing arrivals before the engine sees them.
    limited = (rng.random(n) < 0.2) & (rng.random() < 0.3)
    cases = []
    for i in range(CONFIGS_PER_WORKLOAD):
        order = ORDERS[int(rng.integers(len(ORDERS)))]
        scheduler = dataclasses.replace(
            draw_scheduler(rng, workload), queue_order=order, length_prediction_noise=noise,
            priority_weights=draw_weights(rng) if order == "weighted" else None, enable_prefix_caching=caching)
        cases.append(OrderCase(seed, i, workload, scheduler, draw_cost(rng), horizon_s, ttft_slo_ms, limited))
    return cases


@pytest.fixture(scope="module")
def results():
    out = []
    # Mostly 12-request workloads; some of 60, whose pools outlive admissions between compactions.
    groups = [draw_group(seed) for seed in range(FIRST_SEED, FIRST_SEED + NUM_WORKLOADS)]
    groups += [draw_group(seed, long=True) for seed in range(FIRST_SEED, FIRST_SEED + NUM_LONG_WORKLOADS)]
    for cases in groups:
        first = cases[0]
        engine = simulate_many(first.workload, [c.scheduler for c in cases], step_time_s, [c.cost for c in cases],
                               horizon_s=first.horizon_s, ttft_slo_ms=first.ttft_slo_ms,
                               rate_limited=first.rate_limited)
        for case, got in zip(cases, engine):
            ref = simulate_reference(case.workload, case.scheduler, step_time_s, case.cost, case.horizon_s,
                                     case.ttft_slo_ms, case.rate_limited)
            out.append((case, ref, got))
    return out


def test_scored_orders_match_reference(results):
    assert_agree(results, "simulate_many (scored queue orders)")


def test_draws_cover_preemption_and_cache_hits(results):
    """The draws exercise preemption among scored running sets, and prefix-cache hits."""
    preempted = sum(bool(ref.requests.preemptions.sum()) for _, ref, _ in results)
    hits = sum(ref.totals.prefix_hit_units > 0 for _, ref, _ in results)
    limited = sum(bool(np.any(ref.requests.reject_reason == REJECT_TENANT_RATE)) for _, ref, _ in results)
    assert preempted >= len(results) // 20
    assert limited >= len(results) // 20
    assert hits >= len(results) // 5
    assert all(ref.totals.prefix_hit_units == got.totals.prefix_hit_units for _, ref, got in results)


def test_fcfs_with_prefix_caching_matches_reference():
    """The fcfs queue with prefix caching (one config per workload, through simulate_workload)."""
    from test_differential import draw_group as draw_fcfs_group
    results = []
    for seed in range(FIRST_SEED, FIRST_SEED + 40):
        case = next(c for c in draw_fcfs_group(seed) if c.scheduler.max_num_seqs <= 8)
        rng = np.random.default_rng(seed)
        workload = draw_prefixes(rng, case.workload)
        scheduler = dataclasses.replace(case.scheduler, enable_prefix_caching=True)
        case = dataclasses.replace(case, workload=workload, scheduler=scheduler)
        args = (workload, scheduler, step_time_s, case.cost, case.horizon_s)
        results.append((case, simulate_reference(*args), simulate_workload(*args)))
    assert_agree(results, "simulate_workload (fcfs, prefix caching)")
    assert sum(ref.totals.prefix_hit_units > 0 for _, ref, _ in results) >= 10


# -- queueing theory ---------------------------------------------------------------------------------
# One seat, one-token prompts and a constant step D: a request's service is S = O * D and nobody is
# preempted, so each order is a non-preemptive single-server discipline with a closed form.

from test_queueing import (  # noqa: E402  (the M/G/1 set-up shared with tests/test_queueing.py)
    MEAN_OUTPUT, ONE_SEAT, REQUESTS_PER_RUN, STEP_S, WARMUP, assert_matches_theory,
)
from conftest import linear  # noqa: E402
from servetune.envs.sim.simulator import simulate_seeds, simulate_workload  # noqa: E402

RUNS = 80


def _class_waits(order: str, seed0: int, rates: list[float], mean_outputs: list[float], noise: float = 0.0):
    """Per run, each class's mean wait before its first step (TTFT - D), after the warm-up."""
    scheduler = dataclasses.replace(ONE_SEAT, queue_order=order, length_prediction_noise=noise)
    total = sum(rates)
    n = REQUESTS_PER_RUN
    workloads = []
    for seed in range(seed0, seed0 + RUNS):
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / total, size=n))
        klass = rng.choice(len(rates), size=n, p=np.array(rates) / total)
        outputs = rng.geometric(1.0 / np.array(mean_outputs)[klass])
        workloads.append(dataclasses.replace(Workload.from_lists(arrivals, np.ones(n), outputs), priority=klass,
                                             prediction_z=rng.normal(size=n)))
    waits = []
    kept = np.arange(n) >= WARMUP
    for workload, out in zip(workloads, simulate_seeds(workloads, scheduler, step_time_s, linear(STEP_S))):
        wait = out.requests.first_token_s - workload.arrival_s - STEP_S
        klass = workload.priority
        waits.append([np.mean(wait[kept & (klass == k)]) for k in range(len(rates))])
    return np.array(waits)


def test_priority_classes_match_cobham():
    """Non-preemptive priority: W_k = W0 / ((1 - sigma_{k-1}) (1 - sigma_k)), W0 = sum_i lambda_i E[S_i^2] / 2."""
    mean_outputs = [2.0, 4.0, 6.0]
    loads = [0.2, 0.2, 0.3]     # rho_k; total 0.7
    rates = [rho / (m * STEP_S) for rho, m in zip(loads, mean_outputs)]
    second_moments = [STEP_S**2 * m * (2 * m - 1) for m in mean_outputs]   # E[S^2] for geometric O
    w0 = sum(lam * s2 for lam, s2 in zip(rates, second_moments)) / 2
    sigma = np.cumsum([0.0] + loads)
    waits = _class_waits("priority", 70_000, rates, mean_outputs)
    for k in range(3):
        theory = w0 / ((1 - sigma[k]) * (1 - sigma[k + 1]))
        assert_matches_theory(f"priority class {k} mean wait", waits[:, k], theory)


def _sjf_mean_wait(rate: float, m: float) -> float:
    """Non-preemptive SJF on exact sizes S = O * D, O geometric of mean m: a job of size x waits
    W0 / ((1 - rho(<x)) (1 - rho(<=x))), where rho(.) is the load of the shorter (or equal) jobs."""
    o = np.arange(1, 2000)
    pmf = (1 / m) * (1 - 1 / m) ** (o - 1)
    load = rate * pmf * o * STEP_S
    below, up_to = np.cumsum(load) - load, np.cumsum(load)
    w0 = rate * STEP_S**2 * m * (2 * m - 1) / 2
    return float(np.sum(pmf * w0 / ((1 - below) * (1 - up_to))))


def test_oracle_sjf_matches_the_mg1_sjf_formula():
    rho = 0.8
    rate = rho / (MEAN_OUTPUT * STEP_S)
    waits = _class_waits("sjf", 80_000, [rate], [MEAN_OUTPUT])
    assert_matches_theory("oracle SJF mean wait", waits[:, 0], _sjf_mean_wait(rate, MEAN_OUTPUT))


def test_sjf_gain_over_fcfs_shrinks_as_the_predictor_gets_noisier():
    """Heavy-tailed outputs under continuous batching: oracle SJF beats FCFS on mean TTFT, and the gain
    falls as the predictor's log error grows (a predictor of pure noise is FCFS in a random order)."""
    rng = np.random.default_rng(5)
    n = 3000
    arrivals = np.cumsum(rng.exponential(1.0 / 2.5, size=n))   # ~80% of what 4 seats can serve
    outputs = np.clip(np.rint(rng.lognormal(np.log(60), 1.2, size=n)), 1, 4000)
    workload = dataclasses.replace(
        Workload.from_lists(arrivals, rng.integers(50, 400, size=n), outputs), prediction_z=rng.normal(size=n))
    base = dataclasses.replace(ONE_SEAT, max_num_seqs=4, max_num_batched_tokens=1024, num_kv_blocks=4000)
    cost = linear(0.01, 5e-5, 1e-7)

    def mean_ttft(**knobs) -> float:
        out = simulate_workload(workload, dataclasses.replace(base, **knobs), step_time_s, cost)
        return float(np.mean(out.requests.first_token_s - arrivals))

    fcfs = mean_ttft(queue_order="fcfs")
    sjf = [mean_ttft(queue_order="sjf", length_prediction_noise=s) for s in (0.0, 1.0, 3.0)]
    assert sjf[0] < 0.7 * fcfs, (fcfs, sjf)
    assert sjf[0] < sjf[1] < sjf[2], (fcfs, sjf)


def test_fair_share_protects_the_well_behaved_tenant():
    """Tenant 0 floods at twice the engine's capacity; tenant 1 sends a light load. Under fair (VTC)
    tenant 1's TTFT stays near what it gets alone; under FCFS it queues behind the flood."""
    rng = np.random.default_rng(11)

    def tenant_arrivals(rate, n):
        return np.cumsum(rng.exponential(1.0 / rate, size=n))

    flood, light = tenant_arrivals(40.0, 2400), tenant_arrivals(1.0, 60)
    arrivals = np.concatenate([flood, light])
    tenant = np.concatenate([np.zeros(len(flood), int), np.ones(len(light), int)])
    order = np.argsort(arrivals, kind="stable")
    n = len(arrivals)
    workload = Workload(arrivals[order], np.full(n, 200), np.full(n, 50), tenant=tenant[order],
                        tenant_names=("flooder", "light"))
    scheduler = dataclasses.replace(ONE_SEAT, max_num_seqs=8, max_num_batched_tokens=1024, num_kv_blocks=4000)
    cost = linear(0.02, 5e-5, 0.0)
    horizon = 60.0

    def light_ttft(w, order_name):
        out = simulate_workload(w, dataclasses.replace(scheduler, queue_order=order_name), step_time_s, cost,
                                horizon_s=horizon)
        light_tenant = w.tenant_names.index("light")
        mask = (w.tenant == light_tenant) & np.isfinite(out.requests.first_token_s)
        return float(np.mean(out.requests.first_token_s[mask] - w.arrival_s[mask])), int(mask.sum())

    alone = Workload(light, np.full(len(light), 200), np.full(len(light), 50), tenant_names=("light",))
    solo, _ = light_ttft(alone, "fcfs")
    fair, served_fair = light_ttft(workload, "fair")
    fcfs, served_fcfs = light_ttft(workload, "fcfs")
    # With every seat held by the flood, a light request waits for a seat to free (a service takes
    # ~50 steps of ~20 ms), and VTC gives it the next one; FCFS puts it behind the whole backlog.
    service_s = 50 * 0.0205
    assert fair < solo + service_s, (solo, fair, fcfs)
    assert fcfs > 10 * fair, (solo, fair, fcfs)
    assert served_fair > served_fcfs


# -- config and search ---------------------------------------------------------------------------------

from servetune.config_loader import config_from_dict  # noqa: E402
from servetune.envs.sim import engine  # noqa: E402
from servetune.errors import ConfigError  # noqa: E402
from servetune.search.study.space import SearchSpace, apply_knobs  # noqa: E402


@pytest.mark.parametrize("scheduler, fragment", [
    ({"queue_order": "weighted"}, "scheduler.priority_weights: got null, expected a mapping of feature"),
    ({"queue_order": "weighted", "priority_weights": {"wait_s": 1}},
     "scheduler.priority_weights.wait_s: unknown key; did you mean scheduler.priority_weights.waiting_s?"),
    ({"queue_order": "weighted", "priority_weights": {"deficit": "high"}},
     "scheduler.priority_weights.deficit: got 'high', expected a finite number"),
    ({"queue_order": "weighted", "priority_weights": {"deficit": 0}}, "at least one weight non-zero"),
    ({"queue_order": "fcfs", "priority_weights": {"deficit": 1}}, "null unless queue_order is weighted"),
    ({"queue_order": "lifo"}, "scheduler.queue_order: got 'lifo', expected one of fcfs, priority, sjf"),
])
def test_bad_queue_order_settings_are_named(scheduler, fragment):
    with pytest.raises(ConfigError) as error:
        config_from_dict({"scheduler": scheduler})
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_weights_are_knobs_a_search_sets_without_recompiling():
    config = config_from_dict({
        "workload": {"num_requests": 50},
        "scheduler": {"queue_order": "weighted", "priority_weights": {"waiting_s": -1.0}, "num_kv_blocks": 8192},
        "search": {"knobs": {"scheduler.priority_weights.prompt_tokens": {"low": 0.0, "high": 1.0}}}})
    space = SearchSpace.from_config(config)
    tuned = apply_knobs(config, {"scheduler.priority_weights.prompt_tokens": 0.25})
    assert dict(tuned.scheduler.priority_weights) == {"waiting_s": -1.0, "prompt_tokens": 0.25}
    assert space.values_in(tuned) == {"scheduler.priority_weights.prompt_tokens": 0.25}

    from servetune.envs.workload.requests import build_workload
    workload = build_workload(config.workload)
    cost = linear(0.01, 1e-4)

    def run(weights):
        schedulers = [apply_knobs(config, {"scheduler.priority_weights.prompt_tokens": w}).scheduler
                      for w in weights]
        return simulate_many(workload, schedulers, step_time_s, [cost] * len(schedulers))

    run([0.0, 1.0])
    compiled = engine.run_many._cache_size()
    run([0.5, 2.0])
    assert engine.run_many._cache_size() == compiled


def test_a_weights_knob_needs_the_weighted_order():
    with pytest.raises(ConfigError, match="searches a weight of the weighted queue order"):
        config_from_dict({"search": {"knobs": {"scheduler.priority_weights.deficit": {"low": 0.0, "high": 1.0}}}})


def test_fair_share_keeps_two_backlogged_tenants_within_the_vtc_bound():
    """VTC's guarantee: while two tenants are both backlogged, the service each has received (prompt
    tokens x1, output tokens x2) differs by a bounded amount. Here tenant 0 sends requests four times the
    size of tenant 1's, both faster than the engine serves. Each step boundary admits at most max_num_seqs
    requests on counters read at that boundary, so the difference stays within 2 x max_num_seqs x U, U
    the largest request's service; FCFS serves in arrival order and lets it grow with time."""
    from servetune.envs.sim.reference import _Engine

    rng = np.random.default_rng(3)
    n = 1200
    arrivals = np.sort(rng.uniform(0.0, 20.0, size=n))   # 60 req/s: far more than the engine serves
    tenant = rng.integers(0, 2, size=n)
    prompt = np.where(tenant == 0, 800, 200)
    output = np.where(tenant == 0, 40, 10)
    workload = Workload(arrivals, prompt, output, tenant=tenant, tenant_names=("big", "small"))
    seats = 8
    bound = 2 * seats * int(np.max(prompt + 2 * output))

    def largest_gap_while_both_backlogged(order: str) -> int:
        scheduler = dataclasses.replace(ONE_SEAT, queue_order=order, max_num_seqs=seats,
                                        max_num_batched_tokens=2048, num_kv_blocks=4000)
        engine = _Engine(workload, scheduler, step_time_s, linear(0.02, 5e-5), 30.0, None)
        gaps = []
        complete = engine.complete

        def recording_complete(batch):
            complete(batch)
            if {r.tenant for r in engine.waiting} == {0, 1}:
                gaps.append(abs(engine.tenant_tokens[0] - engine.tenant_tokens[1]))

        engine.complete = recording_complete
        engine.run()
        assert len(gaps) > 100, "both tenants should stay backlogged for most of the run"
        return max(gaps)

    assert largest_gap_while_both_backlogged("fair") <= bound
    assert largest_gap_while_both_backlogged("fcfs") > 3 * bound
