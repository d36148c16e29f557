"""The results store of the benchmark harness: one JSON file per result, under benchmark/results/.

    results/<script>/<env>__<setting>__<steps>.json   one learning row: a registry setting's seeds
    results/throughput/<script>__<env>__<tag>.json    one --mode throughput measurement (ours vs the peer)
    results/speed/<name>.json                         one --mode speed measurement (a SPEED registry entry)

A file is replaced when the same key is measured again, and never touches another file, so results
from different branches merge as separate files. `--mode report` renders results.md and the plots from
these files alone. A learning row keeps every seed's episode series ([step, value] per finished episode)
where it exists, and its numbers (per-seed finals, mean, population std) are re-derived from the series
on every load, so the table cannot disagree with the data under it. A row with "source": "imported"
was made before the harness held it (its "imported" entry says by which command and from which file);
rows without a series (their event files were lost) keep their per-seed finals, and their mean and std
are re-derived from those.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics

import bench_reader as reader

KINDS = ("rows", "throughput", "speed")
TRAIN_LAST_N = 30
"""an evaluation row's training-return number: the mean of the last 30 training episodes (TRPO: 10 envs x 1000-step
episodes, so the last two 15000-step updates), unless the row says otherwise (`train_last_n`)"""


def slug(text: str) -> str:
    """A file-name-safe version of `text` (letters, digits, '.', '-', '_'; the rest becomes '_')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "_"


def row_path(results_dir: str, row: dict) -> str:
    return os.path.join(results_dir, slug(row["script"]),
                        f"{slug(row['env'])}__{slug(row['setting'])}__{row['steps']}.json")


def throughput_path(results_dir: str, t: dict) -> str:
    tag = slug(" ".join(t["flags"]) or "defaults") + f"__{t['steps']}"
    if t.get("peer_label"):
        tag += "__" + ("peer1thread" if str(t.get("peer_threads", "")).startswith("1") else "peerdefault")
    if t.get("machine"):  # one entry per CPU model: a ratio measured on one does not replace another's
        tag += "__" + slug(t["machine"].split("(")[0].split(",")[0].strip())
    return os.path.join(results_dir, "throughput", f"{slug(t['script'])}__{slug(t['env'])}__{tag}.json")


def speed_path(results_dir: str, entry: dict) -> str:
    return os.path.join(results_dir, "speed", f"{slug(entry['name'])}.json")


def _clean(x):
    """JSON has no nan: store it as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def dump(obj: dict, path: str) -> None:
    """One top-level key per line, each value as compact JSON (long series stay on one line: small diffs,
    readable keys)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    obj = _clean(obj)
    lines = [f" {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in obj.items()]
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


def _nan(x):
    return float("nan") if x is None else x


def compact_series(series: dict) -> dict:
    """{seed: [(step, value), ...]} -> {seed: {"steps": [...], "values": [...]}} with values rounded to 4 decimals."""
    return {str(s): {"steps": [int(a) for a, _ in pts], "values": [round(float(b), 4) for _, b in pts]}
            for s, pts in series.items()}


def write_row(results_dir: str, row: dict) -> str:
    path = row_path(results_dir, row)
    dump(derive(row), path)
    return path


def write_throughput(results_dir: str, t: dict) -> str:
    path = throughput_path(results_dir, t)
    dump(t, path)
    return path


def write_speed(results_dir: str, entry: dict) -> str:
    path = speed_path(results_dir, entry)
    dump(entry, path)
    return path


def derive(row: dict) -> dict:
    """The row with its numbers re-derived: per seed the final value from its episode series (mean of the
    last `last_n` episodes, or of the episodes in the last `last_fraction` of the steps), then mean and
    population std across seeds. Rows without a series keep their per-seed finals."""
    row = dict(row)
    series = row.get("series") or {}
    if series and isinstance(next(iter(series.values())), list):  # fresh from the reader: [(step, value), ...]
        series = row["series"] = compact_series(series)
    if series:
        per_seed, episodes, first = {}, {}, {}
        for seed, s in series.items():
            pts = list(zip(s["steps"], s["values"]))
            if row.get("last_fraction"):
                per_seed[seed] = reader.fraction_mean(pts, row["steps"], row["last_fraction"])
                first[seed] = reader.fraction_mean(pts, row["steps"], row["last_fraction"], last=False)
            else:
                per_seed[seed] = reader.final_mean([v for _, v in pts], row["last_n"])
            episodes[seed] = len(pts)
        row["per_seed"], row["episodes"] = per_seed, episodes
        if first:
            row["first_mean"], row["first_std"] = reader.mean_std(list(first.values()))
    train = row.get("train_series") or {}
    if train and isinstance(next(iter(train.values())), list):
        train = row["train_series"] = compact_series(train)
    if train:  # an evaluation row's training return (see bench_reader.make_rows)
        n = row.setdefault("train_last_n", TRAIN_LAST_N)
        row.setdefault("extra", {})[f"training return, mean of the last {n} episodes"] = {
            "per_seed": {seed: reader.final_mean(s["values"], n) for seed, s in train.items()}}
    if row.get("seconds_per_update"):  # [rollout, update] seconds per seed (see bench_reader.make_rows)
        row.setdefault("extra", {})["seconds per update (rollout + update, mean over the run's updates)"] = {
            "per_seed": {seed: ru[0] + ru[1] for seed, ru in row["seconds_per_update"].items()}}
    per_seed = {k: _nan(v) for k, v in row.get("per_seed", {}).items()}
    row["mean"], row["std"] = reader.mean_std(list(per_seed.values()))
    for extra in row.get("extra", {}).values():  # e.g. a deterministic evaluation per seed
        extra["mean"], extra["std"] = reader.mean_std([_nan(v) for v in extra["per_seed"].values()])
    for key in ("sps", "wall_seconds"):
        row[key] = _nan(row.get(key))
    return row


def merge_stored(results_dir: str, row: dict, wanted_seeds, same_as=()) -> dict:
    """`row` (fresh from the reader) plus the seeds of the stored row with the same key that `row` lacks and the
    registry still wants, so that running a subset of a setting's seeds (`--seeds 2 3` after seed 1) adds to the
    stored row instead of replacing it. Only a row of the same measurement (same flags, tag and steps) with episode
    series is merged; anything else is replaced, as before. The provenance of both is kept (commands, code
    versions, loads); SPS and wall time become the mean over all the merged seeds (see below). `same_as`: earlier
    flag lists of the setting that the registry declares the same measurement (e.g. a default value later written
    out)."""
    path = row_path(results_dir, row)
    if not os.path.isfile(path):
        return row
    with open(path) as f:
        old = json.load(f)
    old_series = old.get("series") or {}
    keep = [s for s in old.get("seeds", []) if s in wanted_seeds and s not in row["seeds"] and str(s) in old_series]
    same_flags = old.get("flags") == row.get("flags") or old.get("flags") in [list(f) for f in same_as]
    if not keep or not same_flags or [old.get(k) for k in ("tag", "steps")] != [row.get(k) for k in ("tag", "steps")]:
        return row
    new = dict(row)
    new["seeds"] = sorted(set(row["seeds"]) | set(keep))
    for key in ("series", "train_series", "seconds_per_update"):
        fresh = new.get(key) or {}
        if key != "seconds_per_update" and fresh and isinstance(next(iter(fresh.values())), list):
            fresh = compact_series(fresh)
        kept = {str(s): old[key][str(s)] for s in keep if str(s) in (old.get(key) or {})}
        if fresh or kept:
            new[key] = dict(sorted({**kept, **fresh}.items(), key=lambda kv: int(kv[0])))
    for key in ("sps", "wall_seconds"):
        # per seed where the stored row says it (or has one seed): the mean over exactly the merged seeds. A row
        # stored without per-seed values whose mean also covers seeds this collect replaces gives nothing exact
        # for the kept seeds: the mean is then over the fresh seeds only (weighting the stored mean by the kept
        # seeds' count, as before, mixed the replaced seeds in).
        fresh_per_seed = {k: _nan(v) for k, v in (row.get(f"seed_{key}") or {}).items()}
        stored_per_seed = old.get(f"seed_{key}") or (
            {str(old["seeds"][0]): old.get(key)} if len(old["seeds"]) == 1 else {})
        kept_per_seed = {str(s): _nan(stored_per_seed[str(s)]) for s in keep if str(s) in stored_per_seed}
        if len(kept_per_seed) == len(keep) and len(fresh_per_seed) == len(row["seeds"]):
            merged = {**kept_per_seed, **fresh_per_seed}
            new[f"seed_{key}"] = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
            known = [v for v in merged.values() if v == v]
            new[key] = statistics.fmean(known) if known else float("nan")
        elif set(old["seeds"]) == set(keep):  # the stored mean is over exactly the kept seeds
            a, b = _nan(old.get(key)), _nan(row.get(key))
            new[key] = b if a != a else a if b != b else (a * len(keep) + b * len(row["seeds"])) / len(new["seeds"])
            new.pop(f"seed_{key}", None)
        else:
            new.pop(f"seed_{key}", None)
    replayed = {**{str(s): old["seed_replayed"][str(s)] for s in keep if str(s) in (old.get("seed_replayed") or {})},
                **(row.get("seed_replayed") or {})}
    new.pop("seed_replayed", None)
    if replayed:  # the seeds whose runs counted (zero included); a seed missing here is not known
        new["seed_replayed"] = dict(sorted(replayed.items(), key=lambda kv: int(kv[0])))
    new["merged_seeds"] = {"from the store": sorted(keep), "this collect": sorted(row["seeds"])}
    for key in ("harness_command", "machine", "versions"):
        parts = list(dict.fromkeys(p for v in (old.get(key, ""), row.get(key, "")) for p in v.split(" / ") if p))
        new[key] = " / ".join(parts)
    for key in ("run_commands", "code", "load"):
        new[key] = list(dict.fromkeys((old.get(key) or []) + (row.get(key) or [])))
    new["finished"] = max(old.get("finished", ""), row.get("finished", ""))
    new["nice"] = " / ".join(dict.fromkeys(p for v in (old.get("nice"), row.get("nice")) if v is not None
                                           for p in str(v).split(" / ")))
    return new


def load(results_dir: str) -> dict:
    """Everything in the store: {"rows": [...], "throughput": [...], "speed": [...]} (rows re-derived)."""
    data = {k: [] for k in KINDS}
    for path in sorted(glob.glob(os.path.join(results_dir, "**", "*.json"), recursive=True)):
        with open(path) as f:
            obj = json.load(f)
        rel = os.path.relpath(path, results_dir).split(os.sep)
        obj["_file"] = os.path.relpath(path, os.path.dirname(results_dir.rstrip(os.sep)) or ".")
        if rel[0] == "throughput":
            data["throughput"].append(obj)
        elif rel[0] == "speed":
            data["speed"].append(obj)
        else:
            data["rows"].append(derive(obj))
    return data
