"""The benchmark harness (benchmark/run.py, benchmark/report.py): runs stored and read back with hand-computed numbers,
the report and every results table of the pages regenerated from the committed store (a hand-edited cell fails),
the statistics, the runner end to end on ppo_cartpole.py (resumed runs: test_harness_resume.py), throughput and
speed, and the repository's references."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from conftest import ROOT
from slurm_cluster import free_port

_spec = importlib.util.spec_from_file_location("bench_run", os.path.join(ROOT, "benchmark", "run.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_run"] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)
report = bench.report
STORE = os.path.join(ROOT, "benchmark", "results")


def _write_events(folder, tag, values, steps=None):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(folder)
    for step, v in zip(steps or range(1, len(values) + 1), values):
        w.add_scalar(tag, v, step)
    w.close()


def _finished_run(runs_dir, s, seed, values, steps=None, seconds=10.0, extra=(), machine="M", code="c"):
    """A run as run_job leaves it: event files under its folder and a done.json marker."""
    folder = bench.run_folder(runs_dir, s, seed)
    _write_events(os.path.join(folder, "runs", "r"), s.tag or bench.SCRIPTS[s.script].tag, values, steps)
    for tag, vals in extra:
        _write_events(os.path.join(folder, "runs", tag.replace("/", "_")), tag, vals)
    marker = {"command": bench.display(bench.job_command(s, seed)), "seconds": seconds, "finished": "2026-11-27"}
    marker.update(machine=machine, versions="V", nice=0, code=code, harness_command="h", load=0.5)
    with open(os.path.join(folder, bench.MARKER), "w") as f:
        json.dump(marker, f)
    return folder


def _out(tmp_path):
    return [
        "--results-dir",
        str(tmp_path / "res"),
        "--results-md",
        str(tmp_path / "r.md"),
        "--plots-dir",
        str(tmp_path / "plots"),
    ]


def test_collect_reads_the_events_into_the_store_mean_of_last_100_and_population_std(tmp_path):
    # seed 1: 150 episodes 0..149 -> the last 100 are 50..149, mean 99.5; seed 2: 40 episodes 1..40 -> 20.5;
    # seed 3: 20 of 1000 then 100 of 7, two episodes per step (write order kept) -> 7.0
    s = bench.S("ppo_cartpole", "CartPole-v1", "t", 1000, (1, 2, 3))
    runs = str(tmp_path / "runs")
    _finished_run(runs, s, 1, list(range(150)), extra=[("charts/SPS", [50.0, 300.0])], seconds=30)
    _finished_run(runs, s, 2, list(range(1, 41)), extra=[("charts/SPS", [500.0])], seconds=10)
    _finished_run(runs, s, 3, [1000.0] * 20 + [7.0] * 100, steps=[i // 2 + 1 for i in range(120)], seconds=20)
    assert bench.main(["--mode", "collect", "--runs-dir", runs, *_out(tmp_path)], registry=[s]) == 0
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    assert row["per_seed"] == {"1": 99.5, "2": 20.5, "3": 7.0} and row["episodes"] == {"1": 150, "2": 40, "3": 120}
    # mean 127 / 3; the POPULATION std sqrt(sum (x - m)^2 / 3) = 40.7969, not the sample std (49.9658)
    assert row["mean"] == pytest.approx(42.333333) and row["std"] == pytest.approx(40.796923)
    assert row["sps"] == pytest.approx(400.0)  # the last logged SPS of the seeds that logged one, averaged
    assert row["wall_seconds"] == pytest.approx(20.0) and row["source"] == "harness"
    assert "| `ppo_cartpole.py` | CartPole-v1" in open(tmp_path / "r.md").read().replace("  ", "")
    stored = json.load(open(report.row_path(str(tmp_path / "res"), row)))
    assert "mean" not in stored and stored["series"]["2"]["values"][:3] == [1.0, 2.0, 3.0]  # the data, not numbers


def test_regret_of_the_last_quarter_an_evaluation_row_and_a_subset_of_seeds_merged(tmp_path):
    # ICPI: per seed the mean regret of the episodes that ended at step >= 0.75 * 85 = 63.75
    oracle = next(s for s in bench.SETTINGS if (s.script, s.env, s.name) == ("icpi_chain", "chain", "oracle"))
    runs = str(tmp_path / "runs")
    _finished_run(runs, oracle, 1, [1.0] * 6 + [0.5] * 3, steps=[10, 20, 30, 40, 50, 60, 70, 80, 85])
    _finished_run(runs, oracle, 2, [0.1, 0.3], steps=[70, 80])
    assert _collect(runs, tmp_path, "--settings", "oracle", "--envs", "chain") == 0
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    assert row["per_seed"] == {"1": 0.5, "2": pytest.approx(0.2)} and row["mean"] == pytest.approx(0.35)
    assert row["extra"]["first"]["per_seed"]["1"] == 1.0  # the first quarter: steps < 21.25
    # an evaluation setting: seed 543 first, then seeds 1 and 2 elsewhere: one row of all three, the training return
    # (the last 2 training episodes here) and the seconds per update (rollout + update) beside the evaluation
    s = bench.S(
        "ppo_cartpole",
        "CartPole-v1",
        "e",
        1000,
        (543, 1, 2),
        ("--save-model",),
        tag="eval/episodic_return",
        last_n=2,
        train_last_n=2,
    )
    for runs, seed, evals, train in (
        ("a", 543, [10.0, 20.0], [1.0, 2.0, 3.0]),
        ("b", 1, [30.0, 50.0], [5.0, 7.0]),
        ("b", 2, [0.0, 2.0], [4.0]),
    ):
        parts = [
            ("charts/episodic_return", train),
            ("time/rollout_seconds", [1.0, 3.0]),
            ("time/update_seconds", [2.0]),
        ]
        _finished_run(str(tmp_path / runs), s, seed, evals, extra=parts)
    for runs, seeds in (("a", []), ("b", ["--seeds", "1", "2"])):
        assert _collect(str(tmp_path / runs), tmp_path, *seeds, registry=[s]) == 0
    row = next(r for r in report.load(str(tmp_path / "res"))["rows"] if r["setting"] == "e")
    assert row["seeds"] == [1, 2, 543] and row["per_seed"] == {"1": 40.0, "2": 1.0, "543": 15.0}
    assert row["extra"]["train"]["per_seed"] == {"1": 6.0, "2": 4.0, "543": 2.5}
    assert row["extra"]["update_s"]["per_seed"] == {"1": 4.0, "2": 4.0, "543": 4.0}
    # runs made with other flags are not this setting's: collecting them stores nothing
    other = bench.replace(s, flags=("--other",))
    assert _collect(str(tmp_path / "b"), tmp_path, registry=[other]) == 0
    assert [r["seeds"] for r in report.load(str(tmp_path / "res"))["rows"] if r["setting"] == "e"] == [[1, 2, 543]]
    # a row of other flags is replaced, not merged
    for seed in (1, 2):
        _finished_run(str(tmp_path / "c"), other, seed, [1.0, 2.0])
    assert _collect(str(tmp_path / "c"), tmp_path, registry=[other]) == 0
    assert [r["seeds"] for r in report.load(str(tmp_path / "res"))["rows"] if r["setting"] == "e"] == [[1, 2]]


def test_a_real_run_stores_its_entropy_and_each_perturbed_evaluation_and_merges_them_with_kept_seeds(tmp_path):
    # a real run of the TRPO script through the harness (2 updates of 1000 steps, two evaluations under perturbations)
    flags = ("--policy", "mlp", "--num-envs", "2", "--batch-size", "1000", "--save-model", "--eval-episodes", "2")
    flags += ("--eval-perturbations", "mass=0.5", "action-noise=0.3", "--no-cuda")
    s = bench.S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "tiny", 2000, (1, 2), flags, tag="eval/episodic_return")
    s = bench.replace(s, last_n=2)
    runs = str(tmp_path / "runs")
    assert bench.main(["--runs-dir", runs, "--seeds", "1", "--workers", "1", *_out(tmp_path)], registry=[s]) == 0
    df = bench.read_run(bench.run_folder(runs, s, 1))
    logged = lambda tag: df.value[df.tag == tag].round(4).tolist()  # noqa: E731
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    assert len(logged("losses/entropy")) == 2 and row["entropy_series"]["1"]["values"] == logged("losses/entropy")
    assert sorted(row["perturbed_series"]) == ["action-noise=0.3", "mass=0.5"]
    for p in ("mass=0.5", "action-noise=0.3"):
        stored = row["perturbed_series"][p]["1"]
        assert stored["steps"] == [0, 1] and stored["values"] == logged(f"eval/{p}/episodic_return")
    assert row["perturbed_series"]["mass=0.5"]["1"] != row["series"]["1"]  # not the unperturbed evaluation
    # the step's diagnostics, each update's (per block of the MLP, and the step's scale and residual)
    diagnostics = sorted(t[len("diagnostics/") :] for t in df.tag.unique() if t.startswith("diagnostics/"))
    assert "relative_change/net.0" in diagnostics and "cg_residual" in diagnostics and len(diagnostics) == 2 + 3 * 4
    assert sorted(row["diagnostics_series"]) == diagnostics
    change = df.value[df.tag == "diagnostics/relative_change/net.0"]  # small numbers: 6 significant digits kept
    assert row["diagnostics_series"]["relative_change/net.0"]["1"]["values"] == [float(f"{v:.6g}") for v in change]
    # seed 2 elsewhere, with one of the two perturbations: seed 1's series are kept beside it
    extra = [("losses/entropy", [7.0, 6.5]), ("eval/mass=0.5/episodic_return", [3.0, 4.0])]
    extra += [("diagnostics/step_scale", [0.5, 0.25])]
    _finished_run(str(tmp_path / "other"), s, 2, [1.0, 2.0], extra=extra)
    assert _collect(str(tmp_path / "other"), tmp_path, "--seeds", "2", registry=[s]) == 0
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    assert row["seeds"] == [1, 2] and row["entropy_series"]["2"]["values"] == [7.0, 6.5]
    assert row["entropy_series"]["1"]["values"] == logged("losses/entropy")
    assert list(row["perturbed_series"]["mass=0.5"]) == ["1", "2"]
    assert row["perturbed_series"]["mass=0.5"]["2"]["values"] == [3.0, 4.0]
    assert list(row["perturbed_series"]["action-noise=0.3"]) == ["1"]
    assert row["diagnostics_series"]["step_scale"]["2"]["values"] == [0.5, 0.25]
    assert list(row["diagnostics_series"]["cg_residual"]) == ["1"]
    # a run that logs neither stores neither key
    plain = bench.S("ppo_cartpole", "CartPole-v1", "t", 1000, (1,))
    _finished_run(str(tmp_path / "plain"), plain, 1, [5.0])
    assert _collect(str(tmp_path / "plain"), tmp_path, registry=[plain]) == 0
    where = {"script": "ppo_cartpole", "env": "CartPole-v1", "setting": "t", "steps": 1000}
    stored = json.load(open(report.row_path(str(tmp_path / "res"), where)))
    assert not {"entropy_series", "perturbed_series", "diagnostics_series"} & set(stored)


def test_each_seed_keeps_its_machine_and_script_version_when_rows_merge(tmp_path):
    # seeds 1, 2 on an AMD EPYC by version a, then seed 3 on an Intel Xeon by version b: one row, each seed's own
    s = bench.S("ppo_cartpole", "CartPole-v1", "t", 1000, (1, 2, 3, 4))
    epyc, xeon = "AMD EPYC (no AMX), 2 cores, no GPU", "Intel(R) Xeon(R) Processor, 2 cores, no GPU"
    for seed, machine, code in ((1, epyc, "a"), (2, epyc, "a"), (3, xeon, "b")):
        _finished_run(str(tmp_path / f"runs{seed}"), s, seed, [float(seed)], machine=machine, code=code)
    for seed in (1, 2, 3):
        assert _collect(str(tmp_path / f"runs{seed}"), tmp_path, "--seeds", str(seed), registry=[s]) == 0
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    assert row["seed_machine"] == {"1": epyc, "2": epyc, "3": xeon} and row["seed_code"] == {
        "1": "a",
        "2": "a",
        "3": "b",
    }
    assert report.machines(row) == "AMD EPYC x2, Intel Xeon x1"
    assert "Machines per seed: AMD EPYC x2, Intel Xeon x1." in open(tmp_path / "r.md").read()
    assert report.pooled([row]).startswith("Seeds are pooled across machines (AMD EPYC, Intel Xeon;")
    # a row stored before seeds kept their machine: its single machine and version are each seed's; where it names
    # two, its seeds' are unknown, not guessed
    path = report.row_path(str(tmp_path / "res"), row)
    stored = json.load(open(path))
    for key in ("seed_machine", "seed_code"):
        del stored[key]
    json.dump(dict(stored, machine=epyc, code=["a"]), open(path, "w"))
    _finished_run(str(tmp_path / "runs4"), s, 4, [4.0], machine=xeon, code="b")
    assert _collect(str(tmp_path / "runs4"), tmp_path, "--seeds", "4", registry=[s]) == 0
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    assert row["seed_machine"] == {"1": epyc, "2": epyc, "3": epyc, "4": xeon} and row["seed_code"]["3"] == "a"
    old = dict(stored, machine=f"{epyc} / {xeon}", code=["a", "b"])
    assert report.seed_machines(old) == {} and report.seed_codes(old) == {}
    assert report.machines(old) == "unknown x3"
    one = dict(stored, machine=epyc, code=["a"])
    assert report.machines(one) == "AMD EPYC x3" and report.pooled([one]).startswith("Every seed here ran on AMD EPYC;")


def _collect(runs_dir, tmp_path, *flags, registry=None) -> int:
    return bench.main(["--mode", "collect", "--runs-dir", runs_dir, *flags, *_out(tmp_path)], registry=registry)


def test_a_seed_that_finished_no_episode_is_stored_and_drawn_without_it(tmp_path):
    s = bench.S("ppo_cartpole", "CartPole-v1", "t", 1000, (1, 2))
    runs = str(tmp_path / "runs")
    _finished_run(runs, s, 1, [5.0, 7.0])
    _finished_run(runs, s, 2, [])
    assert _collect(runs, tmp_path, registry=[s]) == 0
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    assert row["per_seed"]["1"] == 6.0 and os.path.isfile(tmp_path / "plots" / "ppo_cartpole.png")


def test_the_committed_report_plots_and_page_tables_are_what_the_store_gives(tmp_path):
    # results.md byte for byte, the same PNGs (rendering is deterministic), and every marked table of README.md and
    # docs/*.md regenerated into a copy of the pages: nothing may differ
    shutil.copytree(STORE, tmp_path / "results")
    for page in report.pages(ROOT):
        os.makedirs(os.path.dirname(tmp_path / os.path.relpath(page, ROOT)), exist_ok=True)
        shutil.copy(page, tmp_path / os.path.relpath(page, ROOT))
    data = report.load(str(tmp_path / "results"))
    text = report.render(data, [(s.script, s.env, s.name) for s in bench.SETTINGS])
    assert text == open(os.path.join(ROOT, "benchmark", "results.md")).read(), (
        "run python benchmark/run.py --mode report"
    )
    assert report.write_pages(data, str(tmp_path)) == [], "a results table differs from the store: --mode report"
    written = report.plot(data["rows"], str(tmp_path / "plots"))
    committed = sorted(os.listdir(os.path.join(ROOT, "benchmark", "plots")))
    assert sorted(map(os.path.basename, written)) == committed
    for name in committed:
        with (
            open(tmp_path / "plots" / name, "rb") as a,
            open(os.path.join(ROOT, "benchmark", "plots", name), "rb") as b,
        ):
            assert a.read() == b.read(), name


def test_a_hand_edited_cell_a_stale_row_and_an_unknown_table_are_caught():
    data = report.load(STORE)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert readme.count("<!-- results: ") == readme.count("<!-- /results -->") == 1
    edited = readme.replace("500.00 ± 0.00", "501.00 ± 0.00", 1)
    assert edited != readme and report.fill(edited, data) == readme  # regenerating restores the store's cell
    with pytest.raises(KeyError, match="no results table 'nope'"):
        report.fill("<!-- results: nope -->\n<!-- /results -->", data)
    # a page row whose setting is not stored is an error, not an empty cell
    missing = dict(data, rows=[r for r in data["rows"] if r["setting"] != "smollm2-bf16"])
    with pytest.raises(KeyError, match="no stored row icpi_chain chain 85 smollm2-bf16"):
        report.fill(readme, missing)
    # every table of the registry is on some page, every page names a table that exists
    used = {m.group(2) for page in report.pages(ROOT) for m in report.MARKED.finditer(open(page).read())}
    assert used == set(report.REGISTRY["tables"])


def test_statistics_of_a_comparison():
    a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 6.5]
    c = report.compare(a, b)
    se2, diff = 1 / 3 + 19 / 36, -19 / 6  # Welch: sample variances 1 and 19/12 over n = 3
    df = se2**2 / ((1 / 3) ** 2 / 2 + (19 / 36) ** 2 / 2)
    half = stats.t.ppf(0.975, df) * se2**0.5
    assert c["welch_ci"] == (pytest.approx(diff - half), pytest.approx(diff + half))
    assert c["P(a > b)"][0] == 0.0 and c["mean a"][0] == 2.0
    assert report.prob_improvement([1, 3, 5], [2, 4, 6]) == pytest.approx(3 / 9)  # 2>... : (3,2), (5,2), (5,4)
    assert report.prob_improvement([1, 2], [2, 0]) == pytest.approx((0 + 0.5 + 1 + 1) / 4)  # a tie counts half
    assert report.iqm(np.arange(1.0, 9.0)) == 4.5  # the middle half of 1..8: 3, 4, 5, 6
    low, high = c["mean a"][1]
    assert 1.0 <= low <= 2.0 <= high <= 3.0 and report.compare(a, b) == c  # a seeded bootstrap: the same each time
    assert report.mean_std([float("nan"), 2.0, 4.0]) == (3.0, 1.0)  # a seed without a value is left out
    # the differences a - b, each setting's seeds resampled on their own: the mean's interval lies within the
    # extremes of resampled a minus resampled b, (1 - 6.5, 3 - 4), and is wider than the seeds paired by index would
    # give (a - b is -3, -3, -3.5 seed by seed: an interval within [-3.5, -3])
    assert c["mean a - b"][0] == pytest.approx(-19 / 6)
    low, high = c["mean a - b"][1]
    assert -5.5 <= low < -4.0 and -2.5 < high <= -1.0
    # 8 seeds each: the interquartile mean trims two seeds at each end (an outlier of b's is dropped)
    a8, b8 = np.arange(1.0, 9.0), np.array([0.0, 1, 2, 3, 4, 5, 6, 100])
    c8 = report.compare(a8, b8)
    assert c8["IQM a - b"][0] == 4.5 - 3.5 and c8["mean a - b"][0] == 4.5 - 121 / 8
    low, high = c8["IQM a - b"][1]
    assert low < 1.0 < high and c8["mean a - b"][1][0] < low
    # the pooled std: sample variances 1 and 19/12, 2 degrees of freedom each
    assert c["pooled_std"] == pytest.approx(((1 + 19 / 12) / 2) ** 0.5)


def test_holm_correction_against_a_case_computed_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> non-decreasing: 0.04 becomes 0.06
    assert report.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert report.holm([0.6, 0.7]) == [1.0, 1.0]  # 0.6 * 2 capped at 1, and 0.7 * 1 raised to the 1.0 before it
    assert report.holm([0.2]) == [0.2] and report.holm([0.01, 0.01]) == [0.02, 0.02]


def test_a_comparison_table_corrects_over_its_own_comparisons_and_has_a_power_line_each(tmp_path):
    data = report.load(STORE)
    spec = report.REGISTRY["tables"]["trpo-pretraining-stats"]
    text = report.table(data, spec)
    lines = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert [line.split("|")[1].strip() for line in lines] == spec["labels"] and "R - M" in spec["labels"]
    rows = [[report.find(data, *w[:2], int(w[2]), x) for x in w[3:]] for w in (x.split() for x in spec["compare"])]
    welch = [report.compare(list(a["per_seed"].values()), list(b["per_seed"].values()))["welch_p"] for a, b in rows]
    assert [line.split("|")[-2].strip() for line in lines] == [report.fmt_p(p) for p in report.holm(welch)]
    assert f"Holm p ({len(welch)} comparisons)" in text
    assert [x.split(":")[0] for x in text.splitlines() if x.startswith("- ")] == [f"- {x}" for x in spec["labels"]]
    # two of the lines alone: corrected over two comparisons
    two = report.table(data, dict(spec, compare=spec["compare"][:2], labels=spec["labels"][:2]))
    assert "Holm p (2 comparisons)" in two and two.count("80% power") == 3
    below = [f"{label} ({report.fmt_p(p)})" for label, p in zip(spec["labels"], report.holm(welch)) if p < 0.05]
    assert f"Holm-corrected p below 0.05: {', '.join(below) or 'none'}, of 5 comparisons." in text

    # a clear difference and a null one: the sentence names the one below 0.05 after the correction
    def row(name, xs):
        per = {str(i + 1): x for i, x in enumerate(xs)}
        return {"script": "s", "env": "e", "steps": 1, "setting": name, "seeds": [1, 2, 3, 4, 5, 6], "per_seed": per}

    fake = {"rows": [row("a", [10, 11, 12, 13, 14, 15]), row("b", [0, 1, 2, 3, 4, 5]), row("c", [0, 1, 2, 3, 4, 6])]}
    out = report.compare_table(fake, ["s e 1 a b", "s e 1 b c"], ["A - B", "B - C"])
    assert "Holm-corrected p below 0.05: A - B (< 0.001), of 2 comparisons." in out and "| < 0.001 " in out


def test_the_difference_80_percent_power_detects():
    # Cohen's classic case, as statsmodels' TTestIndPower (noncentral t, two-sided, df = 126) and G*Power give it:
    # 64 per group detect an effect of 0.5 std with power 0.8015, so 80% power needs an effect just under 0.5
    assert report.t_power(0.5, 1.0, 64, 64) == pytest.approx(0.80146, abs=1e-5)
    assert report.detectable(1.0, 64, 64) == pytest.approx(0.49907, abs=1e-5)
    assert report.detectable(300.0, 64, 64) == pytest.approx(300 * 0.49907, rel=1e-4)  # in the data's units
    # three seeds per arm, as the pretraining rows had: checked by simulation, 20000 t-tests of normal samples whose
    # means differ by the detectable difference reject at alpha 0.05 80% of the time
    d = report.detectable(1.0, 3, 3)
    assert 3.0 < d < 3.2
    rng = np.random.default_rng(1)
    p = stats.ttest_ind(rng.normal(d, 1, (20_000, 3)), rng.normal(0, 1, (20_000, 3)), axis=1).pvalue
    assert (p < 0.05).mean() == pytest.approx(0.80, abs=0.01)
    assert report.detectable(1.0, 3, 10) < d  # unequal arms: more seeds in one arm still help


def test_an_evaluation_stopped_and_run_again_on_resume_counts_once(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    folder = str(tmp_path / "run")
    w = SummaryWriter(folder)  # training to step 3, then an evaluation stopped after two episodes
    for step in (1, 2, 3):
        w.add_scalar("charts/episodic_return", 1.0, step)
        w.add_scalar("charts/episodic_return", 2.0, step)  # two episodes ending at one step both count
    w.add_scalar("eval/episodic_return", 5.0, 0)
    w.add_scalar("eval/episodic_return", 6.0, 1)
    w.close()
    w = SummaryWriter(folder, purge_step=4)  # resumed from the last state: the whole evaluation again
    for ep, v in enumerate([7.0, 8.0, 9.0]):
        w.add_scalar("eval/episodic_return", v, ep)
    w.close()
    df = bench.read_run(folder)
    assert df.value[df.tag == "eval/episodic_return"].tolist() == [7.0, 8.0, 9.0]
    assert len(df[df.tag == "charts/episodic_return"]) == 6


@pytest.mark.parametrize("text", ['{"command": "python ppo_cartpole.py', "[1, 2]", '{"command": "x"}', "\x00\x01"])
def test_a_marker_cut_short_or_foreign_leaves_its_run_incomplete(tmp_path, text):
    """A run's done.json that is not the harness's (cut by a full disk, another program's, missing keys): the run is
    not complete, so it runs again, and collecting it stores nothing, without a traceback."""
    s = bench.S("ppo_cartpole", "CartPole-v1", "default", 512, (1,))
    folder = _finished_run(str(tmp_path / "runs"), s, 1, [1.0, 2.0])
    assert bench.is_complete(folder, bench.job_command(s, 1))  # (the real marker first)
    with open(os.path.join(folder, bench.MARKER), "w") as f:
        f.write(text)
    assert not bench.is_complete(folder, bench.job_command(s, 1)) and bench.marker(folder) is None
    assert bench.collect(s, str(tmp_path / "runs"), str(tmp_path / "store")) is None


def test_the_runs_go_seed_by_seed_across_the_settings(tmp_path, monkeypatch):
    """A sweep stopped part-way leaves its settings with the same seeds: seed 1 of each setting, then seed 2..."""
    a = bench.S("ppo_cartpole", "CartPole-v1", "a", 512, (1, 2, 3))
    b = bench.S("ppo_cartpole", "CartPole-v1", "b", 512, (2, 1))
    started = []
    monkeypatch.setattr(bench, "run_job", lambda s, seed, *rest: started.append((s.name, seed)) or 0)
    monkeypatch.setattr(bench.signal, "signal", lambda *a: None)  # (the harness's handlers stay out of pytest)
    args = bench.Args(workers=1, runs_dir=str(tmp_path))
    assert bench.train(args, [a, b], "h") == []
    assert started == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]


def test_runner_end_to_end_on_ppo_cartpole_clears_a_stale_folder_and_skips_complete_runs(tmp_path):
    runs, out = str(tmp_path / "runs"), _out(tmp_path)
    s = bench.S("ppo_cartpole", "CartPole-v1", "default", 2048, (1,))
    stale = bench.run_folder(runs, s, 1)  # an interrupted earlier run (events, no marker): cleared, not mixed in
    _write_events(os.path.join(stale, "runs", "old"), "charts/episodic_return", [9999.0] * 5)
    assert bench.job_command(s, 1)[1:] == [
        os.path.join(ROOT, "ppo_cartpole.py"),
        "--env-id",
        "CartPole-v1",
        "--total-timesteps",
        "2048",
        "--seed",
        "1",
        "--torch-threads",
        "1",
    ]
    argv = ["--quick", "--scripts", "ppo_cartpole", "--envs", "CartPole-v1", "--seeds", "1", "--runs-dir", runs, *out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "run.py"), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "running 1 runs" in proc.stdout and not os.path.exists(os.path.join(stale, "runs", "old"))
    (row,) = report.load(str(tmp_path / "res"))["rows"]
    df = bench.read_run(stale)
    returns = df.value[df.tag == "charts/episodic_return"].to_numpy()
    assert len(returns) > 30 and row["per_seed"]["1"] == pytest.approx(returns[-100:].mean(), abs=1e-3)
    assert row["run_commands"] == [bench.display(bench.job_command(s, 1)).replace("--seed 1", "--seed {seed}")]
    assert os.path.isfile(tmp_path / "plots" / "ppo_cartpole.png")
    events = sorted(os.path.join(d, f) for d, _, fs in os.walk(stale) for f in fs if "tfevents" in f)
    mtimes = [os.path.getmtime(p) for p in events]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)  # complete: skipped
    assert "skip (complete): ppo_cartpole CartPole-v1 default 2048 steps seed 1" in proc.stdout
    assert [os.path.getmtime(p) for p in events] == mtimes


@pytest.mark.slow
def test_throughput_and_speed_modes_store_what_they_time(tmp_path, monkeypatch):
    out = _out(tmp_path)
    # a peer from another repository runs unmodified from a checkout of it: here a git repository made on the spot
    repo = tmp_path / "peer_repo"
    (repo / "peer").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "ppo_cartpole.py"), repo / "peer" / "ppo.py")
    for git in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "peer"]):
        subprocess.run(["git", "-C", str(repo), *git], check=True)
    entry = {"script": "ppo_cartpole", "env": "CartPole-v1", "flags": "", "peer": "peer/ppo.py", "peer_flags": ""}
    monkeypatch.setattr(bench, "THROUGHPUT", [dict(entry, peer_repo="someone/peer", label="their ppo.py")])
    argv = ["--mode", "throughput", "--quick", "--scripts", "ppo_cartpole", "--repeats", "1", "--throughput-steps"]
    with pytest.raises(SystemExit, match="give a checkout of it with --peer-dir"):
        bench.main([*argv, "1024", *out])
    assert bench.main([*argv, "1024", *out, "--peer-dir", str(repo)]) == 0
    (t,) = report.load(str(tmp_path / "res"))["throughput"]
    assert t["steps"] == 1024 and t["sps"] > 0 and t["ratio"] == pytest.approx(t["sps"] / t["peer_sps"])
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert t["peer_code"] == f"someone/peer peer/ppo.py at {head[:12]}, unmodified"
    assert t["rollout_s"] > 0 and "their ppo.py" in open(tmp_path / "r.md").read()
    tiny = {
        "script": "gpt2ppo_lunar",
        "env": "LunarLander-v3",
        "steps_per_update": 256,
        "updates": 2,
        "configs": ["@HEAD --critic mlp --steps-per-epoch 256", "--critic mlp --steps-per-epoch 256"],
    }  # (`@COMMIT flags`: the script as committed there, the "before" of a change)
    monkeypatch.setitem(bench.SPEED, "tiny", tiny)
    assert bench.main(["--mode", "speed", "--speed", "tiny", *out]) == 0
    (e,) = report.load(str(tmp_path / "res"))["speed"]
    for config in tiny["configs"]:
        per, phases = e["data"]["per_epoch"][config], e["data"]["phases"][config]
        assert e["name"] == "tiny" and len(per) == 2 and all(0 < x < 60 for x in per)
        assert per == [pytest.approx(r + u, abs=2e-4) for r, u in zip(phases["rollout"], phases["update"])]
    assert "### tiny (machine M" in open(tmp_path / "r.md").read()
    # a whole run timed as one number: the sum of its steps' phases (ICPI's time/step_seconds)
    whole = {"script": "icpi_chain", "env": "chain", "steps_per_update": 16, "updates": 1, "whole_run": True}
    whole.update(threads=2)  # (the threads a run may use: OMP_NUM_THREADS and the like)
    assert bench.thread_env(2)["OMP_NUM_THREADS"] == bench.thread_env(2)["MKL_NUM_THREADS"] == "2"
    monkeypatch.setitem(bench.SPEED, "whole", dict(whole, configs=["--model oracle --no-cache"]))
    assert bench.main(["--mode", "speed", "--speed", "whole", *out]) == 0
    (d,) = [e["data"] for e in report.load(str(tmp_path / "res"))["speed"] if e["name"] == "whole"]
    (steps,) = d["phases"].values()
    assert d["unit"] == "run" and d["per_epoch"]["--model oracle --no-cache"] == [round(sum(steps["step"]), 4)]
    assert len(steps["step"]) == 16 and d["steps_per_epoch"] == 16 and d["threads"] == 2
    assert "Each run on 2 threads." in open(tmp_path / "r.md").read()
    # a commit that cannot be read ends the measurement before any run (the first configuration is not timed)
    bad = dict(tiny, configs=[*tiny["configs"], "@nonesuch --critic mlp"])
    monkeypatch.setitem(bench.SPEED, "bad", bad)
    monkeypatch.setattr(bench, "timed_run", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit, match="cannot read gpt2ppo_lunar.py at commit nonesuch"):
        bench.main(["--mode", "speed", "--speed", "bad", *out])


def test_a_time_breakdown_splits_main_into_its_parts(tmp_path, monkeypatch):
    parts = [["rollout: env stepping", [["step", "gymnasium/wrappers/vector/common.py"]]]]
    # a part that takes a good share of every update (GAE's few milliseconds can fall between the 1 ms samples of a
    # loaded machine)
    backward = [["Tensor.backward", "torch/_tensor.py"], ["backward", "torch/_tensor.py"]]
    parts += [["update: backward", backward], ["nothing", [["no_such_function", "ppo_cartpole.py"]]]]
    entry = {"script": "ppo_cartpole", "env": "CartPole-v1", "flags": "", "steps_per_update": 512, "updates": 8}
    monkeypatch.setitem(bench.SPEED, "tiny-breakdown", dict(entry, parts=parts))
    assert bench.main(["--mode", "speed", "--speed", "tiny-breakdown", *_out(tmp_path)]) == 0
    (e,) = report.load(str(tmp_path / "res"))["speed"]
    d = e["data"]
    assert list(d["parts"]) == ["rollout: env stepping", "update: backward", "nothing", "the rest of the loop"]
    assert d["parts"]["nothing"] == 0 and d["parts"]["rollout: env stepping"] > 0 and d["parts"]["update: backward"] > 0
    assert d["parts"]["the rest of the loop"] > 0 and d["startup_seconds"] > 0 and d["updates"] == 8
    assert "| rollout: env stepping |" in open(tmp_path / "r.md").read()


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--scripts", "nope"), "unknown script 'nope'"),
        (("--envs", "NoSuchEnv-v0"), "unknown env 'NoSuchEnv-v0'"),
        (("--settings", "nope"), "unknown setting 'nope'"),
        (("--mode", "speed", "--speed", "nope"), "unknown speed entry 'nope'"),
        (("--mode", "speed"), "--mode speed needs --speed NAME"),
        (("--workers", "0"), "--workers and --repeats must be at least 1"),
        (("--mode", "list", "--steps", "0"), "--steps must be at least 1"),
        (("--mode", "throughput", "--throughput-steps", "-5"), "--throughput-steps must be at least 1"),
        (("--timeout", "0"), "--timeout must be a positive number of seconds"),
        (("--timeout", "nan"), "--timeout must be a positive number of seconds"),
        (("--nice", "-5"), "--nice must be in 0..19"),
        (("--mode", "collect", "--slurm"), "--slurm goes with --mode train"),
        (("--slurm", "no-sbatch"), "--slurm needs Slurm's sbatch on the PATH"),
        (("--mode", "slurm-task"), "--mode slurm-task needs --jobs-file"),
        (("--mode", "slurm-task", "--jobs-file", "jobs.json"), "runs inside a Slurm array task"),
        (("--mode", "throughput", "--scripts", "icpi_chain"), "no throughput entry for icpi_chain"),
        (("--mode", "throughput", "--scripts", "trpo_gpt2_halfcheetah", "--peer-dir", "x"), "--peer-dir applies"),
        (("--mode", "collect", "--runs-dir", "nowhere"), "--runs-dir"),
        (("--runs-dir", "runs\nelsewhere"), "--runs-dir must be a path on one line of text, got 'runs\\nelsewhere'"),
        (("--results-dir", ""), "--results-dir must be a path on one line of text, got ''"),
        # seeds the scripts would refuse, or run twice in one folder
        (
            ("--scripts", "ppo_cartpole", "--seeds", "1", "1"),
            "--seeds must be distinct seeds in 0..4294967295, got 1 1",
        ),
        (("--scripts", "ppo_cartpole", "--seeds", "-3"), "--seeds must be distinct seeds in 0..4294967295, got -3"),
        # a file of the store cut short, or another program's: named before anything runs
        (("--results-dir", "store:cut"), "cut.json cannot be read as a file of the results store (Unterminated"),
        (("--results-dir", "store:list"), "list.json is not a file of the results store (its JSON is not an object)"),
        (("--results-dir", "store:foreign"), "foreign.json is not a row of the results store (at KeyError('series')"),
        (
            ("--mode", "report", "--results-dir", "store:short"),
            "short.json is not a row of the results store (at ValueError('seed 1: its",
        ),
        (("--mode", "report", "--results-dir", "store:slow"), "slow.json is not a row of the results store (at Value"),
        # the harness's own paths, checked before any run starts (a file, a folder, a path under a file)
        (("--runs-dir", "a-file"), "--runs-dir {tmp}/a-file is not a folder"),
        (("--results-dir", "a-file"), "--results-dir {tmp}/a-file is not a folder"),
        (("--mode", "report", "--results-md", "a-folder"), "--results-md {tmp}/a-folder is a folder, not a file"),
        (("--mode", "report", "--results-md", "a-file/r.md"), "cannot be created: {tmp}/a-file is not a folder"),
        (("--plots-dir", "a-file/plots"), "--plots-dir {tmp}/a-file/plots cannot be created: {tmp}/a-file is not"),
        (("--runs-dir", "a-file/runs", "--slurm", "no-cluster"), "--runs-dir {tmp}/a-file/runs cannot be created"),
        (("--mode", "report", "--results-dir", "a-file"), "--results-dir {tmp}/a-file is not a folder"),
        (("--mode", "report", "--results-dir", "no-such"), "--results-dir {tmp}/no-such is not a folder"),  # (a typo)
        # a real sbatch with no cluster to answer it: sbatch's first error line, the jobs file and runs folder gone
        (("--slurm", "--scripts", "ppo_cartpole", "no-cluster"), 'sbatch failed (exit 1): "sbatch: error: '),
        (("--slurm", "--scripts", "ppo_cartpole", "--runs-dir", "a-folder", "no-cluster"), "sbatch failed"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, tuple) else None,
)
def test_bad_input_one_clear_sentence_and_nothing_written(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    (tmp_path / "jobs.json").write_text("{}")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    if "no-sbatch" in flags:
        monkeypatch.setenv("PATH", str(tmp_path))
        flags = tuple(f for f in flags if f != "no-sbatch")
    if "no-cluster" in flags:
        if not shutil.which("sbatch"):
            pytest.skip("Slurm's sbatch is not installed (.ci/run installs Debian's slurm-client)")
        # no controller listens on that port; MessageTimeout=1 makes sbatch give up at once instead of after ~9 s
        conf = tmp_path / "slurm.conf"
        conf.write_text(
            f"ClusterName=none\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={free_port()}\nMessageTimeout=1\n"
            "NodeName=localhost NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN\n"
            "PartitionName=none Nodes=localhost Default=YES State=UP\n"
        )
        monkeypatch.setenv("SLURM_CONF", str(conf))
        flags = tuple(f for f in flags if f != "no-cluster")
    for kind in [f[6:] for f in flags if f.startswith("store:")]:  # a store with one spoiled file
        (tmp_path / "store" / "ppo_cartpole").mkdir(parents=True)
        row = '{"steps": 9, "last_n": 1, "series": {"1": {"steps": [4, 8], "values": [%s]}}%s}'  # (hand-edited rows)
        text = {"cut": '{"script": "ppo_cartpole", "se', "list": "[1, 2]", "foreign": '{"weights": [1, 2]}'}
        text = {**text, "short": row % ("1.0", ""), "slow": row % ("1.0, 2.0", ', "wall_seconds": "slow"')}[kind]
        (tmp_path / "store" / "ppo_cartpole" / f"{kind}.json").write_text(text)
    flags = [
        str(tmp_path / f) if f in ("nowhere", "a-file", "a-folder") or f.startswith("a-file/") else f for f in flags
    ]
    flags = [str(tmp_path / "store") if f.startswith("store:") else f for f in flags]
    before = sorted(os.listdir(tmp_path))
    runs = ["--runs-dir", str(tmp_path / "runs")] * ("--runs-dir" not in flags)
    with pytest.raises(SystemExit) as stop:
        bench.main([*_out(tmp_path), *runs, *flags])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert message.format(tmp=tmp_path) in err, err
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "a-folder") == []
    assert (tmp_path / "a-file").read_text() == ""


def test_a_read_only_store_is_reported_from_and_refused_as_a_place_to_write(tmp_path, monkeypatch, capsys):
    store = tmp_path / "store"
    shutil.copytree(os.path.join(STORE, "ppo_cartpole"), store / "ppo_cartpole")
    access = os.access  # a read-only mount as os.access reports it (chmod would not stop root)
    monkeypatch.setattr(os, "access", lambda p, m: not (m & os.W_OK and str(p).startswith(str(store))) and access(p, m))
    out = ["--results-md", str(tmp_path / "r.md"), "--plots-dir", str(tmp_path / "plots")]
    assert bench.main(["--mode", "report", "--results-dir", str(store), *out]) == 0  # reading it is enough
    assert "ppo_cartpole" in open(tmp_path / "r.md").read()
    before = sorted(os.listdir(tmp_path))
    for flags in (["--results-dir", str(store)], ["--results-dir", str(store / "new")], ["--plots-dir", str(store)]):
        with pytest.raises(SystemExit) as stop:  # collecting would write the store, or the plots, there
            bench.main(["--mode", "collect", "--runs-dir", str(tmp_path), *out, "--results-dir", str(tmp_path), *flags])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and f"cannot be written: {store} is not writable" in err, err
    assert sorted(os.listdir(tmp_path)) == before


def test_a_slurm_collect_job_refused_cancels_the_array_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    # sbatch takes the array (job 4242) and refuses the job after it: the array is cancelled, nothing stays
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f"#!/bin/sh\ncat > /dev/null\nif [ -e {bin_dir}/took ]; then\n"
        "  echo 'sbatch: error: Batch job submission failed: Job dependency problem' >&2; exit 1\nfi\n"
        f"touch {bin_dir}/took; echo 4242\n"
    )
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" > {bin_dir}/cancelled\n')
    for name in ("sbatch", "scancel"):
        os.chmod(bin_dir / name, 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit) as stop:
        bench.main(["--slurm", "--scripts", "ppo_cartpole", "--runs-dir", str(runs), *_out(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.endswith(
        '"sbatch: error: Batch job submission failed: Job dependency problem" (job array 4242 cancelled).'
    )
    assert (bin_dir / "cancelled").read_text().split() == ["4242"] and not runs.exists()
    assert sorted(os.listdir(tmp_path)) == ["bin"]


def test_a_second_harness_leaves_a_run_that_another_process_runs_alone(tmp_path, capsys):
    import fcntl

    s = bench.S("ppo_cartpole", "CartPole-v1", "t", 512, (1,))
    runs = str(tmp_path / "runs")
    os.makedirs(runs)
    with open(bench.run_folder(runs, s, 1) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another harness holds the run
        assert bench.run_job(s, 1, runs) == 75
    assert "skip (another process runs it now)" in capsys.readouterr().out
    assert not os.path.exists(bench.run_folder(runs, s, 1))


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="a kernel without session groups")
def test_a_niced_run_is_niced_as_a_session_where_the_kernel_weighs_sessions(tmp_path):
    """Under autogroup the scheduler shares the CPU between sessions first: a run in a session of its own yields to
    the machine's other work only when its session's nice is raised too."""
    probe = "import os; print(open('/proc/self/autogroup').read().split()[-1], os.nice(0))"
    assert bench.attempt(str(tmp_path / "run"), [sys.executable, "-c", probe], None, 7, 60) == 0
    niced = min(19, os.nice(0) + 7)  # (a nice adds to the test's own)
    assert open(tmp_path / "run" / "run.log").read().splitlines()[-1] == f"7 {niced}"


def _committed_text_files():
    proc = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True
    )
    if proc.returncode:
        pytest.skip("not a git checkout")
    for rel in proc.stdout.splitlines():
        if os.path.isfile(path := os.path.join(ROOT, rel)):
            with open(path, "rb") as f:
                data = f.read()
            if b"\0" not in data:
                yield rel, data.decode("utf-8", "replace")


def test_nothing_committed_points_outside_the_repository():
    outside = re.compile("|".join(["\\.\\./" + "shared", "(?<![\\w.~-])/" + "(?:tmp|work|home|root)/"]))
    found = [f"{rel}: {m.group(0)}" for rel, text in _committed_text_files() for m in outside.finditer(text)]
    assert found == []


def test_every_published_number_says_where_it_stands_and_the_store_holds_it_as_the_registry():
    refs = {key: bench.Ref(v[0], v[1] if v[1] != "" else None, *v[2:]) for key, v in report.REGISTRY["refs"].items()}
    for key, ref in refs.items():  # a web address of the table or figure, or the figure of a document without one
        assert re.match(r"https://\S+|seed report \d{3}, Fig\. \d+$", ref.address), key
        # a file on GitHub at the commit it was read at (a branch's file changes: the zoo's table did)
        assert "github.com" not in ref.address or re.search(r"/blob/[0-9a-f]{40}/", ref.address), key
        assert ref.kind in ("training", "evaluation"), key  # what it measures: which plots may draw it
        assert re.search(r"\d+[kM]? steps", ref.source), key  # its own budget, whatever row it stands beside
        # a ± that is not a spread over seeds is said in words, never printed as a seed std
        assert ref.std is None or "not over seeds" not in ref.source, key
    assert all(refs[k].std is None and "not over seeds" in refs[k].source for k in refs if k.startswith("zoo-"))
    known = [bench.asdict(r) for r in refs.values()]
    stored = [(r["_file"], x) for r in report.load(STORE)["rows"] for x in r["refs"]]
    assert stored and [(f, x) for f, x in stored if x not in known] == []
    assert "<https://sb3-contrib.readthedocs.io/en/master/modules/trpo.html#results>" in report.ref_text(known[3])


def test_a_published_number_is_printed_with_its_own_budget_and_drawn_only_beside_training_curves():
    data = report.load(STORE)
    text = report.table(data, report.REGISTRY["tables"]["gpt2ppo"])
    published = [line for line in text.splitlines() if line.startswith("- ")]
    assert published and all(re.match(r"- beside the [\w-]+ rows( of [\d,]+ steps)?: ", line) for line in published)
    # a number that stands beside some of an env's rows only says which
    assert "- beside the LunarLander-v3 rows of 307,200 steps: -45 (seed 002 GPT2PPO" in text
    assert not re.search(r"^- [\w-]+, [\d,]+ steps:", text, re.M)  # not the row's budget, which it may not share
    assert any("rl-baselines3-zoo PPO on LunarLander-v2, 1M steps" in line for line in published)
    # a training number with a budget (the seed report's ~307k, CleanRL's 500k) stands beside rows of that budget only:
    # it is drawn on their panel
    for row, x in ((r, x) for r in data["rows"] for x in r["refs"] if x["kind"] == "training"):
        budget = re.search(r"(\d+)([kM]) steps", x["source"])
        if budget:
            steps = int(budget[1]) * {"k": 1000, "M": 1000000}[budget[2]]
            assert abs(steps - row["steps"]) <= 0.02 * row["steps"], (row["_file"], x["source"])
    # a panel of training curves draws the training numbers, not an evaluation of a trained agent
    rows = [r for r in data["rows"] if r["script"] == "trpo_gpt2_halfcheetah" and r["refs"]]
    assert rows and report.curve_refs(rows) == []
    lunar = [r for r in data["rows"] if r["env"] == "LunarLander-v3" and r["steps"] == 307200]
    drawn = [x["source"] for x in report.curve_refs(lunar)]
    assert drawn and all("seed 002" in x for x in drawn)


def test_seeds_pooled_across_machines_are_checked_against_the_prediction_interval_of_the_others():
    epyc, h200 = "AMD EPYC (no AMX), 2 cores, no GPU", "Intel Xeon, 16 cores, NVIDIA H200"
    values = {"1": 10.0, "2": 11.0, "3": 12.0, "4": 13.0, "5": 14.0, "6": 12.5, "7": 40.0}
    row = {"setting": "x", "seeds": [1, 2, 3, 4, 5, 6, 7], "per_seed": values, "tag": "eval/episodic_return"}
    row.update(extra={}, seed_machine={s: epyc if int(s) <= 5 else h200 for s in values})
    # 10..14: mean 12, sample std sqrt(2.5); t(0.975, 4) = 2.776445; half-width 2.776445 * 1.581139 * sqrt(1.2) = 4.809
    assert report.prediction_interval([10, 11, 12, 13, 14]) == (
        pytest.approx(7.1910, abs=1e-3),
        pytest.approx(16.809, abs=1e-3),
    )
    checks = report.pooling_check(row)
    assert checks == [
        "evaluation H200 seed 6, 12.50: inside [7.19, 16.81] of its 5 AMD EPYC seeds",
        "evaluation H200 seed 7, 40.00: OUTSIDE [7.19, 16.81] of its 5 AMD EPYC seeds",
    ]
    text = report.pooled([row])
    assert text.startswith("Seeds are pooled across machines (AMD EPYC, H200;") and "under the assumption" in text
    assert checks[1] in text and "does not prove it" in text
    # fewer than 3 seeds on the most frequent machine: nothing to check against
    assert report.pooling_check(dict(row, seeds=[1, 2, 6])) == []


def test_every_stored_command_names_a_script_that_exists():
    for row in report.load(STORE)["rows"]:
        for command in row.get("run_commands") or []:
            script = command.split()[1]
            assert os.path.isfile(os.path.join(ROOT, script)), f"{row['_file']}: {script}"


def test_every_script_page_links_its_paper_and_reference_implementation():
    for page in ("ppo_cartpole", "trpo_gpt2_halfcheetah", "gpt2ppo_lunar", "icpi_chain"):
        head = open(os.path.join(ROOT, "docs", f"{page}.md")).read().split("## What it implements")[0]
        assert re.search(r"\(https://(arxiv\.org/abs/\d{4}\.\d{5}|doi\.org/10\.)", head), page
        assert re.search(r"\(https://github\.com/[\w.-]+/[\w.-]+\)", head), page


def test_a_stored_harness_command_names_no_folder_of_this_machine():
    command = f"python benchmark/run.py --runs-dir /elsewhere/sweep-runs --plots-dir {bench.ROOT}/benchmark/out/p"
    assert bench.portable(command) == "python benchmark/run.py --runs-dir <sweep-runs> --plots-dir benchmark/out/p"


# ----------------------------------------------------------------------------------------------- the registered test

CONFIRM = report.REGISTRY["tables"]["trpo-confirm"]
PERTURBATIONS = ["mass=0.7", "mass=1.3", "friction=0.5", "friction=1.5", "action-noise=0.2"]


def _series(values, start=0, every=1):
    return {"steps": [start + every * i for i in range(len(values))], "values": [round(float(v), 4) for v in values]}


def _confirm_store(folder, seeds: dict, rng, negative=()):
    """A store with the registered test's arms (seeds per arm letter) and the exploratory rows: training returns,
    evaluations, entropies and perturbed evaluations drawn at random, an arm's level apart from another's.
    `negative`: (arm, seed) pairs whose unperturbed evaluation is below 0. Returns the data and every seed's numbers,
    computed here."""
    level = {"P": 1000.0, "R": 1500.0, "S": 1200.0, "M": 900.0}
    arms = {**CONFIRM["arms"], **{f"x{k}": v for k, v in CONFIRM["exploratory"]["arms"].items()}}
    seeds = {**seeds, "xR": [1, 2, 3, 4, 5, 19, 20, 21, 22, 23], "xP": [1, 2, 3, 4, 5, 19, 20, 21, 22, 23]}
    truth = {}
    for arm, name in arms.items():
        row = {"script": "trpo_gpt2_halfcheetah", "env": "HalfCheetah-v5", "setting": name, "steps": 1000000}
        row.update(seeds=seeds.get(arm, []), flags=[], tag="eval/episodic_return", last_n=10, refs=[])
        row.update(x_label="environment steps", y_label="eval/episodic_return")
        row.update(series={}, train_series={}, entropy_series={}, perturbed_series={p: {} for p in PERTURBATIONS})
        row["seed_machine"] = {str(s): "AMD EPYC (no AMX), 2 cores, no GPU" for s in row["seeds"]}
        for s in map(str, row["seeds"]):
            base = level[arm.lstrip("x")] + rng.normal(0, 150)
            train = rng.normal(base, 400, 40 + int(rng.integers(0, 20)))  # every episode of the run
            evals = rng.normal(-50 if (arm, s) in negative else 2 * base, 100, 10)
            under = {p: rng.normal(2 * base * rng.uniform(0.4, 1.0), 100, 10) for p in PERTURBATIONS}
            row["train_series"][s], row["series"][s] = _series(train, 1000, 1000), _series(evals)
            row["entropy_series"][s] = _series(rng.normal(8.0, 0.5, 5), 15000, 15000)
            for p in PERTURBATIONS:
                row["perturbed_series"][p][s] = _series(under[p])
            rounded = lambda x: np.round(x, 4)  # noqa: E731 (as stored)
            h2 = float(rounded(evals).mean())
            h3 = np.mean([rounded(under[p]).mean() for p in PERTURBATIONS]) / h2 if h2 > 0 else None
            truth[(arm, s)] = {"train-all": float(rounded(train).mean()), "eval": h2, "robustness": h3}
            truth[(arm, s)]["under"] = {p: rounded(under[p]).mean() / h2 for p in PERTURBATIONS}
        if row["seeds"]:
            report.dump(row, report.row_path(str(folder), row))
    return report.load(str(folder)), truth


def _cells(text, first):
    """The cells of the table line whose first cell is `first`."""
    (line,) = [x for x in text.splitlines() if x.startswith("| ") and x.split("|")[1].strip() == first]
    return [c.strip() for c in line.split("|")[1:-1]]


def test_the_claim_says_each_registered_outcome_and_the_controls_registered_reading():
    def claim(**outcomes):  # label -> (a - b, its Holm p)
        labels = [c[0] for c in CONFIRM["comparisons"]]
        return report.claim_lines(CONFIRM, [{"diff": outcomes[k][0]} for k in labels], [outcomes[k][1] for k in labels])

    seen = dict(H1=(300.0, 0.0001), H2=(-90.0, 0.21), H3a=(0.01, 0.5), H3b=(0.05, 0.012), C1=(-300.0, 0.001))
    lines = claim(**seen, C2=(-600.0, 0.0002))
    assert lines == [
        "- H1 (R - P, H1 metric): R above P, as predicted (Holm p < 0.001); H2 (R - P, H2 metric): no difference "
        "detected (Holm p 0.210).",
        "- H3a (P - R, H3 score): no difference detected (Holm p 0.500); H3b (P - M, H3 score): P above M (Holm p "
        "0.012).",
        "- C1 (S - P, H1 metric): S below P (Holm p 0.001); C2 (S - R, H1 metric): S below R (Holm p < 0.001): "
        "inconclusive, by the registered reading.",
    ]
    # a prediction contradicted is said so; each registered reading of the control when its outcomes hold
    assert "R below P, against the prediction" in claim(**{**seen, "H1": (-300.0, 0.01)}, C2=(-600.0, 0.01))[0]
    weights = claim(**{**seen, "C1": (-20.0, 0.6)}, C2=(-300.0, 0.01))[2]
    assert weights.endswith("the slowdown comes with the pretrained weights' statistics, by the registered reading.")
    learned = claim(**{**seen, "C1": (200.0, 0.01)}, C2=(-30.0, 0.3))[2]
    assert learned.endswith("the slowdown comes from what pretraining learned, by the registered reading.")
    # p at 0.05 is not below it: no difference detected; a comparison without 2 seeds a side is not tested
    assert "C2 (S - R, H1 metric): no difference detected" in claim(**seen, C2=(-300.0, 0.05))[2]
    labels = [c[0] for c in CONFIRM["comparisons"]]
    untested = report.claim_lines(CONFIRM, [None if k == "H3a" else {"diff": 1.0} for k in labels], [1.0] * 6)
    assert untested[1].startswith("- H3a (P - R, H3 score): not tested (fewer than 2 seeds with a value); H3b")


def test_the_second_registered_test_reads_its_outcomes_as_registered():
    """The weights' scale or their structure (H4-H7): each group's outcomes end in the reading the page registered for
    them, any other combination in "inconclusive"; the reading of both groups together is a line of its own."""
    spec = report.REGISTRY["tables"]["trpo-confirm-scale"]

    def claim(**outcomes):  # label -> "above", "below" or "none" (no difference detected)
        labels = [c[0] for c in spec["comparisons"]]
        results = [{"diff": {"above": 50.0, "below": -50.0, "none": 5.0}[outcomes[k]]} for k in labels]
        return report.claim_lines(spec, results, [0.5 if outcomes[k] == "none" else 0.01 for k in labels])

    remedy = claim(H4="above", H5="above", H6="none", H7="none")
    assert remedy == [
        "- H4 (Pr - P, H1 metric): Pr above P, as predicted (Holm p 0.010); H5 (Sr - S, H1 metric): Sr above S, as "
        "predicted (Holm p 0.010): the weights' scale slows learning, pretrained or shuffled, by the registered "
        "reading.",
        "- H6 (Pr - R, H1 metric): no difference detected (Holm p 0.500); H7 (Sr - R, H1 metric): no difference "
        "detected (Holm p 0.500): at random init's scale neither the pretrained structure nor the shape of the values' "
        "distribution is detected to change the learning speed, by the registered reading.",
        "- Together (H4, H5, H6, H7): the slowdown is the weights' scale, and rescaling a pretrained model's tensors "
        "to random init's statistics is the remedy, by the registered reading.",
    ]
    reading = lambda line: line.split("): ")[-1].removesuffix(", by the registered reading.")  # noqa: E731
    structure = claim(H4="above", H5="none", H6="below", H7="none")
    assert [reading(line) for line in structure] == [
        "rescaling speeds the pretrained weights; for the shuffled ones it is not detected",
        "at random init's scale the pretrained structure slows learning",
    ]
    against = claim(H4="below", H5="above", H6="above", H7="below")
    assert "Pr below P, against the prediction" in against[0]
    assert [reading(line) for line in against] == ["inconclusive", "inconclusive"]
    both = claim(H4="none", H5="none", H6="below", H7="below")
    assert reading(both[1]).endswith(
        "the pretrained values, in their order or shuffled, still learn more slowly than random init"
    )


def test_the_registered_test_against_scipy_with_holm_over_six_and_a_seed_without_a_score(tmp_path):
    rng = np.random.default_rng(7)
    seeds = {arm: list(range(6, 16)) for arm in "PRSM"}
    data, truth = _confirm_store(tmp_path / "res", seeds, rng, negative={("P", "9")})
    text = report.table(data, CONFIRM)
    assert "Incomplete" not in text and "Every arm holds its registered seeds (P 10 of 10, R 10 of 10" in text
    expected, welch_p = {}, []
    for label, metric, a, b, _ in CONFIRM["comparisons"]:
        x = [truth[(a, str(s))][metric] for s in range(6, 16) if truth[(a, str(s))][metric] is not None]
        y = [truth[(b, str(s))][metric] for s in range(6, 16) if truth[(b, str(s))][metric] is not None]
        t, u = stats.ttest_ind(x, y, equal_var=False), stats.mannwhitneyu(x, y, alternative="two-sided")
        expected[label] = (x, y, t, u)
        welch_p.append(t.pvalue)
    # Holm, written out here: the i-th smallest of the six times (6 - i), running maximum, capped at 1
    order = np.argsort(welch_p)
    adjusted = np.minimum(1, np.maximum.accumulate(np.array(welch_p)[order] * (6 - np.arange(6))))
    holm = np.empty(6)
    holm[order] = adjusted
    assert sorted(welch_p)[0] < 0.01 and max(welch_p) > 0.05  # the synthetic arms give both kinds
    head = [c.strip() for c in text.split("\n| comparison")[1].splitlines()[0].split("|")[1:-1]]
    for (label, metric, a, b, _), h in zip(CONFIRM["comparisons"], holm):
        x, y, t, u = expected[label]
        cell = dict(zip(["comparison", *head], _cells(text, label)))
        d = 3 if metric == "robustness" else 2
        assert cell["seeds"] == f"{len(x)} vs {len(y)}"
        assert float(cell["mean a"]) == pytest.approx(np.mean(x), abs=10**-d) and cell["a - b"].startswith(f"{a} - {b}")
        assert float(cell["a - b"].split("= ")[1]) == pytest.approx(np.mean(x) - np.mean(y), abs=10**-d)
        low, high = t.confidence_interval(0.95)
        assert cell["Welch 95% CI"] == f"[{report.fmt(low, d)}, {report.fmt(high, d)}]"
        assert cell["Welch p"] == report.fmt_p(t.pvalue) and cell["Holm p (6 comparisons)"] == report.fmt_p(h)
        assert cell["Mann-Whitney U (p)"] == f"{u.statistic:g} ({report.fmt_p(u.pvalue)})"
        assert f"- {label}: with {len(x)} and {len(y)} seeds" in text  # its power line
    below = [f"{label} ({report.fmt_p(h)})" for (label, *_), h in zip(CONFIRM["comparisons"], holm) if h < 0.05]
    assert f"Holm-corrected p below 0.05: {', '.join(below)}, of 6 comparisons." in text
    # the claim under it: a line per registered group, each comparison's outcome by its Holm p and sign
    claim = text.split("**The claim, as registered**")[1].split("\n\n")[1].splitlines()
    assert len(claim) == 3 and all(line.startswith("- ") for line in claim)
    for (label, metric, a, b, _), h in zip(CONFIRM["comparisons"], holm):
        x, y, *_ = expected[label]
        said = "no difference detected" if h >= 0.05 else f"{a} {'above' if np.mean(x) > np.mean(y) else 'below'} {b}"
        assert f"{label} ({a} - {b}, " in "".join(claim) and said in "".join(claim).split(f"{label} (")[1].split(";")[0]
    # P seed 9's evaluation is below 0: no H3 score, listed, and left out of H3a and H3b only
    assert truth[("P", "9")]["robustness"] is None and _cells(text, "H3a")[3] == "9 vs 10"
    assert _cells(text, "H2")[3] == "10 vs 10" and "P seed 9 (no score: unperturbed mean" in text
    # every arm under each perturbation (S too, which no registered comparison of H3 uses), P seed 9 left out
    for arm in "PRSM":
        seeds = [str(s) for s in range(6, 16) if truth[(arm, str(s))]["robustness"] is not None]
        evals = [truth[(arm, s)]["eval"] for s in seeds]
        cells = _cells(text.split("Under each registered perturbation")[1], arm)
        assert cells[:3] == [arm, str(len(seeds)), f"{report.fmt(np.mean(evals))} ± {report.fmt(np.std(evals))}"]
        for p, cell in zip(PERTURBATIONS, cells[3:], strict=True):
            ratios = [truth[(arm, s)]["under"][p] for s in seeds]
            mean, std = (float(x.split()[0]) for x in cell.split(" ± "))
            assert mean == pytest.approx(np.mean(ratios), abs=1e-3) and std == pytest.approx(np.std(ratios), abs=1e-3)
    # the exploratory comparison beside it, labelled, with Welch and Mann-Whitney on its own seeds
    x = [truth[("xR", str(s))]["train-all"] for s in (1, 2, 3, 4, 5, 19, 20, 21, 22, 23)]
    y = [truth[("xP", str(s))]["train-all"] for s in (1, 2, 3, 4, 5, 19, 20, 21, 22, 23)]
    cells = _cells(text, "R - P (exploratory)")
    assert cells[-2] == report.fmt_p(stats.ttest_ind(x, y, equal_var=False).pvalue)
    assert cells[-1].endswith(f"({report.fmt_p(stats.mannwhitneyu(x, y, alternative='two-sided').pvalue)})")


def test_an_incomplete_registered_test_shows_its_seeds_and_no_test(tmp_path):
    rng = np.random.default_rng(3)
    seeds = {"P": list(range(6, 16)), "R": [6, 7, 8, 9], "S": list(range(6, 15))}  # M: none stored
    data, truth = _confirm_store(tmp_path / "res", seeds, rng)
    text = report.table(data, CONFIRM)
    test, exploratory = text.split("Exploratory")
    assert test.startswith("**Incomplete: not the registered test.**")
    assert "P 10 of 10, R 4 of 10, S 9 of 10, M 0 of 10" in test
    for word in ("Welch", "Holm", "Mann-Whitney", "p (", "< 0.001", "80% power"):
        assert word not in test, word
    tables = [x.split("|")[1].strip() for x in test.splitlines() if x.startswith("| ")]
    assert set(tables) == {"arm", "P", "R", "S"}  # the only table: the seeds stored, per arm and metric
    h1 = [c for c in test.splitlines() if c.startswith("| R ") and "H1" in c][0]
    assert h1.split("|")[-2].strip() == "; ".join(f"{s}: {truth[('R', str(s))]['train-all']:.2f}" for s in (6, 7, 8, 9))
    assert "Welch p" in exploratory  # the exploratory comparison is not the registered test
    # nothing stored at all: said so, and the figure says so too
    empty = report.table(_confirm_store(tmp_path / "none", {}, rng)[0], CONFIRM)
    assert (
        "P 0 of 10, R 0 of 10, S 0 of 10, M 0 of 10" in empty
        and "No seed of the registered test is stored yet" in empty
    )
    written = report.plot([], str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in written] == [
        f"trpo_gpt2_halfcheetah_{n}.png" for n in ("confirm", "scale", "step")
    ]


def test_an_exploratory_check_puts_each_seed_against_the_reference_seeds_prediction_interval(tmp_path):
    spec = report.REGISTRY["tables"]["trpo-bf16"]
    rng = np.random.default_rng(5)
    data, truth = _confirm_store(tmp_path / "res", {"R": list(range(6, 16))}, rng)
    assert "no seed of `bf16-smollm2-2blocks-random-eval` stored yet" in report.table(data, spec)
    (r,) = [x for x in data["rows"] if x["setting"] == spec["reference"]]
    row = json.loads(json.dumps(r))  # three seeds of R's numbers as the new setting's, seed 8's training far above
    row.update(setting=spec["settings"][0], seeds=[6, 7, 8])
    row["train_series"]["8"]["values"] = [v + 5000 for v in row["train_series"]["8"]["values"]]
    report.dump(row, report.row_path(str(tmp_path / "res"), row))
    text = report.table(report.load(str(tmp_path / "res")), spec)
    base = [truth[("R", str(s))]["train-all"] for s in range(6, 16)]
    half = stats.t.ppf(0.975, 9) * np.std(base, ddof=1) * np.sqrt(1 + 1 / 10)
    low, high = np.mean(base) - half, np.mean(base) + half
    h1 = [line for line in text.splitlines() if line.startswith("| `bf16") and "H1 metric" in line]
    assert [c.split("|")[5].strip() for c in h1] == [f"inside [{low:.2f}, {high:.2f}]"] * 2 + [
        f"OUTSIDE [{low:.2f}, {high:.2f}]"
    ]
    mine = [truth[("R", s)]["train-all"] for s in ("6", "7")] + [truth[("R", "8")]["train-all"] + 5000]
    assert f"a difference of {np.mean(mine) - np.mean(base):.2f}" in text and "uncorrected, exploratory" in text
