"""Headroom for an adaptive scheduler on the diurnal scenario (examples/diurnal.yaml).

How much more goodput than the best *static* config can a policy that changes the knobs during the day get?
This measures a lower bound on that headroom with a *phase oracle*: the day is cut into phases by its rate
profile, and one knob setting per phase (an open-loop, piecewise-constant schedule of ServeControl actions) is
optimised by coordinate descent over the phases, each candidate judged by whole-day ServeControl episodes, so a
phase's knobs are judged with the queue the previous phase leaves behind and the backlog they leave to the next.
An RL policy that only learned "which phase is it" could reach it; one that reacts to bursts could do better.

1. Static best: ``servetune tune`` on the config's search space (the four action knobs, chunked prefill fixed
   on), ``--trials`` trials, which also runs vLLM's defaults (enqueued baselines); and a random search over
   constant actions judged by the same episodes as the oracle, on the tuning seeds. The better of the two is
   the static baseline (so the gain is not inflated by a weak baseline).
2. Phase oracle: start from the static best in every phase; per phase, ``--candidates`` actions (the
   incumbent, perturbations of it, uniform draws) with every other phase held; keep the best; ``--rounds``
   sweeps over the phases.
3. Both schedules are replayed through ``gymnasium.make("servetune/ServeControl-v0", ...)`` on the tuning
   seeds and on held-out seeds (not used for tuning), and the episode's ``info["metrics"]["request_goodput"]``
   is reported, with vLLM's defaults for scale.
4. Speed: ``gymnasium.make_vec(..., num_envs=256, vectorization_mode="vector_entry_point")`` steps per second.

    python results/experiments/bench_diurnal_headroom.py --max-num-seqs 128 --phase-hours 7,11   # examples/diurnal.yaml
    python results/experiments/bench_diurnal_headroom.py examples/scenarios/diurnal_chat.yaml --phase-hours 8,11,17
    python results/experiments/bench_diurnal_headroom.py --static-trials 0 --candidates 64 --rounds 1   # a quick look

Run it from the repository root: the config's path is part of the study's identity.

The rate profile and phase clock come from the config's ServeGen arrivals, or its tenants' own.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

import servetune  # noqa: F401  (registers the ids)
from servetune.cli_args import add_config_arguments
from servetune.envs.gym import core
from servetune.envs.gym.actions import INT_KNOBS, decode, encode
from servetune.envs.gym.world import build_world, load_env_config
from servetune.envs.workload.arrivals import read_servegen_trace

DIURNAL = "examples/diurnal.yaml"   # run from the repository root (the study hash includes the path)


def arrival_processes(config_path: str, overrides) -> list:
    """The config's arrival processes: its tenants' own, or the workload's one."""
    workload = load_env_config(config_path, overrides).workload
    return [tenant.arrivals for tenant in workload.tenants] if workload.tenant_arrivals else [workload.arrivals]


def phases_from_profile(config_path: str, overrides, horizon_s: float, hours: list[float]) -> list[tuple[float, float]]:
    """Phase boundaries given in hours of the (uncompressed) day, mapped to the compressed clock."""
    scales = {arrivals.time_scale for arrivals in arrival_processes(config_path, overrides)}
    if len(scales) != 1:
        raise SystemExit(f"{config_path}: the tenants' arrivals play their days at different speeds {sorted(scales)}")
    scale = scales.pop()
    edges = sorted({0.0, *[h * 3600.0 / scale for h in hours], horizon_s})
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if a < horizon_s]


def rate_profile(config_path: str, overrides) -> list[tuple[float, float]]:
    """(start s, rate req/s) of each window on the compressed clock, as the arrivals generate them: the
    workload's ServeGen arrivals, or the sum of its tenants' own."""
    total: dict[float, float] = {}
    for arrivals in arrival_processes(config_path, overrides):
        for window in read_servegen_trace(arrivals.path):   # the loader made the path absolute
            start = window.start_s / arrivals.time_scale
            total[start] = total.get(start, 0.0) + window.rate * arrivals.rate_scale * arrivals.time_scale
    return sorted(total.items())


class Evaluator:
    """Whole-day episodes of action schedules, vmapped: good completions per (schedule, workload)."""

    def __init__(self, world, steps: int):
        self.params = world.params
        self.steps = steps
        params = self.params

        def episode(variant, schedule):
            _, state = core.control_reset_to(variant, params)

            def body(state, action):
                _, new, _, _, _, _ = core.control_step(None, state, action, params)
                return new, None

            state, _ = jax.lax.scan(body, state, schedule)
            return state.good, state.missed

        self._run = jax.jit(jax.vmap(episode))

    def good(self, schedules: np.ndarray, variants: list[int], chunk: int = 768) -> np.ndarray:
        """schedules [N, steps, A] -> good [N, len(variants)]."""
        n = schedules.shape[0]
        pairs_s = np.repeat(schedules, len(variants), axis=0)
        pairs_v = np.tile(np.asarray(variants, np.int32), n)
        out = []
        for start in range(0, len(pairs_v), chunk):
            s, v = pairs_s[start:start + chunk], pairs_v[start:start + chunk]
            pad = chunk - len(v) if len(pairs_v) > chunk else 0
            if pad:
                s = np.concatenate([s, np.repeat(s[-1:], pad, axis=0)])
                v = np.concatenate([v, np.repeat(v[-1:], pad)])
            good, _ = self._run(jnp.asarray(v), jnp.asarray(s, jnp.float32))
            out.append(np.asarray(good)[:len(v) - pad])
        return np.concatenate(out).reshape(n, len(variants))


def knobs_of(world, action) -> dict:
    k = decode(jnp.asarray(action), world.params.bounds)
    queue = int(k.max_num_queued_reqs)
    return {"max_num_seqs": int(k.max_num_seqs), "max_num_batched_tokens": int(k.max_num_batched_tokens),
            "long_prefill_token_threshold": int(k.long_prefill_token_threshold),
            "max_num_queued_reqs": None if queue >= 2**30 else queue}


def gym_goodput(config, overrides, options, actions_per_step: np.ndarray, variant: int) -> dict:
    env = gym.make("servetune/ServeControl-v0", config=config, overrides=list(overrides), **options)
    env.reset(options={"workload": variant})
    info = {}
    for action in actions_per_step:
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    while not ("metrics" in info):   # a schedule shorter than the episode: hold the last action
        _, _, terminated, truncated, info = env.step(actions_per_step[-1])
    m = info["metrics"]
    return {"request_goodput": m["request_goodput"], "slo_attainment": m["slo_attainment"],
            "arrived": m["arrived"], "rejected": m["rejected"], "completed": m["completed"]}


def run_static_study(config, overrides, trials, storage, study) -> dict:
    """`servetune tune`; returns the best trial's knobs and the baselines' metrics (from the storage)."""
    import optuna
    cmd = ["servetune", "tune", config, "--trials", str(trials), "--study", study, "--storage", storage]
    for o in overrides:
        cmd += ["--set", o]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage if "://" in storage else f"sqlite:///{storage}"
    s = optuna.load_study(study_name=study, storage=url)
    done = [t for t in s.trials if t.state.name == "COMPLETE"]
    feasible = [t for t in done if t.user_attrs.get("slo_attainment", 0) >= 0.9] or done
    best = max(feasible, key=lambda t: t.values[0])
    rows = {"best": best}
    for t in done:
        if t.user_attrs.get("baseline"):
            rows[t.user_attrs["baseline"]] = t
    out = {}
    for name, t in rows.items():
        out[name] = {"trial": t.number, "goodput": t.values[0], "attainment": t.user_attrs.get("slo_attainment"),
                     "knobs": {k.split(".")[-1]: v for k, v in t.params.items()}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, default=DIURNAL)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the env's bound on max_num_seqs")
    parser.add_argument("--phase-hours", default="8,11",
                        help="phase boundaries in hours of the uncompressed day (default: trough | peak | day)")
    parser.add_argument("--tune-seeds", type=int, default=3, help="workload variants 0..n-1 used for tuning")
    parser.add_argument("--test-seeds", type=int, default=3, help="the next n variants, held out")
    parser.add_argument("--static-trials", type=int, default=100)
    parser.add_argument("--static-random", type=int, default=256, help="constant actions tried by the env search")
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--miss-penalty", type=float, default=1.0)
    parser.add_argument("--storage", default="/tmp/diurnal.db")
    parser.add_argument("--study", default="diurnal-static")
    parser.add_argument("--speed-envs", type=int, default=256)
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.time()

    variants_tune = list(range(args.tune_seeds))
    variants_test = list(range(args.tune_seeds, args.tune_seeds + args.test_seeds))
    bounds = {"max_num_seqs": (1, args.max_num_seqs)}
    options = dict(bounds=bounds, interval_s=args.interval_s, num_workloads=args.tune_seeds + args.test_seeds,
                   miss_penalty=args.miss_penalty)
    world = build_world(args.config, overrides=args.overrides, **options)
    config = world.config
    horizon = config.simulation.horizon_s
    steps = int(math.ceil(horizon / args.interval_s))
    hours = [float(h) for h in args.phase_hours.split(",") if h]
    phases = phases_from_profile(args.config, args.overrides, horizon, hours)
    step_start = np.arange(steps) * args.interval_s
    phase_of_step = np.array([max(i for i, (a, _) in enumerate(phases) if s >= a) for s in step_start])
    P = len(phases)
    A = int(world.params.config_action.shape[0])
    result = {"config": args.config, "overrides": args.overrides, "options": {**options, "bounds": bounds},
              "phases_s": phases, "requests_per_variant": list(world.window_counts)}
    profile = rate_profile(args.config, args.overrides)
    for i, (a, b) in enumerate(phases):
        rates = [r for s, r in profile if a <= s < b]
        print(f"phase {i}: [{a:g}, {b:g}) s, mean offered rate {np.mean(rates):.2f} req/s (windows {min(rates):.2f}"
              f"–{max(rates):.2f})")
    print(f"requests per variant: {list(world.window_counts)}; {steps} control steps of {args.interval_s:g} s")

    ev = Evaluator(world, steps)
    vllm_action = np.asarray(world.params.vllm_action)
    config_action = np.asarray(world.params.config_action)

    # --- static: the Optuna study ------------------------------------------------------------------------
    study = {}
    if args.static_trials:
        study = run_static_study(args.config, args.overrides, args.static_trials, args.storage, args.study)
        for name, row in study.items():
            print(f"study {name}: trial {row['trial']} goodput {row['goodput']:.3f} attainment "
                  f"{row['attainment']:.3f} {row['knobs']}")
        result["study"] = study
    # --- static: random constant actions on the tuning seeds ---------------------------------------------
    cands = [config_action, vllm_action]
    if study:
        cands.append(encode({k: study["best"]["knobs"].get(k, getattr(config.scheduler, k)) for k in INT_KNOBS},
                            world.params.bounds))
    cands += list(rng.uniform(-1, 1, (args.static_random, A)).astype(np.float32))
    cands = np.stack(cands).astype(np.float32)
    t = time.time()
    good = ev.good(np.repeat(cands[:, None, :], steps, axis=1), variants_tune).sum(1)
    print(f"static search: {len(cands)} constant actions x {len(variants_tune)} seeds in {time.time() - t:.1f} s; "
          f"config {good[0]}, vllm {good[1]}" + (f", study best {good[2]}" if study else "") + f", best {good.max()}")
    # local refinement around the best constant action
    best_static = cands[int(np.argmax(good))]
    best_static_good = good.max()
    for scale in (0.3, 0.1):
        local = np.clip(best_static + rng.normal(0, scale, (args.static_random // 2, A)), -1, 1).astype(np.float32)
        local = np.concatenate([best_static[None], local])
        g = ev.good(np.repeat(local[:, None, :], steps, axis=1), variants_tune).sum(1)
        if g.max() > best_static_good:
            best_static, best_static_good = local[int(np.argmax(g))], g.max()
    print(f"static best (good over tuning seeds) {best_static_good}: {knobs_of(world, best_static)}")
    result["static_knobs"] = knobs_of(world, best_static)

    # --- phase oracle --------------------------------------------------------------------------------------
    phase_actions = np.repeat(best_static[None], P, axis=0)
    incumbent = best_static_good
    for round_ in range(args.rounds):
        for p in range(P):
            n = args.candidates
            local = np.clip(phase_actions[p] + rng.normal(0, 0.25, (n // 2, A)), -1, 1)
            uniform = rng.uniform(-1, 1, (n - n // 2 - 1, A))
            cand = np.concatenate([phase_actions[p][None], local, uniform]).astype(np.float32)
            sched = np.repeat(phase_actions[None], len(cand), axis=0)
            sched[:, p] = cand
            t = time.time()
            g = ev.good(sched[:, phase_of_step], variants_tune).sum(1)
            phase_actions[p] = cand[int(np.argmax(g))]
            incumbent = g.max()
            print(f"round {round_} phase {p}: good {g[0]} -> {incumbent} ({time.time() - t:.1f} s) "
                  f"{knobs_of(world, phase_actions[p])}", flush=True)
    result["phase_knobs"] = [knobs_of(world, a) for a in phase_actions]

    # --- replay through the Gymnasium env ------------------------------------------------------------------
    rows = []
    for v in variants_tune + variants_test:
        row = {"workload": v, "split": "tune" if v in variants_tune else "held-out"}
        for name, sched in (("vllm", np.repeat(vllm_action[None], steps, 0)),
                            ("static", np.repeat(best_static[None], steps, 0)),
                            ("oracle", phase_actions[phase_of_step])):
            row[name] = gym_goodput(args.config, args.overrides, options, sched, v)
        row["gain_pct"] = 100 * (row["oracle"]["request_goodput"] / row["static"]["request_goodput"] - 1)
        rows.append(row)
        print(f"workload {v} ({row['split']}): vllm {row['vllm']['request_goodput']:.3f}  static "
              f"{row['static']['request_goodput']:.3f} ({row['static']['slo_attainment']:.3f})  oracle "
              f"{row['oracle']['request_goodput']:.3f} ({row['oracle']['slo_attainment']:.3f})  gain "
              f"{row['gain_pct']:+.1f}%  [arrived {row['static']['arrived']}]", flush=True)
    result["episodes"] = rows
    for split in ("tune", "held-out"):
        sel = [r for r in rows if r["split"] == split]
        if sel:
            s = np.mean([r["static"]["request_goodput"] for r in sel])
            o = np.mean([r["oracle"]["request_goodput"] for r in sel])
            vl = np.mean([r["vllm"]["request_goodput"] for r in sel])
            print(f"{split}: mean goodput vllm {vl:.3f}, static {s:.3f}, phase oracle {o:.3f}: gain {100*(o/s-1):+.1f}%")
            result[f"mean_{split}"] = {"vllm": vl, "static": s, "oracle": o, "gain_pct": 100 * (o / s - 1)}

    # --- speed ---------------------------------------------------------------------------------------------
    if args.speed_envs:
        envs = gym.make_vec("servetune/ServeControl-v0", num_envs=args.speed_envs,
                            vectorization_mode="vector_entry_point", config=args.config,
                            overrides=list(args.overrides), **options)
        action = np.repeat(best_static[None], args.speed_envs, 0)
        envs.reset(seed=0)
        envs.step(action)              # compiles
        envs.reset(seed=0)
        t = time.time()
        for _ in range(steps):         # a whole day: the night's steps are cheaper than the peak's
            envs.step(action)
        wall = time.time() - t
        sps = steps * args.speed_envs / wall
        print(f"speed: {args.speed_envs} envs, a whole day ({steps} steps) in {wall:.1f} s: {sps:,.0f} control "
              f"steps/s = {sps * args.interval_s:,.0f} simulated serving-s per wall-s")
        result["speed"] = {"envs": args.speed_envs, "steps_per_s": sps, "sim_s_per_s": sps * args.interval_s}
    result["wall_s"] = time.time() - t0
    print(f"total {result['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
