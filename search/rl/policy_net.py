"""The RL scheduler's networks: a Gaussian actor and a value critic, two small tanh MLPs over the normalised
observation. Pure JAX over a plain dict of arrays, so that the same dict is saved to and read back from a policy
file (search/rl/policy_file.py), whose NumPy forward pass mirrors ``actor_mean`` operation for operation.

    params = {"actor": [(w, b), ...], "log_std": [A], "critic": [(w, b), ...]}

Hidden layers use orthogonal weights (gain sqrt 2) and zero biases; the actor's output layer gain 0.01 and the
critic's 1 -- PPO's usual initialisation -- except that the actor's output bias is ``initial_action``: the first
policy holds the config's own knobs (search/rl/train.py), so PPO learns how to depart from a known config rather
than starting from the middle of every knob's range.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

OBS_CLIP = 10.0     # normalised observations beyond this many standard deviations are clipped
VAR_EPS = 1e-8


def _mlp_init(key, sizes: Sequence[int], out_gain: float) -> list:
    layers = []
    keys = jax.random.split(key, len(sizes) - 1)
    for index, (k, n_in, n_out) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
        gain = out_gain if index == len(sizes) - 2 else np.sqrt(2.0)
        w = jax.nn.initializers.orthogonal(gain)(k, (n_in, n_out), jnp.float32)
        layers.append((w, jnp.zeros(n_out, jnp.float32)))
    return layers


def init_network(key, obs_size: int, action_size: int, hidden: Sequence[int], initial_action=None,
                 log_std_init: float = -0.5) -> dict:
    """``log_std_init`` -0.5 spreads the first samples over ~0.6 of the [-1, 1] range's half width: enough to
    try every knob's whole range without pinning most samples at its clipped ends."""
    actor_key, critic_key = jax.random.split(key)
    actor = _mlp_init(actor_key, [obs_size, *hidden, action_size], 0.01)
    if initial_action is not None:
        w, _ = actor[-1]
        actor[-1] = (w, jnp.asarray(initial_action, jnp.float32))
    return {
        "actor": actor,
        "log_std": jnp.full(action_size, log_std_init, jnp.float32),
        "critic": _mlp_init(critic_key, [obs_size, *hidden, 1], 1.0),
    }


def _mlp(layers: list, x):
    for w, b in layers[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = layers[-1]
    return x @ w + b


def actor_mean(params: dict, obs):
    """The mean action (before the environment clips it to [-1, 1]) for normalised observations."""
    return _mlp(params["actor"], obs)


def deterministic_action(layers: list, obs_mean, obs_var, obs):
    """The action a policy file plays for raw observations: the actor's mean on the normalised observation,
    clipped to the action box (search/rl/policy_file.py's NumPy pass does the same)."""
    return jnp.clip(actor_mean({"actor": layers}, normalise(obs, obs_mean, obs_var)), -1.0, 1.0)


def value(params: dict, obs):
    return _mlp(params["critic"], obs)[..., 0]


def log_prob(action, mean, log_std):
    """log N(action; mean, exp(log_std)^2), summed over the action's entries."""
    z = (action - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z * z - log_std - 0.5 * jnp.log(2.0 * jnp.pi), axis=-1)


def entropy(log_std):
    return jnp.sum(log_std + 0.5 * (1.0 + jnp.log(2.0 * jnp.pi)))


def normalise(obs, mean, var):
    return jnp.clip((obs - mean) / jnp.sqrt(var + VAR_EPS), -OBS_CLIP, OBS_CLIP)
