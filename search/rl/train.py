"""``servetune train-rl``: PPO (search/rl/ppo.py) on ServeControl over a config's world, with a progress bar,
checkpoints, a learning curve and, at the end, the policy file (search/rl/policy_file.py).

The environment is the one ``gymnasium.make("servetune/ServeControl-v0", config=...)`` builds with the
config's ``rl`` options (interval, episode, workload variants, miss penalty, knob bounds), driven through its
functional core (envs/gym/core.py) so that the whole rollout stays on the device.

The output folder holds:

- ``policy.safetensors``: the actor, its observation statistics and the config hash (search/rl/policy_file.py);
- ``checkpoint.safetensors``: the learner (networks, optimiser, normalisation statistics, key, update count),
  every ``rl.checkpoint_every`` updates and at the end; ``--resume`` continues from it;
- ``training.json``: per update the timesteps, mean episode return, goodput and SLO attainment of the
  episodes that ended in it, the losses, and the speed (environment steps per second, compile time);
- ``learning_curve.png``: return, goodput and attainment against timesteps.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from servetune.config import Config
from servetune.envs.gym import core
from servetune.envs.gym.actions import action_names
from servetune.envs.gym.world import World, build_world
from servetune.errors import UserError
from servetune.search.rl.es import EsEnv, EsState, EsTrainer, make_es
from servetune.search.rl.policy_file import write_policy
from servetune.search.rl.ppo import EnvSpec, TrainState, Trainer, make_train
from servetune.search.provenance import config_data, content_data
from servetune.versions import software_versions

POLICY_FILE, CHECKPOINT_FILE, HISTORY_FILE, CURVE_FILE = (
    "policy.safetensors", "checkpoint.safetensors", "training.json", "learning_curve.png")
# ServeControl's per-step info entries the logs total over an episode, and the one read at its last step.
EPISODE_SUMS = ("good", "missed", "arrived", "completed", "rejected")
EPISODE_LAST = ("time_s",)


def control_world(config: Config, num_workloads: Optional[int] = None, bounds="rl") -> World:
    """ServeControl's world under the config's rl options; ``bounds``: "rl" for rl.bounds, or a mapping."""
    rl = config.rl
    try:
        return build_world(config, interval_s=rl.interval_s, episode_s=rl.episode_s,
                           num_workloads=num_workloads or rl.num_workloads, miss_penalty=rl.miss_penalty,
                           bounds=dict(rl.bounds or ()) if bounds == "rl" else bounds)
    except ValueError as error:   # build_world's checks of the config (gym.make raises them as they are)
        raise UserError(f"{config.source or 'config'}: {error}") from None


def env_spec(world: World) -> EnvSpec:
    return EnvSpec(reset=core.control_reset, step=core.control_step, params=world.params,
                   obs_size=len(core.control_observation_names(world)),
                   action_size=len(action_names(world.params.bounds)),
                   episode_sums=EPISODE_SUMS, episode_last=EPISODE_LAST,
                   # Inside the box, so that the Gaussian explores both sides of a knob at its bound.
                   initial_action=jnp.clip(world.params.config_action, -0.95, 0.95))


def _without_nulls(data):
    """``data`` without its null entries: an optional field that a later servetune adds (null by default)
    leaves the hash of every earlier config, and so every trained policy, as it was."""
    if isinstance(data, dict):
        return {key: _without_nulls(value) for key, value in data.items() if value is not None}
    if isinstance(data, list):
        return [_without_nulls(value) for value in data]
    return data


def policy_hash(config: Config) -> str:
    """The hash of the world a policy acts in: the config less its search section (how a study runs) and less
    the rl fields that only say how PPO trains. The files it names count by their content (policy files of
    format 1 hashed their absolute paths, which no clone elsewhere reproduces)."""
    data = content_data(config)
    data.pop("search")
    data["rl"] = {key: data["rl"][key] for key in ("interval_s", "episode_s", "num_workloads", "miss_penalty", "bounds")}
    return hashlib.sha256(json.dumps(_without_nulls(data), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: the learner's leaves by their pytree paths.

def _learner(state: TrainState) -> dict:
    return {"network": state.network, "opt_state": state.opt_state, "obs_stats": state.obs_stats,
            "return_stats": state.return_stats, "key": state.key, "update": state.update}


def _es_learner(state: EsState) -> dict:
    return {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}


def _learner_of(state) -> dict:
    return _es_learner(state) if isinstance(state, EsState) else _learner(state)


def save_checkpoint(path: Path, state) -> None:
    """The learner (a PPO TrainState's, or an EsState whole) as safetensors, by pytree path."""
    leaves = jax.tree_util.tree_flatten_with_path(_learner_of(state))[0]
    # np.array, not np.ascontiguousarray: that one makes 0-d leaves (counts, the update number) 1-d.
    save_file({jax.tree_util.keystr(p): np.array(v, order="C") for p, v in leaves}, str(path))


def load_checkpoint(path: Path, template):
    """``template`` (a fresh ``trainer.init``) with the learner's leaves read from ``path``; a PPO state's
    environments start afresh (they are not checkpointed: they are large and restart at a reset anyway)."""
    saved = load_file(str(path))
    paths, treedef = jax.tree_util.tree_flatten_with_path(_learner_of(template))
    leaves = []
    for p, leaf in paths:
        name = jax.tree_util.keystr(p)
        if name not in saved or saved[name].shape != np.shape(leaf):
            raise UserError(f"{path}: checkpoint does not match this config's learner, network and optimiser "
                            f"({name} missing or of another shape); train afresh or use another --out")
        leaves.append(jnp.asarray(saved[name], dtype=np.asarray(leaf).dtype))
    return dataclasses.replace(template, **jax.tree_util.tree_unflatten(treedef, leaves))


# ---------------------------------------------------------------------------------------------------------
# Training

@dataclass(frozen=True)
class TrainingResult:
    out: Path
    history: list[dict]
    compile_s: float
    train_s: float
    steps_per_s: float


def _episode_figures(metrics: dict) -> dict:
    """An update's logs: the mean over the episodes that ended in it (None when none did)."""
    episodes = int(metrics["episodes"])
    row = {"episodes": episodes, **{k: float(v) for k, v in metrics.items()
                                    if not k.startswith("episode_") and k != "episodes"}}
    if episodes:
        good, arrived, clock = (float(metrics[f"episode_{n}"]) for n in ("good", "arrived", "time_s"))
        row.update(episode_return=float(metrics["episode_return"]),
                   goodput=good / clock if clock > 0 else 0.0,
                   slo_attainment=good / arrived if arrived > 0 else None)
    return row


CURVES = {
    "ppo": (("episode_return", "episode return"), ("goodput", "goodput (req/s)"), ("slo_attainment", "SLO attainment")),
    "es": (("gain_over_static", "return over the config's\nknobs, same days"), ("goodput", "goodput (req/s)"),
           ("slo_attainment", "SLO attainment")),
}
CURVE_NOTES = {"ppo": "training episodes: sampled actions (eval-policy plays the mean)",
               "es": "the policy itself (the population's centre) on each generation's days"}


def write_curve(history: list[dict], path: Path, title: str, algo: str = "ppo") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in history if row["episodes"]]
    steps = [row["timesteps"] for row in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for ax, (key, label) in zip(axes, CURVES[algo]):
        ax.plot(steps, [row.get(key) if row.get(key) is not None else np.nan for row in rows], lw=1.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if algo == "es":
        axes[0].axhline(0.0, color="grey", lw=0.8)
        axes[0].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    axes[-1].set_xlabel("environment steps (control intervals)")
    axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class _Learner:
    """PPO's Trainer or ES's EsTrainer as the training loop drives it: one jitted step (an update, or a
    generation), how many, and the environment steps each takes."""

    init: Callable
    step: Callable
    compile: Callable      # state -> ``step`` compiled ahead for that state
    num_steps: int
    env_steps_per_step: int
    network: Callable      # state -> the actor's network dict
    obs_stats: Callable    # state -> (mean, var) the actor normalises with


def _make_learner(config: Config, world: World) -> _Learner:
    rl = config.rl
    if rl.algo == "es":
        es: EsTrainer = make_es(es_env(world, rl), rl)
        return _Learner(es.init, es.generation, es.compile, es.num_generations, es.steps_per_generation,
                        es.network, lambda state: (state.obs_mean, state.obs_var))
    ppo: Trainer = make_train(env_spec(world), rl)
    return _Learner(ppo.init, ppo.update, ppo.compile, ppo.num_updates,
                    ppo.steps_per_update, lambda state: state.network,
                    lambda state: (state.obs_stats.mean, state.obs_stats.var))


def feature_indices(world: World, features) -> tuple[int, ...]:
    """The positions of ``rl.features`` among ServeControl's observations (all of them for None)."""
    names = core.control_observation_names(world)
    if features is None:
        return tuple(range(len(names)))
    unknown = [name for name in features if name not in names]
    if unknown:
        raise UserError(f"rl.features: {unknown[0]!r} is not one of this world's observations "
                        f"({', '.join(names)})")
    return tuple(names.index(name) for name in features)


def es_env(world: World, rl) -> EsEnv:
    return EsEnv(reset_to=core.control_reset_to, step=core.control_step, params=world.params,
                 obs_size=len(core.control_observation_names(world)),
                 action_size=len(action_names(world.params.bounds)), intervals=intervals_per_episode(world),
                 num_days=len(world.workloads), initial_action=world.params.config_action,
                 features=feature_indices(world, rl.features))


def _write_history(out: Path, config: Config, learner: _Learner, history: list[dict], compile_s: float,
                   train_s: float, steps_timed: int) -> float:
    """training.json; returns the environment steps per second of the updates this run timed."""
    steps_per_s = learner.env_steps_per_step * steps_timed / max(train_s, 1e-9)
    (out / HISTORY_FILE).write_text(json.dumps({
        "config_source": config.source, "config_hash": policy_hash(config), "algo": config.rl.algo,
        "compile_s": compile_s, "train_s": train_s, "env_steps_per_s": steps_per_s,
        "steps_per_update": learner.env_steps_per_step, "num_updates": learner.num_steps,
        "history": history}, indent=1) + "\n")
    return steps_per_s


def train_policy(config: Config, world: World, out: Path, resume: bool = False,
                 on_update: Optional[Callable[[dict, int], None]] = None) -> TrainingResult:
    """Train on ``world`` (``control_world(config)``) with ``rl.algo`` and write the output folder;
    ``on_update(row, total)`` after each update or generation (for a progress bar)."""
    rl = config.rl
    learner = _make_learner(config, world)
    out.mkdir(parents=True, exist_ok=True)
    state = learner.init(jax.random.PRNGKey(rl.seed))
    history: list[dict] = []
    if resume:
        checkpoint = out / CHECKPOINT_FILE
        if not checkpoint.is_file():
            raise UserError(f"--resume: {checkpoint} does not exist; train without --resume first")
        state = load_checkpoint(checkpoint, state)
        if (out / HISTORY_FILE).is_file():
            history = json.loads((out / HISTORY_FILE).read_text())["history"][:int(_done(state))]

    compile_start = time.perf_counter()
    compiled = learner.compile(state)
    compile_s = time.perf_counter() - compile_start
    first = int(_done(state))
    start = time.perf_counter()
    for update in range(first, learner.num_steps):
        state, metrics = compiled(state)
        row = {"update": update + 1, "timesteps": (update + 1) * learner.env_steps_per_step,
               **_episode_figures(jax.device_get(metrics))}
        history.append(row)
        if on_update is not None:
            on_update(row, learner.num_steps)
        if (update + 1) % rl.checkpoint_every == 0:
            # The history with it, so that a resumed run's curve starts at the beginning.
            save_checkpoint(out / CHECKPOINT_FILE, state)
            _write_history(out, config, learner, history, compile_s, time.perf_counter() - start, update + 1 - first)
    train_s = time.perf_counter() - start
    steps_per_s = _write_history(out, config, learner, history, compile_s, train_s, learner.num_steps - first)

    save_checkpoint(out / CHECKPOINT_FILE, state)
    names = core.control_observation_names(world)
    # The config's path from the policy's folder: a repository moved whole, or cloned elsewhere, still finds it.
    config_path = "" if not (config.source and Path(config.source).is_file()) else \
        os.path.relpath(Path(config.source).resolve(), out.resolve())
    obs_mean, obs_var = learner.obs_stats(state)
    write_policy(out / POLICY_FILE, learner.network(state), obs_mean, obs_var,
                 world.params.bounds.log_low, world.params.bounds.log_high, world.params.bounds.weight_units,
                 {"config_hash": policy_hash(config), "config": json.dumps(config_data(config)),
                  "config_source": config.source or "", "config_path": config_path,
                  "software": software_versions(), "observation_names": list(names),
                  "action_names": list(action_names(world.params.bounds)), "bounds": world.bounds,
                  "interval_s": rl.interval_s, "episode_s": world.episode_s, "algo": rl.algo,
                  "features": [names[i] for i in feature_indices(world, rl.features)],
                  "timesteps": learner.num_steps * learner.env_steps_per_step, "seed": rl.seed,
                  "trained_workloads": len(world.workloads)})
    write_curve(history, out / CURVE_FILE, f"{rl.algo.upper()} on {Path(config.source or 'config').name}\n"
                                           f"{CURVE_NOTES[rl.algo]}", rl.algo)
    return TrainingResult(out, history, compile_s, train_s, steps_per_s)


def _done(state) -> int:
    """Updates (PPO) or generations (ES) a learner's state has done."""
    return int(state.generation if isinstance(state, EsState) else state.update)


def intervals_per_episode(world: World) -> int:
    if world.episode_s is None:
        raise UserError("rl: an episode needs a time limit for evaluation; set rl.episode_s or simulation.horizon_s")
    return math.ceil(world.episode_s / float(world.params.interval_s))
