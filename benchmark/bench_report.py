"""Report of the benchmark harness: results.md and the plots, from the results store alone (no training,
no event files): `python benchmark/run.py --mode report`."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import warnings
from typing import Optional

import bench_reader as reader
import bench_speed as speed


def cpu_features(flags: set) -> str:
    """The CPU's bfloat16 matmul support, which decides whether `--dtype bfloat16` / `--bf16` is faster or slower
    than float32 on it (an AMX Xeon ran bfloat16 ~3x faster, an AVX-512 VNNI one ~3x slower): a model name like
    "Intel(R) Xeon(R) Processor" alone does not tell the two apart."""
    if not flags:
        return ""
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16, no AMX"
    return ("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2") + ", no AMX"


def resumed_mark(row: dict) -> str:
    return " (resumed)" if any((row.get("seed_replayed") or {}).values()) else ""


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    flags: set = set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    except (OSError, StopIteration):
        pass
    if cpu_features(flags):
        cpu += f" ({cpu_features(flags)})"
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


def fmt(x: Optional[float], digits: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def duration(seconds: Optional[float]) -> str:
    if seconds is None or seconds != seconds:
        return "n/a"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def ref_text(r: dict) -> str:
    num = f"{r['value']:g}" if r.get("std") is None else f"{r['value']:g} ± {r['std']:g}"
    return f"{num} ({r['source']})"


def row_digits(r: dict) -> int:
    return r.get("digits", 3 if r["tag"] == "charts/regret" else 2)


def metric_text(r: dict) -> str:
    if r.get("last_fraction"):
        return f"mean of the episodes in the last {r['last_fraction']:g} of the steps"
    return f"mean of the last {r['last_n']} episodes"


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p > 0.5) of Student's t with `df` degrees of freedom (any real df > 0): its density
    integrated numerically (trapezoid, 200001 points on [0, 60]), then the quantile found by bisection."""
    import math

    import numpy as np

    x = np.linspace(0.0, 60.0, 200_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    dens = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2 * np.diff(x))])
    return float(np.interp(p, cdf, x))


def welch(a: list[float], b: list[float], level: float = 0.95) -> dict:
    """mean(a) - mean(b) with Welch's t confidence interval (sample variances, ddof=1; Welch-Satterthwaite
    degrees of freedom), and the seeds per side that a two-sided test at 5% with 80% power would need for a
    difference of this size at the pooled spread (normal approximation, 2 (1.96 + 0.84)^2 s^2 / d^2)."""
    import statistics

    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff, se = statistics.fmean(a) - statistics.fmean(b), (va + vb) ** 0.5
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se > 0 else float("inf")
    half = (t_quantile(0.5 + level / 2, df) if df < 1e6 else 1.959964) * se
    pooled = (statistics.variance(a) + statistics.variance(b)) / 2
    needed = 2 * (1.959964 + 0.841621) ** 2 * pooled / diff ** 2 if diff else float("inf")
    return {"diff": diff, "low": diff - half, "high": diff + half, "df": df, "seeds_needed": needed}


def contrast_lines(rows: list[dict], contrasts: list[tuple]) -> list[str]:
    """## Differences: for each (label, script, env, steps, setting a, setting b) whose two rows are stored with at
    least 2 seeds each, a minus b on the rows' metric with Welch's 95% interval, and the machines of both."""
    by_key = {(r["script"], r["env"], r["steps"], r["setting"]): r for r in rows}
    lines = []
    for label, script, env, steps, a, b in contrasts:
        ra, rb = by_key.get((script, env, steps, a)), by_key.get((script, env, steps, b))
        if not ra or not rb or min(len(ra["per_seed"]), len(rb["per_seed"])) < 2:
            continue
        w = welch(list(ra["per_seed"].values()), list(rb["per_seed"].values()))
        same = ra["machine"] == rb["machine"] and " / " not in ra["machine"]
        lines.append(f"| {label} | `{a}` minus `{b}` | {env}, {steps:,} | {len(ra['per_seed'])} vs {len(rb['per_seed'])}"
                     f" | {fmt(w['diff'])} | [{fmt(w['low'])}, {fmt(w['high'])}] | {fmt(w['df'], 1)} | "
                     f"{fmt(w['seeds_needed'], 0)} | {ra['machine'] if same else 'differ: ' + ra['machine'] + ' vs ' + rb['machine']} |")
    if not lines:
        return []
    return ["", "## Differences between settings (Welch's t, 95% interval)", "",
            "On each row's metric (per-seed numbers of the table above). Seeds needed: per side, for a two-sided "
            "test at 5% with 80% power to detect a difference of the observed size at the pooled per-seed spread "
            "(normal approximation).", "",
            "| question | difference | env, steps | seeds | difference | 95% interval | df | seeds needed | machine |",
            "|---|---|---|---|---|---|---|---|---|"] + lines


def render(data: dict, order: list[tuple], contrasts: Optional[list[tuple]] = None) -> str:
    """results.md: learning rows (in registry order), differences between settings, then throughput, speed and GPU
    tables."""
    def pos(r):
        k = (r["script"], r["env"], r["setting"])
        return (order.index(k) if k in order else len(order), r["script"], r["env"], r["setting"], r["steps"])

    rows = sorted(data["rows"], key=pos)
    speed_entries = data["speed"] + speed.gpu_entries()
    machines = sorted({r["machine"] + "; " + r["versions"] for r in rows} |
                      {t["machine"] + "; " + t["versions"] for t in data["throughput"]} |
                      {t["machine"] + "; " + t["versions"] for t in speed_entries})
    mid = {m: f"M{i + 1}" for i, m in enumerate(machines)}
    lines = [
        "# Benchmark results",
        "",
        "Written by `python benchmark/run.py --mode report` from the files under `benchmark/results/` (do not "
        "edit by hand). Ours: per seed the mean of the last N episodes (or, for ICPI, of the episodes that "
        "ended in the last quarter of the real steps), then mean ± population std (ddof=0) across seeds, the "
        "openrlbenchmark convention. SPS: the run's final `charts/SPS`, mean over seeds; wall: one run's wall "
        "time, mean over seeds, marked (resumed) where a run replayed answers that an earlier, stopped attempt had "
        "left in the completion cache (ICPI), so that its wall time covers only what it computed. Most runs shared a 2-core machine with other jobs: SPS and wall times are "
        "contended and only comparable within one side-by-side measurement (Throughput, Speed).",
        "",
        "Source `harness`: trained by `benchmark/run.py` and read back from its runs' event files. "
        "Source `imported`: measured before the harness held it, by the command in the row's notes; the "
        "episode series came from that command's output file (re-derived here), or, where the event files "
        "were lost, only per-seed numbers were kept.",
        "",
        "| # | script | env | setting | steps | seeds | ours (mean ± std) | reference (source) | SPS | wall / run "
        "| machine | source |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        refs = "; ".join(ref_text(x) for x in r["refs"]) or "-"
        d = row_digits(r)
        metric = "" if r["tag"] == "charts/episodic_return" else f" ({r['tag']})"
        lines.append(f"| {i + 1} | `{r['script']}.py` | {r['env']} | {r['setting']} | {r['steps']:,} | "
                     f"{' '.join(map(str, r['seeds']))} | {fmt(r['mean'], d)} ± {fmt(r['std'], d)}{metric} | {refs} | "
                     f"{fmt(r['sps'], 0)} | {duration(r['wall_seconds'])}{resumed_mark(r)} | "
                     f"{mid[r['machine'] + '; ' + r['versions']]} | {r.get('source', 'harness')} |")
    lines += ["", "Per row: the flags, the metric, the per-seed numbers, and the command that made it.", ""]
    for i, r in enumerate(rows):
        d = row_digits(r)
        per_seed = ", ".join(f"seed {s}: {fmt(v, d)}" + (f" ({r['episodes'][s]} episodes)" if r.get("episodes") else "")
                             for s, v in r["per_seed"].items())
        text = (f"{i + 1}. `{r['script']}.py {' '.join(r.get('flags', [])) or '(defaults)'}`, {metric_text(r)}"
                f" of `{r['tag']}`. {per_seed}.")
        if r.get("first_mean") is not None:
            text += (f" First quarter of the steps: {fmt(r['first_mean'], d)} ± {fmt(r['first_std'], d)}.")
        for name, extra in r.get("extra", {}).items():
            text += (f" {name}: " + ", ".join(f"seed {s}: {fmt(v, d)}" for s, v in extra["per_seed"].items())
                     + f"; {fmt(extra['mean'], d)} ± {fmt(extra['std'], d)}.")
        if r.get("seed_replayed"):  # some seed's run counted its replayed answers (possibly zero)
            sentences = []
            if resumed_mark(r):
                sentences.append("Resumed: " + ", ".join(f"seed {s} replayed {n} cached answers" for s, n in
                                                         r["seed_replayed"].items() if n)
                                 + " recorded by an earlier, stopped attempt (a resumed run's wall time covers only"
                                 " the rest)")
            # said even when no counted seed replayed: an uncounted seed may have been resumed
            uncounted = [str(s) for s in r["seeds"] if str(s) not in r["seed_replayed"]]
            if uncounted:
                many = len(uncounted) > 1
                sentences.append(f"seed{'s' * many} {', '.join(uncounted)} logged no count (`model/replayed`), so "
                                 f"whether {'they' if many else 'it'} replayed is not known here")
            if sentences:
                joined = "; ".join(sentences)
                text += " " + joined[0].upper() + joined[1:] + "."
        if r.get("source") == "imported":
            imp = r["imported"]
            text += f" Imported: made by `{imp['command']}`"
            if imp.get("from"):
                text += f"; data from {imp['from']}"
            if imp.get("note"):
                text += f"; {imp['note']}"
            text += "."
        else:
            load = (f", 1-minute load average at the runs' ends {min(r['load'])}-{max(r['load'])}"
                    if r.get("load") else "")
            text += (f" Made by `{r['harness_command']}` (finished {r['finished']}, niceness {r['nice']}{load}); "
                     f"each seed ran `{'`, `'.join(r['run_commands'])}` ({'; '.join(r.get('code', []))}).")
        text += f" File: `{r['_file']}`." if r.get("_file") else ""
        lines.append(text)
    lines += contrast_lines(rows, contrasts or [])
    if data["throughput"]:
        lines += ["", "## Throughput (short runs, alternating with the peer on the same machine)", "",
                  "Ours always runs with one torch thread; the peer's threads are in the table. Rollout / update: "
                  "seconds of one run spent collecting and updating (median run), from `time/rollout_seconds` and "
                  "`time/update_seconds`.", "",
                  "| script | flags | steps | SPS (median) | rollout / update seconds | peer | peer threads "
                  "| peer SPS (median) | ratio | repeats | machine |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in data["throughput"]:
            split = "-" if t.get("rollout_s") is None else f"{t['rollout_s']:.1f} / {t['update_s']:.1f}"
            ratio = t.get("ratio")
            lines.append(f"| `{t['script']}.py` | `{' '.join(t['flags']) or '(defaults)'}` | {t['steps']:,} | "
                         f"{fmt(t['sps'], 0)} | {split} | {t['peer_label'] or '-'} | {t.get('peer_threads') or '-'} | "
                         f"{fmt(t.get('peer_sps'), 0)} | {fmt(ratio)} | {t['repeats']} | "
                         f"{mid[t['machine'] + '; ' + t['versions']]} |")
        lines += [""] + [f"- `{t['harness_command']}`" + (f": 1-minute load average {t['load'][0]} before, "
                                                           f"{t['load'][1]} after" if t.get("load") else "")
                         + (f" (`{t['_file']}`)" if t.get("_file") else "") for t in data["throughput"]]
    lines += speed.render(speed_entries, mid)
    lines += ["", "## Machines", ""] + [f"- {v}: {k}" for k, v in mid.items()]
    return "\n".join(lines) + "\n"


def plot_jobs(rows: list[dict], script_order: list[str], groups: Optional[dict] = None) -> list[tuple[str, list]]:
    """The figures `plot` draws: [(file name without .png, its rows), ...]. Deterministic evaluations (eval/...) are
    one batch of episodes at the end of training, not a learning curve: the table reports them, and the plots draw
    the training return of the same runs (train_series) where the row has it, and leave the row out otherwise.
    `groups` splits a script's rows over several figures: {script: [(suffix, keep(row) -> bool), ...]}, named
    `{script}_{suffix}` (suffix "" for the plain name), so that one panel carries a few curves, not dozens."""
    rows = [dict(r, series=r["train_series"], last_n=r.get("train_last_n", 30), tag="charts/episodic_return",
                 setting=f"{r['setting']} (training return)", y_label="episodic return (training)")
            if r["tag"].startswith("eval/") and r.get("train_series") else r for r in rows]
    rows = [r for r in rows if not r["tag"].startswith("eval/")]
    scripts = sorted({r["script"] for r in rows if r.get("series")},
                     key=lambda s: (script_order.index(s) if s in script_order else 99, s))
    jobs = []
    for script in scripts:
        mine = [r for r in rows if r["script"] == script and r.get("series")]
        for suffix, keep in (groups or {}).get(script, [("", lambda row: True)]):
            part = [r for r in mine if keep(r)]
            if part:
                jobs.append((f"{script}_{suffix}" if suffix else script, part))
    return jobs


def plot(rows: list[dict], plots_dir: str, script_order: list[str], points: int = 200,
         groups: Optional[dict] = None) -> list[str]:
    """One PNG per figure of `plot_jobs` (`{plots_dir}/{name}.png`), one panel per (env, step budget) with episode
    series: every setting of the figure on the same axes, the table's metric as a running mean (mean over seeds,
    ±std band), and the published references as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    jobs = plot_jobs(rows, script_order, groups)
    for name, mine in jobs:
        panels = sorted(dict.fromkeys((r["env"], r["steps"]) for r in mine))
        # one colour per setting across the figure's panels (the default cycle has 10)
        colour = {s: f"C{i % 10}" for i, s in enumerate(sorted({r["setting"] for r in mine}))}
        cols = min(3, len(panels))
        nrows = -(-len(panels) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (env, steps) in zip(axes.flat, panels):
            refs = {}
            for r in (r for r in mine if (r["env"], r["steps"]) == (env, steps)):
                curves = [reader.running_mean(list(zip(s["steps"], s["values"])), r["last_n"])
                          for s in r["series"].values()]
                curves = [c for c in curves if c[0]]
                if not curves:
                    continue
                grid = np.linspace(0, max(r["steps"], max(c[0][-1] for c in curves)), points)
                ys = np.array([np.interp(grid, c[0], c[1], left=np.nan, right=np.nan) for c in curves])
                with warnings.catch_warnings():  # grid points before any seed's first episode are nan
                    warnings.simplefilter("ignore", RuntimeWarning)
                    mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
                few = int(np.isfinite(mean).sum()) <= 2
                tag = ", " + r["machine_tag"] if r.get("machine_tag") else ""
                label = f"{r['setting']} ({len(curves)} seed{'s' * (len(curves) != 1)}{tag})"
                line, = ax.plot(grid, mean, label=label, marker="o" if few else None, lw=1.2,
                                color=colour[r["setting"]])
                ax.fill_between(grid, mean - std, mean + std, color=line.get_color(), alpha=0.15)
                for x in r["refs"]:
                    refs[(x["value"], x["source"])] = x
            for i, x in enumerate(refs.values()):
                ax.axhline(x["value"], color="k", linestyle=["--", ":", "-."][i % 3], linewidth=0.8,
                           label=ref_text(x))
            r0 = next(r for r in mine if (r["env"], r["steps"]) == (env, steps))
            ax.set_xlabel(r0.get("x_label", "environment steps"))
            ax.set_ylabel(f"{r0.get('y_label', r0['tag'])} (running mean of {r0['last_n']} episodes)", fontsize=8)
            ax.set_title(f"{env}, {steps:,} steps", fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, loc="best")
        fig.tight_layout()
        os.makedirs(plots_dir, exist_ok=True)
        path = os.path.join(plots_dir, f"{name}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written
