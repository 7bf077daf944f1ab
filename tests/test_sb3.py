"""Bring-your-own RL library: Stable-Baselines3 PPO trains on ServeControl-v0 (issue 7).

Optional: skipped unless stable-baselines3 (and so PyTorch) is installed: ``pip install stable-baselines3``.
On a CPU-only machine install a CPU build of torch first (e.g. ``pip install torch==2.13.0`` where its CPU wheel
is at hand), or pip fetches the multi-GB CUDA one.

Budget: ~4k env steps (about 136 episodes of 30 one-second intervals) plus PPO's updates, well under a minute on
two cores.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "stable_baselines3",
    reason="Stable-Baselines3 is not installed: pip install stable-baselines3 "
           "(it needs PyTorch; on a CPU-only machine install a CPU build of torch first)",
)

import gymnasium as gym  # noqa: E402
import torch  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.env_checker import check_env  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

import servetune  # noqa: E402,F401  (registers the envs)

CHAT = str(Path(__file__).resolve().parent.parent / "examples" / "chat.yaml")
OPTIONS = dict(config=CHAT, episode_s=30, bounds={"max_num_seqs": (1, 64)})
EPISODE_STEPS = 30          # episode_s / interval_s (1 s)
NUM_ENVS = 2
N_STEPS = 256               # per env per rollout: 512 transitions per update
TOTAL_TIMESTEPS = 4096      # 8 rollouts


def make_env():
    return Monitor(gym.make("servetune/ServeControl-v0", **OPTIONS))


class EpisodeInfos(BaseCallback):
    """Keeps the info of every step that ended an episode (the env adds info["metrics"] there)."""

    def __init__(self):
        super().__init__()
        self.final_infos: list[dict] = []
        self.steps = 0

    def _on_step(self) -> bool:
        self.steps += 1
        for done, info in zip(self.locals["dones"], self.locals["infos"]):
            if done:
                self.final_infos.append(info)
        return True


def check_episode(info: dict) -> None:
    """One finished episode: every request accounted for, and Monitor's return is run.json's score."""
    metrics = info["metrics"]
    assert metrics["completed"] + metrics["rejected"] + metrics["unfinished"] == metrics["arrived"], metrics
    assert metrics["arrived"] > 0
    episode = info["episode"]  # Monitor's summary
    assert 1 <= episode["l"] <= EPISODE_STEPS
    # docs/environments.md: the return is good - miss_penalty * (completed - good + rejected), miss_penalty 1.
    score = metrics["good"] - (metrics["completed"] - metrics["good"] + metrics["rejected"])
    assert episode["r"] == pytest.approx(score, abs=1e-3), (episode, metrics)


def test_sb3_env_checker():
    """SB3's checker passes, and has nothing to warn about (spaces, dtypes, bounds, reset/step returns)."""
    env = gym.make("servetune/ServeControl-v0", **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped, warn=True, skip_render_check=True)
        check_env(env, warn=True, skip_render_check=True)  # through gym.make's wrappers too
    env.close()
    checker = [f"{w.category.__name__}: {w.message}" for w in caught
               if "stable_baselines3" in w.filename or "gymnasium" in w.filename]
    assert not checker, checker


def test_sb3_ppo_trains_on_serve_control():
    torch.set_num_threads(1)  # the nets are tiny; threads only contend with JAX on small machines
    venv = VecNormalize(DummyVecEnv([make_env] * NUM_ENVS), norm_obs=True, norm_reward=False)
    model = PPO("MlpPolicy", venv, n_steps=N_STEPS, batch_size=128, n_epochs=4, seed=0, device="cpu", verbose=0)
    before = [p.detach().clone() for p in model.policy.parameters()]
    callback = EpisodeInfos()
    model.learn(total_timesteps=TOTAL_TIMESTEPS, callback=callback)

    # It ran exactly the steps asked for, in full rollouts, and updated the policy.
    assert model.num_timesteps == TOTAL_TIMESTEPS
    assert callback.steps * NUM_ENVS == TOTAL_TIMESTEPS
    assert model.rollout_buffer.full and model.rollout_buffer.buffer_size == N_STEPS
    assert model.logger.name_to_value["train/n_updates"] > 0
    assert all(np.isfinite(v) for k, v in model.logger.name_to_value.items() if k.startswith("train/"))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.policy.parameters()))

    # Every finished episode accounts for every request; 4096 steps over 30-step episodes end >= 130 of them.
    assert len(callback.final_infos) >= TOTAL_TIMESTEPS // EPISODE_STEPS - NUM_ENVS
    for info in callback.final_infos:
        check_episode(info)

    # The learned policy acts inside the action space, deterministically.
    space = venv.action_space
    obs = venv.reset()
    action, _ = model.predict(obs, deterministic=True)
    again, _ = model.predict(obs, deterministic=True)
    assert action.shape == (NUM_ENVS,) + space.shape and action.dtype == np.float32
    assert np.all(action >= space.low) and np.all(action <= space.high)
    np.testing.assert_array_equal(action, again)
    sampled, _ = model.predict(obs, deterministic=False)  # SB3 clips the Gaussian's samples into the box
    assert np.all(sampled >= space.low) and np.all(sampled <= space.high)

    # Evaluated with frozen normalisation statistics, the trained policy scores finite returns.
    venv.training = False
    rewards, lengths = evaluate_policy(model, venv, n_eval_episodes=2, deterministic=True,
                                       return_episode_rewards=True)
    assert len(rewards) == 2 and np.all(np.isfinite(rewards))
    assert all(1 <= length <= EPISODE_STEPS for length in lengths)
    venv.close()
