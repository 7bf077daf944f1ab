"""Gymnasium adapters over the functional core (envs/gym/core.py): NumPy in and out.

``gymnasium.make("servetune/ServeControl-v0", config=PATH_OR_DICT, **options)`` and ``.../ServeTune-v0`` (both
registered on ``import servetune``) build these; ``gymnasium.make_vec(id, num_envs=N,
vectorization_mode="vector_entry_point")`` builds the vector envs, which vmap the same jitted core.

Options (all keyword): ``overrides`` (``--set``-style strings applied to the config), ``interval_s`` (1.0),
``episode_s`` (the config's ``simulation.horizon_s``; with neither, episodes run until every request is served),
``num_workloads`` (8 workload variants drawn from at reset), ``miss_penalty`` (1.0), ``bounds``
({knob: (low, high)}, envs/gym/actions.py). ``reset(options={"workload": i})`` replays variant ``i``.

Seeding: ``reset(seed=s)`` draws the episode's workload variant from a JAX key derived from ``s``; later resets
without a seed continue that key's chain. Vector env ``i`` follows exactly the chain of a single env seeded with
``seed + i``, so the two agree step for step. The vector envs reset an env in the step that ends its episode
(``AutoresetMode.SAME_STEP``, as gymnax does): that step returns the new episode's first observation, with the
last one in ``info["final_obs"]`` and the step's info also in ``info["final_info"]`` (masks ``_final_obs``,
``_final_info``).

Infos hold the functional core's per-step numbers; the single envs add ``info["metrics"]`` -- run.json's metrics
of the whole episode (envs/gym/report.py) -- when an episode ends.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
from gymnasium import spaces
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from servetune.envs.sim import engine
from servetune.envs.gym import core
from servetune.envs.gym.actions import action_names, decode
from servetune.envs.gym.render import draw_timeline, replay, status_line
from servetune.envs.gym.report import episode_metrics, episode_outcome
from servetune.envs.gym.world import CONTEXT_FIELDS, World, build_world
from servetune.parallel import laid_out

RENDER_MODES = ["ansi", "rgb_array"]
_UNIT_FIELDS = {"kv_utilization", "time_of_day", "elapsed_fraction"}

_control_reset = jax.jit(core.control_reset)
_control_reset_to = jax.jit(core.control_reset_to)
_control_step = jax.jit(core.control_step)
_tune_reset = jax.jit(core.tune_reset)
_tune_reset_to = jax.jit(core.tune_reset_to)
_tune_step = jax.jit(core.tune_step)


def _key_from(rng: np.random.Generator) -> jax.Array:
    return jax.random.PRNGKey(int(rng.integers(0, 2**31 - 1)))


def _host(info: dict) -> dict:
    return {name: value.item() for name, value in jax.device_get(info).items()}


def _check_render_mode(render_mode: Optional[str]) -> None:
    if render_mode is not None and render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode: got {render_mode!r}, expected one of {RENDER_MODES} or None")


def _action(action, space: spaces.Box) -> jnp.ndarray:
    action = np.asarray(action, np.float32)
    if action.shape != space.shape:
        raise ValueError(f"action: got shape {action.shape}, expected {space.shape} (the knobs, in [-1, 1])")
    return jnp.asarray(action)


def knob_values(world: World, action) -> dict:
    """The knobs an action sets, for display ("none" where the action means no limit)."""
    knobs = jax.device_get(decode(jnp.asarray(action), world.params.bounds))
    threshold, queue = int(knobs.long_prefill_token_threshold), int(knobs.max_num_queued_reqs)
    return {"max_num_seqs": int(knobs.max_num_seqs), "max_num_batched_tokens": int(knobs.max_num_batched_tokens),
            "long_prefill_token_threshold": threshold or "none",
            "max_num_queued_reqs": "none" if queue >= engine.NO_LIMIT else queue}


def control_observation_space(world: World) -> spaces.Box:
    names = core.control_observation_names(world)
    low = np.array([-1.0 if name.startswith("knob_") else 0.0 for name in names], np.float32)
    high = np.array([1.0 if name.startswith("knob_") or name in _UNIT_FIELDS else np.inf for name in names],
                    np.float32)
    return spaces.Box(low, high, dtype=np.float32)


def tune_observation_space() -> spaces.Box:
    return spaces.Box(0.0, np.inf, (len(CONTEXT_FIELDS),), np.float32)


def action_space(world: World) -> spaces.Box:
    return spaces.Box(-1.0, 1.0, (len(action_names(world.params.bounds)),), np.float32)


def _control_frame(world: World, mode: str, before: Optional[core.ControlState], after: core.ControlState,
                   obs, reward: Optional[float]):
    """A ServeControl frame: after the interval that ran from `before` (None: nothing has run yet)."""
    names = core.control_observation_names(world)
    action = np.asarray(after.action)
    if mode == "ansi":
        clock = float(after.interval) * float(world.params.interval_s)
        return f"t={clock:g}s " + status_line(names, obs, reward, knob_values(world, action))
    params = world.params
    if before is None:
        return draw_timeline([], 0.0, float(params.interval_s), 8, "no interval yet")
    hi, lo, _ = core.interval_end(params, before.interval, params.interval_s)
    spans, _ = replay(core.variant_trace(params, before.variant),
                   core.interval_engine_params(params, before.variant, action, hi, lo, before.engine.iterations),
                   before.engine, params.cost_fn, params.num_slots, params.queue_shape)
    start = float(before.interval) * float(params.interval_s)
    seats = knob_values(world, action)["max_num_seqs"]
    return draw_timeline(spans, start, float(hi) + float(lo), seats,
                         f"interval {int(before.interval) + 1}: max_num_seqs {seats}, reward {reward:+g}")


def _tune_frame(world: World, mode: str, before: core.TuneState, action, info: Optional[dict]):
    """A ServeTune frame of the episode that ran from `before` under `action` (info None: not run yet)."""
    if mode == "ansi":
        if info is None:
            return f"workload {int(before.variant)}: not run yet\n"
        knobs = " ".join(f"{key}={value}" for key, value in knob_values(world, action).items())
        return (f"workload {int(before.variant)}: goodput {info['request_goodput']:.3f} req/s, attainment "
                f"{info['slo_attainment']:.1%}, {info['completed']} completed, {info['rejected']} rejected, "
                f"{info['unfinished']} unfinished | {knobs}\n")
    params = world.params
    if info is None:
        return draw_timeline([], 0.0, float(params.interval_s), 8, "not run yet")
    spans, engine_state, interval = [], before.engine, 0
    trace = core.variant_trace(params, before.variant)
    limited = np.isfinite(float(params.episode_hi))
    # The step's own horizons (gym.core.tune_step): the episode's end, or interval after interval.
    while True:
        hi, lo, at_end = core.interval_end(params, jnp.asarray(interval), params.interval_s)
        if limited:
            hi, lo, at_end = params.episode_hi, params.episode_lo, True
        eparams = core.interval_engine_params(params, before.variant, jnp.asarray(action), hi, lo,
                                              engine_state.iterations)
        more, engine_state = replay(trace, eparams, engine_state, params.cost_fn, params.num_slots,
                                    params.queue_shape)
        spans += more
        interval += 1
        if bool(at_end) or bool(core.resolved(params, before.variant, engine_state)):
            break
    end = spans[-1].end_s if spans else float(params.interval_s)
    seats = knob_values(world, action)["max_num_seqs"]
    return draw_timeline(spans, 0.0, end, seats, f"whole episode: max_num_seqs {seats}, "
                                                 f"goodput {info['request_goodput']:.3f} req/s")


class _SeededEnv(gym.Env):
    """Seeding shared by both envs: a JAX key chain started from the episode seed."""

    metadata = {"render_modes": RENDER_MODES, "render_fps": 4}

    def _next_key(self, seed: Optional[int]) -> jax.Array:
        super().reset(seed=seed)
        if seed is not None or self._key is None:
            self._key = _key_from(self.np_random)
        self._key, key = jax.random.split(self._key)
        return key


class ServeControlEnv(_SeededEnv):
    """Steer the scheduler every control interval (envs/gym/core.py documents the MDP)."""

    def __init__(self, config, render_mode: Optional[str] = None, **options: Any) -> None:
        _check_render_mode(render_mode)
        self.render_mode = render_mode
        self.world = build_world(config, **options)
        self.observation_names = core.control_observation_names(self.world)
        self.observation_space = control_observation_space(self.world)
        self.action_space = action_space(self.world)
        self._key = None
        self._state: Optional[core.ControlState] = None
        self._before: Optional[core.ControlState] = None
        self._obs, self._reward, self._done = None, None, False

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        key = self._next_key(seed)
        workload = (options or {}).get("workload")
        params = self.world.params
        obs, self._state = (_control_reset(key, params) if workload is None
                            else _control_reset_to(_workload_index(workload, self.world), params))
        self._before, self._reward, self._done = None, None, False
        self._obs = np.asarray(obs)
        return self._obs, {"workload": int(self._state.variant)}

    def step(self, action):
        if self._state is None or self._done:
            raise gym.error.ResetNeeded("call reset() to start an episode")
        self._before = self._state
        obs, self._state, reward, terminated, truncated, info = _control_step(
            None, self._state, _action(action, self.action_space), self.world.params)
        self._obs, self._reward = np.asarray(obs), float(reward)
        terminated, truncated, info = bool(terminated), bool(truncated), _host(info)
        self._done = terminated or truncated
        if self._done:
            variant = int(self._state.variant)
            info["metrics"] = episode_metrics(self.world, variant,
                                              episode_outcome(self.world, variant, self._state.engine))
        return self._obs, self._reward, terminated, truncated, info

    def render(self):
        if self.render_mode is None or self._state is None:
            return None
        return _control_frame(self.world, self.render_mode, self._before, self._state, self._obs, self._reward)

    def outcome(self):
        """The episode so far as ``servetune simulate`` would report it (a ``SimulationOutcome``)."""
        if self._state is None:
            raise gym.error.ResetNeeded("call reset() first")
        now = None if self._done else float(self._state.interval) * float(self.world.params.interval_s)
        return episode_outcome(self.world, int(self._state.variant), self._state.engine, now)


class ServeTuneEnv(_SeededEnv):
    """One decision per episode: the knobs for the whole workload window; reward = its goodput."""

    def __init__(self, config, render_mode: Optional[str] = None, **options: Any) -> None:
        _check_render_mode(render_mode)
        self.render_mode = render_mode
        self.world = build_world(config, **options)
        self.observation_names = CONTEXT_FIELDS
        self.observation_space = tune_observation_space()
        self.action_space = action_space(self.world)
        self._key = None
        self._state: Optional[core.TuneState] = None
        self._before: Optional[core.TuneState] = None
        self._action, self._info, self._done = None, None, False

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        key = self._next_key(seed)
        workload = (options or {}).get("workload")
        params = self.world.params
        obs, self._state = (_tune_reset(key, params) if workload is None
                            else _tune_reset_to(_workload_index(workload, self.world), params))
        self._before, self._action, self._info, self._done = None, None, None, False
        return np.asarray(obs), {"workload": int(self._state.variant)}

    def step(self, action):
        if self._state is None or self._done:
            raise gym.error.ResetNeeded("call reset() to start an episode")
        self._before, self._action = self._state, _action(action, self.action_space)
        obs, self._state, reward, terminated, truncated, info = _tune_step(
            None, self._state, self._action, self.world.params)
        info = _host(info)
        variant = int(self._state.variant)
        info["metrics"] = episode_metrics(self.world, variant, episode_outcome(self.world, variant, self._state.engine))
        self._info, self._done = info, True
        return np.asarray(obs), float(reward), bool(terminated), bool(truncated), info

    def render(self):
        if self.render_mode is None or self._state is None:
            return None
        return _tune_frame(self.world, self.render_mode, self._before if self._before is not None else self._state, self._action, self._info)


def _workload_index(workload, world: World) -> int:
    count = len(world.workloads)
    if not (isinstance(workload, (int, np.integer)) and 0 <= workload < count):
        raise ValueError(f"options['workload']: got {workload!r}, expected an integer in [0, {count})")
    return int(workload)


# ---------------------------------------------------------------------------------------------------------
# Vector envs
# ---------------------------------------------------------------------------------------------------------
_vector_control_step = jax.jit(partial(core.autoreset_step, core.control_step, core.control_reset))
_vector_tune_step = jax.jit(partial(core.autoreset_step, core.tune_step, core.tune_reset))
_vector_control_reset = jax.jit(jax.vmap(core.control_reset, (0, None)))
_vector_control_reset_to = jax.jit(jax.vmap(core.control_reset_to, (0, None)))
_vector_tune_reset = jax.jit(jax.vmap(core.tune_reset, (0, None)))
_vector_tune_reset_to = jax.jit(jax.vmap(core.tune_reset_to, (0, None)))
_vector_split = jax.jit(jax.vmap(jax.random.split))


def _row(tree, i: int):
    """Env i's slice of a batched pytree."""
    return jax.tree_util.tree_map(lambda x: x[i], tree)


class _VectorEnv(VectorEnv):
    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": RENDER_MODES, "render_fps": 4}

    _step_fn: Any
    _reset_fn: Any
    _reset_to_fn: Any
    _observation_space: Any
    _build_world: Any = staticmethod(build_world)
    _action_space: Any = staticmethod(action_space)

    def __init__(self, num_envs: int, config, render_mode: Optional[str] = None, **options: Any) -> None:
        if not (isinstance(num_envs, int) and num_envs >= 1):
            raise ValueError(f"num_envs: got {num_envs!r}, expected an integer >= 1")
        _check_render_mode(render_mode)
        self.num_envs = num_envs
        self.render_mode = render_mode
        self.world = self._build_world(config, **options)
        self.single_observation_space = self._observation_space(self.world)
        self.single_action_space = self._action_space(self.world)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self._keys = None
        self._states = None
        self._before = None
        self._obs = None
        self._last = None

    def reset(self, *, seed=None, options: Optional[dict] = None):
        if isinstance(seed, (int, np.integer)):
            super().reset(seed=int(seed))
            seeds = [int(seed) + i for i in range(self.num_envs)]
        elif seed is None:
            seeds = [None] * self.num_envs
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"seed: got {len(seeds)} seeds, expected one per env ({self.num_envs})")
        # Env i's key chain is a single env's seeded with seeds[i] (see _SeededEnv).
        keys = jnp.stack([_key_from(seeding.np_random(s)[0]) for s in seeds])
        pairs = _vector_split(keys)
        self._keys = pairs[:, 0]
        workload = (options or {}).get("workload")
        params = self.world.params
        if workload is None:
            obs, self._states = self._reset_fn(pairs[:, 1], params)
        else:
            workloads = [workload] * self.num_envs if np.ndim(workload) == 0 else list(workload)
            if len(workloads) != self.num_envs:
                raise ValueError(f"options['workload']: got {len(workloads)} values, expected {self.num_envs}")
            indices = [_workload_index(w, self.world) for w in workloads]
            obs, self._states = self._reset_to_fn(jnp.asarray(indices, jnp.int32), params)
        self._keys, self._states = laid_out((self._keys, self._states), self.num_envs)
        self._before, self._last = None, None
        self._obs = np.asarray(obs)
        return self._obs, {"workload": np.asarray(self._states.variant)}

    def step(self, actions):
        if self._states is None:
            raise gym.error.ResetNeeded("call reset() first")
        actions = np.asarray(actions, np.float32)
        if actions.shape != self.action_space.shape:
            raise ValueError(f"actions: got shape {actions.shape}, expected {self.action_space.shape}")
        self._before = self._states
        obs, self._states, reward, terminated, truncated, info, final_obs, self._keys = self._step_fn(
            self._keys, self._states, jnp.asarray(actions), self.world.params)
        self._keys, self._states = laid_out((self._keys, self._states), self.num_envs)
        obs, reward, terminated, truncated, info, final_obs = jax.device_get(
            (obs, reward, terminated, truncated, info, final_obs))
        done = terminated | truncated
        infos = dict(info)
        if done.any():
            infos.update(final_obs=final_obs, _final_obs=done, final_info=dict(info), _final_info=done)
        self._obs = obs
        self._last = (actions, reward, info)
        return obs, reward, terminated, truncated, infos


class ServeControlVectorEnv(_VectorEnv):
    """``num_envs`` ServeControl envs in one vmapped, jitted step."""

    _step_fn = staticmethod(_vector_control_step)
    _reset_fn = staticmethod(_vector_control_reset)
    _reset_to_fn = staticmethod(_vector_control_reset_to)
    _observation_space = staticmethod(control_observation_space)

    def render(self):
        """A frame per env, as the single env draws it (the slot timelines replay every env's interval)."""
        if self.render_mode is None or self._states is None:
            return None
        frames = []
        for i in range(self.num_envs):
            after = _row(self._states, i)
            before = None if self._before is None else _row(self._before, i)
            if before is not None and int(after.interval) != int(before.interval) + 1:
                before = None   # the env restarted in this step: its new episode has not run yet
            reward = None if self._last is None or before is None else float(self._last[1][i])
            frames.append(_control_frame(self.world, self.render_mode, before, after, self._obs[i], reward))
        return tuple(frames)


class ServeTuneVectorEnv(_VectorEnv):
    """``num_envs`` ServeTune envs in one vmapped, jitted step."""

    _step_fn = staticmethod(_vector_tune_step)
    _reset_fn = staticmethod(_vector_tune_reset)
    _reset_to_fn = staticmethod(_vector_tune_reset_to)

    @staticmethod
    def _observation_space(world: World) -> spaces.Box:
        return tune_observation_space()

    def render(self):
        """A frame per env of the episodes the last step ran (every ServeTune step ends its episode)."""
        if self.render_mode is None or self._last is None:
            return None
        actions, _, info = self._last
        return tuple(_tune_frame(self.world, self.render_mode, _row(self._before, i), actions[i],
                                 {k: v[i].item() for k, v in info.items()})
                     for i in range(self.num_envs))
