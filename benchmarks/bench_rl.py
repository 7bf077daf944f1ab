"""Where PPO's training time goes: environment steps per second of whole updates (rollout + learning) against
the rollout alone, for a few numbers of environments, after compilation.

    python benchmarks/bench_rl.py                          # examples/diurnal.yaml, 64 and 256 envs
    python benchmarks/bench_rl.py examples/chat.yaml --set rl.episode_s=60 --envs 1,64,256

One environment step is one control interval (rl.interval_s of simulated serving). Prints a Markdown table for
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax

from servetune.cli_args import add_config_arguments
from servetune.config_loader import load_config
from servetune.search.rl.ppo import make_train
from servetune.search.rl.train import control_world, env_spec


def _rate(function, state, steps_per_call: int, seconds: float) -> tuple[float, float]:
    """(steps per second, compile seconds) of repeated calls of a jitted function of the train state."""
    start = time.perf_counter()
    compiled = jax.jit(function).lower(state).compile()
    compile_s = time.perf_counter() - start
    state = jax.block_until_ready(compiled(state))
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < 2:
        state = jax.block_until_ready(compiled(state))
        calls += 1
    return calls * steps_per_call / (time.perf_counter() - start), compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, default="examples/diurnal.yaml")
    parser.add_argument("--envs", default="64,256", help="comma-separated numbers of environments")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per measurement")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    world = control_world(config)
    print(f"{args.config}: {len(world.workloads)} workload variants, episode {world.episode_s} s in "
          f"{float(world.params.interval_s):g} s intervals, {world.params.num_slots} slots; "
          f"rl.num_steps {config.rl.num_steps}")
    print("| envs | update: env steps/s | rollout alone: env steps/s | learning's share | compile (update) |")
    print("|---:|---:|---:|---:|---:|")
    for envs in (int(n) for n in args.envs.split(",")):
        rl = dataclasses.replace(config.rl, num_envs=envs, num_minibatches=min(config.rl.num_minibatches, envs))
        trainer = make_train(env_spec(world), rl)
        state = trainer.init(jax.random.PRNGKey(0))
        update_rate, update_compile = _rate(lambda s: trainer.update(s)[0], state, trainer.steps_per_update,
                                            args.seconds)
        rollout_rate, _ = _rate(trainer.rollout, state, trainer.steps_per_update, args.seconds)
        share = 1.0 - update_rate / rollout_rate
        print(f"| {envs:,} | {update_rate:,.0f} | {rollout_rate:,.0f} | {share:.0%} | {update_compile:.1f} s |")


if __name__ == "__main__":
    main()
