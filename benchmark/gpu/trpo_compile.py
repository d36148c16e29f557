"""Device check of `trpo_gpt2_halfcheetah.py --compile` on one GPU: GPT-2 small's architecture (random init, so no
hub is needed; the compute is the pretrained model's), `--fvp-subsample 5`, the default 10 envs and 15000-step batches.

    python benchmark/gpu/trpo_compile.py --out DIR [--limit 330]

1. the floor: stepping the 10 HalfCheetah-v5 envs alone (random actions), in steps/s;
2. eager: 2 updates (30k steps), the rollout / update split;
3. compiled (`--compile`): the full 1M-step run, wall time end to end, stopped by SIGINT after `--limit` seconds
   (the script then finishes its current update and exits, so a partial run still reports its updates);
4. the other scripts' default CUDA paths, briefly (train, save, evaluate the checkpoint again);
5. if time is left: 2 compiled updates with TF32 matmuls allowed (set from outside the script), to see whether a
   `--tf32` flag would pay.
Writes DIR/summary.json and prints every time/* series.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "trpo_gpt2_halfcheetah.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import read_scalars  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--limit", type=float, default=330.0)
p.add_argument("--budget", type=float, default=520.0, help="skip step 4 when less than 90 s of this is left")
p.add_argument("--dry", action="store_true", help="a CPU check of this driver: a tiny GPT-2, 3000-step runs")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
T0, summary = time.time(), {}
BASE = ["--llm-init", "random", "--fvp-subsample", "5", "--seed", "543"] + (
    ["--llm-layers", "2", "--llm-embd", "128", "--llm-heads", "2", "--batch-size", "1000", "--total-timesteps", "3000"]
    if a.dry else [])
TAGS = ("time/rollout_seconds", "time/update_seconds", "time/value_fit_seconds", "time/value_fit_wait_seconds",
        "time/grad_seconds", "time/cg_seconds", "time/line_search_seconds", "losses/kl", "charts/step_accepted",
        "charts/SPS", "charts/episodic_return")


def env_floor(steps_per_env: int = 3000) -> dict:
    import gymnasium as gym
    import numpy as np
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("HalfCheetah-v5")] * 10,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    acts = rng.uniform(-1, 1, (steps_per_env, 10, 6)).astype(np.float32)
    t0 = time.time()
    for t in range(steps_per_env):
        envs.step(acts[t])
    sec = time.time() - t0
    return {"steps": 10 * steps_per_env, "seconds": sec, "steps_per_s": 10 * steps_per_env / sec,
            "seconds_per_1M": 1e6 / (10 * steps_per_env / sec)}


def run(name: str, flags: list[str], limit: float, prelude: str = "") -> dict:
    cwd = tempfile.mkdtemp(prefix=name + "_")
    if prelude:  # run the script in-process after `prelude` (a backend switch the script has no flag for)
        cmd = [sys.executable, "-c", f"{prelude}; import runpy, sys; sys.argv = {[SCRIPT] + flags!r}; "
               f"runpy.run_path({SCRIPT!r}, run_name='__main__')"]
    else:
        cmd = [sys.executable, SCRIPT] + flags
    t0 = time.time()
    proc = subprocess.run(["timeout", "-s", "INT", "-k", "60", str(int(limit))] + cmd, cwd=cwd, capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    wall = time.time() - t0
    print(f"== {name}: {' '.join(flags)} {prelude}\nrc {proc.returncode}, wall {wall:.1f} s", flush=True)
    print(proc.stdout[-2500:], proc.stderr[-2500:], flush=True)
    runs = [os.path.join(cwd, "runs", d) for d in os.listdir(os.path.join(cwd, "runs"))] \
        if os.path.isdir(os.path.join(cwd, "runs")) else []
    res = {"flags": flags, "prelude": prelude, "rc": proc.returncode, "wall_seconds": wall}
    if runs:
        for tag in TAGS:
            vals = [v for _, v in read_scalars(runs[0], tag)]
            res[tag] = [round(v, 4) for v in vals] if tag != "charts/episodic_return" else \
                {"episodes": len(vals), "last20_mean": round(statistics.mean(vals[-20:]), 2) if vals else None}
            if tag.startswith("time/") and vals:
                print(f"{tag}: n={len(vals)} sum={sum(vals):.1f} median={statistics.median(vals):.3f} "
                      f"first={vals[0]:.2f}", flush=True)
        steps = [s for s, _ in read_scalars(runs[0], "charts/SPS")]
        res["steps_done"] = steps[-1] if steps else 0
    print(f"-> {json.dumps({k: v for k, v in res.items() if not isinstance(v, list)})}", flush=True)
    return res


def save():
    summary["elapsed_seconds"] = time.time() - T0
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


import torch  # noqa: E402
summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
summary["versions"] = {"torch": torch.__version__, "python": sys.version.split()[0]}
summary["env_floor"] = env_floor()
print("env floor:", summary["env_floor"], flush=True)
save()
summary["eager_2_updates"] = run("eager", BASE + ["--total-timesteps", "30000"], 240)
save()
summary["compiled_1M"] = run("compiled", BASE + ["--compile"], a.limit)
save()


def smoke() -> list:
    """Each script on CUDA by default for a few seconds: exit code, the device line, the evaluation line."""
    out, cwd = [], tempfile.mkdtemp(prefix="smoke_")
    cmds = [["ppo_cartpole.py", "--total-timesteps", "2048", "--save-model", "--eval-episodes", "2"],
            ["gpt2ppo_lunar.py", "--env-id", "Acrobot-v1", "--critic", "gpt2", "--total-timesteps", "1024",
             "--steps-per-epoch", "512", "--save-model", "--eval-episodes", "2"],
            ["trpo_gpt2_halfcheetah.py", "--policy", "mlp", "--total-timesteps", "4000", "--batch-size", "2000",
             "--save-model", "--eval-episodes", "2"]]
    for c in cmds:
        before = set(os.listdir(os.path.join(cwd, "runs"))) if os.path.isdir(os.path.join(cwd, "runs")) else set()
        r = subprocess.run(["timeout", "120", sys.executable, os.path.join(ROOT, c[0])] + c[1:], cwd=cwd,
                           capture_output=True, text=True)
        new = sorted(set(os.listdir(os.path.join(cwd, "runs"))) - before) if os.path.isdir(os.path.join(cwd, "runs")) else []
        pts = [os.path.join(cwd, "runs", d, f) for d in new for f in os.listdir(os.path.join(cwd, "runs", d))
               if f.endswith(".pt")]
        e = subprocess.run(["timeout", "120", sys.executable, os.path.join(ROOT, c[0]), "--eval-checkpoint", pts[0],
                            "--eval-episodes", "2"], cwd=cwd, capture_output=True, text=True) if pts else None
        out.append({"cmd": " ".join(c), "rc": r.returncode, "tail": (r.stdout + r.stderr)[-600:],
                    "eval_rc": e.returncode if e else None, "eval_tail": (e.stdout + e.stderr)[-400:] if e else ""})
        print(json.dumps(out[-1], indent=1), flush=True)
    return out


summary["smoke"] = smoke()
save()
if a.budget - (time.time() - T0) > 90:
    summary["compiled_tf32_2_updates"] = run("compiled_tf32", BASE + ["--compile", "--total-timesteps", "30000"],
                                             a.budget - (time.time() - T0) - 10,
                                             "import torch; torch.backends.cuda.matmul.allow_tf32 = True")
    save()
print("done in", round(time.time() - T0, 1), "s", flush=True)
