"""Gymnasium adapters of ServeClusterControl (envs/gym/cluster_control.py): NumPy in and out.

``gymnasium.make("servetune/ServeClusterControl-v0", config=PATH_OR_DICT, **options)`` (registered on
``import servetune``) builds ``ServeClusterControlEnv``; ``gymnasium.make_vec(..., vectorization_mode=
"vector_entry_point")`` builds the vector env, which vmaps the same jitted core. Options: ServeControl's
(envs/gym/adapters.py) plus ``weight_bounds`` ({signal: (low, high)} of the router's weights). Seeding, resets
(``options={"workload": i}``), autoreset and infos are ServeControl's; ``info["metrics"]`` at an episode's end is
run.json's of the cluster's run (envs/gym/cluster_report.py). ``render_mode="ansi"`` prints one status line.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import gymnasium as gym
import jax
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from servetune.envs.gym import cluster_control as cc
from servetune.envs.gym import core
from servetune.envs.gym.adapters import _UNIT_FIELDS, _action, _host, _SeededEnv, _VectorEnv, _workload_index
from servetune.envs.gym.cluster_report import cluster_episode_metrics, cluster_episode_outcome
from servetune.envs.gym.render import status_line

RENDER_MODES = ["ansi"]

_reset = jax.jit(cc.cluster_reset)
_reset_to = jax.jit(cc.cluster_reset_to)
_step = jax.jit(cc.cluster_step)
_decode_weights = jax.jit(cc.decode_weights)


def observation_space(world: cc.ClusterWorld) -> spaces.Box:
    names = cc.cluster_observation_names(world)
    low = np.array([-1.0 if name.startswith("knob_") else 0.0 for name in names], np.float32)
    bounded = {name for name in names if name.startswith("knob_") or name in _UNIT_FIELDS
               or name.endswith("_kv_utilization")}
    high = np.array([1.0 if name in bounded else np.inf for name in names], np.float32)
    return spaces.Box(low, high, dtype=np.float32)


def action_space(world: cc.ClusterWorld) -> spaces.Box:
    return spaces.Box(-1.0, 1.0, (len(cc.cluster_action_names(world)),), np.float32)


def _check_render_mode(render_mode: Optional[str]) -> None:
    if render_mode is not None and render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode: got {render_mode!r}, expected one of {RENDER_MODES} or None")


def _frame(world: cc.ClusterWorld, state: cc.ClusterControlState, obs, reward: Optional[float]) -> str:
    weights = np.asarray(_decode_weights(state.action, world.params))
    names = cc.cluster_observation_names(world)
    clock = float(state.interval) * float(world.params.env.interval_s)
    return f"t={clock:g}s " + status_line(names, obs, reward, {f"w_{s}": f"{w:g}" for s, w in zip(cc.SIGNALS, weights)})


class ServeClusterControlEnv(_SeededEnv):
    """Steer a cluster's router weights (and its replicas' knobs) every control interval
    (envs/gym/cluster_control.py documents the MDP)."""

    metadata = {"render_modes": RENDER_MODES, "render_fps": 4}

    def __init__(self, config, render_mode: Optional[str] = None, **options: Any) -> None:
        _check_render_mode(render_mode)
        self.render_mode = render_mode
        self.world = cc.build_cluster_world(config, **options)
        self.observation_names = cc.cluster_observation_names(self.world)
        self.action_names = cc.cluster_action_names(self.world)
        self.observation_space = observation_space(self.world)
        self.action_space = action_space(self.world)
        self._key = None
        self._state: Optional[cc.ClusterControlState] = None
        self._obs, self._reward, self._done = None, None, False

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        key = self._next_key(seed)
        workload = (options or {}).get("workload")
        params = self.world.params
        obs, self._state = (_reset(key, params) if workload is None
                            else _reset_to(_workload_index(workload, self.world), params))
        self._reward, self._done = None, False
        self._obs = np.asarray(obs)
        return self._obs, {"workload": int(self._state.variant)}

    def step(self, action):
        if self._state is None or self._done:
            raise gym.error.ResetNeeded("call reset() to start an episode")
        obs, self._state, reward, terminated, truncated, info = _step(
            None, self._state, _action(action, self.action_space), self.world.params)
        self._obs, self._reward = np.asarray(obs), float(reward)
        terminated, truncated, info = bool(terminated), bool(truncated), _host(info)
        self._done = terminated or truncated
        if self._done:
            info["metrics"] = cluster_episode_metrics(self.world, int(self._state.variant), self.outcome())
        return self._obs, self._reward, terminated, truncated, info

    def render(self):
        if self.render_mode is None or self._state is None:
            return None
        return _frame(self.world, self._state, self._obs, self._reward)

    def outcome(self):
        """The ended episode as ``servetune simulate`` reports the cluster's run (a ``ClusterOutcome``)."""
        if self._state is None or not self._done:
            raise gym.error.ResetNeeded("the outcome is the ended episode's: step until it ends")
        return cluster_episode_outcome(self.world, int(self._state.variant), self._state.cluster)


class ServeClusterControlVectorEnv(_VectorEnv):
    """``num_envs`` ServeClusterControl envs in one vmapped, jitted step."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": RENDER_MODES, "render_fps": 4}
    _step_fn = staticmethod(jax.jit(partial(core.autoreset_step, cc.cluster_step, cc.cluster_reset)))
    _reset_fn = staticmethod(jax.jit(jax.vmap(cc.cluster_reset, (0, None))))
    _reset_to_fn = staticmethod(jax.jit(jax.vmap(cc.cluster_reset_to, (0, None))))
    _observation_space = staticmethod(observation_space)
    _build_world = staticmethod(cc.build_cluster_world)
    _action_space = staticmethod(action_space)

    def __init__(self, num_envs: int, config, render_mode: Optional[str] = None, **options: Any) -> None:
        _check_render_mode(render_mode)
        super().__init__(num_envs, config, render_mode, **options)

    def render(self):
        """A status line per env."""
        if self.render_mode is None or self._states is None:
            return None
        rewards = None if self._last is None else self._last[1]
        return tuple(_frame(self.world, jax.tree_util.tree_map(lambda x: x[i], self._states), self._obs[i],
                            None if rewards is None else float(rewards[i]))
                     for i in range(self.num_envs))
