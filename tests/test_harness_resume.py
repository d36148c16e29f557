"""The harness continues stopped runs: locally, a run whose script was stopped resumes from its training state on the
next call; on a real Slurm cluster (tests/slurm_cluster.py), the runs go out as one job array, the store is written by
the job after it, and a task that Slurm stops (`scontrol requeue`) resumes where it stopped."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, all_scalars
from slurm_cluster import wait_for_jobs

RUN_PY = os.path.join(ROOT, "benchmark", "run.py")


def _harness(tmp_path, *flags, steps=20480, seeds=("1",)):
    """`benchmark/run.py` on ppo_cartpole's CartPole-v1 default setting at a small budget, writing under tmp_path."""
    out = tmp_path / "out"
    return [
        sys.executable,
        RUN_PY,
        "--scripts",
        "ppo_cartpole",
        "--envs",
        "CartPole-v1",
        "--settings",
        "default",
        "--steps",
        str(steps),
        "--seeds",
        *seeds,
        "--runs-dir",
        str(tmp_path / "runs"),
        "--results-dir",
        str(out / "results"),
        "--results-md",
        str(out / "results.md"),
        "--plots-dir",
        str(out / "plots"),
        *flags,
    ]


def _wait_for(pattern: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while not glob.glob(pattern):
        assert time.time() < deadline, f"nothing matched {pattern} after {timeout} s"
        time.sleep(0.2)
    return glob.glob(pattern)[0]


def _stored(tmp_path) -> dict:
    (path,) = glob.glob(str(tmp_path / "out" / "results" / "ppo_cartpole" / "*.json"))
    with open(path) as f:
        return json.load(f)


def _check_whole(run_folder: str, updates: int) -> None:
    """The script's TensorBoard log: every update logged once, as in a run that was never stopped."""
    (run,) = glob.glob(os.path.join(run_folder, "runs", "*"))
    steps = [s for s, _ in all_scalars(run)["losses/policy_loss"]]
    assert steps == [512 * (i + 1) for i in range(updates)], steps


@pytest.mark.slow
def test_a_harness_stopped_by_sigterm_stops_its_run_which_resumes_on_the_next_call(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(_harness(tmp_path, "--workers", "1"), env=env, text=True, stderr=subprocess.PIPE)
    state = _wait_for(str(tmp_path / "runs" / "*" / "runs" / "*" / "training_state.pt"))
    first.send_signal(signal.SIGTERM)  # as a scheduler stops the harness: it passes the signal on to its run
    _, err = first.communicate(timeout=120)
    assert first.returncode == 143 and "SIGTERM: passed on to 1 running scripts" in err and "Traceback" not in err
    folder = os.path.dirname(os.path.dirname(os.path.dirname(state)))
    log = open(os.path.join(folder, "run.log")).read()
    assert "interrupted (continue it: --resume" in log and not os.path.exists(os.path.join(folder, "done.json"))
    second = subprocess.run(_harness(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    log = open(os.path.join(folder, "run.log")).read()
    assert "resumed: python ppo_cartpole.py" in log and "--resume runs/" in log
    _check_whole(folder, 40)
    marker = json.load(open(os.path.join(folder, "done.json")))
    assert marker["resumed"] and len(open(os.path.join(folder, "attempts.log")).readlines()) == 2
    assert _stored(tmp_path)["seeds"] == [1]


@pytest.mark.slow
def test_a_run_killed_after_its_last_update_is_finished_by_a_resume(tmp_path):
    """A run whose training state holds its last update but that has no marker (killed before the harness wrote it)
    is resumed: the script runs no update again and ends the run."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    assert subprocess.run(_harness(tmp_path, steps=2048), env=env, capture_output=True, timeout=300).returncode == 0
    (marker,) = glob.glob(str(tmp_path / "runs" / "*" / "done.json"))
    os.remove(marker)
    again = subprocess.run(_harness(tmp_path, steps=2048), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.load(open(marker))["resumed"]
    _check_whole(os.path.dirname(marker), 4)


def _submit(tmp_path, env, **kw) -> str:
    """`--slurm`: the harness submits the runs and returns at once; its output."""
    proc = subprocess.run(_harness(tmp_path, "--slurm", **kw), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one cluster at a time
def test_slurm_array_stores_two_runs(slurm_cluster, tmp_path):
    out = _submit(tmp_path, slurm_cluster, steps=2048, seeds=("1", "2"))
    array, collect = re.search(r"job array (\d+) .* and job (\d+)", out).groups()
    wait_for_jobs(slurm_cluster, array, timeout=600)
    wait_for_jobs(slurm_cluster, collect, timeout=300)
    row = _stored(tmp_path)
    assert row["seeds"] == [1, 2] and all(len(row["series"][k]["values"]) > 20 for k in ("1", "2"))
    assert os.path.isfile(tmp_path / "out" / "results.md")
    # submitting again submits nothing: both runs are complete
    assert "nothing to submit" in _submit(tmp_path, slurm_cluster, steps=2048, seeds=("1", "2"))


@pytest.mark.parametrize(
    "stop",
    [["scontrol", "requeue"], ["scancel", "--full", "--signal=TERM"]],
    ids=["requeued by Slurm", "SIGTERM as at the time limit: the task requeues itself"],
)
@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one cluster at a time
def test_a_slurm_task_stopped_resumes(slurm_cluster, tmp_path, stop):
    array = re.search(r"job array (\d+) ", _submit(tmp_path, slurm_cluster)).group(1)
    state = _wait_for(str(tmp_path / "runs" / "*" / "runs" / "*" / "training_state.pt"))
    task = subprocess.run(
        ["squeue", "-h", "-o", "%A", "-j", array], env=slurm_cluster, capture_output=True, text=True
    ).stdout.split()[0]
    stopped = subprocess.run([*stop, task], env=slurm_cluster, capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr
    deadline, folder = time.time() + 600, os.path.dirname(os.path.dirname(os.path.dirname(state)))
    # until the requeued task has written its marker (the queue can be empty for a moment while a job is requeued)
    while not os.path.exists(os.path.join(folder, "done.json")):
        # a requeued job waits before it may start again; let it start now
        subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], env=slurm_cluster, capture_output=True)
        logs = "".join(open(p).read()[-1500:] for p in glob.glob(str(tmp_path / "runs" / "slurm-*.log")))
        assert time.time() < deadline, f"the requeued task did not finish: {logs}"
        time.sleep(1)
    log = open(os.path.join(folder, "run.log")).read()
    logs = "".join(open(p).read()[-1500:] for p in glob.glob(str(tmp_path / "runs" / "slurm-*.log")))
    assert "resumed: python ppo_cartpole.py" in log and "interrupted" in log, log + logs
    _check_whole(folder, 40)
