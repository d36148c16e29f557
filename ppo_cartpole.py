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

import fcntl
import random
import re
import stat
import time
import types
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Optional, Union, get_args, get_origin

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
    seed: int = 1
    """seed of the experiment; with --eval-checkpoint, a value other than 1 replaces the checkpoint's seed"""
    cuda: bool = True
    """use CUDA when torch sees a device (`--no-cuda`: the CPU)"""
    torch_threads: int = 1
    """torch intra-op threads (one suits these tiny networks and lets runs go side by side)"""
    save_model: bool = False
    """save a checkpoint into the run folder at the end of training, then evaluate it"""
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint to evaluate instead of training"""
    eval_episodes: int = 10
    """number of greedy evaluation episodes (`--eval-checkpoint`, `--save-model`)"""
    track: bool = False
    """log to Weights & Biases as well: the TensorBoard scalars are mirrored (WANDB_MODE=offline: no network)"""
    wandb_project_name: str = "llm-rl"
    """the W&B project (--track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity, a user or team (--track; default: the account's)"""
    capture_video: bool = False
    """record the evaluation episodes (--save-model, --eval-checkpoint) as MP4 files in the run folder's videos/"""
    checkpoint_every: int = 10
    """save the training state (for `--resume`) every this many updates, and when the run ends or is stopped"""
    resume: Optional[str] = None
    """a run folder to continue, with its own flags, to its original budget (in the same folder and log); a flag
    given at a non-default value must equal the run's, except those that change only how the run computes (threads,
    device, checkpointing, saving, evaluation), which replace the run's"""

    env_id: str = "CartPole-v1"
    """the id of the environment (flat Box observation, Discrete actions)"""
    total_timesteps: int = 500000
    """total environment steps, rounded up to whole rollouts (num_envs * num_steps)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: int = 4
    """the number of minibatches per epoch (must divide num_envs * num_steps)"""
    update_epochs: int = 4
    """the number of epochs over the rollout per update"""
    norm_adv: bool = True
    """normalize the advantages within each minibatch"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss as in the PPO paper's implementation"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm of the gradient (clipped in every step)"""
    target_kl: Optional[float] = None
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


def budget_in_updates(args: Args) -> int:
    """The updates of a run: its budget in whole rollouts (num_envs * num_steps), rounded up."""
    return -(-args.total_timesteps // (args.num_envs * args.num_steps))


def main(args: Args, stop: Optional["StopSignal"] = None) -> int:
    """Train (or, with --eval-checkpoint, evaluate); returns the exit status: 0, or 128 + the signal that stopped it."""
    stop = StopSignal() if stop is None else stop
    check_args(args)
    if args.eval_checkpoint is not None:
        torch.set_num_threads(args.torch_threads)
        return evaluate_checkpoint(args, stop)
    run = Run(args, stop)  # with --resume: the run's own flags, read from its training state
    args = run.args
    torch.set_num_threads(args.torch_threads)
    T, N = args.num_steps, args.num_envs
    batch_size, minibatch_size = N * T, N * T // args.num_minibatches
    num_updates = budget_in_updates(args)
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
    begin = run.start(agent=agent, optimizer=optimizer, action_rng=action_rng, envs=envs, next_obs=next_obs)
    global_step, next_obs, writer = begin.global_step, begin.next_obs, run.writer
    first_step, start_time = global_step, time.time()
    for update in range(begin.update + 1, num_updates + 1):
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


# ---- Run machinery: what a run needs around the algorithm (checks, signals, checkpoints, the run object that owns
# the run folder, its log and the training state that --resume continues from, the evaluation-only mode, the command
# line). The algorithm is complete above this line.


class UserError(Exception):
    """A mistake the user can fix (a flag, a file, an env, the disk): one sentence, exit 2 at the entry point."""


RANGES = {  # every numeric flag: (low, high, low excluded); nan and inf are outside every range
    "seed": (0, 2**32 - 1, False),
    "torch_threads": (1, 1024, False),
    "eval_episodes": (1, 10**6, False),
    "checkpoint_every": (1, 10**9, False),
    "total_timesteps": (1, 10**12, False),
    "learning_rate": (0, 1, True),
    "num_envs": (1, 1024, False),
    "num_steps": (1, 10**7, False),
    "gamma": (0, 1, False),
    "gae_lambda": (0, 1, False),
    "num_minibatches": (1, 10**7, False),
    "update_epochs": (1, 10**4, False),
    "clip_coef": (0, 10, True),
    "ent_coef": (0, 100, False),
    "vf_coef": (0, 100, False),
    "max_grad_norm": (0, 1e6, True),
    "target_kl": (0, 1e6, True),
}
CHOICES = {f.name: get_args(f.type) for f in fields(Args) if get_origin(f.type) is Literal}
# all that --eval-checkpoint takes
EVAL_FLAGS = {"eval_checkpoint", "eval_episodes", "seed", "cuda", "torch_threads", "capture_video"}
# the flags a resumed run may change: they change only how the run computes (threads, device, checkpointing, saving,
# evaluation), not what it trains
RESUME_FLAGS = {"resume", "checkpoint_every", "cuda", "torch_threads", "save_model", "eval_episodes", "capture_video"}
PLAIN_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,200}")  # a folder name: no separators, not . or ..


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_values(args: Args) -> None:
    """UserError for the first flag out of its range, its choices or its form (what a flag alone can get wrong)."""
    for name, (low, high, low_excluded) in RANGES.items():
        value = getattr(args, name)
        if value is not None and not (low < value <= high if low_excluded else low <= value <= high):
            raise UserError(f"{flag(name)} must be in {'(' if low_excluded else '['}{low}, {high}], got {value}")
    for name, choices in CHOICES.items():
        if getattr(args, name) not in choices:
            raise UserError(f"{flag(name)} must be one of {', '.join(map(str, choices))}, got {getattr(args, name)}")
    rollout = args.num_envs * args.num_steps
    if rollout % args.num_minibatches:
        raise UserError(f"--num-minibatches {args.num_minibatches} must divide the rollout of {rollout} samples")
    if args.norm_adv and rollout // args.num_minibatches < 2:  # one advantage's std is nan, and so every weight
        raise UserError(
            f"--norm-adv needs minibatches of 2 samples or more, but {args.num_minibatches} minibatches of a rollout "
            f"of {rollout} samples hold {rollout // args.num_minibatches} each; use fewer minibatches or --no-norm-adv"
        )
    if not PLAIN_NAME.fullmatch(args.exp_name):
        raise UserError(
            f"--exp-name must be a plain name of up to 200 letters, digits, '.', '_' or '-', got {args.exp_name!r}"
        )
    if args.exp_name == "training_state":  # the --save-model file, {exp_name}.pt, would overwrite it
        raise UserError("--exp-name training_state is the name of the run's training state; choose another")


def check_args(args: Args) -> None:
    """The one check before anything is made: UserError for the first bad flag, or an env that does not fit this
    script, or rollout buffers that do not fit in memory."""
    check_values(args)
    given = [flag(f.name) for f in fields(Args) if getattr(args, f.name) != f.default and f.name not in EVAL_FLAGS]
    if args.eval_checkpoint is not None:
        if given:
            raise UserError(
                f"--eval-checkpoint evaluates a saved model and takes no training flags, got {' '.join(given)}"
            )
        return  # the env and its sizes are the checkpoint's (its renderer: evaluate_checkpoint checks it)
    obs_space, _ = env_spaces(args.env_id)
    check_memory(args, obs_space)
    if args.track:
        check_wandb()
    if args.capture_video:
        check_renderer(args.env_id)


def check_wandb() -> None:
    """UserError unless `wandb` imports and has a way to log in (never a prompt: there may be no one to answer it)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("--track needs the wandb package (pip install wandb)")
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc().authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise UserError(
        f"--track needs a way to log in to Weights & Biases: WANDB_API_KEY, `wandb login` (a {host} entry in "
        f"~/.netrc), or WANDB_MODE=offline"
    )


def check_renderer(env_id: str) -> None:
    """UserError unless the env renders a frame (--capture-video): made with render_mode="rgb_array", reset, one
    frame. MuJoCo without a display renders through OSMesa."""
    entry_point = str(getattr(gym.spec(env_id), "entry_point", ""))
    if "mujoco" in entry_point and not os.environ.get("DISPLAY") and not os.environ.get("MUJOCO_GL"):
        os.environ.setdefault("MUJOCO_GL", "osmesa")
        os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):  # pygame draws into arrays alone
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    try:
        env = gym.make(env_id, render_mode="rgb_array")
        try:
            env.reset(seed=0)
            frame = env.render()
        finally:
            env.close()
        if not isinstance(frame, np.ndarray) or frame.ndim != 3:
            raise RuntimeError(f"it gave {type(frame).__name__}, not an image")
    except Exception as e:
        why = (str(e).splitlines() or [type(e).__name__])[0].rstrip(".")
        hint = (
            "set MUJOCO_GL=osmesa and install OSMesa (Debian: apt-get install libosmesa6)"
            if "mujoco" in entry_point
            else "install pygame (pip install pygame)"
        )
        raise UserError(f"--capture-video cannot render {env_id} ({why}); {hint}")


def check_writable(folder: str, what: str) -> None:
    """UserError unless a small file can be made, written to disk and removed in `folder` (made when missing)."""
    probe = os.path.join(folder, f".write-test.tmp{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        if os.path.lexists(probe):
            os.remove(probe)
        raise UserError(f"cannot write into {what} {folder} ({e.strerror or e})")


def env_spaces(env_id: str) -> tuple[gym.Space, gym.Space]:
    """(observation space, action space) of an env that fits this script; UserError otherwise."""
    try:
        env = gym.make(env_id)
    except Exception as e:
        raise UserError(f"cannot make env '{env_id}': {(str(e).splitlines() or [type(e).__name__])[0].rstrip('.?!')}")
    obs, act = env.observation_space, env.action_space
    env.close()
    if not isinstance(act, gym.spaces.Discrete) or not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise UserError(
            f"ppo_cartpole.py needs a flat Box observation and Discrete actions, but '{env_id}' has {obs} and {act}"
        )
    return obs, act


def check_memory(args: Args, obs_space: gym.Space) -> None:
    """UserError when the rollout buffers would need over half of this machine's memory."""
    samples = args.num_steps * args.num_envs
    need = 4 * samples * (4 * int(obs_space.shape[0]) + 16)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have / 2:
        raise UserError(
            f"a rollout of {samples} samples needs about {need / 2**30:.1f} GiB, over half of this machine's memory"
        )


def fits(value, hint) -> bool:
    """Whether `value` is of the type `hint`: int excludes bool, float accepts int (not bool), Optional and unions any
    of theirs, list/tuple/dict element by element, Any everything."""
    origin, parts = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(fits(value, h) for h in parts)
    if origin is Literal:
        return any(type(value) is type(p) and value == p for p in parts)
    if hint is float:
        return type(value) in (float, int)
    if hint in (int, bool, str):
        return type(value) is hint
    if origin is dict:
        return isinstance(value, dict) and all(fits(k, parts[0]) and fits(v, parts[1]) for k, v in value.items())
    if origin is list:
        return isinstance(value, list) and all(fits(v, parts[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(parts) == 2 and parts[1] is Ellipsis:
            return all(fits(v, parts[0]) for v in value)
        return len(value) == len(parts) and all(fits(v, h) for v, h in zip(value, parts))
    return isinstance(value, origin or hint)


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


def save_checkpoint(path: str, obj: dict) -> None:
    """Write to a temporary file in the same folder, then rename: a failed save leaves the previous file or none."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
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
    except OSError:
        raise UserError(f"cannot read the checkpoint '{path}' (it does not exist)")
    try:  # a link that leads nowhere or loops, a file that may not be read: why, in the system's words
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):  # not a folder, a FIFO or a device: opening a FIFO would wait forever
            os.close(os.open(path, os.O_RDONLY))
    except OSError as e:
        raise UserError(f"cannot read the checkpoint '{path}' ({e.strerror or e})")
    if not stat.S_ISREG(mode):
        raise UserError(f"cannot read the checkpoint '{path}' (not a regular file)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        raise UserError(f"cannot read the checkpoint '{path}' (not a torch file)")
    if not isinstance(checkpoint, dict):
        raise UserError(f"'{path}' is not a ppo_cartpole.py checkpoint")
    return checkpoint


CHECKPOINT = {"model": dict[str, torch.Tensor], "args": dict[str, Any], "run_name": str}  # a --save-model file
CHECKPOINT_ARGS = {"env_id": str, "seed": int}  # the flags of its run that the evaluation reads


def agent_from_checkpoint(path: str) -> tuple[Agent, dict, str]:
    """(agent, training args, run name) of a --save-model checkpoint, checked key by key and against its env."""
    checkpoint = load_checkpoint(path)
    train = checkpoint.get("args")
    if not (
        all(fits(checkpoint.get(key), hint) for key, hint in CHECKPOINT.items())
        and all(fits(train.get(key), hint) for key, hint in CHECKPOINT_ARGS.items())
        and PLAIN_NAME.fullmatch(checkpoint["run_name"])
    ):
        raise UserError(
            f"'{path}' is not a ppo_cartpole.py checkpoint (model, args.env_id, args.seed or run_name is "
            f"missing, mistyped or not a plain name)"
        )
    obs_space, act_space = env_spaces(train["env_id"])
    agent = Agent(int(obs_space.shape[0]), int(act_space.n))
    want = {k: v.shape for k, v in agent.state_dict().items()}
    got = {k: v.shape for k, v in checkpoint["model"].items() if v.dtype == torch.float32 and bool(v.isfinite().all())}
    if got != want:
        raise UserError(
            f"'{path}' holds no network of this script's shapes for {train['env_id']} (finite float32 weights)"
        )
    agent.load_state_dict(checkpoint["model"])
    return agent, train, checkpoint["run_name"]


def evaluate(
    agent: Agent, env_id: str, episodes: int, seed: int, writer, stop: "StopSignal", videos: Optional[str] = None
) -> list[float]:
    """Greedy episodes on the CPU, episode i reset with seed + i, logged as eval/episodic_return; with `videos` (a
    folder), each episode recorded as an MP4 file in it (eval-episode-{i}.mp4).

    A stop request ends the evaluation after the current episode.
    """
    env, returns = gym.make(env_id, render_mode=None if videos is None else "rgb_array"), []
    if videos is not None:
        env = gym.wrappers.RecordVideo(env, video_folder=videos, episode_trigger=lambda e: True, name_prefix="eval")
    with torch.inference_mode():
        for ep in range(episodes):
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
    print(
        f"eval: {mean:.2f} +- {std:.2f} over {len(returns)} of {episodes} episodes (env {env_id}, seeds from {seed})"
        + ("" if videos is None else f"; videos in {videos}"),
        flush=True,
    )
    return returns


def evaluate_checkpoint(args: Args, stop: StopSignal) -> int:
    """The evaluation-only mode: greedy episodes of a saved agent, seeded as the evaluation after its training."""
    from torch.utils.tensorboard import SummaryWriter

    agent, train, run = agent_from_checkpoint(args.eval_checkpoint)
    if args.capture_video:
        check_renderer(train["env_id"])
    seed = 10_000 + (args.seed if args.seed != 1 else train["seed"])  # a --seed given replaces the run's
    run_dir = os.path.join("runs", make_run_dir(f"{run}-eval__{seed}"))
    print(f"device: cpu (evaluation), logging to {run_dir}", flush=True)
    videos = os.path.join(run_dir, "videos") if args.capture_video else None
    with SummaryWriter(run_dir) as writer:
        evaluate(agent, train["env_id"], args.eval_episodes, seed, writer, stop, videos)
    return stop.exit_status


class Run:
    """A training run around the loop of `main`: its folder, the TensorBoard writer, the stop signals, the progress
    line, the training state (saved every --checkpoint-every updates, at the last update and at a stop) and --resume.

    `main` meets it three times: `start` before the loop (a new run gets its folder; a resumed one puts its training
    state back into the objects it is given), `end_update` after each update, `finish` after the loop.
    """

    def __init__(self, args: Args, stop: StopSignal):
        """Nothing is written. With --resume, `run.args` are the run's own flags, read from its training state."""
        self.stop, self.state, self.writer = stop, None, None
        if args.resume is not None:
            args, self.state = load_training_state(args)
        self.args, self.num_updates = args, budget_in_updates(args)
        self.run_dir = args.resume

    @property
    def state_path(self) -> str:
        return os.path.join(self.run_dir, "training_state.pt")

    @property
    def videos(self) -> str:
        return os.path.join(self.run_dir, "videos")

    def start(self, **objects) -> types.SimpleNamespace:
        """Before the loop, given what a training state holds: the objects restored in place (networks, optimizers,
        random generators, vector envs) and the loop's arrays (such as the current observation).

        A new run gets its folder, locked, and its writer, with the hyperparameters logged. A resumed run gets its
        training state checked against the objects (before anything is written), put back into them, its folder
        locked and checked writable, the temporary files of a killed save removed, and its log continued. Returns
        the counters the loop starts from (update, global_step) and the loop's arrays."""
        args, state = self.args, self.state
        self.objects = {name: obj for name, obj in objects.items() if not isinstance(obj, np.ndarray)}
        values = {name: obj for name, obj in objects.items() if isinstance(obj, np.ndarray)}
        if state is None:
            update, global_step = 0, 0
            base = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}"
            self.run_dir = os.path.join("runs", make_run_dir(base))
            self.lock = lock_run_dir(self.run_dir)
        else:
            validate_training_state(self.state_path, state, args, objects)
            update, global_step, values = restore_training_state(state, self.objects, values, args)
            if args.capture_video and os.path.lexists(self.videos):  # what a resumed run's evaluation writes into
                check_writable(self.videos, "the videos folder")
            self.lock = lock_run_dir(self.run_dir)
            self.stop.last_state = f"the last training state is {self.state_path} (update {update})"
        self.run_name = os.path.basename(os.path.abspath(self.run_dir))
        devices = {str(p.device) for obj in objects.values() if isinstance(obj, nn.Module) for p in obj.parameters()}
        print(f"device: {', '.join(sorted(devices))}, logging to {self.run_dir}", flush=True)
        # imported here, not at the top: tensorboard is slow to import, and neither importing this file nor a refused
        # run should wait for it
        from torch.utils.tensorboard import SummaryWriter

        if state is not None:  # TensorBoard reads a run's event files in name order, which begins with their second
            wait_for_a_new_second(self.run_dir)
        self.wandb_id = None if state is None else state["wandb_id"]
        if args.track:  # before the writer: W&B mirrors what it logs; a resumed run continues its W&B run
            import wandb
            from wandb.sdk.lib.runid import generate_id

            self.wandb_id = self.wandb_id or generate_id()
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
        # a resumed run hides what was logged after its last training state, so no step appears twice
        self.writer = SummaryWriter(self.run_dir, purge_step=None if state is None else global_step + 1)
        if state is None:
            table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.update, self.global_step, self.first_step = update, global_step, global_step
        self.start_time = self.last_line = time.time()
        return types.SimpleNamespace(update=update, global_step=global_step, **values)

    def end_update(self, update: int, global_step: int, **loop_state) -> bool:
        """After an update, given the loop's arrays: the log flushed and the training state saved when due (every
        --checkpoint-every updates, at the last update, at a stop), the progress line; True when the run should
        stop."""
        stopping = self.stop.requested  # read once: a signal after this line stops the run at the next update
        self.update, self.global_step = update, global_step
        if stopping or update % self.args.checkpoint_every == 0 or update == self.num_updates:
            self.writer.flush()  # the logged events of the updates the state holds are on disk before it
            state = training_state(self.args, update, global_step, {**self.objects, **loop_state}, self.wandb_id)
            save_checkpoint(self.state_path, state)
            self.stop.last_state = f"the last training state is {self.state_path} (update {update})"
        due = update % max(1, self.num_updates // 10) == 0 or time.time() - self.last_line >= 60
        if due and not stopping and update < self.num_updates:
            self.last_line = time.time()
            print(
                f"{self.run_name}: update {update}/{self.num_updates}, {global_step} steps, {self.steps_per_second()} "
                f"steps/s, {returns_text(self.objects['envs'].return_queue)}",
                flush=True,
            )
        return stopping

    def steps_per_second(self) -> int:
        return int((self.global_step - self.first_step) / max(time.time() - self.start_time, 1e-9))

    def finish(self) -> int:
        """After the loop: the envs closed, the --save-model checkpoint of the agent, the final line, the evaluation
        (with --save-model, unless stopped), the writer closed. Returns the exit status."""
        args, envs, agent = self.args, self.objects["envs"], self.objects["agent"]
        envs.close()
        self.writer.flush()
        model_path = os.path.join(self.run_dir, f"{args.exp_name}.pt")
        if args.save_model:
            save_checkpoint(model_path, {"model": agent.state_dict(), "args": asdict(args), "run_name": self.run_name})
        saved = f"checkpoint saved to {model_path}" if args.save_model else "no checkpoint (no --save-model)"
        budget = self.num_updates * args.num_envs * args.num_steps
        print(
            f"{self.run_name}: {self.global_step} of {budget} steps, {returns_text(envs.return_queue)}, "
            f"{self.steps_per_second()} steps/s; {saved}"
            + (f"; interrupted (continue it: --resume {self.run_dir})" if self.update < self.num_updates else ""),
            flush=True,
        )
        if args.save_model and not self.stop.requested:
            videos = self.videos if args.capture_video else None
            seed = 10_000 + args.seed
            evaluate(agent.cpu().eval(), args.env_id, args.eval_episodes, seed, self.writer, self.stop, videos)
        self.writer.close()
        if args.track:
            import wandb

            if args.save_model and args.capture_video and os.path.isdir(self.videos):
                for name in sorted(os.listdir(self.videos)):
                    wandb.log({"videos/eval": wandb.Video(os.path.join(self.videos, name), format="mp4")})
            wandb.finish()
            wandb.tensorboard.unpatch()
        os.close(self.lock)  # the folder is free for another process
        return self.stop.exit_status


def training_state(args: Args, update: int, global_step: int, objects: dict, wandb_id: Optional[str] = None) -> dict:
    """Everything a run needs to continue exactly: its flags, counters, the global random streams and the saved form
    of each object the loop carries (weights, optimizer, random generators, envs, arrays)."""
    _, keys, *rest = np.random.get_state()
    return {
        "script": "ppo_cartpole.py",
        "args": asdict(args),
        "update": update,
        "global_step": global_step,
        "wandb_id": wandb_id,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": [torch.from_numpy(keys.copy()), *rest],
        "objects": {name: saved_form(obj) for name, obj in objects.items()},
    }


def saved_form(obj):
    """What a training state keeps of an object: a state dict, a generator's state, an env state, a tensor."""
    if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        return obj.state_dict()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    if isinstance(obj, gym.vector.VectorEnv):
        return env_state(obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    raise TypeError(f"a training state cannot hold a {type(obj).__name__}")


def restore_training_state(state: dict, objects: dict, values: dict, args: Args) -> tuple[int, int, dict]:
    """Put a training state (checked by validate_training_state) back into freshly made objects; (updates done, steps
    done, the loop's arrays).

    Envs whose state was not saved (Box2D's LunarLander, MuJoCo) start new episodes, seeded by the run's seed and the
    update: the episodes in progress are cut off, unlogged."""
    saved, update = state["objects"], state["update"]
    for name, obj in objects.items():
        if isinstance(obj, gym.vector.VectorEnv):
            if saved[name] is not None:
                restore_env_state(obj, saved[name])
        elif isinstance(obj, np.random.Generator):
            obj.bit_generator.state = saved[name]
        else:
            obj.load_state_dict(saved[name])
    torch.set_rng_state(state["torch_rng"])
    keys, *rest = state["numpy_rng"]
    np.random.set_state(("MT19937", keys.numpy(), *rest))
    values = {name: saved[name].numpy() for name in values}
    if saved["envs"] is None:  # new episodes, the same in every resume of this state
        envs = objects["envs"]
        values["next_obs"] = envs.reset(seed=args.seed + envs.num_envs * update)[0].astype(np.float32)
    return update, state["global_step"], values


TRAINING_STATE = {  # the keys of a training state and their types
    "script": str,
    "args": dict[str, Any],
    "update": int,
    "global_step": int,
    "wandb_id": Optional[str],
    "torch_rng": torch.Tensor,
    "numpy_rng": list,
    "objects": dict[str, Any],
}


def validate_training_state(path: str, state: dict, args: Args, objects: dict) -> None:
    """UserError "'{path}' is a damaged training state (why)" unless `state` fits the run's flags `args` and the freshly
    made `objects` (those `Run.start` is given) in every key, type, shape and range. Reads only: nothing is written."""
    why = training_state_problem(state, args, objects)
    if why is not None:
        raise UserError(f"'{path}' is a damaged training state ({why})")


def training_state_problem(state: dict, args: Args, objects: dict) -> Optional[str]:
    """What is wrong with a training state for these flags and objects, or None."""
    for key, hint in TRAINING_STATE.items():
        if key not in state:
            return f"no {key}"
        if not fits(state[key], hint):
            return f"its {key} is {short(state[key])}, not of type {getattr(hint, '__name__', hint)}"
    if set(state) != set(TRAINING_STATE):
        return f"unknown keys {', '.join(sorted(map(str, set(state) - set(TRAINING_STATE))))}"
    update, steps = state["update"], state["global_step"]
    per_update, budget = args.num_envs * args.num_steps, budget_in_updates(args)
    if update < 0 or steps < 0:
        return f"negative counters: update {update}, global_step {steps}"
    if steps != update * per_update:
        return f"global_step {steps} is not update {update} times the {per_update} steps of an update"
    if update > budget:
        return f"update {update} is past the run's budget of {budget} updates"
    fresh = training_state(args, 0, 0, objects)
    for key in ("torch_rng", "numpy_rng"):
        why = differs(state[key], fresh[key], key)
        if why is not None:
            return why
    if not 0 <= state["numpy_rng"][1] <= 624:
        return f"numpy_rng's position {state['numpy_rng'][1]} is outside [0, 624]"
    saved = state["objects"]
    if set(saved) != set(objects):
        return f"objects {', '.join(sorted(map(str, saved)))} where the run has {', '.join(sorted(objects))}"
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            why = optimizer_state_problem(saved[name], obj, name)
        elif isinstance(obj, gym.vector.VectorEnv):
            why = env_state_problem(saved[name], fresh["objects"][name], env_layers(obj), name)
        else:  # weights, a random generator's state, an array: the structure of the fresh object's, finite
            why = differs(saved[name], fresh["objects"][name], name)
            if why is None and isinstance(obj, np.random.Generator):
                try:  # the generator's own check of its numbers, on a scratch generator
                    np.random.default_rng().bit_generator.state = saved[name]
                except (ValueError, TypeError, OverflowError):
                    why = f"{name} is not a state of its random generator"
        if why is not None:
            return why
    return None


def short(value) -> str:
    text = repr(value) if isinstance(value, (bool, int, float, str, type(None))) else f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def differs(saved, fresh, where: str, nonnegative: bool = False) -> Optional[str]:
    """Where `saved` differs from `fresh` in structure (dict keys, list lengths, types, tensor shapes and dtypes), or
    holds a number that is not finite (or, with `nonnegative`, below 0); None when it does not."""
    if isinstance(fresh, dict):
        if not isinstance(saved, dict):
            return f"{where} is {short(saved)}, not a dict"
        if set(saved) != set(fresh):
            extra, missing = set(saved) - set(fresh), set(fresh) - set(saved)
            return f"{where} has no {sorted(map(str, missing))[0]}" if missing else f"{where} has {sorted(extra)[0]}"
        for key in fresh:
            why = differs(saved[key], fresh[key], f"{where}.{key}", nonnegative)
            if why is not None:
                return why
        return None
    if isinstance(fresh, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(fresh):
            return f"{where} is {short(saved)}, not a list of {len(fresh)}"
        for i, (s, f) in enumerate(zip(saved, fresh)):
            why = differs(s, f, f"{where}[{i}]", nonnegative)
            if why is not None:
                return why
        return None
    if torch.is_tensor(fresh):
        if not torch.is_tensor(saved) or saved.dtype != fresh.dtype or saved.shape != fresh.shape:
            what = f"a {saved.dtype} tensor of shape {tuple(saved.shape)}" if torch.is_tensor(saved) else short(saved)
            return f"{where} is {what}, not a {fresh.dtype} tensor of shape {tuple(fresh.shape)}"
        return number_problem(saved, where, nonnegative)
    if not fits(saved, type(fresh)) or type(saved) is not type(fresh) and type(fresh) is not float:
        return f"{where} is {short(saved)}, not of type {type(fresh).__name__}"
    if type(fresh) is str and saved != fresh:
        return f"{where} is {short(saved)}, not {short(fresh)}"
    return number_problem(saved, where, nonnegative)


def number_problem(value, where: str, nonnegative: bool) -> Optional[str]:
    """Not finite, or below 0 where it must not be: what is wrong with a number or tensor; None otherwise."""
    if torch.is_tensor(value) and (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
        if not bool(value.isfinite().all()):
            return f"{where} holds a value that is not finite"
        if nonnegative and value.numel() and bool((value < 0).any()):
            return f"{where} holds a negative value"
    elif type(value) in (int, float):
        if type(value) is float and not np.isfinite(value):
            return f"{where} is {value}, not finite"
        if nonnegative and value < 0:
            return f"{where} is {value}, below 0"
    return None


def optimizer_state_problem(saved, optimizer: torch.optim.Optimizer, where: str) -> Optional[str]:
    """An optimizer's state dict against the optimizer made for the run: its groups as the fresh one's, and per
    parameter its moments of the parameter's shape, finite (second moments and step counts not negative)."""
    fresh = optimizer.state_dict()
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        return f"{where} is not an optimizer's state"
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(fresh["param_groups"]):
        return f"{where} has {short(groups)} as its parameter groups"
    for i, (group, fresh_group) in enumerate(zip(groups, fresh["param_groups"])):
        why = differs(group, fresh_group, f"{where}.param_groups[{i}]", nonnegative=True)
        if why is None and group["params"] != fresh_group["params"]:
            why = f"{where}.param_groups[{i}] holds other parameters"
        if why is not None:
            return why
    shapes = [p.shape for group in optimizer.param_groups for p in group["params"]]
    if not isinstance(saved["state"], dict) or not set(saved["state"]) <= set(range(len(shapes))):
        return f"{where}.state is not a state per parameter of the {len(shapes)}"
    for index, moments in saved["state"].items():
        if not isinstance(moments, dict) or not all(torch.is_tensor(m) for m in moments.values()):
            return f"{where}.state[{index}] is not a dict of tensors"
        for name, value in moments.items():
            if value.ndim and value.shape != shapes[index]:
                return f"{where}.state[{index}].{name} has shape {tuple(value.shape)}, not {tuple(shapes[index])}"
            why = number_problem(value, f"{where}.state[{index}].{name}", nonnegative=name in ("exp_avg_sq", "step"))
            if why is not None:
                return why
    return None


def env_state_problem(saved, fresh, layers: list, where: str) -> Optional[str]:
    """An env state (env_state's form) against the fresh envs': the same layers and keys, each value of the same kind
    and shape, numbers finite and counters not negative, episode queues no longer than theirs."""
    if fresh is None or saved is None:
        return None if saved is fresh else f"{where} is {short(saved)}, where the envs' state is {short(fresh)}"
    if not isinstance(saved, list) or len(saved) != len(fresh):
        return f"{where} has {len(saved) if isinstance(saved, list) else short(saved)} env layers, not {len(fresh)}"
    for i, (plain, fresh_plain, layer) in enumerate(zip(saved, fresh, layers)):
        if not isinstance(plain, dict):
            return f"{where}[{i}] is {short(plain)}, not a dict"
        for key in set(plain) | set(fresh_plain):
            value, fresh_value, at = plain.get(key), fresh_plain.get(key), f"{where}[{i}].{key}"
            if fresh_value is None:  # an attribute set later in an episode: a plain value or none
                if not (value is None or type(value) in (bool, int, float, str)):
                    return f"{at} is {short(value)}, not a plain value"
                continue
            if isinstance(fresh_value, dict) and "deque" in fresh_value:
                ok = isinstance(value, dict) and set(value) == {"deque"} and torch.is_tensor(value["deque"])
                if not ok or value["deque"].ndim != 1 or len(value["deque"]) > (getattr(layer, key).maxlen or 2**62):
                    return f"{at} is not an episode queue of at most {getattr(layer, key).maxlen} numbers"
                why = number_problem(value["deque"], at, nonnegative=False)
            elif number_kind(fresh_value):
                if number_kind(value) != number_kind(fresh_value):
                    return f"{at} is {short(value)}, not a number"
                number = value["scalar"] if isinstance(value, dict) else value
                why = number_problem(number, at, nonnegative=number_kind(fresh_value) == "int")
            elif torch.is_tensor(fresh_value):
                if not (
                    torch.is_tensor(value)
                    and value.shape == fresh_value.shape
                    and kind_of(value) == kind_of(fresh_value)
                ):
                    return f"{at} is {short(value)}, not a tensor of shape {tuple(fresh_value.shape)}"
                why = number_problem(value, at, nonnegative=kind_of(value) == "int")
            else:  # a generator's state, a flag, a name
                why = differs(value, fresh_value, at)
            if why is not None:
                return why
    return None


def number_kind(value) -> Optional[str]:
    """'int' or 'float' for a plain number or env_state's {"scalar": tensor}; None for anything else."""
    if isinstance(value, dict) and set(value) == {"scalar"} and torch.is_tensor(value["scalar"]):
        return kind_of(value["scalar"]) if value["scalar"].ndim == 0 and kind_of(value["scalar"]) != "bool" else None
    return type(value).__name__ if type(value) in (int, float) else None


def kind_of(tensor: torch.Tensor) -> str:
    return "bool" if tensor.dtype == torch.bool else "float" if tensor.is_floating_point() else "int"


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
    """The plain attributes (numbers, arrays, random generators, episode queues) of every layer of the envs, or None
    when an env keeps its state in other objects (Box2D's world: LunarLander; MuJoCo's data).

    For classic-control envs (CartPole, Acrobot, MountainCar) this is their whole state: an episode in progress
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
        raise ValueError(f"{len(saved)} env layers saved where the run's flags make {len(layers)}")
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
        state.get("script") != "ppo_cartpole.py"
        or not isinstance(saved, dict)
        or set(saved) != {f.name for f in fields(Args)}
        or not isinstance(state.get("objects"), dict)
    ):
        raise UserError(f"'{path}' is not a training state of this version of ppo_cartpole.py")
    for f in fields(Args):
        if not fits(saved[f.name], f.type):
            raise UserError(f"'{path}' is a damaged training state (its {flag(f.name)} is {saved[f.name]!r})")
    given = {f.name: getattr(args, f.name) for f in fields(Args) if getattr(args, f.name) != f.default}
    for name, value in given.items():
        if name not in RESUME_FLAGS and value != saved[name]:
            raise UserError(
                f"--resume continues a run with its own flags, but {flag(name)} {value} differs from its {saved[name]}"
            )
    resumed = Args(**{**saved, **given})  # the flags given may only change those in RESUME_FLAGS
    try:  # the flags given were checked: what fails here is the file's
        check_values(resumed)
    except UserError as e:
        raise UserError(f"'{path}' is a damaged training state ({' '.join(str(e).split())[:200]})")
    check_args(resumed)  # the run's env on this machine
    return resumed, state


def wait_for_a_new_second(run_dir: str) -> None:
    """Wait until the clock is past the second of the newest event file in `run_dir` (2 s at most: a file stamped in
    the future, by a clock that was set back, must not stall the run)."""
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


def lock_run_dir(run_dir: str) -> int:
    """Hold `run_dir`/.lock (flock) for the life of this process's run, with its pid in it; the file descriptor.

    UserError when another process holds it, or the folder cannot be written (read-only, full): checked by writing
    a small file before anything else is, and the temporary files of a killed save are removed."""
    path = os.path.join(run_dir, ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"cannot write into the run folder {run_dir} ({e.strerror or e})")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise UserError(f"another process (pid {holder or 'unknown'}) is running {run_dir}")
    try:
        check_writable(run_dir, "the run folder")
        for name in os.listdir(run_dir):  # another process's save that was killed before its rename
            if re.fullmatch(r".+\.tmp\d+", name):
                os.remove(os.path.join(run_dir, name))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except (OSError, UserError) as e:
        os.close(fd)
        if isinstance(e, UserError):
            raise
        raise UserError(f"cannot write into the run folder {run_dir} ({e.strerror or e})")
    return fd


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
