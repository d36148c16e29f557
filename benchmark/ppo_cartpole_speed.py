"""Steps per second of ppo_cartpole.py against the CleanRL-style peer, measured side by side.

The two run alternately (peer, ours, peer, ours, ...) with the same hyperparameters (CleanRL's
defaults: 4 envs x 128 steps, 4 epochs x 4 minibatches) and the same step budget, so that a
competing process on the machine slows both alike. Prints each run and the ratio of medians.

    python benchmark/ppo_cartpole_speed.py --steps 100000 --repeats 3
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class Args:
    steps: int = 100000
    """environment steps per timed run"""
    repeats: int = 3
    """runs of each program"""


def timed(cmd: list[str], cwd: str) -> float:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True).stdout
    return float(re.findall(r"([0-9.]+) steps/s", out)[-1])


def main(args: Args) -> None:
    ours, peer = [], []
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.repeats):
            peer.append(timed([sys.executable, os.path.join(HERE, "cleanrl_style_ppo.py"),
                               "--total-timesteps", str(args.steps)], cwd))
            ours.append(timed([sys.executable, os.path.join(ROOT, "ppo_cartpole.py"), "--total-timesteps",
                               str(args.steps), "--no-progress"], cwd))
            print(f"peer {peer[-1]:.0f} steps/s, ppo_cartpole.py {ours[-1]:.0f} steps/s", flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {cpu}, {os.cpu_count()} cores; {args.steps} steps x {args.repeats} runs each")
    print(f"median SPS: ppo_cartpole.py {statistics.median(ours):.0f}, cleanrl-style peer "
          f"{statistics.median(peer):.0f}, ratio {statistics.median(ours) / statistics.median(peer):.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args))
