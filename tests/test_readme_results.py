"""The README and the docs pages say exactly what the results store (benchmark/results/) holds.

Results tables (a Markdown table with a `setting` column): each row names its stored setting in a code span
and its step budget (a `steps` column, or a column header `<env> (<steps>)`), and its env (an `env` column, an
env column header, or the setting and steps alone when they name one row). Each value cell must equal that
stored row, rounded to the digits written:
  `mean ± std`, a return or regret column, an env column   the row's mean ± population std
  a header with `evaluation` / `training return`           that metric (the main one or the matching extra)
  a header with `first quarter`                            first-quarter mean ± std
  a header with `seconds per update`                        that stored extra (mean ± std over seeds)
  a header with `per seed`                                  the per-seed values, in the order of the row's seeds
  `seeds`                                                   the row's seeds; `machine`: its CPU/GPU kinds
  `published`                                               `x ± y` must be one of the row's references
A code span with flags (`--llm-init random`) must be part of the row's flags. Any other decimal number in a
results row is an error. A row without a setting is a reference row: it starts with `published` or `paper`,
and its `x ± y` must be a stored reference. Other tables (speed, throughput): every decimal number is a value
of the store (of the env a header or first cell names), and a `mean ± std` there is an error.

Prose: a sentence that names a stored setting in a code span may only quote decimal numbers of that setting's
rows (of the envs the sentence names, if it names any); a prose sentence with `x ± y`, and any prose sentence
with a decimal number under a `Results` heading, must name a stored setting or be about `published` numbers.

The five corruptions of the issue are this checker's own tests (each applied to the real text in memory).
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import bench_speed  # noqa: E402
import bench_store  # noqa: E402

DOCS = ["README.md", "docs/ppo_cartpole.md", "docs/trpo_gpt2_halfcheetah.md", "docs/gpt2ppo_lunar.md",
        "docs/icpi_chain.md", "docs/benchmark.md"]
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\d.])")
PAIR = re.compile(r"(-?\d+(?:\.\d+)?)\s*±\s*(\d+(?:\.\d+)?)")
SPAN = re.compile(r"`([^`]*)`")


@functools.lru_cache(maxsize=None)
def store(results_dir: str = os.path.join(ROOT, "benchmark", "results")) -> dict:
    return bench_store.load(results_dir)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


# ----------------------------------------------------------------------------------------------- parsing


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[list[str]]:
    """Every Markdown table of `text`, as its list of lines (header, |---|, rows)."""
    out, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    return out


def matches(written: str, value) -> bool:
    """`written` (as printed) is `value` rounded to the digits written ("0.00" also matches -0.001)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return False
    digits = len(written.split(".")[1]) if "." in written else 0
    shown = f"{value:.{digits}f}"
    return shown == written or (float(written) == 0 and shown.lstrip("-") == written.lstrip("-"))


def steps_of(text: str) -> "int | None":
    text = text.replace(",", "").strip().strip("*")
    return int(text) if re.fullmatch(r"\d+", text) else None


def vendors(machine: str) -> set[str]:
    """The kinds of machine a stored `machine` string names (merged rows name several, joined by ' / ')."""
    out = set()
    for part in machine.split(" / "):
        out.add("H100" if "H100" in part else "AMD EPYC" if "AMD EPYC" in part else
                "Intel Xeon" if "Xeon" in part else part.strip())
    return out


# ----------------------------------------------------------------------------------------------- store views


def rows_by_key() -> dict[tuple[str, str, int], dict]:
    return {(r["setting"], r["env"], r["steps"]): r for r in store()["rows"]}


def settings() -> set[str]:
    return {r["setting"] for r in store()["rows"]}


def envs() -> set[str]:
    return {r["env"] for r in store()["rows"]}


def metric(row: dict, header: str) -> "tuple[dict, float, float] | None":
    """(per-seed values, mean, std) of the metric a column header asks for; None if the row has none."""
    h = header.lower()
    main = (row["per_seed"], row["mean"], row["std"])
    extra = lambda prefix: next(((e["per_seed"], e["mean"], e["std"]) for k, e in row.get("extra", {}).items()  # noqa: E731
                                 if k.startswith(prefix)), None)
    if "first quarter" in h:
        return (None, row.get("first_mean"), row.get("first_std")) if "first_mean" in row else None
    if "seconds per update" in h:
        return extra("seconds per update")
    if "training return" in h:
        return main if row["tag"] == "charts/episodic_return" else extra("training return")
    if "evaluation" in h:
        return main if row["tag"].startswith("eval/") else extra("deterministic evaluation")
    return main


def row_numbers(rows: list[dict]) -> list[float]:
    """Every number a sentence may quote from these rows: means, stds, per-seed values, extras, first quarter."""
    out = []
    for r in rows:
        out += [r["mean"], r["std"], *r["per_seed"].values(), r.get("first_mean"), r.get("first_std")]
        for e in r.get("extra", {}).values():
            out += [e["mean"], e["std"], *e["per_seed"].values()]
    return [v for v in out if isinstance(v, (int, float)) and math.isfinite(v)]


def ref_pairs(rows: list[dict]) -> list[tuple[float, "float | None"]]:
    return [(ref["value"], ref.get("std")) for r in rows for ref in r.get("refs", [])]


def loose_numbers(env: "str | None") -> list[float]:
    """Every number of the store outside the episode series (of one env's rows, throughput and speed entries)."""
    def nums(x, skip=("series", "train_series")):
        if isinstance(x, bool):
            return []
        if isinstance(x, (int, float)):
            return [float(x)] if math.isfinite(x) else []
        if isinstance(x, dict):
            return [v for k, val in x.items() if k not in skip for v in nums(val)]
        if isinstance(x, (list, tuple)):
            return [v for val in x for v in nums(val)]
        return []
    data = store()
    values = nums([r for r in data["rows"] if env in (None, r["env"])])
    values += nums([t for t in data["throughput"] if env in (None, t["env"])])
    for entry in data["speed"] + bench_speed.gpu_entries():
        if env is None or (isinstance(entry["data"], dict) and entry["data"].get("env_id") == env):
            values += nums(entry["data"]) + nums(bench_speed.summary(entry))
    return values


def env_in(cell: str) -> "str | None":
    """The env a header or first cell begins with (`chain (85)` -> chain; `distractor-chain` is not chain)."""
    first = re.split(r"[\s,(]", cell.strip().strip("*`"), maxsplit=1)[0]
    return first if first in envs() else None


# ----------------------------------------------------------------------------------------------- tables


def check_pair(cell: str, per_seed, mean, std, what: str) -> list[str]:
    pairs = PAIR.findall(cell.replace("**", ""))
    if len(pairs) != 1:
        return [f"{what}: expected one 'mean ± std' in {cell!r}"]
    m, s = pairs[0]
    if not (matches(m, mean) and matches(s, std)):
        return [f"{what}: {m} ± {s} is not the stored {mean:.4f} ± {std:.4f}"]
    rest = NUMBER.findall(PAIR.sub("", SPAN.sub("", cell)))
    return [f"{what}: unchecked number {n} in {cell!r}" for n in rest]


def check_results_table(table: list[str]) -> tuple[list[str], int]:
    """Problems of one results table, and how many cells were checked against the store."""
    header = cells(table[0])
    low = [h.lower() for h in header]
    by_key, problems, checked = rows_by_key(), [], 0
    col = lambda name: low.index(name) if name in low else None  # noqa: E731
    i_setting, i_steps, i_env = col("setting"), col("steps"), col("env")
    for line in table[2:]:
        row = cells(line) + [""] * max(0, len(header) - len(cells(line)))
        named = [x for x in SPAN.findall(row[i_setting]) if x in settings()]
        if not named:  # a reference row
            label = re.sub(r"[*`]", "", " ".join(row[:max(1, i_setting + 1)])).strip().lower()
            if not label.startswith(("published", "paper")):
                problems.append(f"row names no stored setting and is not a published reference: {line}")
                continue
            refs = ref_pairs(store()["rows"])
            for m, s in PAIR.findall(line):
                if not any(matches(m, v) and sd is not None and matches(s, sd) for v, sd in refs):
                    problems.append(f"published {m} ± {s} is not a stored reference: {line}")
            continue
        setting = named[0]
        for j, (head, cell) in enumerate(zip(header, row)):
            if j in (i_setting, i_steps, i_env):
                continue
            head_env = env_in(head)
            m = re.search(r"\(([\d,]+)\)", head)
            env = head_env or (row[i_env].strip("`* ") if i_env is not None else None)
            steps = (steps_of(m.group(1)) if head_env and m else
                     steps_of(row[i_steps]) if i_steps is not None else None)
            what = f"`{setting}`" + (f" {env}" if env else "") + (f" {steps}" if steps else "")
            numbers_here = NUMBER.findall(SPAN.sub("", cell)) + PAIR.findall(cell)
            flagspans = [x for x in SPAN.findall(cell) if x.startswith("--")]
            if not numbers_here and not flagspans and low[j] not in ("seeds", "machine"):
                continue
            if steps is None and not numbers_here:  # a label with flags in a wide table: every row of the setting
                for r in [r for (s, e, st), r in by_key.items() if s == setting]:
                    for span in flagspans:
                        toks, fl = span.split(), r["flags"]
                        if not any(fl[k:k + len(toks)] == toks for k in range(len(fl))):
                            problems.append(f"{what}: flags {span!r} are not the stored flags {' '.join(fl)}")
                continue
            if steps is None:
                problems.append(f"{what}: no step budget named (a `steps` column or a header `env (steps)`): {line}")
                continue
            cands = [r for (s, e, st), r in by_key.items() if s == setting and st == steps and env in (None, e)]
            if len(cands) != 1:
                problems.append(f"{what}: {len(cands)} stored rows match (name the env): {line}")
                continue
            r = cands[0]
            for span in flagspans:  # flags written in the row must be the stored row's flags
                toks, fl = span.split(), r["flags"]
                if not any(fl[k:k + len(toks)] == toks for k in range(len(fl))):
                    problems.append(f"{what}: flags {span!r} are not the stored flags {' '.join(fl)}")
            h = low[j]
            if h == "seeds":
                if [int(x) for x in re.findall(r"\d+", cell)] != list(r["seeds"]):
                    problems.append(f"{what}: seeds {cell!r} are not the stored {r['seeds']}")
                checked += 1
            elif h == "machine":
                said = {x.strip() for x in re.split(r"\+|/|;", cell.replace("*", "")) if x.strip()}
                if said != vendors(r["machine"]):
                    problems.append(f"{what}: machine {cell!r} is not the stored {sorted(vendors(r['machine']))}")
                checked += 1
            elif "published" in h:
                for m_, s_ in PAIR.findall(cell):
                    if not any(matches(m_, v) and sd is not None and matches(s_, sd) for v, sd in ref_pairs([r])):
                        problems.append(f"{what}: {m_} ± {s_} is not a reference of this row: {line}")
                checked += 1
            elif "per seed" in h:
                got = metric(r, head)
                want = [got[0][str(s)] for s in r["seeds"]] if got and got[0] else None
                written = NUMBER.findall(SPAN.sub("", cell)) or re.findall(r"-?\d+", cell)
                if want is None or len(written) != len(want) or not all(map(matches, written, want)):
                    problems.append(f"{what}: per-seed {cell!r} are not the stored "
                                    f"{[round(v, 4) for v in want] if want else None}")
                checked += 1
            elif numbers_here:
                got = metric(r, head)
                if got is None:
                    problems.append(f"{what}: the store has no {head!r} for this row")
                else:
                    problems += check_pair(cell, *got, what)
                checked += 1
    return problems, checked


def check_other_table(table: list[str]) -> list[str]:
    """Speed and throughput tables: every decimal number is a value of the store (of the env named)."""
    header, problems, pools = cells(table[0]), [], {}
    for line in table[2:]:
        row = cells(line)
        if PAIR.search(SPAN.sub("", line)) and not re.sub(r"[*`]", "", row[0]).lower().startswith(("published", "paper")):
            problems.append(f"a mean ± std in a table without a `setting` column: {line}")
        for j, cell in enumerate(row):
            env = env_in(header[j] if j < len(header) else "") or env_in(row[0])
            for n in NUMBER.findall(SPAN.sub("", cell)):
                if env not in pools:
                    pools[env] = loose_numbers(env)
                if not any(matches(n, v) for v in pools[env]):
                    problems.append(f"{n} is not in the store{f' (env {env})' if env else ''}: {line}")
    return problems


# ----------------------------------------------------------------------------------------------- prose


def paragraphs(text: str) -> list[tuple[str, str]]:
    """(heading, paragraph) for the prose of a Markdown text: code blocks, tables, headings and images left out;
    each list item is its own paragraph."""
    out, cur, heading, fence = [], [], "", False
    def flush():
        if cur:
            out.append((heading, " ".join(cur)))
            cur.clear()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            flush()
            continue
        if fence or line.startswith(("    ", "\t", "|", "![")) or not line.strip():
            flush()
            continue
        if line.startswith("#"):
            flush()
            heading = line
            continue
        if re.match(r"\s*([*-]|\d+\.)\s", line):
            flush()
        cur.append(line.strip())
    flush()
    return out


def sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?:;])\s+(?=[A-Z(*`])", paragraph) if s.strip()]


def check_prose(text: str) -> tuple[list[str], int]:
    problems, checked = [], 0
    rows = store()["rows"]
    for heading, para in paragraphs(text):
        for sent in sentences(para):
            named = {x for x in SPAN.findall(sent) if x in settings()}
            plain = SPAN.sub("", sent)
            numbers = NUMBER.findall(plain)
            if named:
                said_envs = {e for e in envs() if re.search(rf"(?<![\w-]){re.escape(e)}(?![\w-])", plain)}
                pool = row_numbers([r for r in rows if r["setting"] in named and
                                    (not said_envs or r["env"] in said_envs)])
                for n in numbers:
                    checked += 1
                    if not any(matches(n, v) for v in pool):
                        problems.append(f"{n} is not a number of {sorted(named)}"
                                        f"{f' on {sorted(said_envs)}' if said_envs else ''}: {sent}")
            elif (PAIR.search(plain) or (numbers and "result" in heading.lower())) and not re.search(
                    r"published|paper", plain, re.I):
                problems.append(f"a result sentence that names no stored setting: {sent}")
    return problems, checked


def check_text(text: str) -> tuple[list[str], int]:
    """All problems of one README/docs text against the store, and the number of checked values."""
    problems, checked = [], 0
    for table in tables(text):
        if "setting" in [h.lower() for h in cells(table[0])]:
            p, c = check_results_table(table)
            problems, checked = problems + p, checked + c
        else:
            problems += check_other_table(table)
    p, c = check_prose(text)
    return problems + p, checked + c


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", DOCS)
def test_the_docs_say_what_the_store_holds(path):
    problems, checked = check_text(read(path))
    assert not problems, f"{path} disagrees with benchmark/results/:\n" + "\n".join(problems)
    if path != "docs/benchmark.md":
        assert checked >= 4, f"{path}: only {checked} values checked against the store (no results table found?)"


def test_every_page_has_its_sections_and_no_history():
    for path in DOCS[1:5]:
        text = read(path)
        heads = [h.lower() for h in re.findall(r"^## (.+)$", text, re.M)]
        order = ["what it implements", "usage", "logged metrics", "implementation details", "results", "limitations"]
        assert [h for h in heads if h in order] == order, f"{path}: sections {heads}"
    for path in DOCS:
        text = read(path)
        assert not re.search(r"\bissue \d+|#\d+\b|\b[0-9a-f]{7,40}\b(?<!\d{7})", text, re.I), path
    assert len(read("README.md").splitlines()) <= 250


def test_links_and_images_point_at_files_that_exist():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", read(path)):
            if "://" in target:
                continue
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target))
            assert os.path.exists(full), f"{path} links to {target}, which does not exist"


def swap_cells(text: str, a: str, b: str, column: int) -> str:
    """Swap cell `column` between the table rows that name setting `a` and setting `b` (same table)."""
    lines = text.splitlines()
    ia = next(i for i, l in enumerate(lines) if l.startswith("|") and f"`{a}`" in l)
    ib = next(i for i, l in enumerate(lines) if l.startswith("|") and f"`{b}`" in l and i != ia)
    ca, cb = lines[ia].split("|"), lines[ib].split("|")
    ca[column + 1], cb[column + 1] = cb[column + 1], ca[column + 1]
    lines[ia], lines[ib] = "|".join(ca), "|".join(cb)
    return "\n".join(lines)


def value_column(text: str, setting: str, header_part: str) -> int:
    """The index of the first column whose header contains `header_part`, in the table naming `setting`."""
    for table in tables(text):
        if any(f"`{setting}`" in l for l in table):
            return next(j for j, h in enumerate(cells(table[0])) if header_part in h)
    raise AssertionError(f"no table names {setting}")


def put_in_row(text: str, setting: str, steps: str, old: str, new: str) -> str:
    """Replace `old` by `new` in the (first) table row that names `setting` and `steps`."""
    lines = text.splitlines()
    i = next(i for i, l in enumerate(lines) if l.startswith("|") and f"`{setting}`" in l and f"| {steps} |" in l)
    assert old in lines[i], (old, lines[i])
    lines[i] = lines[i].replace(old, new, 1)
    return "\n".join(lines)


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def stored(setting: str, env: str, steps: int) -> dict:
    return rows_by_key()[setting, env, steps]


def corrupt_swap_cells():
    """Two cells swapped between rows: the mean ± std of PPO and of GPT2PPO."""
    path = "docs/gpt2ppo_lunar.md"
    text = read(path)
    return path, swap_cells(text, "mlp", "gpt2-stride64", value_column(text, "mlp", "mean ± std"))


def corrupt_pretrained_random():
    """Pretrained and random swapped: the two SmolLM2 settings trade rows."""
    path = "docs/trpo_gpt2_halfcheetah.md"
    a, b = "i12-smollm2-2blocks-pretrained-150k-eval", "i12-smollm2-2blocks-random-150k-eval"
    return path, read(path).replace(f"`{a}`", "@@").replace(f"`{b}`", f"`{a}`").replace("@@", f"`{b}`")


def corrupt_1m_in_307k():
    """A 1M-step number put in the 307k row."""
    path = "docs/gpt2ppo_lunar.md"
    short, long = stored("mlp", "LunarLander-v3", 307200), stored("mlp", "LunarLander-v3", 1000000)
    return path, put_in_row(read(path), "mlp", "307,200", fmt(short["mean"]), fmt(long["mean"]))


def corrupt_per_seed_for_mean():
    """A per-seed value in place of the mean (the README's TRPO headline)."""
    r = stored("pretraining-smollm2-2blocks-pretrained-eval", "HalfCheetah-v5", 1000000)
    return "README.md", read("README.md").replace(fmt(r["mean"]), fmt(r["per_seed"]["3"]), 1)


def corrupt_prose_number():
    """A changed number in a prose sentence that names its setting."""
    path = "docs/gpt2ppo_lunar.md"
    r = stored("gpt2-stride64-dropout0.1", "LunarLander-v3", 307200)
    lines = read(path).splitlines()
    i = next(i for i, l in enumerate(lines) if not l.startswith("|") and fmt(r["mean"]) in l)
    lines[i] = lines[i].replace(fmt(r["mean"]), fmt(r["mean"] + 10))
    return path, "\n".join(lines)


@pytest.mark.parametrize("corrupt", [corrupt_swap_cells, corrupt_pretrained_random, corrupt_1m_in_307k,
                                     corrupt_per_seed_for_mean, corrupt_prose_number])
def test_each_corruption_of_the_issue_is_caught(corrupt):
    path, text = corrupt()
    assert text != read(path), "the corruption changed nothing"
    problems, _ = check_text(text)
    assert problems, f"{corrupt.__name__}: the checker accepted the corrupted {path}"


def test_the_checker_reads_tables_and_prose_as_documented():
    r = stored("mlp-eval", "HalfCheetah-v5", 1000000)
    good = ("| policy | setting | env | steps | evaluation, mean ± std | evaluation per seed | seeds | machine |\n"
            "|---|---|---|---|---|---|---|---|\n"
            f"| `--policy mlp` | `mlp-eval` | HalfCheetah-v5 | 1,000,000 | {fmt(r['mean'])} ± {fmt(r['std'])} | "
            + ", ".join(fmt(r["per_seed"][str(s)]) for s in r["seeds"]) + " | 1, 2, 3 | Intel Xeon |\n"
            "| published: SB3-contrib | | | | 1803 ± 46 | | | |\n\n"
            f"The MLP (`mlp-eval`) reaches {fmt(r['mean'])} in evaluation.\n")
    assert check_text(good) == ([], 5)
    bad = {"wrong machine": good.replace("Intel Xeon", "AMD EPYC"),
           "wrong seeds": good.replace("| 1, 2, 3 |", "| 1, 2, 543 |"),
           "foreign flag": good.replace("`--policy mlp`", "`--policy gpt2`"),
           "no steps": good.replace("| 1,000,000 |", "| |"),
           "no env where two stored rows share setting and steps": good.replace("| HalfCheetah-v5 |", "| |"),
           "wrong reference": good.replace("1803 ± 46", "1803 ± 45"),
           "unnamed result": good + "\nIt reached 2533.11 ± 337.40 here.\n",
           "extra number": good.replace(" in evaluation.", " in evaluation (2600.1)."),
           "row without setting": good.replace("| published: SB3-contrib |", "| SB3-contrib |"),
           "table without setting": good.replace("| policy | setting |", "| policy | run |")}
    for what, text in bad.items():
        assert check_text(text)[0], what
    # a speed table: any number of the store (of the env named), nothing else
    assert check_other_table(["| a | b |", "|---|---|", "| x | 123456.789 |"])
