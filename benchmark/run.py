"""Benchmark harness: run the scripts over seeds and settings, read their TensorBoard logs back,
and write the results table (benchmark/results.md) and the learning-curve plots (benchmark/*.png).

    python benchmark/run.py --scripts ppo_cartpole --envs CartPole-v1          # train, then report
    python benchmark/run.py --mode report                                      # table + plots only
    python benchmark/run.py --mode throughput --scripts ppo_cartpole           # short timed runs
    python benchmark/run.py --mode list                                        # the registry
    python benchmark/run.py --quick                                            # everything, tiny budget

How it works:
  * Every (script, env, setting, steps, seed) is one process, started in its own folder
    `{runs_dir}/{script}__{env}__{setting}__{steps}__seed{seed}/` (so the script's `runs/` lands
    there), with OMP_NUM_THREADS=MKL_NUM_THREADS=1 (and `--torch-threads 1` where the script has
    that flag), at most `--workers` at a time. Its console output goes to `run.log`.
  * A run that exits 0 gets a marker `done.json` (its command, wall time, and what the reader
    needs). A run whose marker holds the same command is complete and is skipped (resume); a
    folder without a marker is an interrupted run: it is cleared and run again.
  * Reader: the mean of the last `last_n` (100) episodes per seed, then mean +- std across seeds.
    The std is the POPULATION std (numpy's np.std, ddof=0), as openrlbenchmark computes it.
  * Results accumulate in benchmark/results.json (one row per script/env/setting/steps); the
    Markdown table is rendered from all rows, so a run of one setting never drops the others.

Add a setting: one `S(...)` line in SETTINGS below. A script that is not in the repository yet
is skipped with a message.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARKER = "done.json"
LOG = "run.log"


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """A published reference number and where it comes from."""

    value: float
    std: Optional[float]
    source: str

    def text(self) -> str:
        num = f"{self.value:g}" if self.std is None else f"{self.value:g} ± {self.std:g}"
        return f"{num} ({self.source})"


@dataclass(frozen=True)
class Script:
    """How to drive one script: its flags, what to read back, and its tiny budget for --quick."""

    file: str
    env_flag: str = "--env-id"
    steps_flag: str = "--total-timesteps"
    seed_flag: str = "--seed"
    tag: str = "charts/episodic_return"
    """the scalar the table and the plots aggregate"""
    last_n: int = 100
    """episodes averaged per seed at the end of a run"""
    x_label: str = "environment steps"
    y_label: str = "episodic return"
    quick_steps: int = 2048
    quick_flags: tuple[str, ...] = ()
    """extra flags in --quick mode (e.g. a smaller batch so that the tiny budget is one update)"""
    throughput_steps: int = 50_000


@dataclass(frozen=True)
class S:
    """One setting: a script on an env with flags, a step budget, seeds and reference numbers."""

    script: str
    env: str
    name: str
    steps: int
    seeds: tuple[int, ...]
    flags: tuple[str, ...] = ()
    refs: tuple[Ref, ...] = ()
    quick: bool = True
    """False: too heavy even at a tiny budget (e.g. loads a real language model); --quick skips it"""
    tag: Optional[str] = None
    """the scalar to aggregate and plot, if not the script's (e.g. charts/discounted_return)"""
    last_n: Optional[int] = None
    """episodes averaged per seed, if not the script's"""


SCRIPTS = {
    "ppo_cartpole": Script("ppo_cartpole.py"),
    "trpo_gpt2_halfcheetah": Script("trpo_gpt2_halfcheetah.py", quick_steps=500, quick_flags=("--batch-size", "250"),
                                    throughput_steps=15_000),
    "gpt2ppo_lunar": Script("gpt2ppo_lunar.py", quick_steps=512, quick_flags=("--steps-per-epoch", "256"),
                            throughput_steps=2048 * 3),
    # ICPI: the curve is regret per episode against REAL environment steps (tag agreed: charts/regret);
    # episodes are <= 8 steps long, so the final number averages the last 10 episodes.
    "icpi_chain": Script("icpi_chain.py", env_flag="--env", steps_flag="--total-steps", tag="charts/regret",
                         last_n=10, x_label="real environment steps", y_label="regret (normalised)",
                         quick_steps=16, throughput_steps=40),
}

CLEANRL_CP = Ref(490.04, 6.12, "CleanRL ppo.py, 500k steps, 3 seeds")
BASELINES_CP = Ref(497.54, 4.02, "openai/baselines PPO, 500k steps, as published beside CleanRL")
CLEANRL_ACRO = Ref(-86.36, 1.32, "CleanRL ppo.py, 500k steps, 3 seeds")
SB3_TRPO_HC = Ref(1803, 46, "SB3-contrib TRPO, HalfCheetah-v3, 1M steps, 3 seeds")
ZOO_TRPO_HC = Ref(1785.5, 68.7, "rl-baselines3-zoo TRPO, 1M steps")
ZOO_LUNAR = Ref(242.1, 31.8, "rl-baselines3-zoo PPO, 1M steps")
SEED2_LUNAR_PPO = Ref(-25, None, "seed 002 PPO at epoch 150 (~307k steps), read off its plot")
SEED2_LUNAR_GPT = Ref(-45, None, "seed 002 GPT2PPO at epoch 150 (~307k steps), read off its plot")
ZOO_ACRO = Ref(-73.5, None, "rl-baselines3-zoo PPO, 1M steps")
SEED2_ACRO_PPO = Ref(-115, None, "seed 002 PPO at epoch 150, read off its plot")
SEED2_ACRO_GPT = Ref(-150, None, "seed 002 GPT2PPO at epoch 150, read off its plot")
ICPI_CHAIN = Ref(0.0, None, "ICPI paper, code-davinci-002: ~0 regret by ~40 steps, read off its figure")
ICPI_MAZE = Ref(0.0, None, "ICPI paper, code-davinci-002: ~0 regret by ~120 steps, read off its figure")
ICPI_DCHAIN = Ref(0.17, None, "ICPI paper, code-davinci-002: ~0.17 regret at 140 steps, read off its figure")
ICPI_CATCH = Ref(0.02, None, "ICPI paper, code-davinci-002: ~0.02 regret at ~300 steps, read off its figure")
ICPI_INVADERS = Ref(0.15, None, "ICPI paper, code-davinci-002: ~0.15 regret by ~170 steps, read off its figure")
ICPI_POINT = Ref(0.03, None, "ICPI paper, code-davinci-002: ~0.03 regret at ~300 steps, read off its figure")
GPT2PPO_EPOCHS = 150 * 2048

# One line per setting. Entries whose script is not in the repository yet are skipped with a message;
# their flags are the ones their issues specify (the script's owner adjusts them when it lands).
SETTINGS: list[S] = [
    S("ppo_cartpole", "CartPole-v1", "default", 500_000, (1, 2, 3), refs=(CLEANRL_CP, BASELINES_CP)),
    S("ppo_cartpole", "Acrobot-v1", "default", 500_000, (1, 2, 3), refs=(CLEANRL_ACRO,)),
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "mlp", 1_000_000, (1, 2, 3), ("--policy", "mlp"),
      refs=(SB3_TRPO_HC, ZOO_TRPO_HC)),
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "gpt2-random-embed", 100_000, (1, 2, 3),
      ("--policy", "gpt2", "--llm-init", "random", "--state-encoding", "embed"), refs=(SB3_TRPO_HC,), quick=False),
    S("gpt2ppo_lunar", "LunarLander-v3", "mlp", GPT2PPO_EPOCHS, (1, 2, 3), ("--critic", "mlp"),
      refs=(SEED2_LUNAR_PPO, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2", GPT2PPO_EPOCHS, (1, 2, 3), ("--critic", "gpt2"),
      refs=(SEED2_LUNAR_GPT, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "mlp", 1_000_000, (1, 2, 3), ("--critic", "mlp"), refs=(ZOO_LUNAR,)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2", 1_000_000, (1, 2, 3), ("--critic", "gpt2"), refs=(ZOO_LUNAR,)),
    S("gpt2ppo_lunar", "Acrobot-v1", "mlp", GPT2PPO_EPOCHS, (1, 2, 3), ("--critic", "mlp"),
      refs=(SEED2_ACRO_PPO, ZOO_ACRO, CLEANRL_ACRO)),
    S("gpt2ppo_lunar", "Acrobot-v1", "gpt2", GPT2PPO_EPOCHS, (1, 2, 3), ("--critic", "gpt2"),
      refs=(SEED2_ACRO_GPT, ZOO_ACRO, CLEANRL_ACRO)),
    S("icpi_chain", "chain", "oracle", 85, (1, 2, 3, 4), ("--model", "oracle"), refs=(ICPI_CHAIN,)),
    S("icpi_chain", "chain", "matching", 85, (1, 2, 3, 4), ("--model", "matching"), refs=(ICPI_CHAIN,)),
    S("icpi_chain", "chain", "tabular-q", 85, (1, 2, 3, 4), ("--algo", "tabular-q"), refs=(ICPI_CHAIN,)),
    S("icpi_chain", "chain", "smollm2", 85, (1, 2, 3, 4), (), refs=(ICPI_CHAIN,), quick=False),
    S("icpi_chain", "maze", "oracle", 130, (1, 2, 3, 4), ("--model", "oracle"), refs=(ICPI_MAZE,)),
    S("icpi_chain", "maze", "matching", 130, (1, 2, 3, 4), ("--model", "matching"), refs=(ICPI_MAZE,)),
    S("icpi_chain", "maze", "tabular-q", 130, (1, 2, 3, 4), ("--algo", "tabular-q"), refs=(ICPI_MAZE,)),
    S("icpi_chain", "maze", "smollm2", 130, (1, 2, 3, 4), (), refs=(ICPI_MAZE,), quick=False),
    # SmolLM2 with bfloat16 weights: ~3x faster on this CPU (AMX); the prompts are the original's (issue 13)
    S("icpi_chain", "chain", "smollm2-bf16", 85, (1, 2, 3, 4), ("--dtype", "bfloat16"), refs=(ICPI_CHAIN,),
      quick=False),
    # the other four domains of the paper, at the step budgets of its figures (issue 13)
    *[S("icpi_chain", env, name, steps, (1, 2, 3, 4), flags, refs=(ref,))
      for env, steps, ref in (("distractor-chain", 140, ICPI_DCHAIN), ("mini-catch", 300, ICPI_CATCH),
                              ("mini-invaders", 190, ICPI_INVADERS), ("point-mass", 300, ICPI_POINT))
      for name, flags in (("oracle", ("--model", "oracle")), ("matching", ("--model", "matching")),
                          ("tabular-q", ("--algo", "tabular-q")))],
]


@dataclass(frozen=True)
class Peer:
    """Throughput mode: `ours` and `peer` run alternately on the same budget; the ratio is printed."""

    script: str
    env: str
    flags: tuple[str, ...]
    peer_file: Optional[str]
    """a file relative to the repository root (None: no peer, just time the script)"""
    peer_flags: tuple[str, ...] = ()
    peer_label: str = ""
    peer_thread_limit: bool = True
    """True: the peer gets the same one-thread limit as ours (OMP_NUM_THREADS=1). False: torch's default
    thread count, as CleanRL runs; on a loaded machine that oversubscribes the cores and the peer's
    speed collapses (measured here: ~160 steps/s at load 7), so the ratio would say more about the load"""


THROUGHPUT: list[Peer] = [
    Peer("ppo_cartpole", "CartPole-v1", (), "benchmark/cleanrl_style_ppo.py", (), "CleanRL-style ppo.py peer"),
    Peer("gpt2ppo_lunar", "LunarLander-v3", ("--critic", "gpt2"), "gpt2ppo_lunar.py", ("--critic", "mlp"),
         "gpt2ppo --critic mlp (limit: gpt2 < 3x its wall time)"),
    Peer("trpo_gpt2_halfcheetah", "HalfCheetah-v5", ("--policy", "gpt2", "--llm-init", "random", "--state-encoding",
                                                     "embed"), "trpo_gpt2_halfcheetah.py", ("--policy", "mlp"),
         "trpo --policy mlp"),
    Peer("icpi_chain", "chain", ("--model", "oracle"), None),
]


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


@dataclass
class Args:
    mode: Literal["train", "report", "throughput", "list"] = "train"
    """train: run what is missing, then report; report: table + plots from existing runs;
    throughput: short timed runs (alternating with a peer where one is named); list: show the registry"""
    scripts: tuple[str, ...] = ()
    """scripts to include, by name (e.g. ppo_cartpole); empty: all"""
    envs: tuple[str, ...] = ()
    """env ids to include; empty: all"""
    settings: tuple[str, ...] = ()
    """setting names to include (e.g. mlp gpt2); empty: all"""
    seeds: tuple[int, ...] = ()
    """override the registry's seeds"""
    steps: Optional[int] = None
    """override the registry's step budget"""
    workers: int = os.cpu_count() or 1
    """processes at a time (each limited to one thread)"""
    nice: int = 0
    """niceness added to every launched run (the CPU is shared: use e.g. 10)"""
    quick: bool = False
    """tiny budget for everything (tests the harness; writes under benchmark/out/quick by default)"""
    runs_dir: Optional[str] = None
    """where run folders go (default benchmark/out/runs, git-ignored; --quick: benchmark/out/quick/runs)"""
    results_md: Optional[str] = None
    """the Markdown table (default benchmark/results.md; --quick: benchmark/out/quick/results.md);
    its rows are kept in a .json file next to it"""
    plots_dir: Optional[str] = None
    """where the PNGs go (default benchmark/; --quick: benchmark/out/quick)"""
    repeats: int = 3
    """throughput mode: timed runs of each program"""
    throughput_steps: Optional[int] = None
    """throughput mode: steps per timed run (default: per script)"""
    peer_default_threads: bool = False
    """throughput mode: run the peer with torch's default thread count (as CleanRL does) instead of 1"""
    force: bool = False
    """run again even when a run is complete (its folder is replaced)"""
    timeout: Optional[float] = None
    """seconds after which one run is killed and counted as failed (default: none)"""


def resolve_paths(args: Args) -> Args:
    base = os.path.join(HERE, "out", "quick") if args.quick else None
    runs_dir = args.runs_dir or (os.path.join(base, "runs") if base else os.path.join(HERE, "out", "runs"))
    results_md = args.results_md or (os.path.join(base, "results.md") if base else os.path.join(HERE, "results.md"))
    plots_dir = args.plots_dir or (base if base else HERE)
    return replace(args, runs_dir=os.path.abspath(runs_dir), results_md=os.path.abspath(results_md),
                   plots_dir=os.path.abspath(plots_dir))


def validate(args: Args, registry: list[S]) -> None:
    known = {s.script for s in registry}
    for name in args.scripts:
        if name.removesuffix(".py") not in known:
            sys.exit(f"error: unknown script '{name}'; the registry has: {', '.join(sorted(known))}.")
    envs = {s.env for s in registry}
    for env in args.envs:
        if env not in envs:
            sys.exit(f"error: no setting uses env '{env}'; the registry has: {', '.join(sorted(envs))}.")
    names = {s.name for s in registry}
    for name in args.settings:
        if name not in names:
            sys.exit(f"error: unknown setting '{name}'; the registry has: {', '.join(sorted(names))}.")
    if args.workers < 1:
        sys.exit(f"error: --workers must be at least 1, got {args.workers}.")
    if args.steps is not None and args.steps < 1:
        sys.exit(f"error: --steps must be positive, got {args.steps}.")
    if args.repeats < 1:
        sys.exit(f"error: --repeats must be at least 1, got {args.repeats}.")


def select(args: Args, registry: list[S]) -> list[S]:
    """The registry entries the flags ask for, with --quick / --steps / --seeds applied."""
    scripts = {n.removesuffix(".py") for n in args.scripts}
    out = []
    for s in registry:
        if (scripts and s.script not in scripts) or (args.envs and s.env not in args.envs) or \
                (args.settings and s.name not in args.settings):
            continue
        if args.quick:
            if not s.quick:
                print(f"skip: {s.script} {s.env} {s.name}: too heavy for --quick", flush=True)
                continue
            info = SCRIPTS[s.script]
            s = replace(s, steps=info.quick_steps, seeds=s.seeds[:2], flags=s.flags + info.quick_flags)
        if args.steps is not None:
            s = replace(s, steps=args.steps)
        if args.seeds:
            s = replace(s, seeds=tuple(args.seeds))
        out.append(s)
    # the same setting may appear once per step budget; drop exact duplicates (e.g. after --steps)
    seen, unique = set(), []
    for s in out:
        key = (s.script, s.env, s.name, s.steps)
        if key not in seen:
            seen.add(key)
            unique.append(s)
    return unique


def script_path(name: str) -> str:
    return os.path.join(ROOT, SCRIPTS[name].file)


def present(name: str) -> bool:
    return os.path.isfile(script_path(name))


def has_torch_threads(name: str) -> bool:
    """The script has a `--torch-threads` flag (an Args field `torch_threads`)."""
    with open(script_path(name)) as f:
        return re.search(r"^\s+torch_threads\s*:", f.read(), re.M) is not None


def thread_env(limit: bool = True) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if limit:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


# ----------------------------------------------------------------------------------------------
# Runner
# ----------------------------------------------------------------------------------------------


@dataclass
class Job:
    setting: S
    seed: int
    run_dir: str
    cmd: list[str]
    harness_command: str = ""

    @property
    def label(self) -> str:
        s = self.setting
        return f"{s.script} {s.env} {s.name} {s.steps} steps seed {self.seed}"


def run_id(s: S, seed: int) -> str:
    return f"{s.script}__{s.env}__{s.name}__{s.steps}__seed{seed}"


def command(s: S, seed: int) -> list[str]:
    info = SCRIPTS[s.script]
    cmd = [sys.executable, script_path(s.script), info.env_flag, s.env, info.steps_flag, str(s.steps),
           info.seed_flag, str(seed), *s.flags]
    if has_torch_threads(s.script):
        cmd += ["--torch-threads", "1"]
    return cmd


def display_cmd(cmd: list[str]) -> str:
    """The command as a user types it from the repository root."""
    rel = [os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(ROOT) else c for c in cmd[1:]]
    return "python " + shlex.join(rel)


def is_complete(run_dir: str, cmd: Optional[list[str]] = None) -> bool:
    """A run is complete when its marker exists (written after exit 0) and, if given, holds `cmd`."""
    path = os.path.join(run_dir, MARKER)
    if not os.path.isfile(path):
        return False
    if cmd is None:
        return True
    try:
        with open(path) as f:
            return json.load(f).get("command") == display_cmd(cmd)
    except (OSError, json.JSONDecodeError):
        return False


def plan(selected: list[S], runs_dir: str, harness_cmd: str = "", force: bool = False
         ) -> tuple[list[Job], list[str], list[str]]:
    """Jobs to run, plus messages for what is skipped (missing script, already complete)."""
    jobs, missing, done = [], [], []
    for s in selected:
        if not present(s.script):
            missing.append(f"skip: {SCRIPTS[s.script].file} not present yet -> {s.env} {s.name} skipped")
            continue
        for seed in s.seeds:
            rd = os.path.join(runs_dir, run_id(s, seed))
            cmd = command(s, seed)
            if is_complete(rd, cmd) and not force:
                done.append(f"skip (complete): {s.script} {s.env} {s.name} {s.steps} steps seed {seed}")
            else:
                jobs.append(Job(s, seed, rd, cmd, harness_cmd))
    return jobs, missing, done


def execute(job: Job, nice: int = 0, timeout: Optional[float] = None) -> tuple[int, float]:
    """Run one job in its folder; write the marker on success. Returns (exit code, seconds)."""
    if os.path.isdir(job.run_dir):  # an interrupted or outdated run: start clean
        shutil.rmtree(job.run_dir)
    os.makedirs(job.run_dir)
    code = code_version(script_path(job.setting.script))
    preexec = (lambda: os.nice(nice)) if nice > 0 else None
    t0 = time.time()
    with open(os.path.join(job.run_dir, LOG), "w") as log:
        log.write(display_cmd(job.cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(job.cmd, cwd=job.run_dir, env=thread_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=preexec)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.write(f"\nkilled by benchmark/run.py after {timeout} s\n")
            rc = -9
    seconds = time.time() - t0
    if rc == 0:
        write_marker(job, seconds, nice, code)
    return rc, seconds


def code_version(path: str) -> dict:
    """The commit checked out and whether `path` is exactly as committed there (else its blob hash),
    so that a result says which code made it."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    rel = os.path.relpath(path, ROOT)
    blob, committed = git("hash-object", path), git("rev-parse", f"HEAD:{rel}")
    return {"commit": git("rev-parse", "--short", "HEAD"), "blob": blob[:12], "as_committed": bool(blob) and
            blob == committed}


def code_text(code: Optional[dict], script: str) -> str:
    if not code or not code.get("commit"):
        return "code version not recorded"
    if code["as_committed"]:
        return f"{script}.py blob {code['blob']}, as committed in {code['commit']}"
    return f"{script}.py blob {code['blob']}, uncommitted changes on top of {code['commit']}"


def code_texts(codes: list[Optional[dict]], script: str) -> list[str]:
    """One line per distinct version of the script's file among the seeds (the first commit it was seen at)."""
    by_blob: dict = {}
    for c in codes:
        key = c["blob"] if c and c.get("commit") else None
        by_blob.setdefault(key, c)
    return [code_text(c, script) for c in by_blob.values()]


def write_marker(job: Job, seconds: float, nice: int = 0, code: Optional[dict] = None) -> None:
    """The completion marker: the command (for resume) and everything the reader needs about the run."""
    s, info = job.setting, SCRIPTS[job.setting.script]
    marker = {
        "command": display_cmd(job.cmd), "wall_seconds": seconds, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "script": s.script, "env": s.env, "setting": s.name, "steps": s.steps, "seed": job.seed,
        "flags": list(s.flags), "tag": s.tag or info.tag, "last_n": s.last_n or info.last_n, "x_label": info.x_label,
        "y_label": s.tag or info.y_label, "refs": [asdict(r) for r in s.refs], "machine": machine(),
        "versions": versions(), "nice": os.nice(0) + nice, "harness_command": job.harness_command, "code": code,
        "load_at_end": round(os.getloadavg()[0], 2),
    }
    with open(os.path.join(job.run_dir, MARKER), "w") as f:
        json.dump(marker, f, indent=1)


def run_jobs(jobs: list[Job], workers: int, nice: int = 0, timeout: Optional[float] = None) -> list[Job]:
    """Run the jobs, at most `workers` at a time. Returns the failed ones."""
    failed, lock, count = [], threading.Lock(), [0]

    def one(job: Job) -> None:
        rc, seconds = execute(job, nice, timeout)
        with lock:
            count[0] += 1
            state = "done" if rc == 0 else f"FAILED (exit {rc}, see {os.path.join(job.run_dir, LOG)})"
            print(f"[{count[0]}/{len(jobs)}] {state}: {job.label} in {seconds:.0f} s", flush=True)
            if rc != 0:
                failed.append(job)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, jobs))
    return failed


# ----------------------------------------------------------------------------------------------
# Reader
# ----------------------------------------------------------------------------------------------


def read_scalars(run_dir: str, tag: str) -> list[tuple[int, float, float]]:
    """(step, value, wall_time) of every `tag` event in the event files under `run_dir`, in write order
    (one TensorBoard run folder after another, by name)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = sorted({os.path.dirname(p) for p in
                      glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True)})
    out = []
    for folder in folders:
        acc = EventAccumulator(folder, size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out += [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
    return out


def final_mean(values: list[float], last_n: int) -> float:
    """Mean of the last `last_n` values (all of them when there are fewer); nan when there are none."""
    tail = values[-last_n:]
    return sum(tail) / len(tail) if tail else float("nan")


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and POPULATION std (ddof=0, numpy's np.std) across seeds, ignoring nan seeds."""
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), statistics.pstdev(xs)


def aggregate(run_dirs: dict[int, str], tag: str = "charts/episodic_return", last_n: int = 100,
              wall_seconds: Optional[dict[int, float]] = None) -> dict:
    """Per seed: mean of the last `last_n` episodes of `tag`, final SPS, last step, wall time;
    across seeds: mean and population std of the per-seed means, mean SPS, mean wall time."""
    per_seed = {}
    for seed, rd in sorted(run_dirs.items()):
        values = [v for _, v, _ in read_scalars(rd, tag)]
        sps = read_scalars(rd, "charts/SPS")
        events = read_scalars(rd, tag) or sps
        if wall_seconds and seed in wall_seconds:
            wall = wall_seconds[seed]
        elif events:
            wall = events[-1][2] - events[0][2]
        else:
            wall = float("nan")
        per_seed[seed] = {
            "final": final_mean(values, last_n), "episodes": len(values),
            "sps": sps[-1][1] if sps else float("nan"),
            "last_step": max([e[0] for e in events], default=0), "wall_seconds": wall,
        }
    mean, std = mean_std([p["final"] for p in per_seed.values()])
    sps_values = [p["sps"] for p in per_seed.values() if p["sps"] == p["sps"]]
    walls = [p["wall_seconds"] for p in per_seed.values() if p["wall_seconds"] == p["wall_seconds"]]
    return {"per_seed": per_seed, "mean": mean, "std": std,
            "sps": statistics.fmean(sps_values) if sps_values else float("nan"),
            "wall_seconds": statistics.fmean(walls) if walls else float("nan")}


def complete_runs(runs_dir: str) -> dict[tuple, dict[int, tuple[str, dict]]]:
    """Complete runs found under `runs_dir`, grouped by (script, env, setting, steps): {seed: (dir, marker)}."""
    groups: dict[tuple, dict[int, tuple[str, dict]]] = {}
    for path in sorted(glob.glob(os.path.join(runs_dir, "*", MARKER))):
        try:
            with open(path) as f:
                m = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        key = (m["script"], m["env"], m["setting"], m["steps"])
        groups.setdefault(key, {})[m["seed"]] = (os.path.dirname(path), m)
    return groups


def curve(run_dir: str, tag: str, window: int) -> tuple[list[int], list[float]]:
    """(steps, running mean of the last `window` episodes) of one run, the metric of the table as a curve."""
    events = read_scalars(run_dir, tag)
    steps, means, tail, total = [], [], [], 0.0
    for step, value, _ in events:
        tail.append(value)
        total += value
        if len(tail) > window:
            total -= tail.pop(0)
        steps.append(step)
        means.append(total / len(tail))
    return steps, means


# ----------------------------------------------------------------------------------------------
# Machine, table, plots
# ----------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=10).stdout.strip().splitlines()
            gpu = ", ".join(names) if names else gpu
        except (OSError, subprocess.SubprocessError):
            pass
    return f"{cpu}, {os.cpu_count()} cores, {gpu}"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"python {platform.python_version()}"]
    for pkg in ("torch", "gymnasium", "transformers", "numpy", "tensorboard"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            parts.append(f"{pkg} -")
    return ", ".join(parts)


def fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def duration(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def make_rows(groups: dict, selected_keys: Optional[set]) -> list[dict]:
    """One table row per (script, env, setting, steps) group of complete runs."""
    rows = []
    for key, seeds in groups.items():
        if selected_keys is not None and key not in selected_keys:
            continue
        any_marker = next(iter(seeds.values()))[1]
        agg = aggregate({seed: d for seed, (d, _) in seeds.items()}, any_marker["tag"], any_marker["last_n"],
                        {seed: m["wall_seconds"] for seed, (_, m) in seeds.items()})
        commands = sorted({re.sub(r"(--seed) \d+", r"\1 {seed}", m["command"]) for _, m in seeds.values()})
        rows.append({
            "script": key[0], "env": key[1], "setting": key[2], "steps": key[3], "seeds": sorted(seeds),
            "mean": agg["mean"], "std": agg["std"], "tag": any_marker["tag"], "last_n": any_marker["last_n"],
            "per_seed": {str(s): p["final"] for s, p in agg["per_seed"].items()},
            "episodes": {str(s): p["episodes"] for s, p in agg["per_seed"].items()},
            "sps": agg["sps"], "wall_seconds": agg["wall_seconds"], "refs": any_marker["refs"],
            "machine": any_marker["machine"], "versions": any_marker["versions"], "nice": any_marker["nice"],
            "harness_command": " / ".join(sorted({m["harness_command"] for _, m in seeds.values()})),
            "run_commands": commands,
            "code": code_texts([m.get("code") for _, m in seeds.values()], key[0]),
            "finished": max(m["finished"] for _, m in seeds.values()),
            "load": [m["load_at_end"] for _, m in seeds.values() if "load_at_end" in m],
        })
    return rows


def row_order(row: dict) -> tuple:
    keys = [(s.script, s.env, s.name) for s in SETTINGS]
    k = (row["script"], row["env"], row["setting"])
    return (keys.index(k) if k in keys else len(keys), row["steps"])


def load_rows(json_path: str) -> dict:
    if os.path.isfile(json_path):
        with open(json_path) as f:
            return json.load(f)
    return {"rows": [], "throughput": []}


def write_results(md_path: str, new_rows: list[dict], throughput: Optional[list[dict]] = None) -> None:
    """Merge the new rows into the .json next to `md_path` (same key replaces) and render the Markdown."""
    json_path = os.path.splitext(md_path)[0] + ".json"
    data = load_rows(json_path)
    keys = {(r["script"], r["env"], r["setting"], r["steps"]) for r in new_rows}
    data["rows"] = sorted([r for r in data["rows"] if (r["script"], r["env"], r["setting"], r["steps"]) not in keys]
                          + new_rows, key=row_order)
    if throughput:
        labels = {t["label"] for t in throughput}
        data["throughput"] = [t for t in data.get("throughput", []) if t["label"] not in labels] + throughput
    os.makedirs(os.path.dirname(md_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    with open(md_path, "w") as f:
        f.write(render(data))


def render(data: dict) -> str:
    machines = sorted({r["machine"] + "; " + r["versions"] for r in data["rows"]} |
                      {t["machine"] + "; " + t["versions"] for t in data.get("throughput", [])})
    mid = {m: f"M{i + 1}" for i, m in enumerate(machines)}
    lines = [
        "# Benchmark results",
        "",
        "Written by `benchmark/run.py` (do not edit by hand; rows live in `results.json`).",
        "Ours: per seed the mean of the last N episodes (N = 100 for returns, 10 for ICPI regret), then mean ± "
        "population std (ddof=0) across seeds, the openrlbenchmark convention. SPS: the run's final `charts/SPS`, "
        "mean over seeds; wall: one run's wall time, mean over seeds. Runs were launched in parallel (`--workers`) "
        "on a machine SHARED with other jobs: SPS and wall times are contended and only comparable within one "
        "side-by-side measurement (see Throughput).",
        "",
        "| # | script | env | setting | steps | seeds | ours (mean ± std) | reference (source) | SPS | wall / run "
        "| machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(data["rows"]):
        refs = "; ".join(Ref(**x).text() for x in r["refs"]) or "-"
        metric = "" if r["tag"] == "charts/episodic_return" else f" ({r['tag']})"
        lines.append(f"| {i + 1} | `{r['script']}.py` | {r['env']} | {r['setting']} | {r['steps']:,} | "
                     f"{' '.join(map(str, r['seeds']))} | {fmt(r['mean'])} ± {fmt(r['std'])}{metric} | {refs} | "
                     f"{fmt(r['sps'], 0)} | {duration(r['wall_seconds'])} | "
                     f"{mid[r['machine'] + '; ' + r['versions']]} |")
    lines += ["", "Per row: the command that made it, the per-seed numbers and the run command of each seed.", ""]
    for i, r in enumerate(data["rows"]):
        per_seed = ", ".join(f"seed {s}: {fmt(v)} ({r['episodes'][s]} episodes)" for s, v in r["per_seed"].items())
        load = f", 1-minute load average at the runs' ends {min(r['load'])}-{max(r['load'])}" if r.get("load") else ""
        lines.append(f"{i + 1}. `{r['harness_command']}` (finished {r['finished']}, niceness {r['nice']}{load}). "
                     f"{per_seed}. Each seed ran `{'`, `'.join(r['run_commands'])}` "
                     f"({'; '.join(r.get('code', []))}).")
    if data.get("throughput"):
        lines += ["", "## Throughput (short runs, alternating with the peer on the same machine)", "",
                  "Ours always runs with one torch thread; the peer's threads are in the table. Rollout / update: "
                  "seconds of one run spent collecting and updating (median run), from `time/rollout_seconds` and "
                  "`time/update_seconds`.", "",
                  "| script | flags | steps | SPS (median) | rollout / update seconds | peer | peer threads "
                  "| peer SPS (median) | ratio | repeats | machine |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in data["throughput"]:
            split = "-" if t["rollout_s"] is None else f"{t['rollout_s']:.1f} / {t['update_s']:.1f}"
            lines.append(f"| `{t['script']}.py` | `{' '.join(t['flags']) or '(defaults)'}` | {t['steps']:,} | "
                         f"{fmt(t['sps'], 0)} | {split} | {t['peer_label'] or '-'} | {t.get('peer_threads') or '-'} | "
                         f"{fmt(t['peer_sps'], 0)} | "
                         f"{fmt(t['ratio'])} | {t['repeats']} | {mid[t['machine'] + '; ' + t['versions']]} |")
        lines += [""] + [f"- `{t['harness_command']}`" + (f": 1-minute load average {t['load'][0]} before, "
                                                           f"{t['load'][1]} after" if "load" in t else "")
                         for t in data["throughput"]]
    lines += ["", "Machines:", ""] + [f"- {v}: {k}" for k, v in mid.items()]
    return "\n".join(lines) + "\n"


def plot(groups: dict, scripts: list[str], plots_dir: str, points: int = 200) -> list[str]:
    """One PNG per script (`{plots_dir}/{script}.png`), one panel per env that script has runs on; every
    setting of that env (from any script) on the same axes: mean over seeds with a ±std band, and the
    published references as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    for script in scripts:
        envs = sorted({k[1] for k in groups if k[0] == script}, key=lambda e: [s.env for s in SETTINGS].index(e)
                      if e in [s.env for s in SETTINGS] else 999)
        if not envs:
            continue
        fig, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4.2), squeeze=False)
        for ax, env in zip(axes[0], envs):
            refs, marker = {}, None
            for key in sorted((k for k in groups if k[1] == env), key=lambda k: (k[0] != script, k)):
                seeds = groups[key]
                marker = next(iter(seeds.values()))[1]
                curves = [curve(d, marker["tag"], marker["last_n"]) for d, _ in seeds.values()]
                curves = [c for c in curves if c[0]]
                if not curves:
                    continue
                grid = np.linspace(0, max(c[0][-1] for c in curves), points)
                ys = np.array([np.interp(grid, c[0], c[1], left=np.nan, right=np.nan) for c in curves])
                with warnings.catch_warnings():  # grid points before any seed's first episode are nan
                    warnings.simplefilter("ignore", RuntimeWarning)
                    mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
                label = f"{key[0]} {key[2]} ({len(curves)} seeds)"
                if any(k[1] == env and k[:3] == key[:3] and k[3] != key[3] for k in groups):
                    label += f" {key[3]:,} steps"
                few = int(np.isfinite(mean).sum()) <= 2  # e.g. every episode ended on the last step
                line, = ax.plot(grid, mean, label=label, marker="o" if few else None)
                ax.fill_between(grid, mean - std, mean + std, color=line.get_color(), alpha=0.2)
                for r in marker["refs"]:
                    refs[(r["value"], r["source"])] = r
            for i, r in enumerate(refs.values()):
                ax.axhline(r["value"], color="k", linestyle=["--", ":", "-."][i % 3], linewidth=1,
                           label=Ref(**r).text())
            if marker:
                ax.set_xlabel(marker["x_label"])
                ax.set_ylabel(f"{marker['y_label']} (mean of last {marker['last_n']} episodes)")
            ax.set_title(env)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        os.makedirs(plots_dir, exist_ok=True)
        path = os.path.join(plots_dir, f"{script}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def report(args: Args, selected: list[S]) -> None:
    groups = complete_runs(args.runs_dir)
    keys = {(s.script, s.env, s.name, s.steps) for s in selected}
    rows = make_rows(groups, keys)
    for r in rows:
        print(f"{r['script']} {r['env']} {r['setting']} {r['steps']:,} steps, seeds {r['seeds']}: "
              f"{fmt(r['mean'])} +- {fmt(r['std'])} (population std), SPS {fmt(r['sps'], 0)}, "
              f"wall {duration(r['wall_seconds'])}/run", flush=True)
    if not rows:
        print(f"report: no complete runs for the selection under {args.runs_dir}", flush=True)
        return
    write_results(args.results_md, rows)
    print(f"wrote {args.results_md}", flush=True)
    scripts = sorted({r["script"] for r in rows}, key=list(SCRIPTS).index)
    for path in plot(groups, scripts, args.plots_dir):
        print(f"wrote {path}", flush=True)


# ----------------------------------------------------------------------------------------------
# Throughput
# ----------------------------------------------------------------------------------------------


def timed_run(cmd: list[str], limit_threads: bool, steps: int) -> dict:
    """Run `cmd` in a fresh folder; SPS from its last `N steps/s` line, else its logged charts/SPS, else
    steps / process wall time; rollout and update seconds summed from the log where it has them."""
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=cwd, env=thread_env(limit_threads), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        wall = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{display_cmd(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        found = re.findall(r"([0-9.]+) steps/s", proc.stdout)
        logged = read_scalars(cwd, "charts/SPS")
        sps = float(found[-1]) if found else (logged[-1][1] if logged else steps / wall)
        rollout = read_scalars(cwd, "time/rollout_seconds")
        update = read_scalars(cwd, "time/update_seconds")
    return {"sps": sps, "wall": wall, "rollout_s": sum(v for _, v, _ in rollout) if rollout else None,
            "update_s": sum(v for _, v, _ in update) if update else None}


def throughput(args: Args, harness_cmd: str) -> list[dict]:
    scripts = {n.removesuffix(".py") for n in args.scripts}
    results = []
    for p in THROUGHPUT:
        if (scripts and p.script not in scripts) or (args.envs and p.env not in args.envs):
            continue
        if not present(p.script):
            print(f"skip: {SCRIPTS[p.script].file} not present yet -> throughput skipped", flush=True)
            continue
        info = SCRIPTS[p.script]
        steps = args.throughput_steps or (info.quick_steps if args.quick else info.throughput_steps)
        extra = info.quick_flags if args.quick else ()
        ours_cmd = [sys.executable, script_path(p.script), info.env_flag, p.env, info.steps_flag, str(steps),
                    *p.flags, *extra]
        if has_torch_threads(p.script):
            ours_cmd += ["--torch-threads", "1"]
        peer_cmd = None
        if p.peer_file:
            peer_path = os.path.join(ROOT, p.peer_file)
            if not os.path.isfile(peer_path):
                print(f"skip: peer {p.peer_file} not present -> {p.script} timed alone", flush=True)
            else:
                peer_cmd = [sys.executable, peer_path, info.env_flag, p.env, info.steps_flag, str(steps),
                            *p.peer_flags, *extra]
        ours, peer = [], []
        load0 = round(os.getloadavg()[0], 2)
        peer_limit = p.peer_thread_limit and not args.peer_default_threads
        try:
            for _ in range(args.repeats):  # alternate, so a competing process slows both alike
                if peer_cmd:
                    peer.append(timed_run(peer_cmd, peer_limit, steps))
                ours.append(timed_run(ours_cmd, True, steps))
                print(f"{' '.join([p.script, *p.flags])}: {ours[-1]['sps']:.0f} steps/s"
                      + (f"; peer ({p.peer_label}): {peer[-1]['sps']:.0f} steps/s" if peer else ""), flush=True)
        except RuntimeError as e:
            print(f"throughput: {p.script} failed: {e}", flush=True)
            continue
        sps = statistics.median(r["sps"] for r in ours)
        peer_sps = statistics.median(r["sps"] for r in peer) if peer else float("nan")
        split = [r for r in ours if r["rollout_s"] is not None]
        t = {"label": f"{p.script} {p.env} {' '.join(p.flags)} {steps} {peer_limit}", "script": p.script,
             "env": p.env,
             "flags": list(p.flags), "steps": steps, "sps": sps, "peer_label": p.peer_label if peer else "",
             "peer_sps": peer_sps, "ratio": sps / peer_sps if peer else float("nan"), "repeats": args.repeats,
             "peer_threads": ("1 (OMP_NUM_THREADS=1)" if peer_limit else "torch default") if peer else "",
             "rollout_s": statistics.median(r["rollout_s"] for r in split) if split else None,
             "update_s": statistics.median(r["update_s"] for r in split) if split else None,
             "machine": machine(), "versions": versions(), "harness_command": harness_cmd,
             "load": [load0, round(os.getloadavg()[0], 2)]}
        msg = f"{p.script}: median {sps:.0f} steps/s"
        if t["rollout_s"] is not None:
            msg += f" (rollout {t['rollout_s']:.1f} s, update {t['update_s']:.1f} s per run)"
        if peer:
            msg += f"; peer {p.peer_label}: {peer_sps:.0f} steps/s; ratio {t['ratio']:.2f}x"
        print(msg, flush=True)
        results.append(t)
    return results


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None, registry: Optional[list[S]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = resolve_paths(tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0]))
    registry = SETTINGS if registry is None else registry
    validate(args, registry)
    harness_cmd = "python benchmark/run.py " + shlex.join(argv) if argv else "python benchmark/run.py"
    selected = select(args, registry)

    if args.mode == "list":
        for s in selected:
            state = "present" if present(s.script) else "script not present yet -> skipped"
            refs = "; ".join(r.text() for r in s.refs) or "-"
            print(f"{s.script:22s} {s.env:15s} {s.name:18s} {s.steps:>9,} seeds {s.seeds} "
                  f"flags {' '.join(s.flags) or '-'} | ref {refs} | {state}")
        return 0
    if args.mode == "throughput":
        results = throughput(args, harness_cmd)
        if results:
            write_results(args.results_md, [], results)
            print(f"wrote {args.results_md}", flush=True)
        return 0

    failed = []
    if args.mode == "train":
        jobs, missing, done = plan(selected, args.runs_dir, harness_cmd, args.force)
        for line in missing + done:
            print(line, flush=True)
        if jobs:
            print(f"running {len(jobs)} runs, {min(args.workers, len(jobs))} at a time, under {args.runs_dir}",
                  flush=True)
            failed = run_jobs(jobs, args.workers, args.nice, args.timeout)
    report(args, selected)  # from whatever complete runs exist (the script itself may be absent here)
    if failed:
        print(f"error: {len(failed)} run(s) failed: " + "; ".join(j.label for j in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
