"""Model calls and wall time per real ICPI step: the original's pattern (one sampled call per prediction,
no cache) against this implementation (cached prompt examples, completion cache, log-probability
scoring), on the same model, the same replay buffer and the same states.

    python benchmark/icpi_speed.py --steps 3                  # SmolLM2-135M on the CPU
    python benchmark/icpi_speed.py --model hf:<folder> --steps 5
    python benchmark/icpi_speed.py --dtype bfloat16 --out benchmark/icpi_speed_bf16.json

Also reports how often each prediction (done, reward, next state) agrees with the true environment,
which is what decides between `--scoring logprob` and `--scoring sample`. Appends a Markdown table to
stdout and writes benchmark/icpi_speed.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import icpi_chain as ic  # noqa: E402


@dataclass
class Bench:
    model: str = "smollm2"
    """the model (as icpi_chain.py's --model)"""
    env: str = "chain"
    """the domain"""
    episodes: int = 12
    """random episodes in the replay buffer before timing"""
    steps: int = 3
    """real steps timed per mode (each one |A| simulated rollouts)"""
    modes: str = "original,batched-sample,ours-sample,ours,ours-episode-order"
    """comma-separated subset of the modes below"""
    dtype: str = "auto"
    """hf weights: auto (float32 on CPU), float32, bfloat16 (as icpi_chain.py's --dtype)"""
    out: str = "benchmark/icpi_speed.json"
    """where to write the numbers"""


MODES = {
    # name: (batch, completion cache, prefix KV cache, scoring)
    "original": (False, False, False, "sample"),
    "batched-sample": (True, True, False, "sample"),
    "ours-sample": (True, True, True, "sample"),
    "ours": (True, True, True, "logprob"),
    # the same with --order-seed episode: the timed steps all fall in one episode (same buffer)
    "ours-episode-order": (True, True, True, "logprob"),
}


def speed(ref, secs) -> str:
    return "" if not ref else f"{ref / secs:.1f}x"


def main(b: Bench) -> None:
    domain = ic.make_domain(b.env)
    rng = np.random.default_rng(0)
    episodes = []
    for _ in range(b.episodes):
        s, ep = domain.reset(rng), []
        for _ in range(domain.time_limit):
            a = int(rng.integers(domain.n_actions))
            s2, r, term = domain.step(s, a, rng)
            ep.append(ic.Transition(s, a, r, term, s2))
            s = s2
            if term:
                break
        episodes.append(ic.Episode(ep))
    states = [domain.reset(np.random.default_rng(100 + k)) for k in range(b.steps)]
    base = ic.Args(model=b.model, env=b.env, dtype=b.dtype)
    backend = None
    results = {}
    for name in b.modes.split(","):
        batch, use_cache, prefix, scoring = MODES[name]
        args = replace(base, batch=batch, prefix_cache=prefix, scoring=scoring, no_cache=not use_cache,
                       order_seed="episode" if name.endswith("episode-order") else "step")
        if backend is None:
            backend = ic.make_backend(args, domain, np.random.default_rng(1))
        backend.prefix_cache, backend._prefixes = prefix, {}
        cache = ic.CompletionCache(tempfile.mktemp(suffix=".sqlite"), backend.name) if use_cache else None
        agent = ic.Agent(domain, backend, args, np.random.default_rng(0), cache)
        for ep in episodes:
            agent.add_episode(ep)
        agree = {"done": [0, 0], "reward": [0, 0], "next": [0, 0]}
        orig = agent.predict

        def predict(kind, items, orig=orig, agree=agree):
            out = orig(kind, items)
            if kind in agree:
                for it, v in zip(items, out):
                    s2, r, term = domain.step(it["state"], it["action"], None)
                    truth = {"done": term, "reward": r, "next": s2}[kind]
                    agree[kind][0] += int(v == truth)
                    agree[kind][1] += 1
            return out

        agent.predict = predict
        per_step = []
        for k, s in enumerate(states):
            agent.real_step, agent.stats = k, ic.StepStats()
            t0, f0 = time.time(), getattr(backend, "forward_tokens", 0)
            _, q = agent.act(s)
            per_step.append({"seconds": time.time() - t0, **vars(agent.stats),
                             "forward_tokens": getattr(backend, "forward_tokens", 0) - f0,
                             "q": [round(float(x), 3) for x in q]})
        results[name] = {"steps": per_step, "agreement": agree,
                         "mean_seconds": float(np.mean([p["seconds"] for p in per_step])),
                         "mean_calls": float(np.mean([p["calls"] for p in per_step])),
                         "mean_forward_tokens": float(np.mean([p["forward_tokens"] for p in per_step]))}
        print(f"{name}: {results[name]['mean_seconds']:.1f} s, {results[name]['mean_forward_tokens']:.0f} token "
              f"positions through the model and {results[name]['mean_calls']:.1f} model calls "
              f"per real step; agreement {agree}", flush=True)
    with open(b.out, "w") as f:
        json.dump({"bench": vars(b), "results": results}, f, indent=1)
    ref = results.get("original", {}).get("mean_seconds")
    print("\n| mode | batch | completion cache | prefix KV cache | scoring | s / real step | model calls / step | "
          "token positions / step | cache hits / step | invalid / step | fallbacks / step | done agree | reward agree | next agree | speed-up (wall; token positions) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref_tok = results.get("original", {}).get("mean_forward_tokens")
    for name, r in results.items():
        batch, use_cache, prefix, scoring = MODES[name]
        st = r["steps"]
        ag = {k: f"{v[0]}/{v[1]}" for k, v in r["agreement"].items()}
        print(f"| {name} | {batch} | {use_cache} | {prefix} | {scoring} | {r['mean_seconds']:.1f} | {r['mean_calls']:.1f} | {r['mean_forward_tokens']:.0f} | "
              f"{np.mean([p['cache_hits'] for p in st]):.1f} | {np.mean([p['invalid'] for p in st]):.1f} | "
              f"{np.mean([p['fallbacks'] for p in st]):.1f} | {ag['done']} | {ag['reward']} | {ag['next']} | "
              f"{speed(ref, r['mean_seconds'])} (tokens {speed(ref_tok, r['mean_forward_tokens'])}) |")


if __name__ == "__main__":
    main(tyro.cli(Bench))
