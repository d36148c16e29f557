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

The algorithm reads top to bottom down to the `# ---- Run machinery` banner; below it is the `Run` that `main` meets
before, in and after its loop (run folder, TensorBoard, signals, progress, the training state of `--resume`), the
checks, checkpoints and the evaluation-only mode.
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while the packages below load: one line, not a traceback
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted while starting", file=sys.stderr), os._exit(130)))

import fcntl
import random
import re
import stat
import time
import types
import warnings
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Literal, Optional, Union, get_args, get_origin

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro


@dataclass
class Args:
    exp_name: str = "gpt2ppo_lunar"
    """the name of this experiment (up to 200 letters, digits, `.`, `_`, `-`; part of the run folder's name)"""
    seed: int = 1
    """seed of the experiment; with --eval-checkpoint, a value other than 1 replaces the checkpoint's seed"""
    cuda: bool = True
    """use CUDA when torch sees a device (`--no-cuda`: the CPU)"""
    torch_threads: int = 1
    """torch intra-op threads"""
    save_model: bool = False
    """save a checkpoint into the run folder when training ends or is stopped; a run that ends (not a stopped one)
    then evaluates it"""
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint whose actor is evaluated instead of training"""
    eval_episodes: int = 10
    """number of greedy evaluation episodes (`--eval-checkpoint`, `--save-model`), episode i seeded 10000 + seed + i"""
    checkpoint_every: int = 10
    """save the training state (for `--resume`) every this many updates (rollout and update of steps_per_epoch
    steps), and when the run ends or is stopped"""
    resume: Optional[str] = None
    """a run folder to continue, with its own flags, to its original budget (in the same folder and log); a flag given
    at a non-default value must equal the run's, except those that change only how the run computes (threads, device,
    checkpointing, saving, evaluation), which replace the run's"""
    track: bool = False
    """log to Weights & Biases as well: the TensorBoard scalars are mirrored (WANDB_MODE=offline: no network)"""
    wandb_project_name: str = "llm-rl"
    """the W&B project (--track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity, a user or team (--track; default: the account's)"""
    capture_video: bool = False
    """record the evaluation episodes (--save-model, --eval-checkpoint) as MP4 files in the run folder's videos/"""

    env_id: str = "LunarLander-v3"
    """the id of the environment (flat Box observations, Discrete or flat Box actions, an episode limit)"""
    critic: Literal["gpt2", "mlp"] = "gpt2"
    """`gpt2`: GPT2PPO's critic over the episode's history; `mlp`: plain PPO's, on the current state"""
    total_timesteps: int = 150 * 2048
    """total environment steps (Table I: 150 epochs x 2048), rounded up to whole rollouts"""
    steps_per_epoch: int = 2048
    """environment steps per rollout (the paper's "epoch"), summed over all envs"""
    num_envs: int = 4
    """the number of parallel environments (each runs steps_per_epoch / num_envs steps per rollout)"""
    update_epochs: int = 5
    """Adam steps per minibatch per update (Table I's "training steps per epoch")"""
    update_schedule: Literal["shuffled", "authors"] = "shuffled"
    """`shuffled`: update_epochs passes over the rollout, each reshuffled; `authors`: the authors' code, one pass in
    rollout order with update_epochs consecutive steps on each minibatch"""
    minibatch_size: int = 128
    """samples per minibatch (must divide steps_per_epoch)"""
    actor_lr: float = 3e-4
    """Adam learning rate of the actor"""
    critic_lr: float = 1e-3
    """Adam learning rate of the critic (GPT-2, its embeddings and the value head)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda of generalized advantage estimation (the critic's targets are the GAE returns)"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    max_grad_norm: float = 0.5
    """clip the gradient norm of actor and critic separately (0: no clipping)"""
    hidden_size: int = 64
    """width of the actor and MLP critic layers, and GPT-2's n_embd"""
    context_len: int = 64
    """steps of the current episode the GPT-2 critic sees (2 * context_len - 1 tokens)"""
    n_layer: int = 2
    """GPT-2 blocks"""
    n_head: int = 8
    """GPT-2 attention heads (must divide hidden_size)"""
    dropout: float = 0.5
    """GPT-2 dropout (Table I), active only in training passes"""
    value_stride: int = 1
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


def main(args: Args, stop: Optional["StopSignal"] = None) -> int:
    """Train (or, with --eval-checkpoint, evaluate); returns the exit status: 0, or 128 + the signal that stopped it."""
    stop = StopSignal() if stop is None else stop
    check_args(args)
    torch.set_num_threads(args.torch_threads)
    if args.eval_checkpoint is not None:
        return evaluate_checkpoint(args, stop)
    run = Run(args, stop)  # nothing written yet; with --resume, the run's own flags
    args = run.args
    T, N = args.steps_per_epoch // args.num_envs, args.num_envs  # steps per env per rollout, envs
    num_updates = -(-args.total_timesteps // args.steps_per_epoch)  # whole rollouts, rounded up
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
    start = run.start(  # a resumed run: these objects as they were at its last training state
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
    global_step, next_obs, start_time = start.global_step, start.next_obs, time.time()
    for update in range(start.update + 1, num_updates + 1):
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

        sps = int((global_step - start.global_step) / (time.time() - start_time))
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


# ---- Run machinery: what a run needs around the algorithm (the run object that main meets before, in and after its
# loop, checks, signals, checkpoints, the training state that --resume continues from, the evaluation-only mode, the
# command line). The algorithm is complete above this line.


class UserError(Exception):
    """A mistake the user can fix (a flag, a file, an env, the disk): one sentence, exit 2 at the entry point."""


class Run:
    """The run around the training loop: its folder, the TensorBoard writer (`run.writer`), the signals, the progress
    line, the training state saved every --checkpoint-every updates and at a stop, and --resume. `main` meets it
    before the loop (`start`), at the end of each update (`end_update`) and after the loop (`finish`)."""

    def __init__(self, args: Args, stop: "StopSignal"):
        """Nothing is written here; with --resume, `args` becomes the run's own flags, read from its training state."""
        self.stop, self.state, self.writer, self.wandb, self.wandb_id = stop, None, None, None, None
        if args.resume is not None:
            args, self.state = load_training_state(args)
        self.args, self.run_dir = args, args.resume
        self.num_updates = -(-args.total_timesteps // args.steps_per_epoch)

    def start(self, next_obs: np.ndarray, **objects) -> types.SimpleNamespace:
        """Before the loop: a new run makes its folder and writer and logs its flags; a resumed one puts its training
        state back into `objects` (those a training state holds) and continues its folder and log. The counters the
        loop starts from: update (done so far), global_step, next_obs."""
        args, state, self.objects = self.args, self.state, objects
        update, global_step = 0, 0
        if state is None:
            suffix = "" if args.update_schedule == "shuffled" else f"-{args.update_schedule}-schedule"
            base = f"{args.env_id.replace('/', '-')}__{args.exp_name}__critic-{args.critic}{suffix}__{args.seed}"
            self.run_dir = os.path.join("runs", make_run_dir(base))
            self.take_lock()
        else:  # nothing is written into the folder before the state is known to fit and the folder to be writable
            validate_training_state(self.state_path, state, args, objects)
            self.take_lock()
            for name in os.listdir(self.run_dir):  # a save killed mid-write leaves its temporary file
                if re.fullmatch(r".+\.pt\.tmp\d+", name):
                    os.remove(os.path.join(self.run_dir, name))
            update, global_step, next_obs = restore_training_state(state, objects)
            self.stop.last_state = f"the last training state is {self.state_path} (update {update})"
            # TensorBoard reads event files in name order, which starts with the second of their making
            wait_for_a_new_second(self.run_dir)
        self.run_name = os.path.basename(os.path.abspath(self.run_dir))
        device = next(objects["actor"].parameters()).device
        slow = device.type == "cpu" and args.critic == "gpt2" and args.value_stride == 1
        print(
            f"{self.run_name}: device {device}, {self.num_updates} rollouts of {args.steps_per_epoch} steps"
            + ("" if state is None else f", continued after update {update}")
            + ("; exact windows: minutes per update on a CPU (--value-stride 64: ~64x fewer passes)" if slow else ""),
            flush=True,
        )
        if args.track:  # before the writer: W&B mirrors what it logs; the same W&B run when resumed
            import wandb
            from wandb.sdk.lib.runid import generate_id

            self.wandb = wandb
            self.wandb_id = state["wandb_id"] if state is not None and state["wandb_id"] else generate_id()
            if not wandb.patched["tensorboard"]:  # the scalars only: a copy of the event files would land in W&B's
                wandb.tensorboard.patch(save=False)  # folder inside the run folder, where W&B would read it again
            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=vars(args),
                name=self.run_name,
                save_code=True,
                dir=self.run_dir,
                id=self.wandb_id,
                resume="allow",
            )
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run hides what was logged after its last training state, so no step appears twice
        self.writer = SummaryWriter(self.run_dir, purge_step=None if state is None else global_step + 1)
        if state is None:
            table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.update, self.global_step, self.first_step = update, global_step, global_step
        self.start_time = self.last_line = time.time()
        return types.SimpleNamespace(update=update, global_step=global_step, next_obs=next_obs)

    @property
    def state_path(self) -> str:
        return os.path.join(self.run_dir, "training_state.pt")

    def take_lock(self) -> None:
        """One process per run folder: an advisory lock on <run folder>/.lock, held until the run ends, with the
        holder's pid in it; the folder is checked to be writable (a small file written, synced, removed) before the
        pid is written."""
        try:
            self.lock = open(os.path.join(self.run_dir, ".lock"), "a+")
        except OSError as e:
            raise UserError(f"cannot write into the run folder {self.run_dir} ({e.strerror})")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.lock.seek(0)
            holder = self.lock.read().strip() or "unknown"
            self.lock.close()
            raise UserError(f"another process (pid {holder}) is running {self.run_dir}")
        try:
            check_writable(self.run_dir, "the run folder")
            if self.args.capture_video and self.args.save_model:
                check_writable(os.path.join(self.run_dir, "videos"), "the videos folder")
            self.lock.seek(0)
            self.lock.truncate()
            self.lock.write(f"{os.getpid()}\n")
            self.lock.flush()
        except UserError:
            self.lock.close()
            raise
        except OSError as e:  # the pid could not be written (a full disk)
            self.lock.close()
            raise UserError(f"cannot write into the run folder {self.run_dir} ({e.strerror or e})")

    def steps_per_second(self) -> int:
        return int((self.global_step - self.first_step) / max(time.time() - self.start_time, 1e-9))

    def end_update(self, update: int, global_step: int, **loop_state) -> bool:
        """After each update: save the training state when due (every --checkpoint-every updates, the last one, and
        at a stop), print the progress line (every 10% of the updates or 60 s); True when a stop was asked."""
        self.update, self.global_step = update, global_step
        stopping = self.stop.requested  # read once: a signal after this line stops the run at the next update
        if stopping or update % self.args.checkpoint_every == 0 or update == self.num_updates:
            self.writer.flush()  # what the updates in this state logged is on disk before the state is
            save_checkpoint(
                self.state_path,
                training_state(self.args, update, global_step, self.objects, wandb_id=self.wandb_id, **loop_state),
            )
            self.stop.last_state = f"the last training state is {self.state_path} (update {update})"
        tenth = update * 10 // self.num_updates > (update - 1) * 10 // self.num_updates
        if not stopping and update < self.num_updates and (tenth or time.time() - self.last_line >= 60):
            self.last_line = time.time()
            print(
                f"{self.run_name}: update {update}/{self.num_updates}, {global_step} steps, "
                f"{self.steps_per_second()} steps/s, {returns_text(self.objects['recent_returns'])}",
                flush=True,
            )
        return stopping

    def finish(self) -> int:
        """After the loop: the --save-model checkpoint, the final line, the evaluation of a run that ended (not a
        stopped one); closes the envs and the writer. The exit status."""
        args, objects = self.args, self.objects
        objects["envs"].close()
        self.writer.flush()
        model_path = os.path.join(self.run_dir, f"{args.exp_name}.pt")
        if args.save_model:
            max_timestep, obs_dim, act_dim, discrete = env_dims(objects["envs"])
            checkpoint = {
                "actor": objects["actor"].state_dict(),
                "critic": objects["critic"].state_dict(),
                "args": {**vars(args), "max_timestep": max_timestep},
                "run_name": self.run_name,
                "obs_dim": obs_dim,
                "act_dim": act_dim,
                "discrete": discrete,
            }
            save_checkpoint(model_path, checkpoint)
        saved = f"checkpoint saved to {model_path}" if args.save_model else "no checkpoint (no --save-model)"
        interrupted = self.stop.requested and self.update < self.num_updates  # a stop in the last update: complete
        stopped = f"stopped by {signal.Signals(self.stop.signum).name} after " if interrupted else ""
        print(
            f"{self.run_name}: {stopped}{self.global_step} of {self.num_updates * args.steps_per_epoch} steps, "
            f"{returns_text(objects['recent_returns'])}, {self.steps_per_second()} steps/s; {saved}"
            + (f"; interrupted (continue it: --resume {self.run_dir})" if interrupted else ""),
            flush=True,
        )
        if args.save_model and not self.stop.requested:
            actor, videos = objects["actor"].cpu().eval(), os.path.join(self.run_dir, "videos")
            seed, folder = 10_000 + args.seed, videos if args.capture_video else None
            returns = evaluate(
                actor, args.env_id, args.eval_episodes, seed, self.writer, self.stop, video_folder=folder
            )
            if self.wandb is not None and args.capture_video:  # this evaluation's videos, to W&B too
                for episode in range(len(returns)):
                    path = os.path.join(videos, f"eval-episode-{episode}.mp4")
                    self.wandb.log({"videos/eval": self.wandb.Video(path, format="mp4")})
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb.tensorboard.unpatch()
        self.lock.close()
        return self.stop.exit_status


def check_writable(folder: str, what: str) -> None:
    """Make `folder` if needed and write, sync and remove a small file in it; UserError naming `what` otherwise."""
    probe = os.path.join(folder, f".probe{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            if os.path.lexists(probe):
                os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write into {what} {folder} ({e.strerror or e})")


RANGES = {  # every numeric flag: (low, high, low excluded); nan and inf are outside every range
    "seed": (0, 2**32 - 1, False),
    "torch_threads": (1, 1024, False),
    "eval_episodes": (1, 10**6, False),
    "checkpoint_every": (1, 10**9, False),
    "total_timesteps": (1, 10**12, False),
    "steps_per_epoch": (1, 2**24, False),
    "num_envs": (1, 1024, False),
    "update_epochs": (1, 10**4, False),
    "minibatch_size": (1, 2**24, False),
    "actor_lr": (0, 1, True),
    "critic_lr": (0, 1, True),
    "gamma": (0, 1, False),
    "gae_lambda": (0, 1, False),
    "clip_coef": (0, 10, True),
    "max_grad_norm": (0, 1e6, False),
    "hidden_size": (1, 2**16, False),
    "context_len": (1, 4096, False),
    "n_layer": (1, 96, False),
    "n_head": (1, 1024, False),
    "dropout": (0, 0.99, False),
    "value_stride": (1, 4096, False),
}
CHOICES = {f.name: get_args(f.type) for f in fields(Args) if get_origin(f.type) is Literal}
EVAL_FLAGS = {
    "eval_checkpoint",
    "eval_episodes",
    "seed",
    "cuda",
    "torch_threads",
    "capture_video",
}  # all that --eval-checkpoint takes
# the single list of flags a resumed run may change: they change only how the run computes, not its training
RESUME_FLAGS = {"resume", "checkpoint_every", "cuda", "torch_threads", "save_model", "eval_episodes", "capture_video"}
PLAIN_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,200}")  # a folder name: no separators, not . or ..


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def in_range(name: str, value) -> bool:
    low, high, low_excluded = RANGES[name]
    return low < value <= high if low_excluded else low <= value <= high


def check_args(args: Args) -> None:
    """The one check before anything is made: UserError for the first bad value (ranges, choices, names, the env's
    fit, the memory estimate), before any env, model or run folder exists."""
    for name, (low, high, low_excluded) in RANGES.items():
        value = getattr(args, name)
        if value is not None and not in_range(name, value):
            raise UserError(f"{flag(name)} must be in {'(' if low_excluded else '['}{low}, {high}], got {value}")
    for name, choices in CHOICES.items():
        if getattr(args, name) not in choices:
            raise UserError(f"{flag(name)} must be one of {', '.join(choices)}, got {getattr(args, name)!r}")
    if not PLAIN_NAME.fullmatch(args.exp_name):
        raise UserError(
            f"--exp-name must be a plain name of up to 200 letters, digits, '.', '_' or '-', got {args.exp_name!r}"
        )
    if args.exp_name == "training_state":  # --save-model's file would overwrite the training state
        raise UserError("--exp-name training_state is the name of the run's training state; choose another")
    given = [flag(f.name) for f in fields(Args) if getattr(args, f.name) != f.default and f.name not in EVAL_FLAGS]
    if args.eval_checkpoint is not None and given:
        raise UserError(f"--eval-checkpoint evaluates a saved model and takes no training flags, got {' '.join(given)}")
    if args.track:
        check_wandb()
    if args.capture_video and args.eval_checkpoint is None:
        check_renderer(args.env_id)
    if args.eval_checkpoint is not None:
        return  # the rest is the training's; the checkpoint's own flags are checked when it is read
    if args.steps_per_epoch % args.num_envs:
        raise UserError(f"--steps-per-epoch must be a multiple of --num-envs {args.num_envs}")
    if args.steps_per_epoch % args.minibatch_size:
        raise UserError(f"--minibatch-size must divide --steps-per-epoch {args.steps_per_epoch}")
    if args.critic == "gpt2" and args.value_stride > args.context_len:
        raise UserError(
            f"--value-stride must be between 1 and --context-len {args.context_len}, got {args.value_stride}"
        )
    if args.critic == "gpt2" and args.hidden_size % args.n_head:
        raise UserError(f"--n-head {args.n_head} must divide --hidden-size {args.hidden_size}")
    check_memory(args)
    env_spaces(args.env_id)


def check_memory(args: Args) -> None:
    """UserError when the critic and the rollout would need more than this machine's memory (a rough estimate); the
    GPT-2 sizes count only for `--critic gpt2`."""
    H, memory = args.hidden_size, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpt2 = args.critic == "gpt2"
    K = args.context_len if gpt2 else 1  # the MLP's window: one step
    square = 12 * args.n_layer if gpt2 else 2  # H x H weights: GPT-2's blocks, or the MLP's and the actor's layer
    weights = 16 * (square * H * H + 4096 * H)  # weights, gradients and Adam's moments
    rollout = 32 * args.steps_per_epoch * (K + args.num_envs)
    batch = 4 * max(256, args.minibatch_size) * 2 * K * args.n_layer * (16 * H + 6 * args.n_head * K) if gpt2 else 0
    need = weights + rollout + batch
    if need >= memory:
        raise UserError(f"these sizes need ~{need / 2**30:.0f} GiB, more than this machine's {memory / 2**30:.0f} GiB")


def check_wandb() -> None:
    """UserError unless the wandb package is there and W&B can be reached without a prompt: an API key, a login
    (api.wandb.ai in ~/.netrc) or WANDB_MODE offline (or disabled)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("--track needs the wandb package (pip install wandb)")
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    import netrc

    try:
        login = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc")).authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        login = None
    if not login:
        raise UserError(
            "--track needs a way to log in to Weights & Biases: set WANDB_API_KEY, run `wandb login` (an api.wandb.ai "
            "entry in ~/.netrc), or set WANDB_MODE=offline (then `wandb sync` uploads the run)"
        )


def check_renderer(env_id: str) -> None:
    """UserError unless `env_id` renders a frame headless (rgb_array), naming what to install; MuJoCo envs render
    through OSMesa when no display or MUJOCO_GL is set."""
    mujoco = "mujoco" in str(getattr(gym.spec(env_id), "entry_point", "")) if env_id in gym.registry else False
    if mujoco and not os.environ.get("DISPLAY") and not os.environ.get("MUJOCO_GL"):
        os.environ.setdefault("MUJOCO_GL", "osmesa")
        os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
    if not mujoco and not os.environ.get("DISPLAY"):  # pygame draws off screen: no display, no warning about one
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    install = (
        "set MUJOCO_GL=osmesa and install OSMesa (Debian: apt-get install libosmesa6)"
        if mujoco
        else "pip install pygame"
    )
    try:
        env = gym.make(env_id, render_mode="rgb_array")
        try:
            env.reset(seed=0)
            frame = env.render()
        finally:
            env.close()
    except Exception as e:  # a missing renderer shows up as any error of the env's drawing code
        why = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        raise UserError(f"--capture-video cannot render {env_id} ({why}); {install}")
    if not isinstance(frame, np.ndarray) or frame.ndim != 3:
        raise UserError(f"--capture-video cannot render {env_id} (it draws no rgb_array frames); {install}")


def env_spaces(env_id: str) -> tuple[gym.Space, gym.Space]:
    """(observation space, action space) of an env that fits this script (flat Box observations, Discrete or flat Box
    actions, an episode limit); UserError otherwise."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # an unknown or broken id is the user's input
        raise UserError(f"cannot make env '{env_id}': {(str(e).splitlines() or [type(e).__name__])[0].rstrip('.')}")
    obs, act, spec = env.observation_space, env.action_space, env.spec
    env.close()
    if not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise UserError(f"gpt2ppo_lunar.py needs a flat Box observation, but '{env_id}' has {obs}")
    discrete = isinstance(act, gym.spaces.Discrete)
    if not discrete and not (isinstance(act, gym.spaces.Box) and len(act.shape) == 1):
        raise UserError(f"gpt2ppo_lunar.py needs a Discrete or flat Box action space, but '{env_id}' has {act}")
    if spec is None or spec.max_episode_steps is None:
        raise UserError(f"'{env_id}' has no episode limit, which the timestep embedding needs")
    return obs, act


class StopSignal:
    """SIGINT (Ctrl-C) and SIGTERM: the first asks the run to stop at the next safe point and keep what was done,
    a second quits at once. `install` puts the handler in place (the entry point does; importing does not)."""

    def __init__(self):
        self.signum = 0
        self.last_state = "no training state was saved"  # the run object says where its last state is

    def install(self) -> "StopSignal":
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"\n{name} again: quitting at once without saving; {self.last_state}", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        self.signum = signum
        print(f"\n{name}: stopping at the next safe point (again: quit at once)", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def exit_status(self) -> int:
        return 128 + self.signum if self.signum else 0


def save_checkpoint(path: str, checkpoint: dict) -> None:
    """Write to a temporary file in the same folder, then rename: a failed save leaves the previous file or none."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk: OSError from open, RuntimeError from torch's writer
        why = e.strerror if isinstance(e, OSError) and e.strerror else "the write failed: is the disk full?"
        raise UserError(f"could not save the checkpoint {path} ({why}); the file there, if any, is unchanged")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str) -> dict:
    """The dict in a checkpoint file, read without running code (weights_only); UserError for anything else."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        raise UserError(f"cannot read the checkpoint '{path}' (it does not exist)")
    except OSError as e:
        raise UserError(f"cannot read the checkpoint '{path}' ({e.strerror})")
    try:
        mode = os.stat(path).st_mode  # a symbolic link followed: a loop or a dangling link says so
    except OSError as e:
        raise UserError(f"cannot read the checkpoint '{path}' ({e.strerror})")
    if not stat.S_ISREG(mode):  # a folder, a FIFO or a device: opening a FIFO would wait forever
        raise UserError(f"cannot read the checkpoint '{path}' (not a regular file)")
    try:
        with open(path, "rb") as f:  # unreadable (permissions, an I/O error): say why
            f.read(1)
    except OSError as e:
        raise UserError(f"cannot read the checkpoint '{path}' ({e.strerror})")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        raise UserError(f"cannot read the checkpoint '{path}' (not a torch file)")
    if not isinstance(checkpoint, dict):
        raise UserError(f"'{path}' is not a gpt2ppo_lunar.py checkpoint")
    return checkpoint


def fits(value, hint) -> bool:
    """Whether `value` is of the type hint `hint`: int excludes bool, float accepts an int, Optional and Literal as
    written, tuples, lists and dicts element by element."""
    origin, params = get_origin(hint), get_args(hint)
    if hint is None or hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is Literal:
        return any(type(value) is type(p) and value == p for p in params)
    if origin in (Union, types.UnionType):
        return any(fits(value, p) for p in params)
    if origin is tuple:
        if len(params) == 2 and params[1] is Ellipsis:
            return isinstance(value, tuple) and all(fits(v, params[0]) for v in value)
        return isinstance(value, tuple) and len(value) == len(params) and all(map(fits, value, params))
    if origin is list:
        return isinstance(value, list) and all(fits(v, params[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(fits(k, params[0]) and fits(v, params[1]) for k, v in value.items())
    return isinstance(value, hint)


CHECKPOINT_TYPES = {
    "actor": dict[str, torch.Tensor],
    "critic": dict[str, torch.Tensor],
    "args": dict,
    "obs_dim": int,
    "act_dim": int,
    "discrete": bool,
}
CHECKPOINT_ARGS = {
    "env_id": str,
    "critic": Literal["gpt2", "mlp"],
    "seed": int,
    "hidden_size": int,
    "context_len": int,
    "n_layer": int,
    "n_head": int,
    "dropout": float,
    "max_timestep": int,
}


def spaces_dims(obs: gym.Space, act: gym.Space) -> tuple[int, int, bool]:
    """(obs_dim, act_dim, discrete) of spaces that passed env_spaces."""
    discrete = isinstance(act, gym.spaces.Discrete)
    return int(obs.shape[0]), int(act.n if discrete else act.shape[0]), discrete


def actor_from_checkpoint(path: str) -> tuple[Actor, dict]:
    """(actor, training args with run_name) of a --save-model checkpoint, checked key by key, against its env, and
    weight by weight (names, shapes, dtypes, finite values) before the actor is built; the critic, which an
    evaluation does not use, is only checked (on the meta device: its shapes, nothing allocated)."""
    ckpt = load_checkpoint(path)
    train = ckpt.get("args")
    if not (
        all(fits(ckpt.get(k), t) for k, t in CHECKPOINT_TYPES.items())
        and all(fits(train.get(k), t) for k, t in CHECKPOINT_ARGS.items())
    ):
        raise UserError(f"'{path}' is not a gpt2ppo_lunar.py checkpoint (a key is missing or of the wrong type)")
    config = {**train, "run_name": ckpt.get("run_name") or os.path.basename(os.path.dirname(os.path.abspath(path)))}
    sizes = ("seed", "hidden_size", "context_len", "n_layer", "n_head", "dropout")
    if not (
        all(in_range(k, config[k]) for k in sizes)
        and 1 <= config["max_timestep"] <= 10**7
        and fits(config["run_name"], str)
        and PLAIN_NAME.fullmatch(config["run_name"])
        and (config["critic"] == "mlp" or config["hidden_size"] % config["n_head"] == 0)
    ):
        raise UserError(f"'{path}' is not a gpt2ppo_lunar.py checkpoint (sizes, critic or run name out of range)")
    spaces = (ckpt["obs_dim"], ckpt["act_dim"], ckpt["discrete"])
    if spaces != spaces_dims(*env_spaces(config["env_id"])):
        raise UserError(f"'{path}' was trained on other spaces than those of {config['env_id']} ({spaces})")
    with torch.device("meta"):  # the shapes the args imply, without allocating them
        shapes = Actor(*spaces, config["hidden_size"]), make_critic(config["critic"], *spaces[:2], config)
    for module, state in zip(shapes, (ckpt["actor"], ckpt["critic"])):
        want = {k: (v.shape, v.dtype) for k, v in module.state_dict().items()}
        got = {k: (v.shape, v.dtype) for k, v in state.items() if bool(v.isfinite().all())}
        if got != want or len(state) != len(want):
            raise UserError(f"'{path}' holds no network of the shapes its args give (finite float32 weights)")
    actor = Actor(*spaces, config["hidden_size"])
    actor.load_state_dict(ckpt["actor"])
    return actor, config


def evaluate(actor: Actor, env_id: str, episodes: int, seed: int, writer, stop: StopSignal, video_folder=None):
    """Greedy episodes on the CPU, episode i reset with seed + i, logged as eval/episodic_return; with `video_folder`
    each episode is recorded there as eval-episode-{i}.mp4. The returns.

    A stop request ends the evaluation after the current episode.
    """
    env, returns = gym.make(env_id, render_mode="rgb_array" if video_folder else None), []
    if video_folder is not None:
        with warnings.catch_warnings():  # a folder made beforehand (checked to be writable) is not an overwrite
            warnings.filterwarnings("ignore", message=".*Overwriting existing videos")
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda e: True, name_prefix="eval")
    with torch.inference_mode():
        for ep in range(episodes):
            if stop.requested:
                break
            (obs, _), done, total = env.reset(seed=seed + ep), False, 0.0
            while not done:
                action = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], greedy=True)[0].numpy()
                obs, reward, terminated, truncated, _ = env.step(to_env_action(action, env.action_space))
                total, done = total + float(reward), terminated or truncated
            returns.append(total)
            writer.add_scalar("eval/episodic_return", total, ep)
    env.close()
    stopped = f"; stopped after {len(returns)} of {episodes} episodes" if len(returns) < episodes else ""
    print(
        f"eval: {returns_text(returns, 'over ')} (env {env_id}, seeds {seed}..{seed + len(returns) - 1}){stopped}",
        flush=True,
    )
    return returns


def evaluate_checkpoint(args: Args, stop: StopSignal) -> int:
    """The evaluation-only mode: greedy episodes of a saved actor, seeded as the evaluation after its training (a
    --seed other than 1 replaces the checkpoint's)."""
    from torch.utils.tensorboard import SummaryWriter

    actor, train = actor_from_checkpoint(args.eval_checkpoint)
    if args.capture_video:
        check_renderer(train["env_id"])
    seed = 10_000 + (train["seed"] if args.seed == 1 else args.seed)
    run_name = make_run_dir(f"{train['run_name']}-eval__{seed}")
    videos = os.path.join("runs", run_name, "videos") if args.capture_video else None
    print(f"{args.eval_checkpoint}: critic {train['critic']}, device cpu (evaluation), logging to runs/{run_name}")
    with SummaryWriter(f"runs/{run_name}") as writer:
        evaluate(actor.eval(), train["env_id"], args.eval_episodes, seed, writer, stop, video_folder=videos)
    return stop.exit_status


def returns_text(returns, last: str = "of the last ") -> str:
    """The mean return of the last episodes, as the progress and final lines say it."""
    if not len(returns):
        return "no episode has finished yet"
    return f"mean return {last}{len(returns)} episodes {np.mean(returns):.2f} +- {np.std(returns):.2f}"


MODELS = ("actor", "critic", "actor_optimizer", "critic_optimizer")


def training_state(args: Args, iteration: int, global_step: int, objects: dict, next_obs: np.ndarray, wandb_id=None):
    """Everything a run needs to continue: flags, counters, the weights and optimizers, random streams (torch's, CUDA's
    on a GPU, the minibatch shuffler; numpy's and Python's global ones are seeded but never drawn from), the critic's
    history, the episodes in progress and the last 100 returns, the envs. `objects`: those Run.start was given."""
    cuda = next(objects["actor"].parameters()).is_cuda
    return {
        "script": "gpt2ppo_lunar.py",
        "args": asdict(args),
        "iteration": iteration,
        "global_step": global_step,
        "next_obs": torch.from_numpy(next_obs.copy()),
        **{name: objects[name].state_dict() for name in MODELS},
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if cuda else None,
        "shuffle_rng": objects["shuffle_rng"].bit_generator.state,
        "history": {name: torch.from_numpy(getattr(objects["history"], name).copy()) for name in HISTORY},
        "episode_return": torch.from_numpy(objects["episode_return"].copy()),
        "episode_length": torch.from_numpy(objects["episode_length"].copy()),
        "recent_returns": torch.from_numpy(np.array(objects["recent_returns"], dtype=np.float64)),
        "envs": env_state(objects["envs"]),
        "wandb_id": wandb_id,  # --track: the W&B run that a resume continues
    }


HISTORY = ("obs", "act", "ts", "reach")


TRAINING_STATE_TYPES = {
    "script": str,
    "args": dict,
    "iteration": int,
    "global_step": int,
    "next_obs": torch.Tensor,
    "actor": dict[str, torch.Tensor],
    "critic": dict[str, torch.Tensor],
    "actor_optimizer": dict,
    "critic_optimizer": dict,
    "torch_rng": torch.Tensor,
    "cuda_rng": Optional[torch.Tensor],
    "shuffle_rng": dict,
    "history": dict[str, torch.Tensor],
    "episode_return": torch.Tensor,
    "episode_length": torch.Tensor,
    "recent_returns": torch.Tensor,
    "envs": Optional[list[dict]],
    "wandb_id": Optional[str],
}
ADAM_STATE = {"step": torch.Tensor, "exp_avg": torch.Tensor, "exp_avg_sq": torch.Tensor}


def validate_training_state(path: str, state: dict, args: Args, objects: dict) -> None:
    """UserError "'{path}' is a damaged training state ({why})" unless every key, type, shape and range of `state`
    fits the run's own flags `args` and the freshly built `objects` (those Run.start was given). Reads only."""
    why = training_state_damage(state, args, objects)
    if why is not None:
        raise UserError(f"'{path}' is a damaged training state ({why})")


def training_state_damage(state: dict, args: Args, objects: dict) -> Optional[str]:
    """What is wrong with `state` (see validate_training_state), or None."""
    for key, hint in TRAINING_STATE_TYPES.items():
        if key not in state:
            return f"no {key!r}"
        if not fits(state[key], hint):
            return f"{key} is not of the type {getattr(hint, '__name__', hint)}"
    if set(state) != set(TRAINING_STATE_TYPES):
        return f"unknown keys {sorted(set(state) - set(TRAINING_STATE_TYPES))}"
    updates, per_update = -(-args.total_timesteps // args.steps_per_epoch), args.steps_per_epoch
    update, steps = state["iteration"], state["global_step"]
    if not (1 <= update <= updates and steps == update * per_update):
        return f"update {update} at step {steps}: not one of this run's {updates} updates of {per_update} steps"
    for name in ("actor", "critic"):
        why = tensors_damage(name, state[name], objects[name].state_dict())
        if why is not None:
            return why
    for name in ("actor_optimizer", "critic_optimizer"):
        why = adam_damage(name, state[name], objects[name])
        if why is not None:
            return why
    if not like(state["torch_rng"], torch.get_rng_state()):
        return "torch_rng is not a random state of torch"
    if state["cuda_rng"] is not None and (state["cuda_rng"].dtype != torch.uint8 or state["cuda_rng"].dim() != 1):
        return "cuda_rng is not a random state of CUDA"
    why = structure_damage("shuffle_rng", state["shuffle_rng"], objects["shuffle_rng"].bit_generator.state)
    if why is not None:
        return why
    history, envs = objects["history"], objects["envs"]
    max_timestep = env_dims(envs)[0]
    expected = {f"history.{name}": torch.from_numpy(getattr(history, name)) for name in HISTORY}
    expected["next_obs"] = torch.zeros(envs.num_envs, *envs.single_observation_space.shape)
    expected["episode_return"] = torch.from_numpy(objects["episode_return"])
    expected["episode_length"] = torch.from_numpy(objects["episode_length"])
    if set(state["history"]) != set(HISTORY):
        return f"history holds {sorted(state['history'])}, not {list(HISTORY)}"
    saved = {f"history.{name}": state["history"][name] for name in HISTORY}
    saved.update({k: state[k] for k in ("next_obs", "episode_return", "episode_length")})
    for name, want in expected.items():
        if not like(saved[name], want) or not bool(saved[name].isfinite().all()):
            return f"{name} is not a finite {want.dtype} tensor of shape {tuple(want.shape)}"
    ts, reach, length = saved["history.ts"], saved["history.reach"], saved["episode_length"]
    if not (bool((ts >= 0).all()) and bool((ts <= max_timestep).all()) and bool((length <= max_timestep).all())):
        return f"timesteps outside 0..{max_timestep}, the episode limit"
    if not (
        bool((length >= 0).all()) and bool((reach >= 0).all()) and bool((reach <= ts.clamp(max=history.K - 1)).all())
    ):
        return "windows that reach outside their episodes"
    if state["wandb_id"] is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", state["wandb_id"]):
        return "wandb_id is not a W&B run id"
    recent = state["recent_returns"]
    if recent.dtype != torch.float64 or recent.dim() != 1 or len(recent) > 100 or not bool(recent.isfinite().all()):
        return "recent_returns is not up to 100 finite float64 returns"
    fresh = env_state(envs)
    if (state["envs"] is None) != (fresh is None):
        return "envs are not those of this run"
    if fresh is not None:
        return envs_damage(state["envs"], fresh, env_layers(envs))
    return None


def envs_damage(saved: list, fresh: list, layers: list) -> Optional[str]:
    """The saved envs (env_state) against the fresh envs': the same layers; each env's own attributes exactly the fresh
    env's keys, of the same structure; a wrapper's shared keys of the same structure (wrappers cache some attributes
    on first use, so their key sets vary) and its others plain values or saved arrays."""
    if len(saved) != len(fresh):
        return "envs has other layers than this run's"
    for i, (layer, ours, theirs) in enumerate(zip(layers, saved, fresh)):
        if not isinstance(ours, dict):
            return f"envs[{i}] is not a dict"
        own = isinstance(layer, gym.Env) and not isinstance(layer, gym.Wrapper)
        if own and set(ours) != set(theirs):
            return f"envs[{i}] has other keys than this run's"
        for key in set(ours) & set(theirs):
            why = structure_damage(f"envs[{i}].{key}", ours[key], theirs[key])
            if why is not None:
                return why
        for key in set(ours) - set(theirs):
            if not fits(ours[key], Union[None, bool, int, float, str, torch.Tensor]):
                return f"envs[{i}].{key} is not a plain value"
    return None


def like(saved: torch.Tensor, fresh: torch.Tensor) -> bool:
    """A tensor of the dtype and shape of `fresh`."""
    return torch.is_tensor(saved) and saved.dtype == fresh.dtype and saved.shape == fresh.shape


def tensors_damage(name: str, saved: dict, fresh: dict) -> Optional[str]:
    """The weights `saved` against a fresh model's state_dict: the same names, dtypes and shapes, finite values."""
    if set(saved) != set(fresh):
        return f"{name} has other weights than this run's model"
    for key, want in fresh.items():
        if not like(saved[key], want) or (want.is_floating_point() and not bool(saved[key].isfinite().all())):
            return f"{name}.{key} is not a finite {want.dtype} tensor of shape {tuple(want.shape)}"
    return None


def adam_damage(name: str, saved: dict, optimizer: torch.optim.Optimizer) -> Optional[str]:
    """An Adam state_dict against a fresh optimizer of the run's flags: its hyperparameters and parameter groups, and
    for each parameter a finite step count and finite moments of the parameter's shape (the second non-negative)."""
    fresh = optimizer.state_dict()
    if set(saved) != {"state", "param_groups"} or not fits(saved["param_groups"], list[dict]):
        return f"{name} is not an Adam state"
    if not _same(saved["param_groups"], fresh["param_groups"]):
        return f"{name} has other hyperparameters or parameter groups than this run's"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not fits(saved["state"], dict[int, dict]) or not set(saved["state"]) <= set(range(len(params))):
        return f"{name} holds the state of other parameters"
    for i, moments in saved["state"].items():
        zero = torch.zeros_like(params[i], device="cpu")
        if not (
            set(moments) == set(ADAM_STATE)
            and all(fits(moments[k], t) for k, t in ADAM_STATE.items())
            and moments["step"].numel() == 1
            and bool(moments["step"].isfinite().all())
            and float(moments["step"]) >= 0
            and like(moments["exp_avg"], zero)
            and like(moments["exp_avg_sq"], zero)
            and bool(moments["exp_avg"].isfinite().all())
            and bool(moments["exp_avg_sq"].isfinite().all())
            and bool((moments["exp_avg_sq"] >= 0).all())
        ):
            return f"{name}'s moments of parameter {i} are not finite, of its shape {tuple(zero.shape)}"
    return None


def _same(a, b) -> bool:
    """Equal through dicts, lists and tuples, types included (True is not 1)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def structure_damage(name: str, saved, fresh) -> Optional[str]:
    """`saved` against what the fresh objects give (`env_state`, a generator's state): the same dicts (keys), lists
    (lengths) and generator kinds, tensors of the same dtype and shape (a deque's of any length) with finite values,
    and plain values of the same type (None allowed for either)."""
    if isinstance(fresh, dict):
        if not isinstance(saved, dict) or set(saved) != set(fresh):
            return f"{name} has other keys than this run's"
        if "bit_generator" in fresh and saved["bit_generator"] != fresh["bit_generator"]:
            return f"{name} is not a {fresh['bit_generator']} random state"
        for key in fresh:
            why = structure_damage(f"{name}.{key}", saved[key], fresh[key])
            if why is not None:
                return why
        return None
    if isinstance(fresh, list):
        if not isinstance(saved, list) or len(saved) != len(fresh):
            return f"{name} has other layers than this run's"
        for i, (s_, f_) in enumerate(zip(saved, fresh)):
            why = structure_damage(f"{name}[{i}]", s_, f_)
            if why is not None:
                return why
        return None
    if torch.is_tensor(fresh):
        # an env's arrays keep their shape but not always their precision (a state reset as float32 is stepped in
        # float64); a queue's length and, when empty, its dtype vary
        kind = "float" if fresh.is_floating_point() else "bool" if fresh.dtype == torch.bool else "integer"
        fits_it = torch.is_tensor(saved) and (
            saved.shape[1:] == fresh.shape[1:] if name.endswith(".deque") else saved.shape == fresh.shape
        )
        if not name.endswith(".deque") and fits_it:
            fits_it = kind == (
                "float" if saved.is_floating_point() else "bool" if saved.dtype == torch.bool else "integer"
            )
        if not fits_it:
            return f"{name} is not a {kind} tensor of shape {tuple(fresh.shape)}"
        if saved.is_floating_point() and not bool(saved.isfinite().all()):
            return f"{name} is not finite"
        return None
    if saved is None or fresh is None:
        return None if saved is None or isinstance(saved, (bool, int, float, str)) else f"{name} is not a plain value"
    return None if type(saved) is type(fresh) else f"{name} is not a {type(fresh).__name__}"


def restore_training_state(state: dict, objects: dict) -> tuple[int, int, np.ndarray]:
    """Put a training state that validate_training_state passed back into the freshly made `objects`, in place;
    (updates done, steps done, the current observation).

    Envs whose state was not saved (Box2D, MuJoCo) start new episodes, seeded by the run's seed and the update."""
    envs, episode_return, episode_length = objects["envs"], objects["episode_return"], objects["episode_length"]
    for name in MODELS:
        objects[name].load_state_dict(state[name])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and next(objects["actor"].parameters()).is_cuda:
        torch.cuda.set_rng_state(state["cuda_rng"])
    objects["shuffle_rng"].bit_generator.state = state["shuffle_rng"]
    for name in HISTORY:  # in place: History's torch views share this memory
        getattr(objects["history"], name)[...] = state["history"][name].numpy()
    episode_return[...], episode_length[...] = state["episode_return"].numpy(), state["episode_length"].numpy()
    objects["recent_returns"].clear()
    objects["recent_returns"].extend(state["recent_returns"].numpy())
    if state["envs"] is None:  # the episodes in progress are cut off, unlogged; the windows start afresh
        episode_return[:], episode_length[:] = 0.0, 0
        next_obs = envs.reset(seed=state["args"]["seed"] + envs.num_envs * state["iteration"])[0]
    else:
        restore_env_state(envs, state["envs"])
        next_obs = state["next_obs"].numpy()
    return state["iteration"], state["global_step"], next_obs.astype(np.float32)


def env_layers(envs) -> list:
    """The vector env's wrappers, the vector env, and each copy's wrappers down to the env itself."""
    layers = [envs]
    while hasattr(layers[-1], "env"):
        layers.append(layers[-1].env)
    for env in layers[-1].envs:
        layers.append(env)
        while hasattr(layers[-1], "env"):
            layers.append(layers[-1].env)
    return layers


def env_state(envs) -> Optional[list[dict]]:
    """The plain attributes (numbers, arrays, random generators, queues) of every layer of the envs, or None when an
    env keeps its state in other objects (Box2D's world: LunarLander, BipedalWalker; MuJoCo's data).

    For classic-control envs (Acrobot, CartPole, Pendulum) this is their whole state: an episode in progress
    continues where it stopped.
    """
    saved = []
    for layer in env_layers(envs):
        plain = {}
        for key, value in vars(layer).items():
            if isinstance(value, np.random.Generator):
                plain[key] = {"generator": value.bit_generator.state}
            elif isinstance(value, np.ndarray) and value.dtype != object:
                plain[key] = torch.from_numpy(value.copy())
            elif isinstance(value, np.generic):  # a numpy number, such as a counter summed with np.sum
                plain[key] = {"scalar": torch.from_numpy(np.array(value))}
            elif isinstance(value, deque):
                plain[key] = {"deque": torch.from_numpy(np.array(value))}
            elif value is None or isinstance(value, (bool, int, float, str)):
                plain[key] = value
            elif isinstance(layer, gym.Env) and not isinstance(layer, gym.Wrapper):  # the env itself
                if not isinstance(value, (gym.Space, gym.envs.registration.EnvSpec)):
                    return None  # a simulator's object: the plain attributes are not the whole state
        saved.append(plain)
    return saved


def restore_env_state(envs, saved: list[dict]) -> None:
    layers = env_layers(envs)
    if len(layers) != len(saved):
        raise ValueError("the saved environments do not match this script's")
    for layer, plain in zip(layers, saved):
        for key, value in plain.items():
            if isinstance(value, dict) and "generator" in value:
                generator = np.random.default_rng()
                generator.bit_generator.state = value["generator"]
                setattr(layer, key, generator)
            elif isinstance(value, dict) and "scalar" in value:
                setattr(layer, key, value["scalar"].numpy()[()])
            elif isinstance(value, dict) and "deque" in value:
                queue = getattr(layer, key)
                queue.clear()
                queue.extend(list(value["deque"].numpy()))
            elif torch.is_tensor(value):
                setattr(layer, key, value.numpy())
            else:
                setattr(layer, key, value)


def load_training_state(args: Args) -> tuple[Args, dict]:
    """The flags and training state of the run folder `args.resume`; UserError when it cannot be continued."""
    path = os.path.join(args.resume, "training_state.pt")
    if not os.path.isdir(args.resume):
        raise UserError(f"--resume {args.resume} is not a run folder")
    if not os.path.lexists(path):
        raise UserError(f"--resume {args.resume} holds no training_state.pt (it stopped before its first checkpoint)")
    state = load_checkpoint(path)
    saved = state.get("args")
    if (
        state.get("script") != "gpt2ppo_lunar.py"
        or not isinstance(saved, dict)
        or set(saved) != {f.name for f in fields(Args)}
        or not all(fits(saved[f.name], f.type) for f in fields(Args))
    ):
        raise UserError(f"'{path}' is not a training state of this version of gpt2ppo_lunar.py")
    for f in fields(Args):
        value = getattr(args, f.name)
        if f.name not in RESUME_FLAGS and value != f.default and value != saved[f.name]:
            raise UserError(
                f"--resume continues a run with its own flags, but {flag(f.name)} {value} differs from its "
                f"{saved[f.name]}"
            )
    given = {f.name: getattr(args, f.name) for f in fields(Args) if getattr(args, f.name) != f.default}
    run_args = Args(**{**saved, **{name: value for name, value in given.items() if name in RESUME_FLAGS}})
    try:
        check_args(run_args)
    except UserError as e:
        raise UserError(f"the flags saved in '{path}' cannot run: {e}")
    return run_args, state


def wait_for_a_new_second(run_dir: str) -> None:
    """Sleep until the second after that of the newest event file in `run_dir`, at most 2 s (a file stamped in the
    future, from clock skew, must not stall the run)."""
    made = [int(f.split(".")[3]) for f in os.listdir(run_dir) if re.fullmatch(r"events\.out\.tfevents\.\d+\..*", f)]
    time.sleep(min(2.0, max(0.0, max(made, default=0) + 1 - time.time())))


def make_run_dir(base: str, root: str = "runs") -> str:
    """Create root/{base}__{unix time} (-2, -3, ... appended when a run of the same second has it); its name."""
    stamp, k = int(time.time()), 1
    while True:
        name = f"{base}__{stamp}" + (f"-{k}" if k > 1 else "")
        try:
            os.makedirs(os.path.join(root, name))
            return name
        except FileExistsError:
            k += 1
        except OSError as e:
            raise UserError(f"cannot create the run folder {os.path.join(root, name)} ({e.strerror or e})")


def cli(argv: Optional[list[str]] = None) -> int:
    """The entry point: parse the flags, install the signal handler, run; a user's mistake is one sentence, exit 2."""
    args = tyro.cli(Args, args=argv)
    try:
        return main(args, StopSignal().install())
    except UserError as e:
        print(f"error: {e}.", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
