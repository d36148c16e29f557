"""Learning curves of gpt2ppo_lunar.py: GPT-2 critic against MLP critic, several seeds.

Each (critic, seed) run is a separate `gpt2ppo_lunar.py` process (run one after another, so the
2-core machine is not oversubscribed). After each run its episodic returns are read back from
TensorBoard and appended to a JSON file (so partial results survive an interrupted sweep); `--plot`
draws mean +- min/max over seeds of the 100-episode moving average against environment steps.

    python benchmark/gpt2ppo_curves.py --env-id LunarLander-v3 --total-timesteps 307200 \
        --seeds 123 124 125 --runs "mlp" "gpt2 --value-stride 64" --out benchmark/gpt2ppo_lunar_307k.json
    python benchmark/gpt2ppo_curves.py --plot benchmark/gpt2ppo_lunar_307k.json
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class Args:
    env_id: str = "LunarLander-v3"
    """environment"""
    total_timesteps: int = 307200
    """steps per run (Table I: 150 x 2048)"""
    seeds: list[int] = field(default_factory=lambda: [123, 124, 125])
    """seeds of each configuration"""
    runs: list[str] = field(default_factory=lambda: ["mlp", "gpt2 --value-stride 64"])
    """configurations: the critic, then any extra gpt2ppo_lunar.py flags"""
    out: str = "benchmark/gpt2ppo_curves.json"
    """JSON file the results are appended to"""
    plot: Optional[str] = None
    """only plot this JSON file (to the same name with .png)"""


def returns_of(run_dir: str) -> tuple[list[int], list[float], float]:
    """Episodic returns (steps, values) and the critic's mean explained variance over the last 10 epochs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    ev = acc.Scalars("charts/episodic_return")
    ex_var = float(np.nanmean([e.value for e in acc.Scalars("losses/explained_variance")][-10:]))
    return [e.step for e in ev], [e.value for e in ev], ex_var


def moving(x: list[float], n: int = 100) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    c = np.cumsum(np.insert(x, 0, 0.0))
    return np.array([(c[i + 1] - c[max(0, i + 1 - n)]) / (i + 1 - max(0, i + 1 - n)) for i in range(len(x))])


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.load(open(path))
    fig, ax = plt.subplots(figsize=(7, 4))
    grid = None
    for label in dict.fromkeys(r["config"] for r in results):
        runs = [r for r in results if r["config"] == label]
        total = max(r["total_timesteps"] for r in runs)
        grid = np.linspace(0, total, 200)
        curves = np.stack([np.interp(grid, r["steps"], moving(r["returns"]), left=np.nan) for r in runs])
        with warnings.catch_warnings():  # before the first finished episode every seed is NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, lo, hi = np.nanmean(curves, 0), np.nanmin(curves, 0), np.nanmax(curves, 0)
        ax.plot(grid, mean, label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        ax.fill_between(grid, lo, hi, alpha=0.2)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("return (100-episode moving average)")
    ax.set_title(results[0]["env_id"])
    ax.legend()
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def main(args: Args) -> None:
    if args.plot:
        plot(args.plot)
        return
    results = json.load(open(args.out)) if os.path.exists(args.out) else []
    for config in args.runs:
        critic, *extra = shlex.split(config)
        for seed in args.seeds:
            if any(r["config"] == config and r["seed"] == seed and r["env_id"] == args.env_id
                   and r["total_timesteps"] == args.total_timesteps for r in results):
                continue  # already measured (resume)
            with tempfile.TemporaryDirectory() as cwd:
                cmd = [sys.executable, os.path.join(ROOT, "gpt2ppo_lunar.py"), "--env-id", args.env_id, "--critic",
                       critic, "--seed", str(seed), "--total-timesteps", str(args.total_timesteps), "--no-progress",
                       *extra]
                t0 = time.time()
                proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"))
                wall = time.time() - t0
                if proc.returncode != 0:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    sys.exit(f"error: run failed: {' '.join(cmd)}")
                steps, rets, ex_var = returns_of(glob.glob(os.path.join(cwd, "runs", "*"))[0])
            final = float(np.mean(rets[-100:])) if rets else float("nan")
            results.append({"env_id": args.env_id, "config": config, "seed": seed,
                            "total_timesteps": args.total_timesteps, "wall_s": round(wall, 1),
                            "final_mean_last100": final, "episodes": len(rets),
                            "explained_variance_last10_epochs": round(ex_var, 3),
                            "command": "python gpt2ppo_lunar.py " + " ".join(shlex.quote(c) for c in cmd[2:]),
                            "steps": steps, "returns": [round(r, 2) for r in rets]})
            json.dump(results, open(args.out, "w"))
            print(f"{args.env_id} {config} seed {seed}: last-100 mean {final:.1f} over {len(rets)} episodes, "
                  f"{wall:.0f} s", flush=True)
    for config in args.runs:
        finals = [r["final_mean_last100"] for r in results if r["config"] == config and r["env_id"] == args.env_id
                  and r["total_timesteps"] == args.total_timesteps]
        if finals:
            print(f"{args.env_id} {config}: {np.mean(finals):.1f} +- {np.std(finals):.1f} ({len(finals)} seeds)")


if __name__ == "__main__":
    main(tyro.cli(Args))
