"""The benchmark harness: runs the settings of registry.toml over seeds and stores what they logged.

    python benchmark/run.py --mode report                                    # results.md, plots and page tables
    python benchmark/run.py --mode list                                      # the registry
    python benchmark/run.py --scripts ppo_cartpole --envs CartPole-v1        # train what is missing, store, report
    python benchmark/run.py --mode collect --runs-dir DIR                    # store runs finished elsewhere
    python benchmark/run.py --mode throughput --scripts ppo_cartpole         # timed runs alternating with the peer
    python benchmark/run.py --mode speed --speed gpt2ppo-lunar-strided       # seconds per update of configurations

Every (setting, seed) is one process in its own folder (`run_folder`) running `job_command` with one thread, at most
`--workers` at a time, or as a task of one Slurm job array (`--slurm`). Its output goes to run.log, and a run that
exits 0 gets a marker done.json: a run whose marker holds the same command is complete and is skipped; a stopped run
that left its script's training state continues with `--resume`; any other folder is cleared and run again.
Collecting reads the runs' TensorBoard event files into the results store (benchmark/results/, a JSON file per
setting with every seed's episode series); report.py renders from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import report  # noqa: E402

MARKER = "done.json"
RUNNING: set = set()  # the scripts running now (train mode), which a signal to the harness is passed on to
STOPPING: list[int] = []  # the signal that asked the harness to stop, if any


# ----------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Script:
    """How to drive a script ([scripts.NAME] in registry.toml)."""

    file: str
    env_flag: str = "--env-id"
    steps_flag: str = "--total-timesteps"
    tag: str = "charts/episodic_return"  # the scalar a row aggregates
    last_n: int = 100  # episodes averaged per seed at the end of a run (and the plots' running-mean window)
    last_fraction: Optional[float] = None  # instead: the episodes that ended in this last fraction of the steps
    x_label: str = "environment steps"
    y_label: str = "episodic return"
    quick_steps: int = 2048  # --quick: the tiny budget, with these extra flags
    quick_flags: str = ""
    phases: tuple[str, ...] = ("rollout", "update")  # --mode speed: the time/<phase>_seconds that sum to an update's


@dataclass(frozen=True)
class Ref:
    """A published number shown beside a setting's rows."""

    value: float
    std: Optional[float]
    source: str
    address: str = ""  # where the number stands: the table's or figure's web address, or the figure of a document
    kind: str = ""  # what it measures: "training" (a learning curve, its last episodes) or "evaluation" (an agent's)


@dataclass(frozen=True)
class S:
    """One setting: a script on an env with flags, a step budget, seeds and published numbers."""

    script: str
    env: str
    name: str
    steps: int
    seeds: tuple[int, ...]
    flags: tuple[str, ...] = ()
    refs: tuple[Ref, ...] = ()
    quick: bool = True  # False: too heavy for --quick (a real language model, a GPU)
    tag: Optional[str] = None  # the scalar aggregated, if not the script's (eval/episodic_return: an evaluation)
    last_n: Optional[int] = None
    train_last_n: Optional[int] = None  # an evaluation row's training-return window, if not report.TRAIN_LAST_N


def load_registry(reg: dict) -> tuple[dict, list[S]]:
    """The scripts and the settings of registry.toml (its head says how an entry expands)."""
    scripts = {name: Script(**d) for name, d in reg["scripts"].items()}
    refs = {key: Ref(value, std if std != "" else None, *rest) for key, (value, std, *rest) in reg["refs"].items()}
    settings = []
    for e in reg["settings"]:
        pairs = e["envs"].items() if isinstance(e["envs"], dict) else [(v, n) for n in e["steps"] for v in e["envs"]]
        opts = {k: e[k] for k in ("quick", "tag", "last_n", "train_last_n") if k in e}
        for (env, steps), (name, flags) in ((p, f) for p in pairs for f in e["names"].items()):
            flags = tuple(shlex.split(flags.replace("{out}", os.path.join(HERE, "out"))))
            keys = [r.format(env=env) for r in e.get("refs", [])]
            refs_here = tuple(refs[k] for k in keys if k in refs)
            settings.append(S(e["script"], env, name, steps, tuple(e["seeds"]), flags, refs_here, **opts))
    return scripts, settings


SCRIPTS, SETTINGS = load_registry(report.REGISTRY)
THROUGHPUT, SPEED = report.REGISTRY["throughput"], report.REGISTRY["speed"]


# ----------------------------------------------------------------------------------------------- runner


def run_folder(runs_dir: str, s: S, seed: int) -> str:
    """The folder of one run: the script's runs/ lands there, with run.log and, once it exited 0, done.json."""
    return os.path.join(runs_dir, f"{s.script}__{s.env}__{s.name}__{s.steps}__seed{seed}")


def script_command(path: str, info: Script, env: str, steps: int, flags) -> list[str]:
    """`python path --env-id env --total-timesteps steps flags`, with `--torch-threads 1` where the script has it."""
    cmd = [sys.executable, os.path.join(ROOT, path), info.env_flag, env, info.steps_flag, str(steps), *flags]
    with open(os.path.join(ROOT, path)) as f:
        return cmd + ["--torch-threads", "1"] * bool(re.search(r"^\s+torch_threads\s*:", f.read(), re.M))


def job_command(s: S, seed: int) -> list[str]:
    """The command of one run (started in its run folder)."""
    return script_command(SCRIPTS[s.script].file, SCRIPTS[s.script], s.env, s.steps, ("--seed", str(seed), *s.flags))


def shown(arg: str) -> str:
    """A command-line word as stored and shown: a path inside the repository relative to its root."""
    return os.path.relpath(arg, ROOT) if os.path.isabs(arg) and arg.startswith(ROOT + os.sep) else arg


def portable(command: str) -> str:
    """A stored harness command without this machine's folders: a path outside the repository becomes `<its name>`."""
    return re.sub(
        r"(?<![\w.~-])/\S+",
        lambda m: shown(m.group()) if m.group().startswith(ROOT) else f"<{os.path.basename(m.group())}>",
        command,
    )


def display(cmd: list[str]) -> str:
    return "python " + shlex.join(map(shown, cmd[1:]))


def thread_env(threads: int = 1) -> dict:
    n = str(threads)
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)


# what a run's marker holds, all of which collect reads: a marker without one of them is not this harness's
MARKER_KEYS = {"command", "seconds", "finished", "machine", "versions", "nice", "code", "harness_command", "load"}


def marker(folder: str) -> Optional[dict]:
    """The run's marker (written when it exited 0), or None: none, or not one of this harness's (unreadable, cut, of
    another program): the run then counts as not complete and runs again."""
    try:
        with open(os.path.join(folder, MARKER)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and MARKER_KEYS <= found.keys() else None


def is_complete(folder: str, cmd: list[str]) -> bool:
    return (marker(folder) or {}).get("command") == display(cmd)


def machine() -> str:
    """CPU model (with its bfloat16 support, which decides whether bfloat16 beats float32 there), cores, GPUs."""
    cpu, flags = platform.processor() or platform.machine(), set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        cpu, flags = info.get("model name\t", cpu).strip(), set(info.get("flags\t\t", "").split())
    if flags:
        cpu += " (AMX)" if "amx_bf16" in flags else " (AVX512-BF16, no AMX)" if "avx512_bf16" in flags else " (no AMX)"
    gpu = subprocess.run(
        "nvidia-smi --query-gpu=name --format=csv,noheader", shell=True, capture_output=True, text=True
    )
    return f"{cpu}, {os.cpu_count()} cores, {', '.join(gpu.stdout.splitlines()) or 'no GPU'}"


def versions() -> str:
    from importlib.metadata import version

    packages = ("torch", "gymnasium", "transformers", "numpy", "tensorboard")
    return ", ".join([f"python {platform.python_version()}"] + [f"{p} {version(p)}" for p in packages])


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def resumable(folder: str, cmd: list[str]) -> Optional[str]:
    """The script's run folder inside `folder` that a stopped run of `cmd` left with a training state, when the script
    takes `--resume` and the run is not complete; None otherwise (the run starts afresh)."""
    with open(cmd[1]) as f:
        takes_resume = re.search(r"^\s+resume\s*:", f.read(), re.M)
    states = glob.glob(os.path.join(folder, "runs", "*", "training_state.pt"))
    try:
        with open(os.path.join(folder, "run.log")) as f:
            same = f.readline().strip() == display(cmd)
    except OSError:
        same = False
    return (
        os.path.dirname(states[0])
        if takes_resume and same and len(states) == 1 and not is_complete(folder, cmd)
        else None
    )


def run_job(
    s: S, seed: int, runs_dir: str, harness_command: str = "", nice: int = 0, timeout=None, slurm: bool = False
) -> int:
    """Run one (setting, seed) in its run folder: a stopped run that left a training state continues (`--resume`),
    anything else starts in a fresh folder; write the marker when it exits 0. Returns the exit code (75: another
    process runs it now)."""
    folder, cmd, file = run_folder(runs_dir, s, seed), job_command(s, seed), SCRIPTS[s.script].file
    if STOPPING:  # the harness was asked to stop: start nothing more
        return 128 + STOPPING[0]
    os.makedirs(runs_dir, exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        try:  # one process per run folder: a second harness (or Slurm task) on the same run leaves it alone
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"skip (another process runs it now): {os.path.basename(folder)}", flush=True)
            return 75
        resume = resumable(folder, cmd)
        blob, commit = git("hash-object", os.path.join(ROOT, file))[:12], git("rev-parse", "--short", "HEAD")
        rc = attempt(folder, cmd, resume, nice, timeout, slurm)
        if rc == 0:
            with open(os.path.join(folder, "attempts.log")) as f:
                seconds = sum(float(line.split()[0]) for line in f)
            marker = {"command": display(cmd), "seconds": seconds, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
            marker.update(machine=machine(), versions=versions(), nice=os.nice(0) + nice)
            marker.update(code=f"{file} blob {blob} on {commit}", resumed=resume is not None)
            marker.update(harness_command=harness_command, load=round(os.getloadavg()[0], 2))
            with open(os.path.join(folder, MARKER), "w") as f:
                json.dump(marker, f, indent=1)
    return rc


def attempt(folder: str, cmd: list[str], resume: Optional[str], nice: int, timeout, slurm: bool = False) -> int:
    """One attempt at a run: `cmd` in a fresh folder, or `cmd --resume RUN` in the folder it stopped in; its output
    appended to run.log and its wall time to attempts.log. Returns the exit code (-9: killed at the timeout)."""
    if resume is None:
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted or outdated run starts clean
        os.makedirs(folder)
    t0 = time.time()
    with open(os.path.join(folder, "run.log"), "a") as log:
        full = cmd if resume is None else cmd + ["--resume", os.path.relpath(resume, folder)]
        print(display(full) if resume is None else f"resumed: {display(full)}", file=log, flush=True)
        # here, its own session: Ctrl-C at the terminal reaches the harness alone, which passes it on once (stop_runs);
        # in a Slurm task, the task's session, which Slurm signals as a whole
        kw = dict(cwd=folder, env=thread_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = subprocess.Popen(["nice", "-n", str(nice), *full] if nice else full, start_new_session=not slurm, **kw)
        RUNNING.add(proc)
        if nice and not slurm:  # a kernel that groups sessions (autogroup) weighs a session, not its process's nice
            with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/autogroup", "w") as group:
                group.write(str(nice))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        finally:
            RUNNING.discard(proc)
    with open(os.path.join(folder, "attempts.log"), "a") as f:  # the wall time of every attempt, resumed or not
        print(f"{time.time() - t0:.3f} {rc}", file=f)
    return rc


def stop_runs(signum, frame) -> None:
    """SIGINT or SIGTERM to the harness: pass it on to the running scripts (which save their training state and stop;
    a second signal makes them quit at once) and start no more."""
    STOPPING.append(signum)
    print(f"\n{signal.Signals(signum).name}: passed on to {len(RUNNING)} running scripts", file=sys.stderr, flush=True)
    for proc in list(RUNNING):
        proc.send_signal(signum)


# ----------------------------------------------------------------------------------------------- Slurm


SBATCH = """#!/bin/bash
#SBATCH --job-name=benchmark
#SBATCH --array=0-{last}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={runs_dir}/slurm-%A_%a.log
#SBATCH --cpus-per-task=1
#SBATCH --time={time}
{extra}
exec {python} {run_py} --mode slurm-task --jobs-file {jobs_file}
"""


def submit_slurm(args: "Args", selected: list[S], harness_command: str) -> int:
    """One Slurm job array, a task per (setting, seed) that is not complete, and a job after it that collects the
    runs into the store and writes the report."""
    jobs = [(s, seed) for s in selected for seed in s.seeds]
    jobs = [
        (s, seed)
        for s, seed in jobs
        if args.force or not is_complete(run_folder(args.runs_dir, s, seed), job_command(s, seed))
    ]
    if not jobs:
        print("nothing to submit: every run is complete", flush=True)
        return 0
    made = args.runs_dir  # the folders made here, removed again if the submission fails
    while not os.path.exists(os.path.dirname(made)):
        made = os.path.dirname(made)
    made = None if os.path.exists(made) else made
    os.makedirs(args.runs_dir, exist_ok=True)
    handle, jobs_file = tempfile.mkstemp(prefix="slurm-jobs-", suffix=".json", dir=args.runs_dir)
    with os.fdopen(handle, "w") as f:
        json.dump(
            {
                "runs_dir": args.runs_dir,
                "harness_command": harness_command,
                "nice": args.nice,
                "jobs": [{"setting": asdict(s), "seed": seed} for s, seed in jobs],
            },
            f,
            indent=1,
        )
    extra = [f"#SBATCH --partition={args.slurm_partition}"] * bool(args.slurm_partition)
    extra += [f"#SBATCH --gpus-per-task={args.slurm_gpus_per_task}"] * bool(args.slurm_gpus_per_task)
    script = SBATCH.format(
        last=len(jobs) - 1,
        runs_dir=args.runs_dir,
        time=args.slurm_time,
        extra="\n".join(extra),
        python=sys.executable,
        run_py=os.path.abspath(__file__),
        jobs_file=jobs_file,
    )
    collect_cmd = [sys.executable, os.path.abspath(__file__), "--mode", "collect", *selection_flags(args)]
    array = None
    try:
        array = sbatch(script)
        after = sbatch(
            f"#!/bin/bash\n#SBATCH --job-name=benchmark-collect\n#SBATCH --dependency=afterany:{array}\n"
            f"#SBATCH --output={args.runs_dir}/slurm-{array}-collect.log\n{shlex.join(collect_cmd)}\n"
        )
    except SbatchError as e:  # nothing stays behind: the array (if it went out), the jobs file, the folders made
        if array is not None:
            subprocess.run(["scancel", array], capture_output=True, timeout=60)
        os.remove(jobs_file)
        if made:
            shutil.rmtree(made, ignore_errors=True)
        print(f"error: {e}{f' (job array {array} cancelled)' * (array is not None)}.", file=sys.stderr)
        sys.exit(2)
    print(
        f"submitted job array {array} ({len(jobs)} runs) and job {after}, which stores them and writes the report "
        f"when the array has finished; the tasks' logs: {args.runs_dir}/slurm-{array}_*.log",
        flush=True,
    )
    return 0


class SbatchError(Exception):
    """A submission that Slurm did not take."""


def sbatch(script: str, timeout: float = 120) -> str:
    """Submit a batch script; its job id. SbatchError with sbatch's first error line when it is not taken."""
    try:
        proc = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SbatchError(f"sbatch did not answer in {timeout:.0f} s (is the cluster reachable?)") from None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    job = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 or not job:
        first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
        raise SbatchError(f'sbatch failed (exit {proc.returncode}): "{first.rstrip(".")}"')
    return job


def slurm_task(jobs_file: str) -> int:
    """One task of the array: its run, continued if an earlier attempt stopped. When Slurm stops the task (SIGTERM:
    preemption, the time limit, `scontrol requeue`), the script saves its training state and the task requeues itself,
    so that the next attempt resumes."""
    with open(jobs_file) as f:
        spec = json.load(f)
    job = spec["jobs"][int(os.environ["SLURM_ARRAY_TASK_ID"])]  # check_args made sure both are there
    s = S(
        **{
            **job["setting"],
            "seeds": tuple(job["setting"]["seeds"]),
            "flags": tuple(job["setting"]["flags"]),
            "refs": (),
        }
    )
    stopped = []
    # Slurm signals every process of the task, the script too, which saves and stops: not passed on here (twice would
    # make the script quit at once)
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    rc = run_job(s, job["seed"], spec["runs_dir"], spec["harness_command"], spec["nice"], slurm=True)
    if rc != 0 and stopped:
        requeue = subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], capture_output=True, text=True)
        print(f"stopped by Slurm; requeue: {requeue.stderr.strip() or 'done'}", flush=True)
    return rc


# ----------------------------------------------------------------------------------------------- collect


def read_run(folder: str):
    """Every scalar of the event files under a run folder, in write order within each TensorBoard run. Tensorboard's
    own reader, because it honours `purge_step`: a resumed run hides what it logged after its last checkpoint."""
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    frames = []
    for d in sorted({os.path.dirname(p) for p in glob.glob(os.path.join(folder, "**", "*tfevents*"), recursive=True)}):
        acc = EventAccumulator(d, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            events = acc.Scalars(tag)
            frames.append(
                pd.DataFrame({"step": [e.step for e in events], "tag": tag, "value": [e.value for e in events]})
            )
    if not frames:
        return pd.DataFrame({"step": [], "tag": [], "value": []})
    df = pd.concat(frames, ignore_index=True)
    # An evaluation logs episode i at step i, below any purge_step: one stopped part-way and run again on resume
    # left its first episodes twice. Each episode's last value is the evaluation that finished.
    return df[~(df.tag.str.startswith("eval/") & df.duplicated(["tag", "step"], keep="last"))].reset_index(drop=True)


PERTURBED = re.compile(r"eval/(.+)/episodic_return$")  # an evaluation under one of --eval-perturbations


def series(df, tag: str, significant: bool = False) -> dict:
    """A tag's steps and values, to 4 decimals (returns, entropies) or `significant`ly to 6 digits (small numbers)."""
    values = df.value[df.tag == tag]
    values = [float(f"{v:.6g}") for v in values] if significant else values.round(4).tolist()
    return {"steps": df.step[df.tag == tag].astype(int).tolist(), "values": values}


def collect(s: S, runs_dir: str, results_dir: str, wanted: tuple[int, ...] = ()) -> Optional[dict]:
    """The complete runs of setting `s` under `runs_dir` as a store row, written to the store; seeds of the stored row
    that these runs lack and the registry still lists (`wanted`) are kept (same flags and metric). None: no run."""
    info, fresh = SCRIPTS[s.script], {}
    for seed in s.seeds:
        folder = run_folder(runs_dir, s, seed)
        if is_complete(folder, job_command(s, seed)):  # a run of this setting's command, not of older flags
            fresh[str(seed)] = (read_run(folder), marker(folder))
    if not fresh:
        return None
    tag, dfs, markers = s.tag or info.tag, {k: df for k, (df, _) in fresh.items()}, [m for _, m in fresh.values()]
    row = {"script": s.script, "env": s.env, "setting": s.name, "steps": s.steps, "seeds": sorted(map(int, fresh))}
    row.update(flags=[shown(f) for f in s.flags], tag=tag, last_n=s.last_n or info.last_n)
    row.update(last_fraction=info.last_fraction, x_label=info.x_label, y_label=s.tag or info.y_label)
    row.update(refs=[asdict(r) for r in s.refs], source="harness", series={k: series(df, tag) for k, df in dfs.items()})
    if tag.startswith("eval/"):
        row["train_series"] = {k: series(df, info.tag) for k, df in dfs.items()}
        row.update({"train_last_n": s.train_last_n} if s.train_last_n else {})
    logged = lambda t: {k: df.value[df.tag == t] for k, df in dfs.items() if (df.tag == t).any()}  # noqa: E731
    # where logged: the policy's entropy per update, and each perturbed evaluation (eval/<perturbation>/episodic_return)
    row["entropy_series"] = {
        k: series(df, "losses/entropy") for k, df in dfs.items() if (df.tag == "losses/entropy").any()
    }
    # and where logged, what each policy step did (diagnostics/<name>, per update): exploratory, for the plots
    diagnostics = sorted({t for df in dfs.values() for t in df.tag.unique() if t.startswith("diagnostics/")})
    row["diagnostics_series"] = {
        t[len("diagnostics/") :]: {k: series(df, t, significant=True) for k, df in dfs.items() if (df.tag == t).any()}
        for t in diagnostics
    }
    perturbed = sorted({m[1] for df in dfs.values() for t in df.tag.unique() if (m := PERTURBED.match(t))})
    row["perturbed_series"] = {
        p: {
            k: series(df, f"eval/{p}/episodic_return")
            for k, df in dfs.items()
            if (df.tag == f"eval/{p}/episodic_return").any()
        }
        for p in perturbed
    }
    rollout, update = logged("time/rollout_seconds"), logged("time/update_seconds")
    row["seconds_per_update"] = {k: [round(rollout[k].mean(), 3), round(v.mean(), 3)] for k, v in update.items()}
    row["seed_replayed"] = {k: int(v.sum()) for k, v in logged("model/replayed").items()}
    row["seed_sps"] = {k: float(v.iloc[-1]) for k, v in logged("charts/SPS").items()}
    row["seed_wall_seconds"] = {k: m["seconds"] for k, (_, m) in fresh.items()}
    row["seed_machine"] = {k: m["machine"] for k, (_, m) in fresh.items()}  # seeds pool across machines: each's kept
    row["seed_code"] = {k: m["code"] for k, (_, m) in fresh.items()}
    for key in ("machine", "versions", "nice", "harness_command"):
        row[key] = " / ".join(dict.fromkeys(str(m[key]) for m in markers))
    row["run_commands"] = sorted({re.sub(r"--seed \d+", "--seed {seed}", m["command"]) for m in markers})
    row.update(code=sorted({m["code"] for m in markers}), load=[m["load"] for m in markers])
    row["finished"] = max(m["finished"] for m in markers)
    path = report.row_path(results_dir, row)
    old = report.read_json(path) if os.path.isfile(path) else {}
    wanted = wanted or s.seeds
    keep = [str(x) for x in old.get("seeds", []) if x in wanted and str(x) not in fresh and str(x) in old["series"]]
    if keep and [old.get("flags"), old.get("tag")] == [row["flags"], tag]:
        row["seeds"] = sorted(row["seeds"] + list(map(int, keep)))
        old["seed_machine"], old["seed_code"] = report.seed_machines(old), report.seed_codes(old)
        per_seed_keys = ("series", "train_series", "entropy_series", "seconds_per_update", "seed_replayed", "seed_sps")
        by_seed = lambda new, was: dict(  # noqa: E731 (the kept seeds' entries, then the fresh ones, in seed order)
            sorted({**{k: was[k] for k in keep if k in (was or {})}, **(new or {})}.items(), key=lambda kv: int(kv[0]))
        )
        for key in (*per_seed_keys, "seed_wall_seconds", "seed_machine", "seed_code"):
            row[key] = by_seed(row.get(key), old.get(key))
        for key in ("perturbed_series", "diagnostics_series"):  # {name: {seed: series}}
            was = old.get(key) or {}
            row[key] = {p: by_seed(row[key].get(p), was.get(p)) for p in sorted({*was, *row[key]})}
            row[key] = {p: v for p, v in row[key].items() if v}
        for key in ("machine", "versions", "nice", "harness_command"):
            row[key] = " / ".join(dict.fromkeys(f"{old.get(key, '')} / {row[key]}".strip(" /").split(" / ")))
        for key in ("run_commands", "code", "load"):
            row[key] = list(dict.fromkeys((old.get(key) or []) + row[key]))
        row["finished"] = max(old.get("finished", ""), row["finished"])
    row["harness_command"] = portable(row["harness_command"])  # no folder of this machine's in the store
    for key in ("sps", "wall_seconds"):
        row[key] = statistics.fmean(row[f"seed_{key}"].values()) if row[f"seed_{key}"] else None
    report.dump({k: v for k, v in row.items() if v != {}}, path)
    return report.derive(row)


# ----------------------------------------------------------------------------------------------- throughput and speed


def timed_run(cmd: list[str], steps: int, threads: int = 1) -> tuple[dict, object]:
    """Run `cmd` in a fresh folder: steps/s from its last `N steps/s` line, else its last charts/SPS, else steps over
    the wall time; the rollout and update seconds it logged, summed; and every scalar it logged."""
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.time()
        proc = subprocess.run(
            cmd, cwd=cwd, env=thread_env(threads), capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
        wall = time.time() - t0
        if proc.returncode:
            raise RuntimeError(f"{display(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        df = read_run(cwd)
    found, sps = re.findall(r"([0-9.]+) steps/s", proc.stdout), df.value[df.tag == "charts/SPS"]
    total = {k: float(df.value[df.tag == f"time/{k}_seconds"].sum()) for k in ("rollout", "update")}
    return {"sps": float(found[-1]) if found else float(sps.iloc[-1]) if len(sps) else steps / wall, **total}, df


def throughput(p: dict, steps: int, repeats: int, harness_command: str, peer_dir: Optional[str] = None) -> dict:
    """The script and its peer ([[throughput]] in registry.toml) alternating, so that a competing process slows both
    alike; medians over `repeats` runs of each. A peer from another repository (`peer_repo`) runs unmodified from a
    checkout of it (`peer_dir`)."""
    info, load0, ours, peer = SCRIPTS[p["script"]], round(os.getloadavg()[0], 2), [], []
    ours_cmd = script_command(info.file, info, p["env"], steps, shlex.split(p["flags"]))
    peer_file, peer_code = p["peer"], None
    if p.get("peer_repo"):
        if not peer_dir or not os.path.isfile(os.path.join(peer_dir, p["peer"])):
            sys.exit(f"error: the peer {p['peer']} is {p['peer_repo']}'s: give a checkout of it with --peer-dir.")
        peer_file = os.path.abspath(os.path.join(peer_dir, p["peer"]))
        commit = subprocess.run(["git", "-C", peer_dir, "rev-parse", "HEAD"], capture_output=True, text=True)
        peer_code = f"{p['peer_repo']} {p['peer']} at {commit.stdout.strip()[:12] or 'an unknown commit'}, unmodified"
    peer_cmd = script_command(peer_file, info, p["env"], steps, shlex.split(p["peer_flags"]))
    for _ in range(repeats):
        peer.append(timed_run(peer_cmd, steps)[0])
        ours.append(timed_run(ours_cmd, steps)[0])
        print(f"{p['script']}: {ours[-1]['sps']:.0f} steps/s; peer {p['label']}: {peer[-1]['sps']:.0f}", flush=True)
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    sps, peer_sps = med(ours, "sps"), med(peer, "sps")
    out = {"script": p["script"], "env": p["env"], "flags": shlex.split(p["flags"]), "steps": steps, "sps": sps}
    out.update(peer_label=p["label"], peer_sps=peer_sps, ratio=sps / peer_sps, repeats=repeats)
    out.update({"peer_code": peer_code} if peer_code else {})
    out.update(peer_threads="1 (OMP_NUM_THREADS=1)", rollout_s=med(ours, "rollout"), update_s=med(ours, "update"))
    out.update(machine=machine(), versions=versions(), harness_command=harness_command)
    return dict(out, load=[load0, round(os.getloadavg()[0], 2)])


def committed_script(path: str, commit: str, folder: str) -> str:
    """The script at `path` as committed at `commit`, written into `folder` (the "before" of a speed comparison)."""
    proc = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:{path}"], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: cannot read {path} at commit {commit}: {proc.stderr.strip()[:200]}")
    os.makedirs(os.path.join(folder, commit), exist_ok=True)
    with open(os.path.join(folder, commit, path), "w") as f:
        f.write(proc.stdout)
    return os.path.join(folder, commit, path)


def speed(name: str, harness_command: str) -> dict:
    """Seconds per update (the sum of the script's phases) or per run (`whole_run`) of each configuration of
    [speed.NAME], one after another in turn, and each phase (every `time/*_seconds` the script logs); a configuration
    `@COMMIT flags` runs the script as committed at COMMIT, so that a change is timed against what it changed,
    alternating on one machine."""
    e = SPEED[name]
    info, per, phases = SCRIPTS[e["script"]], {c: [] for c in e["configs"]}, {c: {} for c in e["configs"]}
    unit = "run" if e.get("whole_run") else "update"  # (whole_run: a run's phases summed, one number per run)
    with tempfile.TemporaryDirectory() as committed:
        commands = {}  # every configuration's command, before any run (a commit that cannot be read stops it here)
        for config in e["configs"]:
            words, path = shlex.split(config), info.file
            if words and words[0].startswith("@"):
                path = committed_script(info.file, words.pop(0)[1:], committed)
            commands[config] = script_command(path, info, e["env"], e["steps_per_update"] * e["updates"], words)
        for _ in range(e.get("repeats", 1)):
            for config, cmd in commands.items():
                df = timed_run(cmd, e["steps_per_update"] * e["updates"], e.get("threads", 1))[1]
                parts = [df.value[df.tag == f"time/{k}_seconds"].to_numpy() for k in info.phases]
                times = [round(float(sum(t)), 4) for t in zip(*parts)]
                per[config] += [round(sum(times), 4)] if e.get("whole_run") else times
                for tag in sorted(t for t in set(df.tag) if re.fullmatch(r"time/\w+_seconds", t)):
                    values = df.value[df.tag == tag].to_numpy()
                    phases[config].setdefault(tag[5:-8], []).extend(round(float(v), 4) for v in values)
                print(f"{config}: {per[config][-1 if e.get('whole_run') else -len(times) :]} s per {unit}", flush=True)
    out = {"name": name, "harness_command": harness_command, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    data = {"env_id": e["env"], "steps_per_epoch": e["steps_per_update"], "per_epoch": per, "phases": phases}
    data.update(threads=e.get("threads", 1))
    data.update({"unit": "run", "steps_per_epoch": e["steps_per_update"] * e["updates"]} if e.get("whole_run") else {})
    return dict(out, machine=machine(), versions=versions(), data=data, load=round(os.getloadavg()[0], 2))


def breakdown(name: str, harness_command: str) -> dict:
    """Where a run's time goes ([speed.NAME] with `parts` in registry.toml): the script at its settings under
    pyinstrument's sampling profiler (main thread); each part's seconds per update inside `main` (the inclusive time of
    the functions it names), the rest of `main`, and the start-up before it."""
    e = SPEED[name]
    info = SCRIPTS[e["script"]]
    cmd = script_command(info.file, info, e["env"], e["steps_per_update"] * e["updates"], shlex.split(e["flags"]))
    with tempfile.TemporaryDirectory() as cwd:
        prof = os.path.join(cwd, "profile.json")
        profiler = [sys.executable, "-m", "pyinstrument", "--interval", "0.001", "--show-all", "-r", "json", "-o", prof]
        profiler += ["-p", "processor_options.filter_threshold=0"]  # keep the small parts too
        proc = subprocess.run(profiler + cmd[1:], cwd=cwd, env=thread_env(), capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{display(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        with open(prof) as f:
            tree = json.load(f)["root_frame"]
    seconds: dict[tuple[str, str], float] = {}
    script, main_s = os.path.basename(info.file), 0.0

    def walk(frame, inside_main: bool, above: frozenset) -> None:  # inclusive time, each function once per stack
        nonlocal main_s
        key = (frame["function"], frame["file_path_short"])
        is_main = frame["function"] == "main" and frame["file_path"].endswith(script)
        main_s += frame["time"] * (is_main and not inside_main)
        if inside_main and key not in above:
            seconds[key] = seconds.get(key, 0.0) + frame["time"]
        for child in frame["children"]:
            walk(child, inside_main or is_main, above | {key})

    walk(tree, False, frozenset())
    parts = {
        label: sum(t for (fn, file), t in seconds.items() if [fn, file] in map(list, functions))
        for label, functions in e["parts"]
    }
    parts["the rest of the loop"] = main_s - sum(parts.values())
    data = {"steps_per_update": e["steps_per_update"], "updates": e["updates"], "command": display(cmd)}
    data.update(
        parts={k: round(v / e["updates"], 5) for k, v in parts.items()}, startup_seconds=round(tree["time"] - main_s, 3)
    )
    out = {"name": name, "harness_command": harness_command, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    return dict(out, machine=machine(), versions=versions(), data=data)


# ----------------------------------------------------------------------------------------------- CLI


@dataclass
class Args:
    mode: Literal["train", "collect", "report", "throughput", "speed", "list", "slurm-task"] = "train"
    """train: run what is missing, store it, report; collect: store the complete runs under --runs-dir, report;
    report: results.md, the plots and the pages' tables from the store (seconds); throughput: timed runs alternating
    with the peer; speed: the speed entries named by --speed; list: the settings; slurm-task: one task of a --slurm
    array (Slurm starts it)"""
    scripts: tuple[str, ...] = ()
    """scripts to include (e.g. ppo_cartpole); empty: all"""
    envs: tuple[str, ...] = ()
    """env ids to include; empty: all"""
    settings: tuple[str, ...] = ()
    """setting names to include; empty: all"""
    seeds: tuple[int, ...] = ()
    """override the registry's seeds (a subset adds to the stored row; list new seeds in registry.toml to keep them)"""
    steps: Optional[int] = None
    """override the registry's step budget"""
    workers: int = os.cpu_count() or 1
    """runs at a time (each with one thread)"""
    nice: int = 0
    """niceness added to every run, 0-19 (a shared machine: e.g. 10)"""
    quick: bool = False
    """every light setting at a tiny budget, under benchmark/out/quick (checks the harness)"""
    runs_dir: Optional[str] = None
    """run folders (default benchmark/out/runs, git-ignored)"""
    results_dir: Optional[str] = None
    """the store (default benchmark/results, the only one that writes the pages)"""
    results_md: Optional[str] = None
    """the report (default benchmark/results.md)"""
    plots_dir: Optional[str] = None
    """the plots (default benchmark/plots)"""
    repeats: int = 3
    """throughput: timed runs of each program"""
    throughput_steps: Optional[int] = None
    """throughput: steps per timed run (default: the entry's)"""
    force: bool = False
    """run again even when a run is complete"""
    timeout: Optional[float] = None
    """seconds after which a run is killed and counted as failed"""
    speed: tuple[str, ...] = ()
    """speed: the entries to measure ([speed.NAME] in registry.toml)"""
    slurm: bool = False
    """train: submit the runs to Slurm as one job array (a task per run, one CPU each) instead of running them here"""
    slurm_partition: Optional[str] = None
    """--slurm: the partition (default: the cluster's)"""
    slurm_time: str = "24:00:00"
    """--slurm: each task's time limit; a task stopped by it is requeued and resumes"""
    slurm_gpus_per_task: int = 0
    """--slurm: GPUs per task"""
    jobs_file: Optional[str] = None
    """slurm-task: the array's job list (written by --slurm)"""
    peer_dir: Optional[str] = None
    """throughput: a checkout of a peer's repository (CleanRL's, for the PPO peer, run unmodified)"""


def check_args(args: Args, registry: list[S]) -> None:
    """One sentence and exit 2 for a flag the harness cannot use, before anything runs or is written."""
    checks = [("script", args.scripts, {s.script for s in registry}), ("env", args.envs, {s.env for s in registry})]
    checks += [("setting", args.settings, {s.name for s in registry}), ("speed entry", args.speed, set(SPEED))]
    problems = [
        f"unknown {what} '{bad[0]}'; the registry has: {', '.join(sorted(names))}"
        for what, given, names in checks
        if (bad := [x for x in given if x not in names])
    ]
    path_flags = ("runs_dir", "results_dir", "results_md", "plots_dir", "jobs_file", "peer_dir")
    paths = {k: getattr(args, k) for k in path_flags}
    problems += [
        f"--{k.replace('_', '-')} must be a path on one line of text, got {p!r}"
        for k, p in paths.items()
        if p is not None and not (p and p.isprintable())
    ]
    problems += ["--workers and --repeats must be at least 1"] * (args.workers < 1 or args.repeats < 1)
    problems += [f"--seeds must be distinct seeds in 0..{2**32 - 1}, got {' '.join(map(str, args.seeds))}"] * (
        len(set(args.seeds)) < len(args.seeds) or any(not 0 <= x < 2**32 for x in args.seeds)
    )
    problems += [
        f"--{k.replace('_', '-')} must be at least 1"
        for k in ("steps", "throughput_steps")
        if getattr(args, k) is not None and getattr(args, k) < 1
    ]
    problems += ["--timeout must be a positive number of seconds"] * (
        args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0)
    )
    problems += ["--nice must be in 0..19"] * (not 0 <= args.nice <= 19)
    problems += ["--slurm-gpus-per-task must be at least 0"] * (args.slurm_gpus_per_task < 0)
    problems += ["--slurm goes with --mode train"] * (args.slurm and args.mode != "train")
    problems += ["--slurm needs Slurm's sbatch on the PATH"] * (args.slurm and not shutil.which("sbatch"))
    if args.mode == "slurm-task":
        problems += ["--mode slurm-task needs --jobs-file, the file --slurm wrote"] * (
            not args.jobs_file or not os.path.isfile(args.jobs_file)
        )
        problems += ["--mode slurm-task runs inside a Slurm array task (SLURM_ARRAY_TASK_ID)"] * (
            "SLURM_ARRAY_TASK_ID" not in os.environ
        )
    problems += ["--mode speed needs --speed NAME (registry.toml's [speed.NAME])"] * (
        args.mode == "speed" and not args.speed
    )
    if args.mode == "throughput":
        entries = [p for p in THROUGHPUT if not args.scripts or p["script"] in args.scripts]
        problems += [f"no throughput entry for {' '.join(args.scripts)}"] * (not entries)
        problems += ["--peer-dir applies to a peer from another repository, and no selected entry has one"] * bool(
            args.peer_dir and not any(p.get("peer_repo") for p in entries)
        )
    problems += [f"--runs-dir {args.runs_dir} is not a folder"] * bool(
        args.mode == "collect" and args.runs_dir and not os.path.isdir(args.runs_dir)
    )
    problems += [problem for flag, path, folder in written_paths(args) if (problem := unwritable(flag, path, folder))]
    store = default_paths(args)["results_dir"]  # --mode report only reads the store
    if args.mode not in ("list", "slurm-task") and os.path.isdir(store) and not problems:
        try:  # every file of the store readable as one, before anything runs or is written
            report.load(store)
        except report.StoreError as e:
            problems.append(str(e))
    problems += [f"--results-dir {store} is not a folder"] * (args.mode == "report" and not os.path.isdir(store))
    if problems:
        print(f"error: {problems[0]}.", file=sys.stderr)
        sys.exit(2)


def default_paths(args: Args) -> dict:
    """--runs-dir, --results-dir, --results-md and --plots-dir as given, or their defaults (absolute paths)."""
    base = os.path.join(HERE, "out", "quick") if args.quick else HERE
    defaults = {
        "runs_dir": os.path.join(HERE, "out", "quick" * args.quick, "runs"),
        "results_dir": os.path.join(base, "results"),
        "results_md": os.path.join(base, "results.md"),
        "plots_dir": os.path.join(base, "plots"),
    }
    return {k: os.path.abspath(getattr(args, k) or v) for k, v in defaults.items()}


def written_paths(args: Args) -> list[tuple[str, str, bool]]:
    """(flag, path, is a folder) of what this mode writes: the run folders (and --slurm's jobs file among them), the
    store, the report and the plots."""
    if args.mode in ("list", "slurm-task"):  # nothing; the paths of a task are those its --slurm call checked
        return []
    paths = default_paths(args)
    keys = (
        ["runs_dir"] * (args.mode == "train") + ["results_dir"] * (args.mode != "report") + ["results_md", "plots_dir"]
    )
    return [(f"--{k.replace('_', '-')}", paths[k], k != "results_md") for k in keys]


def unwritable(flag: str, path: str, folder: bool) -> Optional[str]:
    """Why `path` (a folder, or a file when not `folder`) cannot be made or written; None when it can. Nothing is
    created to find out."""
    if folder and os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path} is not a folder"
    if not folder and os.path.isdir(path):
        return f"{flag} {path} is a folder, not a file"
    if not folder and os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{flag} {path} cannot be written"
    existing = path if folder else os.path.dirname(path)
    while not os.path.exists(existing):  # the nearest folder that exists, which the missing ones are made in
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{flag} {path} cannot be created: {existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {path} cannot be written: {existing} is not writable"
    return None


def write_report(args: Args, registry: list[S]) -> None:
    """results.md, the plots and, from the default store, the pages' tables."""
    data = report.load(args.results_dir)
    text = report.render(data, [(s.script, s.env, s.name) for s in registry])  # made before the old one is replaced
    os.makedirs(os.path.dirname(args.results_md), exist_ok=True)
    with open(args.results_md, "w") as f:
        f.write(text)
    written = [args.results_md] + report.plot(data["rows"], args.plots_dir)
    if args.results_dir == os.path.join(HERE, "results"):
        written += report.write_pages(data)
    print("wrote " + ", ".join(os.path.relpath(p, ROOT) for p in written), flush=True)


def select(args: Args, registry: list[S]) -> list[S]:
    """The settings the flags ask for, with --quick, --steps and --seeds applied (one per script, env, name, steps)."""
    out = {}
    for s in registry:
        if args.scripts and s.script not in args.scripts or args.envs and s.env not in args.envs:
            continue
        if args.settings and s.name not in args.settings or args.quick and not s.quick:
            continue
        if args.quick:
            info = SCRIPTS[s.script]
            s = replace(s, steps=info.quick_steps, seeds=s.seeds[:2], flags=s.flags + tuple(info.quick_flags.split()))
        s = replace(s, steps=s.steps if args.steps is None else args.steps, seeds=tuple(args.seeds) or s.seeds)
        out.setdefault((s.script, s.env, s.name, s.steps), s)
    return list(out.values())


def selection_flags(args: Args) -> list[str]:
    """The flags that select the same runs and the same store again (for the job that collects after an array)."""
    flags = [f"--{k}" for k in ("quick", "force") if getattr(args, k)]
    for key in ("scripts", "envs", "settings", "seeds"):
        flags += [f"--{key}", *map(str, getattr(args, key))] if getattr(args, key) else []
    flags += ["--steps", str(args.steps)] if args.steps else []
    for key in ("runs_dir", "results_dir", "results_md", "plots_dir"):
        flags += [f"--{key.replace('_', '-')}", getattr(args, key)]
    return flags


def train(args: Args, selected: list[S], harness_command: str) -> list[str]:
    """Run every (setting, seed) that is not complete, `--workers` at a time; returns the failed ones."""
    jobs, done = [], []
    # seed by seed across the settings: a sweep stopped part-way leaves its settings with the same seeds
    seeds = list(dict.fromkeys(seed for s in selected for seed in s.seeds))
    for s, seed in ((s, seed) for seed in seeds for s in selected if seed in s.seeds):
        complete = is_complete(run_folder(args.runs_dir, s, seed), job_command(s, seed)) and not args.force
        (done if complete else jobs).append((s, seed))
    for s, seed in done:
        print(f"skip (complete): {s.script} {s.env} {s.name} {s.steps} steps seed {seed}", flush=True)
    print(f"running {len(jobs)} runs, {min(args.workers, len(jobs))} at a time, under {args.runs_dir}", flush=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop_runs)
    with ThreadPoolExecutor(args.workers) as pool:
        rcs = list(pool.map(lambda j: run_job(*j, args.runs_dir, harness_command, args.nice, args.timeout), jobs))
    if STOPPING:
        print("stopped: the same command continues the stopped runs where they saved their state", file=sys.stderr)
    return [f"{run_folder(args.runs_dir, s, seed)}/run.log" for (s, seed), rc in zip(jobs, rcs) if rc]


def main(argv: Optional[list[str]] = None, registry: Optional[list[S]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0])
    registry = SETTINGS if registry is None else registry
    args.scripts = tuple(x.removesuffix(".py") for x in args.scripts)
    check_args(args, registry)
    for key, path in default_paths(args).items():
        setattr(args, key, path)
    harness_command = "python benchmark/run.py " + shlex.join(map(shown, argv))
    if args.peer_dir:  # a folder of this machine's: stored as what it is
        harness_command = harness_command.replace(shlex.quote(args.peer_dir), "<checkout of the peer's repository>")
    harness_command = portable(harness_command)  # and any other folder outside the repository by its name
    selected, failed = select(args, registry), []
    if args.mode == "list":
        for s in selected:
            print(f"{s.script:22s} {s.env:17s} {s.name:44s} {s.steps:>9,} seeds {s.seeds} flags {shlex.join(s.flags)}")
        return 0
    if args.mode == "throughput":
        for p in (p for p in THROUGHPUT if not args.scripts or p["script"] in args.scripts):
            info = SCRIPTS[p["script"]]
            steps = args.throughput_steps or (info.quick_steps if args.quick else p["steps"])
            t = throughput(p, steps, args.repeats, harness_command, args.peer_dir)
            cpu = t["machine"].split("(")[0].split(",")[0].strip()
            name = re.sub(
                r"[^\w.-]+", "_", f"{p['script']}__{p['env']}__{p['flags'] or 'defaults'}__{steps}__peer1thread__{cpu}"
            )
            path = report.dump(t, os.path.join(args.results_dir, "throughput", name + ".json"))
            print(f"ratio {t['ratio']:.2f}x -> {path}", flush=True)
    elif args.mode == "speed":
        for name in args.speed:
            entry = breakdown(name, harness_command) if "parts" in SPEED[name] else speed(name, harness_command)
            report.dump(entry, os.path.join(args.results_dir, "speed", f"{name}.json"))
    elif args.mode == "slurm-task":
        return slurm_task(args.jobs_file)
    elif args.mode == "train" and args.slurm:
        return submit_slurm(args, selected, harness_command)
    elif args.mode in ("train", "collect"):
        failed = train(args, selected, harness_command) if args.mode == "train" else []
        for s in selected:
            wanted = next(r.seeds for r in registry if (r.script, r.env, r.name) == (s.script, s.env, s.name))
            if row := collect(s, args.runs_dir, args.results_dir, wanted):
                print(f"{s.script} {s.env} {s.name} {s.steps:,} steps, seeds {row['seeds']}: {report.pm(row)}")
    try:
        write_report(args, registry)
    except KeyError as e:  # a page shows a row the store does not hold
        print(f"error: {e.args[0]}.", file=sys.stderr)
        return 1
    if STOPPING:
        return 128 + STOPPING[0]
    if failed:
        print("error: failed runs, see " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:  # a timed run that failed (throughput, speed)
        print(f"error: {e}.", file=sys.stderr)
        sys.exit(1)
