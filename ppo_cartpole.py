"""PPO-clip on CartPole-v1 (and any env with a flat Box observation and a Discrete action space).

The baseline of the report "Large Language Model as Policy in Reinforcement Learning"
(seed 000, sections 7, 8 and 11.1): the actor is the observation followed by three fully
connected ReLU layers and a softmax over actions; the critic is a separate network.

CleanRL layout (Args dataclass + tyro, make_env thunks, Agent, pre-allocated rollout buffer,
GAE, update loop, TensorBoard), with these differences:
  * gymnasium 1.x vector envs in SAME_STEP autoreset mode: every finished episode is logged,
    also when several envs finish on the same step;
  * a time-limit truncation is bootstrapped with V(final observation), a termination is not;
  * per step only the actor runs; values and old log-probabilities are computed for the whole
    rollout in one batched pass afterwards (same parameters, so the same numbers), which is
    where most of the speed-up over CleanRL comes from.

    python ppo_cartpole.py --seed 1
    python ppo_cartpole.py --save-model
    python ppo_cartpole.py --eval-checkpoint runs/<run>/ppo_cartpole.pt --eval-episodes 10

The budget is rounded up to whole rollouts (the summary line states the steps run). Evaluation episode
i is seeded 10000 + the training seed + i, for the evaluation after `--save-model` and for
`--eval-checkpoint` alike (`--seed` given with `--eval-checkpoint` replaces the checkpoint's seed).
Ctrl-C during training finishes the current update, saves a checkpoint when `--save-model` is given,
and exits.
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
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro


@dataclass
class Args:
    exp_name: str = "ppo_cartpole"
    """the name of this experiment (part of the run folder's name)"""
    seed: Optional[int] = None
    """seed of the experiment (envs, torch, numpy, python); default 1. Evaluation episode i is seeded
    s + 10000 + i, s = the training seed (after `--save-model`); with `--eval-checkpoint`, s = the
    checkpoint's training seed unless `--seed` is given"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = False
    """train on CUDA (an error if torch sees no CUDA device; the networks are tiny: CPU is faster here;
    `--eval-checkpoint` always evaluates on the CPU)"""
    torch_threads: int = 1
    """torch intra-op threads; 1 is fastest for these tiny networks and lets runs go in parallel"""
    track: bool = False
    """log to Weights and Biases (imported only when asked)"""
    wandb_project_name: str = "llm-rl-scripts"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    capture_video: bool = False
    """record videos of env 0 into `videos/{run_name}`"""
    save_model: bool = False
    """save a checkpoint (weights + args) into the run folder at the end of training"""
    progress: bool = True
    """show a progress bar on the console (only when it is a terminal)"""
    progress_every: int = 100
    """when stdout is not a terminal (a log file): print a progress line every N updates (0: never)"""

    # Evaluation of a saved checkpoint (no training)
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint to evaluate instead of training"""
    eval_episodes: int = 10
    """number of episodes for `--eval-checkpoint` and for the evaluation after `--save-model`"""
    eval_greedy: bool = True
    """evaluate with the most probable action (False: sample from the policy)"""

    # Algorithm
    env_id: str = "CartPole-v1"
    """the id of the environment (flat Box observation, Discrete actions)"""
    total_timesteps: int = 500000
    """total environment steps of the experiment, rounded up to whole rollouts (num_envs * num_steps)"""
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
    hidden_size: int = 64
    """width of the hidden layers (actor: 3 ReLU layers as in seed 000; critic: 2 tanh layers)"""


DEFAULT_SEED = 1
EVAL_SEED_OFFSET = 10_000


# ----------------------------------------------------------------------------------------------
# Math helpers (small, top level, tested in tests/test_ppo_cartpole.py)
# ----------------------------------------------------------------------------------------------


def compute_gae(rewards, values, next_values, terminations, dones, gamma, gae_lambda):
    """Generalized advantage estimation over a rollout of shape (T, N).

    next_values[t] is V of the state actually reached after step t: for a step that ended an
    episode this is V(final observation), not V of the next episode's reset observation.
    terminations[t] = 1 cuts the bootstrap (a real terminal state has value 0);
    dones[t] = terminated or truncated cuts the recursion (the next row is another episode).
    A truncated step therefore keeps gamma * V(final observation) in its TD error.
    Returns (advantages, returns) with returns = advantages + values.
    """
    T = rewards.shape[0]
    advantages = rewards * 0.0  # works for numpy arrays and torch tensors alike
    last = 0.0
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminations[t]) - values[t]
        last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
        advantages[t] = last
    return advantages, advantages + values


def clipped_surrogate_loss(new_logprob, old_logprob, advantages, clip_coef):
    """PPO-clip policy loss: mean of max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi_new / pi_old.

    Also returns the approximate KL (the low-variance estimator (r - 1) - log r) and the
    fraction of samples whose ratio was clipped, for logging.
    """
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    loss = torch.max(pg_loss1, pg_loss2).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return loss, approx_kl, clipfrac


def value_loss(new_values, old_values, returns, clip_coef, clip_vloss):
    """0.5 * squared error; with clip_vloss, the max of the plain and the clipped error."""
    unclipped = (new_values - returns) ** 2
    if not clip_vloss:
        return 0.5 * unclipped.mean()
    clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    return 0.5 * torch.max(unclipped, (clipped - returns) ** 2).mean()


def sample_categorical(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row from softmax(logits) by inverting the cumulative distribution.

    In numpy because for a handful of envs the per-call overhead of torch.multinomial is
    larger than the whole computation."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    cdf = np.cumsum(probs, -1)
    u = rng.random((logits.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(-1), logits.shape[-1] - 1)


def mlp_forward_numpy(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """Forward pass of a ReLU MLP given as [(W, b), ...] with W of shape (in, out); no activation
    after the last layer. The rollout runs the actor this way: for a batch of 4 observations a
    numpy matmul costs ~1 us where an nn.Module call costs ~20 us of Python dispatch."""
    for W, b in layers[:-1]:
        x = np.maximum(x @ W + b, 0.0)
    W, b = layers[-1]
    return x @ W + b


def explained_variance(y_pred: np.ndarray, y_true: np.ndarray) -> float:
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


# ----------------------------------------------------------------------------------------------
# Environment and agent
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


def check_env_id(env_id: str) -> None:
    """Exit with one clear sentence when the env does not exist or does not fit this script."""
    try:
        env = gym.make(env_id)
    except gym.error.Error as e:
        sys.exit(f"error: cannot make env '{env_id}': {e}")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Discrete):
        sys.exit(
            f"error: ppo_cartpole.py needs a Discrete action space, but '{env_id}' has {act_space}."
        )
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        sys.exit(f"error: ppo_cartpole.py needs a flat Box observation, but '{env_id}' has {obs_space}.")


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()
        # Critic: a separate 2x tanh MLP (CleanRL's design).
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )
        # Actor: seed 000 section 8, three fully connected ReLU layers and a softmax over actions
        # (the softmax lives in the log_softmax of `log_probs`; the network outputs logits).
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden, n_actions), std=0.01),
        )

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.actor(x), dim=-1)

    def actor_layers_numpy(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """A numpy copy of the actor's weights for `mlp_forward_numpy` (refresh after each update)."""
        linears = [m for m in self.actor if isinstance(m, nn.Linear)]
        return [(m.weight.detach().cpu().numpy().T.copy(), m.bias.detach().cpu().numpy().copy()) for m in linears]

    def act(self, x: torch.Tensor, rng: np.random.Generator, greedy: bool = False) -> np.ndarray:
        """Actions for a batch of observations, as a numpy array (sampled, or the mode)."""
        logits = self.actor(x).cpu().numpy()
        if greedy:
            return logits.argmax(-1)
        return sample_categorical(logits, rng)


def save_checkpoint(path: str, agent: Agent, args: Args, obs_dim: int, n_actions: int, run_name: str) -> None:
    """Weights, args and sizes as tensors and plain Python values: loads with torch.load(weights_only=True)."""
    torch.save({"model": agent.state_dict(), "args": asdict(args), "obs_dim": obs_dim, "n_actions": n_actions,
                "run_name": run_name}, path)


def load_checkpoint(path: str) -> tuple[Agent, dict]:
    if os.path.isdir(path):
        sys.exit(f"error: checkpoint '{path}' is a directory; give the .pt file inside it "
                 f"(e.g. {os.path.join(path, 'ppo_cartpole.pt')}).")
    if not os.path.isfile(path):
        sys.exit(f"error: checkpoint '{path}' does not exist.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        agent = Agent(ckpt["obs_dim"], ckpt["n_actions"], ckpt["args"]["hidden_size"])
        agent.load_state_dict(ckpt["model"])
    except Exception as e:  # a corrupt or foreign file: say so in one sentence
        sys.exit(f"error: '{path}' is not a ppo_cartpole.py checkpoint ({type(e).__name__}: {e}).")
    # the run that wrote it (older checkpoints: the folder it sits in)
    run_name = ckpt.get("run_name") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    return agent, {**ckpt["args"], "run_name": run_name}


def eval_seed(train_seed: int, cli_seed: Optional[int] = None) -> int:
    """The one rule for evaluation seeds: episode i is seeded eval_seed + i, where eval_seed is
    10000 + the training seed (the checkpoint's), or + `--seed` when given with `--eval-checkpoint`.
    So the evaluation after `--save-model` and `--eval-checkpoint` of its file print the same numbers."""
    return (train_seed if cli_seed is None else cli_seed) + EVAL_SEED_OFFSET


def evaluate(agent: Agent, env_id: str, episodes: int, seed: int, greedy: bool = True) -> list[float]:
    """Run `episodes` full episodes in one env and return their undiscounted returns (episode i resets
    with seed + i; sampled actions draw from a generator seeded with `seed`)."""
    env = gym.make(env_id)
    rng = np.random.default_rng(seed)
    returns = []
    with torch.inference_mode():
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            done, total = False, 0.0
            while not done:
                action = agent.act(torch.as_tensor(obs, dtype=torch.float32)[None], rng, greedy=greedy)
                obs, reward, terminated, truncated, _ = env.step(int(action[0]))
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


def returns_text(recent_returns) -> str:
    if not recent_returns:
        return "no episode has finished yet"
    return f"mean return of the last {len(recent_returns)} episodes {np.mean(recent_returns):.2f}"


def eval_text(returns: list[float]) -> str:
    return f"{np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)} episodes"


def run_eval_only(args: Args) -> None:
    from torch.utils.tensorboard import SummaryWriter

    agent, train_args = load_checkpoint(args.eval_checkpoint)
    env_id = train_args["env_id"]
    check_env_id(env_id)
    seed = eval_seed(train_args["seed"], args.seed)
    returns = evaluate(agent, env_id, args.eval_episodes, seed=seed, greedy=args.eval_greedy)
    run_name = make_run_dir(f"{train_args['run_name']}-eval__{seed}")
    writer = SummaryWriter(f"runs/{run_name}")
    for i, r in enumerate(returns):
        writer.add_scalar("eval/episodic_return", r, i)
    writer.close()
    print(f"eval {args.eval_checkpoint}: {eval_text(returns)} (env {env_id}, seeds {seed}..{seed + len(returns) - 1}, "
          f"logged to runs/{run_name})")


def num_rollouts(total_timesteps: int, steps_per_rollout: int) -> int:
    """The budget rule of all three scripts: whole rollouts, rounded up (never fewer steps than asked)."""
    return -(-total_timesteps // steps_per_rollout)


def check_args(args: Args) -> None:
    """Exit with one sentence on the first bad value, before any work (and before the run folder exists)."""
    a = args
    batch = a.num_envs * a.num_steps
    rules = [
        (a.total_timesteps >= 1, f"--total-timesteps must be >= 1, got {a.total_timesteps}"),
        (a.num_envs >= 1, f"--num-envs must be >= 1, got {a.num_envs}"),
        (a.num_steps >= 1, f"--num-steps must be >= 1, got {a.num_steps}"),
        (a.num_minibatches >= 1 and batch % a.num_minibatches == 0,
         f"--num-minibatches {a.num_minibatches} must divide the rollout of --num-envs x --num-steps = {batch} "
         f"samples"),
        (a.update_epochs >= 1, f"--update-epochs must be >= 1, got {a.update_epochs}"),
        (a.learning_rate > 0, f"--learning-rate must be > 0, got {a.learning_rate}"),
        (0.0 <= a.gamma <= 1.0, f"--gamma must be in [0, 1], got {a.gamma}"),
        (0.0 <= a.gae_lambda <= 1.0, f"--gae-lambda must be in [0, 1], got {a.gae_lambda}"),
        (a.clip_coef > 0, f"--clip-coef must be > 0, got {a.clip_coef}"),
        (a.ent_coef >= 0, f"--ent-coef must be >= 0, got {a.ent_coef}"),
        (a.vf_coef >= 0, f"--vf-coef must be >= 0, got {a.vf_coef}"),
        (a.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {a.max_grad_norm}"),
        (a.target_kl is None or a.target_kl > 0, f"--target-kl must be > 0, got {a.target_kl}"),
        (a.hidden_size >= 1, f"--hidden-size must be >= 1, got {a.hidden_size}"),
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

    check_env_id(args.env_id)
    args.seed = DEFAULT_SEED if args.seed is None else args.seed
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = num_rollouts(args.total_timesteps, batch_size)
    run_name = make_run_dir(f"{args.env_id}__{args.exp_name}__{args.seed}")
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, monitor_gym=True, save_code=True)
    writer = SummaryWriter(f"runs/{run_name}")
    hparams = {**vars(args), "batch_size": batch_size, "minibatch_size": minibatch_size,
               "num_iterations": num_iterations}
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n%s" % ("\n".join([f"|{key}|{value}|" for key, value in hparams.items()])),
    )
    if num_iterations * batch_size != args.total_timesteps:
        print(f"{run_name}: {num_iterations} rollouts of {batch_size} steps = {num_iterations * batch_size} steps "
              f"(--total-timesteps {args.total_timesteps} rounded up to whole rollouts)")

    seed_everything(args.seed, args.torch_deterministic)
    device = torch.device("cuda" if args.cuda else "cpu")

    # SAME_STEP autoreset: the obs returned on a done step is already the next episode's first
    # obs, and the real last obs sits in info["final_obs"]. Every row of the buffer is then a
    # genuine transition (no dummy reset step as in gymnasium's default NEXT_STEP mode).
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, i, args.capture_video, run_name) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    n_actions = int(envs.single_action_space.n)
    agent = Agent(obs_dim, n_actions, args.hidden_size).to(device)
    # fused Adam: one kernel for all parameters instead of a dozen small ops per tensor
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    action_rng = np.random.default_rng(args.seed)  # the policy's sampling noise

    # Pre-allocated rollout buffer (numpy while stepping, torch for the update).
    T, N = args.num_steps, args.num_envs
    obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)
    next_obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)  # state reached after each step
    actions_buf = np.zeros((T, N), dtype=np.int64)
    rewards_buf = np.zeros((T, N), dtype=np.float32)
    terminations_buf = np.zeros((T, N), dtype=np.float32)
    dones_buf = np.zeros((T, N), dtype=np.float32)

    episode_return = np.zeros(N, dtype=np.float64)
    episode_length = np.zeros(N, dtype=np.int64)
    recent_returns: deque = deque(maxlen=100)

    global_step = 0
    start_time = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = next_obs.astype(np.float32)
    bar = tqdm(total=num_iterations * batch_size, unit="step", disable=None if args.progress else True,
               dynamic_ncols=True)

    print_progress = args.progress_every > 0 and not sys.stdout.isatty()
    stop = StopOnCtrlC()
    for iteration in range(1, num_iterations + 1):
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate
        rollout_start = time.time()
        # The parameters are fixed during the rollout: act with a numpy copy of the actor (same
        # function, without the per-call overhead of torch modules on a batch of 4 observations).
        actor_layers = agent.actor_layers_numpy() if device.type == "cpu" else None

        with torch.inference_mode():
            for step in range(T):
                global_step += N
                obs_buf[step] = next_obs
                if actor_layers is not None:
                    action = sample_categorical(mlp_forward_numpy(actor_layers, next_obs), action_rng)
                else:
                    action = agent.act(torch.from_numpy(next_obs).to(device), action_rng)
                actions_buf[step] = action
                next_obs, reward, terminations, truncations, infos = envs.step(action)
                next_obs = next_obs.astype(np.float32)
                dones = np.logical_or(terminations, truncations)
                rewards_buf[step] = reward
                terminations_buf[step] = terminations
                dones_buf[step] = dones
                next_obs_buf[step] = next_obs
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(dones):
                    # the real last observation (for the bootstrap of a truncated episode)
                    next_obs_buf[step, i] = infos["final_obs"][i]
                    writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    recent_returns.append(episode_return[i])
                    episode_return[i], episode_length[i] = 0.0, 0

            # One batched pass for the values and the behaviour log-probabilities of the whole
            # rollout (the parameters did not change while stepping).
            b_obs_t = torch.from_numpy(obs_buf).to(device)
            actions_t = torch.from_numpy(actions_buf).to(device)
            values = agent.get_value(b_obs_t)
            next_values = agent.get_value(torch.from_numpy(next_obs_buf).to(device))
            logprobs = agent.log_probs(b_obs_t).gather(-1, actions_t.unsqueeze(-1)).squeeze(-1)
            # GAE in numpy: a 128-step Python loop over tiny arrays is cheaper there than in torch
            advantages, returns = compute_gae(
                rewards_buf, values.cpu().numpy(), next_values.cpu().numpy(), terminations_buf, dones_buf,
                args.gamma, args.gae_lambda,
            )
            advantages, returns = torch.from_numpy(advantages).to(device), torch.from_numpy(returns).to(device)
        rollout_time = time.time() - rollout_start

        # Flatten the batch (clone out of inference mode so autograd may use it).
        b_obs = b_obs_t.reshape(-1, obs_dim).clone()
        b_actions = actions_t.reshape(-1).clone()
        b_logprobs = logprobs.reshape(-1).clone()
        b_advantages = advantages.reshape(-1).clone()
        b_returns = returns.reshape(-1).clone()
        b_values = values.reshape(-1).clone()

        update_start = time.time()
        b_inds = np.arange(batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = torch.from_numpy(b_inds[start:start + minibatch_size])
                all_logp = agent.log_probs(b_obs[mb_inds])
                newlogprob = all_logp.gather(-1, b_actions[mb_inds].unsqueeze(-1)).squeeze(-1)
                entropy = -(all_logp.exp() * all_logp).sum(-1)
                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss, approx_kl, clipfrac = clipped_surrogate_loss(
                    newlogprob, b_logprobs[mb_inds], mb_advantages, args.clip_coef)
                clipfracs.append(clipfrac.item())
                newvalue = agent.get_value(b_obs[mb_inds])
                v_loss = value_loss(newvalue, b_values[mb_inds], b_returns[mb_inds], args.clip_coef, args.clip_vloss)
                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

            if args.target_kl is not None and approx_kl > args.target_kl:
                break
        update_time = time.time() - update_start

        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        sps = int(global_step / (time.time() - start_time))
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
        writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        writer.add_scalar("losses/explained_variance", explained_variance(y_pred, y_true), global_step)
        writer.add_scalar("charts/SPS", sps, global_step)
        writer.add_scalar("time/rollout_seconds", rollout_time, global_step)
        writer.add_scalar("time/update_seconds", update_time, global_step)
        bar.update(batch_size)
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
    model_path = f"runs/{run_name}/{args.exp_name}.pt"
    if stop.requested:  # Ctrl-C: save what there is, close everything, one line
        if args.save_model:
            save_checkpoint(model_path, agent, args, obs_dim, n_actions, run_name)
        envs.close()
        writer.close()
        print(f"{run_name}: interrupted after {global_step} of {num_iterations * batch_size} steps, "
              f"{returns_text(recent_returns)}; "
              + (f"checkpoint saved to {model_path}" if args.save_model else "no checkpoint (no --save-model)"),
              flush=True)
        sys.exit(130)
    print(f"{run_name}: {global_step} steps, {returns_text(recent_returns)}, {sps} steps/s")

    if args.save_model:
        save_checkpoint(model_path, agent, args, obs_dim, n_actions, run_name)
        print(f"model saved to {model_path}")
        agent.eval()
        returns_eval = evaluate(agent, args.env_id, args.eval_episodes, seed=eval_seed(args.seed),
                                greedy=args.eval_greedy)
        for i, r in enumerate(returns_eval):
            writer.add_scalar("eval/episodic_return", r, i)
        print(f"eval: {eval_text(returns_eval)}")

    envs.close()
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args))
