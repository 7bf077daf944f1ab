"""Baseline policies, the bars an RL scheduler must clear: pure functions ``policy(obs, params) -> action``.

They are plain JAX, so they jit and vmap like the environments (``jax.vmap(policy, (0, None))``):

- ``vllm_defaults``: what ``vllm serve`` runs with no scheduler flags (envs/gym/actions.py ``vllm_knobs``).
- ``fixed_config``: the config's own knobs, every interval (the run ``servetune simulate`` reports).
- ``reactive`` (ServeControl only): the config's knobs, except that the token budget moves with what the
  observation shows: it shrinks by ``BUDGET_STEP`` when the interval's p99 inter-token gap passes
  ``ITL_HIGH`` of the ITL SLO (smaller steps decode sooner), else grows by ``BUDGET_STEP`` when at least
  ``QUEUE_BUILDING`` requests wait (bigger steps prefill more of them). Without an ITL SLO it only grows.
"""
from __future__ import annotations

import jax.numpy as jnp

from servetune.envs.gym.actions import INT_KNOBS
from servetune.envs.gym.world import EnvParams
from servetune.envs.gym.core import CONTROL_FIELDS

ITL_HIGH = 0.8          # fraction of the ITL SLO at which the budget shrinks
QUEUE_BUILDING = 4      # waiting requests at which the budget grows
BUDGET_STEP = 0.1       # action units per interval: a factor of about 1.23 at the default bounds

_ITL_P99 = CONTROL_FIELDS.index("itl_p99_slo")
_QUEUE_LEN = CONTROL_FIELDS.index("queue_len")
_BUDGET = INT_KNOBS.index("max_num_batched_tokens")


def vllm_defaults(obs, params: EnvParams):
    del obs
    return params.vllm_action


def fixed_config(obs, params: EnvParams):
    del obs
    return params.config_action


def reactive(obs, params: EnvParams):
    # The observation ends with the knobs in force; the budget's is the one the rule moves.
    budget = obs[len(CONTROL_FIELDS) + params.num_tenants + _BUDGET]
    change = jnp.where(obs[_ITL_P99] > ITL_HIGH, -BUDGET_STEP,
                       jnp.where(obs[_QUEUE_LEN] >= QUEUE_BUILDING, BUDGET_STEP, 0.0))
    return params.config_action.at[_BUDGET].set(jnp.clip(budget + change, -1.0, 1.0))


BASELINES = {"vllm_defaults": vllm_defaults, "fixed_config": fixed_config, "reactive": reactive}
