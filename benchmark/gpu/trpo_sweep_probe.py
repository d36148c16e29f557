"""Device probe: N runs of the P/R architecture (2 SmolLM2 blocks, random init from its config) at once for 3
updates; per run the time to the first update's end, the steady wall time per update, the rollout seconds. Adds a
line to probe.json in the temporary folder and prints it. The architecture comes from a folder that holds SmolLM2's
config.json alone ($PROBE_LLM, default .dev/cfg: copied from the folder `--llm smollm2` converts into, under
~/.cache/trpo_gpt2_halfcheetah), so the probe needs only the first of the two calls that carry the model file."""

import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

root, n, tmp = os.getcwd(), int(sys.argv[1]), tempfile.gettempdir()
llm = os.path.abspath(os.environ.get("PROBE_LLM", ".dev/cfg"))
env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
flags = "--llm-layers 2 --llm-init random --fvp-subsample 5 --total-timesteps 45000 --torch-threads 1".split()
t0, procs = time.time(), []
for i in range(n):
    d = os.path.join(tmp, f"probe{n}", f"r{i}")
    os.makedirs(d, exist_ok=True)
    cmd = [sys.executable, f"{root}/trpo_gpt2_halfcheetah.py", "--llm", llm, *flags, "--seed", str(100 + i)]
    cmd += os.environ.get("PROBE_ARGS", "").split()
    procs.append(subprocess.Popen(cmd, cwd=d, env=env, stdout=open(f"{d}/log", "w"), stderr=subprocess.STDOUT))
rcs = [p.wait() for p in procs]
wall = time.time() - t0
first, steady, roll, upd = [], [], [], []
for i in range(n):
    d = os.path.join(tmp, f"probe{n}", f"r{i}")
    try:
        ea = EventAccumulator(glob.glob(f"{d}/runs/*/events*")[0])
        ea.Reload()
        sps = ea.Scalars("charts/SPS")
        first.append(sps[0].wall_time - t0)
        steady.append((sps[-1].wall_time - sps[0].wall_time) / (len(sps) - 1))
        roll += [e.value for e in ea.Scalars("time/rollout_seconds")[1:]]
        upd += [e.value for e in ea.Scalars("time/update_seconds")[1:]]
    except Exception as e:
        print(f"run {i}: {e!r}; rc {rcs[i]}; log tail:", open(f"{d}/log").read()[-800:])
out = dict(n=n, rcs=rcs, wall=round(wall, 1), first=max(first), steady=max(steady))
out.update(steady_median=statistics.median(steady), rollout=statistics.median(roll), update=statistics.median(upd))
print(json.dumps(out))
path = os.path.join(tmp, "probe.json")
old = json.load(open(path)) if os.path.exists(path) else {}
json.dump({**old, str(n): out}, open(path, "w"))
