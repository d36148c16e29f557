"""icpi_chain.py against outputs recorded from the original ICPI code (ethanabrooks/icpi, d5c8ef7).

The fixtures (tests/data/icpi_original_fixtures.json.xz, described in tests/data/README.md) are the authority. Texts,
rewards, flags, states, optima and regrets are compared exactly; the only differences allowed are these departures,
each documented in docs/icpi_chain.md and docs/references.md:

- rewards are ints: policy examples print `assert reward == 0` where the original printed `0.0` in chain,
  distractor-chain, maze and point-mass (FLOAT_REWARD_DOMAINS), and a parsed reward answer is an int where the
  original's was a float of the same value;
- a completion must be exactly a canonical answer: the completions the original accepted and we refuse are listed
  (EXPECTED_STRICTER, EXPECTED_STRICTER_INVADERS_REWARD, expected_stricter);
- the chain and distractor-chain optimum comes from the true start state: the episodes where the original's logged
  optimum came from a start state mutated by the first action (flagged in the fixtures) get the search value;
- mini-invaders' regret is divided by its largest optimal return, 2 (the original logs optimal - return).

Where the original shuffles, the examples are compared as sorted lists or multisets; distractor-chain's distractor is
random, so its one-step entries hold only the next position."""

import hashlib
import json
import lzma
import os
import re
from collections import Counter

import numpy as np
import pytest

import icpi_chain as ic

DATA = os.path.join(os.path.dirname(__file__), "data", "icpi_original_fixtures.json.xz")
FIX = json.loads(lzma.open(DATA).read())
DOMAINS = list(FIX)


def to_state(name, s):
    """Our state from the fixtures' structured form."""
    if name in ("chain", "distractor-chain"):
        return tuple(s)
    if name == "maze":
        return (s["i"], s["j"])
    if name == "mini-catch":
        return (s["paddle_x"], s["ball_x"], s["ball_y"])
    if name == "mini-invaders":
        return (s["ship"], tuple(None if a is None else tuple(a) for a in s["aliens"]))
    return (s["pos"], s["vel"])


class Draw:
    """A stand-in generator that makes distractor-chain draw the recorded distractor."""

    def __init__(self, value):
        self.value = value

    def integers(self, *_):
        return self.value


# Known bug of the original kept fixed here (documented in icpi_chain.py, docs/icpi_chain.md and docs/references.md):
# chain, distractor-chain, maze and point-mass print the rewards of policy examples as floats (`assert reward == 0.0`)
# while the reward prompt prints ints; icpi_chain.py prints ints everywhere. The same int-vs-float difference in the
# parsed answers: the original reads a reward answer as a float (`1.0`), icpi_chain.py as an int (`1`), equal values.
FLOAT_REWARD_DOMAINS = {"chain", "distractor-chain", "maze", "point-mass"}


def expected_policy_text(name, text):
    if name in FLOAT_REWARD_DOMAINS:
        return re.sub(r"assert reward == (-?\d+)\.0\n", r"assert reward == \1\n", text)
    return text


def test_fixture_copy_is_complete():
    assert DOMAINS == ["chain", "distractor-chain", "maze", "mini-catch", "mini-invaders", "point-mass"]
    assert sum(len(b["episodes"]) for d in DOMAINS for b in FIX[d]["episodes"]) == 600


@pytest.mark.parametrize("name", DOMAINS)
def test_constants(name):
    d, c = ic.make_domain(name), FIX[name]["constants"]
    assert d.gamma == c["gamma"] and d.log_gamma == c["log_gamma"] and d.horizon == c["horizon"]
    assert d.time_limit == c["time_limit"] and d.success_threshold == c["success_threshold"]
    assert list(d.action_names) == c["action_names"]
    assert [d.action_text(a) for a in range(d.n_actions)] == c["action_texts"]
    assert d.header == c["reset_header"]
    assert d.done_text(True) == c["done_texts"]["true"] + c["stops"]["done"]
    assert d.done_text(False) == c["done_texts"]["false"] + c["stops"]["done"]
    for r, text in c["reward_texts"].items():
        assert d.reward_text(int(r)) == text + c["stops"]["reward"]
    assert d.stops == {
        "done": c["stops"]["done"],
        "reward": c["stops"]["reward"],
        "next": c["stops"]["next_state"],
        "policy": c["stops"]["policy"],
    }


@pytest.mark.parametrize("name", DOMAINS)
def test_replay_every_recorded_episode(name):
    """Every recorded episode, replayed from its start state: every text, reward, flag and state."""
    d = ic.make_domain(name)
    n_steps = 0
    for block in FIX[name]["episodes"]:
        for ep in block["episodes"]:
            state = to_state(name, ep["start_state"])
            rewards = []
            for k, st in enumerate(ep["steps"]):
                assert d.state_text(state, True) == st["state_text"]
                assert d.state_text(state, False) == st["state_text_nohint"]
                assert d.action_text(st["action"]) == st["action_text"]
                rng = Draw(st["next_state"][1]) if name == "distractor-chain" else None
                nxt, r, term = d.step(state, st["action"], rng)
                assert (r, term) == (st["reward"], st["terminal"])
                timeout = not term and d.time_limit is not None and k + 1 == d.time_limit
                assert timeout == st["timeout"]
                assert nxt == to_state(name, st["next_state"])
                assert d.state_text(nxt, True) == st["next_state_text"]
                rewards.append(r)
                state = nxt
                n_steps += 1
            assert term or timeout  # the episode ends where the recording ends
            assert ic.discounted(rewards, d.log_gamma) == ep["discounted_return"]
    assert n_steps == sum(len(ep["steps"]) for b in FIX[name]["episodes"] for ep in b["episodes"])


@pytest.mark.parametrize("name", [n for n in DOMAINS if n != "point-mass"])
def test_every_one_step_entry(name):
    d = ic.make_domain(name)
    entries = FIX[name]["one_step"]
    assert len(entries) == {"chain": 8, "distractor-chain": 64, "maze": 9, "mini-catch": 80, "mini-invaders": 376}[name]
    for e in entries:
        s = to_state(name, e["state"])
        assert d.state_text(s, True) == e["text"] and d.state_text(s, False) == e["text_nohint"]
        assert d.parse_state(e["text"]) == s and d.parse_state(e["text_nohint"], hints=False) == s
        for a in e["actions"]:
            nxt, r, term = d.step(s, a["action"], Draw(0) if name == "distractor-chain" else None)
            assert (r, term) == (a["reward"], a["terminal"])
            if name == "distractor-chain":
                assert nxt[0] == a["next_position"]
            else:
                assert nxt == to_state(name, a["next_state"]) and d.state_text(nxt) == a["next_text"]


@pytest.mark.parametrize("name", DOMAINS)
def test_every_optimal_return(name):
    """The optimal return of every recorded start state equals the original's `optimal` exactly,
    and the exhaustive search over our dynamics reproduces the fixtures' search."""
    d, table = ic.make_domain(name), FIX[name]["optimal_return"]
    assert table["states"]
    for e in table["states"]:
        s = to_state(name, e["start_state"])
        assert d.optimal_return(s) == e["original"], e
        if name != "distractor-chain":  # its distractor is random
            assert ic.search_optimal_return(d, s, table["search_limit_steps"], table["discount"]) == e["search"]
        if name == "mini-invaders":
            assert ic.search_optimal_return(d, s, 8, d.gamma) == e["search_with_planning_gamma"]


@pytest.mark.parametrize("name", DOMAINS)
def test_logged_optimum_and_regret_of_every_episode(name):
    """The optimum and regret the original logged for every recorded episode, exactly, with the two listed
    departures: an episode the fixtures flag (chain and distractor-chain: the original's optimum came from a start
    state mutated by the first action) gets the search value, and mini-invaders' regret is divided by 2."""
    d = ic.make_domain(name)
    flagged = FIX[name]["optimal_return"]["episodes_where_logged_optimal_differs"]
    assert bool(flagged) == (name in ("chain", "distractor-chain"))
    flagged = {(e["seed"], e["episode"]): e for e in flagged}
    assert d.return_scale == (2.0 if name == "mini-invaders" else 1.0)
    seen = 0
    for block in FIX[name]["episodes"]:
        for ep in block["episodes"]:
            rewards = [int(st["reward"]) for st in ep["steps"]]
            regret, opt = ic.normalised_regret(d, to_state(name, ep["start_state"]), rewards)
            e = flagged.get((block["seed"], ep["episode"]))
            if e is None:
                assert opt == ep["logged_optimal"] and regret == ep["logged_regret"] / d.return_scale
            else:
                seen += 1  # the fixtures' search adds in another order: its last bit may differ
                assert to_state(name, e["start_state"]) == to_state(name, ep["start_state"])
                assert opt == pytest.approx(e["search"], rel=1e-15) and opt != pytest.approx(ep["logged_optimal"])
                want = ep["logged_regret"] + e["search"] - ep["logged_optimal"]
                assert regret == pytest.approx(want, abs=1e-12)
    assert seen == len(flagged)


# ---------------------------------------------------------------- prompts


def buffer_episodes(name, buf):
    """The buffer of a prompt fixture: time-outs stored with done = False, as the original does."""
    d = ic.make_domain(name)
    block = next(b for b in FIX[name]["episodes"] if b["seed"] == buf["seed"])
    episodes = []
    for k in buf["episodes"]:
        ep = block["episodes"][k]
        state, trs = to_state(name, ep["start_state"]), []
        for st in ep["steps"]:
            nxt = to_state(name, st["next_state"])
            trs.append(ic.Transition(state, st["action"], int(st["reward"]), bool(st["terminal"]), nxt))
            state = nxt
        episodes.append(ic.Episode(trs))
    return d, episodes


def prompt_cases():
    return [(name, k) for name in DOMAINS for k in range(len(FIX[name]["prompts"]["buffers"]))]


def class_counts(examples, pattern):
    return Counter(re.search(pattern, ex).group(0) for ex in examples)


@pytest.mark.parametrize("name,k", prompt_cases())
def test_prompts_match_the_original(name, k):
    """Done, reward, next-state and policy prompts built from the fixtures' buffers: the same
    examples (sorted: the original shuffles), the same query, the same stop string, the same correct
    completion; balanced prompts: the same distinct examples and the same count per class."""
    fx = FIX[name]["prompts"]["buffers"][k]
    d, episodes = buffer_episodes(name, fx["buffer"])
    transitions = [t for e in episodes for t in e.transitions]
    rng = np.random.default_rng(0)
    stop = {"done": "done", "reward": "reward", "next_state": "next", "policy": "policy"}

    for kind, pattern in (
        ("done", r"assert (not )?done\n\n$"),
        ("reward", r"assert reward == \d+"),
        ("next_state", r"$"),
    ):
        p = fx[kind]
        q = p["query_transition"]
        state, action = to_state(name, q["state"]), q["action"]
        assert ic.query_text(d, state, action) == p["query"]
        assert p["stop"] == [d.stops[stop[kind]]]
        for balance in (False, True):
            if kind == "done":
                ours = ic.done_examples(d, transitions, action, rng, balance)
            elif kind == "reward":
                ours = ic.reward_examples(d, transitions, action, bool(q["done"]), rng, balance)
            else:
                ours = ic.next_examples(d, episodes, action, rng, balance)
            theirs = p["balanced" if balance else "unbalanced"]["examples"]
            if balance:
                assert set(ours) == set(theirs) and len(ours) == len(theirs)
                assert class_counts(ours, pattern) == class_counts(theirs, pattern)
                sizes = p["balanced"]["class_sizes_before_balancing"]
                nonempty = [v for v in sizes.values() if v]
                assert Counter(class_counts(ours, pattern).values()) == Counter({max(nonempty): len(nonempty)})
            else:
                assert sorted(ours) == sorted(theirs)
        # the text sent to the model is "".join(examples) + query
        full = "".join(p["unbalanced"]["examples"]) + p["query"]
        assert hashlib.sha256(full.encode()).hexdigest() == p["unbalanced"]["prompt_sha256"]
        # the completion that answers the query correctly, with the stop string appended, is our text, and it
        # parses to the recorded answer (the next state: the one recorded in the episode)
        block = next(b for b in FIX[name]["episodes"] if b["seed"] == q["seed"])
        nxt = to_state(name, block["episodes"][q["episode"]]["steps"][q["step"]]["next_state"])
        right = {"done": d.done_text(bool(q["done"])), "reward": d.reward_text(int(q["reward"]))}
        assert p["completion_for_query"] + d.stops[stop[kind]] == right.get(kind, d.state_text(nxt))
        got = ic.parse_completion(d, stop[kind], p["completion_for_query"])
        answer = {"done": bool(q["done"]), "reward": int(q["reward"])}
        if kind == "next_state" and name == "point-mass":  # the text holds the position to 2 decimals
            assert d.state_text(got) == d.state_text(nxt) and got == (round(nxt[0], 2), nxt[1])
        else:
            assert got == answer.get(kind, nxt) and type(got) is type(answer.get(kind, nxt))

    p = fx["policy"]
    state = to_state(name, p["query_transition"]["state"])
    assert d.header + d.state_text(state) == p["query"]
    assert p["stop"] == [d.stops["policy"]]
    ours = ic.policy_examples(d, episodes, rng)
    theirs = [expected_policy_text(name, ex) for ex in p["examples"]]
    assert len(ours) == p["n_examples"] == sum(n * (n + 1) // 2 for n in (len(e.transitions) for e in episodes))
    assert sorted(ours) == sorted(theirs)
    assert p["completion_for_query"] + d.stops["policy"] == d.action_text(p["query_transition"]["action"])
    if name not in FLOAT_REWARD_DOMAINS:  # (elsewhere the texts differ by the listed reward fix)
        assert hashlib.sha256(("".join(p["examples"]) + p["query"]).encode()).hexdigest() == p["prompt_sha256"]


def test_policy_reward_fix_is_the_only_policy_difference():
    """The expected difference is exactly the float rewards: undoing it on our texts gives theirs."""
    fx = FIX["chain"]["prompts"]["buffers"][0]
    d, episodes = buffer_episodes("chain", fx["buffer"])
    ours = ic.policy_examples(d, episodes, np.random.default_rng(0))
    floats = [re.sub(r"assert reward == (\d+)\n", r"assert reward == \1.0\n", ex) for ex in ours]
    assert sorted(floats) == sorted(fx["policy"]["examples"])
    assert any("assert reward == 0\n" in ex for ex in ours)


# ---------------------------------------------------------------- validation

KIND = {"done": "done", "reward": "reward", "next_state": "next", "policy": "policy"}

# Where we are stricter than the original on purpose: a completion must be exactly the canonical text
# of an answer (plus the stop string), since a next state must become a state and not any text that
# starts with `assert state == `. These completions the original accepted; we reject them.
EXPECTED_STRICTER = {
    "done": {"assert done and more", "assert  not done"},
    "reward": {"assert reward == 1.0", "assert reward == 1 and reward == 0", "assert reward == 1 "},
}
# mini-invaders' reward stop is "()\n": the original accepts any text with `reward == N` before it;
# we want the whole reward block (`assert reward == 1\nfor a in aliens:\n    a.descend`).
EXPECTED_STRICTER_INVADERS_REWARD = {"assert reward == 1", "assert reward == 0", "assert reward == 2", "reward == 1"}


def expected_stricter(name, kind, completion, valid_prefix):
    if kind == "next_state":  # extra clauses, a bare prefix, or the original's `ball.x!=` repair
        return completion.endswith(" and more") or completion == valid_prefix or "ball.x!=" in completion
    extra = EXPECTED_STRICTER_INVADERS_REWARD if (name, kind) == ("mini-invaders", "reward") else set()
    return completion in EXPECTED_STRICTER.get(kind, set()) | extra


@pytest.mark.parametrize("name", DOMAINS)
def test_validation_verdicts(name):
    """Every recorded verdict: where the original rejects, we reject; where both accept, the values
    agree; where only the original accepts, the case is one of the listed stricter cases."""
    d, v = ic.make_domain(name), FIX[name]["validation"]
    stricter = 0
    for c in v["cases"]:
        ours = ic.parse_completion(d, KIND[c["kind"]], c["completion"])
        if not c["valid"]:
            assert ours is None, c
        elif ours is None:
            assert expected_stricter(name, c["kind"], c["completion"], v[c["kind"]].get("valid_prefix")), c
            stricter += 1
        elif c["kind"] == "next_state":
            assert d.state_text(ours) == c["value"], c
        elif c["kind"] == "reward":  # an int where the original's is a float (see FLOAT_REWARD_DOMAINS)
            assert type(ours) is int and type(c["value"]) is float and ours == c["value"], c
        else:
            assert ours == c["value"] and type(ours) is type(c["value"]), c
    assert stricter == (11 if name == "mini-invaders" else 8 if name == "mini-catch" else 7)
    for kind in ("done", "reward", "next_state", "policy"):
        assert v[kind]["stop"] == d.stops[KIND[kind]]
