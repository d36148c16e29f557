"""Ctrl-C while a script is still importing its packages (before its run installs its own signal handler): one line
on stderr, exit 130, no traceback, nothing written. The first third-party import is held open by an import hook, so
the signal lands there on any machine, however fast its imports are."""

import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT

HOLD = """
import builtins, runpy, sys, time
real = builtins.__import__
def held(name, *a, **k):
    if name in ("gymnasium", "numpy") and not getattr(held, "done", False):
        held.done = True
        print("IMPORTING", flush=True)
        time.sleep(30)
    return real(name, *a, **k)
builtins.__import__ = held
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", ["ppo_cartpole.py", "gpt2ppo_lunar.py", "trpo_gpt2_halfcheetah.py",
                                    "icpi_chain.py"])
def test_ctrl_c_while_importing_is_one_line_and_exit_130(script, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, os.path.join(ROOT, script)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "IMPORTING"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.strip()] == [
        "interrupted while starting"], err
    assert os.listdir(tmp_path) == []
