"""A clairvoyant receding-horizon controller on ServeControl: how much a closed-loop scheduler could gain.

The phase oracle (bench_diurnal_headroom.py) bounds from below what a policy that knows the time of day can
gain over the best static config. A policy that reacts to the queue could do better, so that bound says little
about whether a learner's target is within reach. This controller is told far more than any policy is: before
each decision it plays every candidate action forward from the *true* engine state through the day's *actual*
future arrivals (the functional core is pure, so a look-ahead from a state is exact), holding the static
config after the first interval, and takes the candidate with the most good completions over the look-ahead.
Ties go to the static config, so it departs from it only where the look-ahead says that pays.

Greedy and finite-horizon, it is not the optimum either; but it replans every interval with perfect
knowledge of the future, so a gain it cannot reach is one a policy that sees only the present is unlikely to.

    python results/experiments/bench_diurnal_mpc.py --horizon 8                  # seats x queue limit, 40 s ahead
    python results/experiments/bench_diurnal_mpc.py --horizon 12 --budgets 560,789,1200

The days are eval-policy's held-out ones (the config's workload variants after the ``rl.num_workloads`` trained
on), under the config's ``rl`` options. The static config is the config's own knobs (examples/diurnal.yaml holds
its 100-trial study's best) unless ``--static`` names another.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.progress import track
from scipy import stats

from servetune.cli_args import add_config_arguments
from servetune.config_loader import load_config
from servetune.envs.gym import core
from servetune.envs.gym.actions import INT_KNOBS, config_knobs, encode
from servetune.search.rl.evaluate import final_metrics, heldout_world, play
from servetune.search.rl.train import intervals_per_episode


def parse_knobs(text: str) -> dict:
    knobs = {}
    for item in text.split(","):
        name, value = item.split("=")
        if name not in INT_KNOBS:
            raise SystemExit(f"--static: {name} is not one of {', '.join(INT_KNOBS)}")
        knobs[name] = None if value in ("none", "null") else int(value)
    return knobs


def candidate_knobs(static: dict, seats: list, budgets: list, queues: list) -> list[dict]:
    """The static config first (ties go to it), then the grid around it (the static prefill cap kept)."""
    grid = [{**static, "max_num_seqs": s, "max_num_batched_tokens": b, "max_num_queued_reqs": q}
            for s, b, q in itertools.product(seats, budgets, queues)]
    return [static] + [knobs for knobs in grid if knobs != static]


def make_controller(steps: int, horizon: int):
    """One interval of control for a batch of days: (states, candidates [K, A], params) -> (states, chosen)."""
    def lookahead(state, first, static, params):
        def body(carry, action):
            s, i = carry
            _, new, reward, _, _, _ = core.control_step(None, s, action, params)
            # Past the episode's end nothing is judged: the static episode does not count it either.
            return (new, i + 1), jnp.where(state.interval + i < steps, reward, 0.0)
        actions = jnp.concatenate([first[None], jnp.repeat(static[None], horizon - 1, axis=0)])
        _, rewards = jax.lax.scan(body, (state, jnp.asarray(0, jnp.int32)), actions)
        return rewards.sum()

    def decide(state, candidates, params):
        scores = jax.vmap(lookahead, (None, 0, None, None))(state, candidates, candidates[0], params)
        chosen = jnp.argmax(scores)   # the first of the best: the static config where nothing beats it
        _, new, _, _, _, _ = core.control_step(None, state, candidates[chosen], params)
        return new, chosen

    return jax.jit(jax.vmap(decide, (0, None, None)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, default="examples/diurnal.yaml")
    parser.add_argument("--static", default=None,
                        help="the static config, e.g. max_num_seqs=102,max_num_queued_reqs=4 (default: the config's)")
    parser.add_argument("--episodes", type=int, default=5, help="held-out days")
    parser.add_argument("--horizon", type=int, default=8, help="look-ahead in control intervals")
    parser.add_argument("--seats", default="72,102,128")
    parser.add_argument("--budgets", default="789")
    parser.add_argument("--queues", default="1,2,4,8,16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]

    config = load_config(args.config, args.overrides)
    world = heldout_world(config, args.episodes)
    params = world.params
    steps = intervals_per_episode(world)
    static = {**config_knobs(config), **(parse_knobs(args.static) if args.static else {})}
    knobs = candidate_knobs(static, ints(args.seats), ints(args.budgets), ints(args.queues))
    candidates = jnp.asarray(np.stack([encode(k, params.bounds) for k in knobs]), jnp.float32)
    variants = jnp.arange(args.episodes, dtype=jnp.int32)
    print(f"{args.episodes} held-out days (variants from {config.rl.num_workloads}), {steps} intervals of "
          f"{config.rl.interval_s:g} s, {len(knobs)} candidates, look-ahead {args.horizon} intervals")

    # The static config played as eval-policy plays the config's own knobs: as the world's config action.
    static_world = dataclasses.replace(world, params=dataclasses.replace(params, config_action=candidates[0]))
    static_runs = play(static_world, "fixed_config").metrics

    start = time.perf_counter()
    decide = make_controller(steps, args.horizon)
    states = jax.vmap(lambda v: core.control_reset_to(v, params)[1])(variants)
    chosen = []
    for _ in track(range(steps), description="clairvoyant control"):
        states, picks = decide(states, candidates, params)
        chosen.append(np.asarray(picks))
    controlled_runs = final_metrics(world, states)
    seconds = time.perf_counter() - start
    chosen = np.stack(chosen, axis=1)   # [episodes, steps]

    goodput = lambda runs: np.array([m["request_goodput"] for m in runs])
    gains = goodput(controlled_runs) / goodput(static_runs) - 1.0
    for e in range(args.episodes):
        print(f"day {config.rl.num_workloads + e}: static {goodput(static_runs)[e]:.3f} req/s "
              f"({static_runs[e]['slo_attainment']:.1%}), controller {goodput(controlled_runs)[e]:.3f} "
              f"({controlled_runs[e]['slo_attainment']:.1%}): {gains[e]:+.1%}; departs from static in "
              f"{np.mean(chosen[e] != 0):.0%} of intervals")
    half = stats.t.ppf(0.975, len(gains) - 1) * gains.std(ddof=1) / np.sqrt(len(gains))
    print(f"mean gain {gains.mean():+.1%} ± {half:.1%} (95% t-interval over days); {seconds:.0f} s")
    counts = np.bincount(chosen.ravel(), minlength=len(knobs))
    for index in np.argsort(-counts)[:6]:
        print(f"  {counts[index] / chosen.size:5.1%} of intervals: {knobs[index]}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"config": args.config, "overrides": args.overrides, "static": knobs[0],
                       "horizon": args.horizon, "candidates": knobs,
                       "static_goodput": goodput(static_runs).tolist(),
                       "controller_goodput": goodput(controlled_runs).tolist(),
                       "gain": gains.tolist(),
                       "chosen": chosen.tolist(), "seconds": seconds}, out, indent=1)


if __name__ == "__main__":
    main()
