"""Peer for trpo_gpt2_halfcheetah.py --policy mlp: SB3-contrib's TRPO, for speed and learning side by side.

Benchmark only (install with `pip install -r benchmark/requirements-peers.txt`); the repository's scripts
do not depend on it. Two settings (`--hyperparams`):

  * `same` (default): the settings of trpo_gpt2_halfcheetah.py --policy mlp, as far as SB3-contrib has
    them: 10 envs x 1500 steps = 15000 steps per update, gamma 0.995, GAE lambda 0.97, CG 10 iterations,
    damping 0.1, max KL 0.01, 64x64 tanh policy and value networks, observation normalisation (running
    mean/std, clipped at 5, rewards not normalised), one torch thread. What SB3-contrib does its own way
    (not configurable to ours): the value net is fitted by Adam (lr 1e-3, 10 epochs of minibatches of
    128, its defaults) instead of L-BFGS, the line search shrinks by 0.8 instead of 0.5, float32;
  * `zoo`: rl-baselines3-zoo's tuned HalfCheetah TRPO hyperparameters (hyperparams/trpo.yml, the
    `HalfCheetah-v4` entry: 2 envs x 1024 steps, batch 128, gamma 0.99, lambda 0.95, CG 25 iterations,
    damping 0.1, 20 critic epochs, lr 1e-3, target KL 0.04, VecNormalize of observations AND rewards),
    the setting of SB3-contrib's published 1803 +- 46 at 1M steps (HalfCheetah-v3, 3 seeds).

Logs what the harness reads, as the script does: TensorBoard scalars charts/episodic_return,
charts/episodic_length, charts/SPS, time/rollout_seconds, time/update_seconds in runs/{run_name}, a final
line `... N steps/s`, and with `--eval-episodes K` (K > 0) the deterministic evaluation (mean action,
observation statistics frozen) as eval/episodic_return, env seeds seed+10000 ... as the script.

    python benchmark/peers/sb3_trpo_halfcheetah.py --total-timesteps 150000 --seed 1
    python benchmark/peers/sb3_trpo_halfcheetah.py --hyperparams zoo --eval-episodes 10 --seed 1
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import tyro


@dataclass
class Args:
    env_id: str = "HalfCheetah-v5"
    """the environment id"""
    total_timesteps: int = 1000000
    """total environment steps"""
    seed: int = 1
    """seed of SB3 (envs, torch, numpy)"""
    hyperparams: Literal["same", "zoo"] = "same"
    """`same` (the settings of trpo_gpt2_halfcheetah.py --policy mlp) or `zoo` (rl-baselines3-zoo's HalfCheetah)"""
    torch_threads: int = 1
    """torch intra-op threads"""
    eval_episodes: int = 0
    """deterministic evaluation episodes after training (0: none)"""
    exp_name: str = "sb3_trpo"
    """part of the run folder's name"""


def settings(name: str) -> tuple[int, dict, dict]:
    """(number of envs, TRPO keyword arguments, VecNormalize keyword arguments)."""
    net = dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh)
    if name == "same":
        return (
            10,
            dict(
                n_steps=1500,
                gamma=0.995,
                gae_lambda=0.97,
                cg_max_steps=10,
                cg_damping=0.1,
                target_kl=0.01,
                policy_kwargs=net,
            ),
            dict(norm_obs=True, norm_reward=False, clip_obs=5.0),
        )
    # rl-baselines3-zoo hyperparams/trpo.yml, HalfCheetah-v4 (= mujoco defaults + target_kl 0.04); the zoo's
    # `normalize: true` is VecNormalize's defaults (observations and rewards, clip 10) with the algorithm's gamma
    return (
        2,
        dict(
            n_steps=1024,
            batch_size=128,
            gamma=0.99,
            gae_lambda=0.95,
            sub_sampling_factor=1,
            cg_max_steps=25,
            cg_damping=0.1,
            n_critic_updates=20,
            learning_rate=1e-3,
            target_kl=0.04,
            policy_kwargs=net,
        ),
        dict(norm_obs=True, norm_reward=True, gamma=0.99),
    )


def main(args: Args) -> None:
    if args.total_timesteps < 1 or args.torch_threads < 1 or args.eval_episodes < 0:
        sys.exit("error: --total-timesteps and --torch-threads must be at least 1, --eval-episodes at least 0.")
    try:
        gym.make(args.env_id).close()
    except Exception as e:
        sys.exit(f"error: cannot make env '{args.env_id}': {(str(e).splitlines() or [type(e).__name__])[0]}")
    try:
        from sb3_contrib import TRPO
        from stable_baselines3.common.callbacks import BaseCallback
        from stable_baselines3.common.env_util import make_vec_env
        from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize
    except ImportError:
        sys.exit("error: this peer needs sb3-contrib: pip install -r benchmark/requirements-peers.txt")
    from torch.utils.tensorboard import SummaryWriter

    torch.set_num_threads(args.torch_threads)
    n_envs, kwargs, norm = settings(args.hyperparams)
    run_name = f"{args.env_id}__{args.exp_name}-{args.hyperparams}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n"
        + "\n".join(f"|{k}|{v}|" for k, v in {**vars(args), "n_envs": n_envs, **kwargs, **norm}.items()),
    )
    venv = VecNormalize(make_vec_env(args.env_id, n_envs=n_envs, seed=args.seed, vec_env_cls=DummyVecEnv), **norm)
    model = TRPO("MlpPolicy", venv, seed=args.seed, device="cpu", **kwargs)

    class Log(BaseCallback):
        """Episodes (from the Monitor wrapper's info), SPS and the rollout / update time split."""

        def _on_training_start(self) -> None:
            self.start = time.time()
            self.rollout_start = self.update_start = None

        def _on_rollout_start(self) -> None:
            now = time.time()
            if self.update_start is not None:
                writer.add_scalar("time/update_seconds", now - self.update_start, self.num_timesteps)
            self.rollout_start = now

        def _on_rollout_end(self) -> None:
            now = time.time()
            writer.add_scalar("time/rollout_seconds", now - self.rollout_start, self.num_timesteps)
            writer.add_scalar("charts/SPS", int(self.num_timesteps / (now - self.start)), self.num_timesteps)
            self.update_start = now

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    writer.add_scalar("charts/episodic_return", info["episode"]["r"], self.num_timesteps)
                    writer.add_scalar("charts/episodic_length", info["episode"]["l"], self.num_timesteps)
            return True

    log = Log()
    model.learn(args.total_timesteps, callback=log)
    elapsed = time.time() - log.start
    if log.update_start is not None:
        writer.add_scalar("time/update_seconds", time.time() - log.update_start, model.num_timesteps)
    print(f"{run_name}: {model.num_timesteps} steps, {int(model.num_timesteps / elapsed)} steps/s")

    if args.eval_episodes > 0:
        venv.training, venv.norm_reward = False, False  # frozen statistics, raw rewards
        env = gym.make(args.env_id)
        returns = []
        for ep in range(args.eval_episodes):
            obs, _ = env.reset(seed=args.seed + 10_000 + ep)
            done, total = False, 0.0
            while not done:
                action, _ = model.predict(venv.normalize_obs(obs[None]), deterministic=True)
                obs, reward, terminated, truncated, _ = env.step(action[0])
                total += float(reward)
                done = terminated or truncated
            returns.append(total)
            writer.add_scalar("eval/episodic_return", total, ep)
        env.close()
        print(f"eval: {np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)} episodes")
    venv.close()
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args))
