"""Wall time per epoch (2048 env steps + the PPO update) of gpt2ppo_lunar.py's GPT-2 critic against
its MLP critic, measured side by side on the same machine.

Every configuration runs as its own process, one after another, repeated in turn (mlp, gpt2, ...,
mlp, gpt2, ...) so a competing process slows all alike; per-epoch rollout and update seconds are
read back from TensorBoard (`time/rollout_seconds`, `time/update_seconds`). Prints a table with the
median seconds per epoch, steps per second and the ratio to the MLP critic.

    python benchmark/gpt2ppo_speed.py --epochs 3 --repeats 2
    python benchmark/gpt2ppo_speed.py --configs "mlp" "gpt2 --value-stride 64" "gpt2" --epochs 1
"""

from __future__ import annotations

import glob
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class Args:
    env_id: str = "LunarLander-v3"
    """environment"""
    epochs: int = 3
    """epochs (rollouts of --steps-per-epoch 2048 steps + updates) per timed run"""
    repeats: int = 1
    """runs of each configuration"""
    configs: list[str] = field(default_factory=lambda: ["mlp", "gpt2 --value-stride 64", "gpt2 --value-stride 32"])
    """configurations: the critic, then extra gpt2ppo_lunar.py flags (Table I defaults otherwise)"""


def epoch_seconds(cmd: list[str]) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        acc = EventAccumulator(glob.glob(os.path.join(cwd, "runs", "*"))[0], size_guidance={"scalars": 0})
        acc.Reload()
        roll = [e.value for e in acc.Scalars("time/rollout_seconds")]
        upd = [e.value for e in acc.Scalars("time/update_seconds")]
    return [r + u for r, u in zip(roll, upd)]


def main(args: Args) -> None:
    per = {c: [] for c in args.configs}
    for _ in range(args.repeats):
        for config in args.configs:
            critic, *extra = shlex.split(config)
            cmd = [sys.executable, os.path.join(ROOT, "gpt2ppo_lunar.py"), "--env-id", args.env_id, "--critic", critic,
                   "--total-timesteps", str(2048 * args.epochs), "--steps-per-epoch", "2048", "--no-progress", *extra]
            secs = epoch_seconds(cmd)
            per[config] += secs
            print(f"{config}: " + ", ".join(f"{s:.2f}" for s in secs) + " s per epoch", flush=True)
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"\nmachine: {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")
    base = statistics.median(per[args.configs[0]])
    print(f"| critic | s per epoch (median) | env steps/s | x {args.configs[0]} |\n|---|---|---|---|")
    for config, secs in per.items():
        med = statistics.median(secs)
        print(f"| `{config}` | {med:.2f} | {2048 / med:.0f} | {med / base:.1f} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
