"""ServeControl speed: control steps per second for vmapped envs, each step one simulated second of the chat
scenario (examples/chat.yaml as shipped: 4 req/s, 2,000 requests, episodes until every request is served).

For 1, 64 and 1,024 envs it times the functional core (``jax.vmap(control_step)``, jitted, on one device), the
same step split across the cores as the adapter splits it (servetune/parallel.py), and the Gymnasium
vector adapter (``gymnasium.make_vec(..., vectorization_mode="vector_entry_point")``, which adds autoreset and
the host transfers), at two slot-table sizes: the default action bounds (max_num_seqs up to 256, to cover
vLLM's default, so a 256-slot table) and ``bounds={"max_num_seqs": (1, 64)}`` (the chat config's own 64).
Every env holds the config's own knobs (the ``fixed_config`` baseline), so all sizes do the same work.

Where the time goes: the engine loop alone (``engine.run_from`` vmapped over the same states) against the
whole step; the loop iterations per step, mean over envs against the batch's slowest env (a vmapped
``while_loop`` runs until its last env is done); and the adapter against the core.

    python benchmarks/bench_envs.py                      # the BENCHMARKS.md table
    python benchmarks/bench_envs.py --envs 64 --steps 5  # a quick look
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

import servetune  # noqa: F401  (registers the ids)
from servetune.envs.gym import core
from servetune.envs.gym.world import build_world
from servetune.parallel import across_cores, laid_out

CHAT = str(Path(__file__).resolve().parent.parent / "examples" / "chat.yaml")


def _batched(tree, num_envs):
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_envs,) + x.shape), tree)


def _engine_only(params, states, actions):
    """The engine loop of one control step, vmapped as the step vmaps it, without judging or observing."""
    def one(state, action):
        hi, lo, _ = core.interval_end(params, state.interval, params.interval_s)
        return core.advance(params, state.variant, state.engine, action, hi, lo)[0]
    return jax.vmap(one)(states, actions)


def bench_core(world, num_envs: int, steps: int) -> dict:
    params = world.params
    keys = jax.random.split(jax.random.PRNGKey(0), num_envs)
    _, states = jax.jit(jax.vmap(core.control_reset, (0, None)))(keys, params)
    actions = _batched(params.config_action, num_envs)
    step = jax.jit(jax.vmap(core.control_step, (None, 0, 0, None)))
    engine_only = jax.jit(_engine_only)

    start = time.perf_counter()
    jax.block_until_ready(step.lower(None, states, actions, params).compile())
    compile_s = time.perf_counter() - start
    engine_only.lower(params, states, actions).compile()

    step_s, engine_s, mean_iterations, max_iterations = [], [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(engine_only(params, states, actions))
        engine_s.append(time.perf_counter() - start)
        before = np.asarray(states.engine.iterations)
        start = time.perf_counter()
        _, states, reward, *_ = step(None, states, actions, params)
        jax.block_until_ready(reward)
        step_s.append(time.perf_counter() - start)
        done = np.asarray(states.engine.iterations) - before
        mean_iterations.append(done.mean())
        max_iterations.append(done.max())
    total = sum(step_s)
    return {"compile_s": compile_s, "steps_per_s": steps * num_envs / total,
            "engine_share": sum(engine_s) / total,
            "iterations_mean": float(np.mean(mean_iterations)), "iterations_max": float(np.mean(max_iterations)),
            "us_per_env_iteration": total / (num_envs * sum(max_iterations)) * 1e6}


def bench_split(world, num_envs: int, steps: int) -> float:
    """Steps per second of the core's step split across the cores as the vector adapter splits it
    (servetune/parallel.py), the states kept in the split layout between steps."""
    params = world.params
    keys = jax.random.split(jax.random.PRNGKey(0), num_envs)
    _, states = jax.jit(jax.vmap(core.control_reset, (0, None)))(keys, params)
    actions = _batched(params.config_action, num_envs)
    step = jax.jit(across_cores(lambda s, a, p: jax.vmap(core.control_step, (None, 0, 0, None))(None, s, a, p),
                                (True, True, False)))
    states = laid_out(states, num_envs)
    jax.block_until_ready(step(states, actions, params))
    start = time.perf_counter()
    for _ in range(steps):
        _, states, reward, *_ = step(states, actions, params)
        states = laid_out(states, num_envs)
    jax.block_until_ready(reward)
    return steps * num_envs / (time.perf_counter() - start)


def bench_adapter(options: dict, num_envs: int, steps: int) -> dict:
    env = gym.make_vec("servetune/ServeControl-v0", num_envs=num_envs, vectorization_mode="vector_entry_point",
                       config=CHAT, **options)
    action = np.broadcast_to(np.asarray(env.unwrapped.world.params.config_action), env.action_space.shape)
    env.reset(seed=0)
    start = time.perf_counter()
    env.step(action)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        env.step(action)
    return {"compile_s": compile_s, "steps_per_s": steps * num_envs / (time.perf_counter() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--seats", type=int, nargs="+", default=[256, 64],
                        help="upper bounds of max_num_seqs (the slot table's size)")
    parser.add_argument("--steps", type=int, default=20, help="timed control steps per measurement")
    parser.add_argument("--episode-s", type=float, default=None,
                        help="episode length (default: the config's, none: every request of the workload)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; episode_s {args.episode_s}")
    print("| seats | envs | core steps/s (= serving-s per wall-s) | core split across cores | adapter steps/s "
          "| engine loop share | loop iterations/step: mean, slowest env | us per env-iteration | compile s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seats in args.seats:
        options = {"bounds": {"max_num_seqs": (1, seats)}, "episode_s": args.episode_s}
        world = build_world(CHAT, **options)
        print(f"seats {seats}: slot table {world.params.num_slots}, {max(world.window_counts)} requests per "
              f"episode", flush=True)
        for num_envs in args.envs:
            core_numbers = bench_core(world, num_envs, args.steps)
            split = bench_split(world, num_envs, args.steps)
            adapter = bench_adapter(options, num_envs, args.steps)
            print(f"| {seats} | {num_envs} | {core_numbers['steps_per_s']:,.0f} | {split:,.0f} "
                  f"| {adapter['steps_per_s']:,.0f} "
                  f"| {core_numbers['engine_share']:.0%} | {core_numbers['iterations_mean']:.1f}, "
                  f"{core_numbers['iterations_max']:.1f} | {core_numbers['us_per_env_iteration']:.1f} "
                  f"| {core_numbers['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
