"""Prefix caching: how many prompt tokens of each request are already in the KV cache when it arrives.

The model (docs/queue-orders.md, "Prefix caching"): prompts are cut into units of ``hash_block_tokens`` tokens, each with
a hash id that stands for the whole prefix up to it (Mooncake's ``hash_ids``; generated shared prefixes get
ids per group). The cache keeps units in least-recently-used order inside the KV capacity:
``num_kv_blocks * block_size`` tokens, so ``floor(that / hash_block_tokens)`` units. Requests look up and
then insert their units in arrival order; a request hits the leading run of its units that is cached (a
prefix cache stops at the first miss, as vLLM's does) and skips prefilling those tokens -- though at
least its last prompt token is computed, to emit the first output token. A preempted request's recompute
hits the same prefix.

What this leaves out, on purpose: the cache is driven by arrival order, not by the moment a prefill
finishes, and cached blocks are not subtracted from the blocks a request reserves (vLLM shares them). So
hits do not depend on the schedule, which lets this run on the host, once per workload and capacity,
while the jitted engine only starts each request's prefill further along.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional

import numpy as np

from servetune.envs.workload.requests import Workload


class PrefixHits(NamedTuple):
    cached_tokens: np.ndarray   # int64 per request: prompt tokens it need not prefill
    hit_units: int              # units found in the cache
    looked_up_units: int        # units looked up (every unit of every request)

    @property
    def hit_rate(self) -> float:
        return self.hit_units / self.looked_up_units if self.looked_up_units else 0.0


def capacity_units(workload: Workload, num_kv_blocks: int, block_size: int) -> int:
    """How many prefix units the KV cache holds."""
    return (num_kv_blocks * block_size) // workload.hash_block_tokens


def prefix_hits(workload: Workload, capacity: Optional[int]) -> PrefixHits:
    """Replay the workload's units through an LRU cache of ``capacity`` units (None: unlimited)."""
    n = workload.num_requests
    cached_tokens = np.zeros(n, dtype=np.int64)
    if workload.hash_ids is None:
        return PrefixHits(cached_tokens, 0, 0)
    offsets, ids, unit = workload.hash_offsets, workload.hash_ids, workload.hash_block_tokens
    cache: OrderedDict[int, None] = OrderedDict()
    hit_units = 0
    for i in range(n):
        units = ids[offsets[i]:offsets[i + 1]].tolist()
        leading = 0
        while leading < len(units) and units[leading] in cache:
            leading += 1
        hit_units += leading
        cached_tokens[i] = min(leading * unit, int(workload.prompt_tokens[i]) - 1)
        for unit_id in units:
            cache[unit_id] = None
            cache.move_to_end(unit_id)
        if capacity is not None:
            while len(cache) > capacity:
                cache.popitem(last=False)
    return PrefixHits(cached_tokens, hit_units, len(ids))
