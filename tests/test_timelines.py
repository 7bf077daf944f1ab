"""Hand-computed timelines: small workloads whose every event was worked out on paper from docs/engine-semantics.md.

Each expected number below comes from the arithmetic in its comment, never from a simulator's output.
Unless a test says otherwise the step time is the linear model with base 1 s and 0.01 s per token, so
a step's duration is 1 + 0.01 * (tokens scheduled); "Rk" is request k in workload order, "t=" a step
boundary, "c" computed tokens, "g" emitted tokens, "h" blocks held, "free" the free KV blocks (of the
num_kv_blocks - 1 usable: block 0 is vLLM's null block), "W" the watermark's blocks, "cap" the
long-prefill threshold when it applies (more than one request in the system).
"""
from __future__ import annotations

import csv
import dataclasses
import math

import numpy as np
import pytest

from conftest import linear, scheduler_config, uniform_slos
from servetune.config import SloConfig
from servetune.cost_models.linear import step_time_s
from servetune.envs.metrics import compute_metrics, segment_metrics, write_requests_csv
from servetune.envs.sim.outcome import (
    COMPLETED,
    ITL_HIST_BINS,
    NOT_ARRIVED,
    REJECT_MAX_MODEL_LEN,
    REJECT_NONE,
    REJECT_QUEUE_FULL,
    REJECTED,
    UNFINISHED,
    itl_bin_index,
)
from servetune.envs.workload.requests import Workload

NAN = math.nan
BASE_COST = linear(1.0, per_token=0.01)


# The helpers run synchronously unless told otherwise (async_scheduling=False, where vLLM 0.33 and the
# config default to async): most timelines below are worked out one step at a time, each step scheduled
# when the one before it ends, which is also how static batching always runs. The async tests pass
# async_scheduling=True and work out the same workload both ways.


def simulate(simulator, requests, horizon_s=None, cost_fn=step_time_s, cost=BASE_COST, priority=None,
             async_scheduling=False, **scheduler):
    """Run ``requests`` -- (arrival_s, prompt_tokens, output_tokens) triples, with ``priority`` per request
    when given -- through ``simulator``."""
    arrivals, prompts, outputs = zip(*requests)
    workload = Workload.from_lists(arrivals, prompts, outputs)
    if priority is not None:
        workload = dataclasses.replace(workload, priority=np.asarray(priority, dtype=np.int64))
    config = scheduler_config(async_scheduling=async_scheduling, **scheduler)
    return simulator(workload, config, cost_fn, cost, horizon_s=horizon_s)


def approx(values):
    return pytest.approx(values, rel=1e-6, nan_ok=True)


def assert_requests(outcome, *, first, finish, status=None, preemptions=None):
    r = outcome.requests
    assert list(r.first_token_s) == approx(first)
    assert list(r.finish_s) == approx(finish)
    if status is not None:
        assert list(r.status) == status
    if preemptions is not None:
        assert list(r.preemptions) == preemptions


def assert_accounting(outcome, arrived):
    status = outcome.requests.status
    completed, rejected, unfinished = (int(np.sum(status == s)) for s in (COMPLETED, REJECTED, UNFINISHED))
    assert completed + rejected + unfinished == arrived
    assert int(np.sum(status != NOT_ARRIVED)) == arrived


# (a) ---------------------------------------------------------------------------------------------------


def test_continuous_admits_arrivals_while_others_decode(simulator):
    # R0 (a=0, P=100, O=4); R1 and R2 arrive at 1.5 (P=50, O=2 and P=10, O=3). block_size 16.
    # t=0     R0 prefill 100                       d = 1 + 1.00 = 2.00 -> t=2.00  R0 first token
    # t=2.00  R1, R2 arrive; R0 decode + R1 50 + R2 10 = 61 tokens
    #                                              d = 1.61        -> t=3.61  R0 g=2; R1, R2 first token
    # t=3.61  three decodes                        d = 1.03        -> t=4.64  R0 g=3; R1 g=2 done; R2 g=2
    # t=4.64  R0, R2 decode                        d = 1.02        -> t=5.66  R0 g=4 done; R2 g=3 done
    out = simulate(simulator, [(0.0, 100, 4), (1.5, 50, 2), (1.5, 10, 3)], max_num_seqs=8)
    assert_requests(out, first=[2.00, 3.61, 3.61], finish=[5.66, 4.64, 5.66], status=[COMPLETED] * 3)
    r = out.requests
    assert list(r.generated_tokens) == [4, 2, 3]
    # R0's gaps 1.61, 1.03, 1.02; R1's 1.03; R2's 1.03, 1.02.
    assert list(r.max_itl_s) == approx([1.61, 1.03, 1.03])
    assert list(r.itl_sum_sq_s2) == approx([1.61**2 + 1.03**2 + 1.02**2, 1.03**2, 1.03**2 + 1.02**2])

    totals = out.totals
    assert totals.end_s == pytest.approx(5.66, rel=1e-6)
    assert totals.steps == 4
    assert totals.scheduled_seqs == 1 + 3 + 3 + 2
    # Blocks after each step's allocations: step 1: R0 ceil(100/16)=7 -> 7 * 2.00 = 14.00
    # step 2: R0 ceil(101/16)=7, R1 ceil(50/16)=4, R2 ceil(10/16)=1 -> 12 * 1.61 = 19.32
    # step 3: R0 ceil(102/16)=7, R1 ceil(51/16)=4, R2 ceil(11/16)=1 -> 12 * 1.03 = 12.36
    # step 4: R0 7, R2 ceil(12/16)=1 -> 8 * 1.02 = 8.16                      total 53.84
    assert totals.kv_block_seconds == pytest.approx(53.84, rel=1e-6)
    # In system: 1 * 2.00 + R1, R2 arrived 0.5 s before t=2.00 (2 * 0.5) + 3 * 1.61 + 3 * 1.03 + 2 * 1.02
    # = 2 + 1 + 4.83 + 3.09 + 2.04 = 12.96 = sum of (finish - arrival) = 5.66 + 3.14 + 4.16.
    assert totals.in_system_seconds == pytest.approx(12.96, rel=1e-6)
    assert not totals.truncated
    gaps = np.array([1.61, 1.03, 1.02, 1.03, 1.03, 1.02])
    expected_histogram = np.bincount(itl_bin_index(gaps), minlength=ITL_HIST_BINS)
    assert np.array_equal(np.asarray(totals.itl_histogram), expected_histogram)


# (b) ---------------------------------------------------------------------------------------------------

STATIC_VS_CONTINUOUS = [(0.0, 10, 10), (0.0, 10, 2), (0.0, 10, 2), (0.5, 10, 2)]


def test_static_batch_is_held_by_its_longest_request(simulator):
    # batch_size 3: R0 (O=10) and two short requests form a batch at t=0; R3 arrives at 0.5.
    # t=0     batch R0, R1, R2: 30 prefill tokens  d = 1.30 -> t=1.30  all first tokens
    # t=1.30  R3 waits: static admits nothing while the batch runs; 3 decodes d = 1.03 -> t=2.33
    #         R1, R2 done (g=2), R0 g=2
    # R0 alone, d = 1.01 per token: g=10 at 2.33 + 8 * 1.01 = 10.41, done.
    # t=10.41 running empty, R3 waited 9.91 >= max_wait 0.2: batch [R3]; 10 tokens d = 1.10 -> t=11.51
    # t=11.51 R3 decode                             d = 1.01 -> t=12.52 done. TTFT(R3) = 11.51 - 0.5 = 11.01
    out = simulate(simulator, STATIC_VS_CONTINUOUS, policy="static", batch_size=3, max_wait_s=0.2)
    assert_requests(out, first=[1.30, 1.30, 1.30, 11.51], finish=[10.41, 2.33, 2.33, 12.52], status=[COMPLETED] * 4)
    assert out.totals.end_s == pytest.approx(12.52, rel=1e-6)


def test_continuous_batching_admits_the_late_arrival_at_once(simulator):
    # t=0     R0, R1, R2: 30 prefill tokens        d = 1.30 -> t=1.30  all first tokens
    # t=1.30  R3 arrives: 3 decodes + R3's 10      d = 1.13 -> t=2.43  R1, R2 done; R0 g=2; R3 first token
    # t=2.43  R0, R3 decode                        d = 1.02 -> t=3.45  R3 done; R0 g=3
    # R0 alone: g=10 at 3.45 + 7 * 1.01 = 10.52.  TTFT(R3) = 2.43 - 0.5 = 1.93, against 11.01 under static.
    out = simulate(simulator, STATIC_VS_CONTINUOUS, policy="continuous")
    assert_requests(out, first=[1.30, 1.30, 1.30, 2.43], finish=[10.52, 2.43, 2.43, 3.45], status=[COMPLETED] * 4)


def test_static_formation_stops_at_batch_size_and_at_the_first_request_that_does_not_fit(simulator):
    # block_size 4, 5 blocks (4 usable), batch_size 3, max_wait 0 (a batch forms as soon as anything waits).
    # R0, R1: P=8 (2 blocks each); R2..R5: P=4 (1 block each); all O=1, all arrive at 0.
    # t=0     R0 (free 2), R1 (free 0), R2 does not fit -> batch [R0, R1]: 16 tokens d = 1.16 -> t=1.16
    # t=1.16  batch [R2, R3, R4] (batch_size reached): 12 tokens  d = 1.12 -> t=2.28
    # t=2.28  batch [R5]: 4 tokens                 d = 1.04 -> t=3.32
    requests = [(0.0, 8, 1), (0.0, 8, 1)] + [(0.0, 4, 1)] * 4
    out = simulate(simulator, requests, policy="static", batch_size=3, max_wait_s=0.0, block_size=4, num_kv_blocks=5)
    done = [1.16, 1.16, 2.28, 2.28, 2.28, 3.32]
    assert_requests(out, first=done, finish=done, status=[COMPLETED] * 6)
    assert out.totals.steps == 3
    assert out.totals.scheduled_seqs == 6


# (c) ---------------------------------------------------------------------------------------------------

CHUNKING = [(0.0, 10, 6), (1.5, 150, 2)]


def test_unchunked_prefill_stalls_the_running_decode(simulator):
    # Budget 256 (without chunking it must cover a whole prompt).
    # t=0     R0 prefill 10                        d = 1.10 -> t=1.10  R0 first token
    # t=1.10  R0 decode                            d = 1.01 -> t=2.11  R0 g=2
    # t=2.11  R1 arrives; R0 decode + R1's whole 150  d = 2.51 -> t=4.62  R0 g=3 (gap 2.51); R1 first token
    # t=4.62  both decode                          d = 1.02 -> t=5.64  R0 g=4; R1 done
    # t=5.64  R0 -> 6.65 (g=5) -> 7.66 (g=6) done
    out = simulate(simulator, CHUNKING, enable_chunked_prefill=False, max_num_batched_tokens=256)
    assert_requests(out, first=[1.10, 4.62], finish=[7.66, 5.64], status=[COMPLETED] * 2)
    assert list(out.requests.max_itl_s) == approx([2.51, 1.02])


def test_chunked_prefill_bounds_the_decode_gap(simulator):
    # Budget 64 with chunking: the decode goes first and the prompt takes what is left.
    # t=0     R0 prefill 10                        d = 1.10 -> t=1.10
    # t=1.10  R0 decode                            d = 1.01 -> t=2.11
    # t=2.11  R0 decode + R1 chunk 63              d = 1.64 -> t=3.75  R1 c=63
    # t=3.75  R0 decode + R1 chunk 63              d = 1.64 -> t=5.39  R1 c=126
    # t=5.39  R0 decode + R1 last 24               d = 1.25 -> t=6.64  R0 g=5; R1 first token
    # t=6.64  both decode                          d = 1.02 -> t=7.66  both done
    # R0's largest gap is 1.64 instead of 2.51; R1's TTFT grows from 3.12 to 5.14.
    out = simulate(simulator, CHUNKING, enable_chunked_prefill=True, max_num_batched_tokens=64)
    assert_requests(out, first=[1.10, 6.64], finish=[7.66, 7.66], status=[COMPLETED] * 2)
    assert list(out.requests.max_itl_s) == approx([1.64, 1.02])


def test_unchunked_prompt_above_the_budget_left_blocks_the_queue(simulator):
    # Chunking off, budget 10. R0 (0, P=6, O=3), R1 (0, P=8, O=1), R2 (0, P=2, O=1).
    # t=0     R0 6 (budget left 4); R1's 8 > 4 blocks the queue, R2 behind it too
    #                                              d = 1.06 -> t=1.06  R0 first token
    # t=1.06  R0 decode (left 9); R1 8 (left 1); R2's 2 > 1 blocks   d = 1.09 -> t=2.15  R1 done
    # t=2.15  R0 decode + R2 2                     d = 1.03 -> t=3.18  R0, R2 done
    # (Had R2 skipped past R1 at t=0, it would have been done at 1.08.)
    requests = [(0.0, 6, 3), (0.0, 8, 1), (0.0, 2, 1)]
    out = simulate(simulator, requests, enable_chunked_prefill=False, max_num_batched_tokens=10)
    assert_requests(out, first=[1.06, 2.15, 3.18], finish=[3.18, 2.15, 3.18], status=[COMPLETED] * 3)


# (d) ---------------------------------------------------------------------------------------------------


def test_long_prefill_token_threshold_lets_a_short_prompt_through(simulator):
    # R0 P=100, R1 P=30, both O=2 at t=0; threshold 40.
    # t=0     R0 chunk 40 + R1 30                  d = 1.70 -> t=1.70  R1 first token
    # t=1.70  R0 chunk 40 + R1 decode              d = 1.41 -> t=3.11  R1 done; R0 c=80
    # t=3.11  R0 last 20                           d = 1.20 -> t=4.31  R0 first token
    # t=4.31  R0 decode                            d = 1.01 -> t=5.32  R0 done
    requests = [(0.0, 100, 2), (0.0, 30, 2)]
    out = simulate(simulator, requests, long_prefill_token_threshold=40)
    assert_requests(out, first=[4.31, 1.70], finish=[5.32, 3.11])
    # Without the threshold: t=0 130 tokens d = 2.30, both first tokens; both decode d = 1.02 -> 3.32.
    out = simulate(simulator, requests, long_prefill_token_threshold=0)
    assert_requests(out, first=[2.30, 2.30], finish=[3.32, 3.32])


def test_long_prefill_token_threshold_spares_a_lone_prompt_and_caps_it_once_another_arrives(simulator):
    # Budget 100, threshold 40. R0 (0, P=150, O=2) alone; R1 (0.5, P=60, O=2) arrives during its first step.
    # t=0     R0 alone: no cap, only the budget: chunk min(150, 100) = 100   d = 2.00 -> t=2.00  R0 c=100
    # t=2.00  R1 in: cap 40. R0 min(50, 40) = 40 (left 60); R1 min(60, 40) = 40
    #                                              d = 1.80 -> t=3.80  R0 c=140; R1 c=40
    # t=3.80  R0 last 10 + R1 last 20              d = 1.30 -> t=5.10  both first tokens
    # t=5.10  both decode                          d = 1.02 -> t=6.12  both done
    # (A cap on the lone prompt too would give R0 40 at t=0; no cap once R1 is in, 50 + 50 at t=2.00.)
    requests = [(0.0, 150, 2), (0.5, 60, 2)]
    out = simulate(simulator, requests, max_num_batched_tokens=100, long_prefill_token_threshold=40)
    assert_requests(out, first=[5.10, 5.10], finish=[6.12, 6.12], status=[COMPLETED] * 2)
    assert out.totals.steps == 4


def test_long_prefill_token_threshold_applies_without_chunked_prefill(simulator):
    # Chunking off, budget 64, max_model_len 64 (vLLM's bound without chunking), threshold 40.
    # R0 (0, P=60, O=2), R1 (0, P=30, O=2).
    # t=0     cap 40: R0 is admitted with min(60, 40) = 40 (left 24); R1's 30 > 24: without chunking an
    #         admission must fit whole, so it blocks  d = 1.40 -> t=1.40  R0 c=40
    # t=1.40  R0, running, takes its last 20 (left 44); R1's 30 fits
    #                                              d = 1.50 -> t=2.90  both first tokens
    # t=2.90  both decode                          d = 1.02 -> t=3.92  both done
    # (Were the cap ignored without chunking, R0 would take its whole 60 at t=0 and be first at 1.60.)
    requests = [(0.0, 60, 2), (0.0, 30, 2)]
    out = simulate(simulator, requests, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64,
                   long_prefill_token_threshold=40)
    assert_requests(out, first=[2.90, 2.90], finish=[3.92, 3.92], status=[COMPLETED] * 2)
    assert out.totals.steps == 3


# (e) ---------------------------------------------------------------------------------------------------


def test_preemption_recomputes_the_last_admitted_request(simulator):
    # block_size 4, 3 blocks (2 usable). R0 P=4 O=2 (peak 5 tokens = 2 blocks), R1 P=2 O=3 (peak 4 = 1 block).
    # t=0     R0 (1 block), R1 (1 block), free 0; 6 tokens  d = 1.06 -> t=1.06  both first tokens
    # t=1.06  R0 decode 4->5 needs a 2nd block, none free: preempt the last, R1 (c=0, g=1 kept, to the
    #         queue), R0 takes the freed block. No admission in a step that preempted.
    #         R0 decode                            d = 1.01 -> t=2.07  R0 done, frees 2
    # t=2.07  R1 recompute: P+g = 3 tokens, 1 block d = 1.03 -> t=3.10  R1 g=2 (gap 3.10 - 1.06 = 2.04)
    # t=3.10  R1 decode                            d = 1.01 -> t=4.11  R1 done
    out = simulate(simulator, [(0.0, 4, 2), (0.0, 2, 3)], block_size=4, num_kv_blocks=3)
    assert_requests(out, first=[1.06, 1.06], finish=[2.07, 4.11], status=[COMPLETED] * 2, preemptions=[0, 1])
    assert list(out.requests.max_itl_s) == approx([1.01, 2.04])
    assert list(out.requests.itl_sum_sq_s2) == approx([1.01**2, 2.04**2 + 1.01**2])
    totals = out.totals
    assert totals.steps == 4
    assert totals.scheduled_seqs == 2 + 1 + 1 + 1
    assert totals.end_s == pytest.approx(4.11, rel=1e-6)
    # Blocks held: 2 * 1.06 + 2 (R0 only, R1 freed) * 1.01 + 1 * 1.03 + 1 * 1.01 = 6.18
    assert totals.kv_block_seconds == pytest.approx(6.18, rel=1e-6)
    # In system: 2 * 1.06 + 2 * 1.01 (R1 waiting) + 1 * 1.03 + 1 * 1.01 = 6.18 = 2.07 + 4.11
    assert totals.in_system_seconds == pytest.approx(6.18, rel=1e-6)


def test_a_request_that_preempts_itself_waits_for_blocks(simulator):
    # block_size 4, 4 blocks (3 usable). R0 and R1: P=4 O=6 (peak 9 tokens = 3 blocks).
    # t=0     both admitted (1 block each, free 1); 8 tokens  d = 1.08 -> t=1.08  both first tokens
    # t=1.08  R0 4->5 takes the free block; R1 4->5 finds none: the last request is R1 itself, preempted.
    #         R0 decode                            d = 1.01 -> t=2.09
    # R0 decodes alone (R1 needs ceil(5/4) = 2 blocks, 1 free) until it is done at 1.08 + 5 * 1.01 = 6.13
    # (its 9th token at t=5.12 takes the last block).
    # t=6.13  R1 recompute 5 tokens                d = 1.05 -> t=7.18  R1 g=2 (gap 7.18 - 1.08 = 6.10)
    # R1 then decodes: g=6 at 7.18 + 4 * 1.01 = 11.22.
    out = simulate(simulator, [(0.0, 4, 6), (0.0, 4, 6)], block_size=4, num_kv_blocks=4)
    assert_requests(out, first=[1.08, 1.08], finish=[6.13, 11.22], status=[COMPLETED] * 2, preemptions=[0, 1])
    assert list(out.requests.max_itl_s) == approx([1.01, 6.10])


def test_victims_of_one_step_requeue_in_admission_order(simulator):
    # block_size 4, 5 blocks (4 usable). R0 P=4 O=2, R1 P=4 O=3, R2 P=2 O=3, R3 P=4 O=2; 1 block each at first.
    # t=0     all four admitted, free 0; 14 tokens d = 1.14 -> t=1.14  all first tokens
    # t=1.14  R0 4->5 needs a block: preempt R3; R1 4->5 needs a block: preempt R2. Queue [R2, R3].
    #         R0, R1 decode                        d = 1.02 -> t=2.16  R0 done (frees 2, free 2); R1 g=2
    # t=2.16  R1 decode; front R2 recompute 3 tokens (1 block, free 1); R3 needs ceil(5/4) = 2: blocked.
    #                                              d = 1.04 -> t=3.20  R1 done (free 3); R2 g=2
    # t=3.20  R2 decode + R3 recompute 5 tokens    d = 1.06 -> t=4.26  R2 done; R3 g=2 done
    # (Had R3 been first in the queue it would have finished at 3.22.)
    requests = [(0.0, 4, 2), (0.0, 4, 3), (0.0, 2, 3), (0.0, 4, 2)]
    out = simulate(simulator, requests, block_size=4, num_kv_blocks=5)
    assert_requests(
        out, first=[1.14] * 4, finish=[2.16, 3.20, 4.26, 4.26], status=[COMPLETED] * 4, preemptions=[0, 0, 1, 1]
    )
    # R2's gaps: 3.20 - 1.14 = 2.06, then 1.06; R3's only gap 4.26 - 1.14 = 3.12.
    assert list(out.requests.max_itl_s) == approx([1.02, 1.04, 2.06, 3.12])


def test_the_null_block_leaves_one_block_fewer_than_num_kv_blocks(simulator):
    # block_size 4. R0, R1 (0, P=8, O=1): 2 blocks each.
    # 5 blocks, 4 usable: both admitted at t=0, free 0; 16 tokens  d = 1.16 -> t=1.16  both done
    # 4 blocks, 3 usable: R0 takes 2 (free 1); R1 needs 2: blocked.
    # t=0     R0 prefill 8                         d = 1.08 -> t=1.08  R0 done, free 3
    # t=1.08  R1 prefill 8                         d = 1.08 -> t=2.16  R1 done
    requests = [(0.0, 8, 1), (0.0, 8, 1)]
    four_usable = simulate(simulator, requests, block_size=4, num_kv_blocks=5)
    assert_requests(four_usable, first=[1.16, 1.16], finish=[1.16, 1.16], status=[COMPLETED] * 2)
    three_usable = simulate(simulator, requests, block_size=4, num_kv_blocks=4)
    assert_requests(three_usable, first=[1.08, 2.16], finish=[1.08, 2.16], status=[COMPLETED] * 2)


OVER_ADMISSION = [(0.0, 16, 2)] * 3   # block_size 4: each prompt is 4 blocks, each chunk of 8 is 2


def test_admission_reserves_the_whole_prompt_but_allocates_only_its_chunk(simulator):
    # block_size 4, 7 blocks (6 usable), threshold 8, reserve_full_prompt on: a request is admitted if its
    # whole prompt fits the free blocks, and takes only its chunk's blocks; later chunks allocate as it runs.
    # t=0     cap 8. R0: 4 <= 6 free, takes 2 (free 4). R1: 4 <= 4, takes 2 (free 2), though R0's second
    #         chunk needs those 2. R2: 4 > 2: blocked.  16 tokens  d = 1.16 -> t=1.16  R0, R1 c=8
    # t=1.16  R0's second chunk takes 2 (free 0). R1's needs 2, none free: the last admitted is R1 itself,
    #         preempted (recompute: c=0, free 2). No admission in a step that preempted.
    #         R0 8                                 d = 1.08 -> t=2.24  R0 first token
    # t=2.24  R0 decode 16->17 takes a 5th block (free 1); R1 needs 4 > 1: blocked
    #                                              d = 1.01 -> t=3.25  R0 done, free 6
    # t=3.25  R1 and R2 as R0 and R1 at t=0:       d = 1.16 -> t=4.41
    # t=4.41  R1 takes 2 (free 0), R2 preempts itself  d = 1.08 -> t=5.49  R1 first token
    # t=5.49  R1 decode (free 1), R2 blocked       d = 1.01 -> t=6.50  R1 done, free 6
    # t=6.50  R2 alone (no cap): 16 tokens         d = 1.16 -> t=7.66  R2 first token
    # t=7.66  R2 decode                            d = 1.01 -> t=8.67  R2 done
    # (Were the whole prompt allocated at admission, R1 would have waited at t=0 and nobody preempted.)
    out = simulate(simulator, OVER_ADMISSION, block_size=4, num_kv_blocks=7, long_prefill_token_threshold=8)
    assert_requests(out, first=[2.24, 5.49, 7.66], finish=[3.25, 6.50, 8.67], status=[COMPLETED] * 3,
                    preemptions=[0, 1, 1])


def test_without_reserve_full_prompt_admission_needs_only_the_chunk_to_fit(simulator):
    # As above with reserve_full_prompt off: only the chunk's 2 blocks must be free.
    # t=0     R0 (free 4), R1 (free 2), R2 (free 0) all admitted  24 tokens  d = 1.24 -> t=1.24  all c=8
    # t=1.24  R0 needs 2: preempt the last, R2 (free 2), R0 takes them (free 0); R1 needs 2: the last is R1
    #         itself, preempted (free 2). Queue [R1, R2].  R0 8  d = 1.08 -> t=2.32  R0 first token
    # t=2.32  R0 decode takes a block (free 1); R1's chunk needs 2: blocked
    #                                              d = 1.01 -> t=3.33  R0 done, free 6
    # t=3.33  R1 (free 4), R2 (free 2) admitted    d = 1.16 -> t=4.49
    # t=4.49  R1 takes 2 (free 0), R2 preempts itself  d = 1.08 -> t=5.57  R1 first token
    # t=5.57  R1 decode (free 1), R2 blocked       d = 1.01 -> t=6.58  R1 done, free 6
    # t=6.58  R2 alone: 16 tokens                  d = 1.16 -> t=7.74
    # t=7.74  R2 decode                            d = 1.01 -> t=8.75  R2 done
    out = simulate(simulator, OVER_ADMISSION, block_size=4, num_kv_blocks=7, long_prefill_token_threshold=8,
                   reserve_full_prompt=False)
    assert_requests(out, first=[2.32, 5.57, 7.74], finish=[3.33, 6.58, 8.75], status=[COMPLETED] * 3,
                    preemptions=[0, 1, 2])


# (f) ---------------------------------------------------------------------------------------------------


def test_max_model_len_and_queue_full_rejections(simulator):
    # block_size 4, 5 blocks: 4 usable, so max_model_len defaults to 16 tokens. At most 1 unfinished request.
    # R0 (0, P=8, O=1): accepted, queue [R0].
    # R1 (0, P=16, O=2): P >= max_model_len 16 leaves no room for an output token -> max_model_len.
    # R2 (0, P=2, O=1): R0 is unfinished -> queue_full.
    # R3 (0.5, P=2, O=1): processed at t=1.08, R0 done, nothing unfinished -> accepted.
    # t=0     R0 prefill 8                         d = 1.08 -> t=1.08  R0 done
    # t=1.08  R3 prefill 2                         d = 1.02 -> t=2.10  R3 done
    requests = [(0.0, 8, 1), (0.0, 16, 2), (0.0, 2, 1), (0.5, 2, 1)]
    out = simulate(simulator, requests, block_size=4, num_kv_blocks=5, max_num_queued_reqs=1)
    assert_requests(
        out,
        first=[1.08, NAN, NAN, 2.10],
        finish=[1.08, NAN, NAN, 2.10],
        status=[COMPLETED, REJECTED, REJECTED, COMPLETED],
    )
    assert list(out.requests.reject_reason) == [REJECT_NONE, REJECT_MAX_MODEL_LEN, REJECT_QUEUE_FULL, REJECT_NONE]
    assert list(out.requests.generated_tokens) == [1, 0, 0, 1]
    assert list(out.requests.max_itl_s) == approx([NAN] * 4)
    assert list(out.requests.itl_sum_sq_s2) == approx([0.0] * 4)
    assert_accounting(out, arrived=4)


def test_the_queue_limit_counts_running_requests(simulator):
    # At most 1 unfinished request (waiting or running). R0 (0, P=10, O=2), R1 (0.5, P=10, O=1),
    # R2 (2.5, P=10, O=1).
    # t=0     R0 prefill 10                        d = 1.10 -> t=1.10  R0 first token
    # t=1.10  R1 processed: the queue is empty but R0 runs -> queue_full. R0 decode  d = 1.01 -> t=2.11  done
    # idle    jump to 2.5: nothing unfinished, R2 accepted; prefill 10  d = 1.10 -> t=3.60  R2 done
    # (Counting only the waiting, R1 would have joined R0's decode and finished at 2.21.)
    requests = [(0.0, 10, 2), (0.5, 10, 1), (2.5, 10, 1)]
    out = simulate(simulator, requests, max_num_queued_reqs=1)
    assert_requests(out, first=[1.10, NAN, 3.60], finish=[2.11, NAN, 3.60],
                    status=[COMPLETED, REJECTED, COMPLETED])
    assert list(out.requests.reject_reason) == [REJECT_NONE, REJECT_QUEUE_FULL, REJECT_NONE]
    assert_accounting(out, arrived=3)


def test_max_model_len_refuses_long_prompts_and_cuts_long_outputs(simulator):
    # max_model_len 20 (vLLM's API server: a prompt of 20 or more is refused, max_tokens cut to 20 - P).
    # R0 (0, P=20, O=1): refused -> max_model_len.
    # R1 (0, P=19, O=5): output cut to 20 - 19 = 1.
    # R2 (0, P=15, O=5): P + O = 20 fits, uncut.
    # t=0     R1 19 + R2 15 = 34 tokens            d = 1.34 -> t=1.34  R1 done (its 1 token); R2 g=1
    # R2 decodes alone: g=5 at 1.34 + 4 * 1.01 = 5.38.
    requests = [(0.0, 20, 1), (0.0, 19, 5), (0.0, 15, 5)]
    out = simulate(simulator, requests, max_model_len=20)
    assert_requests(out, first=[NAN, 1.34, 1.34], finish=[NAN, 1.34, 5.38],
                    status=[REJECTED, COMPLETED, COMPLETED])
    assert list(out.requests.reject_reason) == [REJECT_MAX_MODEL_LEN, REJECT_NONE, REJECT_NONE]
    assert list(out.requests.generated_tokens) == [0, 1, 5]


def test_max_model_len_defaults_to_what_the_usable_kv_blocks_hold(simulator):
    # block_size 4, 5 blocks: 4 usable, so max_model_len is 16 tokens; nothing longer is ever admitted.
    # R0 (0, P=16, O=1): refused -> max_model_len (it would fill the cache before its first token).
    # R1 (0, P=12, O=10): output cut to 16 - 12 = 4; its peak, P + O - 1 = 15 tokens, is 4 blocks: it fits.
    # t=0     R1 prefill 12 (3 blocks)             d = 1.12 -> t=1.12  R1 g=1
    # R1 decodes (the first decode takes the 4th block): g=4 at 1.12 + 3 * 1.01 = 4.15, never preempted.
    requests = [(0.0, 16, 1), (0.0, 12, 10)]
    out = simulate(simulator, requests, block_size=4, num_kv_blocks=5)
    assert_requests(out, first=[NAN, 1.12], finish=[NAN, 4.15], status=[REJECTED, COMPLETED], preemptions=[0, 0])
    assert list(out.requests.reject_reason) == [REJECT_MAX_MODEL_LEN, REJECT_NONE]
    assert list(out.requests.generated_tokens) == [0, 4]


def test_without_chunked_prefill_every_admitted_request_fits_the_budget_whole(simulator):
    # Chunking off, budget 8, max_num_seqs 8: vLLM then needs max_model_len <= 8, so a prompt too long for
    # the budget is refused or cut at arrival, and even a recompute (P + g <= P + O - 1 < 8) fits whole.
    # block_size 2, 6 blocks (5 usable).
    # R0 (0, P=8, O=2): refused -> max_model_len.
    # R1 (0, P=4, O=4): fits.  R2 (0, P=4, O=6): output cut to 8 - 4 = 4.
    # t=0     R1 4 (2 blocks, free 3) + R2 4 (2 blocks, free 1)  d = 1.08 -> t=1.08  both first tokens
    # t=1.08  R1 4->5 takes a 3rd block (free 0); R2 4->5 finds none: R2 itself, preempted (free 2)
    #         R1 decode                            d = 1.01 -> t=2.09  R1 g=2
    # t=2.09  R1 decode; R2 recompute P + g = 5 fits the budget, but needs ceil(5/2) = 3 > 2 blocks
    #                                              d = 1.01 -> t=3.10  R1 g=3
    # t=3.10  R1 6->7 takes a 4th block (free 1)   d = 1.01 -> t=4.11  R1 done, free 5
    # t=4.11  R2 recompute 5 tokens whole          d = 1.05 -> t=5.16  R2 g=2 (gap 5.16 - 1.08 = 4.08)
    # R2 decodes: g=4 at 5.16 + 2 * 1.01 = 7.18.
    requests = [(0.0, 8, 2), (0.0, 4, 4), (0.0, 4, 6)]
    out = simulate(simulator, requests, enable_chunked_prefill=False, max_num_batched_tokens=8, max_num_seqs=8,
                   max_model_len=8, block_size=2, num_kv_blocks=6)
    assert_requests(out, first=[NAN, 1.08, 1.08], finish=[NAN, 4.11, 7.18],
                    status=[REJECTED, COMPLETED, COMPLETED], preemptions=[0, 0, 1])
    assert list(out.requests.reject_reason) == [REJECT_MAX_MODEL_LEN, REJECT_NONE, REJECT_NONE]
    assert list(out.requests.generated_tokens) == [0, 4, 4]
    assert list(out.requests.max_itl_s) == approx([NAN, 1.01, 4.08])
    assert_accounting(out, arrived=3)


# (g) ---------------------------------------------------------------------------------------------------


def test_watermark_blocks_admission_but_not_running_requests(simulator):
    # block_size 4, 11 blocks (10 usable), watermark 0.2 -> W = int(0.2 * 11) = 2 blocks kept free for the
    # running requests whenever an admission finds any running.
    # R0, R1 (0, P=16, O=5): 4 blocks each at admission, 5 at their peak of 20 tokens. R2 (0, P=4, O=1).
    # t=0     R0 takes 4 (nothing runs yet: W not applied; free 6); R1 takes 4 (4 + W <= 6; free 2);
    #         R2 needs 1 + W > 2: blocked.  32 tokens  d = 1.32 -> t=1.32  R0, R1 first tokens
    # t=1.32  R0 16->17 takes a block (free 1, below W: the watermark only guards admission), R1 too
    #         (free 0); R2 still blocked. Two decodes d = 1.02 per step: g=5 at 1.32 + 4 * 1.02 = 5.40,
    #         R0, R1 done, free 10.
    # t=5.40  R2 prefill 4                         d = 1.04 -> t=6.44  R2 done
    # (Without the watermark R2 would have joined the first step and finished at 1.36.)
    requests = [(0.0, 16, 5), (0.0, 16, 5), (0.0, 4, 1)]
    out = simulate(simulator, requests, block_size=4, num_kv_blocks=11, watermark=0.2)
    assert_requests(
        out,
        first=[1.32, 1.32, 6.44],
        finish=[5.40, 5.40, 6.44],
        status=[COMPLETED] * 3,
        preemptions=[0, 0, 0],
    )


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_watermark_is_ignored_when_nothing_runs(simulator, policy):
    # block_size 4, 11 blocks (10 usable), W = 2; static: batch_size 2, max_wait 0.
    # R0 (0, P=36, O=2): 9 blocks, 9 + W > 10, but nothing runs: admitted (free 1).
    # R1 (0, P=4, O=1): R0 now runs (admitted earlier in this pass or batch), 1 + W > 1: blocked.
    # t=0     R0 prefill 36                        d = 1.36 -> t=1.36  R0 first token
    # t=1.36  R0 36->37 takes the 10th block (free 0)  d = 1.01 -> t=2.37  R0 done, free 10
    # t=2.37  R1 alone: prefill 4                  d = 1.04 -> t=3.41  R1 done
    # (Were W applied to an empty engine, R0 would never be admitted and R1 would wait behind it.)
    requests = [(0.0, 36, 2), (0.0, 4, 1)]
    out = simulate(simulator, requests, block_size=4, num_kv_blocks=11, watermark=0.2, policy=policy,
                   batch_size=2, max_wait_s=0.0)
    assert_requests(out, first=[1.36, 3.41], finish=[2.37, 3.41], status=[COMPLETED] * 2)


# Scored queue orders: the running set stays in admission order ---------------------------------------


def test_priority_order_hands_the_budget_out_in_admission_order(simulator):
    # queue_order priority, budget 16, 4 seats. R0 (0, P=4, O=4, priority 1) runs first;
    # R1 (0.5, P=40, O=2, priority 0) arrives during its prefill and is served first among the waiting.
    # t=0     R0 prefill 4                         d = 1.04 -> t=1.04  R0 first token
    # t=1.04  R0 decode (left 15); R1 admitted with min(40, 15) = 15  d = 1.16 -> t=2.20  R1 c=15
    # t=2.20  running [R0, R1], admission order: R0 decode (left 15), R1 15  d = 1.16 -> t=3.36  R1 c=30
    # t=3.36  R0 decode; R1 last 10                d = 1.11 -> t=4.47  R0 done (g=4); R1 first token
    # t=4.47  R1 decode                            d = 1.01 -> t=5.48  R1 done
    # (With the running set sorted by priority, R1's 16-token chunk at t=2.20 would leave R0's decode out:
    # R0 would finish at 5.48.)
    requests = [(0.0, 4, 4), (0.5, 40, 2)]
    out = simulate(simulator, requests, priority=[1, 0], queue_order="priority", max_num_batched_tokens=16,
                   max_num_seqs=4)
    assert_requests(out, first=[1.04, 4.47], finish=[4.47, 5.48], status=[COMPLETED] * 2)
    assert list(out.requests.max_itl_s) == approx([1.16, 1.01])


def test_priority_victim_already_scheduled_gives_its_tokens_back(simulator):
    # queue_order priority, block_size 4, 8 blocks (7 usable), budget 8, threshold 4, 4 seats.
    # R0 (0, P=5, O=5, priority 3), R1 (0.5, P=2, O=6, priority 0), R2 (1.5, P=12, O=1, priority 2),
    # R3 (2.5, P=8, O=1, priority 1): each arrives during the step before it is admitted, so the running set,
    # in admission order, is [R0, R1, R2, R3] and the worst, R0, comes first.
    # t=0     R0 alone (no cap) 5, h=2             d = 1.05 -> t=1.05  R0 g=1
    # t=1.05  cap 4. R0 decode; R1 2 (h=1)         d = 1.03 -> t=2.08  R0 g=2, R1 g=1
    # t=2.08  R0, R1 decode (left 6); R2 min(12, 4) = 4: its prompt's 3 blocks fit the free 4, takes 1
    #                                              d = 1.06 -> t=3.14  R2 c=4
    # t=3.14  R0, R1 decode; R2 4 (h=2; left 2); R3 min(8, 4, 2) = 2: its prompt's 2 blocks fit the free 2,
    #         takes 1 (free 1)                     d = 1.08 -> t=4.22  R0 g=4, R1 g=3, R2 c=8, R3 c=2
    # t=4.22  R0 decode 8->9 takes the last free block (left 7). R1 decode 4->5 needs a block, none free:
    #         the victim is the worst running, R0, already scheduled: its token goes back (left 8), its 3
    #         blocks are freed. R1 takes 1 (free 2; left 7); R2 4 (h=3, free 1; left 3); R3 min(6, 4, 3) = 3
    #         (h=2, free 0). No admission in a step that preempted.
    #                                              d = 1.08 -> t=5.30  R1 g=4; R2 first token, done (free 3)
    # t=5.30  R1 decode; R3 last 3 (left 4); R0 recompute P + g = 9: its 3 blocks fit the free 3,
    #         min(9, 4, 4) = 4 takes 1             d = 1.08 -> t=6.38  R1 g=5; R3 first token, done
    # t=6.38  cap 4 (R1, R0). R1 decode; R0 4 more d = 1.05 -> t=7.43  R1 done (g=6)
    # t=7.43  R0 alone: last 1                     d = 1.01 -> t=8.44  R0 done (g=5; gap 8.44 - 4.22 = 4.22)
    # (Without the token given back, R3 would get 2 at t=4.22; with the running set sorted by priority,
    # [R1, R3, R2, R0], R1 would take the free block and R3 4, preempting R0 before it was scheduled.)
    requests = [(0.0, 5, 5), (0.5, 2, 6), (1.5, 12, 1), (2.5, 8, 1)]
    out = simulate(simulator, requests, priority=[3, 0, 2, 1], queue_order="priority", block_size=4,
                   num_kv_blocks=8, max_num_batched_tokens=8, long_prefill_token_threshold=4, max_num_seqs=4)
    assert_requests(out, first=[1.05, 2.08, 5.30, 6.38], finish=[8.44, 7.43, 5.30, 6.38],
                    status=[COMPLETED] * 4, preemptions=[1, 0, 0, 0])
    assert out.requests.max_itl_s[0] == pytest.approx(4.22, rel=1e-6)
    assert out.totals.steps == 8


# Async scheduling: step k + 1 is scheduled when step k starts -------------------------------------------


def test_async_scheduling_sees_an_arrival_one_step_later(simulator):
    # R0 (0, P=10, O=4), R1 (1.5, P=10, O=2), arriving during R0's second step [1.10, 2.11].
    # Sync: each step is scheduled when the last ends.
    # t=0     R0 prefill 10                        d = 1.10 -> t=1.10  R0 first token
    # t=1.10  R0 decode                            d = 1.01 -> t=2.11
    # t=2.11  R1 in: R0 decode + R1 10             d = 1.11 -> t=3.22  R0 g=3; R1 first token
    # t=3.22  both decode                          d = 1.02 -> t=4.24  both done
    sync = simulate(simulator, [(0.0, 10, 4), (1.5, 10, 2)])
    assert_requests(sync, first=[1.10, 3.22], finish=[4.24, 4.24], status=[COMPLETED] * 2)
    # Async: each decision is taken when the step before the one it schedules starts.
    # at 0     step 1: R0 prefill 10, [0, 1.10]; at once step 2: R0's next token, [1.10, 2.11]
    # at 1.10  (step 1 done: R0 first token) step 3: R0 decode, [2.11, 3.12]
    # at 2.11  (step 2 done) R1 in: step 4: R0's 4th token + R1 10, [3.12, 4.23]
    # at 3.12  (step 3 done) R0's last token is in flight: step 5: R1 decode, [4.23, 5.24]
    # at 4.23  (step 4 done: R0 done, R1 first token) R1's last token is in flight: nothing to schedule;
    #          wait for step 5: R1 done at 5.24
    pipelined = simulate(simulator, [(0.0, 10, 4), (1.5, 10, 2)], async_scheduling=True)
    assert_requests(pipelined, first=[1.10, 4.23], finish=[4.23, 5.24], status=[COMPLETED] * 2)
    totals = pipelined.totals
    assert totals.steps == 5
    assert totals.end_s == pytest.approx(5.24, rel=1e-6)
    # Each step weighs what it was scheduled with, less requests whose last token is in flight: blocks
    # 1 * 1.10 + 1 * 1.01 + 1 * 1.01 + 2 * 1.11 + (R0 leaving) 1 * 1.01 = 6.35
    assert totals.kv_block_seconds == pytest.approx(6.35, rel=1e-6)
    # In system: the same weights, 6.35, plus R1 from its arrival to the start of step 4, 3.12 - 1.5 = 1.62:
    # 7.97 = 4.23 + (5.24 - 1.5)
    assert totals.in_system_seconds == pytest.approx(7.97, rel=1e-6)


def test_async_scheduling_reuses_a_finished_requests_blocks_one_step_later(simulator):
    # block_size 4, 4 blocks (3 usable). R0 (0, P=7, O=2) holds 2 blocks, R1 (0, P=1, O=3) 1; R2 (0, P=8,
    # O=1) needs 2: it waits for R0 to finish.
    # Sync:
    # t=0     R0 7 + R1 1 (free 0); R2 blocked     d = 1.08 -> t=1.08  R0, R1 first tokens
    # t=1.08  R0, R1 decode                        d = 1.02 -> t=2.10  R0 done, free 2
    # t=2.10  R1 decode + R2 8                     d = 1.09 -> t=3.19  R1 done, R2 done
    sync = simulate(simulator, [(0.0, 7, 2), (0.0, 1, 3), (0.0, 8, 1)], block_size=4, num_kv_blocks=4)
    assert_requests(sync, first=[1.08, 1.08, 3.19], finish=[2.10, 3.19, 3.19], status=[COMPLETED] * 3)
    # Async:
    # at 0     step 1: R0 7 + R1 1, [0, 1.08]; at once step 2: R0, R1 next tokens, [1.08, 2.10]
    # at 1.08  R0's last token is in flight: it keeps its 2 blocks, R2 stays blocked.
    #          step 3: R1 decode, [2.10, 3.11]
    # at 2.10  (step 2 done: R0 done, free 2) R1's last token is in flight. step 4: R2 8, [3.11, 4.19]
    # at 3.11  (step 3 done: R1 done) nothing to schedule; wait for step 4: R2 done at 4.19
    pipelined = simulate(simulator, [(0.0, 7, 2), (0.0, 1, 3), (0.0, 8, 1)], block_size=4, num_kv_blocks=4,
                         async_scheduling=True)
    assert_requests(pipelined, first=[1.08, 1.08, 4.19], finish=[2.10, 3.11, 4.19], status=[COMPLETED] * 3)
    # Blocks: 3 * 1.08 + 3 * 1.02 + (R0 leaving) 1 * 1.01 + (R1 leaving) 2 * 1.08 = 9.47
    assert pipelined.totals.kv_block_seconds == pytest.approx(9.47, rel=1e-6)
    # In system: 3 * 1.08 + 3 * 1.02 + 2 * 1.01 + 1 * 1.08 = 9.40 = 2.10 + 3.11 + 4.19
    assert pipelined.totals.in_system_seconds == pytest.approx(9.40, rel=1e-6)


# (h) ---------------------------------------------------------------------------------------------------


def test_horizon_leaves_unfinished_and_not_arrived_requests(simulator):
    # Horizon 2.5. R0 (0, P=10, O=2), R1 (1.0, P=10, O=5), R2 (2.5, ...) and R3 (3.0, ...) never arrive.
    # t=0     R0 prefill 10                        d = 1.10 -> t=1.10  R0 first token
    # t=1.10  R1 arrives; R0 decode + R1 10        d = 1.11 -> t=2.21  R0 done; R1 first token
    # t=2.21  R1 decode (a step that starts before the horizon runs to its end)  d = 1.01 -> t=3.22
    # t=3.22  >= 2.5: the run stops. R1 has emitted 2 of 5 tokens: unfinished.
    requests = [(0.0, 10, 2), (1.0, 10, 5), (2.5, 10, 1), (3.0, 10, 1)]
    out = simulate(simulator, requests, horizon_s=2.5)
    assert_requests(
        out,
        first=[1.10, 2.21, NAN, NAN],
        finish=[2.21, NAN, NAN, NAN],
        status=[COMPLETED, UNFINISHED, NOT_ARRIVED, NOT_ARRIVED],
    )
    assert list(out.requests.generated_tokens) == [2, 2, 0, 0]
    assert list(out.requests.max_itl_s) == approx([1.11, 1.01, NAN, NAN])
    assert_accounting(out, arrived=2)
    assert out.totals.end_s == pytest.approx(3.22, rel=1e-6)
    # In system: 1 * 1.10 + R1 arrived 0.10 before t=1.10 + 2 * 1.11 + 1 * 1.01 (R1 counts until the end)
    # = 1.10 + 0.10 + 2.22 + 1.01 = 4.43
    assert out.totals.in_system_seconds == pytest.approx(4.43, rel=1e-6)


def test_idle_wait_for_a_request_beyond_the_horizon_stops_at_the_horizon(simulator):
    # Horizon 3.0. R0 (0, P=10, O=1) is done at 1.10; the engine idles toward R1 at 5.0, which never
    # arrives, and the wait stops at the horizon.
    out = simulate(simulator, [(0.0, 10, 1), (5.0, 10, 1)], horizon_s=3.0)
    assert_requests(out, first=[1.10, NAN], finish=[1.10, NAN], status=[COMPLETED, NOT_ARRIVED])
    assert out.totals.end_s == pytest.approx(3.0, rel=1e-6)
    assert out.totals.steps == 1
    assert_accounting(out, arrived=1)


# (i) ---------------------------------------------------------------------------------------------------


def test_idle_engine_jumps_to_the_next_arrival(simulator):
    # R0 (0, P=10, O=1), R1 (5.0, P=20, O=2); block_size 16.
    # t=0     R0 prefill 10                        d = 1.10 -> t=1.10  R0 done
    # idle    jump to 5.0
    # t=5.0   R1 prefill 20                        d = 1.20 -> t=6.20  R1 first token
    # t=6.20  R1 decode                            d = 1.01 -> t=7.21  R1 done
    out = simulate(simulator, [(0.0, 10, 1), (5.0, 20, 2)])
    assert_requests(out, first=[1.10, 6.20], finish=[1.10, 7.21], status=[COMPLETED] * 2)
    totals = out.totals
    assert totals.end_s == pytest.approx(7.21, rel=1e-6)
    assert totals.steps == 3
    assert totals.scheduled_seqs == 3
    # Blocks: 1 * 1.10 + (idle: none) + ceil(20/16)=2 * 1.20 + ceil(21/16)=2 * 1.01 = 1.10 + 2.40 + 2.02
    assert totals.kv_block_seconds == pytest.approx(5.52, rel=1e-6)
    # In system: 1.10 + 0 while idle + 1.20 + 1.01 = 3.31
    assert totals.in_system_seconds == pytest.approx(3.31, rel=1e-6)


def test_static_batch_forms_when_the_front_request_has_waited_max_wait(simulator):
    # batch_size 4, max_wait 2.0. R0 (0), R1 (1.0), R2 (10.0); all P=10, O=1.
    # t=0     1 waiting < 4, waited 0 < 2: idle; next event min(arrival 1.0, timeout 0 + 2 = 2.0) = 1.0
    # t=1.0   2 waiting, front waited 1.0: idle; min(arrival 10.0, timeout 2.0) = 2.0
    # t=2.0   R0 waited 2.0: batch [R0, R1], 20 tokens d = 1.20 -> t=3.20  both done
    # idle    jump to 10.0; R2 alone, its timeout 12.0 comes first (no more arrivals): jump to 12.0
    # t=12.0  batch [R2]                           d = 1.10 -> t=13.10
    out = simulate(simulator, [(0.0, 10, 1), (1.0, 10, 1), (10.0, 10, 1)], policy="static", batch_size=4, max_wait_s=2.0)
    assert_requests(out, first=[3.20, 3.20, 13.10], finish=[3.20, 3.20, 13.10], status=[COMPLETED] * 3)
    totals = out.totals
    assert totals.end_s == pytest.approx(13.10, rel=1e-6)
    # In system: idle 0->1 with 1 waiting (1.0) + idle 1->2 with 2 (2.0) + step 2 * 1.20 + idle 10->12
    # with 1 (2.0) + step 1 * 1.10 = 8.50 = 3.20 + 2.20 + 3.10
    assert totals.in_system_seconds == pytest.approx(8.50, rel=1e-6)


# The batch summary handed to the cost model ------------------------------------------------------------


def probe_step_time(params, batch):
    """A cost that weighs every StepBatch field differently, so a miscounted field changes the timeline."""
    del params
    return (
        1.0
        + 0.5 * batch.num_prefill_seqs
        + 0.01 * batch.prefill_tokens
        + 0.001 * batch.prefill_context_tokens
        + 0.0001 * batch.prefill_attention_pairs
        + 0.00001 * batch.prefill_causal_pairs
        + 0.1 * batch.num_decode_seqs
        + 0.001 * batch.decode_context_tokens
    )


def test_step_batch_counts_prefill_chunks_and_decodes(simulator):
    # R0 (0, P=4, O=3) in chunks of 2 (threshold 2); R1 (0, P=1, O=2): one prompt token is a prefill (g=0).
    # t=0        prefills: R0 n=2 c=0 (pairs 2*(0+1) = 2, causal 2*2/2 = 2), R1 n=1 c=0 (pairs 1*(0+0.5) = 0.5,
    #            causal 0.5): seqs 2, tokens 3, context 2+1 = 3, pairs 2.5, causal 2.5
    #            d = 1 + 1.0 + 0.03 + 0.003 + 0.00025 + 0.000025 = 2.033275   -> t=2.033275  R1 first token
    # t=2.033275 prefill R0 n=2 c=2: tokens 2, context 4, pairs 2*(2+1) = 6, causal 2; decode R1 c=1: context 2
    #            d = 1 + 0.5 + 0.02 + 0.004 + 0.0006 + 0.00002 + 0.1 + 0.002 = 1.62662
    #                                                                    -> t=3.659895  R0 first; R1 done
    # t=3.659895 decode R0 c=4: context 5  d = 1 + 0.1 + 0.005 = 1.105     -> t=4.764895
    # t=4.764895 decode R0 c=5: context 6  d = 1.106                      -> t=5.870895  R0 done
    out = simulate(simulator, [(0.0, 4, 3), (0.0, 1, 2)], cost_fn=probe_step_time, long_prefill_token_threshold=2)
    assert_requests(out, first=[3.659895, 2.033275], finish=[5.870895, 3.659895], status=[COMPLETED] * 2)


def test_each_chunk_brings_its_own_causal_block_on_every_step_of_a_run(simulator):
    # R0 (0, P=12, O=2) in chunks of 4 (threshold 4: two requests in the system); R1 (0, P=2, O=4).
    # t=0        prefills: R0 n=4 c=0 (pairs 4*(0+2) = 8, causal 8), R1 n=2 c=0 (pairs 2, causal 2)
    #            d = 1 + 1.0 + 0.06 + 0.006 + 0.001 + 0.0001 = 2.0671               -> t=2.0671   R1 first
    # t=2.0671   prefill R0 n=4 c=4 (pairs 4*(4+2) = 24, causal 8), decode R1 c=2 (context 3)
    #            d = 1 + 0.5 + 0.04 + 0.008 + 0.0024 + 0.00008 + 0.1 + 0.003 = 1.65348 -> t=3.72058
    # t=3.72058  prefill R0 n=4 c=8 (pairs 4*(8+2) = 40, causal 8: the block, not the prefix), decode R1 c=3
    #            d = 1 + 0.5 + 0.04 + 0.012 + 0.004 + 0.00008 + 0.1 + 0.004 = 1.66008 -> t=5.38066  R0 first
    # t=5.38066  decodes R0 c=12, R1 c=4 (contexts 13 + 5)  d = 1 + 0.2 + 0.018 = 1.218 -> t=6.59866  both done
    out = simulate(simulator, [(0.0, 12, 2), (0.0, 2, 4)], cost_fn=probe_step_time, long_prefill_token_threshold=4)
    assert_requests(out, first=[5.38066, 2.0671], finish=[6.59866, 6.59866], status=[COMPLETED] * 2)


def test_a_burst_larger_than_one_iterations_arrivals_counts_each_gap_once(simulator):
    # Every step 0.01 s. R0-R3 (P=4, O=200) take all 4 seats at t=0; 30 requests (P=4, O=2) arrive together
    # at 0.5, mid-decode: more than the engine processes in one loop iteration (16), while nobody can be
    # admitted. R0-R3 emit at steps 1..200 (199 gaps each) and finish at t=2.00; then the 30 go 4 at a time,
    # prefill then decode (1 gap each): 8 groups of 2 steps, ending at 2.16. 4 * 199 + 30 = 826 gaps, all 0.01.
    out = simulate(simulator, [(0.0, 4, 200)] * 4 + [(0.5, 4, 2)] * 30, cost=linear(0.01), max_num_seqs=4)
    assert np.all(out.requests.status == COMPLETED)
    assert out.totals.steps == 216
    assert out.totals.end_s == pytest.approx(2.16, rel=1e-6)
    expected = np.bincount(itl_bin_index(np.full(826, 0.01)), minlength=ITL_HIST_BINS)
    assert np.array_equal(np.asarray(out.totals.itl_histogram), expected)


# Closed-loop agent sessions ----------------------------------------------------------------------------


def session_workload(sessions) -> Workload:
    """``sessions`` -- (start_s, [(prompt, output), (think_s, prompt, output), ...]) each: a first call, then
    calls arriving think_s after the previous one ended -- as a workload; ids number the calls session by
    session."""
    arrival, prompt, output, session, think = [], [], [], [], []
    for index, (start, calls) in enumerate(sessions):
        for position, call in enumerate(calls):
            wait, p, o = (0.0, *call) if position == 0 else call
            arrival.append(start)
            prompt.append(p)
            output.append(o)
            session.append(index)
            think.append(wait)
    return Workload(np.array(arrival, float), np.array(prompt), np.array(output),
                    session=np.array(session), think_s=np.array(think, float))


def simulate_sessions(simulator, sessions, horizon_s=None, cost=BASE_COST, async_scheduling=False, **scheduler):
    """Run ``sessions`` (see session_workload) through ``simulator``, synchronously unless told otherwise."""
    config = scheduler_config(async_scheduling=async_scheduling, **scheduler)
    return simulator(session_workload(sessions), config, step_time_s, cost, horizon_s=horizon_s)


AGENTS = [(0.0, [(100, 2), (0.5, 50, 1), (0.25, 10, 1)]),   # A0, A1, A2 (ids 0, 1, 2)
          (0.5, [(10, 3), (1.0, 20, 2)])]                   # B0, B1 (ids 3, 4)


def test_each_call_arrives_its_think_time_after_the_previous_one_finished(simulator):
    # t=0     A0 arrives; prefill 100              d = 2.00 -> t=2.00  A0 first token
    # t=2.00  B0 (arrived 0.5); A0 decode + B0 10  d = 1.11 -> t=3.11  A0 done; B0 first token
    #         A1 is released: it arrives at 3.11 + 0.5 = 3.61
    # t=3.11  B0 decode                            d = 1.01 -> t=4.12
    # t=4.12  A1 (arrived 3.61); B0 decode + A1 50 d = 1.51 -> t=5.63  B0 done, A1 done (O=1)
    #         A2 arrives at 5.63 + 0.25 = 5.88, B1 at 5.63 + 1.0 = 6.63
    # idle    jump to 5.88
    # t=5.88  A2 prefill 10                        d = 1.10 -> t=6.98  A2 done
    # t=6.98  B1 (arrived 6.63) prefill 20         d = 1.20 -> t=8.18  B1 first token
    # t=8.18  B1 decode                            d = 1.01 -> t=9.19  B1 done
    out = simulate_sessions(simulator, AGENTS, max_num_seqs=8)
    assert list(out.requests.arrival_s) == approx([0.0, 3.61, 5.88, 0.5, 6.63])
    assert_requests(out, first=[2.00, 5.63, 6.98, 3.11, 8.18], finish=[3.11, 5.63, 6.98, 5.63, 9.19],
                    status=[COMPLETED] * 5)
    assert out.totals.end_s == pytest.approx(9.19, rel=1e-6)
    assert out.totals.steps == 7
    # In system from each call's own arrival: 3.11 + (5.63 - 3.61) + (6.98 - 5.88) + (5.63 - 0.5) + (9.19 - 6.63)
    # = 3.11 + 2.02 + 1.10 + 5.13 + 2.56
    assert out.totals.in_system_seconds == pytest.approx(13.92, rel=1e-6)


def test_metrics_and_requests_csv_measure_from_each_calls_actual_arrival(simulator, tmp_path):
    # The timeline above. TTFT: A0 2.00, A1 5.63 - 3.61 = 2.02, A2 6.98 - 5.88 = 1.10, B0 3.11 - 0.5 = 2.61,
    # B1 8.18 - 6.63 = 1.55: mean 9.28 / 5 = 1.856 s. E2EL: 3.11, 2.02, 1.10, 5.13, 2.56: mean 2.784 s.
    # Within a 2,050 ms TTFT SLO: all but B0. Duration: from the first arrival (0) to the end (9.19).
    workload = session_workload(AGENTS)
    out = simulator(workload, scheduler_config(max_num_seqs=8, async_scheduling=False), step_time_s, BASE_COST)
    slos = uniform_slos(SloConfig(ttft_ms=2050.0), workload.num_requests)
    metrics = compute_metrics(workload, out, slos, num_kv_blocks=8192)
    assert metrics["mean_ttft_ms"] == pytest.approx(1856.0, rel=1e-6)
    assert metrics["mean_e2el_ms"] == pytest.approx(2784.0, rel=1e-6)
    assert metrics["duration_s"] == pytest.approx(9.19, rel=1e-6)
    assert metrics["good"] == 4
    # 5 s windows by actual arrival: A0, B0 and A1 (3.61) in the first; A2 (5.88) and B1 (6.63) in the second.
    windows = segment_metrics(workload, out, slos, window_s=5.0)["time_window"]
    assert {name: segment["arrived"] for name, segment in windows.items()} == {"0-5s": 3, "5-10s": 2}
    write_requests_csv(tmp_path / "requests.csv", workload, out)
    with open(tmp_path / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["arrival_s"] for row in rows] == ["0.000000", "3.610000", "5.880000", "0.500000", "6.630000"]


def test_a_call_unfinished_at_the_horizon_holds_back_the_rest_of_its_session(simulator):
    # As above to t=3.11 < horizon 3.5: B0's decode runs to 4.12. A1 was released to arrive at 3.61, at or
    # after the horizon: it never arrives, nor does A2; B0 is unfinished (2 of 3 tokens), so B1 never comes.
    out = simulate_sessions(simulator, AGENTS, horizon_s=3.5, max_num_seqs=8)
    assert list(out.requests.status) == [COMPLETED, NOT_ARRIVED, NOT_ARRIVED, UNFINISHED, NOT_ARRIVED]
    assert list(out.requests.arrival_s) == approx([0.0, NAN, NAN, 0.5, NAN])
    assert list(out.requests.generated_tokens) == [2, 0, 0, 2, 0]
    assert_accounting(out, arrived=2)


TOOLS = [(0.0, [(10, 2), (0.5, 100, 1), (0.5, 10, 1)]),   # X0, X1 (rejected: 100 tokens > 3 blocks of 16), X2
         (0.2, [(200, 1), (0.3, 5, 1)])]                  # Y0 (rejected), Y1


def test_a_rejected_call_releases_the_next_one_from_the_boundary_that_rejected_it(simulator):
    # 4 KV blocks of 16 tokens, 3 usable: max_model_len defaults to 48, and a call whose prompt reaches it
    # is rejected (max_model_len).
    # t=0     X0 prefill 10                        d = 1.10 -> t=1.10  X0 first token
    # t=1.10  Y0 (arrived 0.2) rejected: Y1 arrives at 1.10 + 0.3 = 1.40. X0 decode d = 1.01 -> t=2.11  X0 done
    #         X1 arrives at 2.11 + 0.5 = 2.61
    # t=2.11  Y1 (arrived 1.40) prefill 5          d = 1.05 -> t=3.16  Y1 done
    # t=3.16  X1 (arrived 2.61) rejected: X2 arrives at 3.16 + 0.5 = 3.66; nothing to run: idle to 3.66
    # t=3.66  X2 prefill 10                        d = 1.10 -> t=4.76  X2 done
    out = simulate_sessions(simulator, TOOLS, num_kv_blocks=4, block_size=16)
    assert list(out.requests.arrival_s) == approx([0.0, 2.61, 3.66, 0.2, 1.40])
    assert_requests(out, first=[1.10, NAN, 4.76, NAN, 3.16], finish=[2.11, NAN, 4.76, NAN, 3.16],
                    status=[COMPLETED, REJECTED, COMPLETED, REJECTED, COMPLETED])
    assert list(out.requests.reject_reason) == [REJECT_NONE, REJECT_MAX_MODEL_LEN, REJECT_NONE, REJECT_MAX_MODEL_LEN,
                                                REJECT_NONE]
    # With a horizon of 3.5, X2's release at 3.66 is past it: the idle jump stops at 3.5 and X2 never arrives.
    cut = simulate_sessions(simulator, TOOLS, horizon_s=3.5, num_kv_blocks=4, block_size=16)
    assert list(cut.requests.status) == [COMPLETED, REJECTED, NOT_ARRIVED, REJECTED, COMPLETED]
    assert cut.totals.end_s == pytest.approx(3.5, rel=1e-6)
    assert_accounting(cut, arrived=4)


def test_released_calls_join_the_queue_in_arrival_order_then_by_id(simulator):
    # One seat, every step 1 s (base 1, nothing per token). Ids: S0 calls 0, 1; S1 calls 2, 3; S2 call 4.
    # t=0  0, 2, 4 arrive together: queue [0, 2, 4] (ties by id); 0 runs -> t=1 done; 1 arrives 1 + think
    # t=1  2 runs -> t=2 done; 3 arrives 2 + think
    # t=2  4 (O=3) runs three steps -> t=5
    # Thinks 3.0 and 0.5: 1 arrives at 4.0, 3 at 2.5; at t=5 the queue is [3, 1]: 3 runs -> 6, 1 -> 7.
    # Thinks 2.0 and 1.0: both arrive at 3.0 exactly; the tie goes to the lower id: 1 runs -> 6, 3 -> 7.
    def sessions(think_0, think_1):
        return [(0.0, [(1, 1), (think_0, 1, 1)]), (0.0, [(1, 1), (think_1, 1, 1)]), (0.0, [(1, 3)])]

    by_time = simulate_sessions(simulator, sessions(3.0, 0.5), cost=linear(1.0), max_num_seqs=1)
    assert list(by_time.requests.arrival_s) == approx([0.0, 4.0, 0.0, 2.5, 0.0])
    assert list(by_time.requests.finish_s) == approx([1.0, 7.0, 2.0, 6.0, 5.0])
    by_id = simulate_sessions(simulator, sessions(2.0, 1.0), cost=linear(1.0), max_num_seqs=1)
    assert list(by_id.requests.arrival_s) == approx([0.0, 3.0, 0.0, 3.0, 0.0])
    assert list(by_id.requests.finish_s) == approx([1.0, 6.0, 2.0, 7.0, 5.0])
