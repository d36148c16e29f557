"""Reader of the benchmark harness: TensorBoard event files of finished runs -> per-seed episode series
-> the numbers of a results row (per-seed final values, mean +- population std across seeds).

Used by run.py (collect step) and bench_store.py (which re-derives every row's numbers from the series
it stores). No registry here: everything a row needs comes from the runs' `done.json` markers.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
from typing import Optional

MARKER = "done.json"
TRAIN_TAG = "charts/episodic_return"


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


def fraction_mean(series: list[tuple[int, float]], steps: int, fraction: float, last: bool = True) -> float:
    """Mean of the values logged in the last (or first) `fraction` of the step budget: step >= (1 - f) * steps
    (or step < f * steps); nan when no episode ended there. ICPI's metric: the last quarter of the real steps."""
    if last:
        vals = [v for s, v in series if s >= (1 - fraction) * steps]
    else:
        vals = [v for s, v in series if s < fraction * steps]
    return sum(vals) / len(vals) if vals else float("nan")


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and POPULATION std (ddof=0, numpy's np.std) across seeds, ignoring nan seeds."""
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), statistics.pstdev(xs)


def aggregate(run_dirs: dict[int, str], tag: str = "charts/episodic_return", last_n: int = 100,
              wall_seconds: Optional[dict[int, float]] = None) -> dict:
    """Per seed: mean of the last `last_n` episodes of `tag`, final SPS, last step, wall time, the episode
    series [(step, value)]; across seeds: mean and population std of the per-seed means, mean SPS, wall."""
    per_seed = {}
    for seed, rd in sorted(run_dirs.items()):
        events = read_scalars(rd, tag)
        values = [v for _, v, _ in events]
        sps = read_scalars(rd, "charts/SPS")
        timed = events or sps
        if wall_seconds and seed in wall_seconds:
            wall = wall_seconds[seed]
        elif timed:
            wall = timed[-1][2] - timed[0][2]
        else:
            wall = float("nan")
        per_seed[seed] = {
            "final": final_mean(values, last_n), "episodes": len(values),
            "sps": sps[-1][1] if sps else float("nan"),
            "last_step": max([e[0] for e in timed], default=0), "wall_seconds": wall,
            "series": [(int(s), float(v)) for s, v, _ in events],
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


def running_mean(series: list[tuple[int, float]], window: int) -> tuple[list[int], list[float]]:
    """(steps, running mean of the last `window` episodes): the table's metric as a curve."""
    steps, means, tail, total = [], [], [], 0.0
    for step, value in series:
        tail.append(value)
        total += value
        if len(tail) > window:
            total -= tail.pop(0)
        steps.append(step)
        means.append(total / len(tail))
    return steps, means


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


def make_rows(groups: dict, selected_keys: Optional[set]) -> list[dict]:
    """One store row per (script, env, setting, steps) group of complete runs (see bench_store.py)."""
    rows = []
    for key, seeds in groups.items():
        if selected_keys is not None and key not in selected_keys:
            continue
        m0 = next(iter(seeds.values()))[1]
        agg = aggregate({seed: d for seed, (d, _) in seeds.items()}, m0["tag"], m0["last_n"],
                        {seed: m["wall_seconds"] for seed, (_, m) in seeds.items()})
        commands = sorted({re.sub(r"(--seed) \d+", r"\1 {seed}", m["command"]) for _, m in seeds.values()})
        # a deterministic evaluation (eval/...) is one batch of episodes after training: keep the run's training
        # return beside it, so the row has a learning curve and a training-return number too
        train = ({str(seed): [(int(st), float(v)) for st, v, _ in read_scalars(d, TRAIN_TAG)]
                  for seed, (d, _) in seeds.items()} if m0["tag"].startswith("eval/") else {})
        # seconds per update where the script logs them (time/rollout_seconds, time/update_seconds): [rollout, update]
        # per seed, each the mean over the run's updates
        timing = {}
        for seed, (d, _) in seeds.items():
            ro, up = read_scalars(d, "time/rollout_seconds"), read_scalars(d, "time/update_seconds")
            if ro and up:
                timing[str(seed)] = [round(statistics.fmean(v for _, v, _ in ro), 3),
                                     round(statistics.fmean(v for _, v, _ in up), 3)]
        # ICPI: answers replayed from the completion cache as an earlier attempt of the run recorded them (a run
        # resumed after it was stopped): they took no model time, so the wall time covers only the rest. A run
        # that logged no count at all (older code) is left out: unknown, not zero
        replayed = {str(seed): int(sum(v for _, v, _ in points)) for seed, (d, _) in seeds.items()
                    if (points := read_scalars(d, "model/replayed"))}
        rows.append({
            "script": key[0], "env": key[1], "setting": key[2], "steps": key[3], "seeds": sorted(seeds),
            "flags": m0.get("flags", []), "tag": m0["tag"], "last_n": m0["last_n"],
            "last_fraction": m0.get("last_fraction"), "x_label": m0.get("x_label", "environment steps"),
            "y_label": m0.get("y_label", m0["tag"]), "refs": m0["refs"],
            "source": "harness",
            "series": {str(s): p["series"] for s, p in agg["per_seed"].items()},
            "per_seed": {str(s): p["final"] for s, p in agg["per_seed"].items()},
            "episodes": {str(s): p["episodes"] for s, p in agg["per_seed"].items()},
            "mean": agg["mean"], "std": agg["std"],
            "sps": agg["sps"], "wall_seconds": agg["wall_seconds"],
            # per seed too, so that a later collect merging seeds (bench_store.merge_stored) can average exactly
            "seed_sps": {str(s): p["sps"] for s, p in agg["per_seed"].items()},
            "seed_wall_seconds": {str(s): p["wall_seconds"] for s, p in agg["per_seed"].items()},
            "machine": m0["machine"], "versions": m0["versions"],
            "nice": " / ".join(dict.fromkeys(str(m["nice"]) for _, m in seeds.values())),  # each run's niceness
            "harness_command": " / ".join(sorted({m["harness_command"] for _, m in seeds.values()})),
            "run_commands": commands,
            "code": code_texts([m.get("code") for _, m in seeds.values()], key[0]),
            "finished": max(m["finished"] for _, m in seeds.values()),
            "load": [m["load_at_end"] for _, m in seeds.values() if "load_at_end" in m],
            **({"train_series": train} if any(train.values()) else {}),
            **({"train_last_n": m0["train_last_n"]} if m0.get("train_last_n") else {}),
            **({"seconds_per_update": timing} if timing else {}),
            **({"seed_replayed": replayed} if replayed else {}),
        })
    return rows
