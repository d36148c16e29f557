"""PPO-clip on CartPole-v1 (any env with a flat Box observation and Discrete actions), in CleanRL's layout.

Proximal Policy Optimization (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) with CleanRL's `ppo.py`
hyperparameters, as the baseline of "Large Language Model as Policy in RL": its actor is three ReLU layers and a
softmax, the critic a separate tanh MLP. Every finished episode is logged (SAME_STEP autoreset) and a time-limit
truncation bootstraps with V(final observation).

    python ppo_cartpole.py --seed 1 --save-model
    python ppo_cartpole.py --resume runs/<run>
    python ppo_cartpole.py --eval-checkpoint runs/<run>/ppo_cartpole.pt

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
import torch.nn.functional as F
import tyro


@dataclass
class Args:
    exp_name: str = "ppo_cartpole"
    """the name of this experiment (letters, digits, `.`, `_`, `-`; part of the run folder's name)"""
    seed: Annotated[int, "[0, 4294967295]", "eval"] = 1
    """seed of the experiment; with --eval-checkpoint, a value other than 1 replaces the checkpoint's seed"""
    cuda: Annotated[bool, "resume", "eval"] = True
    """use CUDA when torch sees a device (`--no-cuda`: the CPU)"""
    torch_threads: Annotated[int, "[1, 4096]", "resume", "eval"] = 1
    """torch intra-op threads (one suits these tiny networks and lets runs go side by side)"""
    save_model: Annotated[bool, "resume"] = False
    """save a checkpoint into the run folder at the end of training, then evaluate it"""
    eval_checkpoint: Annotated[Optional[str], "path", "eval"] = None
    """path of a checkpoint to evaluate instead of training"""
    eval_episodes: Annotated[int, "[1, 1e12]", "resume", "eval"] = 10
    """number of greedy evaluation episodes (`--eval-checkpoint`, `--save-model`)"""
    track: bool = False
    """log to Weights & Biases as well: the TensorBoard scalars are mirrored (WANDB_MODE=offline: no network)"""
    wandb_project_name: str = "llm-rl"
    """the W&B project (--track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity, a user or team (--track; default: the account's)"""
    capture_video: Annotated[bool, "resume", "eval"] = False
    """record the evaluation episodes (--save-model, --eval-checkpoint) as MP4 files in the run folder's videos/"""
    checkpoint_every: Annotated[int, "[1, 1e12]", "resume"] = 10
    """save the training state (for `--resume`) every this many updates, and when the run ends or is stopped"""
    resume: Annotated[Optional[str], "path", "resume"] = None
    """a run folder to continue, with its own flags, to its original budget (in the same folder and log); a flag
    given at a non-default value must equal the run's, except those that change only how the run computes (threads,
    device, checkpointing, saving, evaluation), which replace the run's"""

    env_id: str = "CartPole-v1"
    """the id of the environment (flat Box observation, Discrete actions)"""
    total_timesteps: Annotated[int, "[1, 1e12]"] = 500000
    """total environment steps, rounded up to whole rollouts (num_envs * num_steps)"""
    learning_rate: Annotated[float, "(0, 1e6]"] = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: Annotated[int, "[1, 4096]"] = 4
    """the number of parallel game environments"""
    num_steps: Annotated[int, "[1, 1e12]"] = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0"""
    gamma: Annotated[float, "[0, 1]"] = 0.99
    """the discount factor gamma"""
    gae_lambda: Annotated[float, "[0, 1]"] = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: Annotated[int, "[1, 1e12]"] = 4
    """the number of minibatches per epoch (must divide num_envs * num_steps)"""
    update_epochs: Annotated[int, "[1, 1e12]"] = 4
    """the number of epochs over the rollout per update"""
    norm_adv: bool = True
    """normalize the advantages within each minibatch"""
    clip_coef: Annotated[float, "(0, 1e6]"] = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss as in the PPO paper's implementation"""
    ent_coef: Annotated[float, "[0, 1e6]"] = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: Annotated[float, "[0, 1e6]"] = 0.5
    """coefficient of the value loss"""
    max_grad_norm: Annotated[float, "(0, 1e6]"] = 0.5
    """the maximum norm of the gradient (clipped in every step)"""
    target_kl: Annotated[Optional[float], "(0, 1e6]"] = None
    """stop the epochs of an update early once the approximate KL exceeds this"""


def make_env(env_id: str):
    return lambda: gym.make(env_id)  # a thunk: the vector env makes each copy


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Critic: CleanRL's separate 2x tanh MLP; actor: three ReLU layers and a softmax (the seed report's section 8)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, n_actions), std=0.01),
        )
        # act's numpy copy of the actor is taken again after anything that can change the weights: a backward pass
        # (which comes before every optimizer step), a load, a move, an in-place edit (a version counter; fused Adam's
        # step leaves those unchanged, hence the backward hook)
        self._numpy_actor, self._actor_params = None, tuple(self.actor.parameters())
        for p in self._actor_params:
            p.register_post_accumulate_grad_hook(self._forget_numpy_actor)
        self.register_load_state_dict_post_hook(self._forget_numpy_actor)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.actor(x), dim=-1)

    def act(self, obs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        """Actions drawn from the policy at a batch of observations (one per row): softmax(actor(obs)) sampled by its
        inverse cumulative distribution at `uniforms` of shape (rows, 1).

        The actor runs in numpy on a copy of its weights: for networks this small, one torch call per env step costs
        more in overhead than the arithmetic. Each weight keeps torch's layout, W of shape (out, in), stored in
        column order so that x @ W.T multiplies row-ordered arrays (the rounding the run's numbers are made with).
        """
        versions = [p._version for p in self._actor_params]
        if self._numpy_actor is None or self._numpy_actor[0] != versions:
            linears = [m for m in self.actor if isinstance(m, nn.Linear)]
            weights = [(m.weight.detach().cpu().numpy(), m.bias.detach().cpu().numpy()) for m in linears]
            self._numpy_actor = versions, [(np.array(W, order="F"), np.array(b)) for W, b in weights]
        x = obs
        for W, b in self._numpy_actor[1][:-1]:
            x = np.maximum(x @ W.T + b, 0.0)
        W, b = self._numpy_actor[1][-1]
        return sample_categorical(x @ W.T + b, uniforms)

    def _forget_numpy_actor(self, *_) -> None:
        self._numpy_actor = None

    def _apply(self, fn, recurse=True):  # .to(device), .cuda(), .double(): the weights move or change
        self._forget_numpy_actor()
        return super()._apply(fn, recurse)


def sample_categorical(logits: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """One draw per row from softmax(logits): the inverse cumulative distribution at uniforms of shape (rows, 1)."""
    cdf = np.cumsum(np.exp(logits - logits.max(-1, keepdims=True)), -1)
    return np.minimum((cdf <= uniforms * cdf[:, -1:]).sum(-1), logits.shape[-1] - 1)


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


def clipped_surrogate_loss(new_logprob, old_logprob, advantages, clip_coef):
    """PPO-clip policy loss mean(max(-A r, -A clip(r, 1-eps, 1+eps))), r = pi_new / pi_old.

    Also returns, for logging, the approximate KL ((r - 1) - log r) and the fraction of clipped ratios.
    """
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    with torch.no_grad():
        return loss, ((ratio - 1) - logratio).mean(), ((ratio - 1.0).abs() > clip_coef).float().mean()


def value_loss(new_values, old_values, returns, clip_coef, clip_vloss):
    """0.5 * squared error; with clip_vloss, the max of the plain and the clipped error."""
    unclipped = (new_values - returns) ** 2
    if not clip_vloss:
        return 0.5 * unclipped.mean()
    clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    return 0.5 * torch.max(unclipped, (clipped - returns) ** 2).mean()


def make_envs(env_id: str, num_envs: int):
    """SAME_STEP autoreset: a done step returns the next episode's first obs, the real last one is in
    info["final_obs"]; the episode statistics log every finished episode."""
    return gym.wrappers.vector.RecordEpisodeStatistics(
        gym.vector.SyncVectorEnv(
            [make_env(env_id) for _ in range(num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
        )
    )


def budget(args: Args) -> tuple[int, int]:
    """(updates, steps per update) of a run: its --total-timesteps in whole rollouts of num_envs * num_steps steps."""
    steps = args.num_envs * args.num_steps
    return -(-args.total_timesteps // steps), steps


def evaluate(objects: dict, env_id: str, args: Args, seed: int, writer, stop, videos: Optional[str] = None) -> list:
    """--eval-episodes greedy episodes of the agent on the CPU, episode i reset with seed + i, logged as
    eval/episodic_return; with `videos` (a folder), each recorded into it as an MP4 file. A stop request ends the
    evaluation after the current episode."""
    agent, returns = objects["agent"].cpu().eval(), []
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
                action = agent.actor(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax(-1)
                obs, reward, terminated, truncated, _ = env.step(int(action[0]))
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
    T, N = args.num_steps, args.num_envs
    batch_size, minibatch_size = N * T, N * T // args.num_minibatches
    num_updates, _ = budget(args)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    envs = make_envs(args.env_id, N)
    obs_dim, n_actions = envs.single_observation_space.shape[0], int(envs.single_action_space.n)
    agent = Agent(obs_dim, n_actions).to(device)
    params = list(agent.parameters())
    optimizer = torch.optim.Adam(params, lr=args.learning_rate, eps=1e-5, fused=True)
    action_rng = np.random.default_rng(args.seed)  # the policy's sampling noise

    obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)
    next_obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # the state reached after each step
    actions_buf = np.zeros((T, N), dtype=np.int64)
    rewards_buf = np.zeros((T, N), dtype=np.float32)
    terminations_buf = np.zeros((T, N), dtype=np.float32)
    dones_buf = np.zeros((T, N), dtype=np.float32)
    next_obs = envs.reset(seed=args.seed)[0].astype(np.float32)
    # the run folder and its log; a resumed run puts its weights, optimizer, random streams and envs back in place
    first_update, global_step = run.start(
        agent=agent, optimizer=optimizer, action_rng=action_rng, envs=envs, next_obs=next_obs
    )
    writer, first_step, start_time = run.writer, global_step, time.time()
    for update in range(first_update + 1, num_updates + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (update - 1.0) / num_updates) * args.learning_rate
        rollout_start = time.time()
        uniforms = action_rng.random((T, N, 1))  # the rollout's sampling noise, drawn at once
        for step in range(T):
            global_step += N
            obs_buf[step] = next_obs
            actions_buf[step] = action = agent.act(next_obs, uniforms[step])
            next_obs, reward, terminations, truncations, infos = envs.step(action)
            next_obs_buf[step] = next_obs = next_obs.astype(np.float32)
            dones = np.logical_or(terminations, truncations)
            rewards_buf[step], terminations_buf[step], dones_buf[step] = reward, terminations, dones
            for i in np.flatnonzero(dones):
                next_obs_buf[step, i] = infos["final_obs"][i]  # the real last observation, for the bootstrap
                writer.add_scalar("charts/episodic_return", infos["episode"]["r"][i], global_step)
                writer.add_scalar("charts/episodic_length", infos["episode"]["l"][i], global_step)

        with torch.inference_mode():  # values and behaviour log-probabilities of the whole rollout in one pass
            rollout_obs = torch.from_numpy(obs_buf).to(device)
            rollout_actions = torch.from_numpy(actions_buf).to(device)
            values = agent.get_value(rollout_obs)
            next_values = agent.get_value(torch.from_numpy(next_obs_buf).to(device))
            logprobs = agent.log_probs(rollout_obs).gather(-1, rollout_actions.unsqueeze(-1)).squeeze(-1)
        advantages, returns = compute_gae(
            rewards_buf,
            values.cpu().numpy(),
            next_values.cpu().numpy(),
            terminations_buf,
            dones_buf,
            args.gamma,
            args.gae_lambda,
        )
        rollout_time, update_start = time.time() - rollout_start, time.time()

        # flatten the batch (clones out of inference mode, so that autograd may use them)
        b_obs = rollout_obs.reshape(-1, obs_dim).clone()
        b_actions = rollout_actions.reshape(-1).clone()
        b_logprobs = logprobs.reshape(-1).clone()
        b_values = values.reshape(-1).clone()
        b_advantages = torch.from_numpy(advantages.reshape(-1)).to(device)
        b_returns = torch.from_numpy(returns.reshape(-1)).to(device)

        b_inds, clipfracs = np.arange(batch_size), []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = torch.from_numpy(b_inds[start : start + minibatch_size])
                mb_obs = b_obs[mb_inds]
                all_logp = agent.log_probs(mb_obs)
                newlogprob = all_logp.gather(-1, b_actions[mb_inds].unsqueeze(-1)).squeeze(-1)
                entropy = -(all_logp.exp() * all_logp).sum(-1)
                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss, approx_kl, clipfrac = clipped_surrogate_loss(
                    newlogprob, b_logprobs[mb_inds], mb_advantages, args.clip_coef
                )
                clipfracs.append(clipfrac.item())
                newvalue = agent.get_value(mb_obs)
                v_loss = value_loss(newvalue, b_values[mb_inds], b_returns[mb_inds], args.clip_coef, args.clip_vloss)
                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        y_pred, y_true = b_values.cpu().numpy(), returns.ravel()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
        writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        writer.add_scalar("losses/explained_variance", explained_var, global_step)
        writer.add_scalar("charts/SPS", int((global_step - first_step) / (time.time() - start_time)), global_step)
        writer.add_scalar("time/rollout_seconds", rollout_time, global_step)
        writer.add_scalar("time/update_seconds", time.time() - update_start, global_step)
        if run.end_update(update, global_step, next_obs=next_obs):  # logs flushed, the state saved when due
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

OWN_KINDS = {}  # what this script alone saves: a kind's name -> (its saved form, how it is put back)
MODEL = ("agent",)  # what a --save-model checkpoint holds


def check_this_script(args: Args) -> None:
    """UserError for minibatches that do not fit the rollout or an env this script cannot take."""
    rollout = args.num_envs * args.num_steps
    if rollout % args.num_minibatches or args.norm_adv and rollout // args.num_minibatches < 2:
        raise UserError(
            f"--num-minibatches {args.num_minibatches} must divide the rollout of {rollout} samples (into minibatches "
            f"of 2 or more with --norm-adv: one advantage's std is nan)"
        )
    model_objects(args)


def model_objects(args: Args) -> dict:
    """The agent for the env of `args` (UserError for an env this script cannot take)."""
    try:
        env = gym.make(args.env_id)
    except Exception as e:  # gymnasium raises several kinds (an unknown id, a missing package)
        raise UserError(f"cannot make env '{args.env_id}': {brief(e)}")
    obs, act = env.observation_space, env.action_space
    env.close()
    if not isinstance(act, gym.spaces.Discrete) or not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise UserError(f"{SCRIPT} needs a flat Box observation and Discrete actions; '{args.env_id}' has {obs}, {act}")
    return {"agent": Agent(obs.shape[0], int(act.n))}


def shown_returns(objects: dict):
    return objects["envs"].return_queue


if __name__ == "__main__":
    sys.exit(cli())
