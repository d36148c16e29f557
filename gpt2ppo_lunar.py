"""GPT2PPO: PPO-clip whose critic reads the episode's recent steps through a small GPT-2, in CleanRL's layout.

"GPT2PPO: Auto Regressive Proximal Policy Optimization" (Cozma and Price) on PPO (Schulman et al. 2017,
https://arxiv.org/abs/1707.06347): the actor sees only the current state; the critic is a Decision-Transformer-style
GPT-2 (Chen et al. 2021, https://arxiv.org/abs/2106.01345) over the last `--context-len` steps of the CURRENT episode
(tokens s, a, s, a, ..., s), its value read at the current state's token; `--critic mlp` is plain PPO. Defaults: the
paper's Table I (dropout 0.5, 150 epochs of 2048 steps; its seed is --seed 123). Unlike the authors' code, the whole
critic trains, dropout is off in rollouts and value targets, and a time-limit truncation bootstraps from V(final
observation) over that episode's history. `--value-stride S`: windows start only every S steps (the CPU's
approximation).

    python gpt2ppo_lunar.py --value-stride 64 --dropout 0.1 --save-model
    python gpt2ppo_lunar.py --eval-checkpoint runs/<run>/gpt2ppo_lunar.pt
    python gpt2ppo_lunar.py --resume runs/<run>

The algorithm reads top to bottom down to the `# ---- Run machinery` banner; below it are the checks, signals,
checkpoints, the run object that owns the run folder, its log and the training state that `--resume` continues
from, and the evaluation-only mode.
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while the packages below load: one line, not a traceback
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted while starting", file=sys.stderr), os._exit(130)))

import contextlib
import copy
import fcntl
import gc
import io
import itertools
import math
import random
import re
import shutil
import stat
import threading
import time
import types
import uuid
import warnings
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Annotated, Literal, Optional, Union, get_args, get_origin

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro


@dataclass
class Args:
    exp_name: str = "gpt2ppo_lunar"
    """the name of this experiment (letters, digits, `.`, `_`, `-`; part of the run folder's name)"""
    seed: Annotated[int, "[0, 4294967295]", "eval"] = 1
    """seed of the experiment; with --eval-checkpoint, a value other than 1 replaces the checkpoint's seed"""
    cuda: Annotated[bool, "resume", "eval"] = True
    """use CUDA when torch sees a device (`--no-cuda`: the CPU)"""
    torch_threads: Annotated[int, "[1, 1024]", "resume", "eval"] = 1
    """torch intra-op threads"""
    save_model: Annotated[bool, "resume"] = False
    """save a checkpoint into the run folder when training ends or is stopped; a run that ends (not a stopped one)
    then evaluates it"""
    eval_checkpoint: Annotated[Optional[str], "path", "eval"] = None
    """path of a checkpoint whose actor is evaluated instead of training"""
    eval_episodes: Annotated[int, "[1, 1e6]", "resume", "eval"] = 10
    """number of greedy evaluation episodes (`--eval-checkpoint`, `--save-model`), episode i seeded 10000 + seed + i"""
    checkpoint_every: Annotated[int, "[1, 1e9]", "resume"] = 10
    """save the training state (for `--resume`) every this many updates (rollout and update of steps_per_epoch
    steps), and when the run ends or is stopped"""
    resume: Annotated[Optional[str], "path", "resume"] = None
    """a run folder to continue, with its own flags, to its original budget (in the same folder and log); a flag given
    at a non-default value must equal the run's, except those that change only how the run computes (threads, device,
    checkpointing, saving, evaluation), which replace the run's"""
    track: bool = False
    """log to Weights & Biases as well: the TensorBoard scalars are mirrored (WANDB_MODE=offline: no network)"""
    wandb_project_name: str = "llm-rl"
    """the W&B project (--track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity, a user or team (--track; default: the account's)"""
    capture_video: Annotated[bool, "resume", "eval"] = False
    """record the evaluation episodes (--save-model, --eval-checkpoint) as MP4 files in the run folder's videos/"""

    env_id: str = "LunarLander-v3"
    """the id of the environment (flat Box observations, Discrete or flat Box actions, an episode limit)"""
    critic: Literal["gpt2", "mlp"] = "gpt2"
    """`gpt2`: GPT2PPO's critic over the episode's history; `mlp`: plain PPO's, on the current state"""
    total_timesteps: Annotated[int, "[1, 1e12]"] = 150 * 2048
    """total environment steps (Table I: 150 epochs x 2048), rounded up to whole rollouts"""
    steps_per_epoch: Annotated[int, "[1, 16777216]"] = 2048
    """environment steps per rollout (the paper's "epoch"), summed over all envs"""
    num_envs: Annotated[int, "[1, 1024]"] = 4
    """the number of parallel environments (each runs steps_per_epoch / num_envs steps per rollout)"""
    update_epochs: Annotated[int, "[1, 10000]"] = 5
    """Adam steps per minibatch per update (Table I's "training steps per epoch")"""
    update_schedule: Literal["shuffled", "authors"] = "shuffled"
    """`shuffled`: update_epochs passes over the rollout, each reshuffled; `authors`: the authors' code, one pass in
    rollout order with update_epochs consecutive steps on each minibatch"""
    minibatch_size: Annotated[int, "[1, 16777216]"] = 128
    """samples per minibatch (must divide steps_per_epoch)"""
    actor_lr: Annotated[float, "(0, 1]"] = 3e-4
    """Adam learning rate of the actor"""
    critic_lr: Annotated[float, "(0, 1]"] = 1e-3
    """Adam learning rate of the critic (GPT-2, its embeddings and the value head)"""
    gamma: Annotated[float, "[0, 1]"] = 0.99
    """the discount factor gamma"""
    gae_lambda: Annotated[float, "[0, 1]"] = 0.95
    """the lambda of generalized advantage estimation (the critic's targets are the GAE returns)"""
    clip_coef: Annotated[float, "(0, 10]"] = 0.2
    """the surrogate clipping coefficient"""
    max_grad_norm: Annotated[float, "[0, 1e6]"] = 0.5
    """clip the gradient norm of actor and critic separately (0: no clipping)"""
    hidden_size: Annotated[int, "[1, 65536]"] = 64
    """width of the actor and MLP critic layers, and GPT-2's n_embd"""
    context_len: Annotated[int, "[1, 4096]"] = 64
    """steps of the current episode the GPT-2 critic sees (2 * context_len - 1 tokens)"""
    n_layer: Annotated[int, "[1, 96]"] = 2
    """GPT-2 blocks"""
    n_head: Annotated[int, "[1, 1024]"] = 8
    """GPT-2 attention heads (must divide hidden_size)"""
    dropout: Annotated[float, "[0, 0.99]"] = 0.5
    """GPT-2 dropout (Table I), active only in training passes"""
    value_stride: Annotated[int, "[1, 4096]"] = 1
    """S > 1: windows start every S steps (they hold K-S+1..K steps), so S states share one critic pass"""


def make_env(env_id: str):
    return lambda: gym.make(env_id)  # a thunk: the vector env makes each copy


def env_dims(envs) -> tuple[int, int, int, bool]:
    """(episode limit, obs_dim, act_dim, discrete) of a vector env's copies."""
    obs, act = envs.single_observation_space, envs.single_action_space
    discrete = isinstance(act, gym.spaces.Discrete)
    return envs.envs[0].spec.max_episode_steps, int(obs.shape[0]), int(act.n if discrete else act.shape[0]), discrete


def to_env_action(action: np.ndarray, act_space) -> np.ndarray:
    """What the env receives: a Gaussian sample clipped to the bounds (the sample itself is what is stored)."""
    return np.clip(action, act_space.low, act_space.high) if isinstance(act_space, gym.spaces.Box) else action


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Actor(nn.Module):
    """Linear-ReLU-Linear-ReLU (the authors' CommonBase) on the current state, then the logits of a categorical or
    the mean of a diagonal Gaussian with a state-independent log-std."""

    def __init__(self, obs_dim: int, act_dim: int, discrete: bool, hidden: int):
        super().__init__()
        self.discrete = discrete
        self.body = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.ReLU(),
        )
        self.head = layer_init(nn.Linear(hidden, act_dim), std=0.01)
        if not discrete:
            self.log_std = nn.Parameter(torch.zeros(act_dim))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        out = self.head(self.body(obs))
        if self.discrete:
            return torch.distributions.Categorical(logits=out)
        return torch.distributions.Independent(torch.distributions.Normal(out, self.log_std.exp().expand_as(out)), 1)

    def log_prob_entropy(self, obs: torch.Tensor, actions: torch.Tensor):
        d = self.dist(obs)
        return d.log_prob(actions), d.entropy()

    def act(self, obs: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        d = self.dist(obs)
        if not greedy:
            return d.sample()
        return d.probs.argmax(-1) if self.discrete else d.mean


class MLPCritic(nn.Module):
    """Plain PPO's critic: a 2x64 ReLU MLP on the current state."""

    def __init__(self, obs_dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )

    def forward(self, states, actions, timesteps, mask):
        return self.net(states).squeeze(-1)  # (B, K): the value of the state at every position


class GPT2Critic(nn.Module):
    """Decision-Transformer-style critic: GPT2Model over a window's tokens s_0, a_0, ..., s_K-1 (linear(x) + timestep
    embedding, LayerNorm) with causal attention and the padding mask; position embeddings zeroed and frozen. The value
    is a linear head on each state token's last hidden state (position K-1: the window's current state)."""

    def __init__(self, obs_dim, act_dim, hidden_size, context_len, n_layer, n_head, dropout, max_timestep):
        super().__init__()
        from transformers import AttentionInterface, GPT2Config, GPT2Model
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register("gpt2ppo_fast_dropout", GPT2Critic.attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register("gpt2ppo_fast_dropout", sdpa_mask)
        self.max_timestep = max_timestep
        config = GPT2Config(
            vocab_size=1,
            n_positions=2 * context_len,
            n_embd=hidden_size,
            n_layer=n_layer,
            n_head=n_head,
            n_inner=4 * hidden_size,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            use_cache=False,
            bos_token_id=None,
            eos_token_id=None,
            attn_implementation="gpt2ppo_fast_dropout",
        )
        self.gpt2 = GPT2Model(config)
        nn.init.zeros_(self.gpt2.wpe.weight).requires_grad_(False)
        self.gpt2.wte.weight.requires_grad_(False)  # unused: tokens come in as inputs_embeds
        self.embed_timestep = nn.Embedding(max_timestep + 1, hidden_size)
        # it stands in for GPT-2's position embedding, so it gets GPT-2's initializer, not nn.Embedding's N(0, 1)
        nn.init.normal_(self.embed_timestep.weight, std=config.initializer_range)
        self.embed_state = nn.Linear(obs_dim, hidden_size)
        self.embed_action = nn.Linear(act_dim, hidden_size)
        self.embed_ln = nn.LayerNorm(hidden_size)
        self.head = layer_init(nn.Linear(hidden_size, 1), std=1.0)

    def forward(self, states, actions, timesteps, mask):
        """The value at every position of the windows (B, K); all-padding columns are left out of the pass."""
        B, K, _ = states.shape
        first = self.first_real_column(mask)
        if first > 0:
            v = self.forward(states[:, first:], actions[:, first:], timesteps[:, first:], mask[:, first:])
            return nn.functional.pad(v, (first, 0))
        t = self.embed_timestep(timesteps.clamp(max=self.max_timestep))
        tokens = torch.stack([self.embed_state(states) + t, self.embed_action(actions) + t], 2).reshape(B, 2 * K, -1)
        tokens = tokens[:, :-1]  # s_0, a_0, ..., s_K-1: the current state's action is not chosen yet
        tok_mask = mask.repeat_interleave(2, dim=1)[:, :-1]
        h = self.gpt2(inputs_embeds=self.embed_ln(tokens), attention_mask=tok_mask.long(), use_cache=False)
        return self.head(h.last_hidden_state[:, 0::2]).squeeze(-1)  # (B, K): the value at every state token

    # Two speed paths of the forward pass, each with the plain computation as its reference in the tests. Both stay
    # whatever they pay: the training passes' dropout draws, and so the numbers, depend on them.
    @staticmethod
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """GPT-2 attention (transformers' AttentionInterface): the fused SDPA without dropout (eval passes), else the
        textbook computation with inverted dropout drawn by rand_like (the SDPA with dropout is slow on a CPU).
        attention_mask: True = may attend, or None (causal); fully masked (padded) rows get a finite, unused output."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if dropout == 0.0:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs
            )
        L, S = query.shape[-2], key.shape[-2]
        scores = (query * (query.shape[-1] ** -0.5 if scaling is None else scaling)) @ key.transpose(-1, -2)
        if attention_mask is None:
            attention_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)
        bias = torch.zeros(attention_mask.shape, dtype=scores.dtype, device=scores.device)
        probs = (scores + bias.masked_fill_(~attention_mask, torch.finfo(scores.dtype).min)).softmax(-1)
        keep = torch.rand_like(probs).ge_(dropout)  # 1.0 with probability 1 - dropout, else 0.0
        return ((probs * keep) @ (value / (1.0 - dropout))).transpose(1, 2).contiguous(), None

    @staticmethod
    def first_real_column(mask: torch.Tensor) -> int:
        """The first column of a (B, K) padding mask that some window uses (0 when none does). Columns that are
        padding in EVERY window change nothing (masked, no position embeddings), so a batch of short windows costs
        only its longest window; their values are 0."""
        return int(mask.any(0).to(torch.int8).argmax()) if bool(mask.any()) else 0


def make_critic(kind: str, obs_dim: int, act_dim: int, config: dict) -> nn.Module:
    """The critic of `--critic kind` with the sizes in `config` (the run's args and the env's max_timestep)."""
    if kind == "mlp":
        return MLPCritic(obs_dim, config["hidden_size"])
    sizes = {k: config[k] for k in ("hidden_size", "context_len", "n_layer", "n_head", "dropout", "max_timestep")}
    return GPT2Critic(obs_dim, act_dim, **sizes)


def window_reach(timesteps, context_len: int, value_stride: int):
    """How far back the window of a state at episode timestep t reaches: t - s(t). S = 1: the last K steps
    (min(t, K-1)). S > 1: windows start at multiples of S, s(t) = max(0, S * floor((t - K + S) / S)), so a window
    holds K-S+1..K steps and the states of one segment share one sequence."""
    t = np.asarray(timesteps)
    start = np.maximum(0, value_stride * np.floor_divide(t - context_len + value_stride, value_stride))
    return t - start


def build_windows(obs, act, ts, reach, rows, context_len: int):
    """The windows of `rows` gathered from stored steps (obs (R, obs_dim), act (R, act_dim), ts and reach (R,), in
    time order per env): rows r-K+1..r, left-padded; position j is real (mask True) iff r - j <= reach[r], so a
    window never leaves its episode. Padded positions are zeros, and so is the last position's action (not chosen
    yet when the value is needed). Returns states (B, K, obs_dim), actions (B, K, act_dim), timesteps, mask (B, K)."""
    back = torch.arange(context_len - 1, -1, -1, device=obs.device)  # K-1, ..., 1, 0 steps back
    idx = rows[:, None] - back[None, :]
    mask = back[None, :] <= reach[rows][:, None]
    states = obs[idx] * mask[..., None]
    actions = act[idx] * mask[..., None]
    actions[:, -1] = 0.0
    return states, actions, ts[idx] * mask, mask


class History:
    """Each env's rollout stored once, after the previous rollout's last K-1 rows: per env, rows 0..K-2 history,
    K-1+t rollout step t, K-1+T the state it ended in (numpy, with torch views of the same memory to gather)."""

    def __init__(self, num_envs: int, num_steps: int, context_len: int, value_stride: int, obs_dim: int, act_dim: int):
        self.T, self.K, self.S = num_steps, context_len, value_stride
        self.L = context_len + num_steps
        self.obs = np.zeros((num_envs, self.L, obs_dim), dtype=np.float32)
        self.act = np.zeros((num_envs, self.L, act_dim), dtype=np.float32)
        self.ts = np.zeros((num_envs, self.L), dtype=np.int64)
        self.reach = np.zeros((num_envs, self.L), dtype=np.int64)
        arrays = (self.obs, self.act, self.ts, self.reach)
        self.views = [torch.from_numpy(x).view(num_envs * self.L, *x.shape[2:]) for x in arrays]

    def put_state(self, step: int, obs: np.ndarray, timesteps: np.ndarray) -> None:
        r = self.K - 1 + step
        self.obs[:, r] = obs
        self.ts[:, r] = timesteps
        self.act[:, r] = 0.0
        self.reach[:, r] = window_reach(timesteps, self.K, self.S)

    def put_action(self, step: int, actions_vec: np.ndarray) -> None:
        """The actions of rollout step `step`: one-hot (discrete) or the sampled, unclipped Gaussian action."""
        self.act[:, self.K - 1 + step] = actions_vec

    def windows(self, flat_rows, device: torch.device | str = "cpu") -> tuple:
        return tuple(x.to(device) for x in build_windows(*self.views, torch.as_tensor(flat_rows), self.K))

    def segments(self, flat_rows: np.ndarray):
        """States whose windows start at the same row share a segment: by causality, the window of its last state
        gives each state its own window's value at its own position. Returns (last row, segment of, back)."""
        uniq, seg_of = np.unique(flat_rows - self.reach.reshape(-1)[flat_rows], return_inverse=True)
        seg_rows = np.full(len(uniq), -1, dtype=np.int64)
        np.maximum.at(seg_rows, seg_of, flat_rows)
        return seg_rows, seg_of, seg_rows[seg_of] - flat_rows

    def final_window(self, env: int, step: int, final_obs: np.ndarray):
        """The window of an episode's final observation, reached by the action of rollout step `step`."""
        r, K = self.K - 1 + step, self.K
        obs = np.concatenate([self.obs[env, r - K + 2 : r + 1], final_obs[None].astype(np.float32)])
        act = np.concatenate([self.act[env, r - K + 2 : r + 1], np.zeros_like(self.act[env, :1])])
        ts = np.concatenate([self.ts[env, r - K + 2 : r + 1], self.ts[env, r : r + 1] + 1])
        reach = window_reach(ts, K, self.S)
        return build_windows(*map(torch.from_numpy, (obs, act, ts, reach)), torch.tensor([K - 1]), K)

    def carry_over(self) -> None:
        """The next rollout's K-1 history rows and first state are this one's last K rows."""
        for a in (self.obs, self.act, self.ts, self.reach):
            a[:, : self.K] = a[:, self.T : self.T + self.K].copy()

    def state_dict(self) -> dict:
        return {name: torch.from_numpy(getattr(self, name).copy()) for name in ("obs", "act", "ts", "reach")}

    def load_state_dict(self, state: dict) -> None:
        """In place (the torch views share this memory), once every window stays inside its episode."""
        ts, reach = state["ts"].numpy(), state["reach"].numpy()
        if not ((ts >= 0) & (reach >= 0) & (reach <= np.minimum(ts, self.K - 1))).all():
            raise ValueError("its history holds windows that reach outside their episodes")
        for name in ("obs", "act", "ts", "reach"):
            getattr(self, name)[...] = state[name].numpy()


@torch.no_grad()
def state_values(critic: nn.Module, history: History, flat_rows: np.ndarray, chunk: int = 256, device="cpu"):
    """V (on the CPU) of the states at `flat_rows`, each from its own window, in a few passes over segments."""
    seg_rows, seg_of, back = history.segments(flat_rows)
    per_pos = torch.cat(
        [critic(*history.windows(seg_rows[i : i + chunk], device)).cpu() for i in range(0, len(seg_rows), chunk)]
    )
    return per_pos[torch.from_numpy(seg_of), torch.from_numpy(history.K - 1 - back)]


def compute_gae(rewards, values, next_values, terminations, dones, gamma, gae_lambda):
    """GAE over a rollout of shape (T, N) -> (advantages, returns).

    next_values[t] is V of the state reached after step t (after an episode's last step: V(final observation));
    terminations[t] cuts the bootstrap, dones[t] (terminated or truncated) cuts the recursion, so a truncated step
    keeps gamma * V(final observation).
    """
    deltas = rewards + gamma * next_values * (1.0 - terminations) - values  # the TD errors, all at once
    decay = gamma * gae_lambda * (1.0 - dones)
    advantages, last = rewards * 0.0, 0.0  # zeros of the rewards' type: numpy arrays and torch tensors alike
    for t in reversed(range(rewards.shape[0])):
        advantages[t] = last = deltas[t] + decay[t] * last
    return advantages, advantages + values


def minibatch_plan(schedule: str, batch: int, n_segments: int, minibatch_size: int, update_epochs: int, rng):
    """The update's Adam steps as (actor minibatch, critic segments) pairs. shuffled: update_epochs passes, each
    reshuffled; authors: one pass in rollout order, update_epochs consecutive steps on each minibatch."""
    n_mb = -(-batch // minibatch_size)
    b_inds, seg_inds = np.arange(batch), np.arange(n_segments)
    for _ in range(1 if schedule == "authors" else update_epochs):
        if schedule == "shuffled":
            rng.shuffle(b_inds)
            rng.shuffle(seg_inds)
        seg_batches = np.array_split(seg_inds.copy(), n_mb)
        for k, start in enumerate(range(0, batch, minibatch_size)):
            for _ in range(update_epochs if schedule == "authors" else 1):
                yield b_inds[start : start + minibatch_size].copy(), seg_batches[k]


def clipped_surrogate_loss(new_logprob, old_logprob, advantages, clip_coef):
    """PPO-clip policy loss mean(max(-A r, -A clip(r, 1-eps, 1+eps))), r = pi_new / pi_old.

    Also returns, for logging, the approximate KL ((r - 1) - log r) and the fraction of clipped ratios.
    """
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    with torch.no_grad():
        return loss, ((ratio - 1) - logratio).mean(), ((ratio - 1.0).abs() > clip_coef).float().mean()


def value_loss(new_values, targets):
    """The critic's loss: 0.5 * mean squared error to the GAE returns."""
    return 0.5 * ((new_values - targets) ** 2).mean()


def budget(args: Args) -> tuple[int, int]:
    """(updates, steps per update) of a run: its --total-timesteps in whole rollouts of --steps-per-epoch steps."""
    return -(-args.total_timesteps // args.steps_per_epoch), args.steps_per_epoch


def evaluate(objects: dict, env_id: str, args: Args, seed: int, writer, stop, videos: Optional[str] = None) -> list:
    """--eval-episodes greedy episodes of the actor on the CPU, episode i reset with seed + i, logged as
    eval/episodic_return; with `videos` (a folder), each recorded into it as an MP4 file. A stop request ends the
    evaluation after the current episode."""
    actor, returns = objects["actor"].cpu().eval(), []
    env = gym.make(env_id, render_mode=None if videos is None else "rgb_array")
    if videos is not None:
        env = gym.wrappers.RecordVideo(env, video_folder=videos, episode_trigger=lambda e: True, name_prefix="eval")
    with torch.inference_mode():
        for ep in range(args.eval_episodes):
            if stop.requested:
                break
            obs, done = env.reset(seed=seed + ep)[0], False
            returns.append(0.0)
            while not done:
                action = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], greedy=True)[0].numpy()
                obs, reward, terminated, truncated, _ = env.step(to_env_action(action, env.action_space))
                returns[-1], done = returns[-1] + float(reward), terminated or truncated
            writer.add_scalar("eval/episodic_return", returns[-1], ep)
    env.close()  # the last video is written here
    mean, std = np.mean(returns or [np.nan]), np.std(returns or [np.nan])
    where = f"env {env_id}, seeds from {seed}" + ("" if videos is None else f"; videos in {videos}")
    print(f"eval: {mean:.2f} +- {std:.2f} over {len(returns)} of {args.eval_episodes} episodes ({where})", flush=True)
    return returns


def main(args: Args, stop: Optional["StopSignal"] = None) -> int:
    """Train (or, with --eval-checkpoint, evaluate); returns the exit status: 0, or 128 + the signal that stopped it."""
    stop = StopSignal() if stop is None else stop
    if args.eval_checkpoint is not None:
        return evaluate_checkpoint(args, stop)
    run = Run(args, stop)  # the flags checked; with --resume, the run's own, read from its training state
    args = run.args
    torch.set_num_threads(args.torch_threads)
    T, N = args.steps_per_epoch // args.num_envs, args.num_envs  # steps per env per rollout, envs
    num_updates, _ = budget(args)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    # SAME_STEP autoreset: a done step returns the next episode's first obs, the real last one is in info["final_obs"]
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id) for _ in range(N)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    max_timestep, obs_dim, act_dim, discrete = env_dims(envs)
    actor = Actor(obs_dim, act_dim, discrete, args.hidden_size).to(device)
    critic = make_critic(args.critic, obs_dim, act_dim, {**vars(args), "max_timestep": max_timestep}).to(device)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=args.actor_lr, eps=1e-5)
    critic_params = [p for p in critic.parameters() if p.requires_grad]  # all but GPT-2's frozen wpe and wte
    critic_opt = torch.optim.Adam(critic_params, lr=args.critic_lr, eps=1e-5)
    shuffle_rng = np.random.default_rng(args.seed)

    K, S = (args.context_len, args.value_stride) if args.critic == "gpt2" else (1, 1)  # the MLP's window: one step
    history = History(N, T, K, S, obs_dim, act_dim)
    act_buf = np.zeros((T, N) if discrete else (T, N, act_dim), dtype=np.int64 if discrete else np.float32)
    rewards_buf = np.zeros((T, N), dtype=np.float32)
    terminations_buf = np.zeros((T, N), dtype=np.float32)
    dones_buf = np.zeros((T, N), dtype=np.float32)
    eye = np.eye(act_dim, dtype=np.float32)  # one-hot discrete actions, for the critic's history
    episode_return = np.zeros(N)
    episode_length = np.zeros(N, dtype=np.int64)  # the current timestep of each env's episode
    recent_returns: deque = deque(maxlen=100)
    # flat History rows: every state of the rollout and the one it ended in, env-major; the T*N samples, step-major
    rows_all = (np.arange(N)[:, None] * history.L + K - 1 + np.arange(T + 1)[None]).reshape(-1)
    rows_train = (np.arange(N)[None] * history.L + K - 1 + np.arange(T)[:, None]).reshape(-1)

    next_obs = envs.reset(seed=args.seed)[0].astype(np.float32)
    # the run folder and its log; a resumed run puts these objects back as they were at its last training state
    first_update, global_step = run.start(
        actor=actor,
        critic=critic,
        actor_optimizer=actor_opt,
        critic_optimizer=critic_opt,
        shuffle_rng=shuffle_rng,
        history=history,
        episode_return=episode_return,
        episode_length=episode_length,
        recent_returns=recent_returns,
        envs=envs,
        next_obs=next_obs,
    )
    first_step, start_time = global_step, time.time()
    if device.type == "cpu" and args.critic == "gpt2" and args.value_stride == 1:
        print("exact windows: minutes per update on a CPU (--value-stride 64: ~64x fewer passes)", flush=True)
    for update in range(first_update + 1, num_updates + 1):
        rollout_start = time.time()
        actor.eval()
        critic.eval()  # no dropout while collecting data and computing value targets
        truncated_at = []  # (step, env, final window) of truncated episodes, to bootstrap
        with torch.inference_mode():
            for step in range(T):
                global_step += N
                history.put_state(step, next_obs, episode_length)
                action = actor.act(torch.from_numpy(next_obs).to(device)).cpu().numpy()
                act_buf[step] = action  # the sample, unclipped: its log-probability is the one PPO's ratio needs
                history.put_action(step, eye[action] if discrete else action)
                next_obs, reward, terminations, truncations, infos = envs.step(
                    to_env_action(action, envs.single_action_space)
                )
                next_obs = next_obs.astype(np.float32)
                dones = np.logical_or(terminations, truncations)
                rewards_buf[step], terminations_buf[step], dones_buf[step] = reward, terminations, dones
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(dones):
                    if not terminations[i]:  # truncated: V(final obs) with this episode's history
                        truncated_at.append((step, i, history.final_window(i, step, infos["final_obs"][i])))
                    run.writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    run.writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    recent_returns.append(episode_return[i])
                    episode_return[i], episode_length[i] = 0.0, 0
            history.put_state(T, next_obs, episode_length)

            # every state's value (and the final state's) in a few batched passes, with the update's windows
            values_all = state_values(critic, history, rows_all, device=device).view(N, T + 1).T.numpy()  # (T+1, N)
            values, next_values = values_all[:T], values_all[1:].copy()  # after a done step: another episode ...
            if truncated_at:  # ... replaced by V(final obs) where the episode was truncated
                windows = [torch.cat(parts).to(device) for parts in zip(*[w for _, _, w in truncated_at])]
                for (step, i, _), v in zip(truncated_at, critic(*windows)[:, -1].cpu().numpy()):
                    next_values[step, i] = v
            advantages, returns = compute_gae(
                rewards_buf, values, next_values, terminations_buf, dones_buf, args.gamma, args.gae_lambda
            )
            b_obs = torch.from_numpy(history.obs[:, K - 1 : -1].transpose(1, 0, 2).reshape(T * N, obs_dim)).to(device)
            b_actions = torch.from_numpy(act_buf.reshape((T * N,) + act_buf.shape[2:])).to(device)
            b_logprobs, _ = actor.log_prob_entropy(b_obs, b_actions)
        rollout_time = time.time() - rollout_start

        b_obs, b_logprobs = b_obs.clone(), b_logprobs.clone()  # out of inference mode, so that autograd may use them
        b_advantages = torch.from_numpy(advantages.reshape(-1)).to(device)
        # the critic trains on segments: each state's value at its own token of its segment's window
        seg_rows, seg_of, back = history.segments(rows_train)
        seg_targets = torch.zeros(len(seg_rows), K, device=device)
        seg_read = torch.zeros(len(seg_rows), K, dtype=torch.bool, device=device)
        seg_targets[seg_of, K - 1 - back] = torch.from_numpy(returns.reshape(-1)).to(device)
        seg_read[seg_of, K - 1 - back] = True

        update_start = time.time()
        actor.train()
        critic.train()  # dropout on: training passes only
        clipfracs = []
        plan = minibatch_plan(
            args.update_schedule, T * N, len(seg_rows), args.minibatch_size, args.update_epochs, shuffle_rng
        )
        for mb_inds, seg_batch in plan:
            mb = torch.from_numpy(mb_inds).to(device)
            newlogprob, entropy = actor.log_prob_entropy(b_obs[mb], b_actions[mb])
            mb_adv = b_advantages[mb]
            if len(mb) > 1:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_loss, approx_kl, clipfrac = clipped_surrogate_loss(newlogprob, b_logprobs[mb], mb_adv, args.clip_coef)
            actor_opt.zero_grad()
            pg_loss.backward()
            if args.max_grad_norm > 0:
                nn.utils.clip_grad_norm_(actor.parameters(), args.max_grad_norm)
            actor_opt.step()
            if len(seg_batch) > 0:
                smb = torch.from_numpy(seg_batch).to(device)
                newvalue, read = critic(*history.windows(seg_rows[seg_batch], device)), seg_read[smb]
                critic_loss = value_loss(newvalue[read], seg_targets[smb][read])
                critic_opt.zero_grad()
                critic_loss.backward()
                if args.max_grad_norm > 0:
                    nn.utils.clip_grad_norm_(critic_params, args.max_grad_norm)
                critic_opt.step()
            clipfracs.append(clipfrac.item())
        update_time = time.time() - update_start
        history.carry_over()

        sps = int((global_step - first_step) / (time.time() - start_time))
        y, y_pred = returns.reshape(-1), values.reshape(-1)
        explained_var = np.nan if np.var(y) == 0 else 1 - np.var(y - y_pred) / np.var(y)
        run.writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        run.writer.add_scalar("losses/value_loss", critic_loss.item(), global_step)
        run.writer.add_scalar("losses/entropy", entropy.mean().item(), global_step)
        run.writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        run.writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        run.writer.add_scalar("charts/SPS", sps, global_step)
        run.writer.add_scalar("losses/explained_variance", explained_var, global_step)
        run.writer.add_scalar("time/rollout_seconds", rollout_time, global_step)
        run.writer.add_scalar("time/update_seconds", update_time, global_step)
        if run.end_update(update, global_step, next_obs=next_obs):  # log, save when due, progress
            break  # a stop was asked: the training state keeps what was done

    return run.finish()  # the --save-model checkpoint and its evaluation, the final line; the exit status


# ---- Run machinery: checks, signals, atomic saves, the run folder (its lock, log and W&B), the training state that
# --resume continues from, the evaluation-only mode; the same text in the three torch scripts down to the next banner.

SCRIPT = os.path.basename(__file__)
PLAIN_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,255}")  # a file or folder name: no separators, not . or ..


class UserError(Exception):
    """A mistake the user can fix (a flag, a file, an env): one sentence, exit 2 at the entry point."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def brief(e: BaseException) -> str:
    """An exception's message on one line, at most 200 characters."""
    return (" ".join(str(e).split()) or type(e).__name__)[:200].rstrip(".")


def marks(name: str) -> tuple:
    """What `Args` says of a flag beside its type: a number's range ("(" excludes low; nan, inf are outside), "path",
    "resume" (a resume may change it: how the run computes, not what), "eval" (an evaluation takes it), its own."""
    return getattr(Args.__dataclass_fields__[name].type, "__metadata__", ())


def check_args(args: Args) -> None:
    """UserError for a flag out of its range or form, or that this script's env cannot take (tyro checks choices)."""
    for name, value in vars(args).items():
        for interval in (m for m in marks(name) if m[0] in "(["):
            low, high = map(float, interval[1:-1].split(","))
            if value is not None and not ((low < value if interval[0] == "(" else low <= value) and value <= high):
                raise UserError(f"{flag(name)} must be in {interval}, got {value}")
    widest = f"{args.env_id}__{args.exp_name}__{2**32 - 1}__{10**9}-99-eval__{2**32 - 1}__{10**9}-99"  # (its folders)
    if not PLAIN_NAME.fullmatch(args.exp_name) or args.exp_name == "training_state" or len(widest) > 255:
        raise UserError(
            f"--exp-name must be a plain name, not training_state, that keeps its folders' names within 255 "
            f"characters, got {args.exp_name!r}"
        )
    check_this_script(args)
    if not args.capture_video:
        return
    try:  # a frame and the recorder now, not after training
        with gym.make(args.env_id, render_mode="rgb_array") as env, warnings.catch_warnings(action="ignore"):
            env.reset(seed=0)
            if getattr(env.render(), "ndim", 0) != 3:
                raise RuntimeError("it gave no image")
            import moviepy  # noqa: F401  (what gymnasium's RecordVideo writes with)
    except Exception as e:  # renderers raise many kinds (ImportError, RuntimeError, GL errors)
        missing = isinstance(e, (ImportError, gym.error.DependencyNotInstalled))
        fix = "pip install -r requirements.txt" if missing else "a working DISPLAY, or none and libosmesa6 for MuJoCo"
        raise UserError(f"--capture-video cannot render {args.env_id} ({brief(e)}; {fix})")


def fits(value, hint) -> bool:
    """Whether `value` is of a flag's type `hint`: int not bool, float or int, by member (Optional, Literal, tuple)."""
    origin, parts = get_origin(hint), get_args(hint)
    if origin is Literal:
        return any(type(value) is type(p) and value == p for p in parts)
    if origin in (Union, types.UnionType, Annotated):  # (an annotation's marks are no types: they match nothing)
        return any(fits(value, p) for p in parts)
    if origin is tuple:
        return type(value) is tuple and all(fits(v, parts[0]) for v in value)
    return type(value) is hint or hint is float and type(value) is int


class StopSignal:
    """SIGINT (Ctrl-C) and SIGTERM, once `handle` is their handler (the entry point's doing, not an import's): the first
    stops the run at the next safe point, keeping what was done; a second quits at once."""

    exit_status, requested, last_state = 0, False, "no training state was saved"  # (the Run names its last state)

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"\n{name} again: quitting at once without saving; {self.last_state}", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        self.exit_status, self.requested = 128 + signum, True
        print(f"\n{name}: stopping at the next safe point (again: quit at once)", file=sys.stderr, flush=True)


def save_checkpoint(path: str, obj: dict) -> None:
    """Write `obj` to a temporary file, synced, then rename it: a failed save leaves the previous file (or none)."""
    buffer, tmp = io.BytesIO(), f"{path}.tmp{os.getpid()}"
    torch.save(obj, buffer)
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None  # (a failed write names no file)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def load_checkpoint(name: str, path: str) -> dict:
    """The file that flag `name` gives (a checkpoint or training state of this script), read without running code
    (weights_only), its flags typed; every refusal names the flag."""
    source = f"{flag(name)} '{path}'"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a folder, a FIFO (opening it would wait forever), a device
            raise UserError(f"{source} is not a regular file")
        with open(path, "rb") as f:
            data = io.BytesIO(f.read())
    except OSError as e:
        raise OSError(e.errno, e.strerror, f"{flag(name)} {path}") from None
    try:
        saved = torch.load(data, map_location="cpu", weights_only=True)
    except Exception:
        saved = None
    if not isinstance(saved, dict) or saved.get("script") != SCRIPT or not isinstance(saved.get("args"), dict):
        raise UserError(f"{source} is not a checkpoint or training state of {SCRIPT}")
    flags, run_name = saved["args"], saved.get("run_name")
    typed = flags.keys() == {f.name for f in fields(Args)} and all(fits(flags[f.name], f.type) for f in fields(Args))
    evaluation = f"{run_name}-eval__{2**32 - 1}__{10**9}-99"  # (the widest folder name --eval-checkpoint makes of it)
    if not typed or not isinstance(run_name, str) or not PLAIN_NAME.fullmatch(evaluation):
        raise UserError(f"{source} was made by another version of {SCRIPT} (its flags or run name differ)")
    return saved


def load_into(source: str, saved: dict, fresh: dict, put_back) -> None:
    """Call `put_back` once `saved` matches `fresh`; the libraries' own checks of what it puts back refuse the rest."""
    body = lambda d: {k: v for k, v in d.items() if k not in ("script", "args", "run_name", "update")}  # noqa: E731
    try:  # (its script, flags, name and update: checked as the file was read)
        if (why := mismatch(body(saved), body(fresh), "it")) is None:
            put_back()
    except Exception as e:  # (they raise many kinds: ValueError, RuntimeError, OverflowError, KeyError, ...)
        why = brief(e)
    if why is not None:
        raise UserError(f"{source} holds what another run's flags or another version of {SCRIPT} made ({why})")


def mismatch(saved, fresh, where: str) -> Optional[str]:
    """Where `saved` differs from `fresh` in structure or kind (keys, lengths, exact types, tensor dtypes and shapes,
    floats of any precision; strings, the names of things, by value) or holds a number that is not finite. None in
    `fresh` (an env's counter not set yet, a device this machine lacks) takes None, a number or a tensor."""
    if fresh is None:
        return None if saved is None or type(saved) in (int, float) or torch.is_tensor(saved) else f"{where} is set"
    if isinstance(fresh, (dict, list, tuple)):
        keys = fresh.keys() if isinstance(fresh, dict) else range(len(fresh))
        same = type(saved) is type(fresh) and len(saved) == len(fresh)
        if not same or isinstance(fresh, dict) and saved.keys() != keys:
            return f"{where} is not a {type(fresh).__name__} of {len(fresh)} ({', '.join(map(str, keys))[:50]})"
        return next((why for k in keys if (why := mismatch(saved[k], fresh[k], f"{where}.{k}")) is not None), None)
    if torch.is_tensor(fresh):  # (an env may step in float64 a state it was reset to in float32)
        floats = torch.is_tensor(saved) and saved.is_floating_point() and fresh.is_floating_point()
        if not (torch.is_tensor(saved) and (saved.dtype == fresh.dtype or floats) and saved.shape == fresh.shape):
            return f"{where} is not a {fresh.dtype} tensor of shape {tuple(fresh.shape)}"
        return None if not saved.is_floating_point() or bool(saved.isfinite().all()) else f"{where} is not finite"
    if type(saved) is not type(fresh) or isinstance(fresh, str) and saved != fresh:
        return f"{where} is {saved!r:.30}, not {fresh!r:.30}"
    return None if not isinstance(saved, float) or math.isfinite(saved) else f"{where} is {saved}"


def saved_form(obj, fresh: bool = False):
    """What a checkpoint keeps of an object; `fresh`: an optimizer's as its first step makes it (with its moments)."""
    if isinstance(obj, torch.optim.Optimizer) and fresh:
        obj = copy.deepcopy(obj)
        for p in (p for group in obj.param_groups for p in group["params"]):
            p.grad = torch.zeros_like(p)
        obj.step()
    if type(obj).__name__ in OWN_KINDS:  # what this script alone saves
        return OWN_KINDS[type(obj).__name__][0](obj)
    if hasattr(obj, "state_dict"):  # a model, an optimizer, an object of the script's own
        return obj.state_dict()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    if isinstance(obj, gym.vector.VectorEnv):
        return env_state(obj)
    if isinstance(obj, deque):  # padded to its length, as a fresh one is
        padded = [*obj, *[0.0] * (obj.maxlen - len(obj))]
        return {"values": torch.tensor(padded, dtype=torch.float64), "count": len(obj)}
    return torch.from_numpy(obj.copy()) if isinstance(obj, np.ndarray) else getattr(obj, "item", lambda: obj)()


def restore(obj, saved):
    """Put a saved form back into `obj`, in place; returns `obj`, or what replaces it (a plain value)."""
    if isinstance(obj, torch.optim.Optimizer):  # its settings, by value, are those the run's flags make
        for mine, theirs in zip(obj.state_dict()["param_groups"], saved["param_groups"]):
            for key in (k for k in mine if k not in ("lr", "params") and theirs[k] != mine[k]):  # (lr: a schedule's)
                raise ValueError(f"its optimizer's {key} is {theirs[key]}, not {mine[key]} as this run's flags make it")
    if type(obj).__name__ in OWN_KINDS:
        return OWN_KINDS[type(obj).__name__][1](obj, saved)
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(saved)  # (the library's own strict loading)
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = saved  # (numpy's own check)
    elif isinstance(obj, gym.vector.VectorEnv):
        for layer, state in zip(env_layers(obj), saved):
            for key, value in ((k, v) for k, v in state.items() if v is not None):  # (None: not saved, or None)
                old = getattr(layer, key)  # (an env's arrays are replaced: they keep the saved precision)
                setattr(layer, key, restore(None if isinstance(old, np.ndarray) else old, value))
    elif isinstance(obj, deque):
        if not 0 <= saved["count"] <= obj.maxlen:
            raise ValueError(f"a queue of {obj.maxlen} holds {saved['count']}")
        obj.clear()
        obj.extend(saved["values"][: saved["count"]].tolist())
    elif isinstance(obj, np.ndarray):
        obj[...] = saved.numpy()
    elif obj is not None and not isinstance(obj, (bool, int, float, str, np.generic)):  # (an env's space, its mode)
        raise ValueError(f"a {type(saved).__name__} cannot replace its {type(obj).__name__}")
    else:  # a plain value, or an array where the fresh object has none yet
        return saved.numpy() if torch.is_tensor(saved) else saved
    return obj


def env_layers(env) -> list:
    """An env and every env inside it, its wrapped env or a vector env's copies, down to the envs themselves."""
    inner = [env.env] if hasattr(env, "env") else getattr(env, "envs", [])
    return [env, *(layer for e in inner for layer in env_layers(e))]


def env_state(envs) -> Optional[list[dict]]:
    """The state of classic-control envs and of those holding a kind this script saves (not Box2D's): every layer's
    attributes, those that are not plain values (numbers, strings, arrays, random generators, queues) as None."""
    env, own = env_layers(envs)[-1].unwrapped, lambda v: type(v).__name__ in OWN_KINDS
    if not type(env).__module__.startswith("gymnasium.envs.classic_control") and not any(map(own, vars(env).values())):
        return None
    kinds = (np.random.Generator, deque, np.ndarray, np.generic, bool, int, float, str)
    plain = lambda v: own(v) or isinstance(v, kinds) and getattr(v, "dtype", "") != "O"  # noqa: E731
    return [{k: saved_form(v) if plain(v) else None for k, v in vars(x).items()} for x in env_layers(envs)]


class Run:
    """A training run around the loop of `main`, which meets it three times: `start` before the loop (the folder, its
    lock and log; a resumed run's state put back), `end_update` after each update, `finish` after the loop."""

    def __init__(self, args: Args, stop: StopSignal):
        """The run's flags, checked: those given, or its own with --resume (those marked "resume" may replace them)."""
        self.stop, self.state, self.lock, self.run_dir, self.run_name = stop, None, None, args.resume, None
        if args.resume is not None:
            self.state = load_checkpoint("resume", os.path.join(args.resume, "training_state.pt"))
            saved, given = self.state["args"], [f.name for f in fields(Args) if getattr(args, f.name) != f.default]
            for n in (n for n in given if "resume" not in marks(n) and getattr(args, n) != saved[n]):
                raise UserError(f"--resume continues a run: {flag(n)} {getattr(args, n)} is not its {saved[n]}")
            args = Args(**{**saved, **{n: getattr(args, n) for n in given}})
        check_args(args)
        self.args, (self.num_updates, self.steps_per_update) = args, budget(args)

    def training_state(self, update: int, fresh: bool = False) -> dict:
        """All a run needs to continue exactly (a saved form waits for the work in flight it holds)."""
        objects = {k: saved_form(v, fresh) for k, v in self.objects.items()}
        keys, *numpy = np.random.get_state()[1:]
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        random_streams = {"numpy": [torch.from_numpy(keys), *numpy], "torch": torch.get_rng_state(), "cuda": cuda}
        run = {"script": SCRIPT, "args": asdict(self.args), "run_name": self.run_name, "update": update}
        return {**run, "random": random_streams, "objects": objects}

    def start(self, **objects) -> tuple[int, int]:
        """Given the objects a training state holds (models, optimizers, generators, envs, the loop's arrays, queues):
        a resumed run's state put back once it matches what they would save (the episodes in progress return with the
        envs' state, or start anew); the folder, its lock and log. The update and step the loop goes on from."""
        self.objects, self.update, self.writer, args, made = objects, 0, None, self.args, not os.path.exists("runs")
        if self.state is not None:
            fresh, episodes = self.training_state(0, fresh=True), (np.ndarray, deque, gym.vector.VectorEnv)
            state, path = self.state, os.path.join(self.run_dir, "training_state.pt")
            self.run_name, self.update = state["run_name"], state.get("update")
            if type(self.update) is not int or not 0 <= self.update <= self.num_updates:
                raise UserError(f"--resume '{path}' holds an update outside its run's budget")
            envs = fresh["objects"]["envs"]  # (None: envs without a state, whose episodes start anew)
            names = [k for k, v in objects.items() if envs is not None or not isinstance(v, episodes)]

            def put_back() -> None:
                objects.update({k: restore(objects[k], state["objects"][k]) for k in names})
                np.random.set_state(("MT19937", state["random"]["numpy"][0].numpy(), *state["random"]["numpy"][1:]))
                torch.set_rng_state(state["random"]["torch"])
                if state["random"]["cuda"] is not None and torch.cuda.is_available():
                    torch.cuda.set_rng_state(state["random"]["cuda"])

            load_into(f"--resume '{path}'", state, fresh, put_back)
            if envs is None:
                print(f"note: {SCRIPT} does not save {args.env_id}'s state: its episodes in progress start anew")
            self.stop.last_state = f"the last training state is {path} (update {self.update})"
        try:
            if self.state is None:
                self.run_name = make_run_dir(f"{args.env_id}__{args.exp_name}__{args.seed}")
                self.run_dir = os.path.join("runs", self.run_name)
            lock = os.path.join(self.run_dir, ".lock")
            self.lock = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # (a link: ELOOP, named)
            try:  # held while this process runs the folder, its pid in it
                fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(self.lock, 32).decode(errors="replace").strip() or "unknown"
                raise UserError(f"another process (pid {holder}) is running {self.run_dir}") from None
            os.truncate(lock, 0)  # (what is no file, a FIFO, is refused here, named)
            os.write(self.lock, f"{os.getpid()}\n".encode())
            self.open_log()
        except BaseException as e:  # a refused start (a name too long, another process, W&B) leaves nothing behind
            if self.lock is not None:
                os.close(self.lock)
            if self.writer is not None:  # (its thread writes into the folder: a second signal may come while it opens)
                self.writer.close()
            if self.state is None and self.run_dir:
                shutil.rmtree(self.run_dir)
            if made and os.path.isdir("runs") and not os.listdir("runs"):
                os.rmdir("runs")
            if isinstance(e, OSError) and e.strerror:  # (the log's writer names its file in bytes, or none: the folder)
                raise OSError(e.errno, e.strerror, os.fsdecode(e.filename or self.run_dir)) from None
            raise
        self.global_step = self.first_step = self.update * self.steps_per_update
        self.start_time = self.last_line = time.time()
        return self.update, self.global_step

    def open_log(self) -> None:
        """The log (and W&B); a resumed one hides what came after its state, from an event file of a new second."""
        from torch.utils.tensorboard import SummaryWriter  # (slow to import: not before a run starts)

        args, names = self.args, os.listdir(self.run_dir)
        for name in (n for n in names if re.fullmatch(r".+\.pt\.tmp\d+", n)):  # what a killed save left
            os.remove(os.path.join(self.run_dir, name))
        events = [int(n.split(".")[3]) for n in names if re.fullmatch(r"events\.out\.tfevents\.\d+\..+", n)]
        time.sleep(min(2.0, max(0.0, max(events, default=0) + 1 - time.time())))  # (2 s at most: a clock set back)
        wandb_id = uuid.uuid5(uuid.NAMESPACE_URL, self.run_name).hex[:12]  # (a resume goes on with its W&B run)
        where = dict(project=args.wandb_project_name, entity=args.wandb_entity, dir=self.run_dir, id=wandb_id)
        try:  # W&B's own checks (the package, its mode, the project, the credentials) may refuse the run
            if args.track:
                import wandb  # (it mirrors the scalars; a copy of the event files in its folder would be read again)

                if not wandb.patched["tensorboard"]:
                    wandb.tensorboard.patch(save=False)
                wandb.init(**where, name=self.run_name, config=vars(args), sync_tensorboard=True, resume="allow")
        except Exception as e:
            if sys.modules.get("wandb"):
                sys.modules["wandb"].tensorboard.unpatch()
            raise UserError(f"--track: W&B refused to start the run ({brief(e)})")
        purge = self.update * self.steps_per_update + 1 if self.state is not None else None
        self.writer = SummaryWriter(self.run_dir, purge_step=purge)
        if self.state is None:
            table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        devices = {str(p.device) for x in self.objects.values() if isinstance(x, nn.Module) for p in x.parameters()}
        print(f"device: {', '.join(sorted(devices))}, logging to {self.run_dir}", flush=True)

    def end_update(self, update: int, global_step: int, **loop_state) -> bool:
        """The training state saved when due, the progress line; True when the run should stop."""
        stopping = self.stop.requested  # read once: a signal after this line stops the run at the next update
        self.update, self.global_step = update, global_step
        self.objects.update(loop_state)
        if stopping or update % self.args.checkpoint_every == 0 or update == self.num_updates:
            state, path = self.training_state(update), os.path.join(self.run_dir, "training_state.pt")
            self.writer.flush()  # the events of the updates the state holds are on disk before it
            save_checkpoint(path, state)
            self.stop.last_state = f"the last training state is {path} (update {update})"
        due = update % max(1, self.num_updates // 10) == 0 or time.time() - self.last_line > 60
        if due and not stopping and update < self.num_updates:
            self.last_line = time.time()
            print(f"{self.run_name}: update {update}/{self.num_updates}, {self.progress()}", flush=True)
        return stopping

    def progress(self, of: str = "") -> str:
        speed = (self.global_step - self.first_step) / max(time.time() - self.start_time, 1e-9)
        last = shown_returns(self.objects)
        mean = f"mean return of the last {len(last)} episodes {np.mean(last):.2f}" if last else "no episode yet"
        return f"{self.global_step}{of} steps, {int(speed)} steps/s, {mean}"

    def finish(self) -> int:
        """The --save-model checkpoint, the final line, the evaluation (unless stopped); the exit status."""
        args, path, videos = self.args, os.path.join(self.run_dir, f"{self.args.exp_name}.pt"), None
        self.objects["envs"].close()
        if args.save_model:  # the flags, the run's name and the model
            model = {k: saved_form(self.objects[k]) for k in MODEL}
            save_checkpoint(path, {"script": SCRIPT, "args": asdict(args), "run_name": self.run_name, "objects": model})
        saved = f"checkpoint saved to {path}" if args.save_model else "no checkpoint (no --save-model)"
        stopped = f"; interrupted (continue it: --resume {self.run_dir})" if self.update < self.num_updates else ""
        print(f"{self.run_name}: {self.progress(f' of {self.num_updates * self.steps_per_update}')}; {saved}{stopped}")
        if args.save_model and not self.stop.requested:
            videos = os.path.join(self.run_dir, "videos") if args.capture_video else None
            evaluate(self.objects, args.env_id, args, 10_000 + args.seed, self.writer, self.stop, videos)
        self.writer.close()
        if args.track:
            import wandb

            for name in sorted(os.listdir(videos)) if videos else []:
                wandb.log({"videos/eval": wandb.Video(os.path.join(videos, name), format="mp4")})
            wandb.finish()
            wandb.tensorboard.unpatch()
        os.close(self.lock)  # the folder is free for another process
        return self.stop.exit_status


def evaluate_checkpoint(args: Args, stop: StopSignal) -> int:
    """The evaluation-only mode: a --save-model checkpoint's model, built from its flags and the evaluation's."""
    from torch.utils.tensorboard import SummaryWriter

    given = [f.name for f in fields(Args) if getattr(args, f.name) != f.default]
    if training := [flag(n) for n in given if "eval" not in marks(n)]:
        raise UserError(f"--eval-checkpoint takes an evaluation's flags only, got {' '.join(training)}")
    path, saved = args.eval_checkpoint, load_checkpoint("eval_checkpoint", args.eval_checkpoint)
    if "update" in saved:
        raise UserError(f"--eval-checkpoint '{path}' is a training state, which --resume continues")
    taken = [n for n in vars(args) if "eval" in marks(n) and n != "eval_checkpoint" and (n != "seed" or n in given)]
    train = Args(**{**saved["args"], **{n: getattr(args, n) for n in taken}})
    check_args(train)  # (the evaluation's flags too: its renderer with --capture-video, what the script checks)
    torch.set_num_threads(train.torch_threads)
    objects = model_objects(train)
    put_back = lambda: objects.update({k: restore(objects[k], saved["objects"][k]) for k in MODEL})  # noqa: E731
    load_into(f"--eval-checkpoint '{path}'", saved, {"objects": {k: saved_form(objects[k]) for k in MODEL}}, put_back)
    run_dir = os.path.join("runs", make_run_dir(f"{saved['run_name']}-eval__{10_000 + train.seed}"))
    stop.last_state = f"the evaluation logs to {run_dir}"  # (what a failed write of its log names)
    print(f"device: cpu (evaluation), logging to {run_dir}", flush=True)
    with SummaryWriter(run_dir) as writer:
        videos = os.path.join(run_dir, "videos") if args.capture_video else None
        evaluate(objects, train.env_id, train, 10_000 + train.seed, writer, stop, videos)
    return stop.exit_status


def make_run_dir(base: str) -> str:
    """Create runs/{base}__{unix time} (-2, ... when a run of that second has it; other than A-Za-z0-9._- made -)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", base)
    for name in (f"{base}__{int(time.time())}" + (f"-{k}" if k > 1 else "") for k in itertools.count(1)):
        with contextlib.suppress(FileExistsError):
            os.makedirs(os.path.join("runs", name))
            return name


def cli(argv: Optional[list[str]] = None) -> int:
    """The entry point: a user's mistake, a file the system refuses (a full disk), too little memory: one sentence,
    the last line (what the run left open is closed before it: a video recorder's warning comes first)."""
    args, stop = tyro.cli(Args, args=argv), StopSignal()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop.handle)
    # a thread's OSError (the log's writer on a full disk) reaches the run through the object it serves: said once
    threading.excepthook = lambda a: None if issubclass(a.exc_type, OSError) else threading.__excepthook__(a)
    try:
        for name, path in ((n, getattr(args, n)) for n in vars(args) if "path" in marks(n)):
            if path is not None and not (path and path.isprintable()):  # (not bytes the system cannot decode)
                raise UserError(f"{flag(name)} must be a path on one line of text, got {path!r}")
        return main(args, stop)
    except UserError as e:
        error = str(e)
    except OSError as e:  # a file's, named; a thread's write names none: where the last training state is, then
        error = f"{e.filename}: {e.strerror}" if e.filename else f"{e.strerror or brief(e)}; {stop.last_state}"
    except (MemoryError, RuntimeError) as e:  # (torch's allocators raise RuntimeError: the CPU's, CUDA's OutOfMemory)
        if isinstance(e, RuntimeError) and "allocate" not in str(e):
            raise
        error = "this machine lacks the memory this run needs (its flags or a file)"
    gc.collect()  # (the error's frames, and what they held open, are gone)
    print(f"error: {error}.", file=sys.stderr, flush=True)
    return 2


# ---- This script's machinery: what its flags' marks alone do not say, its model's checkpoint.

MODEL = ("actor", "critic")  # what a --save-model checkpoint holds


def mujoco_state(data) -> torch.Tensor:
    """MuJoCo's integration state of an env's MjData: what its simulation continues from exactly. (Ant and Humanoid
    read, before a step, positions MuJoCo derived during the last one: their first reward after a resume reads them
    derived anew.)"""
    import mujoco

    state = torch.zeros(mujoco.mj_stateSize(data.model, mujoco.mjtState.mjSTATE_INTEGRATION), dtype=torch.float64)
    mujoco.mj_getState(data.model, data, state.numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)
    return state


def put_mujoco_state(data, saved: torch.Tensor):
    """`saved` put back into an env's MjData, with what MuJoCo derives from it."""
    import mujoco

    mujoco.mj_setState(data.model, data, saved.numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)
    mujoco.mj_forward(data.model, data)
    return data


# what this script alone saves: a kind's name -> (its saved form, how it is put back)
OWN_KINDS = {"MjData": (mujoco_state, put_mujoco_state)}


def check_this_script(args: Args) -> None:
    """UserError for sizes that do not fit together or into this machine's memory (a rough estimate, GPT-2's sizes only
    with --critic gpt2), or an env this script cannot take."""
    if args.capture_video and not os.environ.get("DISPLAY"):  # MuJoCo renders through OSMesa (read at its import)
        os.environ.setdefault("MUJOCO_GL", "osmesa")
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    if args.steps_per_epoch % args.num_envs:
        raise UserError(f"--steps-per-epoch must be a multiple of --num-envs {args.num_envs}")
    if args.steps_per_epoch % args.minibatch_size:
        raise UserError(f"--minibatch-size must divide --steps-per-epoch {args.steps_per_epoch}")
    gpt2, H, L = args.critic == "gpt2", args.hidden_size, args.n_layer
    if gpt2 and args.value_stride > args.context_len:
        raise UserError(
            f"--value-stride must be between 1 and --context-len {args.context_len}, got {args.value_stride}"
        )
    if gpt2 and H % args.n_head:
        raise UserError(f"--n-head {args.n_head} must divide --hidden-size {H}")
    K, memory = args.context_len if gpt2 else 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = 16 * ((12 * L if gpt2 else 2) * H * H + 4096 * H)  # weights, gradients and Adam's moments
    batch = 4 * max(256, args.minibatch_size) * 2 * K * L * (16 * H + 6 * args.n_head * K) if gpt2 else 0
    need = weights + 32 * args.steps_per_epoch * (K + args.num_envs) + batch  # and the rollout's history
    if need >= memory:
        raise UserError(f"these sizes need ~{need / 2**30:.0f} GiB, more than this machine's {memory / 2**30:.0f} GiB")
    env_fit(args.env_id)


def env_fit(env_id: str) -> tuple[int, int, int, bool]:
    """(episode limit, obs_dim, act_dim, discrete) of an env with a flat Box observation, Discrete or flat Box actions
    and an episode limit (the timestep embedding's range); UserError for any other."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises several kinds (an unknown id, a missing package)
        raise UserError(f"cannot make env '{env_id}': {brief(e)}")
    obs, act, limit = env.observation_space, env.action_space, getattr(env.spec, "max_episode_steps", None)
    env.close()
    discrete = isinstance(act, gym.spaces.Discrete)
    if not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise UserError(f"{SCRIPT} needs a flat Box observation, but '{env_id}' has {obs}")
    if not discrete and not (isinstance(act, gym.spaces.Box) and len(act.shape) == 1):
        raise UserError(f"{SCRIPT} needs a Discrete or flat Box action space, but '{env_id}' has {act}")
    if limit is None:
        raise UserError(f"'{env_id}' has no episode limit, which the timestep embedding needs")
    return limit, int(obs.shape[0]), int(act.n if discrete else act.shape[0]), discrete


def model_objects(args: Args) -> dict:
    """The actor and the critic that main builds for the flags `args` (on the CPU)."""
    limit, obs_dim, act_dim, discrete = env_fit(args.env_id)
    critic = make_critic(args.critic, obs_dim, act_dim, {**vars(args), "max_timestep": limit})
    return {"actor": Actor(obs_dim, act_dim, discrete, args.hidden_size), "critic": critic}


def shown_returns(objects: dict):
    return objects["recent_returns"]


if __name__ == "__main__":
    sys.exit(cli())
