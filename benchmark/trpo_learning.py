"""Learning curves of trpo_gpt2_halfcheetah.py on HalfCheetah-v5: plot and summarise runs.

The runs themselves are plain invocations of the script (recorded in benchmark/trpo_results.md),
e.g. for the MLP baseline, 1M steps, seeds 543, 1, 2:

    OMP_NUM_THREADS=1 nice python trpo_gpt2_halfcheetah.py --policy mlp --seed 543 --total-timesteps 1000000 \\
        --exp-name trpo_mlp --no-progress

This script reads their TensorBoard event files and writes a plot of the training episodic return
(each point: the mean of the episodes that ended in one update, i.e. over one batch) and a table:

    python benchmark/trpo_learning.py --runs 'benchmark/out/trpo_learn/runs/*' --out benchmark/trpo_halfcheetah.png
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import read_scalars  # noqa: E402


def curve(run: str, batch: int = 15000):
    ev = read_scalars(run, "charts/episodic_return")
    steps = np.array([s for s, _ in ev])
    rets = np.array([v for _, v in ev])
    xs, ys = [], []
    for end in range(batch, int(steps.max()) + batch, batch):
        m = (steps > end - batch) & (steps <= end)
        if m.any():
            xs.append(end)
            ys.append(rets[m].mean())
    return np.array(xs), np.array(ys), steps, rets


def label_of(run: str) -> str:
    name = os.path.basename(run)  # env__exp__seed__time
    parts = name.split("__")
    return f"{parts[1]} seed {parts[2]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", required=True, help="run folders or glob patterns")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark", "trpo_halfcheetah.png"))
    ap.add_argument("--last", type=int, default=30, help="summarise the mean of the last N episodes")
    ap.add_argument("--at", type=int, nargs="*", default=[300000, 600000],
                    help="also the mean return of the episodes ending within 30k steps before these steps")
    a = ap.parse_args()
    runs = sorted({r for pat in a.runs for r in glob.glob(pat)})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"543": "-", "1": "--", "2": ":"}
    at_cols = "".join(f" at {x // 1000}k |" for x in a.at)
    print(f"| run | env steps | mean return, last {a.last} episodes | best batch mean |{at_cols}")
    print("|---|---|---|---|" + "---|" * len(a.at))
    for run in runs:
        xs, ys, steps, rets = curve(run)
        if not len(xs):
            continue
        gpt2 = "gpt2" in label_of(run)
        ax.plot(xs, ys, label=label_of(run), lw=1.2, color="tab:orange" if gpt2 else "tab:blue",
                ls=styles[label_of(run).split(" seed ")[1]] if label_of(run).split(" seed ")[1] in styles else "-")
        at_vals = ""
        for x in a.at:
            m = (steps > x - 30000) & (steps <= x)
            at_vals += f" {rets[m].mean():.1f} |" if m.any() and steps.max() >= x else " - |"
        print(f"| {label_of(run)} | {int(steps.max()):,} | {rets[-a.last:].mean():.1f} | {ys.max():.1f} |{at_vals}")
    ax.axhline(1803, color="k", ls="--", lw=0.8, label="SB3-contrib TRPO, 1M steps (1803)")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("training episodic return (per-batch mean)")
    ax.set_title("TRPO on HalfCheetah-v5 (CPU, contended)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=80)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
