"""GPT2PPO (seed 002, Cozma and Price): PPO-clip whose critic reads the episode's recent steps through a small GPT-2.

The actor sees only the current state; the critic is a Decision-Transformer-style GPT-2 over the last `--context-len`
steps of the CURRENT episode (tokens s, a, s, a, ..., s), its value read at the current state's token; `--critic mlp`
is plain PPO. Defaults: Table I (dropout 0.5, 150 epochs of 2048 steps, seed 123), 4 envs, GAE(lambda) targets,
gradient-norm clipping 0.5, Adam eps 1e-5. Unlike the authors' code, the whole critic trains, dropout is off in
rollouts and value targets, and a time-limit truncation bootstraps from V(final observation) over THAT episode's
history. Continuous actions: a diagonal Gaussian with a state-independent log-std; buffer, log-probs and the critic's
history hold the sample, the env gets it clipped. `--value-stride S`: windows start only every S steps (CPU).

    python gpt2ppo_lunar.py                                  # GPT2PPO, Table I (exact windows: a GPU's job)
    python gpt2ppo_lunar.py --value-stride 64 --dropout 0.1  # CPU-friendly windows, the Decision Transformer's dropout
    python gpt2ppo_lunar.py --value-stride 64 --update-schedule authors
    python gpt2ppo_lunar.py --critic mlp --env-id BipedalWalker-v3 --save-model
    python gpt2ppo_lunar.py --eval-checkpoint runs/<run>/gpt2ppo_lunar.pt --eval-episodes 10
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, Optional

signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted while starting", file=sys.stderr), os._exit(130)))

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter

@dataclass
class Args:
    exp_name: str = "gpt2ppo_lunar"  # part of the run folder's name (letters, digits, '.', '_', '-')
    seed: Optional[int] = None  # seed of envs, torch, numpy and python (default 123, Table I); see --eval-episodes
    cuda: bool = True  # use CUDA when torch sees it (--no-cuda: the CPU; --cuda without a CUDA device is an error)
    torch_threads: int = 1  # torch intra-op threads
    save_model: bool = False  # save a checkpoint at the end of training (or when stopped), then evaluate it
    eval_checkpoint: Optional[str] = None  # evaluate this checkpoint's actor instead of training
    eval_episodes: int = 10  # greedy evaluation episodes, episode i seeded 10000 + the training seed (or --seed) + i

    env_id: str = "LunarLander-v3"  # flat Box observations, Discrete or flat Box actions, an episode limit
    critic: Literal["gpt2", "mlp"] = "gpt2"  # GPT2PPO (over the episode's history) or plain PPO (current state)
    total_timesteps: int = 150 * 2048  # environment steps (Table I: 150 epochs x 2048), rounded up to whole rollouts
    steps_per_epoch: int = 2048  # environment steps per rollout ("epoch" in the seed), summed over all envs
    num_envs: int = 4  # parallel environments (each runs steps_per_epoch / num_envs steps per rollout)
    update_epochs: int = 5  # Adam steps per minibatch per update (Table I's "training steps per epoch")
    update_schedule: Literal["shuffled", "authors"] = "shuffled"  # passes reshuffled, or the authors' in-order steps
    minibatch_size: int = 128  # samples per minibatch (must divide steps_per_epoch)
    actor_lr: float = 3e-4  # Adam learning rate of the actor
    critic_lr: float = 1e-3  # Adam learning rate of the critic (GPT-2, its embeddings and the value head)
    gamma: float = 0.99  # the discount factor
    gae_lambda: float = 0.95  # the lambda of generalized advantage estimation
    clip_coef: float = 0.2  # the surrogate clipping coefficient
    max_grad_norm: float = 0.5  # clip the gradient norm of actor and critic separately (0: no clipping)
    hidden_size: int = 64  # width of the actor and MLP critic layers, and GPT-2's n_embd
    context_len: int = 64  # steps of the current episode the GPT-2 critic sees (2*context_len-1 tokens)
    n_layer: int = 2  # GPT-2 blocks
    n_head: int = 8  # GPT-2 attention heads (must divide hidden_size)
    dropout: float = 0.5  # GPT-2 dropout (Table I), active only in training passes
    value_stride: int = 1  # S > 1: windows start every S steps (K-S+1..K steps), S states share one critic pass

DEFAULT_SEED, EVAL_SEED_OFFSET = 123, 10_000
RANGES = {  # every numeric field of Args: (lowest, highest) allowed
    "seed": (0, 2**32 - 1), "torch_threads": (1, 1024), "eval_episodes": (1, 10**6),
    "total_timesteps": (1, 10**12), "steps_per_epoch": (1, 2**24), "num_envs": (1, 1024), "update_epochs": (1, 10**4),
    "minibatch_size": (1, 2**24), "actor_lr": (1e-12, 1.0), "critic_lr": (1e-12, 1.0), "gamma": (0.0, 1.0),
    "gae_lambda": (0.0, 1.0), "clip_coef": (1e-6, 10.0), "max_grad_norm": (0.0, 1e6), "hidden_size": (1, 2**16),
    "context_len": (1, 4096), "n_layer": (1, 96), "n_head": (1, 1024), "dropout": (0.0, 0.99),
    "value_stride": (1, 4096),
}
EVAL_FLAGS = {"eval_checkpoint", "eval_episodes", "seed", "cuda", "torch_threads"}  # all --eval-checkpoint takes

def fail(message: str, code: int = 2):
    """One sentence on stderr and a non-zero exit: 2 for bad input, 1 where the system refused (disk, folders)."""
    print(f"error: {message}.", file=sys.stderr, flush=True)
    raise SystemExit(code)

def plain_name(name: object, longest: int) -> bool:
    return isinstance(name, str) and name not in (".", "..") and bool(re.fullmatch(rf"[\w.-]{{1,{longest}}}", name,
                                                                                   re.ASCII))

def out_of_range(values: dict) -> Optional[str]:
    """The first value of `values` (field: value) outside its RANGES row, in one sentence, else None."""
    for name, v in values.items():
        lo, hi = RANGES[name]
        if not (name == "seed" and v is None) and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                   or not math.isfinite(v) or not lo <= v <= hi):
            return f"--{name.replace('_', '-')} must be a finite number in [{lo}, {hi}], got {v}"
    return None

def check_args(a: Args) -> None:
    """Exit with one sentence on the first bad value, before any env, model or run folder exists."""
    if problem := out_of_range({k: getattr(a, k) for k in RANGES}):
        fail(problem)
    given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(a)
             if f.name not in EVAL_FLAGS and getattr(a, f.name) != f.default]
    K, H, memory = a.context_len, a.hidden_size, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # rough bytes: critic weights, gradients and Adam moments; one critic pass over a batch of windows; the rollout
    need = 16 * (12 * a.n_layer * H * H + 4096 * H) + 32 * a.steps_per_epoch * (K + a.num_envs) \
        + 4 * max(256, a.minibatch_size) * 2 * K * a.n_layer * (16 * H + 6 * a.n_head * K)
    for ok, message in [
        (a.eval_checkpoint is None or not given,
         f"--eval-checkpoint evaluates a saved actor; training flags cannot be given with it ({' '.join(given)})"),
        (plain_name(a.exp_name, 64),
         f"--exp-name must be a plain name (at most 64 of A-Z a-z 0-9 . _ -), got {a.exp_name!r}"),
        (a.steps_per_epoch % a.num_envs == 0, f"--steps-per-epoch must be a multiple of --num-envs {a.num_envs}"),
        (a.steps_per_epoch % a.minibatch_size == 0,
         f"--minibatch-size must divide --steps-per-epoch {a.steps_per_epoch}"),
        (a.value_stride <= K, f"--value-stride must be between 1 and --context-len {K}, got {a.value_stride}"),
        (a.critic != "gpt2" or H % a.n_head == 0, f"--n-head {a.n_head} must divide --hidden-size {H}"),
        (need < memory, f"these sizes need ~{need / 2**30:.0f} GiB, more than this machine's {memory / 2**30:.0f} GiB"),
    ]:
        if not ok:
            fail(message)

# ========== Environment ==========
def check_env(env_id: str) -> tuple[int, int, int, bool]:
    """(episode limit, obs_dim, act_dim, discrete) of the env, or one sentence on why it does not fit."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # an unknown or broken id is the user's input
        fail(f"cannot make env '{env_id}' ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
    obs_space, act_space, spec = env.observation_space, env.action_space, env.spec
    env.close()
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        fail(f"gpt2ppo_lunar.py needs a flat Box observation, but '{env_id}' has {obs_space}")
    discrete = isinstance(act_space, gym.spaces.Discrete)
    if not discrete and not (isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1):
        fail(f"gpt2ppo_lunar.py needs a Discrete or flat Box action space, but '{env_id}' has {act_space}")
    if spec is None or spec.max_episode_steps is None:
        fail(f"'{env_id}' has no episode limit, which the timestep embedding needs")
    return spec.max_episode_steps, obs_space.shape[0], int(act_space.n) if discrete else act_space.shape[0], discrete

def to_env_action(action: np.ndarray, act_space) -> np.ndarray:
    """What the env receives: a Gaussian sample clipped to the bounds (the sample itself is what is stored)."""
    return np.clip(action, act_space.low, act_space.high) if isinstance(act_space, gym.spaces.Box) else action

# ========== Networks ==========
def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer

class Actor(nn.Module):
    """Linear-ReLU-Linear-ReLU (the seed's CommonBase) on the current state, then logits of a categorical or the
    mean of a diagonal Gaussian with a state-independent log-std."""
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
        return torch.distributions.Independent(torch.distributions.Normal(out, self.log_std.exp().expand_as(out)), 1)

    def log_prob_entropy(self, obs: torch.Tensor, actions: torch.Tensor):
        d = self.dist(obs)
        return d.log_prob(actions), d.entropy()

    def act(self, obs: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        d = self.dist(obs)
        return (d.probs.argmax(-1) if self.discrete else d.mean) if greedy else d.sample()

class MLPCritic(nn.Module):
    """Plain PPO's critic: a 2x64 ReLU MLP on the current state."""
    def __init__(self, obs_dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.ReLU(),
                                 layer_init(nn.Linear(hidden, hidden)), nn.ReLU(),
                                 layer_init(nn.Linear(hidden, 1), std=1.0))

    def forward(self, states, actions, timesteps, mask):
        return self.net(states).squeeze(-1)  # (B, K): the value of the state at every position

def attention_with_fast_dropout(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                                **kwargs):
    """GPT-2 attention (transformers' AttentionInterface): the fused SDPA without dropout (eval passes), else the
    textbook computation with inverted dropout drawn by rand_like (a CPU's SDPA with dropout is slow). attention_mask:
    True = may attend, or None (causal); fully masked (padded) rows get a finite, unused output."""
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

class GPT2Critic(nn.Module):
    """Decision-Transformer-style critic: GPT2Model over a window's tokens s_0, a_0, ..., s_K-1 (linear(x) + timestep
    embedding, LayerNorm) with causal attention and the padding mask; position embeddings zeroed and frozen. The value
    is a linear head on each state token's last hidden state (position K-1: the window's current state)."""
    def __init__(self, obs_dim: int, act_dim: int, hidden: int, context_len: int, n_layer: int, n_head: int,
                 dropout: float, max_timestep: int):
        super().__init__()
        from transformers import AttentionInterface, GPT2Config, GPT2Model
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register("gpt2ppo_fast_dropout", attention_with_fast_dropout)
        ALL_MASK_ATTENTION_FUNCTIONS.register("gpt2ppo_fast_dropout", sdpa_mask)
        self.max_timestep = max_timestep
        config = GPT2Config(vocab_size=1, n_positions=2 * context_len, n_embd=hidden, n_layer=n_layer,
                            n_head=n_head, n_inner=4 * hidden, resid_pdrop=dropout, embd_pdrop=dropout,
                            attn_pdrop=dropout, use_cache=False, bos_token_id=None, eos_token_id=None,
                            attn_implementation="gpt2ppo_fast_dropout")
        self.gpt2 = GPT2Model(config)
        nn.init.zeros_(self.gpt2.wpe.weight).requires_grad_(False)
        self.gpt2.wte.weight.requires_grad_(False)  # unused: tokens come in as inputs_embeds
        self.embed_timestep = nn.Embedding(max_timestep + 1, hidden)
        # it stands in for GPT-2's position embedding, so it gets GPT-2's initializer, not nn.Embedding's N(0, 1)
        nn.init.normal_(self.embed_timestep.weight, std=config.initializer_range)
        self.embed_state = nn.Linear(obs_dim, hidden)
        self.embed_action = nn.Linear(act_dim, hidden)
        self.embed_ln = nn.LayerNorm(hidden)
        self.head = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, states, actions, timesteps, mask):
        B, K, _ = states.shape
        # Columns that are padding in EVERY window change nothing (masked, no position embeddings): drop them, so
        # a batch of short windows costs only its longest window. Their values come back as 0 (unused).
        first = int(mask.any(0).to(torch.int8).argmax()) if bool(mask.any()) else 0
        if first > 0:
            v = self.forward(states[:, first:], actions[:, first:], timesteps[:, first:], mask[:, first:])
            return nn.functional.pad(v, (first, 0))
        t = self.embed_timestep(timesteps.clamp(max=self.max_timestep))
        tokens = torch.stack([self.embed_state(states) + t, self.embed_action(actions) + t], 2).reshape(B, 2 * K, -1)
        tokens = tokens[:, :-1]  # s_0, a_0, ..., s_K-1: the current state's action is not chosen yet
        tok_mask = mask.repeat_interleave(2, dim=1)[:, :-1]
        h = self.gpt2(inputs_embeds=self.embed_ln(tokens), attention_mask=tok_mask.long(),
                      use_cache=False).last_hidden_state
        return self.head(h[:, 0::2]).squeeze(-1)  # (B, K): the value at every state token

def make_critic(kind: str, obs_dim: int, act_dim: int, a: dict) -> nn.Module:
    if kind == "mlp":
        return MLPCritic(obs_dim, a["hidden_size"])
    return GPT2Critic(obs_dim, act_dim, a["hidden_size"], a["context_len"], a["n_layer"], a["n_head"],
                      a["dropout"], a["max_timestep"])

def save_checkpoint(path: str, actor: Actor, critic: nn.Module, args: dict, spaces: dict, run_name: str) -> None:
    """Plain tensors and Python values, to a temporary file beside `path` renamed over it (atomic)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save({"actor": actor.state_dict(), "critic": critic.state_dict(), "args": args, "run_name": run_name,
                    **spaces}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        fail(f"could not save the checkpoint {path} ({e}); any previous file there is unchanged", 1)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

def load_checkpoint(path: str) -> tuple[Actor, nn.Module, dict]:
    """(actor, critic, training args) of a checkpoint of this script, or one sentence on what is wrong with it."""
    def bad(why: str):
        fail(f"'{path}' is not a usable gpt2ppo_lunar.py checkpoint: {why}")
    if not os.path.isfile(path):
        bad("it is a directory (give the .pt file inside it)" if os.path.isdir(path) else "no such file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, foreign or not a torch file at all
        bad(f"it cannot be read ({type(e).__name__})")
    types = {"actor": dict, "critic": dict, "args": dict, "obs_dim": int, "act_dim": int, "discrete": bool}
    arg_types = {"env_id": str, "critic": str, "seed": int, "hidden_size": int, "context_len": int, "n_layer": int,
                 "n_head": int, "dropout": float, "max_timestep": int}
    if not isinstance(ckpt, dict) or not all(isinstance(ckpt.get(k), t) for k, t in types.items()) \
            or not all(isinstance(ckpt["args"].get(k), t) for k, t in arg_types.items()):
        bad("keys are missing or of the wrong type")
    a = {**ckpt["args"], "run_name": ckpt.get("run_name") or os.path.basename(os.path.dirname(os.path.abspath(path)))}
    problem = out_of_range({k: a[k] for k in ("seed", "hidden_size", "context_len", "n_layer", "n_head", "dropout")})
    if problem or a["critic"] not in ("gpt2", "mlp") or not 1 <= a["max_timestep"] <= 10**7 \
            or not plain_name(a["run_name"], 255):
        bad(problem or "its critic, timestep limit or run name is not one this script writes")
    if (spaces := (ckpt["obs_dim"], ckpt["act_dim"], ckpt["discrete"])) != check_env(a["env_id"])[1:]:
        bad(f"its spaces (obs_dim, act_dim, discrete) {spaces} are not those of {a['env_id']}")
    try:
        actor = Actor(ckpt["obs_dim"], ckpt["act_dim"], ckpt["discrete"], a["hidden_size"])
        actor.load_state_dict(ckpt["actor"])
        critic = make_critic(a["critic"], ckpt["obs_dim"], ckpt["act_dim"], a)
        critic.load_state_dict(ckpt["critic"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        bad(f"its weights do not fit its args ({str(e).splitlines()[0][:200]})")
    return actor, critic, a

# ========== The critic's windows: trajectories stored once, windows gathered by index ==========
def window_reach(timesteps, context_len: int, value_stride: int):
    """How far back the window of a state at episode timestep t reaches: t - s(t). S = 1: the last K steps
    (min(t, K-1)). S > 1: windows start at multiples of S, s(t) = max(0, S * floor((t - K + S) / S)), so a window
    holds K-S+1..K steps and the states of one segment share one sequence."""
    start = np.maximum(0, value_stride * np.floor_divide(np.asarray(timesteps) - context_len + value_stride,
                                                            value_stride))
    return np.asarray(timesteps) - start

def build_windows(obs: torch.Tensor, act: torch.Tensor, ts: torch.Tensor, reach: torch.Tensor, rows: torch.Tensor,
                  context_len: int):
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
    def __init__(self, num_envs: int, num_steps: int, context_len: int, value_stride: int, obs_dim: int,
                 act_dim: int):
        self.N, self.T, self.K, self.S, self.L = num_envs, num_steps, context_len, value_stride, context_len + num_steps
        self.obs, self.act = (np.zeros((num_envs, self.L, d), dtype=np.float32) for d in (obs_dim, act_dim))
        self.ts, self.reach = (np.zeros((num_envs, self.L), dtype=np.int64) for _ in range(2))
        self.views = [torch.from_numpy(x).view(num_envs * self.L, *x.shape[2:]) for x in (self.obs, self.act, self.ts,
                                                                                         self.reach)]

    def put_state(self, step: int, obs: np.ndarray, timesteps: np.ndarray) -> None:
        r = self.K - 1 + step
        self.obs[:, r], self.ts[:, r], self.act[:, r] = obs, timesteps, 0.0
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
        obs = np.concatenate([self.obs[env, r - K + 2:r + 1], final_obs[None].astype(np.float32)])
        act = np.concatenate([self.act[env, r - K + 2:r + 1], np.zeros_like(self.act[env, :1])])
        ts = np.concatenate([self.ts[env, r - K + 2:r + 1], self.ts[env, r:r + 1] + 1])
        return build_windows(*map(torch.from_numpy, (obs, act, ts, window_reach(ts, K, self.S))),
                             torch.tensor([K - 1]), K)

    def carry_over(self) -> None:
        """The next rollout's K-1 history rows and first state are this one's last K rows."""
        for a in (self.obs, self.act, self.ts, self.reach):
            a[:, :self.K] = a[:, self.T:self.T + self.K].copy()

@torch.no_grad()
def state_values(critic: nn.Module, history: History, flat_rows: np.ndarray, chunk: int = 256,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """V (on the CPU) of the states at `flat_rows`, each from its own window, in a few passes over segments."""
    seg_rows, seg_of, back = history.segments(flat_rows)
    per_pos = torch.cat([critic(*history.windows(seg_rows[i:i + chunk], device)).cpu()
                         for i in range(0, len(seg_rows), chunk)])
    return per_pos[torch.from_numpy(seg_of), torch.from_numpy(history.K - 1 - back)]

# ========== PPO ==========
def compute_gae(rewards, values, next_values, terminations, dones, gamma, gae_lambda):
    """GAE over a (T, N) rollout; next_values[t] = V(state reached after step t, the final obs if truncated);
    terminations cut the bootstrap, dones the recursion. Returns (advantages, returns = advantages + values)."""
    advantages, last = rewards * 0.0, 0.0
    for t in reversed(range(rewards.shape[0])):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminations[t]) - values[t]
        last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
        advantages[t] = last
    return advantages, advantages + values

def minibatch_plan(schedule: str, batch: int, n_segments: int, minibatch_size: int, update_epochs: int,
                   rng: np.random.Generator):
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
                yield b_inds[start:start + minibatch_size].copy(), seg_batches[k]

def clipped_surrogate_loss(new_logprob, old_logprob, advantages, clip_coef):
    """PPO-clip loss mean(max(-A r, -A clip(r, 1-eps, 1+eps))), r = pi_new / pi_old, with the approximate KL
    ((r - 1) - log r) and the clipped fraction for logging."""
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return loss, approx_kl, clipfrac

def make_run_dir(base: str, root: str = "runs") -> str:
    """Create root/{base}__{unix time} (or -2, -3, ... when taken) atomically and return its name."""
    stamp, k = int(time.time()), 1
    while True:
        name = f"{base}__{stamp}" + (f"-{k}" if k > 1 else "")
        try:
            os.makedirs(os.path.join(root, name))
            return name
        except FileExistsError:
            k += 1
        except OSError as e:
            fail(f"cannot create the run folder {os.path.join(root, name)} ({e.strerror or e})", 1)

class StopSignal:
    """Ctrl-C (SIGINT) and SIGTERM alike: stop at the next safe point (after the current update or evaluation
    episode); the caller keeps what was done and exits 128 + the signal's number. A second signal quits at once."""
    def __init__(self):
        self.signum = 0
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame) -> None:
        print(f"\n{signal.Signals(signum).name}: " + ("quit at once" if self.signum else
              "stopping at the next safe point (again: quit at once)"), file=sys.stderr, flush=True)
        if self.signum:
            raise SystemExit(128 + signum)
        self.signum = signum

def evaluate(actor: Actor, env_id: str, episodes: int, seed: int, stop: StopSignal, writer) -> list[float]:
    """Undiscounted returns of greedy episodes (episode i reset with seed + i) on the CPU, logged to `writer`;
    when stopped, the episodes finished so far, and the caller says so in one line and exits."""
    env, actor, returns = gym.make(env_id), actor.cpu().eval(), []
    with torch.inference_mode():
        for ep in range(episodes):
            (obs, _), done, total = env.reset(seed=seed + ep), False, 0.0
            while not done and not stop.signum:
                action = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], greedy=True)[0].numpy()
                obs, reward, terminated, truncated, _ = env.step(to_env_action(action, env.action_space))
                total, done = total + float(reward), terminated or truncated
            if not done:
                break
            returns.append(total)
            writer.add_scalar("eval/episodic_return", total, ep)
    env.close()
    writer.close()
    if stop.signum:
        print(f"evaluation stopped after {len(returns)} of {episodes} episodes", flush=True)
        sys.exit(128 + stop.signum)
    return returns

def returns_text(returns, last: str = "of the last ") -> str:
    if not len(returns):
        return "no episode has finished yet"
    return f"mean return {last}{len(returns)} episodes {np.mean(returns):.2f} +- {np.std(returns):.2f}"

def main(args: Args, cuda_asked: bool = False) -> None:
    check_args(args)
    if cuda_asked and not torch.cuda.is_available():
        fail("--cuda was given but torch sees no CUDA device (--no-cuda: the CPU)")
    torch.set_num_threads(args.torch_threads)
    stop = StopSignal()
    try:
        if args.eval_checkpoint is None:
            train(args, torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu"), stop)
            return
        print("device: cpu (evaluation)", flush=True)
        actor, _, train_args = load_checkpoint(args.eval_checkpoint)
        seed = EVAL_SEED_OFFSET + (train_args["seed"] if args.seed is None else args.seed)
        run_name = make_run_dir(f"{train_args['run_name']}-eval__{seed}")
        returns = evaluate(actor, train_args["env_id"], args.eval_episodes, seed, stop,
                           SummaryWriter(f"runs/{run_name}"))
        print(f"eval {args.eval_checkpoint}: {returns_text(returns, 'over ')} (env {train_args['env_id']}, critic "
              f"{train_args['critic']}, seeds {seed}..{seed + len(returns) - 1}, logged to runs/{run_name})")
    finally:
        for s, handler in stop.previous.items():
            signal.signal(s, handler)

# ========== Training ==========
def train(args: Args, device: torch.device, stop: StopSignal) -> None:
    max_timestep, obs_dim, act_dim, discrete = check_env(args.env_id)
    args.seed = DEFAULT_SEED if args.seed is None else args.seed
    T, N = args.steps_per_epoch // args.num_envs, args.num_envs  # steps per env per rollout, envs
    num_iterations = -(-args.total_timesteps // args.steps_per_epoch)  # whole rollouts, never fewer steps than asked
    schedule = "" if args.update_schedule == "shuffled" else f"-{args.update_schedule}-schedule"
    run_name = make_run_dir(f"{args.env_id.replace('/', '-')}__{args.exp_name}__critic-{args.critic}{schedule}__"
                            f"{args.seed}")
    slow = device.type == "cpu" and args.critic == "gpt2" and args.value_stride == 1
    print(f"{run_name}: device {device}, {num_iterations} rollouts of {args.steps_per_epoch} steps" + (
        "; exact windows: minutes per update on a CPU (--value-stride 64: ~64x fewer passes)" * slow), flush=True)
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|" + "".join(f"\n|{k}|{v}|" for k, v in vars(args).items()))

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    # SAME_STEP autoreset: on a done step the returned obs is the next episode's first; the last is info["final_obs"]
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(args.env_id)] * N,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    actor = Actor(obs_dim, act_dim, discrete, args.hidden_size).to(device)
    critic = make_critic(args.critic, obs_dim, act_dim, {**vars(args), "max_timestep": max_timestep}).to(device)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=args.actor_lr, eps=1e-5)
    critic_params = [p for p in critic.parameters() if p.requires_grad]  # all of the GPT-2, embeddings and head
    critic_opt = torch.optim.Adam(critic_params, lr=args.critic_lr, eps=1e-5)
    shuffle_rng = np.random.default_rng(args.seed)

    K, S = (args.context_len, args.value_stride) if args.critic == "gpt2" else (1, 1)  # the MLP's window: one step
    history = History(N, T, K, S, obs_dim, act_dim)
    act_buf = np.zeros((T, N) if discrete else (T, N, act_dim), dtype=np.int64 if discrete else np.float32)
    rewards_buf, terminations_buf, dones_buf = (np.zeros((T, N), dtype=np.float32) for _ in range(3))
    eye = np.eye(act_dim, dtype=np.float32)
    episode_return, episode_length = np.zeros(N), np.zeros(N, dtype=np.int64)  # length = the current timestep
    recent_returns: deque = deque(maxlen=100)
    # flat History rows: every state of the rollout and the one it ended in, env-major; the T*N samples, step-major
    rows_all = (np.arange(N)[:, None] * history.L + K - 1 + np.arange(T + 1)[None]).reshape(-1)
    rows_train = (np.arange(N)[None] * history.L + K - 1 + np.arange(T)[:, None]).reshape(-1)

    global_step, start_time = 0, time.time()
    next_obs = envs.reset(seed=args.seed)[0].astype(np.float32)
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
                act_buf[step] = action  # the sample, unclipped: its log-probability is the one PPO's ratio needs
                history.put_action(step, eye[action] if discrete else action)
                next_obs, reward, terminations, truncations, infos = envs.step(
                    to_env_action(action, envs.single_action_space))
                next_obs = next_obs.astype(np.float32)
                dones = np.logical_or(terminations, truncations)
                rewards_buf[step], terminations_buf[step], dones_buf[step] = reward, terminations, dones
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

            # every state's value (and the final state's) in a few batched passes, with the update's windows
            values_all = state_values(critic, history, rows_all, device=device).view(N, T + 1).T.numpy()  # (T+1, N)
            values, next_values = values_all[:T], values_all[1:].copy()  # after a done step: another episode ...
            if truncated_at:  # ... replaced by V(final obs) where the episode was truncated
                windows = [torch.cat(parts).to(device) for parts in zip(*[w for _, _, w in truncated_at])]
                for (step, i, _), v in zip(truncated_at, critic(*windows)[:, -1].cpu().numpy()):
                    next_values[step, i] = v
            advantages, returns = compute_gae(rewards_buf, values, next_values, terminations_buf, dones_buf,
                                              args.gamma, args.gae_lambda)
            b_obs = torch.from_numpy(history.obs[:, K - 1:-1].transpose(1, 0, 2).reshape(T * N, obs_dim)).to(device)
            b_actions = torch.from_numpy(act_buf.reshape((T * N,) + act_buf.shape[2:])).to(device)
            b_logprobs, _ = actor.log_prob_entropy(b_obs, b_actions)
        rollout_time = time.time() - rollout_start

        b_obs, b_logprobs = b_obs.clone(), b_logprobs.clone()  # out of inference mode
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
        for mb_inds, seg_batch in minibatch_plan(args.update_schedule, T * N, len(seg_rows), args.minibatch_size,
                                                 args.update_epochs, shuffle_rng):
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
                critic_loss = 0.5 * ((newvalue[read] - seg_targets[smb][read]) ** 2).mean()
                critic_opt.zero_grad()
                critic_loss.backward()
                if args.max_grad_norm > 0:
                    nn.utils.clip_grad_norm_(critic_params, args.max_grad_norm)
                critic_opt.step()
            clipfracs.append(clipfrac.item())
        update_time = time.time() - update_start
        history.carry_over()

        sps = int(global_step / (time.time() - start_time))
        y, y_pred = returns.reshape(-1), values.reshape(-1)
        for tag, v in [("losses/policy_loss", pg_loss.item()), ("losses/value_loss", critic_loss.item()),
                       ("losses/entropy", entropy.mean().item()), ("losses/approx_kl", approx_kl.item()),
                       ("losses/clipfrac", np.mean(clipfracs)), ("charts/SPS", sps),
                       ("losses/explained_variance", np.nan if np.var(y) == 0 else 1 - np.var(y - y_pred) / np.var(y)),
                       ("time/rollout_seconds", rollout_time), ("time/update_seconds", update_time)]:
            writer.add_scalar(tag, v, global_step)
        if iteration < num_iterations:
            print(f"{run_name}: update {iteration}/{num_iterations}, {global_step} steps, "
                  f"{returns_text(recent_returns)}, {sps} steps/s", flush=True)
        if stop.signum:
            break

    envs.close()
    model_path = f"runs/{run_name}/{args.exp_name}.pt"
    if args.save_model:
        save_checkpoint(model_path, actor, critic, {**vars(args), "max_timestep": max_timestep},
                        {"obs_dim": obs_dim, "act_dim": act_dim, "discrete": discrete}, run_name)
    stopped = f"stopped by {signal.Signals(stop.signum).name} after " if stop.signum else ""
    print(f"{run_name}: {stopped}{global_step} of {num_iterations * args.steps_per_epoch} steps, "
          f"{returns_text(recent_returns)}, {int(global_step / (time.time() - start_time))} steps/s; " +
          (f"checkpoint saved to {model_path}" if args.save_model else "no checkpoint (no --save-model)"), flush=True)
    if stop.signum:
        writer.close()
        sys.exit(128 + stop.signum)
    if args.save_model:
        returns = evaluate(actor, args.env_id, args.eval_episodes, EVAL_SEED_OFFSET + args.seed, stop, writer)
        print(f"eval: {returns_text(returns, 'over ')}")
    writer.close()

if __name__ == "__main__":
    main(tyro.cli(Args), cuda_asked="--cuda" in sys.argv[1:])
