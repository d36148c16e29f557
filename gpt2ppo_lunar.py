"""GPT2PPO: PPO-clip whose critic reads the episode's recent states and actions through a small GPT-2.

Seed 002 ("GPT2PPO: Auto Regressive Proximal Policy Optimization", Cozma and Price): the actor sees
only the current state; the critic is a Decision-Transformer-style GPT-2 over a window of the last
`--context-len` steps of the CURRENT episode (tokens s, a, s, a, ..., s), and the value is read from
the hidden state of the current state's token. `--critic mlp` is the plain-PPO baseline: the same
script, line for line, except that the critic is an MLP on the current state.

Done right where the authors' code (andreicozma1/ECE517-Final-Project) was not:
  * the GPT-2, its embeddings and the value head are all in the critic's optimizer (theirs never
    trained the GPT-2: it stayed at its random initialisation), and the actor's body is in the
    actor's optimizer (theirs never gave it to an optimizer either);
  * dropout is active only in training passes; values used for the rollout's targets come from
    the critic in eval mode (theirs left dropout on while collecting data);
  * discrete actions enter the context one-hot and are stored as integers (theirs stored the
    policy's probability vectors);
  * episodes run to the env's own time limit (theirs cut every env at 500 steps), and a time-limit
    truncation is bootstrapped with V(final observation) computed from THAT episode's history.
Also: the timestep embedding is initialised like GPT-2's position embeddings, N(0, 0.02), not with
nn.Embedding's N(0, 1) that the Decision Transformer's code kept; with N(0, 1) the GPT-2 critic
failed on LunarLander (benchmark/gpt2ppo_results.md).

Departures from Table I and the authors' code (choices of this script, not fixes; each is a flag or
a line to change):
  * the critic's targets are GAE(lambda) returns (advantage + value, CleanRL's PPO); the authors
    used bootstrapped discounted returns;
  * the critic loss is 0.5 * mean squared error;
  * gradient norms are clipped at 0.5 (`--max-grad-norm`, each network separately) and Adam's eps is
    1e-5: neither Table I nor the authors' code has these;
  * 4 envs (`--num-envs`; 2048 steps per epoch summed over them) instead of 1;
  * Table I's "5 training steps per epoch" is by default 5 passes over the rollout, reshuffled every
    pass (`--update-schedule shuffled`); the authors' code takes 5 consecutive Adam steps on each
    minibatch in one unshuffled pass: `--update-schedule authors` (benchmark/gpt2ppo_results.md
    compares the two).

Efficient history: each env's trajectory is stored once per rollout (plus the last context-1 rows
carried over from the previous rollout); a window is gathered by index (`build_windows`), with a
mask that stops at the episode's first step. The same function builds the windows for the values
of the rollout and for the minibatches of the update. Only the actor runs per env step; all
values come from a few large batched critic calls, and states whose windows are prefixes of one
another (the first context_len steps of an episode) share one pass. On a CPU the exact design is
slow (every later state has its own 127-token window): `--value-stride 64` lets windows start only
every 64 steps, so 64 states share each pass (measured 4.5x the MLP critic's cost per epoch instead
of ~50x; benchmark/gpt2ppo_results.md), at the price of windows holding 1..64 steps. On a GPU
(`--cuda`, H100) the exact windows cost 2.8x the MLP critic per epoch, about what S = 64 costs there.
Table I's dropout 0.5 is the default; 0.1 (the Decision Transformer's) learned better in our runs
(LunarLander, 3 seeds: 220.8 against 117.7 at 307k steps; the MLP-critic PPO: 185.8).

    python gpt2ppo_lunar.py --cuda                           # GPT2PPO on LunarLander-v3, Table I (GPU)
    python gpt2ppo_lunar.py --value-stride 64                # the same on a CPU, with CPU-friendly windows
    python gpt2ppo_lunar.py --value-stride 64 --dropout 0.1  # the best GPT2PPO we measured
    python gpt2ppo_lunar.py --value-stride 64 --update-schedule authors  # the authors' update schedule
    python gpt2ppo_lunar.py --critic mlp                     # the PPO baseline
    python gpt2ppo_lunar.py --env-id Acrobot-v1 --seed 1 --value-stride 64 --save-model
    python gpt2ppo_lunar.py --eval-checkpoint runs/<run>/gpt2ppo_lunar.pt --eval-episodes 10

The exact windows (`--value-stride 1`, the default) take hours on a CPU; the script prints its
expected time per update at start-up when it is large. Evaluation episode i is seeded 10000 + the
training seed + i, for the evaluation after `--save-model` and for `--eval-checkpoint` alike
(`--seed` given with `--eval-checkpoint` replaces the checkpoint's seed). Ctrl-C during training
finishes the current update, saves a checkpoint when `--save-model` is given, and exits.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro


@dataclass
class Args:
    exp_name: str = "gpt2ppo_lunar"
    """the name of this experiment (part of the run folder's name)"""
    seed: Optional[int] = None
    """seed of the experiment (envs, torch, numpy, python); default 123 (Table I). Evaluation episode i is
    seeded s + 10000 + i, s = the training seed (after `--save-model`); with `--eval-checkpoint`, s = the
    checkpoint's training seed unless `--seed` is given"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = False
    """train on CUDA (an error if torch sees no CUDA device); `--eval-checkpoint` evaluates the small
    MLP actor on the CPU"""
    torch_threads: int = 1
    """torch intra-op threads"""
    track: bool = False
    """log to Weights and Biases (imported only when asked)"""
    wandb_project_name: str = "llm-rl-scripts"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    capture_video: bool = False
    """record videos of env 0 into `videos/{run_name}`"""
    save_model: bool = False
    """save a checkpoint (weights + args) into the run folder at the end of training, then evaluate it"""
    progress: bool = True
    """show a progress bar on the console (only when it is a terminal)"""
    progress_every: int = 10
    """when stdout is not a terminal (a log file): print a progress line every N updates (0: never)"""

    # Evaluation of a saved checkpoint (no training)
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint to evaluate instead of training"""
    eval_episodes: int = 10
    """number of episodes for `--eval-checkpoint` and for the evaluation after `--save-model`"""
    eval_greedy: bool = True
    """evaluate with the most probable action / the Gaussian mean (False: sample from the policy)"""

    # Algorithm (defaults: Table I of seed 002)
    env_id: str = "LunarLander-v3"
    """the id of the environment (flat Box observation; Discrete or Box actions)"""
    critic: Literal["gpt2", "mlp"] = "gpt2"
    """the critic: `gpt2` (GPT2PPO, over the episode's history) or `mlp` (plain PPO, current state)"""
    total_timesteps: int = 150 * 2048
    """total environment steps (Table I: 150 epochs x 2048 steps), rounded up to whole rollouts"""
    steps_per_epoch: int = 2048
    """environment steps per rollout ("epoch" in the seed), summed over all envs"""
    num_envs: int = 4
    """the number of parallel environments (each runs steps_per_epoch / num_envs steps per rollout)"""
    update_epochs: int = 5
    """Adam steps per minibatch per update ("training steps per epoch" in Table I), ordered by
    `--update-schedule`"""
    update_schedule: Literal["shuffled", "authors"] = "shuffled"
    """`shuffled`: update_epochs passes over the rollout, reshuffled every pass (CleanRL's PPO); `authors`:
    one unshuffled pass in rollout order, with update_epochs consecutive Adam steps on each minibatch (the
    authors' code)"""
    minibatch_size: int = 128
    """samples per minibatch (Table I "batch size"; must divide steps_per_epoch)"""
    actor_lr: float = 3e-4
    """Adam learning rate of the actor"""
    critic_lr: float = 1e-3
    """Adam learning rate of the critic (GPT-2, its embeddings and the value head)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda of generalized advantage estimation"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    norm_adv: bool = True
    """normalize the advantages within each minibatch"""
    ent_coef: float = 0.0
    """coefficient of the entropy bonus (the seed's Lightning-Bolts PPO has none)"""
    max_grad_norm: float = 0.5
    """clip the gradient norm of actor and critic separately (<= 0: no clipping)"""
    target_kl: Optional[float] = None
    """stop the epochs of an update early once the approximate KL exceeds this"""
    hidden_size: int = 64
    """width of the actor and MLP critic layers, and the GPT-2 embedding width n_embd"""
    context_len: int = 64
    """steps of the current episode the GPT-2 critic sees (2*context_len-1 tokens)"""
    n_layer: int = 2
    """GPT-2 blocks"""
    n_head: int = 8
    """GPT-2 attention heads (must divide hidden_size)"""
    dropout: float = 0.5
    """GPT-2 dropout (embeddings, attention, residual); active only in training passes. Table I: 0.5;
    0.1 learned better on LunarLander and Acrobot (benchmark/gpt2ppo_results.md)"""
    value_stride: int = 1
    """1: every state's window is the last context_len steps of its episode (the seed's design; one
    window per state). S > 1: windows start every S steps, so each holds K-S+1..K steps and the
    S states of a segment share one critic pass (about S times cheaper; S = context_len:
    non-overlapping segments). The MLP critic ignores it."""
    max_timestep: Optional[int] = None
    """size of the timestep embedding table - 1 (default: the env's own episode limit)"""


DEFAULT_SEED = 123
EVAL_SEED_OFFSET = 10_000


# ----------------------------------------------------------------------------------------------
# Math helpers (small, top level, tested in tests/test_gpt2ppo_lunar.py)
# ----------------------------------------------------------------------------------------------


def compute_gae(rewards, values, next_values, terminations, dones, gamma, gae_lambda):
    """Generalized advantage estimation over a rollout of shape (T, N).

    next_values[t] is V of the state actually reached after step t: for a step that ended an
    episode this is V(final observation), not V of the next episode's reset observation.
    terminations[t] = 1 cuts the bootstrap (a real terminal state has value 0);
    dones[t] = terminated or truncated cuts the recursion (the next row is another episode).
    Returns (advantages, returns) with returns = advantages + values.
    """
    T = rewards.shape[0]
    advantages = rewards * 0.0
    last = 0.0
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminations[t]) - values[t]
        last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
        advantages[t] = last
    return advantages, advantages + values


def clipped_surrogate_loss(new_logprob, old_logprob, advantages, clip_coef):
    """PPO-clip policy loss: mean of max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi_new / pi_old.
    Also returns the approximate KL ((r - 1) - log r) and the clipped fraction, for logging."""
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return loss, approx_kl, clipfrac


def explained_variance(y_pred: np.ndarray, y_true: np.ndarray) -> float:
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


def window_reach(timesteps, context_len: int, value_stride: int):
    """How many steps back the window of a state at episode timestep t reaches: t - s(t).

    With value_stride S = 1 the window is the last K = context_len steps of the episode
    (reach min(t, K-1)). With S > 1 windows start only at timesteps that are multiples of S:
    s(t) = max(0, S * floor((t - K + S) / S)), so a window holds between K-S+1 and K steps (all
    steps since the reset early in an episode), and the states of one such segment share one
    sequence: the critic computes all their values in one pass (see `segments`). S = K gives
    non-overlapping segments. Works elementwise on numpy arrays and python ints."""
    start = np.maximum(0, value_stride * np.floor_divide(np.asarray(timesteps) - context_len + value_stride,
                                                            value_stride))
    return np.asarray(timesteps) - start


def build_windows(obs: torch.Tensor, act: torch.Tensor, ts: torch.Tensor, reach: torch.Tensor, rows: torch.Tensor,
                  context_len: int):
    """Gather the critic's context windows by index from a stored trajectory.

    obs (R, obs_dim), act (R, act_dim), ts (R,) and reach (R,) are rows of stored steps, in time
    order per env (envs may be concatenated: a window never reaches into an earlier env's rows,
    because it stops at its episode's first step); ts[r] is the step's timestep within its episode
    (0 at reset) and reach[r] <= min(ts[r], K-1) how far back its window goes (`window_reach`).
    For each row r in `rows`, the window is rows r-K+1 .. r (K = context_len), left-padded:
      states (B, K, obs_dim), actions (B, K, act_dim), timesteps (B, K) int64, mask (B, K) bool.
    A position j is real (mask True) iff r - j <= reach[r]; padded positions are all zeros. The
    action of the last position (the current state's action, not chosen yet when the value is
    needed) is always zero, so a window is the same whether it is built during the rollout or
    gathered after the action was stored. Requires rows >= K-1 (the caller keeps K-1 rows of
    history in front of every rollout).
    """
    back = torch.arange(context_len - 1, -1, -1, device=obs.device)  # K-1, ..., 1, 0 steps back
    idx = rows[:, None] - back[None, :]
    mask = back[None, :] <= reach[rows][:, None]
    states = obs[idx] * mask[..., None]
    actions = act[idx] * mask[..., None]
    actions[:, -1] = 0.0
    timesteps = ts[idx] * mask
    return states, actions, timesteps, mask


def segments(rows: np.ndarray, reach: np.ndarray):
    """Group states whose windows are prefixes of one another, so one critic pass serves them all.

    rows: flat row indices of states; reach: their window reach. A state's window starts at row
    rows - reach; states with the same start share a segment, read through the window of the
    segment's last state (causal attention: the value at an earlier state's token sees exactly
    that state's own window). Returns (seg_rows, seg_of, pos): the last row of each segment, the
    segment of each state, and the state's position (0..K-1 from the left of a K-window is
    K-1-(seg_row - row); returned as the distance back, seg_row - row)."""
    start = rows - reach
    uniq, seg_of = np.unique(start, return_inverse=True)
    seg_rows = np.full(len(uniq), -1, dtype=np.int64)
    np.maximum.at(seg_rows, seg_of, rows)
    return seg_rows, seg_of, seg_rows[seg_of] - rows


class History:
    """Each env's trajectory of the current rollout, stored once, with the last K-1 rows of the
    previous rollout in front (so that windows reach back across the rollout boundary).

    Row layout per env: rows 0..K-2 history, row K-1+t the state of rollout step t, and row
    K-1+T the state the rollout ended in (its action unknown). Arrays are numpy (cheap per-step
    writes) with torch views of the same memory for the gathers.
    """

    def __init__(self, num_envs: int, num_steps: int, context_len: int, value_stride: int, obs_dim: int,
                 act_dim: int):
        self.N, self.T, self.K, self.S = num_envs, num_steps, context_len, value_stride
        self.L = context_len + num_steps  # (K-1) history rows + T steps + 1 final row
        self.obs = np.zeros((num_envs, self.L, obs_dim), dtype=np.float32)
        self.act = np.zeros((num_envs, self.L, act_dim), dtype=np.float32)
        self.ts = np.zeros((num_envs, self.L), dtype=np.int64)
        self.reach = np.zeros((num_envs, self.L), dtype=np.int64)
        self.obs_t = torch.from_numpy(self.obs).view(-1, obs_dim)
        self.act_t = torch.from_numpy(self.act).view(-1, act_dim)
        self.ts_t = torch.from_numpy(self.ts).view(-1)
        self.reach_t = torch.from_numpy(self.reach).view(-1)

    def row(self, step: int) -> int:
        return self.K - 1 + step

    def put_state(self, step: int, obs: np.ndarray, timesteps: np.ndarray) -> None:
        """The states of all envs at rollout step `step` (step T: the state the rollout ended in)."""
        r = self.row(step)
        self.obs[:, r] = obs
        self.ts[:, r] = timesteps
        self.reach[:, r] = window_reach(timesteps, self.K, self.S)
        self.act[:, r] = 0.0

    def put_action(self, step: int, actions_vec: np.ndarray) -> None:
        self.act[:, self.row(step)] = actions_vec

    def flat_rows(self, steps: np.ndarray, envs: np.ndarray) -> np.ndarray:
        """Flat row indices (into obs_t etc.) of (rollout step, env) pairs."""
        return (np.asarray(envs) * self.L + self.K - 1 + np.asarray(steps)).astype(np.int64)

    def windows(self, flat_rows) -> tuple:
        return build_windows(self.obs_t, self.act_t, self.ts_t, self.reach_t, torch.as_tensor(flat_rows), self.K)

    def segments(self, flat_rows: np.ndarray):
        return segments(flat_rows, self.reach.reshape(-1)[flat_rows])

    def final_window(self, env: int, step: int, final_obs: np.ndarray):
        """The window of an episode's final observation (reached by the action of rollout step
        `step` in env `env`): that episode's last K-1 rows, then the final observation."""
        r, K = self.row(step), self.K
        obs = np.concatenate([self.obs[env, r - K + 2:r + 1], final_obs[None].astype(np.float32)])
        act = np.concatenate([self.act[env, r - K + 2:r + 1], np.zeros_like(self.act[env, :1])])
        ts = np.concatenate([self.ts[env, r - K + 2:r + 1], self.ts[env, r:r + 1] + 1])
        reach = window_reach(ts, K, self.S)
        return build_windows(torch.from_numpy(obs), torch.from_numpy(act), torch.from_numpy(ts),
                             torch.from_numpy(reach), torch.tensor([K - 1]), K)

    def carry_over(self) -> None:
        """Start the next rollout: its K-1 history rows and first state are this one's last K rows."""
        T, K = self.T, self.K
        for a in (self.obs, self.act, self.ts, self.reach):
            a[:, :K] = a[:, T:T + K].copy()


@torch.no_grad()
def state_values(critic: nn.Module, history: History, flat_rows: np.ndarray, chunk: int = 256,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """V of the states at `flat_rows`, each from its own window, computed in a few batched passes
    over the segments (the caller sets eval mode: no dropout). Returned on the CPU."""
    seg_rows, seg_of, back = history.segments(flat_rows)
    per_pos = torch.cat([critic(*to_device(history.windows(seg_rows[i:i + chunk]), device)).cpu()
                         for i in range(0, len(seg_rows), chunk)])
    return per_pos[torch.from_numpy(seg_of), torch.from_numpy(history.K - 1 - back)]


def to_device(window: tuple, device: torch.device | str) -> tuple:
    return tuple(x.to(device) for x in window)


# ----------------------------------------------------------------------------------------------
# Environment and networks
# ----------------------------------------------------------------------------------------------


def make_env(env_id: str, idx: int, capture_video: bool, run_name: str):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)  # the env's own time limit (LunarLander 1000, BipedalWalker 1600)
        return env

    return thunk


def check_spaces(env_id: str, obs_space, act_space) -> None:
    """Exit with one clear sentence when the spaces do not fit this script."""
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        sys.exit(f"error: gpt2ppo_lunar.py needs a flat Box observation, but '{env_id}' has {obs_space}.")
    if isinstance(act_space, gym.spaces.Box):
        if len(act_space.shape) != 1:
            sys.exit(f"error: gpt2ppo_lunar.py needs a flat Box action space, but '{env_id}' has {act_space}.")
    elif not isinstance(act_space, gym.spaces.Discrete):
        sys.exit(f"error: gpt2ppo_lunar.py needs a Discrete or Box action space, but '{env_id}' has {act_space}.")


def check_env_id(env_id: str, max_timestep: Optional[int]) -> int:
    """Check the env and return the largest timestep the timestep embedding must hold."""
    try:
        env = gym.make(env_id)
    except gym.error.Error as e:
        sys.exit(f"error: cannot make env '{env_id}': {e}")
    check_spaces(env_id, env.observation_space, env.action_space)
    limit = env.spec.max_episode_steps if env.spec is not None else None
    env.close()
    if max_timestep is not None:
        if max_timestep < 1:
            sys.exit(f"error: --max-timestep must be >= 1, got {max_timestep}.")
        return max_timestep
    if limit is None:
        sys.exit(f"error: '{env_id}' has no episode limit; give --max-timestep for the timestep embedding.")
    return int(limit)


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Actor(nn.Module):
    """Linear-ReLU-Linear(hidden) on the current state (the seed's CommonBase; a ReLU after the
    second layer too, so the two layers do not collapse into one linear map), then the head:
    logits of a categorical (discrete) or the mean of a diagonal Gaussian with a state-independent
    log-std (continuous)."""

    def __init__(self, obs_dim: int, act_dim: int, discrete: bool, hidden: int):
        super().__init__()
        self.discrete = discrete
        self.body = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.ReLU(),
                                  layer_init(nn.Linear(hidden, hidden)), nn.ReLU())
        self.head = layer_init(nn.Linear(hidden, act_dim), std=0.01)
        if not discrete:
            self.log_std = nn.Parameter(torch.zeros(act_dim))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        out = self.head(self.body(obs))
        if self.discrete:
            return torch.distributions.Categorical(logits=out)
        return torch.distributions.Normal(out, self.log_std.exp().expand_as(out))

    def log_prob_entropy(self, obs: torch.Tensor, actions: torch.Tensor):
        d = self.dist(obs)
        if self.discrete:
            return d.log_prob(actions), d.entropy()
        return d.log_prob(actions).sum(-1), d.entropy().sum(-1)

    def act(self, obs: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        d = self.dist(obs)
        if greedy:
            return d.probs.argmax(-1) if self.discrete else d.mean
        return d.sample()


class MLPCritic(nn.Module):
    """Plain PPO's critic: 2x64 ReLU MLP on the current state (Lightning-Bolts' MLP)."""

    def __init__(self, obs_dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.ReLU(),
                                 layer_init(nn.Linear(hidden, hidden)), nn.ReLU(),
                                 layer_init(nn.Linear(hidden, 1), std=1.0))

    def forward(self, states, actions, timesteps, mask):
        return self.net(states).squeeze(-1)  # (B, K): the value of the state at every position


def attention_with_fast_dropout(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                                **kwargs):
    """GPT-2 attention for transformers' AttentionInterface: torch's fused SDPA when there is no
    dropout (eval passes, or --dropout 0), else the textbook computation with the dropout mask
    drawn by `torch.rand_like(p) >= dropout` and the kept probabilities scaled by 1 / (1 - dropout).

    This is the same inverted dropout as torch's, only drawn faster: on a CPU, SDPA with
    dropout_p > 0 runs its slow math path and draws the mask with bernoulli_, ~4x slower than
    rand_like here, and the attention-probability dropout (B x heads x L x L draws per layer) is
    what made Table I's dropout 0.5 double the critic's training time (benchmark/gpt2ppo_results.md).
    `attention_mask` is transformers' boolean SDPA mask (True = may attend), or None for a purely
    causal batch. Fully masked rows (the padded positions) get a finite, unused output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if dropout == 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                      **kwargs)
    L, S = query.shape[-2], key.shape[-2]
    scores = (query * (query.shape[-1] ** -0.5 if scaling is None else scaling)) @ key.transpose(-1, -2)
    if attention_mask is None:
        attention_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)
    bias = torch.zeros(attention_mask.shape, dtype=scores.dtype, device=scores.device)
    probs = (scores + bias.masked_fill_(~attention_mask, torch.finfo(scores.dtype).min)).softmax(-1)
    keep = torch.rand_like(probs).ge_(dropout)  # 1.0 with probability 1 - dropout, else 0.0
    return ((probs * keep) @ (value / (1.0 - dropout))).transpose(1, 2).contiguous(), None


def register_fast_dropout_attention() -> str:
    """Register `attention_with_fast_dropout` (and SDPA's boolean masks for it) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("gpt2ppo_fast_dropout", attention_with_fast_dropout)
    ALL_MASK_ATTENTION_FUNCTIONS.register("gpt2ppo_fast_dropout", sdpa_mask)
    return "gpt2ppo_fast_dropout"


class GPT2Critic(nn.Module):
    """Decision-Transformer-style critic: a GPT2Model (transformers) over the window's tokens.

    Token embeddings: linear(state) + timestep embedding, linear(action) + timestep embedding,
    interleaved s_0, a_0, s_1, a_1, ..., s_K-1 (the current state's action is not in the window),
    LayerNorm, then GPT-2 with causal attention and the window's padding mask. GPT-2's absolute
    position embeddings are zeroed and frozen (requires_grad False), so they contribute nothing:
    order comes from the causal mask and the timesteps. The value is a linear head on the final
    hidden state of the current state's token (the last token)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, context_len: int, n_layer: int, n_head: int,
                 dropout: float, max_timestep: int):
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        self.max_timestep = max_timestep
        config = GPT2Config(vocab_size=1, n_positions=2 * context_len, n_embd=hidden, n_layer=n_layer,
                            n_head=n_head, n_inner=4 * hidden, resid_pdrop=dropout, embd_pdrop=dropout,
                            attn_pdrop=dropout, use_cache=False,
                            bos_token_id=None, eos_token_id=None,
                            attn_implementation=register_fast_dropout_attention())
        self.gpt2 = GPT2Model(config)
        with torch.no_grad():
            self.gpt2.wpe.weight.zero_()
        self.gpt2.wpe.weight.requires_grad_(False)
        self.gpt2.wte.weight.requires_grad_(False)  # unused: tokens come in as inputs_embeds
        self.embed_timestep = nn.Embedding(max_timestep + 1, hidden)
        # The timestep embedding stands in for GPT-2's position embedding, so it gets GPT-2's initializer
        # (N(0, 0.02)), not nn.Embedding's N(0, 1) (which the Decision Transformer's code kept): with N(0, 1)
        # each token is ~40x more "which timestep" than "which state" after the embedding LayerNorm, and
        # the critic first has to unlearn 64k random numbers. Measured on LunarLander (307k steps, context
        # 1, 2 seeds): N(0, 1) -81 and -54, N(0, 0.02) 190 and 43 (benchmark/gpt2ppo_results.md).
        nn.init.normal_(self.embed_timestep.weight, std=config.initializer_range)
        self.embed_state = nn.Linear(obs_dim, hidden)
        self.embed_action = nn.Linear(act_dim, hidden)
        self.embed_ln = nn.LayerNorm(hidden)
        self.head = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, states, actions, timesteps, mask):
        B, K, _ = states.shape
        # Left-padded columns that are padding in EVERY window of the batch change nothing (they are
        # masked and there are no position embeddings): drop them, so that a batch of short windows
        # (early in episodes) costs only its longest window. Their values come back as 0 (unused).
        first = int(mask.any(0).to(torch.int8).argmax()) if bool(mask.any()) else 0
        if first > 0:
            v = self.forward(states[:, first:], actions[:, first:], timesteps[:, first:], mask[:, first:])
            return nn.functional.pad(v, (first, 0))
        t = self.embed_timestep(timesteps.clamp(max=self.max_timestep))
        s = self.embed_state(states) + t
        a = self.embed_action(actions) + t
        tokens = torch.stack([s, a], dim=2).reshape(B, 2 * K, -1)[:, :-1]
        tok_mask = mask.repeat_interleave(2, dim=1)[:, :-1]
        h = self.gpt2(inputs_embeds=self.embed_ln(tokens), attention_mask=tok_mask.long(),
                      use_cache=False).last_hidden_state
        # (B, K): the value read at every state token (even token indices); position K-1 is the
        # window's current state. Causal attention: position j depends on positions <= j only.
        return self.head(h[:, 0::2]).squeeze(-1)


def make_critic(kind: str, obs_dim: int, act_dim: int, a: dict) -> nn.Module:
    if kind == "mlp":
        return MLPCritic(obs_dim, a["hidden_size"])
    return GPT2Critic(obs_dim, act_dim, a["hidden_size"], a["context_len"], a["n_layer"], a["n_head"],
                      a["dropout"], a["max_timestep"])


def save_checkpoint(path: str, actor: Actor, critic: nn.Module, args: Args, spaces: dict, run_name: str) -> None:
    """Weights, args and spaces as tensors and plain Python values: loads with torch.load(weights_only=True)."""
    torch.save({"actor": actor.state_dict(), "critic": critic.state_dict(), "args": asdict(args),
                "run_name": run_name, **spaces}, path)


def load_checkpoint(path: str) -> tuple[Actor, nn.Module, dict]:
    if os.path.isdir(path):
        sys.exit(f"error: checkpoint '{path}' is a directory; give the .pt file inside it "
                 f"(e.g. {os.path.join(path, 'gpt2ppo_lunar.pt')}).")
    if not os.path.isfile(path):
        sys.exit(f"error: checkpoint '{path}' does not exist.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        a = ckpt["args"]
        actor = Actor(ckpt["obs_dim"], ckpt["act_dim"], ckpt["discrete"], a["hidden_size"])
        actor.load_state_dict(ckpt["actor"])
        critic = make_critic(a["critic"], ckpt["obs_dim"], ckpt["act_dim"], a)
        critic.load_state_dict(ckpt["critic"])
    except Exception as e:  # a corrupt or foreign file: say so in one sentence
        sys.exit(f"error: '{path}' is not a gpt2ppo_lunar.py checkpoint ({type(e).__name__}: {e}).")
    # the run that wrote it (older checkpoints: the folder it sits in)
    a = {**a, "run_name": ckpt.get("run_name") or os.path.basename(os.path.dirname(os.path.abspath(path)))}
    return actor, critic, a


def to_env_action(action: np.ndarray, act_space) -> np.ndarray:
    if isinstance(act_space, gym.spaces.Box):
        return np.clip(action, act_space.low, act_space.high)
    return action


def eval_seed(train_seed: int, cli_seed: Optional[int] = None) -> int:
    """The one rule for evaluation seeds: episode i is seeded eval_seed + i, where eval_seed is
    10000 + the training seed (the checkpoint's), or + `--seed` when given with `--eval-checkpoint`.
    So the evaluation after `--save-model` and `--eval-checkpoint` of its file print the same numbers."""
    return (train_seed if cli_seed is None else cli_seed) + EVAL_SEED_OFFSET


def evaluate(actor: Actor, env_id: str, episodes: int, seed: int, greedy: bool = True) -> list[float]:
    """Run `episodes` full episodes in one env with the actor and return their undiscounted returns.
    Episode i resets with seed + i; sampled actions (greedy False) draw from torch seeded with `seed`,
    without touching the caller's random state."""
    env = gym.make(env_id)
    returns = []
    with torch.inference_mode(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            done, total = False, 0.0
            while not done:
                action = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], greedy=greedy)[0].numpy()
                obs, reward, terminated, truncated, _ = env.step(to_env_action(action, env.action_space))
                total += float(reward)
                done = terminated or truncated
            returns.append(total)
    env.close()
    return returns


def seed_everything(seed: int, torch_deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = torch_deterministic


def make_run_dir(base: str, root: str = "runs") -> str:
    """Create the folder root/{base}__{unix time} and return its name. Creation is atomic: a run that
    finds the name taken (same base, same second) takes {base}__{time}-2, -3, ... instead."""
    stamp, k = int(time.time()), 1
    while True:
        name = f"{base}__{stamp}" + (f"-{k}" if k > 1 else "")
        try:
            os.makedirs(os.path.join(root, name))
            return name
        except FileExistsError:
            k += 1


def run_base_name(args: Args) -> str:
    """The run's name before its time stamp: env, experiment, setting (the critic, and the update schedule
    when it is not the default) and seed."""
    schedule = "" if args.update_schedule == "shuffled" else f"-{args.update_schedule}-schedule"
    return f"{args.env_id}__{args.exp_name}__critic-{args.critic}{schedule}__{args.seed}"


def returns_text(recent_returns) -> str:
    if not recent_returns:
        return "no episode has finished yet"
    return f"mean return of the last {len(recent_returns)} episodes {np.mean(recent_returns):.2f}"


def eval_text(returns: list[float]) -> str:
    return f"{np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)} episodes"


def run_eval_only(args: Args) -> None:
    from torch.utils.tensorboard import SummaryWriter

    actor, _, train_args = load_checkpoint(args.eval_checkpoint)
    env_id = train_args["env_id"]
    seed = eval_seed(train_args["seed"], args.seed)
    returns = evaluate(actor, env_id, args.eval_episodes, seed=seed, greedy=args.eval_greedy)
    run_name = make_run_dir(f"{train_args['run_name']}-eval__{seed}")
    writer = SummaryWriter(f"runs/{run_name}")
    for i, r in enumerate(returns):
        writer.add_scalar("eval/episodic_return", r, i)
    writer.close()
    print(f"eval {args.eval_checkpoint}: {eval_text(returns)} (env {env_id}, critic {train_args['critic']}, "
          f"seeds {seed}..{seed + len(returns) - 1}, logged to runs/{run_name})")


def num_rollouts(total_timesteps: int, steps_per_rollout: int) -> int:
    """The budget rule of all three scripts: whole rollouts, rounded up (never fewer steps than asked)."""
    return -(-total_timesteps // steps_per_rollout)


def check_args(args: Args) -> None:
    """Exit with one sentence on the first bad value, before any work (and before the run folder exists)."""
    a = args
    rules = [
        (a.total_timesteps >= 1, f"--total-timesteps must be >= 1, got {a.total_timesteps}"),
        (a.num_envs >= 1 and a.steps_per_epoch >= 1 and a.steps_per_epoch % a.num_envs == 0,
         f"--steps-per-epoch {a.steps_per_epoch} must be a positive multiple of --num-envs {a.num_envs}"),
        (a.minibatch_size >= 1 and a.steps_per_epoch % a.minibatch_size == 0,
         f"--minibatch-size {a.minibatch_size} must divide --steps-per-epoch {a.steps_per_epoch}"),
        (a.update_epochs >= 1, f"--update-epochs must be >= 1, got {a.update_epochs}"),
        (a.actor_lr > 0 and a.critic_lr > 0, f"--actor-lr and --critic-lr must be > 0, got {a.actor_lr} and "
                                             f"{a.critic_lr}"),
        (0.0 <= a.gamma <= 1.0, f"--gamma must be in [0, 1], got {a.gamma}"),
        (0.0 <= a.gae_lambda <= 1.0, f"--gae-lambda must be in [0, 1], got {a.gae_lambda}"),
        (a.clip_coef > 0, f"--clip-coef must be > 0, got {a.clip_coef}"),
        (a.ent_coef >= 0, f"--ent-coef must be >= 0, got {a.ent_coef}"),
        (a.target_kl is None or a.target_kl > 0, f"--target-kl must be > 0, got {a.target_kl}"),
        (a.hidden_size >= 1, f"--hidden-size must be >= 1, got {a.hidden_size}"),
        (a.context_len >= 1, f"--context-len must be >= 1, got {a.context_len}"),
        (a.n_layer >= 1 and a.n_head >= 1, f"--n-layer and --n-head must be >= 1, got {a.n_layer} and {a.n_head}"),
        (1 <= a.value_stride <= max(a.context_len, 1),
         f"--value-stride must be between 1 and --context-len {a.context_len}, got {a.value_stride}"),
        (a.critic != "gpt2" or a.hidden_size % max(a.n_head, 1) == 0,
         f"--n-head {a.n_head} must divide --hidden-size {a.hidden_size}"),
        (0.0 <= a.dropout < 1.0, f"--dropout must be in [0, 1), got {a.dropout}"),
        (a.eval_episodes >= 1, f"--eval-episodes must be >= 1, got {a.eval_episodes}"),
        (a.torch_threads >= 1, f"--torch-threads must be >= 1, got {a.torch_threads}"),
        (a.progress_every >= 0, f"--progress-every must be >= 0, got {a.progress_every}"),
        (not a.track or importlib.util.find_spec("wandb") is not None,
         "--track needs the wandb package (pip install wandb)"),
        (not a.capture_video or importlib.util.find_spec("moviepy") is not None,
         "--capture-video needs the moviepy package (pip install moviepy)"),
    ]
    for ok, message in rules:
        if not ok:
            sys.exit(f"error: {message}.")


class StopOnCtrlC:
    """Ctrl-C during training: finish the current update, then stop cleanly (the caller saves a
    checkpoint with --save-model, closes the writer and exits with one line). A second Ctrl-C quits
    at once without saving."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            print("\nsecond Ctrl-C: quit without saving", file=sys.stderr, flush=True)
            raise SystemExit(130)
        self.requested = True
        print("\nCtrl-C: stopping after the current update (Ctrl-C again: quit at once)", file=sys.stderr, flush=True)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)


def minibatch_plan(schedule: str, batch: int, n_segments: int, minibatch_size: int, update_epochs: int,
                   rng: np.random.Generator):
    """The order of one update's Adam steps, as groups of (actor minibatch, critic segment batch) pairs;
    `--target-kl` is checked after each group. Each step trains the actor on its minibatch of samples
    and the critic on its batch of segments (as many critic steps as actor steps).

    shuffled: update_epochs groups, one per pass over the rollout, reshuffled every pass (one step
      per minibatch);
    authors: one pass in rollout order, unshuffled; each minibatch gets update_epochs consecutive
      steps, one group per minibatch (the authors' code: Table I's 5 "training steps per epoch").
    Both take update_epochs * batch / minibatch_size steps."""
    n_mb = -(-batch // minibatch_size)
    b_inds, seg_inds = np.arange(batch), np.arange(n_segments)
    if schedule == "authors":
        seg_batches = np.array_split(seg_inds, n_mb)
        for k, start in enumerate(range(0, batch, minibatch_size)):
            yield [(b_inds[start:start + minibatch_size], seg_batches[k])] * update_epochs
        return
    for _ in range(update_epochs):
        rng.shuffle(b_inds)
        rng.shuffle(seg_inds)
        seg_batches = np.array_split(seg_inds.copy(), n_mb)
        yield [(b_inds[start:start + minibatch_size].copy(), seg_batches[k])
               for k, start in enumerate(range(0, batch, minibatch_size))]


def slow_update_note(seconds_per_update: float, num_iterations: int, device_type: str, value_stride: int,
                     limit: float = 10.0) -> Optional[str]:
    """The start-up line for a slow critic (more than `limit` s per update expected), else None."""
    if seconds_per_update <= limit:
        return None
    hint = "; --value-stride 64 makes the windows about 64x fewer (README)" if value_stride == 1 else ""
    return (f"note: the GPT-2 critic may take up to ~{seconds_per_update:.0f} s per update on {device_type} "
            f"(~{seconds_per_update * num_iterations / 3600:.1f} h for {num_iterations} updates; estimated from a "
            f"probe batch){hint}")


def probe_update_seconds(critic: nn.Module, obs_dim: int, act_dim: int, context_len: int, windows: int,
                         update_epochs: int, device: torch.device, probe: int = 8) -> float:
    """Rough upper bound on the critic's seconds per update: time a training pass (forward + backward)
    of `probe` full-length windows (best of 3) and scale it to `windows` windows per pass, update_epochs
    training passes plus one value pass (an upper bound: early in an episode states share windows). Leaves the random state, the gradients and the mode as they were."""
    was_training = critic.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        critic.train()
        x = (torch.zeros(probe, context_len, obs_dim, device=device), torch.zeros(probe, context_len, act_dim,
             device=device), torch.zeros(probe, context_len, dtype=torch.long, device=device),
             torch.ones(probe, context_len, dtype=torch.bool, device=device))
        critic(*x).sum().backward()  # warm-up
        times = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
            critic(*x).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.time() - t0)
        per_window = min(times) / probe
    critic.zero_grad(set_to_none=True)
    critic.train(was_training)
    # update_epochs training passes, plus the value pass (forward only: about a third of a training pass)
    return per_window * windows * (update_epochs + 1 / 3)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    torch.set_num_threads(max(args.torch_threads, 1))
    check_args(args)
    if args.cuda and not torch.cuda.is_available():  # never fall back to the CPU silently
        sys.exit("error: --cuda was given but torch sees no CUDA device.")
    if args.eval_checkpoint is not None:
        run_eval_only(args)
        return
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    args.max_timestep = check_env_id(args.env_id, args.max_timestep)
    args.seed = DEFAULT_SEED if args.seed is None else args.seed
    num_steps = args.steps_per_epoch // args.num_envs  # per env per rollout
    num_iterations = num_rollouts(args.total_timesteps, args.steps_per_epoch)
    run_name = make_run_dir(run_base_name(args))
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, monitor_gym=True, save_code=True)
    writer = SummaryWriter(f"runs/{run_name}")
    hparams = {**vars(args), "num_steps (per env per rollout)": num_steps, "num_iterations": num_iterations}
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n%s" % ("\n".join([f"|{key}|{value}|" for key, value in hparams.items()])),
    )
    if num_iterations * args.steps_per_epoch != args.total_timesteps:
        print(f"{run_name}: {num_iterations} rollouts of {args.steps_per_epoch} steps = "
              f"{num_iterations * args.steps_per_epoch} steps (--total-timesteps {args.total_timesteps} rounded up "
              f"to whole rollouts)")

    seed_everything(args.seed, args.torch_deterministic)
    device = torch.device("cuda" if args.cuda else "cpu")

    # SAME_STEP autoreset: on a done step the returned obs is already the next episode's first
    # obs, and the real last obs is in info["final_obs"]; every row is a genuine transition.
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, i, args.capture_video, run_name) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    act_space = envs.single_action_space
    discrete = isinstance(act_space, gym.spaces.Discrete)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    act_dim = int(act_space.n) if discrete else int(np.prod(act_space.shape))
    actor = Actor(obs_dim, act_dim, discrete, args.hidden_size).to(device)
    critic = make_critic(args.critic, obs_dim, act_dim, vars(args)).to(device)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=args.actor_lr, eps=1e-5)
    # every trainable critic parameter: GPT-2 blocks, embeddings, LayerNorm, value head (the
    # authors' code gave only the value head to the optimizer; its GPT-2 never learned)
    critic_params = [p for p in critic.parameters() if p.requires_grad]
    critic_opt = torch.optim.Adam(critic_params, lr=args.critic_lr, eps=1e-5)
    shuffle_rng = np.random.default_rng(args.seed)
    if args.critic == "gpt2":  # say so at start-up when an update will be slow (exact windows on a CPU)
        est = probe_update_seconds(critic, obs_dim, act_dim, args.context_len,
                                   args.steps_per_epoch // args.value_stride, args.update_epochs, device)
        note = slow_update_note(est, num_iterations, device.type, args.value_stride)
        if note:
            print(f"{run_name}: {note}", flush=True)

    # The MLP critic sees only the current state: its "window" is that one step.
    T, N = num_steps, args.num_envs
    K, S = (args.context_len, args.value_stride) if args.critic == "gpt2" else (1, 1)
    history = History(N, T, K, S, obs_dim, act_dim)
    act_buf = np.zeros((T, N) if discrete else (T, N, act_dim), dtype=np.int64 if discrete else np.float32)
    rewards_buf = np.zeros((T, N), dtype=np.float32)
    terminations_buf = np.zeros((T, N), dtype=np.float32)
    dones_buf = np.zeros((T, N), dtype=np.float32)
    eye = np.eye(act_dim, dtype=np.float32)

    episode_return = np.zeros(N, dtype=np.float64)
    episode_length = np.zeros(N, dtype=np.int64)  # = timestep of the current state in its episode
    recent_returns: deque = deque(maxlen=100)

    global_step = 0
    start_time = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = next_obs.astype(np.float32)
    bar = tqdm(total=num_iterations * args.steps_per_epoch, unit="step",
               disable=None if args.progress else True, dynamic_ncols=True)
    all_steps = np.repeat(np.arange(T + 1)[None], N, 0)  # (N, T+1) rollout steps incl. the final state
    all_envs = np.repeat(np.arange(N)[:, None], T + 1, 1)
    rows_all = history.flat_rows(all_steps.reshape(-1), all_envs.reshape(-1))
    rows_train = history.flat_rows(all_steps[:, :T].T.reshape(-1), all_envs[:, :T].T.reshape(-1))  # (T*N,) t-major

    print_progress = args.progress_every > 0 and not sys.stdout.isatty()
    stop = StopOnCtrlC()
    for iteration in range(1, num_iterations + 1):
        rollout_start = time.time()
        actor.eval()
        critic.eval()  # no dropout while collecting data and computing value targets
        truncated_at = []  # (step, env, final window) of truncated episodes, to bootstrap
        with torch.inference_mode():
            for step in range(T):
                global_step += N
                history.put_state(step, next_obs, episode_length)
                action = actor.act(torch.from_numpy(next_obs).to(device)).cpu().numpy()
                act_buf[step] = action
                history.put_action(step, eye[action] if discrete else action)
                next_obs, reward, terminations, truncations, infos = envs.step(to_env_action(action, act_space))
                next_obs = next_obs.astype(np.float32)
                dones = np.logical_or(terminations, truncations)
                rewards_buf[step] = reward
                terminations_buf[step] = terminations
                dones_buf[step] = dones
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(dones):
                    if not terminations[i]:  # truncated: V(final obs) with this episode's history
                        truncated_at.append((step, i, history.final_window(i, step, infos["final_obs"][i])))
                    writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    recent_returns.append(episode_return[i])
                    episode_return[i], episode_length[i] = 0.0, 0
            history.put_state(T, next_obs, episode_length)

            # Values of every state of the rollout (and of the state it ended in) in a few batched
            # critic calls, with the same windows the update will gather; dropout off.
            values_all = state_values(critic, history, rows_all, device=device).view(N, T + 1).T.numpy()  # (T+1, N)
            values = values_all[:T]
            next_values = values_all[1:].copy()  # for a done step this row is another episode ...
            if truncated_at:  # ... replaced by V(final obs) where the episode was truncated
                windows = [torch.cat(parts) for parts in zip(*[w for _, _, w in truncated_at])]
                v_final = critic(*to_device(windows, device))[:, -1].cpu().numpy()
                for (step, i, _), v in zip(truncated_at, v_final):
                    next_values[step, i] = v
            advantages, returns = compute_gae(rewards_buf, values, next_values, terminations_buf, dones_buf,
                                              args.gamma, args.gae_lambda)
            b_obs = history.obs[:, K - 1:K - 1 + T].transpose(1, 0, 2).reshape(T * N, obs_dim)  # a copy
            b_obs = torch.from_numpy(b_obs).to(device)
            b_actions = torch.from_numpy(act_buf.reshape((T * N,) + act_buf.shape[2:])).to(device)
            b_logprobs, _ = actor.log_prob_entropy(b_obs, b_actions)
        rollout_time = time.time() - rollout_start

        b_obs, b_logprobs = b_obs.clone(), b_logprobs.clone()  # out of inference mode
        b_advantages = torch.from_numpy(advantages.reshape(-1)).to(device)
        # The critic trains on segments: all states of a segment get their value from one pass,
        # each at its own token (the same windows as the values above, see `state_values`).
        seg_rows, seg_of, back = history.segments(rows_train)
        seg_targets = torch.zeros(len(seg_rows), K, device=device)
        seg_read = torch.zeros(len(seg_rows), K, dtype=torch.bool, device=device)
        seg_targets[seg_of, K - 1 - back] = torch.from_numpy(returns.reshape(-1)).to(device)
        seg_read[seg_of, K - 1 - back] = True

        update_start = time.time()
        actor.train()
        critic.train()  # dropout on: training passes only
        clipfracs = []
        for group in minibatch_plan(args.update_schedule, T * N, len(seg_rows), args.minibatch_size,
                                    args.update_epochs, shuffle_rng):
            for mb_inds, seg_batch in group:
                mb = torch.from_numpy(mb_inds).to(device)
                newlogprob, entropy = actor.log_prob_entropy(b_obs[mb], b_actions[mb])
                mb_adv = b_advantages[mb]
                if args.norm_adv and len(mb) > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss, approx_kl, clipfrac = clipped_surrogate_loss(newlogprob, b_logprobs[mb], mb_adv,
                                                                      args.clip_coef)
                entropy_loss = entropy.mean()
                actor_loss = pg_loss - args.ent_coef * entropy_loss
                actor_opt.zero_grad()
                actor_loss.backward()
                if args.max_grad_norm > 0:
                    nn.utils.clip_grad_norm_(actor.parameters(), args.max_grad_norm)
                actor_opt.step()

                if len(seg_batch) > 0:
                    smb = torch.from_numpy(seg_batch).to(device)
                    newvalue = critic(*to_device(history.windows(seg_rows[seg_batch]), device))
                    read = seg_read[smb]
                    critic_loss = 0.5 * ((newvalue[read] - seg_targets[smb][read]) ** 2).mean()
                    critic_opt.zero_grad()
                    critic_loss.backward()
                    if args.max_grad_norm > 0:
                        nn.utils.clip_grad_norm_(critic_params, args.max_grad_norm)
                    critic_opt.step()
                clipfracs.append(clipfrac.item())
            if args.target_kl is not None and approx_kl > args.target_kl:
                break
        update_time = time.time() - update_start
        history.carry_over()

        sps = int(global_step / (time.time() - start_time))
        writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        writer.add_scalar("losses/value_loss", critic_loss.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        writer.add_scalar("losses/explained_variance", explained_variance(values.reshape(-1), returns.reshape(-1)),
                          global_step)
        writer.add_scalar("charts/SPS", sps, global_step)
        writer.add_scalar("time/rollout_seconds", rollout_time, global_step)
        writer.add_scalar("time/update_seconds", update_time, global_step)
        bar.update(args.steps_per_epoch)
        if recent_returns:
            bar.set_postfix(ret=f"{np.mean(recent_returns):.1f}", sps=sps)
        if print_progress and iteration % args.progress_every == 0 and iteration < num_iterations:
            print(f"{run_name}: update {iteration}/{num_iterations}, {global_step} steps, "
                  f"{returns_text(recent_returns)}, {sps} steps/s", flush=True)
        if stop.requested:
            break

    bar.close()
    stop.restore()
    sps = int(global_step / (time.time() - start_time))
    spaces = {"obs_dim": obs_dim, "act_dim": act_dim, "discrete": discrete}
    model_path = f"runs/{run_name}/{args.exp_name}.pt"
    if stop.requested:  # Ctrl-C: save what there is, close everything, one line
        if args.save_model:
            save_checkpoint(model_path, actor, critic, args, spaces, run_name)
        envs.close()
        writer.close()
        print(f"{run_name}: interrupted after {global_step} of {num_iterations * args.steps_per_epoch} steps, "
              f"{returns_text(recent_returns)}; "
              + (f"checkpoint saved to {model_path}" if args.save_model else "no checkpoint (no --save-model)"),
              flush=True)
        sys.exit(130)
    print(f"{run_name}: {global_step} steps, {returns_text(recent_returns)}, {sps} steps/s")

    if args.save_model:
        save_checkpoint(model_path, actor, critic, args, spaces, run_name)
        print(f"model saved to {model_path}")
        actor.eval()
        returns_eval = evaluate(actor, args.env_id, args.eval_episodes, seed=eval_seed(args.seed),
                                greedy=args.eval_greedy)
        for i, r in enumerate(returns_eval):
            writer.add_scalar("eval/episodic_return", r, i)
        print(f"eval: {eval_text(returns_eval)}")

    envs.close()
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args))
