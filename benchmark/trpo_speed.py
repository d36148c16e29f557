"""Speed of trpo_gpt2_halfcheetah.py: rollout cost against the bare GPT-2 forward, and the
time split of one TRPO update (value fit / surrogate gradient / CG / line search).

Part 1 (rollout, in process): for each policy, the same per-step work as the script's rollout
loop (normalise the observation, policy forward, sample the Gaussian, step 10 HalfCheetah-v5
envs) is timed over K steps, and so is the bare `GPT2Model` forward on inputs of the same shape
(K calls); the overhead is 1 - bare / rollout (medians of per-step times). The two alternate step
by step so that load from other processes on a shared machine hits them alike.

Part 2 (update, the real script as a subprocess): `time/*` scalars of one or two updates read
back from TensorBoard.

GPT-2 small is built from GPT2Config() with random weights (no download; the speed is the same
as the pretrained model's). The text encoding needs a tokenizer: offline we use the small
byte-level BPE tokenizer of tests/conftest.py, which splits the 17 printed numbers into ~72 tokens,
about what GPT-2's tokenizer gives (anchors.md: ~70).

    OMP_NUM_THREADS=1 python benchmark/trpo_speed.py            # writes benchmark/out/trpo_speed.json
    OMP_NUM_THREADS=1 python benchmark/trpo_speed.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import gymnasium as gym  # noqa: E402

import trpo_gpt2_halfcheetah as trpo  # noqa: E402
from conftest import build_tiny_gpt2, read_scalars  # noqa: E402

N_ENVS = 10


def make_llm_folder(root: str, small: bool) -> str:
    """A folder with the test tokenizer and (for `small`) GPT-2 small's config.json (random init reads only the
    config), else a 2-layer width-128 GPT-2."""
    folder = os.path.join(root, "gpt2_small" if small else "gpt2_2x128")
    os.makedirs(folder, exist_ok=True)
    build_tiny_gpt2(folder, n_layer=2, n_embd=128, n_head=2)
    if small:
        from transformers import GPT2Config

        cfg = GPT2Config()
        cfg.vocab_size = 50257
        cfg.save_pretrained(folder)
    return folder


def rollout_vs_bare(policy, obs_dim: int, steps: int) -> dict:
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("HalfCheetah-v5") for _ in range(N_ENVS)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    low, high = envs.single_action_space.low, envs.single_action_space.high
    rms = trpo.RunningMeanStd(obs_dim)
    raw, _ = envs.reset(seed=0)
    rms.update(raw)
    obs = rms.normalize(raw)
    log_std = policy.action_log_std.detach().numpy()[0]
    # the bare forward's input: same shape as what the policy feeds the transformer
    with torch.no_grad():
        enc = policy.encode(torch.from_numpy(obs))
        if "input_ids" in enc:
            L = enc["input_ids"].shape[1] + policy.prefix_ids.numel()
        else:
            L = (1 if policy.embed_tokens == "one" else obs_dim) + policy.prefix_ids.numel()
    d = policy.transformer.config.n_embd
    x_bare = torch.randn(N_ENVS, L, d)
    t_roll, t_bare = [], []
    mask = torch.ones(N_ENVS, L, dtype=torch.long)
    with torch.no_grad():
        policy(torch.from_numpy(obs)), policy.transformer(inputs_embeds=x_bare)  # warm-up
        for _ in range(steps):  # alternate step by step: background load hits both alike
            t0 = time.perf_counter()
            mean = policy(torch.from_numpy(obs)).numpy()
            action = (mean + np.exp(log_std) * torch.randn(mean.shape, dtype=torch.float64).numpy()).astype(
                np.float32)
            raw, reward, term, trunc, infos = envs.step(np.clip(action, low, high))
            rms.update(raw)
            obs = rms.normalize(raw)
            t_roll.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            policy.transformer(inputs_embeds=x_bare, attention_mask=mask)
            t_bare.append(time.perf_counter() - t0)
    envs.close()
    roll, bare = float(np.median(t_roll)), float(np.median(t_bare))  # medians: robust to load spikes
    return {"tokens": L, "steps": steps, "env_steps_per_s": N_ENVS / roll, "rollout_ms_per_step": 1000 * roll,
            "bare_forward_ms": 1000 * bare, "overhead": 1 - bare / roll}


def update_split(flags: list[str], cwd: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "trpo_gpt2_halfcheetah.py"), *flags, "--no-progress"],
                          cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    run = sorted(glob.glob(os.path.join(cwd, "runs", "*")), key=os.path.getmtime)[-1]
    out = {"wall_s": time.time() - t0, "flags": " ".join(flags)}
    for tag in ("rollout_seconds", "update_seconds", "value_fit_seconds", "grad_seconds", "cg_seconds",
                "line_search_seconds"):
        vals = [v for _, v in read_scalars(run, f"time/{tag}")]
        out[tag] = float(np.mean(vals[1:] if len(vals) > 1 else vals))  # skip the first update (warm-up)
    out["kl"] = [round(v, 5) for _, v in read_scalars(run, "losses/kl")]
    out["accepted"] = [v for _, v in read_scalars(run, "charts/step_accepted")]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-gpt2-small-update", action="store_true")
    ap.add_argument("--part", choices=["all", "rollout", "update"], default="all",
                    help="run one part only (the other part's results are kept from an existing --out file)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark", "out", "trpo_speed.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="trpo_speed_")
    small_dir, gpt2_dir = make_llm_folder(tmp, small=False), make_llm_folder(tmp, small=True)
    results = {"rollout": {}, "update": {}}
    if a.part != "all" and os.path.exists(a.out):
        with open(a.out) as f:
            results = json.load(f)
    results[f"time_{a.part}"] = time.ctime()

    steps = 10 if a.quick else 40
    for name, folder, init, enc, tokens, k in [
        ("gpt2-2x128 embed one", small_dir, "pretrained", "embed", "one", steps * 5),
        ("gpt2-2x128 embed per-dim", small_dir, "pretrained", "embed", "per-dim", steps * 5),
        ("gpt2-2x128 text", small_dir, "pretrained", "text", "one", steps),
        ("gpt2-small embed one", gpt2_dir, "random", "embed", "one", steps),
        ("gpt2-small embed per-dim", gpt2_dir, "random", "embed", "per-dim", steps // 2),
        ("gpt2-small text", gpt2_dir, "random", "text", "one", max(5, steps // 4)),
    ] if a.part != "update" else []:
        args = trpo.Args(llm=folder, llm_init=init, state_encoding=enc, embed_tokens=tokens)
        torch.manual_seed(0)
        policy = trpo.build_policy(args, 17, 6)
        results["rollout"][name] = r = rollout_vs_bare(policy, 17, k)
        print(f"rollout {name:28s} {r['tokens']:3d} tokens  {r['env_steps_per_s']:8.1f} env steps/s  "
              f"{r['rollout_ms_per_step']:8.1f} ms/step vs bare forward {r['bare_forward_ms']:8.1f} ms  "
              f"overhead {100 * r['overhead']:.0f}%", flush=True)
        del policy

    runs = [
        ("mlp, batch 15000", ["--policy", "mlp", "--total-timesteps", "30000"]),
        ("gpt2-2x128 embed one, batch 2000", ["--llm", small_dir, "--batch-size", "2000", "--total-timesteps",
                                             "4000"]),
        ("gpt2-2x128 embed one, batch 2000, fvp-subsample 5",
         ["--llm", small_dir, "--batch-size", "2000", "--total-timesteps", "4000", "--fvp-subsample", "5"]),
        ("gpt2-2x128 text, batch 200, fvp-subsample 5",
         ["--llm", small_dir, "--state-encoding", "text", "--batch-size", "200", "--total-timesteps", "400",
          "--fvp-subsample", "5"]),
    ]
    if not a.skip_gpt2_small_update:
        runs.append(("gpt2-small embed one, batch 200, fvp-subsample 5, finetune-blocks 2",
                     ["--llm", gpt2_dir, "--llm-init", "random", "--batch-size", "200", "--total-timesteps", "200",
                      "--fvp-subsample", "5", "--finetune-blocks", "2"]))
    for name, flags in runs if a.part != "rollout" else []:
        cwd = os.path.join(tmp, f"run{len(results['update'])}")
        os.makedirs(cwd)
        results["update"][name] = u = update_split(flags, cwd)
        print(f"update {name:70s} value {u['value_fit_seconds']:.2f}s grad {u['grad_seconds']:.2f}s "
              f"cg {u['cg_seconds']:.2f}s line search {u['line_search_seconds']:.2f}s "
              f"(rollout {u['rollout_seconds']:.1f}s) kl {u['kl']} accepted {u['accepted']}", flush=True)

    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
