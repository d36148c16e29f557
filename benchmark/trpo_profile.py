"""Profile of one TRPO-MLP update of trpo_gpt2_halfcheetah.py, before and after issue 17, and the rollout
against the raw stepping rate of the same vector env.

Update (in process): one batch of 15000 HalfCheetah-v5 steps (10 envs, a copy of the script's rollout loop:
normalised observations, the policy's Gaussian actions) is collected once; then the value fit
(`fit_value_lbfgs`) and the policy step (`trpo_step`: gradient, CG with Fisher-vector products, line search)
of two versions of the script run on copies of the SAME networks and batch, alternating, `--repeats` times:
`before` = the script as of a git revision (default 759e27f, before issue 17), `after` = the working tree,
with its default flags, and with any extra `--after-flags` (e.g. the float32 option) as a third column.
Medians of the seconds per part; the number of L-BFGS objective evaluations and the maximum difference of
the resulting parameters are printed as well.

Rollout: the same SyncVectorEnv (10 x HalfCheetah-v5, SAME_STEP autoreset) stepped in process with pre-drawn
random actions and nothing else ("raw"), against the script's own rollout loop for the same number of steps
(policy forward, sampling, observation normalisation, buffers, episode bookkeeping, TensorBoard), i.e. the
`time/rollout_seconds` of a one-update run of the working tree's script as a subprocess; alternating.

    OMP_NUM_THREADS=1 python benchmark/trpo_profile.py                    # writes benchmark/out/trpo_profile.json
    OMP_NUM_THREADS=1 python benchmark/trpo_profile.py --repeats 3 --before 759e27f
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import gymnasium as gym
import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "trpo_gpt2_halfcheetah.py"


def load_version(rev: str | None, tmp: str, name: str):
    """The script's module at git revision `rev` (None: the working tree)."""
    path = os.path.join(ROOT, SCRIPT)
    if rev is not None:
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w") as f:
            f.write(subprocess.run(["git", "show", f"{rev}:{SCRIPT}"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_envs(mod, n: int):
    return gym.vector.SyncVectorEnv([mod.make_env("HalfCheetah-v5", i, False, "") for i in range(n)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def rollout(mod, policy, envs, obs_rms, next_obs, T: int, dtype):
    """A copy of the script's rollout loop (torch forward of the policy; main() now uses numpy for the MLP), minus
    TensorBoard: returns the buffers and the last obs. Used to make the batch the update is profiled on."""
    N = envs.num_envs
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)
    next_obs_buf = np.zeros((T, N, obs_dim), dtype=np.float32)
    actions_buf = np.zeros((T, N, act_dim), dtype=np.float32)
    rewards_buf, terms, dones_buf = (np.zeros((T, N)) for _ in range(3))
    ep_ret, ep_len, finished = np.zeros(N), np.zeros(N, dtype=np.int64), []
    with torch.no_grad():
        log_std = policy.action_log_std.detach().float().cpu().numpy()[0]
        for step in range(T):
            obs_buf[step] = next_obs
            mean = policy(torch.from_numpy(next_obs).to(dtype=dtype)).float().numpy()
            action = (mean + np.exp(log_std) * torch.randn(mean.shape, dtype=torch.float64).numpy()).astype(np.float32)
            actions_buf[step] = action
            raw, reward, term, trunc, infos = envs.step(np.clip(action, low, high))
            dones = np.logical_or(term, trunc)
            obs_rms.update(raw)
            next_obs = obs_rms.normalize(raw)
            rewards_buf[step], terms[step], dones_buf[step], next_obs_buf[step] = reward, term, dones, next_obs
            ep_ret += reward
            ep_len += 1
            for i in np.flatnonzero(dones):
                next_obs_buf[step, i] = obs_rms.normalize(infos["final_obs"][i])
                finished.append(ep_ret[i])
                ep_ret[i], ep_len[i] = 0.0, 0
    return (obs_buf, next_obs_buf, actions_buf, rewards_buf, terms, dones_buf), next_obs


def update_parts(mod, policy, value_net, batch, flags: dict, dtype) -> dict:
    """The update of main() on one batch: GAE, value fit, trpo_step; seconds per part."""
    obs_buf, next_obs_buf, actions_buf, rewards_buf, terms, dones_buf = batch
    T, N, obs_dim = obs_buf.shape
    args = mod.Args(policy="mlp", **flags)
    b_obs = torch.from_numpy(obs_buf.reshape(-1, obs_dim)).to(dtype)
    with torch.no_grad():
        values = value_net(b_obs).numpy().reshape(T, N)
        next_values = value_net(torch.from_numpy(next_obs_buf.reshape(-1, obs_dim)).to(dtype)).numpy().reshape(T, N)
    adv, ret = mod.compute_gae(rewards_buf, values, next_values, terms, dones_buf, args.gamma, args.gae_lambda)
    b_adv = torch.from_numpy(adv.reshape(-1)).to(dtype)
    b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
    b_ret = torch.from_numpy(ret.reshape(-1)).to(dtype)
    b_act = torch.from_numpy(actions_buf.reshape(-1, actions_buf.shape[-1])).to(dtype)
    evals = [0]
    orig = torch.optim.LBFGS.step

    def counting_step(self, closure):
        def counted():
            evals[0] += 1
            return closure()
        return orig(self, counted)

    torch.optim.LBFGS.step = counting_step
    try:
        t0 = time.perf_counter()
        v_loss = mod.fit_value_lbfgs(value_net, b_obs, b_ret, args.l2_reg, args.vf_iters)
        t_value = time.perf_counter() - t0
    finally:
        torch.optim.LBFGS.step = orig
    params = [p for p in policy.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    stats = mod.trpo_step(policy, params, policy.encode(b_obs), b_act, b_adv, args)
    t_step = time.perf_counter() - t0
    return {"value_fit": t_value, "gradient": stats["grad_seconds"], "cg": stats["cg_seconds"],
            "line_search": stats["line_search_seconds"], "policy_step_total": t_step,
            "update_total": t_value + t_step, "lbfgs_evaluations": evals[0], "kl": stats["kl"],
            "value_loss": v_loss, "accepted": stats["accepted"]}


def script_rollout_seconds(steps: int, seed: int) -> float:
    """time/rollout_seconds of one `--policy mlp` update of the script (working tree) run as a subprocess."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run([sys.executable, os.path.join(ROOT, SCRIPT), "--policy", "mlp", "--total-timesteps", str(steps),
                        "--batch-size", str(steps), "--seed", str(seed), "--torch-threads", "1"], cwd=cwd, check=True,
                       capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        (run,) = [os.path.join(cwd, "runs", d) for d in os.listdir(os.path.join(cwd, "runs"))]
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        return acc.Scalars("time/rollout_seconds")[0].value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="759e27f", help="git revision of the 'before' script")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--after-flags", default="mlp_dtype=float32",
                    help="comma-separated Args overrides for a third column (empty: none)")
    ap.add_argument("--rollout-steps", type=int, default=1500, help="steps per env in the rollout comparison")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark", "out", "trpo_profile.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        before = load_version(a.before, tmp, "trpo_before")
        after = load_version(None, tmp, "trpo_after")
        variants = [("before", before, {}), ("after", after, {})]
        if a.after_flags:
            extra = {}
            for kv in a.after_flags.split(","):
                k, v = kv.split("=")
                extra[k] = v
            variants.append((f"after {a.after_flags}", after, extra))

        # one batch from the script's rollout path, with a slightly trained-looking policy (random init)
        torch.manual_seed(1)
        np.random.seed(1)
        envs = make_envs(after, 10)
        obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
        obs_rms = after.RunningMeanStd(obs_dim)
        raw, _ = envs.reset(seed=1)
        obs_rms.update(raw)
        policy0 = after.MLPPolicy(obs_dim, act_dim).double()
        value0 = after.ValueNet(obs_dim).double()
        batch, next_obs = rollout(after, policy0, envs, obs_rms, obs_rms.normalize(raw), 1500, torch.float64)

        rows = {name: [] for name, _, _ in variants}
        finals = {}
        for r in range(a.repeats):
            for name, mod, flags in variants:
                dtype = torch.float32 if flags.get("mlp_dtype") == "float32" else torch.float64
                pol = mod.MLPPolicy(obs_dim, act_dim).to(dtype)
                pol.load_state_dict(policy0.state_dict())
                vn = mod.ValueNet(obs_dim).to(dtype)
                vn.load_state_dict(value0.state_dict())
                rows[name].append(update_parts(mod, pol, vn, batch, flags, dtype))
                finals[name] = torch.cat([p.detach().double().reshape(-1) for p in
                                          list(pol.parameters()) + list(vn.parameters())])
            print(f"repeat {r + 1}: " + "; ".join(f"{n} {rows[n][-1]['update_total']:.3f} s" for n in rows),
                  flush=True)

        envs.close()

    # rollout vs raw stepping, alternating: the raw vector env in process, the script's real loop as a subprocess
    raw_t, ours_t = [], []
    steps = a.rollout_steps * 10
    for r in range(a.repeats):
        envs = make_envs(after, 10)
        envs.reset(seed=r)
        low, high = envs.single_action_space.low, envs.single_action_space.high
        acts = np.random.default_rng(r).uniform(low, high, (a.rollout_steps, 10, act_dim)).astype(np.float32)
        t0 = time.perf_counter()
        for i in range(a.rollout_steps):
            envs.step(acts[i])
        raw_t.append(time.perf_counter() - t0)
        envs.close()
        ours_t.append(script_rollout_seconds(steps, r + 1))
        print(f"rollout repeat {r + 1}: raw {raw_t[-1]:.3f} s, script {ours_t[-1]:.3f} s", flush=True)

    med = {n: {k: statistics.median(x[k] for x in v) for k in v[0] if isinstance(v[0][k], (int, float))}
           for n, v in rows.items()}
    diffs = {n: float((finals[n] - finals["before"]).abs().max()) for n in finals if n != "before"}
    out = {"before_rev": a.before, "repeats": a.repeats, "load_before": round(load0, 2),
           "load_after": round(os.getloadavg()[0], 2), "medians": med, "max_param_diff_vs_before": diffs,
           "rollout": {"steps": steps, "raw_seconds_median": statistics.median(raw_t),
                       "ours_seconds_median": statistics.median(ours_t),
                       "raw_steps_per_s": steps / statistics.median(raw_t),
                       "ours_steps_per_s": steps / statistics.median(ours_t),
                       "ours_over_raw_time": statistics.median(ours_t) / statistics.median(raw_t)},
           "torch": torch.__version__}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    keys = ["value_fit", "lbfgs_evaluations", "gradient", "cg", "line_search", "update_total", "kl"]
    print("| part | " + " | ".join(med) + " |")
    print("|---|" + "---|" * len(med))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{med[n][k]:.4g}" for n in med) + " |")
    print(f"max |param difference| vs before after one update (policy and value): {diffs}")
    ro = out["rollout"]
    print(f"rollout {steps} steps: raw vector env {ro['raw_seconds_median']:.3f} s ({ro['raw_steps_per_s']:.0f} "
          f"steps/s), ours {ro['ours_seconds_median']:.3f} s ({ro['ours_steps_per_s']:.0f} steps/s), "
          f"ours / raw time {ro['ours_over_raw_time']:.2f}")
    print(f"1-minute load average: {out['load_before']} before, {out['load_after']} after; wrote {a.out}")


if __name__ == "__main__":
    main()
