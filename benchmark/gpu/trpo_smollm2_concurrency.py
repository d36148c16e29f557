"""Device check for the pretraining runs: SmolLM2-135M's first 2 blocks as the TRPO policy (`--fvp-subsample 5`,
`--compile`), alone and as K runs at once on one GPU, in seconds per update. The architecture comes from a folder
holding SmolLM2's config.json (`--llm-init random`: the pretrained model's compute without its 98 MB of weights).

    python benchmark/gpu/trpo_smollm2_concurrency.py --config-dir .smolcfg --out DIR [--k 6] [--limit 70]
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import read_scalars  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--config-dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--k", type=int, default=6)
p.add_argument("--limit", type=float, default=70.0)
p.add_argument("--extra", default="--compile", help="flags added to every run")
a = p.parse_args()
FLAGS = ["--llm", os.path.abspath(a.config_dir), "--llm-init", "random", "--llm-layers", "2", "--fvp-subsample", "5",
         "--total-timesteps", "150000", *a.extra.split()]


def start(i: int, limit: float):
    cwd = tempfile.mkdtemp(prefix=f"run{i}_")
    cmd = ["timeout", "-s", "INT", "-k", "30", str(int(limit)), sys.executable, os.path.join(ROOT,
           "trpo_gpt2_halfcheetah.py"), *FLAGS, "--seed", str(i + 1)]
    return cwd, subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))


def finish(cwd, proc) -> dict:
    out = proc.communicate()[0]
    runs = os.listdir(os.path.join(cwd, "runs")) if os.path.isdir(os.path.join(cwd, "runs")) else []
    res = {"rc": proc.returncode, "tail": out[-300:]}
    for tag in ("time/rollout_seconds", "time/update_seconds"):
        res[tag] = [round(v, 3) for _, v in read_scalars(os.path.join(cwd, "runs", runs[0]), tag)] if runs else []
    return res


summary = {"flags": FLAGS}
for k in (1, a.k):
    t0 = time.time()
    procs = [start(i, a.limit) for i in range(k)]
    res = [finish(*p_) for p_ in procs]
    later = [r for x in res for r in x["time/rollout_seconds"][1:]], [u for x in res for u in x["time/update_seconds"][1:]]
    summary[f"k{k}"] = {"wall_seconds": time.time() - t0, "runs": res,
                        "median_rollout_after_first": statistics.median(later[0]) if later[0] else None,
                        "median_update_after_first": statistics.median(later[1]) if later[1] else None}
    print(k, json.dumps({kk: v for kk, v in summary[f"k{k}"].items() if kk != "runs"}), flush=True)
    for r in res:
        print("  rc", r["rc"], "rollout", r["time/rollout_seconds"], "update", r["time/update_seconds"], flush=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
