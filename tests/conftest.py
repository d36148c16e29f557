"""Shared test helpers: run a script as a user would (a subprocess in a temporary folder) and
read back what it logged to TensorBoard."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_script(script: str, *flags: str, cwd: str, timeout: float = 300, check: bool = True):
    """Run `python script flags...` in `cwd` (so its runs/ folder lands there)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(flags)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def read_scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    """All (step, value) events of `tag` in the event files of `run_dir`, in write order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def only_run_dir(cwd: str, pattern: str = "*") -> str:
    dirs = sorted(glob.glob(os.path.join(cwd, "runs", pattern)))
    assert len(dirs) == 1, f"expected one run folder, found {dirs}"
    return dirs[0]


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path)
