"""Evolution strategies over the policy's weights (OpenAI-ES: Salimans et al., 2017), for ``train-rl --algo es``.

    trainer = make_es(env, rl)             # env: an EsEnv over ServeControl's functional core; rl: RlConfig
    state = trainer.init(jax.random.PRNGKey(seed))
    for _ in range(trainer.num_generations):
        state, metrics = trainer.generation(state)

The policy is search/rl/policy_net.py's actor, acting deterministically (its mean action, clipped to the box) as
``eval-policy`` and the policy file play it. What one generation does (rl's fields in brackets):

- *Candidates.* [es_population] perturbations of the weights, in antithetic pairs θ ± [es_sigma]·ε, and θ
  itself. Only the weights that read [features] move: the first layer's rows for the other observations stay
  0, so the policy file's network reads only them.
- *Common days.* Every candidate plays the same [es_days] whole days, drawn from the training bank without
  replacement: a day's own difficulty (the best static config's goodput ranges 1.7-2.3 req/s over days on
  examples/diurnal.yaml) then moves every candidate alike and drops out of their comparison.
- *Counterfactual baseline.* A candidate's fitness is its mean return over those days less the config's own
  knobs' return on the same days (played once per training day at the start). The baseline does not depend on
  the candidate, so the ranking and the optimum are unchanged; the logged figure is the policy's gain over
  the static config, comparable from one generation to the next.
- *Update.* Fitnesses become centred ranks in [-0.5, 0.5] (robust to a day's outliers); the gradient estimate
  Σ rank·ε / (population·σ) goes to Adam at [es_learning_rate].

The first policy holds the config's knobs exactly (its output layer's weights are 0 and its bias the
config's action), so generation 0's θ plays the static config and its gain is 0. Observations are normalised
by statistics fixed at the start: the mean and variance over the training days played at the config's knobs.
Every draw comes from the state's key and the environment is deterministic: the same seed gives the same
weights, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from servetune.config import RlConfig
from servetune.parallel import across_cores
from servetune.pytree import pytree_dataclass, replace
from servetune.search.rl import policy_net as net

f32 = jnp.float32


@dataclass(frozen=True)
class EsEnv:
    """ServeControl as the trainer plays it: whole episodes from given workloads of the bank.

    ``reset_to(variant, params) -> (obs, state)`` and ``step(key, state, action, params)`` are
    envs/gym/core.py's ``control_reset_to`` and ``control_step``; ``intervals``: the steps an episode
    lasts; ``num_days``: workloads in the bank; ``initial_action``: the config's own knobs in action units;
    ``features``: indices of the observations the policy reads.
    """

    reset_to: Callable
    step: Callable
    params: Any
    obs_size: int
    action_size: int
    intervals: int
    num_days: int
    initial_action: Any
    features: Sequence[int]


@pytree_dataclass
class EsState:
    theta: jnp.ndarray       # float32[P]: the actor's weights, flattened
    opt_state: Any
    obs_mean: jnp.ndarray    # float32[O]: fixed at init
    obs_var: jnp.ndarray
    baseline: jnp.ndarray    # float32[num_days]: each training day's return at the config's knobs
    key: jnp.ndarray
    generation: jnp.ndarray  # int32: generations done


@dataclass(frozen=True)
class EsTrainer:
    init: Callable           # key -> EsState
    generation: Callable     # EsState -> (EsState, metrics): three jitted programs in turn
    compile: Callable        # EsState -> ``generation`` with its programs compiled for that state's shapes
    network: Callable        # EsState -> the actor as search/rl/policy_net.py's dict ({"actor": layers})
    num_generations: int
    steps_per_generation: int


def initial_actor(obs_size: int, action_size: int, hidden: Sequence[int], initial_action, features) -> list:
    """Orthogonal hidden layers over the chosen features only; an output layer of zero weights whose bias is
    the config's action, so that the first policy holds the config's knobs whatever it observes."""
    layers = net.init_network(jax.random.PRNGKey(0), obs_size, action_size, hidden, initial_action)["actor"]
    w, b = layers[0]
    layers[0] = (w * read_mask(obs_size, w.shape[1], features), b)
    w, b = layers[-1]
    layers[-1] = (jnp.zeros_like(w), b)
    return layers


def read_mask(obs_size: int, width: int, features) -> jnp.ndarray:
    """1 on the first layer's rows of the observations the policy reads, 0 elsewhere."""
    rows = np.zeros((obs_size, 1), np.float32)
    rows[list(features)] = 1.0
    return jnp.asarray(np.broadcast_to(rows, (obs_size, width)))


def centred_ranks(x):
    """Ranks of ``x`` scaled to [-0.5, 0.5] (ties broken by position, deterministically)."""
    ranks = jnp.argsort(jnp.argsort(x)).astype(f32)
    return ranks / jnp.maximum(x.shape[0] - 1, 1) - 0.5


def make_es(env: EsEnv, rl: RlConfig) -> EsTrainer:
    population, sigma, days = rl.es_population, rl.es_sigma, rl.es_days
    candidates = population + 1                       # the perturbations and θ itself
    steps_per_generation = candidates * days * env.intervals
    num_generations = max(1, rl.timesteps // steps_per_generation)
    layers = initial_actor(env.obs_size, env.action_size, rl.hidden, env.initial_action, env.features)
    theta0, unravel = ravel_pytree(layers)
    mask_layers = [(jnp.ones_like(w), jnp.ones_like(b)) for w, b in layers]
    mask_layers[0] = (read_mask(env.obs_size, layers[0][0].shape[1], env.features), jnp.ones_like(layers[0][1]))
    trainable = ravel_pytree(mask_layers)[0]
    optimizer = optax.adam(rl.es_learning_rate)

    def play_rows(thetas, variants, obs_mean, obs_var):
        """Each row's weights over its workload's whole episode: (return, good, arrived, clock at the end) per
        row, and every observation it acted on with whether its episode was still running."""
        obs, states = jax.vmap(env.reset_to, (0, None))(variants, env.params)
        actors = jax.vmap(unravel)(thetas)
        count = variants.shape[0]

        def interval(carry, _):
            obs, states, done, totals = carry
            actions = jax.vmap(net.deterministic_action, (0, None, None, 0))(actors, obs_mean, obs_var, obs)
            new_obs, new_states, reward, terminated, truncated, info = jax.vmap(env.step, (None, 0, 0, None))(
                None, states, actions, env.params)
            live = ~done
            totals = totals + jnp.where(live[:, None], jnp.stack(
                [reward, info["good"].astype(f32), info["arrived"].astype(f32), jnp.zeros_like(reward)], -1), 0.0)
            totals = totals.at[:, 3].set(jnp.where(live, info["time_s"], totals[:, 3]))
            # An ended episode stays as it ended.
            states = jax.tree_util.tree_map(
                lambda old, new: jnp.where(done.reshape(done.shape + (1,) * (old.ndim - 1)), old, new),
                states, new_states)
            return (jnp.where(done[:, None], obs, new_obs), states, done | terminated | truncated, totals), (obs, live)

        carry = (obs, states, jnp.zeros(count, bool), jnp.zeros((count, 4), f32))
        (_, _, _, totals), (seen, live) = jax.lax.scan(interval, carry, None, env.intervals)
        return totals, jnp.swapaxes(seen, 0, 1), jnp.swapaxes(live, 0, 1)

    def play(thetas, variants, obs_mean, obs_var):
        # Whole episodes split across the cores: the rows are independent, so the halves never meet mid-day.
        return across_cores(lambda t, v: play_rows(t, v, obs_mean, obs_var), (True, True))(thetas, variants)

    play_jit = jax.jit(play)

    def init(key) -> EsState:
        # Every day played by the first policy, in batches of a generation's rows (the last padded with day 0 and
        # cut off), so that init and the generations share one compiled play. The first policy ignores its
        # observations (zero output weights), so any statistics do here.
        rows = candidates * days
        chunks = -(-env.num_days // rows)
        all_days = np.zeros(chunks * rows, np.int32)
        all_days[:env.num_days] = np.arange(env.num_days)
        played = [play_jit(np.broadcast_to(np.asarray(theta0), (rows, theta0.shape[0])), part,
                           np.zeros(env.obs_size, np.float32), np.ones(env.obs_size, np.float32))
                  for part in all_days.reshape(chunks, rows)]
        totals, obs, live = (jnp.concatenate(parts)[:env.num_days] for parts in zip(*played))
        weights = live.astype(f32)[..., None]
        count = jnp.maximum(jnp.sum(weights), 1.0)
        mean = jnp.sum(obs * weights, axis=(0, 1)) / count
        var = jnp.sum((obs - mean) ** 2 * weights, axis=(0, 1)) / count
        state = EsState(theta=theta0, opt_state=optimizer.init(theta0), obs_mean=mean, obs_var=var,
                        baseline=totals[:, 0], key=key, generation=jnp.asarray(0, jnp.int32))
        return jax.device_get(state)   # on no device yet: see ``staged``

    class Proposal(NamedTuple):
        rows: jnp.ndarray      # float32[candidates * days, P]: each env's weights
        variants: jnp.ndarray  # int32[candidates * days]: each env's workload
        chosen: jnp.ndarray    # int32[days]: the generation's days
        noise: jnp.ndarray     # float32[population, P]
        key: jnp.ndarray       # the state's next key

    @jax.jit
    def propose(state: EsState) -> Proposal:
        key, noise_key, day_key = jax.random.split(state.key, 3)
        noise = jax.random.normal(noise_key, (population // 2, theta0.shape[0]), f32) * trainable
        noise = jnp.concatenate([noise, -noise])
        thetas = jnp.concatenate([state.theta + sigma * noise, state.theta[None]])
        chosen = jax.random.choice(day_key, env.num_days, (days,), replace=False).astype(jnp.int32)
        return Proposal(jnp.repeat(thetas, days, axis=0), jnp.tile(chosen, candidates), chosen, noise, key)

    @jax.jit
    def learn(state: EsState, totals, proposal: Proposal):
        totals = totals.reshape(candidates, days, 4)
        baseline = state.baseline[proposal.chosen]
        fitness = jnp.mean(totals[:, :, 0] - baseline, axis=1)
        ranks = centred_ranks(fitness[:population])
        ascent = ranks @ proposal.noise / (population * sigma)
        updates, opt_state = optimizer.update(-ascent, state.opt_state, state.theta)
        centre = totals[population]
        static_mean = jnp.mean(baseline)
        metrics = {
            "episodes": jnp.asarray(days, jnp.int32),
            "episode_return": jnp.mean(centre[:, 0]),
            "static_return": static_mean,
            "gain_over_static": jnp.mean(centre[:, 0] - baseline) / jnp.maximum(jnp.abs(static_mean), 1e-9),
            "episode_good": jnp.sum(centre[:, 1]), "episode_arrived": jnp.sum(centre[:, 2]),
            "episode_time_s": jnp.sum(centre[:, 3]),
            "best_candidate_gain": jnp.max(fitness[:population]) / jnp.maximum(jnp.abs(static_mean), 1e-9),
        }
        new = replace(state, theta=optax.apply_updates(state.theta, updates), opt_state=opt_state,
                      key=proposal.key, generation=state.generation + 1)
        return new, metrics

    def staged(propose_fn, play_fn, learn_fn):
        def generation(state: EsState):
            proposal = propose_fn(state)
            # Between the programs as host arrays (a few kB): play places them across the cores, and learning
            # runs on one device with no collective, which XLA's CPU client can deadlock on when it runs a
            # cheap program inline (one core waiting at the all-reduce for the other's turn).
            totals = play_fn(*jax.device_get((proposal.rows, proposal.variants, state.obs_mean, state.obs_var)))[0]
            return learn_fn(state, jax.device_get(totals), proposal)
        return generation

    def compile_generation(state: EsState) -> Callable:
        """``generation`` with its three programs compiled ahead (so that compiling is timed apart)."""
        proposal = jax.eval_shape(propose, state)
        played = jax.eval_shape(play, proposal.rows, proposal.variants, state.obs_mean, state.obs_var)[0]
        return staged(propose.lower(state).compile(),
                      play_jit.lower(proposal.rows, proposal.variants, state.obs_mean, state.obs_var).compile(),
                      learn.lower(state, played, proposal).compile())

    return EsTrainer(init=init, generation=staged(propose, play_jit, learn), compile=compile_generation,
                     network=lambda state: {"actor": unravel(state.theta)},
                     num_generations=num_generations, steps_per_generation=steps_per_generation)
