"""Every number in the README's result tables is in the results store (benchmark/results/ and the GPU raw
outputs of benchmark/gpu/), so the README and the harness cannot drift apart.

Checked: every decimal number (e.g. 220.8, -0.037, 2.07 in 2.07x) in every Markdown table of README.md except
the flag tables (first header cell `flag`), outside `code spans`. A README number with d decimals matches a
value of the store rounded to d decimals: a row's mean, std, per-seed values, first-quarter mean, extra columns,
its references; a throughput entry; a speed entry's raw data and the medians and ratios derived from it. The
episode series are left out on purpose: thousands of returns would match almost anything.

Stricter where a table row names a store setting in a code span (e.g. `mlp-eval`): its numbers must then be
values of that setting's rows, not of any row, so a number copied from the neighbouring row is caught. Stricter
where a column header or a row's first cell begins with an env id of the store (`chain (85)`, `LunarLander-v3,
307k steps`): a number must then come from that env's rows, throughput or speed entries, so a number copied
from the neighbouring column is caught."""

import importlib.util
import math
import os
import re
import sys

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("bench_run", os.path.join(ROOT, "benchmark", "run.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_run"] = bench
_spec.loader.exec_module(bench)

NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\d.])")


def result_tables(text: str) -> list[list[str]]:
    """The Markdown tables of `text` (lists of their row lines), flag tables left out."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
            continue
        if current:
            first = current[0].strip("|").split("|")[0].strip().strip("`").lower()
            if first != "flag":
                tables.append(current)
            current = []
    return tables


def cells(line: str) -> list[str]:
    """The cells of a Markdown table line, stripped."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_cells(text: str) -> list[tuple[str, str, str, str]]:
    """(number as written, its table line, its column's header cell, the row's first cell) for every decimal
    number in the result tables, code spans removed."""
    out = []
    for table in result_tables(text):
        header = cells(table[0])
        for line in table[2:]:  # after the header and the |---| line
            row = cells(line)
            for j, cell in enumerate(row):
                plain = re.sub(r"`[^`]*`", "", cell)
                head = header[j] if j < len(header) else ""
                out += [(m.group(0), line, head, row[0]) for m in NUMBER.finditer(plain)]
    return out


def table_numbers(text: str) -> list[tuple[str, str]]:
    """(number as written, its table line) for every decimal number in the result tables, code spans removed."""
    return [(n, line) for n, line, _, _ in table_cells(text)]


def numbers_in(x, skip=("series",)) -> list[float]:
    """Every finite number in a JSON-like structure, except under the keys in `skip`."""
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [float(x)] if math.isfinite(x) else []
    if isinstance(x, dict):
        return [v for k, val in x.items() if k not in skip for v in numbers_in(val, skip)]
    if isinstance(x, (list, tuple)):
        return [v for val in x for v in numbers_in(val, skip)]
    return []


def store_numbers(results_dir: str, env=None) -> list[float]:
    """Every number of the store; with `env`, of that env's rows, throughput entries and speed entries (a
    speed entry names its env in data["env_id"]; one that names none is left out)."""
    data = bench.store.load(results_dir)
    keep = [r for r in data["rows"] if env is None or r["env"] == env]
    values = numbers_in(keep) + numbers_in([t for t in data["throughput"] if env is None or t["env"] == env])
    for entry in data["speed"] + bench.speed.gpu_entries():
        if env is None or (isinstance(entry["data"], dict) and entry["data"].get("env_id") == env):
            values += numbers_in(entry["data"]) + numbers_in(bench.speed.summary(entry))
    return values


def rows_by_setting(results_dir: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in bench.store.load(results_dir)["rows"]:
        out.setdefault(r["setting"], []).append(r)
    return out


def env_named(cell: str, envs) -> "str | None":
    """The env id a header or first cell begins with (`chain (85)` -> chain; `distractor-chain` is not chain)."""
    first = re.split(r"[\s,(]", cell.strip().strip("*`"), maxsplit=1)[0]
    return first if first in envs else None


def unmatched(text: str, results_dir: str) -> list[str]:
    """README table numbers that the store does not hold (for a row naming settings: those settings' rows; in
    a column or row naming an env: that env's rows)."""
    by_setting = rows_by_setting(results_dir)
    envs = {r["env"] for rows in by_setting.values() for r in rows}
    pools: dict = {}
    missing = []
    for n, line, head, first in table_cells(text):
        named = tuple(x for x in re.findall(r"`([^`]*)`", line) if x in by_setting)
        env = env_named(head, envs) or env_named(first, envs)
        if (named, env) not in pools:
            pools[named, env] = (numbers_in([r for x in named for r in by_setting[x] if env in (None, r["env"])])
                                 if named else store_numbers(results_dir, env))
        if not matches(n, pools[named, env]):
            where = [f"the rows of {', '.join(named)}"] if named else []
            where += [f"env {env}"] if env else []
            missing.append(f"{n} in: {line}" + (f" (checked against {' in '.join(where)})" if where else ""))
    return missing


def matches(written: str, values: list[float]) -> bool:
    digits = len(written.split(".")[1])
    return any(f"{v:.{digits}f}" == written for v in values)


def test_table_parser_finds_result_numbers_and_skips_flags_and_code():
    text = ("| flag | default |\n|---|---|\n| `--x` | 0.25 |\n\n"
            "| run | ours |\n|---|---|\n| `--lr 2.5e-4` v1.4.0 | **220.8 ± 17.0**, 2.07x, 500k, -0.037 |\n")
    assert [n for n, _ in table_numbers(text)] == ["220.8", "17.0", "2.07", "-0.037"]
    assert matches("220.8", [220.827]) and not matches("220.8", [220.75 - 0.1])
    assert matches("-0.037", [-0.0371]) and not matches("0.037", [-0.0371])


def test_every_number_in_the_readme_result_tables_is_in_the_results_store():
    with open(os.path.join(ROOT, "README.md")) as f:
        found = table_numbers(f.read())
    assert len(found) > 50  # the README's result tables are found at all
    with open(os.path.join(ROOT, "README.md")) as f:
        missing = unmatched(f.read(), os.path.join(ROOT, "benchmark", "results"))
    assert not missing, "README numbers not in benchmark/results/:\n" + "\n".join(missing)


def test_a_number_of_another_setting_in_a_row_naming_a_setting_is_caught():
    results = os.path.join(ROOT, "benchmark", "results")
    rows = rows_by_setting(results)
    own, other = rows["mlp-eval"][0], rows["mlp-float32-eval"][0]
    row = "| run | eval |\n|---|---|\n| ours (`mlp-eval`) | {:.2f} ± {:.2f} |\n"
    assert unmatched(row.format(own["mean"], own["std"]), results) == []
    # the neighbouring row's mean is in the store, but not in the row this line names
    wrong = unmatched(row.format(other["mean"], own["std"]), results)
    assert len(wrong) == 1 and wrong[0].startswith(f"{other['mean']:.2f} in:") and "mlp-eval" in wrong[0]
    # without a setting named, any row of the store may hold it (the old, looser rule)
    assert unmatched(f"| run | eval |\n|---|---|\n| ours | {other['mean']:.2f} |\n", results) == []


def test_a_retyped_number_is_caught(tmp_path):
    # the check can fail: a README table with a number the store does not hold
    values = store_numbers(os.path.join(ROOT, "benchmark", "results"))
    text = "| policy | return |\n|---|---|\n| mlp | 1380.7 ± 110.4 |\n| gpt2 | 1556.9 ± 218.5 |\n"
    bad = [n for n, _ in table_numbers(text) if not matches(n, values)]
    assert bad == ["1556.9"]


@pytest.mark.parametrize("path", ["benchmark/plots/ppo_cartpole.png", "benchmark/plots/gpt2ppo_lunar.png",
                                  "benchmark/plots/icpi_chain.png"])
def test_the_readme_shows_the_harness_plots(path):
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"]({path})" in f.read()
    assert os.path.isfile(os.path.join(ROOT, path))


def test_a_number_of_another_env_in_a_column_naming_an_env_is_caught():
    results = os.path.join(ROOT, "benchmark", "results")
    chain = next(r for r in rows_by_setting(results)["tabular-q"] if r["env"] == "chain")
    table = ("| agent | chain (85) | distractor-chain (140) | maze (130) |\n|---|---|---|---|\n"
             "| Tabular Q | {} | | {} |\n")
    assert unmatched(table.format(f"{chain['mean']:.3f}", ""), results) == []
    # chain's number in the maze column: in the store, but not among maze's rows
    wrong = unmatched(table.format("", f"{chain['mean']:.3f}"), results)
    assert len(wrong) == 1 and wrong[0].startswith(f"{chain['mean']:.3f} in:") and "env maze" in wrong[0]
    # a row whose first cell names the env restricts the same way; `distractor-chain` is not `chain`
    rows = "| env | ours |\n|---|---|\n| {} | {:.3f} |\n"
    assert unmatched(rows.format("chain", chain["mean"]), results) == []
    assert len(unmatched(rows.format("distractor-chain", chain["mean"]), results)) == 1
