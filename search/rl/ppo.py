"""PPO in pure JAX, in the PureJaxRL manner: the environments are vmapped, and one jitted ``update`` collects
a rollout from all of them and learns from it, with no host round trip inside.

    trainer = make_train(env, rl)          # env: an EnvSpec over gymnax-style functions; rl: RlConfig
    state = trainer.init(jax.random.PRNGKey(seed))
    for _ in range(trainer.num_updates):
        state, metrics = trainer.update(state)

What one update does (rl's fields in brackets):

- *Rollout.* [num_steps] steps of [num_envs] environments, which restart in the step that ends an episode
  (envs/gym/core.py ``autoreset_step``). The actor's Gaussian samples the actions; the environment clips
  them to [-1, 1] (the log-probability is of the unclipped sample). An episode's end is treated as terminal,
  truncation included: ServeControl observes the fraction of the episode elapsed, so its time limit is part of
  the state and nothing lies beyond it to bootstrap from.
- *Normalisation.* Observations are standardised by running mean and variance over every observation seen
  (Chan et al.'s parallel update, batch by batch) and clipped to ±10; rewards are divided by the running
  standard deviation of the discounted return (as Gymnasium's ``NormalizeReward``). The policy file keeps the
  observation statistics, which the policy needs at inference.
- *Advantages.* GAE([gamma], [gae_lambda]) over the rollout, bootstrapped from the critic at its last
  observation.
- *Learning.* [update_epochs] passes over the rollout in [num_minibatches] shuffled minibatches: the clipped
  surrogate ([clip_eps]), a clipped value loss ([vf_coef]) and an entropy bonus ([ent_coef]); Adam at
  [learning_rate], linearly annealed to 0 over the run when [anneal_lr], gradients clipped to [max_grad_norm].

The same seed gives the same parameters, bit for bit (tests/test_ppo.py), since every random draw comes from
the state's key and the environments are deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from servetune.config import RlConfig
from servetune.envs.gym.core import autoreset_step
from servetune.parallel import on_every_device
from servetune.pytree import pytree_dataclass, replace
from servetune.search.rl import policy_net as net

f32 = jnp.float32


@dataclass(frozen=True)
class EnvSpec:
    """The environment the trainer drives: gymnax-style pure functions and their params.

    ``reset(key, params) -> (obs, state)``; ``step(key, state, action, params) -> (obs, state, reward,
    terminated, truncated, info)`` (the step's key is passed as None: the environments here are deterministic).
    ``episode_sums``: info entries summed over each episode for the logs (ServeControl: good, missed, ...);
    ``episode_last``: entries whose value at an episode's last step is logged (its clock, say).
    ``initial_action``: the first policy's mean action (None: the middle of the box).
    """

    reset: Callable
    step: Callable
    params: Any
    obs_size: int
    action_size: int
    episode_sums: tuple[str, ...] = ()
    episode_last: tuple[str, ...] = ()
    initial_action: Any = None


@pytree_dataclass
class RunningStats:
    """Mean and variance of everything seen so far, and how many (float32: counts pass 2**24 harmlessly,
    since a weight that small no longer moves the mean)."""

    mean: jnp.ndarray
    var: jnp.ndarray
    count: jnp.ndarray


def empty_stats(shape) -> RunningStats:
    # A tiny prior count keeps the first batch's update finite; it weighs nothing after it.
    return RunningStats(jnp.zeros(shape, f32), jnp.ones(shape, f32), jnp.asarray(1e-4, f32))


def update_stats(stats: RunningStats, batch) -> RunningStats:
    """Fold a batch (leading axis) into the statistics: Chan, Golub and LeVeque's pairwise update."""
    batch_mean, batch_var = jnp.mean(batch, axis=0), jnp.var(batch, axis=0)
    n = jnp.asarray(batch.shape[0], f32)
    total = stats.count + n
    delta = batch_mean - stats.mean
    mean = stats.mean + delta * n / total
    m2 = stats.var * stats.count + batch_var * n + delta**2 * stats.count * n / total
    return RunningStats(mean, m2 / total, total)


@pytree_dataclass
class Episodes:
    """Per environment, the running episode's totals (for the logs)."""

    ret: jnp.ndarray      # float32[E]: undiscounted raw reward
    length: jnp.ndarray   # int32[E]
    sums: jnp.ndarray     # float32[E, len(episode_sums)]


@pytree_dataclass
class TrainState:
    network: dict
    opt_state: Any
    obs_stats: RunningStats
    return_stats: RunningStats   # of the discounted return, for reward scaling
    discounted: jnp.ndarray      # float32[E]: each env's running discounted return
    env_state: Any
    obs: jnp.ndarray             # float32[E, O]: raw observations the next step acts on
    env_keys: jnp.ndarray        # each env's reset key chain
    episodes: Episodes
    key: jnp.ndarray
    update: jnp.ndarray          # int32: updates done


class Transition(NamedTuple):
    obs: jnp.ndarray      # normalised, as the actor saw it
    action: jnp.ndarray
    log_prob: jnp.ndarray
    value: jnp.ndarray
    reward: jnp.ndarray   # scaled
    done: jnp.ndarray


def advantages(reward, value, done, last_value, gamma: float, lam: float):
    """GAE(gamma, lambda) over a rollout ([T, E] arrays; ``done[t]``: the episode ended at step t, so step
    t + 1 starts a new one), bootstrapped from ``last_value`` after the last step."""
    def backwards(carry, step):
        gae, next_value = carry
        r, v, d = step
        delta = r + gamma * next_value * (1.0 - d) - v
        gae = delta + gamma * lam * (1.0 - d) * gae
        return (gae, v), gae

    _, gaes = jax.lax.scan(backwards, (jnp.zeros_like(last_value), last_value),
                           (reward, value, done.astype(f32)), reverse=True)
    return gaes


@dataclass(frozen=True)
class Trainer:
    init: Callable        # key -> TrainState
    update: Callable      # TrainState -> (TrainState, metrics), jitted
    compile: Callable     # TrainState -> ``update`` compiled ahead for states of its shapes
    rollout: Callable     # TrainState -> TrainState: a rollout with no learning (to time the two apart)
    num_updates: int
    steps_per_update: int


class Hyperparameters(NamedTuple):
    """The RlConfig fields PPO's programs are built from: trainers that agree on these (and on the environment's
    functions and sizes) share one compiled update, whatever their run's length (``timesteps``) or seed."""

    num_envs: int
    num_steps: int
    num_minibatches: int
    update_epochs: int
    learning_rate: float
    anneal_lr: bool
    max_grad_norm: float
    gamma: float
    gae_lambda: float
    clip_eps: float
    vf_coef: float
    ent_coef: float
    hidden: tuple[int, ...]
    log_std_init: float

    @classmethod
    def of(cls, rl: RlConfig) -> "Hyperparameters":
        values = {name: getattr(rl, name) for name in cls._fields}
        return cls(**{**values, "hidden": tuple(values["hidden"])})


class EnvFunctions(NamedTuple):
    """What of an EnvSpec shapes the programs (its params and initial action are their arguments instead)."""

    reset: Callable
    step: Callable
    obs_size: int
    action_size: int
    episode_sums: tuple[str, ...]
    episode_last: tuple[str, ...]


def make_train(env: EnvSpec, rl: RlConfig) -> Trainer:
    hp = Hyperparameters.of(rl)
    batch = hp.num_envs * hp.num_steps
    num_updates = max(1, rl.timesteps // batch)
    programs = _programs(EnvFunctions(env.reset, env.step, env.obs_size, env.action_size, tuple(env.episode_sums),
                                      tuple(env.episode_last)), hp)
    params, initial_action, updates = env.params, env.initial_action, jnp.asarray(num_updates, jnp.int32)

    def compile_update(state: TrainState) -> Callable:
        compiled = programs.update.lower(on_every_device(state), params, updates).compile()
        return lambda state: compiled(on_every_device(state), params, updates)

    return Trainer(init=lambda key: programs.init(key, params, initial_action),
                   update=lambda state: programs.update(on_every_device(state), params, updates),
                   compile=compile_update,
                   rollout=lambda state: programs.rollout(on_every_device(state), params),
                   num_updates=num_updates, steps_per_update=batch)


class _Programs(NamedTuple):
    init: Callable      # (key, env params, initial action) -> TrainState
    update: Callable    # (state, env params, num_updates) -> (state, metrics)
    rollout: Callable   # (state, env params) -> state


@lru_cache(maxsize=32)
def _programs(env: EnvFunctions, rl: Hyperparameters) -> _Programs:
    """The jitted programs, one set per (environment functions, hyperparameters): the environment's params and
    the run's number of updates (the learning rate's annealing length) are traced arguments, so a second trainer
    of another length or world of the same shapes reuses the compiled update instead of tracing a new one."""
    num_envs, num_steps = rl.num_envs, rl.num_steps
    batch = num_envs * num_steps
    minibatch = batch // rl.num_minibatches

    def make_optimizer(num_updates):
        def learning_rate(count):
            # count is in optimizer steps; each update takes update_epochs * num_minibatches of them.
            done = count // (rl.update_epochs * rl.num_minibatches)
            return rl.learning_rate * (1.0 - done / num_updates) if rl.anneal_lr else rl.learning_rate

        return optax.chain(optax.clip_by_global_norm(rl.max_grad_norm), optax.adam(learning_rate, eps=1e-5))

    step_batch = jax.jit(lambda keys, states, actions, params: autoreset_step(
        env.step, env.reset, keys, states, actions, params))

    def init(key, params, initial_action) -> TrainState:
        network_key, env_key, key = jax.random.split(key, 3)
        network = net.init_network(network_key, env.obs_size, env.action_size, rl.hidden, initial_action,
                                   rl.log_std_init)
        pairs = jax.vmap(jax.random.split)(jax.random.split(env_key, num_envs))
        obs, env_state = jax.vmap(env.reset, (0, None))(pairs[:, 1], params)
        obs_stats = update_stats(empty_stats(env.obs_size), obs)
        # The optimiser's state does not depend on the schedule's length.
        return TrainState(
            network=network, opt_state=make_optimizer(1).init(network), obs_stats=obs_stats,
            return_stats=empty_stats(()), discounted=jnp.zeros(num_envs, f32), env_state=env_state, obs=obs,
            env_keys=pairs[:, 0],
            episodes=Episodes(jnp.zeros(num_envs, f32), jnp.zeros(num_envs, jnp.int32),
                              jnp.zeros((num_envs, len(env.episode_sums)), f32)),
            key=key, update=jnp.asarray(0, jnp.int32))

    def env_step(params, state: TrainState, _):
        key, action_key = jax.random.split(state.key)
        obs = net.normalise(state.obs, state.obs_stats.mean, state.obs_stats.var)
        mean = net.actor_mean(state.network, obs)
        log_std = state.network["log_std"]
        action = mean + jnp.exp(log_std) * jax.random.normal(action_key, mean.shape)
        next_obs, env_state, reward, terminated, truncated, info, _, env_keys = step_batch(
            state.env_keys, state.env_state, action, params)
        done = terminated | truncated
        discounted = state.discounted * rl.gamma + reward
        return_stats = update_stats(state.return_stats, discounted)
        scaled = reward / jnp.sqrt(return_stats.var + net.VAR_EPS)

        ep = state.episodes
        sums = ep.sums + jnp.stack([info[name].astype(f32) for name in env.episode_sums]
                                   + [jnp.zeros(num_envs, f32)], axis=-1)[:, :-1]
        ended = {"return": ep.ret + reward, "length": (ep.length + 1).astype(f32),
                 **{name: sums[:, i] for i, name in enumerate(env.episode_sums)},
                 **{name: info[name].astype(f32) for name in env.episode_last}}
        keep = ~done
        episodes = Episodes(jnp.where(keep, ep.ret + reward, 0.0), jnp.where(keep, ep.length + 1, 0),
                            jnp.where(keep[:, None], sums, 0.0))
        transition = Transition(obs, action, net.log_prob(action, mean, log_std),
                                net.value(state.network, obs), scaled, done)
        state = replace(state, obs_stats=update_stats(state.obs_stats, next_obs), return_stats=return_stats,
                        discounted=jnp.where(done, 0.0, discounted), env_state=env_state, obs=next_obs,
                        env_keys=env_keys, episodes=episodes, key=key)
        return state, (transition, reward, done, ended)

    def loss(network, t: Transition, gae, target):
        mean = net.actor_mean(network, t.obs)
        log_std = network["log_std"]
        ratio = jnp.exp(net.log_prob(t.action, mean, log_std) - t.log_prob)
        gae = (gae - gae.mean()) / (gae.std() + 1e-8)
        actor = -jnp.mean(jnp.minimum(ratio * gae, jnp.clip(ratio, 1 - rl.clip_eps, 1 + rl.clip_eps) * gae))
        v = net.value(network, t.obs)
        v_clipped = t.value + jnp.clip(v - t.value, -rl.clip_eps, rl.clip_eps)
        critic = 0.5 * jnp.mean(jnp.maximum((v - target) ** 2, (v_clipped - target) ** 2))
        ent = net.entropy(log_std)
        return actor + rl.vf_coef * critic - rl.ent_coef * ent, (actor, critic, ent)

    def learn(optimizer, carry, _):
        network, opt_state, key, flat = carry
        key, shuffle_key = jax.random.split(key)
        order = jax.random.permutation(shuffle_key, batch)
        shuffled = jax.tree_util.tree_map(lambda x: x[order].reshape((rl.num_minibatches, minibatch) + x.shape[1:]),
                                          flat)

        def minibatch_step(inner, mb):
            network, opt_state = inner
            t, gae, target = mb
            (_, parts), grads = jax.value_and_grad(loss, has_aux=True)(network, t, gae, target)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(network, updates), opt_state), parts

        (network, opt_state), parts = jax.lax.scan(minibatch_step, (network, opt_state), shuffled)
        return (network, opt_state, key, flat), parts

    def update(state: TrainState, params, num_updates):
        state, (transitions, reward, done, ended) = jax.lax.scan(partial(env_step, params), state, None, num_steps)
        last_obs = net.normalise(state.obs, state.obs_stats.mean, state.obs_stats.var)
        gae = advantages(transitions.reward, transitions.value, transitions.done,
                         net.value(state.network, last_obs), rl.gamma, rl.gae_lambda)
        target = gae + transitions.value
        flat = jax.tree_util.tree_map(lambda x: x.reshape((batch,) + x.shape[2:]), (transitions, gae, target))
        key, learn_key = jax.random.split(state.key)
        (network, opt_state, _, _), (actor, critic, ent) = jax.lax.scan(
            partial(learn, make_optimizer(num_updates)), (state.network, state.opt_state, learn_key, flat), None,
            rl.update_epochs)
        episodes = jnp.sum(done)
        per_episode = {name: jnp.sum(jnp.where(done, values, 0.0)) / jnp.maximum(episodes, 1)
                       for name, values in ended.items()}
        metrics = {"episodes": episodes, **{f"episode_{name}": value for name, value in per_episode.items()},
                   "reward_per_step": jnp.mean(reward),
                   "actor_loss": jnp.mean(actor), "value_loss": jnp.mean(critic), "entropy": jnp.mean(ent),
                   "action_std": jnp.mean(jnp.exp(network["log_std"]))}
        state = replace(state, network=network, opt_state=opt_state, key=key, update=state.update + 1)
        return state, metrics

    def rollout(state: TrainState, params) -> TrainState:
        return jax.lax.scan(partial(env_step, params), state, None, num_steps)[0]

    # The state leaves each program whole on every device, as it enters the next (Trainer's calls put it so):
    # the envs' step splits its batch across the cores, and a state left split would make the second update
    # compile again.
    def update_whole(state: TrainState, params, num_updates):
        state, metrics = update(state, params, num_updates)
        return on_every_device(state), metrics

    return _Programs(jax.jit(lambda key, params, initial_action: on_every_device(init(key, params, initial_action))),
                     jax.jit(update_whole), jax.jit(lambda state, params: on_every_device(rollout(state, params))))
