"""Speed peer for ppo_cartpole.py: the per-step work of CleanRL's ppo.py, re-written here.

CleanRL's code cannot be vendored into this repository, so this file reproduces what its
ppo.py does per environment step and per update, with its default hyperparameters, so that
steps per second can be measured side by side on the same machine:
  * every step: one `get_action_and_value` call (actor AND critic forward, a
    torch.distributions.Categorical built with argument validation, sample, log_prob,
    entropy), torch storage tensors written row by row, `torch.Tensor(...)` conversions of
    the numpy results, a SyncVectorEnv wrapped in RecordEpisodeStatistics;
  * every update: GAE over stored values, 4 epochs x 4 minibatches of the same PPO-clip loss,
    re-evaluating actor and critic through `get_action_and_value`.
Torch runs with its default thread count, as CleanRL does.
Only SPS is meant to be compared; use ppo_cartpole.py for learning results.

    python benchmark/peers/cleanrl_style_ppo.py --total-timesteps 100000
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from torch.distributions.categorical import Categorical


@dataclass
class Args:
    seed: int = 1
    env_id: str = "CartPole-v1"
    total_timesteps: int = 100000
    learning_rate: float = 2.5e-4
    num_envs: int = 4
    num_steps: int = 128
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id)) for _ in range(args.num_envs)]
    )
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(obs_dim, envs.single_action_space.n)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    T, N = args.num_steps, args.num_envs
    batch_size = T * N
    minibatch_size = batch_size // args.num_minibatches
    obs = torch.zeros((T, N, obs_dim))
    actions = torch.zeros((T, N))
    logprobs = torch.zeros((T, N))
    rewards = torch.zeros((T, N))
    dones = torch.zeros((T, N))
    values = torch.zeros((T, N))
    global_step = 0
    start = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.Tensor(next_obs)
    next_done = torch.zeros(N)
    num_iterations = args.total_timesteps // batch_size
    for iteration in range(1, num_iterations + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
        for step in range(T):
            global_step += N
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward).view(-1)
            next_obs, next_done = torch.Tensor(next_obs), torch.Tensor(next_done)
            if "final_info" in infos:  # CleanRL's logging loop (finds nothing under gymnasium 1.x)
                for info in infos["final_info"]:
                    if info and "episode" in info:
                        pass
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(T)):
                if t == T - 1:
                    nextnonterminal, nextvalues = 1.0 - next_done, next_value
                else:
                    nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values
        b_obs, b_logprobs = obs.reshape(-1, obs_dim), logprobs.reshape(-1)
        b_actions, b_advantages = actions.reshape(-1), advantages.reshape(-1)
        b_returns, b_values = returns.reshape(-1), values.reshape(-1)
        b_inds = np.arange(batch_size)
        for _ in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for s in range(0, batch_size, minibatch_size):
                mb = b_inds[s : s + minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions.long()[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                mb_adv = b_advantages[mb]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(
                    -mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                ).mean()
                newvalue = newvalue.view(-1)
                v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
    sps = global_step / (time.time() - start)
    print(f"cleanrl-style ppo: {global_step} steps, {sps:.0f} steps/s")


if __name__ == "__main__":
    main(tyro.cli(Args))
