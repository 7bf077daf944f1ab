"""Prefix caching: the LRU replay against hand-worked cases and the traces' own reuse rates, and the
engine skipping cached prefill on a hand-computed timeline."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from conftest import linear, scheduler_config
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim.prefix_cache import capacity_units, prefix_hits
from servetune.envs.workload.traces import block_reuse_rate, load_trace
from servetune.envs.workload.requests import Workload
from servetune.paths import shared_data_dir

FIXTURE = Path(__file__).parent / "fixtures" / "traces" / "mooncake_conversation_first200.jsonl"


def with_units(units_per_request: list[list[int]], unit_tokens: int, arrival_s=None, prompt_tokens=None) -> Workload:
    n = len(units_per_request)
    arrival_s = np.arange(n, dtype=float) if arrival_s is None else arrival_s
    prompt_tokens = [len(u) * unit_tokens for u in units_per_request] if prompt_tokens is None else prompt_tokens
    base = Workload.from_lists(arrival_s, prompt_tokens, [1] * n)
    offsets = np.concatenate([[0], np.cumsum([len(u) for u in units_per_request])])
    ids = np.concatenate([np.asarray(u, np.int64) for u in units_per_request])
    return dataclasses.replace(base, hash_offsets=offsets, hash_ids=ids, hash_block_tokens=unit_tokens)


def test_lru_with_two_units_on_a_hand_worked_sequence():
    # Cache of 2 units, each request looks up then touches its units (most recent last):
    #   [A B]  miss miss          cache (LRU first): A B
    #   [A C]  hit A, miss C      touch A, insert C (evicts B): A C
    #   [A B]  hit A, miss B      touch A, insert B (evicts C): A B
    #   [C]    miss C (evicted)   insert C (evicts A): B C
    #   [B D]  hit B, miss D      touch B, insert D (evicts C): B D
    #   [A]    miss A             A was evicted two requests ago
    workload = with_units([[1, 2], [1, 3], [1, 2], [3], [2, 4], [1]], unit_tokens=4)
    hits = prefix_hits(workload, capacity=2)
    assert hits.hit_units == 3 and hits.looked_up_units == 10
    # Cached tokens: hit units x 4, but the last prompt token is always computed.
    np.testing.assert_array_equal(hits.cached_tokens, [0, 4, 4, 0, 4, 0])
    unlimited = prefix_hits(workload, capacity=None)
    assert unlimited.hit_units == 6   # 1 2 | 1 . | 1 2 | 3 | 2 . | 1
    assert unlimited.hit_rate == pytest.approx(block_reuse_rate(workload))


def test_a_prefix_stops_at_the_first_miss():
    workload = with_units([[1, 2, 3], [1, 9, 3]], unit_tokens=2)
    assert prefix_hits(workload, None).cached_tokens.tolist() == [0, 2]   # unit 3 is cached, but after a miss


def test_a_full_hit_still_computes_the_last_prompt_token():
    workload = with_units([[5, 6], [5, 6]], unit_tokens=8)
    assert prefix_hits(workload, None).cached_tokens.tolist() == [0, 15]


def test_capacity_is_the_kv_cache_in_units():
    workload = with_units([[1]], unit_tokens=512)
    assert capacity_units(workload, num_kv_blocks=100, block_size=16) == 3   # 1600 tokens hold 3 units of 512


def test_unlimited_cache_on_the_mooncake_fixture_hits_its_reuse_rate():
    workload = load_trace(FIXTURE, "mooncake")
    unlimited = prefix_hits(workload, None)
    assert unlimited.hit_rate == pytest.approx(block_reuse_rate(workload))
    assert unlimited.hit_units > 100   # the first 200 requests reuse ~6% of their blocks
    bounded = prefix_hits(workload, capacity=400)
    assert bounded.hit_rate < unlimited.hit_rate


@pytest.mark.parametrize("name, published", [("conversation_trace.jsonl", 0.37), ("synthetic_trace.jsonl", 0.64)])
def test_unlimited_cache_hits_the_published_mooncake_rates(name, published):
    shared = shared_data_dir()
    if shared is None:
        pytest.skip("../shared/data is absent")
    workload = load_trace(shared / "traces" / "mooncake" / name, "mooncake")
    assert prefix_hits(workload, None).hit_rate == pytest.approx(published, abs=0.01)


def test_cached_prefix_skips_prefill_on_a_timeline(simulator):
    """Step cost 10 ms + 1 ms per token; 4-token units. A (8 tokens, units 1 2) prefills 8 tokens: TTFT
    18 ms. B arrives after A is done with units 1 3: unit 1 is cached, so it prefills 4 tokens: 14 ms.
    Without caching both take 18 ms."""
    workload = with_units([[1, 2], [1, 3]], unit_tokens=4, arrival_s=np.array([0.0, 1.0]))
    cost = linear(0.010, 0.001)
    for caching, expected in ((True, [0.018, 0.014]), (False, [0.018, 0.018])):
        scheduler = scheduler_config(enable_prefix_caching=caching, block_size=4, num_kv_blocks=64)
        out = simulator(workload, scheduler, step_time_s, cost)
        ttft = out.requests.first_token_s - workload.arrival_s
        np.testing.assert_allclose(ttft, expected, rtol=1e-6)
        assert out.totals.prefix_hit_units == (1 if caching else 0)


def test_generated_prefix_groups_share_their_leading_blocks():
    """Two tenants: rag (a 64-token prefix, one of 2 groups) and chat (none). Requests of one rag group
    share exactly the prefix's 4 blocks of 16 tokens; nothing else is shared."""
    from servetune.config_loader import config_from_dict
    from servetune.envs.workload.requests import build_workload

    config = config_from_dict({"workload": {
        "arrivals": {"kind": "poisson", "rate": 5.0}, "num_requests": 200,
        "lengths": {"kind": "uniform", "prompt_tokens": [1, 100], "output_tokens": [1, 10]},
        "tenants": [{"name": "rag", "share": 0.5, "prefix_tokens": 64, "prefix_groups": 2},
                    {"name": "chat", "share": 0.5}]}})
    workload = build_workload(config.workload)
    units = [workload.hash_ids[a:b].tolist() for a, b in zip(workload.hash_offsets[:-1], workload.hash_offsets[1:])]
    assert [len(u) for u in units] == (-(-workload.prompt_tokens // 16)).tolist()
    # Which requests use each unit id: a shared id only the first 4 units of one group's requests, any
    # other id exactly one request.
    users: dict[int, set] = {}
    for request, request_units in enumerate(units):
        group = int(workload.prefix_id[request])
        for j, unit_id in enumerate(request_units):
            users.setdefault(unit_id, set()).add((group, j) if group >= 0 and j < 4 else ("own", request))
    assert all(len(places) == 1 for places in users.values())
    rag = workload.tenant == workload.tenant_names.index("rag")
    shared_ids = {u for request in np.flatnonzero(rag) for u in units[request][:4]}
    assert len(shared_ids) == 8   # 2 groups x 4 blocks
    hits = prefix_hits(workload, None)
    # Every rag request after its group's first hits 4 blocks (its prompt is at least 65 tokens).
    expected = 4 * (int(rag.sum()) - 2)
    assert hits.hit_units == expected
