"""Speed measurements of the benchmark harness (`python benchmark/run.py --mode speed --speed NAME`), one
kind per script whose cost is not just steps per second, plus the raw GPU outputs of benchmark/gpu/:

  trpo     rollout cost against the bare GPT-2 forward (in process), and the time split of one TRPO update
           (value fit / surrogate gradient / CG / line search) read back from the real script's TensorBoard
  gpt2ppo  wall time per epoch (2048 env steps + the PPO update) of each critic configuration, run one after
           another in turn so that a competing process slows all alike
  icpi     model calls, token positions and wall time per real ICPI step: the original's pattern (one
           sampled call per prediction, no cache) against this implementation, same model/buffer/states
  trpo-profile      one 15000-step MLP update of trpo_gpt2_halfcheetah.py split in parts: the script at an older
                    git revision against the working tree (and Args overrides), same batch and networks,
                    alternating; and its rollout against the bare vector env's stepping rate
  (trpo-fvp and trpo-value-dtype: stored entries only; they measured options the script no longer has)

Each kind takes its own flags (the SPEED registry entry's `flags`; `--help` via `--speed NAME --speed-help`)
and returns a JSON-able dict that run.py stores as results/speed/<name>.json; `render` turns stored entries
into the tables of results.md. `gpu_entries` reads benchmark/gpu/ (outputs recorded on a lent H100) into
entries of the same kinds at every report, so those numbers are never copied by hand.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPU_DIR = os.path.join(HERE, "gpu")


# ----------------------------------------------------------------------------------------------
# trpo: rollout vs bare forward, update split
# ----------------------------------------------------------------------------------------------


def _trpo_llm_folder(root: str, small: bool) -> str:
    """A folder with the test tokenizer and (for `small`) GPT-2 small's config.json (random init reads only the
    config), else a 2-layer width-128 GPT-2."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import build_tiny_gpt2

    folder = os.path.join(root, "gpt2_small" if small else "gpt2_2x128")
    os.makedirs(folder, exist_ok=True)
    build_tiny_gpt2(folder, n_layer=2, n_embd=128, n_head=2)
    if small:
        from transformers import GPT2Config

        cfg = GPT2Config()
        cfg.vocab_size = 50257
        cfg.save_pretrained(folder)
    return folder


def _trpo_rollout_vs_bare(trpo, policy, obs_dim: int, steps: int, n_envs: int = 10) -> dict:
    import gymnasium as gym
    import numpy as np
    import torch

    envs = gym.vector.SyncVectorEnv([lambda: gym.make("HalfCheetah-v5") for _ in range(n_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    low, high = envs.single_action_space.low, envs.single_action_space.high
    rms = trpo.RunningMeanStd(obs_dim)
    raw, _ = envs.reset(seed=0)
    rms.update(raw)
    obs = rms.normalize(raw)
    log_std = policy.action_log_std.detach().numpy()[0]
    with torch.no_grad():  # the bare forward's input: the shape the policy feeds the transformer
        enc = policy.encode(torch.from_numpy(obs))
        if "input_ids" in enc:
            length = enc["input_ids"].shape[1] + policy.prefix_ids.numel()
        else:
            length = 1 + policy.prefix_ids.numel()
    x_bare = torch.randn(n_envs, length, policy.transformer.config.n_embd)
    mask = torch.ones(n_envs, length, dtype=torch.long)
    t_roll, t_bare = [], []
    with torch.no_grad():
        policy(torch.from_numpy(obs)), policy.transformer(inputs_embeds=x_bare)  # warm-up
        for _ in range(steps):  # alternate step by step: background load hits both alike
            t0 = time.perf_counter()
            mean = policy(torch.from_numpy(obs)).numpy()
            action = (mean + np.exp(log_std) * torch.randn(mean.shape, dtype=torch.float64).numpy()).astype(np.float32)
            raw, *_ = envs.step(np.clip(action, low, high))
            rms.update(raw)
            obs = rms.normalize(raw)
            t_roll.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            policy.transformer(inputs_embeds=x_bare, attention_mask=mask)
            t_bare.append(time.perf_counter() - t0)
    envs.close()
    roll, bare = float(np.median(t_roll)), float(np.median(t_bare))  # medians: robust to load spikes
    return {"tokens": length, "steps": steps, "env_steps_per_s": n_envs / roll, "rollout_ms_per_step": 1000 * roll,
            "bare_forward_ms": 1000 * bare, "overhead": 1 - bare / roll}


def _trpo_update_split(flags: list[str], cwd: str) -> dict:
    import numpy as np

    import bench_reader as reader

    t0 = time.time()
    # the value fit in line (not overlapped with the rest): "update" is then the whole update, split in its parts
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "trpo_gpt2_halfcheetah.py"), *flags,
                           "--no-overlap-value-fit"],
                          cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    out = {"wall_s": time.time() - t0, "flags": " ".join(flags)}
    for tag in ("rollout_seconds", "update_seconds", "value_fit_seconds", "grad_seconds", "cg_seconds",
                "line_search_seconds"):
        vals = [v for _, v, _ in reader.read_scalars(cwd, f"time/{tag}")]
        out[tag] = float(np.mean(vals[1:] if len(vals) > 1 else vals))  # skip the first update (warm-up)
    out["kl"] = [round(v, 5) for _, v, _ in reader.read_scalars(cwd, "losses/kl")]
    out["accepted"] = [v for _, v, _ in reader.read_scalars(cwd, "charts/step_accepted")]
    return out


def trpo(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="--mode speed (kind trpo)")
    ap.add_argument("--part", choices=["rollout", "update", "frozen"], required=True,
                    help="frozen: SmolLM2 (2 blocks) fine-tuned vs its blocks frozen (--finetune-blocks 0), alternating")
    ap.add_argument("--repeats", type=int, default=2, help="--part frozen: runs of each, in turn")
    ap.add_argument("--quick", action="store_true", help="fewer steps and smaller runs (tests the measurement)")
    ap.add_argument("--skip-gpt2-small-update", action="store_true")
    a = ap.parse_args(argv)
    import torch

    sys.path.insert(0, ROOT)
    import trpo_gpt2_halfcheetah as trpo_mod

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="trpo_speed_")
    small_dir, gpt2_dir = _trpo_llm_folder(tmp, small=False), _trpo_llm_folder(tmp, small=True)
    out = {"rollout": {}, "update": {}}
    steps = 3 if a.quick else 40
    if a.part == "rollout":
        configs = [("gpt2-2x128 embed one", small_dir, "pretrained", "embed", steps * 5),
                   ("gpt2-2x128 text", small_dir, "pretrained", "text", steps)]
        if not a.quick:
            configs += [("gpt2-small embed one", gpt2_dir, "random", "embed", steps),
                        ("gpt2-small text", gpt2_dir, "random", "text", max(5, steps // 4))]
        for name, folder, init, enc, k in configs:
            args = trpo_mod.Args(llm=folder, llm_init=init, state_encoding=enc)
            torch.manual_seed(0)
            policy = trpo_mod.build_policy(args, 17, 6)
            out["rollout"][name] = r = _trpo_rollout_vs_bare(trpo_mod, policy, 17, k)
            print(f"rollout {name:28s} {r['tokens']:3d} tokens {r['env_steps_per_s']:8.1f} env steps/s "
                  f"{r['rollout_ms_per_step']:8.1f} ms/step vs bare forward {r['bare_forward_ms']:8.1f} ms, "
                  f"overhead {100 * r['overhead']:.0f}%", flush=True)
    elif a.part == "frozen":  # seconds per update (3 updates of 3000 steps, the first skipped), alternating
        base = ["--llm", "smollm2", "--llm-layers", "2", "--fvp-subsample", "5", "--batch-size", "3000",
                "--total-timesteps", "9000" if not a.quick else "600"] + (["--batch-size", "200"] if a.quick else [])
        for r in range(a.repeats):
            for name, extra in (("fine-tuned", []), ("frozen", ["--finetune-blocks", "0"])):
                cwd = os.path.join(tmp, f"{name}{r}")
                os.makedirs(cwd)
                u = _trpo_update_split(base + extra, cwd)
                out.setdefault("frozen", {}).setdefault(name, []).append(u)
                print(f"{name} (repeat {r + 1}): update {u['update_seconds']:.2f}s (value {u['value_fit_seconds']:.2f}s "
                      f"grad {u['grad_seconds']:.2f}s cg {u['cg_seconds']:.2f}s line search "
                      f"{u['line_search_seconds']:.2f}s), rollout {u['rollout_seconds']:.2f}s", flush=True)
        med = {k: statistics.median(u["update_seconds"] for u in v) for k, v in out["frozen"].items()}
        out["frozen_over_finetuned"] = med["frozen"] / med["fine-tuned"]
        print(f"median update: fine-tuned {med['fine-tuned']:.2f}s, frozen {med['frozen']:.2f}s "
              f"(ratio {out['frozen_over_finetuned']:.2f})", flush=True)
    else:
        runs = [("mlp, batch 15000", ["--policy", "mlp", "--total-timesteps", "30000"]),
                ("gpt2-2x128 embed one, batch 2000", ["--llm", small_dir, "--batch-size", "2000",
                                                     "--total-timesteps", "4000"]),
                ("gpt2-2x128 embed one, batch 2000, fvp-subsample 5",
                 ["--llm", small_dir, "--batch-size", "2000", "--total-timesteps", "4000", "--fvp-subsample", "5"]),
                ("gpt2-2x128 text, batch 200, fvp-subsample 5",
                 ["--llm", small_dir, "--state-encoding", "text", "--batch-size", "200", "--total-timesteps", "400",
                  "--fvp-subsample", "5"])]
        if a.quick:
            runs = [("mlp, batch 1000", ["--policy", "mlp", "--batch-size", "1000", "--total-timesteps", "2000"])]
        elif not a.skip_gpt2_small_update:
            runs.append(("gpt2-small embed one, batch 200, fvp-subsample 5, finetune-blocks 2",
                         ["--llm", gpt2_dir, "--llm-init", "random", "--batch-size", "200", "--total-timesteps",
                          "200", "--fvp-subsample", "5", "--finetune-blocks", "2"]))
        for name, flags in runs:
            cwd = os.path.join(tmp, f"run{len(out['update'])}")
            os.makedirs(cwd)
            out["update"][name] = u = _trpo_update_split(flags, cwd)
            u["flags"] = u["flags"].replace(tmp + os.sep, "<tmp>/")
            print(f"update {name}: value {u['value_fit_seconds']:.2f}s grad {u['grad_seconds']:.2f}s "
                  f"cg {u['cg_seconds']:.2f}s line search {u['line_search_seconds']:.2f}s kl {u['kl']}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# gpt2ppo: seconds per epoch, each critic against the first configuration
# ----------------------------------------------------------------------------------------------


def gpt2ppo(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="--mode speed (kind gpt2ppo)")
    ap.add_argument("--env-id", default="LunarLander-v3")
    ap.add_argument("--epochs", type=int, default=3, help="epochs (rollout of 2048 steps + update) per timed run")
    ap.add_argument("--steps-per-epoch", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration, in turn")
    ap.add_argument("--configs", nargs="+", default=["mlp", "gpt2 --value-stride 64"],
                    help="the critic, then extra gpt2ppo_lunar.py flags; the first is the baseline of the ratio")
    a = ap.parse_args(argv)
    import bench_reader as reader

    per = {c: [] for c in a.configs}
    for _ in range(a.repeats):
        for config in a.configs:
            critic, *extra = shlex.split(config)
            cmd = [sys.executable, os.path.join(ROOT, "gpt2ppo_lunar.py"), "--env-id", a.env_id, "--critic", critic,
                   "--total-timesteps", str(a.steps_per_epoch * a.epochs), "--steps-per-epoch",
                   str(a.steps_per_epoch), *extra]
            with tempfile.TemporaryDirectory() as cwd:
                subprocess.run(cmd, cwd=cwd, check=True, capture_output=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
                roll = [v for _, v, _ in reader.read_scalars(cwd, "time/rollout_seconds")]
                upd = [v for _, v, _ in reader.read_scalars(cwd, "time/update_seconds")]
            per[config] += [round(r + u, 4) for r, u in zip(roll, upd)]
            print(f"{config}: " + ", ".join(f"{s:.2f}" for s in per[config][-len(roll):]) + " s per epoch", flush=True)
    return {"env_id": a.env_id, "steps_per_epoch": a.steps_per_epoch, "per_epoch": per}


# ----------------------------------------------------------------------------------------------
# icpi: per real step, the original's call pattern against ours
# ----------------------------------------------------------------------------------------------

ICPI_MODES = {  # name: (batch, completion cache, prefix KV cache); all sample, as the script does
    "original": (False, False, False),
    "batched-sample": (True, True, False),  # whole prompts, batched and left-padded: other completions than ours
    "ours": (True, True, True),
}


def icpi(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="--mode speed (kind icpi)")
    ap.add_argument("--model", default="smollm2", help="as icpi_chain.py's --model")
    ap.add_argument("--env", default="chain")
    ap.add_argument("--episodes", type=int, default=12, help="random episodes in the replay buffer before timing")
    ap.add_argument("--steps", type=int, default=3, help="real steps timed per mode")
    ap.add_argument("--modes", default="original,batched-sample,ours", help=",".join(ICPI_MODES))
    ap.add_argument("--dtype", default="auto", help="as icpi_chain.py's --dtype")
    a = ap.parse_args(argv)
    from dataclasses import replace

    import numpy as np

    sys.path.insert(0, ROOT)
    import icpi_chain as ic

    domain = ic.make_domain(a.env)
    rng = np.random.default_rng(0)
    episodes = []
    for _ in range(a.episodes):
        s, ep = domain.reset(rng), []
        for _ in range(domain.time_limit):
            act = int(rng.integers(domain.n_actions))
            s2, r, term = domain.step(s, act, rng)
            ep.append(ic.Transition(s, act, r, term, s2))
            s = s2
            if term:
                break
        episodes.append(ic.Episode(ep))
    states = [domain.reset(np.random.default_rng(100 + k)) for k in range(a.steps)]
    base = ic.Args(model=a.model, env=a.env, dtype=a.dtype)
    backend, results = None, {}
    for name in a.modes.split(","):
        batch, use_cache, prefix = ICPI_MODES[name]
        args = replace(base, no_cache=not use_cache)
        if backend is None:
            backend = ic.make_backend(args, domain, np.random.default_rng(1))
        backend.prefix_cache, backend._prefixes = prefix, {}
        cache = ic.CompletionCache(tempfile.mktemp(suffix=".sqlite"), backend.name) if use_cache else None
        agent = ic.Agent(domain, backend, args, np.random.default_rng(0), cache)
        agent.batch = batch
        for ep in episodes:
            agent.add_episode(ep)
        agree = {"done": [0, 0], "reward": [0, 0], "next": [0, 0]}
        orig = agent.predict

        def predict(kind, items, orig=orig, agree=agree):
            out = orig(kind, items)
            if kind in agree:
                for it, v in zip(items, out):
                    s2, r, term = domain.step(it["state"], it["action"], None)
                    agree[kind][0] += int(v == {"done": term, "reward": r, "next": s2}[kind])
                    agree[kind][1] += 1
            return out

        agent.predict = predict
        per_step = []
        for k, s in enumerate(states):
            agent.real_step, agent.stats = k, ic.StepStats()
            t0, f0 = time.time(), getattr(backend, "forward_tokens", 0)
            agent._examples = {}
            q = agent.q_values(s)
            per_step.append({"seconds": time.time() - t0, **vars(agent.stats),
                             "forward_tokens": getattr(backend, "forward_tokens", 0) - f0,
                             "q": [round(float(x), 3) for x in q]})
        results[name] = {"steps": per_step, "agreement": agree,
                         "mean_seconds": float(np.mean([p["seconds"] for p in per_step])),
                         "mean_calls": float(np.mean([p["calls"] for p in per_step])),
                         "mean_forward_tokens": float(np.mean([p["forward_tokens"] for p in per_step]))}
        print(f"{name}: {results[name]['mean_seconds']:.1f} s, {results[name]['mean_forward_tokens']:.0f} token "
              f"positions and {results[name]['mean_calls']:.1f} model calls per real step; agreement {agree}",
              flush=True)
    return {"bench": vars(a), "results": results}


# ----------------------------------------------------------------------------------------------
# trpo-profile: one MLP update, a git revision of the script against the working tree; rollout vs raw env
# ----------------------------------------------------------------------------------------------

TRPO_SCRIPT = "trpo_gpt2_halfcheetah.py"


def _trpo_module(rev: str | None, tmp: str, name: str):
    """trpo_gpt2_halfcheetah.py as a module: at git revision `rev` (`git show` into `tmp`), or the working tree."""
    import importlib.util

    path = os.path.join(ROOT, TRPO_SCRIPT)
    if rev is not None:
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w") as f:
            f.write(subprocess.run(["git", "show", f"{rev}:{TRPO_SCRIPT}"], cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _halfcheetah_envs(mod, n: int = 10):
    import gymnasium as gym

    return gym.vector.SyncVectorEnv([lambda: gym.make("HalfCheetah-v5") for i in range(n)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def _mlp_batch(policy, envs, obs_rms, next_obs, T: int) -> tuple:
    """A copy of the script's rollout loop (torch forward of the policy, float64), minus TensorBoard: T steps of
    every env -> (obs, next_obs, actions, rewards, terminations, dones), time-step first."""
    import numpy as np
    import torch

    N = envs.num_envs
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    obs_buf, next_obs_buf = np.zeros((T, N, obs_dim), np.float32), np.zeros((T, N, obs_dim), np.float32)
    actions_buf = np.zeros((T, N, act_dim), np.float32)
    rewards_buf, terms, dones_buf = (np.zeros((T, N)) for _ in range(3))
    with torch.no_grad():
        log_std = policy.action_log_std.detach().double().numpy()[0]
        for step in range(T):
            obs_buf[step] = next_obs
            mean = policy(torch.from_numpy(next_obs).double()).numpy()
            action = (mean + np.exp(log_std) * torch.randn(mean.shape, dtype=torch.float64).numpy()).astype(np.float32)
            actions_buf[step] = action
            raw, reward, term, trunc, infos = envs.step(np.clip(action, low, high))
            dones = np.logical_or(term, trunc)
            obs_rms.update(raw)
            next_obs = obs_rms.normalize(raw)
            rewards_buf[step], terms[step], dones_buf[step], next_obs_buf[step] = reward, term, dones, next_obs
            for i in np.flatnonzero(dones):
                next_obs_buf[step, i] = obs_rms.normalize(infos["final_obs"][i])
    return obs_buf, next_obs_buf, actions_buf, rewards_buf, terms, dones_buf


class _CountLBFGS:
    """Counts the objective evaluations of every torch.optim.LBFGS.step inside the `with` block."""

    def __enter__(self):
        import torch

        self.count, self._orig = 0, torch.optim.LBFGS.step
        outer = self

        def step(opt, closure):
            def counted():
                outer.count += 1
                return closure()
            return outer._orig(opt, counted)

        torch.optim.LBFGS.step = step
        return self

    def __exit__(self, *exc):
        import torch

        torch.optim.LBFGS.step = self._orig


def _mlp_update_parts(mod, policy, value_net, batch: tuple, flags: dict, dtype) -> dict:
    """main()'s update on one batch (GAE, value fit, trpo_step) with module `mod`: seconds per part."""
    import torch

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
    with _CountLBFGS() as lbfgs:
        t0 = time.perf_counter()
        mod.fit_value_lbfgs(value_net, b_obs, b_ret, args.l2_reg, args.vf_iters)
        t_value = time.perf_counter() - t0
    params = [p for p in policy.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    stats = mod.trpo_step(policy, params, policy.encode(b_obs), b_act, b_adv, args)
    t_step = time.perf_counter() - t0
    return {"value_fit": t_value, "gradient": stats["grad_seconds"], "cg": stats["cg_seconds"],
            "line_search": stats["line_search_seconds"], "update_total": t_value + t_step,
            "lbfgs_evaluations": lbfgs.count, "kl": float(stats["kl"])}


def _script_rollout_seconds(steps: int, seed: int) -> float:
    """time/rollout_seconds of a one-update `--policy mlp` run of the working tree's script (a subprocess)."""
    import bench_reader as reader

    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run([sys.executable, os.path.join(ROOT, TRPO_SCRIPT), "--policy", "mlp", "--total-timesteps",
                        str(steps), "--batch-size", str(steps), "--seed", str(seed), "--torch-threads", "1"],
                       cwd=cwd, check=True, capture_output=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
        return reader.read_scalars(cwd, "time/rollout_seconds")[0][1]


def trpo_profile_args(argv: list[str]) -> argparse.Namespace:
    """The flags of kind trpo-profile (a SPEED entry's `flags`)."""
    ap = argparse.ArgumentParser(prog="--mode speed (kind trpo-profile)")
    ap.add_argument("--before", default="759e27f", help="git revision of the 'before' script ('none': no column)")
    ap.add_argument("--after-flags", default="",
                    help="comma-separated Args overrides for a third column (empty: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps-per-env", type=int, default=1500, help="batch of the profiled update, per env (x 10)")
    ap.add_argument("--rollout-steps", type=int, default=1500, help="steps per env in the rollout comparison")
    return ap.parse_args(argv)


def trpo_profile(argv: list[str]) -> dict:
    """Update: one batch of `--steps-per-env` x 10 HalfCheetah-v5 steps (random-init MLP policy, the script's
    rollout loop) is collected once; then the value fit and `trpo_step` of the script at `--before` (git show),
    of the working tree, and of the working tree with `--after-flags`, run on copies of the SAME networks and
    batch, one after another (after one untimed warm-up update of each), `--repeats` rounds (a competing process
    slows all alike). Rollout: the bare vector
    env stepped with pre-drawn random actions, alternating with the script's own time/rollout_seconds of a
    one-update run (subprocess) for the same number of steps."""
    a = trpo_profile_args(argv)
    import numpy as np
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        after = _trpo_module(None, tmp, "trpo_after")
        variants = [("after", after, {})]
        if a.before != "none":
            variants.insert(0, ("before", _trpo_module(a.before, tmp, "trpo_before"), {}))
        if a.after_flags:
            variants.append((f"after {a.after_flags}", after, dict(kv.split("=") for kv in a.after_flags.split(","))))
        torch.manual_seed(1)
        envs = _halfcheetah_envs(after)
        obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
        obs_rms = after.RunningMeanStd(obs_dim)
        raw, _ = envs.reset(seed=1)
        obs_rms.update(raw)
        policy0, value0 = after.MLPPolicy(obs_dim, act_dim).double(), after.ValueNet(obs_dim).double()
        batch = _mlp_batch(policy0, envs, obs_rms, obs_rms.normalize(raw), a.steps_per_env)
        envs.close()
        runs, finals = {name: [] for name, _, _ in variants}, {}
        warm_up = tuple(x[:10] for x in batch)  # an untimed update of each variant first (lazy initialisation)
        for r in [-1, *range(a.repeats)]:
            for name, mod, flags in variants:
                dtype = torch.float32 if flags.get("mlp_dtype") == "float32" else torch.float64
                pol, vn = mod.MLPPolicy(obs_dim, act_dim).to(dtype), mod.ValueNet(obs_dim).to(dtype)
                pol.load_state_dict(policy0.state_dict())
                vn.load_state_dict(value0.state_dict())
                if r < 0:
                    _mlp_update_parts(mod, pol, vn, warm_up, flags, dtype)
                    continue
                runs[name].append(_mlp_update_parts(mod, pol, vn, batch, flags, dtype))
                finals[name] = torch.cat([p.detach().double().reshape(-1) for p in [*pol.parameters(),
                                                                                    *vn.parameters()]])
            if r >= 0:
                totals = "; ".join(f"{n} {v[-1]['update_total']:.3f} s" for n, v in runs.items())
                print(f"update round {r + 1}: {totals}", flush=True)
    first = variants[0][0]
    diffs = {n: float((finals[n] - finals[first]).abs().max()) for n in finals if n != first}
    raw_t, script_t = [], []
    for r in range(a.repeats):
        envs = _halfcheetah_envs(after)
        envs.reset(seed=r)
        low, high = envs.single_action_space.low, envs.single_action_space.high
        acts = np.random.default_rng(r).uniform(low, high, (a.rollout_steps, 10, act_dim)).astype(np.float32)
        t0 = time.perf_counter()
        for i in range(a.rollout_steps):
            envs.step(acts[i])
        raw_t.append(time.perf_counter() - t0)
        envs.close()
        script_t.append(_script_rollout_seconds(a.rollout_steps * 10, r + 1))
        print(f"rollout round {r + 1}: raw vector env {raw_t[-1]:.3f} s, script {script_t[-1]:.3f} s", flush=True)
    return {"before_rev": None if a.before == "none" else a.before, "repeats": a.repeats,
            "batch": a.steps_per_env * 10, "updates": runs, "max_param_diff_vs_first": diffs,
            "rollout": {"steps": a.rollout_steps * 10, "raw_seconds": raw_t, "script_seconds": script_t}}


# (kinds trpo-fvp and trpo-value-dtype measured options the script no longer has: their stored entries still render)
KINDS = {"trpo": trpo, "gpt2ppo": gpt2ppo, "icpi": icpi, "trpo-profile": trpo_profile}


# ----------------------------------------------------------------------------------------------
# benchmark/gpu/: raw outputs of a lent H100, read at every report
# ----------------------------------------------------------------------------------------------


def _gpu_machine(gpu_dir: str) -> tuple[str, str]:
    """(machine, versions) from the 'Machine:' paragraph of benchmark/gpu/README.md."""
    with open(os.path.join(gpu_dir, "README.md")) as f:
        text = f.read()
    para = text.split("Machine:", 1)[1].split("\n\n", 1)[0].replace("\n", " ").strip()
    para = re.split(r"\.\s", para)[0]  # the first sentence
    machine, _, versions = para.partition(", Python")
    return machine.strip(), ("python" + versions).strip().rstrip(".") if versions else "-"


def _per_epoch_lines(text: str) -> dict:
    """`config: 0.35, 0.33 s per epoch` lines of a gpt2ppo speed output -> {config: [seconds, ...]}."""
    per: dict = {}
    for config, secs in re.findall(r"^(.+?): ([0-9., ]+) s per epoch$", text, re.M):
        per.setdefault(config, []).extend(float(x) for x in secs.split(","))
    return per


def gpu_entries(gpu_dir: str = GPU_DIR) -> list[dict]:
    """benchmark/gpu/'s raw outputs as speed entries (source `imported-gpu`, the file named in `imported`)."""
    if not os.path.isdir(gpu_dir):
        return []
    machine, vers = _gpu_machine(gpu_dir)
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    out = []
    for path in sorted(glob.glob(os.path.join(gpu_dir, "gpt2ppo_speed_h100_*.txt"))):
        env = {"lunarlander": "LunarLander-v3", "acrobot": "Acrobot-v1"}.get(
            path.rsplit("_", 1)[1].removesuffix(".txt"), "?")
        with open(path) as f:
            per = _per_epoch_lines(f.read())
        out.append({"name": f"gpt2ppo-{env}-h100", "kind": "gpt2ppo", "source": "imported-gpu",
                    "imported": {"from": rel(path), "command": "python benchmark/gpt2ppo_speed.py --env-id "
                                 f"{env} --epochs 4 --configs " + " ".join(shlex.quote(c) for c in per)},
                    "machine": machine, "versions": vers, "data": {"env_id": env, "steps_per_epoch": 2048,
                                                                   "per_epoch": per}})
    trpo_runs = {}
    for path in sorted(glob.glob(os.path.join(gpu_dir, "trpo_h100_*.txt"))):
        with open(path) as f:
            text = f.read()
        flags = re.search(r"^== \w+: (.+)$", text, re.M).group(1)
        run = {"flags": flags, "file": rel(path)}
        for tag, vals in re.findall(r"^(time/\w+|losses/kl|charts/step_accepted|charts/SPS): \[(.*)\]$", text, re.M):
            run[tag] = [float(x) for x in vals.split(",")]
        mem = re.search(r"^cuda memory: (\{.*\})$", text, re.M)
        run["cuda_memory"] = json.loads(mem.group(1)) if mem else {}
        trpo_runs[flags] = run
    if trpo_runs:
        out.append({"name": "trpo-h100", "kind": "trpo-gpu", "source": "imported-gpu",
                    "imported": {"from": ", ".join(r["file"] for r in trpo_runs.values()),
                                 "command": "python benchmark/gpu/trpo_gpu.py B A"},
                    "machine": machine, "versions": vers, "data": trpo_runs})
    path = os.path.join(gpu_dir, "trpo_compile_h200.json")
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
        out.append({"name": "trpo-compile-h200", "kind": "trpo-compile-gpu", "source": "imported-gpu",
                    "imported": {"from": rel(path), "command": "python benchmark/gpu/trpo_compile.py --out OUT "
                                 "--limit 300 --budget 505 (2026-11-26)"},
                    "machine": f"one {data['device']} (16 Xeon cores)", "versions": f"python "
                    f"{data['versions']['python']}, torch {data['versions']['torch']}, transformers 5.23.0, "
                    "gymnasium 1.4.0, mujoco 3.3.7", "data": data})
    path = os.path.join(gpu_dir, "icpi_speed_h100.json")
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
        out.append({"name": "icpi-h100", "kind": "icpi", "source": "imported-gpu",
                    "imported": {"from": rel(path), "command": "python benchmark/icpi_speed.py --steps 3 "
                                 "(modes original,batched-sample,ours-sample,ours,ours-episode-order)"},
                    "machine": machine, "versions": vers, "data": data})
    return out


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def summary(entry: dict) -> dict:
    """The numbers a table shows, derived from the raw data (also what the README test compares against)."""
    d, kind = entry["data"], entry["kind"]
    if kind == "gpt2ppo":
        meds = {c: statistics.median(v) for c, v in d["per_epoch"].items()}
        base = next(iter(meds.values()))
        return {c: {"median_s": m, "steps_per_s": d["steps_per_epoch"] / m, "ratio": m / base}
                for c, m in meds.items()}
    if kind == "icpi":
        res = d["results"]
        ref = res.get("original", {})
        return {m: {"s_per_step": r["mean_seconds"], "calls": r["mean_calls"], "tokens": r["mean_forward_tokens"],
                    "speedup": ref["mean_seconds"] / r["mean_seconds"] if ref else None,
                    "token_ratio": ref["mean_forward_tokens"] / r["mean_forward_tokens"] if ref else None}
                for m, r in res.items()}
    if kind == "trpo-profile":
        upd = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in d["updates"].items()}
        base = next(iter(upd.values()))["update_total"]
        ro = d["rollout"]
        raw, script = statistics.median(ro["raw_seconds"]), statistics.median(ro["script_seconds"])
        return {"update": upd, "speedup": {v: base / u["update_total"] for v, u in upd.items()},
                "rollout": {"raw_s": raw, "script_s": script, "raw_steps_per_s": ro["steps"] / raw,
                            "script_steps_per_s": ro["steps"] / script, "script_over_raw": script / raw}}
    if kind == "trpo-fvp":
        med = {c: {k: statistics.median(x[k] for x in rs) for k in ("seconds", "cg_seconds", "peak_extra_mib", "kl")}
               for c, rs in d["runs"].items()}
        base = next(iter(med.values()))
        for m in med.values():
            m["speedup"] = base["seconds"] / m["seconds"]
            m["time_saved_pct"] = 100 * (1 - m["seconds"] / base["seconds"])
            m["memory_saved_pct"] = 100 * (1 - m["peak_extra_mib"] / base["peak_extra_mib"])
        return med
    if kind == "trpo-compile-gpu":
        med = lambda r, k: statistics.median(r[k]) if r.get(k) else None  # noqa: E731
        return {name: {"flags": " ".join(r["flags"]), "updates": len(r.get("time/rollout_seconds", [])),
                       "rollout_s": med(r, "time/rollout_seconds"), "update_s": med(r, "time/update_seconds"),
                       "value_fit_s": med(r, "time/value_fit_seconds"), "steps": r.get("steps_done", 0),
                       "wall_s": r["wall_seconds"], "sps": (r.get("charts/SPS") or [None])[-1],
                       "last20": r.get("charts/episodic_return", {}).get("last20_mean")}
                for name, r in d.items() if isinstance(r, dict) and "wall_seconds" in r}
    if kind == "trpo-gpu":
        out = {}
        for flags, r in d.items():
            out[flags] = {k: r[k] for k in r if k.startswith(("time/", "losses/", "charts/"))}
            out[flags]["max_allocated_gib"] = r["cuda_memory"].get("max_allocated_gib")
        return out
    return d


def _fmt(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}f}"


def render(entries: list[dict], mid: dict) -> list[str]:
    """The Speed section of results.md: one table per entry (stored entries and `gpu_entries()`)."""
    if not entries:
        return []
    lines = ["", "## Speed (`--mode speed`; GPU rows read from `benchmark/gpu/`)", ""]
    for e in entries:
        m = mid.get(e["machine"] + "; " + e["versions"]) or f"{e['machine']}; {e['versions']}"
        how = (f"imported: `{e['imported']['command']}`, from `{e['imported']['from']}`" if e.get("imported")
               else f"`{e['harness_command']}`, finished {e['finished']}")
        lines += [f"### {e['name']} ({e['kind']}; machine {m})", "", how + ".", ""]
        s, d = summary(e), e["data"]
        if e["kind"] == "gpt2ppo":
            first = next(iter(s))
            lines += [f"{d['env_id']}, {d['steps_per_epoch']} env steps per epoch.", "",
                      f"| critic | s per epoch (median) | env steps/s | x `{first}` | epochs timed |",
                      "|---|---|---|---|---|"]
            lines += [f"| `{c}` | {v['median_s']:.2f} | {v['steps_per_s']:.0f} | {v['ratio']:.1f} | "
                      f"{len(d['per_epoch'][c])} |" for c, v in s.items()]
        elif e["kind"] == "icpi":
            b = d["bench"]
            lines += [f"model {b['model']}, env {b['env']}, dtype {b.get('dtype', 'auto')}, {b['steps']} real steps "
                      f"per mode, {b['episodes']} random episodes in the buffer.", "",
                      "| mode | s / real step | model calls / step | token positions / step | speed-up (wall) | "
                      "speed-up (token positions) | done / reward / next agree |", "|---|---|---|---|---|---|---|"]
            for mode, v in s.items():
                ag = d["results"][mode]["agreement"]
                lines.append(f"| {mode} | {v['s_per_step']:.1f} | {v['calls']:.1f} | {v['tokens']:.0f} | "
                             f"{_fmt(v['speedup'], 1)}x | {_fmt(v['token_ratio'], 1)}x | "
                             f"{' / '.join(f'{a}/{n}' for a, n in ag.values())} |")
        elif e["kind"] == "trpo":
            if d.get("rollout"):
                lines += ["Rollout, HalfCheetah-v5, 10 envs (medians of per-step times):", "",
                          "| policy | tokens / state | ms per step | bare forward ms | overhead | env steps/s |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {n} | {r['tokens']} | {r['rollout_ms_per_step']:.1f} | {r['bare_forward_ms']:.1f} | "
                          f"{100 * r['overhead']:.0f}% | {r['env_steps_per_s']:.1f} |" for n, r in d["rollout"].items()]
            if d.get("update"):
                lines += ["", "Update split, seconds per update (mean over the updates after the first):", "",
                          "| configuration | value fit | surrogate grad | CG | line search | KL after each step |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {n} | {u['value_fit_seconds']:.2f} | {u['grad_seconds']:.2f} | {u['cg_seconds']:.2f} | "
                          f"{u['line_search_seconds']:.2f} | {', '.join(map(str, u['kl']))} |"
                          for n, u in d["update"].items()]
            if d.get("frozen"):
                lines += ["SmolLM2-135M-Instruct's first 2 blocks as the policy, `--fvp-subsample 5`, 3 updates of 3000 "
                          "HalfCheetah-v5 steps per run (the first skipped), value fit in line, the two runs "
                          "alternating; seconds per update:", "",
                          "| configuration | update (each run) | median | value fit | surrogate grad | CG | line search "
                          "| rollout |", "|---|---|---|---|---|---|---|---|"]
                for n, us in d["frozen"].items():
                    m = lambda k: statistics.median(u[k] for u in us)  # noqa: E731
                    each = ", ".join(f"{u['update_seconds']:.2f}" for u in us)
                    lines.append(f"| {n} | {each} | "
                                 f"{m('update_seconds'):.2f} | {m('value_fit_seconds'):.2f} | {m('grad_seconds'):.2f} | "
                                 f"{m('cg_seconds'):.2f} | {m('line_search_seconds'):.2f} | {m('rollout_seconds'):.2f} |")
                lines += ["", f"Frozen over fine-tuned (median update): {d['frozen_over_finetuned']:.2f}."]
        elif e["kind"] == "trpo-profile":
            names = list(s["update"])
            rev = d.get("before_rev")
            head = [f"before ({rev})" if n == "before" else n for n in names]
            lines += [f"One TRPO update of `--policy mlp` on one batch of {d['batch']} HalfCheetah-v5 steps "
                      f"(random-init policy), the variants one after another, {d['repeats']} rounds, medians in "
                      "seconds:", "",
                      "| part | " + " | ".join(head) + " |", "|---|" + "---|" * len(names)]
            for k in ("value_fit", "lbfgs_evaluations", "gradient", "cg", "line_search", "update_total", "kl"):
                digits = {"lbfgs_evaluations": 0, "kl": 6}.get(k, 2)
                lines.append(f"| {k} | " + " | ".join(_fmt(s["update"][n][k], digits) for n in names) + " |")
            lines.append(f"| speed-up vs {head[0]} | " + " | ".join(f"{s['speedup'][n]:.2f}x" for n in names) + " |")
            diffs = ", ".join(f"{n} {v:.1e}" for n, v in d["max_param_diff_vs_first"].items())
            r = s["rollout"]
            lines += ["", f"Parameters after the update, max difference from {head[0]}: {diffs}.", "",
                      f"Rollout of {d['rollout']['steps']} steps (medians of {len(d['rollout']['raw_seconds'])}): "
                      f"the bare 10-env vector env with random actions {r['raw_s']:.2f} s "
                      f"({r['raw_steps_per_s']:.0f} steps/s), the script's loop {r['script_s']:.2f} s "
                      f"({r['script_steps_per_s']:.0f} steps/s): {r['script_over_raw']:.2f}x the raw time."]
        elif e["kind"] == "trpo-fvp":
            first = next(iter(s))
            lines += [f"One `trpo_step` per fresh process, `--llm {d['llm']} --llm-layers {d['layers']}`, batch "
                      f"{d['batch']}, `--fvp-subsample {d['fvp_subsample']}`, instruction {d['instruction']!r}, "
                      f"synthetic batch; medians; memory = peak RSS minus RSS before the step.", "",
                      "| fvp-impl:attention | trpo_step s (each round) | of which CG s | peak extra MiB | KL | "
                      f"time saved vs `{first}` | memory saved |", "|---|---|---|---|---|---|---|"]
            for c, v in s.items():
                each = ", ".join(f"{x['seconds']:.1f}" for x in d["runs"][c])
                lines.append(f"| `{c}` | {v['seconds']:.1f} ({each}) | {v['cg_seconds']:.1f} | "
                             f"{v['peak_extra_mib']:.0f} | {v['kl']:.5f} | {v['time_saved_pct']:.0f}% | "
                             f"{v['memory_saved_pct']:.0f}% |")
        elif e["kind"] == "trpo-value-dtype":
            lines += [f"Checkpoint: {d['checkpoint']}; one batch of {d.get('batch', 15000)} steps with its policy, "
                      "its value net refitted by `fit_value_lbfgs` to the GAE returns"
                      + (f" (mean {d['returns_mean']:.2f}, std {d['returns_std']:.2f})" if "returns_mean" in d else "")
                      + ".", "", "| dtype | MSE before | MSE after | L-BFGS evaluations | explained variance | "
                      "seconds |", "|---|---|---|---|---|---|"]
            lines += [f"| {dt} | {_fmt(f.get('mse_before'))} | {_fmt(f.get('mse_after'))} | {f['evaluations']} | "
                      f"{_fmt(f.get('explained_variance'), 4)} | {_fmt(f.get('seconds'))} |"
                      for dt, f in d["fits"].items()]
        elif e["kind"] == "trpo-compile-gpu":
            f = d["env_floor"]
            lines += ["GPT-2 small's architecture at random initialisation (`--llm-init random --fvp-subsample 5 --seed "
                      "543`, 10 envs, 15000 steps per update) on HalfCheetah-v5; seconds are medians over the updates "
                      "(the first rollout holds the compilation). Stepping the 10 envs alone with random actions: "
                      f"{f['steps_per_s']:.0f} steps/s, {f['seconds_per_1M']:.0f} s per 1M steps.", "",
                      "| run | extra flags | updates | rollout s | update s | value fit s | steps | wall s | steps/s "
                      "| last 20 episodes |", "|---|---|---|---|---|---|---|---|---|---|"]
            for n, r in s.items():
                extra = r["flags"].split("--seed 543", 1)[1].strip()
                lines.append(f"| {n} | `{extra or '-'}` | {r['updates']} | {_fmt(r['rollout_s'])} | "
                             f"{_fmt(r['update_s'])} | {_fmt(r['value_fit_s'])} | {r['steps']} | {r['wall_s']:.0f} | "
                             f"{_fmt(r['sps'], 0)} | {_fmt(r['last20'])} |")
            lines += ["", "compiled_1M was stopped by SIGINT after 300 s (the budget of the device call); "
                      "compiled_tf32_2_updates allowed TF32 matmuls from outside the script."]
        elif e["kind"] == "trpo-gpu":
            lines += ["| flags | rollout s per update | update s | CG s | value fit s | gradient s | line search s "
                      "| KL | accepted | peak CUDA memory GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
            j = lambda xs: ", ".join(f"{x:g}" for x in xs)  # noqa: E731
            for flags, r in s.items():
                lines.append(f"| `{flags}` | {j(r['time/rollout_seconds'])} | {j(r['time/update_seconds'])} | "
                             f"{j(r['time/cg_seconds'])} | {j(r['time/value_fit_seconds'])} | "
                             f"{j(r['time/grad_seconds'])} | {j(r['time/line_search_seconds'])} | "
                             f"{j(r['losses/kl'])} | {sum(r['charts/step_accepted']):.0f} of "
                             f"{len(r['charts/step_accepted'])} | {_fmt(r['max_allocated_gib'], 1)} |")
        lines.append("")
    return lines
