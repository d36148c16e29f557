"""Regret curves of icpi_chain.py: ICPI with the oracle, the Matching Model, Tabular Q (and, slowly,
ICPI with SmolLM2) on chain and maze, several seeds, beside the paper's numbers.

    python benchmark/icpi_regret.py                                   # oracle, matching, tabular-q; 4 seeds
    nice python benchmark/icpi_regret.py --agents smollm2 --envs chain --seeds 1 --steps-chain 40
    nice python benchmark/icpi_regret.py --agents smollm2-bf16          # SmolLM2, 4 seeds, chain and maze
    python benchmark/icpi_regret.py --from-runs benchmark/out/runs      # table + figure of benchmark/run.py's runs

Each (agent, env, seed) is one run of icpi_chain.py in a scratch folder; the per-episode regrets it
logged to TensorBoard are merged into benchmark/icpi_regret.json (later invocations add to it), and
benchmark/icpi_regret.png plus the table printed at the end are made from that file.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AGENTS = {  # name: flags of icpi_chain.py
    "oracle": ["--model", "oracle"],
    "matching": ["--model", "matching"],
    "tabular-q": ["--algo", "tabular-q"],
    "smollm2": ["--model", "smollm2"],
    "smollm2-episode-order": ["--model", "smollm2", "--order-seed", "episode"],
    "smollm2-bf16": ["--model", "smollm2", "--dtype", "bfloat16"],  # default flags, bf16 weights (~3x faster)
}
COLORS = {"oracle": "tab:orange", "matching": "tab:blue", "tabular-q": "tab:green", "smollm2": "tab:red",
          "smollm2-episode-order": "tab:purple", "smollm2-bf16": "tab:red"}
PAPER = {  # ICPI with code-davinci-002, read off the paper's figures (reference/icpi.md), 4 seeds
    "chain": "ICPI ~0 by ~40 steps; Tabular Q ~0 by 60-80 (85 steps shown)",
    "maze": "ICPI ~0 by ~120 steps (130 shown)",
    "distractor-chain": "ICPI ~0.17 (140 steps shown)",
    "mini-catch": "ICPI ~0.02 at ~300 steps",
    "mini-invaders": "ICPI ~0.15 by ~170 steps (baselines >= 0.45)",
    "point-mass": "ICPI ~0.03 at ~300 steps (baselines >= 0.25)",
}


@dataclass
class Config:
    agents: str = "oracle,matching,tabular-q"
    """comma-separated agents (oracle, matching, tabular-q, smollm2, smollm2-episode-order, smollm2-bf16)"""
    envs: str = "chain,maze"
    """comma-separated domains"""
    seeds: str = "1,2,3,4"
    """comma-separated seeds"""
    steps_chain: int = 85
    """real steps on chain (the paper shows 85)"""
    steps_maze: int = 130
    """real steps on maze (the paper shows 130)"""
    extra: str = ""
    """extra flags for icpi_chain.py, space-separated"""
    out: str = "benchmark/icpi_regret.json"
    """merged results"""
    plot: str = "benchmark/icpi_regret.png"
    """the figure"""
    from_runs: str = ""
    """read the run folders benchmark/run.py made under this folder (icpi_chain__{env}__{setting}__{steps}__seed{n})
    instead of running anything; writes only the table and the figure"""


def read_regrets(run_dir: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("charts/regret")]


def curve(regrets: list[tuple[int, float]], total: int, window: int = 10) -> list[float]:
    """Mean regret of the episodes that ended in each window of `window` real steps (nan if none)."""
    out = []
    for lo in range(0, total, window):
        vals = [v for s, v in regrets if lo <= s < lo + window]
        out.append(float(np.mean(vals)) if vals else float("nan"))
    return out


def results_from_runs(runs_dir: str) -> dict:
    """{env/agent/seed: {steps, regrets}} from benchmark/run.py's completed icpi_chain run folders."""
    results = {}
    for folder in sorted(glob.glob(os.path.join(runs_dir, "icpi_chain__*__seed*"))):
        if not os.path.isfile(os.path.join(folder, "done.json")):
            continue
        _, env, agent, steps, seed = os.path.basename(folder).split("__")
        run = glob.glob(os.path.join(folder, "runs", "*"))
        if len(run) == 1:
            results[f"{env}/{agent}/{seed[4:]}"] = {"steps": int(steps), "regrets": read_regrets(run[0])}
    return results


def main(c: Config) -> None:
    if c.from_runs:
        report(results_from_runs(c.from_runs), c.plot)
        return
    results = {}
    if os.path.isfile(c.out):
        with open(c.out) as f:
            results = json.load(f)
    for env in c.envs.split(","):
        steps = c.steps_chain if env == "chain" else c.steps_maze
        for agent in c.agents.split(","):
            for seed in c.seeds.split(","):
                cwd = tempfile.mkdtemp(prefix="icpi_bench_")
                cmd = [sys.executable, os.path.join(ROOT, "icpi_chain.py"), *AGENTS[agent], "--env", env,
                       "--total-steps", str(steps), "--seed", seed, "--no-progress", *c.extra.split()]
                t0 = time.time()
                proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"))
                if proc.returncode != 0:
                    sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
                run = glob.glob(os.path.join(cwd, "runs", "*"))[0]
                regrets = read_regrets(run)
                key = f"{env}/{agent}/{seed}"
                results[key] = {"steps": steps, "regrets": regrets, "seconds": time.time() - t0,
                                "summary": proc.stdout.strip().splitlines()[-1]}
                print(f"{key}: {len(regrets)} episodes, {time.time() - t0:.0f} s; {results[key]['summary']}",
                      flush=True)
                with open(c.out, "w") as f:
                    json.dump(results, f)
    report(results, c.plot)


def report(results: dict, plot_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ["chain", "distractor-chain", "maze", "mini-catch", "mini-invaders", "point-mass"]
    envs = sorted({k.split("/")[0] for k in results}, key=lambda e: order.index(e) if e in order else 99)
    cols = min(3, len(envs))
    rows = (len(envs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(envs):]:
        ax.set_visible(False)
    print("\n| env | agent | seeds | real steps | mean regret, first quarter | mean regret, last quarter | "
          "first window (10 steps) with mean regret < 0.05 | paper (code-davinci-002) |")
    print("|---|---|---|---|---|---|---|---|")
    for ax, env in zip(axes.flat, envs):
        agents = sorted({k.split("/")[1] for k in results if k.startswith(env + "/")})
        for agent in agents:
            runs = [v for k, v in results.items() if k.startswith(f"{env}/{agent}/")]
            total = max(r["steps"] for r in runs)
            curves = np.array([curve(r["regrets"], total) for r in runs])
            mean = np.nanmean(curves, axis=0)
            x = np.arange(len(mean)) * 10 + 10
            ax.plot(x, mean, marker="o", ms=3, label=f"{agent} ({len(runs)} seeds)", color=COLORS.get(agent))
            allr = [(s, v) for r in runs for s, v in r["regrets"]]
            first = [v for s, v in allr if s < total / 4]
            last = [v for s, v in allr if s >= 3 * total / 4]
            below = next((int(xx) for xx, m in zip(x, mean) if m < 0.05 and
                          all(not (mm >= 0.05) for mm in mean[list(x).index(xx):])), None)
            print(f"| {env} | {agent} | {len(runs)} | {total} | {np.mean(first):.3f} | {np.mean(last):.3f} | "
                  f"{'by step ' + str(below) if below else 'not reached'} | {PAPER.get(env, '')} |")
        ax.set_title(env)
        ax.set_xlabel("real steps (window end)")
        ax.set_ylabel("normalised regret")
        ax.set_ylim(-0.02, 1.0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_path, dpi=80)
    print(f"\nfigure: {plot_path}")


if __name__ == "__main__":
    main(tyro.cli(Config))
