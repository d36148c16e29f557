"""Every number in the README's result tables is in the results store (benchmark/results/ and the GPU raw
outputs of benchmark/gpu/), so the README and the harness cannot drift apart.

Checked: every decimal number (e.g. 220.8, -0.037, 2.07 in 2.07x) in every Markdown table of README.md except
the flag tables (first header cell `flag`), outside `code spans`. A README number with d decimals matches a
value of the store rounded to d decimals: a row's mean, std, per-seed values, first-quarter mean, extra columns,
its references; a throughput entry; a speed entry's raw data and the medians and ratios derived from it. The
episode series are left out on purpose: thousands of returns would match almost anything.

Stricter where a table row names a store setting in a code span (e.g. `mlp-eval`): its numbers must then be
values of that setting's rows, not of any row, so a number copied from the neighbouring row is caught."""

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


def table_numbers(text: str) -> list[tuple[str, str]]:
    """(number as written, its table line) for every decimal number in the result tables, code spans removed."""
    out = []
    for table in result_tables(text):
        for line in table[2:]:  # after the header and the |---| line
            plain = re.sub(r"`[^`]*`", "", line)
            out += [(m.group(0), line) for m in NUMBER.finditer(plain)]
    return out


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


def store_numbers(results_dir: str) -> list[float]:
    data = bench.store.load(results_dir)
    values = numbers_in(data["rows"]) + numbers_in(data["throughput"])
    for entry in data["speed"] + bench.speed.gpu_entries():
        values += numbers_in(entry["data"]) + numbers_in(bench.speed.summary(entry))
    return values


def rows_by_setting(results_dir: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in bench.store.load(results_dir)["rows"]:
        out.setdefault(r["setting"], []).append(r)
    return out


def unmatched(text: str, results_dir: str) -> list[str]:
    """README table numbers that the store does not hold (for a row naming settings: those settings' rows)."""
    values, by_setting = store_numbers(results_dir), rows_by_setting(results_dir)
    missing = []
    for n, line in table_numbers(text):
        named = [x for x in re.findall(r"`([^`]*)`", line) if x in by_setting]
        pool = numbers_in([r for x in named for r in by_setting[x]]) if named else values
        if not matches(n, pool):
            missing.append(f"{n} in: {line}" + (f" (checked against the rows of {', '.join(named)})" if named else ""))
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
