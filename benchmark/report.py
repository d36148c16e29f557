"""The report of the benchmark harness, made from the results store (benchmark/results/) alone: the numbers of every
row, the statistics of the comparisons, benchmark/results.md, the plots, and the results tables that README.md and
docs/*.md hold between `<!-- results: NAME -->` and `<!-- /results -->`. `python benchmark/run.py --mode report`."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import tomllib
import warnings

import numpy as np
import pandas as pd
from scipy import optimize, stats

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
with open(os.path.join(HERE, "registry.toml"), "rb") as _f:
    REGISTRY = tomllib.load(_f)
TRAIN_LAST_N = 30  # an evaluation row's training return: the mean of its last 30 training episodes per seed
DERIVED = ("per_seed", "episodes", "mean", "std", "extra", "first_mean", "first_std", "_file")
EXTRAS = {"first": "first quarter", "train": "training return", "update_s": "seconds per update"}


# ----------------------------------------------------------------------------------------------- the store


def row_path(results_dir: str, row: dict) -> str:
    return os.path.join(results_dir, row["script"], f"{row['env']}__{row['setting']}__{row['steps']}.json")


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no nan
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return [_clean(v) for v in x] if isinstance(x, (list, tuple)) else x


def dump(obj: dict, path: str) -> str:
    """One top-level key per line (a series stays on one line: small diffs); derived numbers are not stored."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = [f' "{k}": {json.dumps(_clean(v), separators=(", ", ": "))}' for k, v in obj.items() if k not in DERIVED]
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")
    return path


def mean_std(values) -> tuple[float, float]:
    """Mean and POPULATION std (ddof=0) over seeds, as openrlbenchmark; a seed without a value is left out."""
    x = np.array([v for v in values if v is not None and v == v], dtype=float)
    return (float(x.mean()), float(x.std())) if x.size else (math.nan, math.nan)


def _mean(x) -> float:
    return float(np.mean(x)) if len(x) else math.nan


def derive(row: dict) -> dict:
    """The row's numbers from its episode series: per seed the mean of the last `last_n` episodes (or of those that
    ended in the last `last_fraction` of the steps), then mean and population std over seeds; the same for the
    extras (the first quarter, an evaluation row's training return, seconds per update)."""
    row, frac, n = dict(row), row.get("last_fraction"), row.get("train_last_n", TRAIN_LAST_N)
    if not (type(row.get("last_n", 1)) is int and row.get("last_n", 1) >= 1 and 0 < float(frac or 1) <= 1):
        raise ValueError("last_n or last_fraction")
    per_seed, first = {}, {}
    for seed, s in row["series"].items():
        steps, values = np.asarray(s["steps"], dtype=float), np.asarray(s["values"], dtype=float)
        if steps.shape != values.shape or steps.ndim != 1 or not np.isfinite([*steps, *values]).all():
            raise ValueError(f"seed {seed}: its steps and values are not finite numbers of one length")
        if frac:
            per_seed[seed] = _mean(values[steps >= (1 - frac) * row["steps"]])
            first[seed] = _mean(values[steps < frac * row["steps"]])
        else:
            per_seed[seed] = _mean(values[-row["last_n"] :])
    row["per_seed"], row["episodes"] = per_seed, {k: len(s["values"]) for k, s in row["series"].items()}
    row["mean"], row["std"] = mean_std(per_seed.values())
    train = {k: _mean(s["values"][-n:]) for k, s in (row.get("train_series") or {}).items()}
    update = {k: r + u for k, (r, u) in (row.get("seconds_per_update") or {}).items()}
    extra = {"first": first, "train": train, "update_s": update}
    row["extra"] = {k: dict(zip(("per_seed", "mean", "std"), (v, *mean_std(v.values())))) for k, v in extra.items()}
    row["extra"] = {k: v for k, v in row["extra"].items() if v["per_seed"]}
    row["sps"], row["wall_seconds"] = (
        math.nan if row.get(k) is None else float(row[k]) for k in ("sps", "wall_seconds")
    )
    return row


class StoreError(Exception):
    """A file of the results store that is not one: one sentence naming it."""


def read_json(path: str) -> dict:
    """The JSON object of a store file; StoreError naming the file for anything else (cut, foreign, unreadable)."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise StoreError(f"{path} cannot be read as a file of the results store ({' '.join(str(e).split())[:120]})")
    if not isinstance(obj, dict):
        raise StoreError(f"{path} is not a file of the results store (its JSON is not an object)")
    return obj


def load(results_dir: str) -> dict:
    """Everything in the store: {"rows": [...], "throughput": [...], "speed": [...]}, the rows' numbers derived."""
    data = {"rows": [], "throughput": [], "speed": []}
    for path in sorted(glob.glob(os.path.join(results_dir, "**", "*.json"), recursive=True)):
        obj = read_json(path)
        obj["_file"] = os.path.relpath(path, os.path.dirname(os.path.abspath(results_dir)))
        kind = os.path.relpath(path, results_dir).split(os.sep)[0]
        try:
            data[kind].append(obj) if kind in data else data["rows"].append(derive(obj))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"{path} is not a row of the results store (at {e!r:.100})")
    return data


def find(data: dict, script: str, env: str, steps: int, setting: str) -> dict:
    for r in data["rows"]:
        if (r["script"], r["env"], r["steps"], r["setting"]) == (script, env, steps, setting):
            return r
    raise KeyError(f"no stored row {script} {env} {steps} {setting}: run it (benchmark/run.py) or take it off the page")


# ----------------------------------------------------------------------------------------------- statistics


def _boot(samples, statistic) -> tuple[float, float]:
    """Percentile bootstrap 95% interval, each sample resampled on its own (stratified: seeds within a setting)."""
    res = stats.bootstrap(samples, statistic, n_resamples=10_000, method="percentile", rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def iqm(x, axis=-1):
    return stats.trim_mean(x, 0.25, axis=axis)


def prob_improvement(x, y, axis=-1):
    """P(X > Y) for a random seed of each, ties counting half: rliable's probability of improvement on one task."""
    d = np.moveaxis(np.asarray(x), axis, -1)[..., :, None] - np.moveaxis(np.asarray(y), axis, -1)[..., None, :]
    return (d > 0).mean((-2, -1)) + 0.5 * (d == 0).mean((-2, -1))


def holm(pvalues) -> list[float]:
    """Holm's step-down correction of p-values for the number of comparisons: the i-th smallest of m is multiplied by
    m - i + 1 (i from 1), capped at 1, and made non-decreasing in that order."""
    p = np.asarray(pvalues, dtype=float)
    out, running = np.empty_like(p), 0.0
    for i, k in enumerate(np.argsort(p, kind="stable")):
        running = max(running, min(1.0, (len(p) - i) * p[k]))
        out[k] = running
    return out.tolist()


def pooled_std(a, b) -> float:
    """The pooled standard deviation of two samples (each's sample variance, weighted by its degrees of freedom)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.sqrt(((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / (len(a) + len(b) - 2)))


def t_power(difference: float, std: float, n_a: int, n_b: int, alpha: float = 0.05) -> float:
    """The power of the two-sided two-sample t-test at level alpha to detect a true `difference` between means of
    samples of n_a and n_b with common std `std`: noncentral t with n_a + n_b - 2 degrees of freedom."""
    df, nc = n_a + n_b - 2, difference / (std * math.sqrt(1 / n_a + 1 / n_b))
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def detectable(std: float, n_a: int, n_b: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest true difference of means that the two-sided t-test (`t_power`) detects with `power`."""
    scale = std * math.sqrt(1 / n_a + 1 / n_b)
    gap = lambda nc: t_power(nc * scale, std, n_a, n_b, alpha) - power  # noqa: E731
    high = 1.0
    while gap(high) < 0:  # the noncentrality that reaches the power (doubling: nct turns to nan far out)
        high *= 2
    return float(optimize.brentq(gap, 0.0, high) * scale)


def _diff(statistic):
    return lambda x, y, axis=-1: statistic(x, axis=axis) - statistic(y, axis=axis)


def compare(a: list[float], b: list[float]) -> dict:
    """Setting a against setting b: the mean and the interquartile mean of each and their differences a - b with
    stratified-bootstrap 95% intervals (each setting's seeds resampled on their own), and the probability of
    improvement P(a > b) with its interval (Agarwal et al. 2021, rliable's method), beside Welch's t-test of the
    difference of the means (95% interval, p-value); and the difference that a two-sided t-test at alpha 0.05 would
    detect with 80% power with these seeds per setting and their pooled std (noncentral t)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    welch = stats.ttest_ind(a, b, equal_var=False)
    out = {"welch_p": float(welch.pvalue), "welch_ci": tuple(map(float, welch.confidence_interval(0.95)))}
    for name, x in (("a", a), ("b", b)):
        out[f"mean {name}"] = (float(x.mean()), _boot((x,), np.mean))
        out[f"IQM {name}"] = (float(iqm(x)), _boot((x,), iqm))
    out["mean a - b"] = (float(a.mean() - b.mean()), _boot((a, b), _diff(np.mean)))
    out["IQM a - b"] = (float(iqm(a) - iqm(b)), _boot((a, b), _diff(iqm)))
    out["P(a > b)"] = (float(prob_improvement(a, b)), _boot((a, b), prob_improvement))
    out["pooled_std"] = pooled_std(a, b)
    out["detectable"] = detectable(out["pooled_std"], len(a), len(b))
    return out


# ----------------------------------------------------------------------------------------------- cells and tables


def fmt(x, digits: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def fmt_p(p: float) -> str:
    """A p-value to 3 decimals, one below 0.001 as such (not as 0.000)."""
    return "< 0.001" if p < 0.001 else fmt(p, 3)


def pm(row: dict, key: str | None = None) -> str:
    """`mean ± std` of the row's number or of one of its extras ('' when the row has no such extra)."""
    x, d = row if key is None else row["extra"].get(key), 3 if row["tag"] == "charts/regret" else 2
    return "" if x is None else f"{fmt(x['mean'], d)} ± {fmt(x['std'], d)}"


def per_seed(row: dict, key: str | None = None) -> str:
    x, d = row["per_seed"] if key is None else row["extra"][key]["per_seed"], 3 if row["tag"] == "charts/regret" else 2
    return ", ".join(fmt(x[str(s)], d) for s in row["seeds"] if str(s) in x)


def seed_machines(row: dict) -> dict:
    """Each seed's machine: as stored per seed, or, for a row stored before the store kept it, the row's machine where
    it names one; a seed whose machine cannot be told is left out (unknown)."""
    if "seed_machine" in row:
        return {k: v for k, v in row["seed_machine"].items() if v}
    single = row.get("machine") and " / " not in row["machine"]
    return {str(s): row["machine"] for s in row["seeds"]} if single else {}


def seed_codes(row: dict) -> dict:
    """Each seed's script version, as `seed_machines` (a row of one version, else unknown)."""
    if "seed_code" in row:
        return {k: v for k, v in row["seed_code"].items() if v}
    return {str(s): row["code"][0] for s in row["seeds"]} if len(row.get("code") or []) == 1 else {}


def machines(row: dict) -> str:
    """The machines of the row's seeds, with how many seeds each ran: `AMD EPYC x3, Intel Xeon x7`."""
    per = seed_machines(row)
    kinds = [short_machine(per[str(s)]) if str(s) in per else "unknown" for s in row["seeds"]]
    return ", ".join(f"{k} x{kinds.count(k)}" for k in dict.fromkeys(kinds))


def prediction_interval(x, level: float = 0.95) -> tuple[float, float]:
    """The interval that holds one more draw from the distribution of the sample `x` with probability `level`, for
    normal data: mean ± t(n - 1) · s · sqrt(1 + 1/n), s the sample std."""
    x = np.asarray(x, dtype=float)
    half = stats.t.ppf((1 + level) / 2, len(x) - 1) * x.std(ddof=1) * math.sqrt(1 + 1 / len(x))
    return float(x.mean() - half), float(x.mean() + half)


def pooling_check(row: dict) -> list[str]:
    """Per metric of a row that pools seeds across machines (its number, and an evaluation row's training return):
    each seed of another machine against the 95% prediction interval of the seeds of the row's most frequent machine
    (at least 3 of them), as `H200 seed 5, 3442.83: inside [a, b]`."""
    per, kinds = seed_machines(row), {}
    for s in (str(s) for s in row["seeds"] if str(s) in per):
        kinds.setdefault(short_machine(per[s]), []).append(s)
    main = max(kinds, key=lambda k: len(kinds[k]), default=None)
    if len(kinds) < 2 or len(kinds[main]) < 3:
        return []
    out, metrics = [], [("evaluation " * row["tag"].startswith("eval/"), row["per_seed"])]
    if "train" in row["extra"]:
        metrics.append(("training return ", row["extra"]["train"]["per_seed"]))
    for what, values in metrics:
        low, high = prediction_interval([values[s] for s in kinds[main]])
        for k, seeds in ((k, v) for k, v in kinds.items() if k != main):
            out += [
                f"{what}{k} seed {s}, {fmt(values[s])}: {'inside' if low <= values[s] <= high else 'OUTSIDE'} "
                f"[{fmt(low)}, {fmt(high)}] of its {len(kinds[main])} {main} seeds"
                for s in seeds
            ]
    return out


def pooled(rows: list[dict]) -> str:
    """The sentence under a table with a `machines` column: whether its rows pool seeds across machines, the
    assumption that pooling makes, and the check of it that the store allows (`pooling_check`)."""
    kinds = sorted({short_machine(m) for r in rows for m in seed_machines(r).values()})
    assumption = (
        "the assumption that a different processor changes a seed's floating-point trajectory but not the distribution "
        "it is drawn from (every seed was computed by the script with its row's flags)"
    )
    if len(kinds) <= 1:
        on = f"on {kinds[0]}" if kinds else "on machines not recorded per seed"
        return f"Every seed here ran {on}; seeds from other machines would be pooled into a row under {assumption}."
    checks = [f"`{r['setting']}`: {'; '.join(c)}" for r in rows if (c := pooling_check(r))]
    check = (
        " The check the store allows: per row, each seed of another machine against the 95% prediction interval "
        "(Student's t) of the seeds of the row's most frequent machine, for the row's number and its training return "
        "(`benchmark/report.py`, `pooling_check`): "
        + ". ".join(checks)
        + ". A seed inside its interval is consistent with the assumption and does not prove it: one seed per row "
        "would show only a shift of the order of the interval's half-width."
    ) * bool(checks)
    where = f"{', '.join(kinds)}; per row in the machines column"
    return f"Seeds are pooled across machines ({where}) under {assumption}.{check}"


def short_machine(machine: str) -> str:
    names = {"H100": "H100", "H200": "H200", "EPYC": "AMD EPYC", "Xeon": "Intel Xeon"}
    one = lambda m: next((v for k, v in names.items() if k in m), m.split(",")[0])  # noqa: E731
    return " + ".join(dict.fromkeys(one(m) for m in machine.split(" / ")))


def metric(row: dict) -> str:
    if row["tag"].startswith("eval/"):
        return f"deterministic evaluation, {row['last_n']} episodes per seed"
    if row.get("last_fraction"):
        return f"normalised regret, episodes ending in the last {row['last_fraction']:.0%} of the steps (lower: better)"
    return f"{row['tag'].split('/')[-1].replace('_', ' ')}, last {row['last_n']} episodes per seed"


def flags(row: dict) -> str:
    """The setting's flags, less those that only save, evaluate or cache."""
    kept = re.sub(r"--save-model|--eval-episodes \S+|--cache \S+", "", " ".join(row["flags"])).split()
    return f"`{' '.join(kept)}`" if kept else "(defaults)"


def ref_text(r: dict, where: bool = True) -> str:
    """A published number, its source and (`where`) where in the source it stands (a web address as a link)."""
    url, _, words = (r.get("address") or "").partition(" ") if where else ("", "", "")
    where = ", ".join(x for x in ([f"<{url}>", words] if url.startswith("http") else [f"{url} {words}".strip()]) if x)
    where = f"; {where}" if where else ""
    return (
        f"{r['value']:g}" if r.get("std") is None else f"{r['value']:g} ± {r['std']:g}"
    ) + f" ({r['source']}{where})"


def markdown(records: list, columns: list[str] | None = None) -> str:
    df = pd.DataFrame(records, columns=columns, dtype=str).fillna("")
    return df.to_markdown(index=False, disable_numparse=True, tablefmt="github")


CELLS = {  # column of a results table -> (header, cell of a stored row)
    "script": ("script", lambda r: f"`{r['script']}.py`"),
    "setting": ("setting", lambda r: f"`{r['setting']}`"),
    "flags": ("flags", flags),
    "env": ("env", lambda r: r["env"]),
    "steps": ("steps", lambda r: f"{r['steps']:,}"),
    "seeds": ("seeds", lambda r: ", ".join(map(str, r["seeds"]))),
    "machine": ("machine", lambda r: short_machine(r["machine"])),
    "machines": ("machines (seeds)", machines),
    "metric": ("metric", metric),
    "result": ("mean ± std", pm),
    "eval": ("evaluation, mean ± std", pm),
    "per-seed": ("per seed", per_seed),
    "first": ("first quarter, mean ± std", lambda r: pm(r, "first")),
    "train": ("training return, mean ± std", lambda r: pm(r, "train")),
    "update-s": ("seconds per update, mean ± std", lambda r: pm(r, "update_s")),
}


def picked(data: dict, lines: list[str]) -> list[dict]:
    """Stored rows named by lines `script env steps setting [setting ...]`."""
    return [find(data, s, e, int(n), x) for s, e, n, *xs in (line.split() for line in lines) for x in xs]


def rows_table(data: dict, columns: str, lines: list[str]) -> str:
    """One line per named row with the given columns (CELLS), then the rows' published numbers."""
    rows = picked(data, lines)
    beside = {}  # a published number -> the budgets of the rows of each env it stands beside
    for r, x in ((r, x) for r in rows for x in r["refs"]):
        beside.setdefault((r["env"], ref_text(x)), set()).add(r["steps"])
    budgets = lambda env, steps: (  # noqa: E731 (named where not every row of the env is meant)
        ""
        if steps == {r["steps"] for r in rows if r["env"] == env}
        else f" of {' and '.join(f'{n:,}' for n in sorted(steps))} steps"
    )
    refs = {f"- beside the {env} rows{budgets(env, steps)}: {text}": 0 for (env, text), steps in beside.items()}
    head = ["", "Published (other code, machines and library versions; each with its own env and budget):", ""]
    head = head if refs else []
    note = ["", pooled(rows)] if "machines" in columns.split() else []
    table = markdown([{CELLS[c][0]: CELLS[c][1](r) for c in columns.split()} for r in rows])
    return "\n".join([table, *note, *head, *refs])


def pivot_table(data: dict, script: str, settings: list[str], envs: str) -> str:
    """Settings by env (`env (steps)`): mean ± std where the store has the row, empty where it has none."""
    pairs = list(zip(envs.split()[::2], map(int, envs.split()[1::2])))
    have = {(r["env"], r["steps"], r["setting"]): r for r in data["rows"] if r["script"] == script}
    found = [have[(e, n, s)] for s in settings for e, n in pairs if (e, n, s) in have]
    missing = [s for s in settings if not any(r["setting"] == s for r in found)]
    if missing:
        raise KeyError(f"no stored row of {script} {missing[0]}: run it (benchmark/run.py) or take it off the page")
    records = [{"setting": f"`{s}`", "flags": flags(next(r for r in found if r["setting"] == s))} for s in settings]
    for rec, s in zip(records, settings):
        rec.update({f"{e} ({n})": pm(have[(e, n, s)]) if (e, n, s) in have else "" for e, n in pairs})
    seeds = "; ".join(sorted({", ".join(map(str, r["seeds"])) for r in found}))
    return (
        markdown(records)
        + f"\n\nSeeds {seeds}; machines: {', '.join(sorted({short_machine(r['machine']) for r in found}))}."
    )


def compare_table(data: dict, lines: list[str], labels: list[str] | None = None) -> str:
    """For each line `script env steps a b`: a against b (`compare`), named by its label; the Welch p-values
    Holm-corrected over the comparisons of the table; then a line per comparison with the difference that 80% power
    would detect."""
    records, power, found = [], [], []
    labels = labels or [f"{line.split()[3]} - {line.split()[4]}" for line in lines]
    for label, (script, env, steps, a, b) in zip(labels, (line.split() for line in lines)):
        ra, rb = find(data, script, env, int(steps), a), find(data, script, env, int(steps), b)
        found.append(compare(list(ra["per_seed"].values()), list(rb["per_seed"].values())))
        d = 3 if ra.get("tag") == "charts/regret" else 2  # digits (the power line: one fewer)
        c, ci = found[-1], lambda lo, hi, k=d: f"[{fmt(lo, k)}, {fmt(hi, k)}]"  # noqa: E731
        records.append({"comparison": label, "a": f"`{a}`", "b": f"`{b}`"})
        records[-1]["seeds"] = f"{len(ra['per_seed'])} vs {len(rb['per_seed'])}"
        records[-1].update({f"{k} [95% CI]": f"{fmt(c[k][0], d)} {ci(*c[k][1])}" for k in ("mean a - b", "IQM a - b")})
        records[-1].update({"P(a > b) [95% CI]": f"{fmt(c['P(a > b)'][0])} {ci(*c['P(a > b)'][1], 2)}"})
        records[-1].update({"Welch 95% CI of a - b": ci(*c["welch_ci"]), "Welch p": fmt_p(c["welch_p"])})
        n_a, n_b = len(ra["per_seed"]), len(rb["per_seed"])
        power.append(
            f"- {label}: with {n_a} and {n_b} seeds and their pooled std {fmt(c['pooled_std'], d - 1)}, a true "
            f"difference of {fmt(c['detectable'], d - 1)} would be detected with 80% power "
            f"(the observed: {fmt(c['mean a - b'][0], d - 1)})."
        )
    corrected = holm([c["welch_p"] for c in found])
    for record, p in zip(records, corrected):
        record[f"Holm p ({len(found)} comparisons)"] = fmt_p(p)
    below = [f"{label} ({fmt_p(p)})" for label, p in zip(labels, corrected) if p < 0.05]
    verdict = f"Holm-corrected p below 0.05: {', '.join(below) or 'none'}, of {len(found)} comparisons."
    head = (
        "The difference of means that a two-sided two-sample t-test at alpha 0.05 detects with 80% power, with the "
        "seeds stored per setting (noncentral t):"
    )
    return "\n".join([markdown(records), "", verdict, "", head, "", *power])


# ----------------------------------------------------------------------------------------------- a registered test


def registered(script: str, env: str, steps: int, name: str) -> dict:
    """A setting as registry.toml registers it: its seeds and its flags (KeyError when it has none such)."""
    for e in REGISTRY["settings"]:
        pairs = e["envs"].items() if isinstance(e["envs"], dict) else [(v, n) for n in e["steps"] for v in e["envs"]]
        if e["script"] == script and name in e["names"] and (env, steps) in pairs:
            return {"seeds": [str(s) for s in e["seeds"]], "flags": e["names"][name].split()}
    raise KeyError(f"no setting {script} {env} {steps} {name} in registry.toml")


def perturbations(flags: list[str]) -> list[str]:
    """The perturbations of `--eval-perturbations` among a setting's flags."""
    words = flags[flags.index("--eval-perturbations") + 1 :] if "--eval-perturbations" in flags else []
    return words[: next((i for i, w in enumerate(words) if w.startswith("--")), len(words))]


def find_or_none(data: dict, script: str, env: str, steps: int, setting: str) -> dict | None:
    try:
        return find(data, script, env, steps, setting)
    except KeyError:
        return None


METRICS = {  # a registered metric: (its name on the page, digits)
    "train-all": ("H1 metric: mean training return over all episodes of the run", 2),
    "eval": ("H2 metric: mean return of the deterministic evaluation", 2),
    "robustness": (
        "H3 score: mean over the perturbations of the perturbed evaluation's mean / the evaluation's mean",
        3,
    ),
}


def seed_metric(row: dict, seed: str, metric: str, perturbed: list[str]) -> tuple[float | None, str]:
    """One seed's value of a registered metric, or None and why it has none. `train-all`: the mean of every training
    episodic return of the run; `eval`: the mean of its evaluation episodes; `robustness`: the mean over `perturbed` of
    each perturbed evaluation's mean, over the unperturbed evaluation's mean (none when that mean is at most 0)."""
    mean = lambda s: float(np.mean(s["values"])) if s and s["values"] else None  # noqa: E731
    if metric == "train-all":
        x = mean((row.get("train_series") or {}).get(seed))
        return x, "" if x is not None else "no training episode stored"
    unperturbed = mean(row["series"].get(seed))
    if metric == "eval" or unperturbed is None:
        return unperturbed, "" if unperturbed is not None else "no evaluation stored"
    if unperturbed <= 0:
        return None, f"no score: unperturbed mean {fmt(unperturbed)} <= 0"
    under = [mean((row.get("perturbed_series") or {}).get(p, {}).get(seed)) for p in perturbed]
    if None in under:
        return None, f"no score: {perturbed[under.index(None)]} not stored"
    return float(np.mean(under)) / unperturbed, ""


def welch_mw(a: list[float], b: list[float]) -> dict:
    """Welch's two-sided t-test of a - b (95% interval, p), the two-sided Mann-Whitney U test beside it, and the
    difference of means that a two-sided t-test at alpha 0.05 detects with 80% power with these seeds (`detectable`)."""
    welch = stats.ttest_ind(a, b, equal_var=False)
    mw = stats.mannwhitneyu(a, b, alternative="two-sided")
    out = {"diff": float(np.mean(a) - np.mean(b)), "welch_p": float(welch.pvalue), "mw_u": float(mw.statistic)}
    out.update(welch_ci=tuple(map(float, welch.confidence_interval(0.95))), mw_p=float(mw.pvalue))
    out.update(pooled_std=pooled_std(a, b), detectable=detectable(pooled_std(a, b), len(a), len(b)))
    return out


def confirm_table(data: dict, spec: dict) -> str:
    """A pre-registered test (`confirm` in a [tables.NAME] entry): per arm (a setting and its registered seeds) the
    registered metrics per seed; when every arm holds all of its registered seeds, each registered comparison a - b
    (Welch's two-sided test with its 95% interval, p Holm-corrected over the comparisons, the two-sided Mann-Whitney U
    test beside it, the difference detectable with 80% power); before that, the seeds stored and no test. Then the
    `exploratory` comparison, labelled as such."""
    script, env, steps = spec["confirm"].split()
    steps, arms = int(steps), spec["arms"]
    reg = {a: registered(script, env, steps, name) for a, name in arms.items()}
    rows = {a: find_or_none(data, script, env, steps, name) for a, name in arms.items()}
    stored = {a: [s for s in reg[a]["seeds"] if r and s in r["series"]] for a, r in rows.items()}
    complete = all(len(stored[a]) == len(reg[a]["seeds"]) for a in arms)
    used = {a: dict.fromkeys(m for _, m, x, y, _ in spec["comparisons"] if a in (x, y)) for a in arms}
    values = {
        (a, m): {s: seed_metric(rows[a], s, m, perturbations(reg[a]["flags"])) for s in stored[a]}
        for a in arms
        for m in used[a]
    }
    counts = ", ".join(f"{a} {len(stored[a])} of {len(reg[a]['seeds'])}" for a in arms)
    out = []
    if not complete:
        out += [
            f"**Incomplete: not the registered test.** Seeds stored per arm, of those registered: {counts}. The tests "
            "run only when every arm holds all of its registered seeds; until then no test or p-value is shown.",
            "",
        ]
    else:
        records, power, results = [], [], []
        for label, m, x, y, _ in spec["comparisons"]:
            a = [v for v, _ in values[(x, m)].values() if v is not None]
            b = [v for v, _ in values[(y, m)].values() if v is not None]
            results.append(welch_mw(a, b) if min(len(a), len(b)) >= 2 else None)
            c, d = results[-1], METRICS[m][1]
            rec = {"comparison": label, "metric": METRICS[m][0].split(":")[0], "a - b": f"{x} - {y}"}
            rec.update(seeds=f"{len(a)} vs {len(b)}", **{"mean a": fmt(_mean(a), d), "mean b": fmt(_mean(b), d)})
            if c:
                rec["a - b"] = f"{x} - {y} = {fmt(c['diff'], d)}"
                rec["Welch 95% CI"] = f"[{fmt(c['welch_ci'][0], d)}, {fmt(c['welch_ci'][1], d)}]"
                rec["Welch p"] = fmt_p(c["welch_p"])
                rec["Mann-Whitney U (p)"] = f"{c['mw_u']:g} ({fmt_p(c['mw_p'])})"
                power.append(
                    f"- {label}: with {len(a)} and {len(b)} seeds and their pooled std {fmt(c['pooled_std'], d)}, a "
                    f"true difference of {fmt(c['detectable'], d)} would be detected with 80% power (the observed: "
                    f"{fmt(c['diff'], d)})."
                )
            records.append(rec)
        corrected = holm([c["welch_p"] if c else 1.0 for c in results])
        for rec, p, c in zip(records, corrected, results):
            rec[f"Holm p ({len(results)} comparisons)"] = fmt_p(p) if c else "n/a"
        below = [
            f"{label} ({fmt_p(p)})"
            for (label, *_), p, c in zip(spec["comparisons"], corrected, results)
            if c is not None and p < 0.05
        ]
        head = "The difference of means that a two-sided two-sample t-test at alpha 0.05 detects with 80% power:"
        columns = [*records[0], "Welch 95% CI", "Welch p", f"Holm p ({len(results)} comparisons)", "Mann-Whitney U (p)"]
        out += [
            f"Every arm holds its registered seeds ({counts}).",
            "",
            markdown(records, list(dict.fromkeys(columns))),
        ]
        out += [""]
        out += [f"Holm-corrected p below 0.05: {', '.join(below) or 'none'}, of {len(results)} comparisons.", ""]
        out += [head, "", *power, ""]
        out += [
            "**The claim, as registered** (the report's words for the outcomes above, by the registered rules):",
            "",
        ]
        out += [*claim_lines(spec, results, corrected), ""]
    per_arm = []
    for (a, m), vals in ((k, v) for k, v in values.items() if v):
        cells = [f"{s}: {fmt(v, METRICS[m][1]) if v is not None else why}" for s, (v, why) in vals.items()]
        per_arm.append([a, f"`{arms[a]}`", METRICS[m][0].split(":")[0], len(vals), "; ".join(cells)])
    if any(stored.values()):
        out += ["Per seed:", "", markdown(per_arm, ["arm", "setting", "metric", "seeds", "per seed"]), ""]
        left = [f"{a} seed {s} ({why})" for (a, m), vals in values.items() for s, (v, why) in vals.items() if v is None]
        out += [f"Seeds without a value, left out of their comparisons: {', '.join(left) or 'none'}."]
        out += [f"Machines: {'; '.join(f'{a} {machines(rows[a])}' for a in arms if stored[a])}.", ""]
        out += robustness_table(rows, reg, stored)
    else:
        out += ["No seed of the registered test is stored yet.", ""]
    out += [
        "Metrics: " + "; ".join(f"{k}" for k in dict.fromkeys(METRICS[m][0] for _, m, *_ in spec["comparisons"])) + "."
    ]
    if "exploratory" in spec:
        out += ["", exploratory_line(data, spec["exploratory"], script, env, steps)]
    return "\n".join(out)


def claim_lines(spec: dict, results: list, corrected: list[float]) -> list[str]:
    """The registered claim: a line per group of `spec["claim"]`, each comparison's outcome after Holm's correction at
    0.05 (a above b, a below b, or no difference detected; said against its registered prediction where it has one),
    a group that one of `spec["readings"]` names ending with the reading its outcomes match, or "inconclusive"; a
    reading over several groups, a line of its own where its outcomes hold."""
    found = {c[0]: (c, r, p) for c, r, p in zip(spec["comparisons"], results, corrected)}
    outcome = {
        k: "untested" if r is None else "none" if p >= 0.05 else ["below", "above"][r["diff"] > 0]
        for k, (_, r, p) in found.items()
    }
    lines = []
    for group in spec["claim"]:
        parts = []
        for label in group:
            (_, metric, a, b, predicted), result, p = found[label]
            words = {"above": f"{a} above {b}", "below": f"{a} below {b}", "none": "no difference detected"}
            said = words.get(outcome[label], "not tested (fewer than 2 seeds with a value)")
            if predicted and outcome[label] in ("above", "below"):
                said += ", as predicted" if outcome[label] == predicted else ", against the prediction"
            name = METRICS[metric][0].split(":")[0]
            parts.append(f"{label} ({a} - {b}, {name}): {said}" + (f" (Holm p {fmt_p(p)})" if result else ""))
        readings = [(want, meaning) for want, meaning in spec.get("readings", []) if set(want) == set(group)]
        if readings:
            matched = [meaning for want, meaning in readings if all(outcome[k] == v for k, v in want.items())]
            parts[-1] += f": {matched[0] if matched else 'inconclusive'}, by the registered reading"
        lines.append("- " + "; ".join(parts) + ".")
    for want, meaning in spec.get("readings", []):  # a reading of the groups together: said where it holds
        if not any(set(want) == set(group) for group in spec["claim"]) and all(
            outcome[k] == v for k, v in want.items()
        ):
            lines.append(f"- Together ({', '.join(want)}): {meaning}, by the registered reading.")
    return lines


def robustness_table(rows: dict, reg: dict, stored: dict) -> list[str]:
    """Every arm's evaluation under each registered perturbation: over its stored seeds (those whose unperturbed mean
    is above 0), the mean ± std of the perturbed evaluation's mean over the unperturbed one, beside the unperturbed
    mean. Descriptive: the H3 score is these ratios' mean per seed, and H3 is the registered test."""
    perturbed = next((p for a in rows if (p := perturbations(reg[a]["flags"]))), [])
    records = []
    for a in (a for a in rows if stored[a] and perturbations(reg[a]["flags"])):
        seeds = [s for s in stored[a] if (seed_metric(rows[a], s, "eval", [])[0] or 0) > 0]
        if not seeds:
            continue
        ratios = {p: [seed_metric(rows[a], s, "robustness", [p])[0] for s in seeds] for p in perturbed}
        cells = [
            f"{fmt(_mean(r), 3)} ± {fmt(float(np.std(r)), 3)}" if None not in r else "n/a" for r in ratios.values()
        ]
        unperturbed = [seed_metric(rows[a], s, "eval", [])[0] for s in seeds]
        records.append([a, len(seeds), f"{fmt(_mean(unperturbed))} ± {fmt(float(np.std(unperturbed)))}", *cells])
    if not records:
        return []
    head = "Under each registered perturbation, per arm over its stored seeds (mean ± std of each seed's perturbed"
    head += " evaluation over its unperturbed one; descriptive, the registered test of robustness is H3):"
    return [head, "", markdown(records, ["arm", "seeds", "evaluation", *perturbed]), ""]


def exploratory_line(data: dict, ex: dict, script: str, env: str, steps: int) -> str:
    """The registered test's metric on seeds that were looked at before it was registered: Welch and Mann-Whitney,
    labelled exploratory (no correction; it tests nothing)."""
    (x, a_name), (y, b_name) = ex["arms"].items()
    ra, rb = find(data, script, env, steps, a_name), find(data, script, env, steps, b_name)
    m, d = ex["metric"], METRICS[ex["metric"]][1]
    a = [v for s in map(str, ra["seeds"]) if (v := seed_metric(ra, s, m, [])[0]) is not None]
    b = [v for s in map(str, rb["seeds"]) if (v := seed_metric(rb, s, m, [])[0]) is not None]
    c = welch_mw(a, b)
    rec = {"comparison": f"{x} - {y} (exploratory)", "metric": METRICS[m][0].split(":")[0], "a": f"`{a_name}`"}
    rec.update(
        b=f"`{b_name}`", seeds=f"{len(a)} vs {len(b)}", **{"mean a": fmt(_mean(a), d), "mean b": fmt(_mean(b), d)}
    )
    rec.update(
        {"a - b": fmt(c["diff"], d), "Welch 95% CI": f"[{fmt(c['welch_ci'][0], d)}, {fmt(c['welch_ci'][1], d)}]"}
    )
    rec.update({"Welch p": fmt_p(c["welch_p"]), "Mann-Whitney U (p)": f"{c['mw_u']:g} ({fmt_p(c['mw_p'])})"})
    seeds = [", ".join(map(str, r["seeds"])) for r in (ra, rb)]
    seeds = f"seeds {seeds[0]} of each" if seeds[0] == seeds[1] else f"seeds {seeds[0]} and {seeds[1]}"
    return (
        f"Exploratory, not part of the test: the {METRICS[m][0].split(':')[0]} on the seeds looked at before the "
        f"registration ({seeds}), without correction:\n\n" + markdown([rec])
    )


def against_table(data: dict, spec: dict) -> str:
    """Exploratory: each seed of `settings` against the 95% prediction interval of the seeds of a `reference` row,
    per registered metric (`metrics`, as seed_metric computes them), then each setting's mean against the reference's
    with Welch's 95% interval, uncorrected (it tests nothing)."""
    script, env, steps = spec["against"].split()
    ref = find_or_none(data, script, env, int(steps), spec["reference"])
    records, lines = [], []
    for m in spec["metrics"]:
        name, d = METRICS[m][0].split(":")[0], METRICS[m][1]
        base = [v for s in map(str, ref["seeds"]) if (v := seed_metric(ref, s, m, [])[0]) is not None] if ref else []
        low, high = prediction_interval(base) if len(base) >= 3 else (math.nan, math.nan)
        for setting in spec["settings"]:
            row = find_or_none(data, script, env, int(steps), setting)
            values = {s: seed_metric(row, s, m, [])[0] for s in map(str, row["seeds"])} if row else {}
            values = {s: v for s, v in values.items() if v is not None}
            for s, v in values.items():
                inside = "inside" if low <= v <= high else "OUTSIDE"
                records.append([f"`{setting}`", s, name, fmt(v, d), f"{inside} [{fmt(low, d)}, {fmt(high, d)}]"])
            if len(values) >= 2 and len(base) >= 2:
                c = welch_mw(list(values.values()), base)
                lines.append(
                    f"- {name}: `{setting}` {fmt(_mean(list(values.values())), d)} against {fmt(_mean(base), d)}, a "
                    f"difference of {fmt(c['diff'], d)}, Welch 95% CI [{fmt(c['welch_ci'][0], d)}, "
                    f"{fmt(c['welch_ci'][1], d)}] ({len(values)} vs {len(base)} seeds; uncorrected, exploratory)."
                )
    head = f"Against `{spec['reference']}` ({len(ref['seeds']) if ref else 0} seeds stored)"
    if not records:
        return f"{head}: no seed of {', '.join(f'`{s}`' for s in spec['settings'])} stored yet."
    columns = ["setting", "seed", "metric", "value", "against the reference seeds' 95% prediction interval"]
    return f"{head}, exploratory:\n\n" + markdown(records, columns) + "\n\n" + "\n".join(lines)


def throughput_table(data: dict, script: str) -> str:
    head = "steps per run, runs each, ours steps/s, peer, peer threads, peer steps/s, ratio".split(", ")
    keys = ("steps", "repeats", "sps", "peer_label", "peer_threads", "peer_sps", "ratio")
    cell = lambda x, k: fmt(x, 2 * (k == "ratio")) if isinstance(x, float) else f"{x:,}" if isinstance(x, int) else x  # noqa: E731
    cores = lambda t: re.search(r"(\d+) cores", t["machine"])  # noqa: E731
    load = lambda t: f"{t['load'][0]} / {t['load'][1]}" + (f" on {cores(t)[1]} cores" if cores(t) else "")  # noqa: E731
    records = [
        [short_machine(t["machine"])] + [cell(t[k], k) for k in keys] + [load(t)]
        for t in data["throughput"]
        if t["script"] == script
    ]
    return markdown(records, ["machine", *head, "1-minute load before / after"])


def phases(d: dict) -> list[str]:
    """The phases of an update a speed entry timed in every configuration (the script's time/<phase>_seconds): the
    rollout first, the update's total last, its parts between."""
    common = set.intersection(*(set(p) for p in d["phases"].values())) if d.get("phases") else set()
    common = set() if d.get("unit") == "run" else common  # (a whole run's time: its phases are per step, not per run)
    return sorted(common, key=lambda k: (k != "rollout", k == "update", k))


def speed_records(e: dict) -> list[list]:
    """A speed entry's table: seconds per update (epoch) of each configuration against the first's (`per_epoch`), or
    the runs of a GPU check (`runs`: medians over the updates)."""
    d = e["data"]
    if "parts" in d:  # a time breakdown: seconds per update of each part
        total = sum(d["parts"].values())
        return [[part, fmt(t, 4), f"{100 * t / total:.0f}%"] for part, t in d["parts"].items()]
    if "per_epoch" in d:
        med = {c: float(np.median(v)) for c, v in d["per_epoch"].items()}
        first = next(iter(med.values()))
        shown = [[fmt(float(np.median(d["phases"][c][k]))) for k in phases(d)] for c in med]
        return [
            [f"`{c}`", fmt(m), fmt(d["steps_per_epoch"] / m, 0 if d["steps_per_epoch"] >= 10 * m else 3)]
            + [f"{m / first:.{2 if phases(d) or d.get('unit') == 'run' else 1}f}x"]
            + [len(d["per_epoch"][c]), *shown[i]]
            for i, (c, m) in enumerate(med.items())
        ]
    # the first update holds the start-up (and compilation): left out where later ones were timed
    med = lambda r, k: fmt(np.median(r[f"time/{k}_seconds"][1:] or r[f"time/{k}_seconds"]))  # noqa: E731
    updates = lambda r: r.get("updates", len(r["time/update_seconds"]))  # noqa: E731 (a probe says what it timed)
    parts = lambda r: [updates(r), med(r, "rollout"), med(r, "update"), f"{r['steps_done']:,}"]  # noqa: E731
    return [[name, *parts(r), fmt(r["wall_seconds"], 0), f"`{' '.join(r['flags'])}`"] for name, r in d["runs"].items()]


def speed_columns(e: dict) -> list[str]:
    if "parts" in e["data"]:
        return ["part", "s per update", "share"]
    if "per_epoch" in e["data"]:
        shown = [f"{k.replace('_', ' ')} s" for k in phases(e["data"])]
        unit = e["data"].get("unit", "update")
        return ["configuration", f"s per {unit} (median)", "env steps/s", "vs the first", f"{unit}s timed", *shown]
    return [
        "run",
        "updates",
        "rollout s (median after the first)",
        "update s (median after the first)",
        "steps",
        "wall s",
        "flags",
    ]


def speed_table(data: dict, name: str) -> str:
    (e,) = [e for e in data["speed"] if e["name"] == name]
    floor = e["data"].get("env_floor")
    note = f" The {floor['steps']:,} env steps alone: {floor['steps_per_s']:.0f} steps/s." if floor else ""
    if "parts" in e["data"]:
        d = e["data"]
        updates = f"{d['updates']} update{'s' * (d['updates'] != 1)}"
        note = f" `{d['command']}` under pyinstrument, {updates}; start-up {fmt(d['startup_seconds'])} s."
    if e["data"].get("threads", 1) > 1:
        note += f" Each run on {e['data']['threads']} threads."
    if "load" in e:
        note += f" The 1-minute load average when it ended: {e['load']}."
    return markdown(speed_records(e), speed_columns(e)) + f"\n\nMachine: {e['machine']}.{note}"


def critics_table(data: dict) -> str:
    """GPT2PPO's critics: seconds per epoch against the MLP critic's, per machine and env (gpt2ppo speed entries)."""
    records = {}
    for e in (e for e in data["speed"] if e["name"].startswith("gpt2ppo")):
        for rec in speed_records(e)[1:]:
            key = (rec[0], short_machine(e["machine"]))
            records.setdefault(key, {"critic": key[0], "machine": key[1]})[e["data"]["env_id"]] = rec[3]
    return markdown(list(records.values()))


def refs_table(data: dict) -> str:
    """Every published number the stored rows are shown beside, with the scripts and envs it stands beside."""
    beside = {}
    for r in data["rows"]:
        for x in r["refs"]:
            beside.setdefault(ref_text(x), {})[f"`{r['script']}.py` {r['env']}"] = 0
    return markdown([[k, ", ".join(v)] for k, v in beside.items()], ["published number (source)", "shown beside"])


def table(data: dict, spec: dict) -> str:
    """A page table from its registry entry ([tables.NAME] in registry.toml)."""
    if "rows" in spec:
        return rows_table(data, spec["columns"], spec["rows"])
    if "pivot" in spec:
        return pivot_table(data, spec["pivot"], spec["settings"], spec["envs"])
    if "compare" in spec:
        return compare_table(data, spec["compare"], spec.get("labels"))
    if "confirm" in spec:
        return confirm_table(data, spec)
    if "against" in spec:
        return against_table(data, spec)
    if "throughput" in spec:
        return throughput_table(data, spec["throughput"])
    if "speed" in spec:
        return speed_table(data, spec["speed"])
    return critics_table(data) if "critics" in spec else refs_table(data)


# ----------------------------------------------------------------------------------------------- results.md

HEADER = (
    "Written by `python benchmark/run.py --mode report` from `benchmark/results/` (do not edit). Per seed the mean of "
    "the last N episodes of the row's metric (ICPI: of the episodes that ended in the last quarter of the real steps), "
    "then mean ± population std (ddof=0) over seeds. SPS and wall minutes are means over seeds, on machines that were "
    "often shared: compare them only within a side-by-side measurement (Throughput, Speed). Source `imported`: made "
    "before the harness held it, by the command in its notes."
)


def render(data: dict, order: list[tuple]) -> str:
    """results.md: every stored row (registry order), how each was made, the comparisons, throughput and speed."""
    rank = {k: i for i, k in enumerate(order)}
    rows = sorted(data["rows"], key=lambda r: (rank.get((r["script"], r["env"], r["setting"]), len(rank)), r["steps"]))
    setups = sorted({f"{x['machine']}; {x['versions']}" for k in data for x in data[k]})
    mid = {m: f"M{i + 1}" for i, m in enumerate(setups)}
    m_of = lambda x: mid[f"{x['machine']}; {x['versions']}"]  # noqa: E731
    cols = "script env setting steps seeds result metric".split()
    line = lambda r: [CELLS[c][1](r) for c in cols] + [fmt(r["sps"], 0), fmt(r["wall_seconds"] / 60, 1), m_of(r)]  # noqa: E731
    main = [[i + 1, *line(r), r.get("source", "harness")] for i, r in enumerate(rows)]
    head = ["#", *(CELLS[c][0] for c in cols), "SPS", "wall / run, min", "machine", "source"]
    out = ["# Benchmark results", "", HEADER, "", markdown(main, head), "", "How each row was made:", ""]
    for i, r in enumerate(rows):
        text = f"{i + 1}. `{r['script']}.py {' '.join(r['flags']) or '(defaults)'}`: per seed {per_seed(r)} "
        text += f"({', '.join(map(str, r['episodes'].values()))} episodes)."
        text += "".join(f" {EXTRAS[k].capitalize()}: {pm(r, k)} ({per_seed(r, k)})." for k in r["extra"])
        if any((r.get("seed_replayed") or {}).values()):
            text += " Answers replayed from the cache of a stopped attempt (the wall time is the rest's): "
            text += ", ".join(f"seed {s} {n}" for s, n in r["seed_replayed"].items()) + "."
        if "," in machines(r) or "unknown" in machines(r):  # seeds pooled across machines, or not recorded per seed
            text += f" Machines per seed: {machines(r)}."
        if r.get("imported"):
            text += f" Imported: made by `{r['imported']['command']}`; data from {r['imported']['from']}."
        else:
            text += f" Made by `{r['harness_command']}` (finished {r['finished']}, niceness {r['nice']}); each seed"
            text += f" ran `{'`, `'.join(r['run_commands'])}` ({'; '.join(r['code'])})."
        out.append(text + f" File: `{r['_file']}`.")
    have = {(r["script"], r["env"], str(r["steps"]), r["setting"]) for r in data["rows"]}
    stored = lambda p: {(*p.split()[:3], x) for x in p.split()[3:]} <= have  # noqa: E731
    shown = {name: spec for name, spec in REGISTRY["tables"].items() if spec.get("compare")}
    shown = {name: spec for name, spec in shown.items() if all(map(stored, spec["compare"]))}
    out += ["", "## Comparisons between settings", "", " ".join(compare.__doc__.split())] * bool(shown)
    for name, spec in shown.items():  # Holm's correction over the comparisons of each table
        out += ["", f"`{name}`:", "", compare_table(data, spec["compare"], spec.get("labels"))]
    out += ["", "## Throughput (short runs alternating with the peer, medians)"]
    for script in dict.fromkeys(t["script"] for t in data["throughput"]):
        out += ["", f"`{script}.py`:", "", throughput_table(data, script)]
    out.append("")
    for t in data["throughput"]:
        load = f"1-minute load {t['load'][0]} before, {t['load'][1]} after"
        out.append(f"- `{t['_file']}`: `{t['harness_command']}`, machine {m_of(t)}, {load}")
    out += ["", "## Speed (`--mode speed`; the GPU entries imported from `benchmark/gpu/`)"]
    for e in data["speed"]:
        how = e.get("imported") and f"imported: `{e['imported']['command']}`, from `{e['imported']['from']}`"
        how = how or f"`{e['harness_command']}`, finished {e['finished']}"
        threads = e.get("data", {}).get("threads", 1)
        how += f". Each run on {threads} threads" if threads > 1 else ""
        out += ["", f"### {e['name']} (machine {m_of(e)})", "", how + ".", ""]
        out.append(markdown(speed_records(e), speed_columns(e)))
    return "\n".join(out + ["", "## Machines", ""] + [f"- {v}: {k}" for k, v in mid.items()]) + "\n"


# ----------------------------------------------------------------------------------------------- pages

MARKED = re.compile(r"(<!-- results: ([\w.-]+) -->\n)(.*?)(<!-- /results -->)", re.S)


def fill(text: str, data: dict) -> str:
    """`text` with every marked results table regenerated from the store (an unknown name is an error)."""

    def one(m: re.Match) -> str:
        if m.group(2) not in REGISTRY["tables"]:
            raise KeyError(f"no results table '{m.group(2)}' in registry.toml ({', '.join(REGISTRY['tables'])})")
        return m.group(1) + table(data, REGISTRY["tables"][m.group(2)]) + "\n" + m.group(4)

    return MARKED.sub(one, text)


def pages(root: str = ROOT) -> list[str]:
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def write_pages(data: dict, root: str = ROOT) -> list[str]:
    """Regenerate the marked tables of README.md and docs/*.md under `root`; returns the files that changed."""
    changed = []
    for path in pages(root):
        with open(path) as f:
            old = f.read()
        if (new := fill(old, data)) != old:
            with open(path, "w") as f:
                f.write(new)
            changed.append(path)
    return changed


# ----------------------------------------------------------------------------------------------- plots


def band(ax, series: dict, steps: int, window: int, colour: str, label: str, points: int = 200) -> int:
    """Per seed the running mean of `window` values of its series, interpolated on a grid of `steps`; their mean over
    seeds as a line with a ±std band. Returns the seeds drawn (a seed with no value draws nothing)."""
    grid, ys = np.linspace(0, steps, points), []
    for s in (s for s in series.values() if s["steps"]):
        run = pd.Series(s["values"], dtype=float).rolling(window, min_periods=1).mean()
        ys.append(np.interp(grid, s["steps"], run, left=np.nan, right=np.nan))
    if not ys:
        return 0
    with warnings.catch_warnings():  # grid points before any seed's first episode
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
    ax.plot(grid, mean, lw=1.2, color=colour, label=f"{label} ({len(ys)} seed{'s' * (len(ys) > 1)})")
    ax.fill_between(grid, mean - std, mean + std, color=colour, alpha=0.15)
    return len(ys)


CURVES = {  # a curve of a `curves` figure: (the row's key, y label, window)
    "train": ("train_series", "training return (running mean of {n} episodes)", None),
    "entropy": ("entropy_series", "policy entropy (per update)", 1),
}


def curves_figure(rows: list[dict], f: dict, path: str) -> str:
    """A figure of `curves` (registry [figures]): a panel per curve (three to a line), a line per setting with the
    seeds stored, and "no seed stored yet" on a panel with none. A curve `diagnostics/NAME` draws the scalar the
    script logged under that tag at every update (`diagnostics_series`)."""
    import matplotlib.pyplot as plt

    mine = {s: find_or_none({"rows": rows}, f["script"], f["env"], f["steps"], s) for s in f["settings"]}
    cols = min(3, len(f["curves"]))
    lines = -(-len(f["curves"]) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(5.5 * cols, 4.2 * lines), squeeze=False)
    for ax in axes.flat[len(f["curves"]) :]:
        ax.set_visible(False)
    for ax, curve in zip(axes.flat, f["curves"]):
        diagnostic = curve.removeprefix("diagnostics/") if curve.startswith("diagnostics/") else None
        key, ylabel, window = ("diagnostics_series", "per update, log scale", 1) if diagnostic else CURVES[curve]
        pick = (lambda r: (r.get(key) or {}).get(diagnostic) or {}) if diagnostic else (lambda r: r.get(key) or {})
        n = next((r.get("train_last_n", TRAIN_LAST_N) for r in mine.values() if r), TRAIN_LAST_N)
        drawn = sum(
            band(ax, pick(r), f["steps"], window or n, f"C{i % 10}", setting)
            for i, (setting, r) in enumerate(mine.items())
            if r
        )
        if not drawn:
            ax.text(0.5, 0.5, "no seed stored yet", ha="center", va="center", transform=ax.transAxes)
        title = diagnostic if diagnostic else f"{f['env']}, {f['steps']:,} steps"
        ax.set(xlabel="environment steps", xlim=(0, f["steps"]), title=title)
        ax.set_ylabel(ylabel.format(n=n), fontsize=8)
        if diagnostic and drawn:  # (norms and scales of the arms differ by orders of magnitude)
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return path


def curve_refs(rows: list[dict]) -> list[dict]:
    """The published numbers of `rows` that a panel of training curves draws: those that measure training (a learning
    curve, or its last episodes), each once; an evaluation of a trained agent is another metric and is left out."""
    return list({(x["value"], x["source"]): x for r in rows for x in r["refs"] if x.get("kind") == "training"}.values())


def plot(rows: list[dict], plots_dir: str, points: int = 200) -> list[str]:
    """One PNG per figure of the registry (a script's settings, or its rows that no other figure takes), a panel
    per (env, steps): per setting the running mean of the row's window over each seed's episodes, mean over
    seeds with a ±std band, and the published numbers that measure the same (a training curve) as lines. Evaluation
    rows draw their training return; a figure of `curves` draws those (`curves_figure`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, f in REGISTRY["figures"].items():
        if "curves" in f:
            os.makedirs(plots_dir, exist_ok=True)
            written.append(curves_figure(rows, f, os.path.join(plots_dir, f"{name}.png")))
    figures = {name: (f["script"], f.get("settings")) for name, f in REGISTRY["figures"].items() if "curves" not in f}
    train = lambda r: dict(r, series=r["train_series"], last_n=r.get("train_last_n", TRAIN_LAST_N))  # noqa: E731
    rows = [train(r) if r.get("train_series") else r for r in rows if r.get("train_series") or r["tag"][:5] != "eval/"]
    taken = {(script, s) for script, settings in figures.values() for s in settings or ()}
    for name, (script, settings) in figures.items():
        mine = [
            r
            for r in rows
            if r["script"] == script and (r["setting"] in settings if settings else (script, r["setting"]) not in taken)
        ]
        if not mine:
            continue
        panels = sorted({(r["env"], r["steps"]) for r in mine})
        colour = {s: f"C{i % 10}" for i, s in enumerate(sorted({r["setting"] for r in mine}))}
        cols, lines = min(3, len(panels)), -(-len(panels) // 3)
        fig, axes = plt.subplots(lines, cols, figsize=(5.5 * cols, 4.2 * lines), squeeze=False)
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        for ax, (env, steps) in zip(axes.flat, panels):
            here = [r for r in mine if (r["env"], r["steps"]) == (env, steps)]
            for r in here:
                band(ax, r["series"], r["steps"], r["last_n"], colour[r["setting"]], r["setting"], points)
            for i, x in enumerate(curve_refs(here)):
                ax.axhline(x["value"], color="k", ls=["--", ":", "-."][i % 3], lw=0.8, label=ref_text(x, where=False))
            ylabel = "training return" if here[0].get("train_series") else here[0]["y_label"]
            ax.set(xlabel=here[0]["x_label"], title=f"{env}, {steps:,} steps")
            ax.set_ylabel(f"{ylabel} (running mean of {here[0]['last_n']} episodes)", fontsize=8)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # a panel whose rows have no episode yet draws no legend
                ax.legend(fontsize=6, loc="best")
        fig.tight_layout()
        os.makedirs(plots_dir, exist_ok=True)
        written.append(os.path.join(plots_dir, f"{name}.png"))
        fig.savefig(written[-1], dpi=80, metadata={"Software": None})
        plt.close(fig)
    return written
