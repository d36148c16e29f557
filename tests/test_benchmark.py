"""Tests of the benchmark harness benchmark/run.py: the reader against hand-computed numbers from
event files written here, the results store and the report rebuilt from it, resume, the --quick mode end to
end on ppo_cartpole.py, missing scripts, the GPU imports, a speed measurement."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, read_scalars

_spec = importlib.util.spec_from_file_location("bench_run", os.path.join(ROOT, "benchmark", "run.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_run"] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)


def _write_events(folder, tag, values, steps=None, sps=None, t0=1000.0):
    """One TensorBoard run folder: `tag` = values at the given steps (wall time t0 + step / 10)."""
    from torch.utils.tensorboard import SummaryWriter

    steps = steps if steps is not None else [10 * (i + 1) for i in range(len(values))]
    w = SummaryWriter(folder)
    for step, v in zip(steps, values):
        w.add_scalar(tag, v, step, walltime=t0 + step / 10)
    for step, v in (sps or []):
        w.add_scalar("charts/SPS", v, step, walltime=t0 + step / 10)
    w.close()


def _harness(*flags, cwd=ROOT, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "run.py"), *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_reader_mean_of_last_100_then_population_std(tmp_path):
    # seed 1: 150 episodes 0..149 -> last 100 are 50..149, mean 99.5
    # seed 2: only 40 episodes 1..40 (fewer than 100: all count) -> 20.5
    # seed 3: 20 episodes of 1000 then 100 of 7, two episodes per step -> the 1000s fall out -> 7.0
    dirs = {s: str(tmp_path / f"seed{s}" / "runs" / "r") for s in (1, 2, 3)}
    _write_events(dirs[1], "charts/episodic_return", list(range(150)), sps=[(100, 50.0), (1500, 300.0)])
    _write_events(dirs[2], "charts/episodic_return", list(range(1, 41)), sps=[(400, 500.0)])
    _write_events(dirs[3], "charts/episodic_return", [1000.0] * 20 + [7.0] * 100,
                  steps=[10 * (i // 2 + 1) for i in range(120)], sps=[(600, 700.0)])
    agg = bench.aggregate({s: str(tmp_path / f"seed{s}") for s in (1, 2, 3)})
    assert [agg["per_seed"][s]["final"] for s in (1, 2, 3)] == pytest.approx([99.5, 20.5, 7.0])
    assert [agg["per_seed"][s]["episodes"] for s in (1, 2, 3)] == [150, 40, 120]
    # mean 127 / 3; population std sqrt(((99.5-m)^2 + (20.5-m)^2 + (7-m)^2) / 3) = 40.7969,
    # not the sample std (49.9658)
    assert agg["mean"] == pytest.approx(42.333333, abs=1e-5)
    assert agg["std"] == pytest.approx(40.796923, abs=1e-5)
    assert agg["sps"] == pytest.approx((300 + 500 + 700) / 3)  # the LAST logged SPS of each seed
    # wall time from the events (no marker): seed 1 spans steps 10..1500 -> 149 s
    assert agg["per_seed"][1]["wall_seconds"] == pytest.approx(149.0, abs=1e-3)
    assert agg["per_seed"][1]["last_step"] == 1500
    # a different window: ICPI's 10 episodes
    assert bench.aggregate({1: str(tmp_path / "seed1")}, last_n=10)["mean"] == pytest.approx(144.5)
    # a seed without a single episode counts as missing, not as 0
    assert bench.mean_std([float("nan"), 2.0, 4.0]) == (3.0, 1.0)


def _marker_run(runs_dir, setting, seed, values, seconds=12.0, steps=None):
    """A finished run as the runner leaves it: events under runs/ and a done.json marker."""
    job = bench.Job(setting, seed, os.path.join(runs_dir, bench.run_id(setting, seed)),
                    bench.command(setting, seed) if bench.present(setting.script) else ["python", "x.py"],
                    "python benchmark/run.py (test)")
    _write_events(os.path.join(job.run_dir, "runs", "r"), setting.tag or bench.SCRIPTS[setting.script].tag, values,
                  steps=steps or list(range(1, len(values) + 1)))
    bench.write_marker(job, seconds)
    return job


def _store(tmp_path):
    return {"--results-dir": str(tmp_path / "out" / "results"), "--results-md": str(tmp_path / "out" / "results.md"),
            "--plots-dir": str(tmp_path / "out" / "plots")}


def _flags(d):
    return [x for kv in d.items() for x in kv]


def test_collect_regret_of_the_last_quarter_into_the_store(tmp_path):
    # ICPI-type logs: charts/regret against real steps; per seed the mean regret of the episodes that ended in
    # the last quarter of the 85 steps (step >= 63.75); the script itself need not exist for the reader.
    oracle = next(s for s in bench.SETTINGS if s.script == "icpi_chain" and s.env == "chain" and s.name == "oracle")
    runs, out = str(tmp_path / "runs"), _store(tmp_path)
    # seed 1 ends episodes at steps 10..60 (regret 1) and 70, 80, 85 (0.5); seed 2 at 70 and 80 (0.1, 0.3)
    # -> finals 0.5 and 0.2; first quarter (step < 21.25): seed 1 only -> 1.0
    _marker_run(runs, oracle, 1, [1.0] * 6 + [0.5] * 3, seconds=10, steps=[10, 20, 30, 40, 50, 60, 70, 80, 85])
    _marker_run(runs, oracle, 2, [0.1, 0.3], seconds=30, steps=[70, 80])
    assert bench.main(["--mode", "collect", "--scripts", "icpi_chain", "--runs-dir", runs, *_flags(out)]) == 0
    path = os.path.join(out["--results-dir"], "icpi_chain", "chain__oracle__85.json")
    raw = json.load(open(path))
    assert raw["series"]["1"]["steps"] == [10, 20, 30, 40, 50, 60, 70, 80, 85] and raw["source"] == "harness"
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["tag"] == "charts/regret" and row["seeds"] == [1, 2] and row["last_fraction"] == 0.25
    assert row["per_seed"] == {"1": pytest.approx(0.5), "2": pytest.approx(0.2)}
    assert row["mean"] == pytest.approx(0.35) and row["std"] == pytest.approx(0.15)
    assert row["first_mean"] == pytest.approx(1.0)
    assert row["wall_seconds"] == pytest.approx(20.0)
    text = open(out["--results-md"]).read()
    assert "| `icpi_chain.py` | chain | oracle | 85 | 1 2 | 0.350 ± 0.150 (charts/regret)" in text
    with open(os.path.join(out["--plots-dir"], "icpi_chain.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # another setting collected later gets its own file; the first one stays
    tab = next(s for s in bench.SETTINGS if s.script == "icpi_chain" and s.env == "chain" and s.name == "tabular-q")
    _marker_run(runs, tab, 1, [0.0] * 3, steps=[70, 80, 85])
    bench.main(["--mode", "collect", "--scripts", "icpi_chain", "--settings", "tabular-q", "--runs-dir", runs,
                *_flags(out)])
    rows = bench.store.load(out["--results-dir"])["rows"]
    assert sorted((r["setting"], r["mean"]) for r in rows) == [("oracle", pytest.approx(0.35)), ("tabular-q", 0.0)]
    assert os.path.isfile(path)


def test_a_setting_may_name_its_own_tag_and_window(tmp_path):
    s = bench.S("ppo_cartpole", "CartPole-v1", "lengths", 1000, (1,), tag="charts/episodic_length", last_n=2)
    runs, out = str(tmp_path / "runs"), _store(tmp_path)
    _marker_run(runs, s, 1, [5.0, 6.0, 9.0])
    assert bench.main(["--mode", "collect", "--runs-dir", runs, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["tag"] == "charts/episodic_length" and row["mean"] == pytest.approx(7.5)
    assert "7.50 ± 0.00 (charts/episodic_length)" in open(out["--results-md"]).read()


def test_the_store_rederives_every_number_from_the_series(tmp_path):
    # a row file whose stored mean disagrees with its series: loading re-derives it (last 2 episodes per seed)
    row = {"script": "ppo_cartpole", "env": "CartPole-v1", "setting": "x", "steps": 100, "seeds": [1, 2],
           "tag": "charts/episodic_return", "last_n": 2, "refs": [], "mean": 999.0, "std": 999.0,
           "series": {"1": {"steps": [10, 20, 30], "values": [1.0, 2.0, 4.0]},
                      "2": {"steps": [10, 20], "values": [10.0, 20.0]}},
           "machine": "m", "versions": "v"}
    bench.store.dump(row, bench.store.row_path(str(tmp_path), row))
    (got,) = bench.store.load(str(tmp_path))["rows"]
    assert got["per_seed"] == {"1": 3.0, "2": 15.0} and got["episodes"] == {"1": 3, "2": 2}
    assert got["mean"] == 9.0 and got["std"] == 6.0  # population std of 3 and 15
    # a row without a series (imported numbers only): mean and std from its per-seed values
    row2 = dict(row, setting="y", series=None, per_seed={"1": 1.0, "2": 2.0, "3": None})
    bench.store.dump(row2, bench.store.row_path(str(tmp_path), row2))
    got2 = next(r for r in bench.store.load(str(tmp_path))["rows"] if r["setting"] == "y")
    assert got2["mean"] == 1.5 and got2["std"] == 0.5  # the missing seed is left out, not counted as 0


def test_report_rebuilds_results_md_from_the_committed_store(tmp_path):
    # `--mode report` reproduces the committed results.md byte for byte from benchmark/results/ alone (no event
    # files, no training), and draws the plots
    import shutil
    res = str(tmp_path / "results")
    shutil.copytree(os.path.join(ROOT, "benchmark", "results"), res)
    md, plots = str(tmp_path / "results.md"), str(tmp_path / "plots")
    proc = _harness("--mode", "report", "--results-dir", res, "--results-md", md, "--plots-dir", plots)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rel = lambda text: text.replace(str(tmp_path) + "/", "benchmark/")  # noqa: E731
    assert rel(open(md).read()) == open(os.path.join(ROOT, "benchmark", "results.md")).read()
    # exactly the committed PNGs: none missing, none stale, none new and uncommitted
    assert sorted(os.listdir(plots)) == sorted(os.listdir(os.path.join(ROOT, "benchmark", "plots")))
    for name in sorted(os.listdir(plots)):
        with open(os.path.join(plots, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


def test_plots_split_the_store_into_readable_panels():
    # PLOT_GROUPS: every stored curve is drawn in some figure, and no panel carries more than 5 curves
    rows = bench.store.load(os.path.join(ROOT, "benchmark", "results"))["rows"]
    jobs = bench.report.plot_jobs(rows, list(bench.SCRIPTS), bench.PLOT_GROUPS)
    drawn = {(r["script"], r["env"], r["steps"], r["setting"]) for _, part in jobs for r in part}
    everything = bench.report.plot_jobs(rows, list(bench.SCRIPTS))  # no groups: one figure per script
    assert drawn == {(r["script"], r["env"], r["steps"], r["setting"]) for _, part in everything for r in part}
    for name, part in jobs:
        panels = [(r["env"], r["steps"]) for r in part]
        assert max(panels.count(p) for p in panels) <= 5, name
    assert len(jobs) == len({name for name, _ in jobs})  # no two figures share a file name


def test_gpu_raw_outputs_are_read_not_retyped():
    # the H100 numbers come from benchmark/gpu/'s files at every report: check two against the files' own lines
    entries = {e["name"]: e for e in bench.speed.gpu_entries()}
    trpo = entries["trpo-h100"]["data"]
    b = next(v for k, v in trpo.items() if "--bf16" in k)
    assert b["time/rollout_seconds"] == [18.0459, 17.3734] and b["cuda_memory"]["max_allocated_gib"] > 15.6
    lunar = bench.speed.summary(entries["gpt2ppo-LunarLander-v3-h100"])
    assert lunar["gpt2 --cuda"]["median_s"] == pytest.approx((1.88 + 1.91) / 2)  # of 2.33, 1.72, 1.91, 1.88
    assert lunar["gpt2 --cuda"]["ratio"] == pytest.approx(1.895 / 0.685)
    assert "H100" in entries["icpi-h100"]["machine"]


def test_the_machine_says_whether_the_cpu_has_amx():
    # bfloat16 was ~3x faster than float32 on an AMX Xeon and ~3x slower on an AVX-512 VNNI one, both named
    # "Intel(R) Xeon(R) Processor": the stored machine must tell them apart
    f = bench.report.cpu_features
    assert f({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}) == "AMX"
    assert f({"avx2", "avx512f", "avx512_bf16"}) == "AVX512-BF16, no AMX"
    assert f({"avx2", "avx512f", "avx512_vnni"}) == "AVX-512, no AMX"
    assert f({"sse4_2", "avx2"}) == "AVX2, no AMX" and f({"sse4_2"}) == "no AVX2, no AMX" and f(set()) == ""
    m = bench.report.machine()
    assert " cores, " in m and ("AMX" in m or not os.path.exists("/proc/cpuinfo"))


def test_speed_mode_measures_stores_and_renders(tmp_path, monkeypatch):
    # a tiny SPEED entry of kind gpt2ppo: 2 epochs of 256 steps of the MLP critic, stored and rendered
    tiny = bench.Speed("tiny", "gpt2ppo", ("--epochs", "2", "--steps-per-epoch", "256", "--configs", "mlp"))
    monkeypatch.setattr(bench, "SPEED", [tiny])
    out = _store(tmp_path)
    assert bench.main(["--mode", "speed", "--speed", "tiny", *_flags(out)]) == 0
    (entry,) = bench.store.load(out["--results-dir"])["speed"]
    assert entry["name"] == "tiny" and entry["source"] == "harness" and entry["kind"] == "gpt2ppo"
    per = entry["data"]["per_epoch"]["mlp"]
    assert entry["data"]["env_id"] == "LunarLander-v3" and len(per) == 2 and all(0 < s < 60 for s in per)
    text = open(out["--results-md"]).read()
    assert "### tiny (gpt2ppo; machine M" in text and "| `mlp` |" in text
    assert "### trpo-h100 (trpo-gpu" in text  # the GPU raw outputs are always part of the report


def test_missing_script_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench.SCRIPTS, "no_such_script", bench.Script("no_such_script.py"))
    registry = [bench.S("no_such_script", "CartPole-v1", "x", 1000, (1, 2))]
    runs = str(tmp_path / "runs")
    rc = bench.main(["--runs-dir", runs, "--results-dir", str(tmp_path / "res"), "--results-md", str(tmp_path / "r.md"),
                     "--plots-dir", str(tmp_path)], registry=registry)
    out = capsys.readouterr().out
    assert rc == 0
    assert "skip: no_such_script.py not present yet -> CartPole-v1 x skipped" in out
    assert not os.path.exists(runs) and not os.path.exists(str(tmp_path / "r.md"))


def test_is_complete_needs_the_marker_with_the_same_command(tmp_path):
    s = bench.S("ppo_cartpole", "CartPole-v1", "default", 2048, (1,))
    job = _marker_run(str(tmp_path), s, 1, [1.0, 2.0])
    assert bench.is_complete(job.run_dir, bench.command(s, 1))
    assert not bench.is_complete(job.run_dir, bench.command(s, 2))  # another command: not this run
    os.remove(os.path.join(job.run_dir, bench.MARKER))
    assert not bench.is_complete(job.run_dir)  # events without a marker: interrupted


def test_quick_end_to_end_on_ppo_cartpole_and_resume(tmp_path):
    runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
    flags = ("--quick", "--scripts", "ppo_cartpole", "--envs", "CartPole-v1", "--workers", "2", "--runs-dir", runs,
             "--results-dir", os.path.join(out, "results"), "--results-md", os.path.join(out, "results.md"),
             "--plots-dir", out)
    # an interrupted earlier run of seed 1 (events, no marker) must be cleared, not mixed in
    s1 = bench.S("ppo_cartpole", "CartPole-v1", "default", bench.SCRIPTS["ppo_cartpole"].quick_steps, (1,))
    stale = os.path.join(runs, bench.run_id(s1, 1))
    _write_events(os.path.join(stale, "runs", "old"), "charts/episodic_return", [9999.0] * 5)

    proc = _harness(*flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "running 2 runs, 2 at a time" in proc.stdout
    assert not os.path.exists(os.path.join(stale, "runs", "old"))
    rows = bench.store.load(os.path.join(out, "results"))["rows"]
    assert len(rows) == 1 and rows[0]["seeds"] == [1, 2] and rows[0]["steps"] == 2048
    # the table's number is the mean of each seed's last 100 logged returns, read independently here
    finals = []
    for seed in (1, 2):
        rd = os.path.join(runs, bench.run_id(s1, seed))
        (sub,) = os.listdir(os.path.join(rd, "runs"))
        vals = [v for _, v in read_scalars(os.path.join(rd, "runs", sub), "charts/episodic_return")]
        assert 30 < len(vals) and max(vals) < 500
        finals.append(sum(vals[-100:]) / len(vals[-100:]))
    assert rows[0]["per_seed"] == {"1": pytest.approx(finals[0]), "2": pytest.approx(finals[1])}
    assert rows[0]["mean"] == pytest.approx(sum(finals) / 2)
    assert rows[0]["std"] == pytest.approx(abs(finals[0] - finals[1]) / 2)
    assert rows[0]["sps"] > 0
    table = open(os.path.join(out, "results.md")).read()
    assert "| `ppo_cartpole.py` | CartPole-v1 | default | 2,048 | 1 2 |" in table
    assert "490.04 ± 6.12 (CleanRL ppo.py" in table and "python ppo_cartpole.py --env-id CartPole-v1" in table
    assert "cores" in table and "torch " in table and "gymnasium " in table
    with open(os.path.join(out, "ppo_cartpole.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # resume: both runs are complete, nothing is launched, the event files stay as they were
    events = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(runs) for f in fs if "tfevents" in f)
    mtimes = [os.path.getmtime(p) for p in events]
    proc = _harness(*flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("skip (complete): ppo_cartpole CartPole-v1 default 2048 steps") == 2
    assert "running" not in proc.stdout
    assert [os.path.getmtime(p) for p in events] == mtimes


@pytest.mark.parametrize("flags, message", [
    (("--scripts", "nope"), "error: unknown script 'nope'"),
    (("--envs", "NoSuchEnv-v0"), "error: no setting uses env 'NoSuchEnv-v0'"),
    (("--workers", "0"), "error: --workers must be at least 1"),
    (("--mode", "speed", "--speed", "nope"), "error: unknown speed entry 'nope'"),
    (("--speed", "icpi-fp32"), "error: --speed names speed entries; it needs --mode speed."),
])
def test_bad_input_one_clear_sentence(tmp_path, flags, message):
    proc = _harness(*flags, "--runs-dir", str(tmp_path))
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_throughput_mode_times_ours_against_the_peer(tmp_path):
    md = str(tmp_path / "results.md")
    proc = _harness("--mode", "throughput", "--quick", "--scripts", "ppo_cartpole", "--repeats", "1",
                    "--throughput-steps", "1024", "--results-md", md, "--results-dir", str(tmp_path / "results"),
                    "--plots-dir", str(tmp_path / "plots"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "peer CleanRL-style ppo.py peer" in proc.stdout and "ratio" in proc.stdout
    (t,) = bench.store.load(str(tmp_path / "results"))["throughput"]
    assert t["steps"] == 1024 and t["sps"] > 0 and t["peer_sps"] > 0
    assert t["ratio"] == pytest.approx(t["sps"] / t["peer_sps"])
    # ppo_cartpole.py logs time/rollout_seconds and time/update_seconds: the split is read back
    assert t["rollout_s"] > 0 and t["update_s"] > 0
    assert "## Throughput" in open(md).read()


def test_import_legacy_converts_an_old_single_file_store(tmp_path):
    # the old run.py kept every row in one results.json; import-legacy writes one store file per row / entry
    legacy = {"rows": [{"script": "ppo_cartpole", "env": "Acrobot-v1", "setting": "default", "steps": 500000,
                        "seeds": [1, 2], "tag": "charts/episodic_return", "last_n": 100, "per_seed": {"1": -80.0,
                        "2": -90.0}, "mean": 0.0, "std": 0.0, "refs": [], "sps": 100.0, "wall_seconds": 9.0,
                        "machine": "m", "versions": "v", "nice": 0, "harness_command": "python benchmark/run.py",
                        "run_commands": ["python ppo_cartpole.py"], "finished": "2026-11-22 23:46:13"}],
              "throughput": [{"label": "x", "script": "ppo_cartpole", "env": "CartPole-v1", "flags": [], "steps": 1024,
                              "sps": 2.0, "peer_label": "p", "peer_sps": 1.0, "ratio": 2.0, "repeats": 1,
                              "peer_threads": "1 (OMP_NUM_THREADS=1)", "rollout_s": None, "update_s": None,
                              "machine": "m", "versions": "v", "harness_command": "h"}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(legacy))
    out = _store(tmp_path)
    assert bench.main(["--mode", "import-legacy", "--legacy-json", str(path), *_flags(out)]) == 0
    data = bench.store.load(out["--results-dir"])
    (row,) = data["rows"]
    assert row["mean"] == -85.0 and row["std"] == 5.0  # re-derived from the per-seed values, not the stored 0.0
    assert os.path.isfile(os.path.join(out["--results-dir"], "ppo_cartpole", "Acrobot-v1__default__500000.json"))
    assert data["throughput"][0]["ratio"] == 2.0 and "label" not in data["throughput"][0]
    assert "-85.00 ± 5.00" in open(out["--results-md"]).read()


def test_collect_takes_the_metric_from_the_registry_not_an_old_marker(tmp_path):
    # a run finished by an older run.py: its marker says "last 10 episodes" and has no last_fraction; the registry
    # now reports ICPI's last-quarter regret, and collect applies it
    oracle = next(s for s in bench.SETTINGS if s.script == "icpi_chain" and s.env == "maze" and s.name == "oracle")
    runs, out = str(tmp_path / "runs"), _store(tmp_path)
    job = _marker_run(runs, oracle, 1, [1.0] * 12 + [0.2], steps=list(range(10, 130, 10)) + [125])
    marker = os.path.join(job.run_dir, bench.MARKER)
    m = json.load(open(marker))
    m.pop("last_fraction")
    m["last_n"] = 10
    json.dump(m, open(marker, "w"))
    assert bench.main(["--mode", "collect", "--scripts", "icpi_chain", "--runs-dir", runs, *_flags(out)]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    # last quarter of 130 steps: step >= 97.5 -> episodes at 100, 110, 120 (1.0) and 125 (0.2) -> 0.8
    assert row["last_fraction"] == 0.25 and row["mean"] == pytest.approx(0.8)


def test_collect_merges_a_subset_of_seeds_into_the_stored_row(tmp_path):
    # an evaluation setting with 3 registry seeds: seed 543 first, then `--seeds 1 2` in another runs folder; the
    # stored row must end with all three (not be replaced by the 2-seed row), keep both provenances, and carry each
    # run's training return beside the evaluation (number and curve)
    s = bench.S("ppo_cartpole", "CartPole-v1", "evalset", 1000, (543, 1, 2), ("--save-model",), tag="eval/episodic_return",
                last_n=2)
    out = _store(tmp_path)
    runs1, runs2 = str(tmp_path / "runs1"), str(tmp_path / "runs2")
    for runs, seed, evals, train, secs in ((runs1, 543, [10.0, 20.0], [1.0, 2.0, 3.0], 30.0),
                                          (runs2, 1, [30.0, 50.0], [5.0, 7.0], 10.0),
                                          (runs2, 2, [0.0, 2.0], [4.0], 20.0)):
        job = _marker_run(runs, s, seed, evals, seconds=secs)
        _write_events(os.path.join(job.run_dir, "runs", "train"), "charts/episodic_return", train)
        _write_events(os.path.join(job.run_dir, "runs", "t1"), "time/rollout_seconds", [secs / 10, secs / 5])
        _write_events(os.path.join(job.run_dir, "runs", "t2"), "time/update_seconds", [1.0, 2.0])
    assert bench.main(["--mode", "collect", "--runs-dir", runs1, *_flags(out)], registry=[s]) == 0
    assert bench.main(["--mode", "collect", "--seeds", "1", "2", "--runs-dir", runs2, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["seeds"] == [1, 2, 543]
    assert row["per_seed"] == {"1": 40.0, "2": 1.0, "543": 15.0}
    assert row["mean"] == pytest.approx(56 / 3)
    assert row["merged_seeds"] == {"from the store": [543], "this collect": [1, 2]}
    assert row["wall_seconds"] == pytest.approx(20.0)  # (30 + 10 + 20) / 3
    assert row["harness_command"] == "python benchmark/run.py (test)"  # the same command once, not repeated
    # training return: mean of the last 30 episodes of charts/episodic_return per seed
    train = row["extra"]["training return, mean of the last 30 episodes"]
    assert train["per_seed"] == {"1": 6.0, "2": 4.0, "543": 2.0} and train["mean"] == pytest.approx(4.0)
    assert ("training return, mean of the last 30 episodes: seed 1: 6.00, seed 2: 4.00, seed 543: 2.00; 4.00 ± 1.63"
            in open(out["--results-md"]).read())
    assert os.path.isfile(os.path.join(out["--plots-dir"], "ppo_cartpole.png"))  # the training curve is drawn
    # seconds per update: mean rollout (secs * 0.15) + mean update (1.5) per seed
    per_update = row["extra"]["seconds per update (rollout + update, mean over the run's updates)"]["per_seed"]
    assert per_update == {"1": pytest.approx(3.0), "2": pytest.approx(4.5), "543": pytest.approx(6.0)}
    # a seed the registry no longer lists is dropped; a different measurement (other flags) replaces the row
    s2 = bench.replace(s, seeds=(1, 2))
    assert bench.main(["--mode", "collect", "--runs-dir", runs2, *_flags(out)], registry=[s2]) == 0
    assert bench.store.load(out["--results-dir"])["rows"][0]["seeds"] == [1, 2]
    path = bench.store.row_path(out["--results-dir"], row)
    stored = json.load(open(path))
    stored["seeds"], stored["flags"] = [543], ["--other"]
    bench.store.dump(stored, path)
    assert bench.main(["--mode", "collect", "--runs-dir", runs2, *_flags(out)], registry=[s]) == 0
    assert bench.store.load(out["--results-dir"])["rows"][0]["seeds"] == [1, 2]
    # ... unless the registry declares those flags the same measurement (same_as): then the stored seed is kept
    stored = json.load(open(path))
    stored["seeds"], stored["flags"] = [543], ["--other"]
    stored["series"] = {"543": stored["series"]["1"]}
    bench.store.dump(stored, path)
    s3 = bench.replace(s, same_as=(("--other",),))
    assert bench.main(["--mode", "collect", "--runs-dir", runs2, *_flags(out)], registry=[s3]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["seeds"] == [1, 2, 543] and row["flags"] == ["--save-model"]
    assert row["merged_seeds"] == {"from the store": [543], "this collect": [1, 2]}


def test_a_merge_averages_wall_time_over_exactly_the_merged_seeds(tmp_path):
    # seeds 543 (30 s) and 1 (100 s) stored; seed 1 rerun (10 s) with seed 2 (20 s): the row's wall time must be
    # the mean over 543's 30, 10 and 20 = 20 s. The stored mean (65 s) also covers the replaced seed-1 run, so
    # weighting it by the one kept seed (the old rule) gave (65 + 2 * 15) / 3 = 31.7 s.
    s = bench.S("ppo_cartpole", "CartPole-v1", "walls", 1000, (543, 1, 2), ())
    out = _store(tmp_path)
    runs1, runs2 = str(tmp_path / "runs1"), str(tmp_path / "runs2")
    for runs, seed, secs in ((runs1, 543, 30.0), (runs1, 1, 100.0), (runs2, 1, 10.0), (runs2, 2, 20.0)):
        _marker_run(runs, s, seed, [float(seed)], seconds=secs)
    assert bench.main(["--mode", "collect", "--runs-dir", runs1, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["wall_seconds"] == pytest.approx(65.0) and row["seed_wall_seconds"] == {"1": 100.0, "543": 30.0}
    path = bench.store.row_path(out["--results-dir"], row)
    stored = json.load(open(path))
    assert bench.main(["--mode", "collect", "--seeds", "1", "2", "--runs-dir", runs2, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["seeds"] == [1, 2, 543] and row["merged_seeds"] == {"from the store": [543], "this collect": [1, 2]}
    assert row["wall_seconds"] == pytest.approx(20.0)
    assert row["seed_wall_seconds"] == {"1": 10.0, "2": 20.0, "543": 30.0}
    # a row stored before per-seed walls were kept: nothing exact is known of seed 543 alone, so the mean is over
    # the fresh seeds (said in merge_stored), not a mixture with the replaced run
    del stored["seed_wall_seconds"], stored["seed_sps"]
    bench.store.dump(stored, path)
    assert bench.main(["--mode", "collect", "--seeds", "1", "2", "--runs-dir", runs2, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["seeds"] == [1, 2, 543] and row["wall_seconds"] == pytest.approx(15.0) and "seed_wall_seconds" not in row
    # ... but one stored seed is exact
    one = dict(stored, seeds=[543], wall_seconds=30.0, series={"543": stored["series"]["543"]})
    bench.store.dump(one, path)
    assert bench.main(["--mode", "collect", "--seeds", "1", "2", "--runs-dir", runs2, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["wall_seconds"] == pytest.approx(20.0) and row["seed_wall_seconds"]["543"] == 30.0
    # ... and so is a stored mean over exactly the kept seeds (543 and 3 at 40 s on average, fresh 1 and 2 at 15 s):
    # (2 * 40 + 2 * 15) / 4, with no per-seed values to pass on
    s4 = bench.replace(s, seeds=(543, 1, 2, 3))
    two = dict(stored, seeds=[3, 543], wall_seconds=40.0,
               series={"3": stored["series"]["543"], "543": stored["series"]["543"]})
    bench.store.dump(two, path)
    assert bench.main(["--mode", "collect", "--seeds", "1", "2", "--runs-dir", runs2, *_flags(out)], registry=[s4]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["seeds"] == [1, 2, 3, 543] and row["merged_seeds"]["from the store"] == [3, 543]
    assert row["wall_seconds"] == pytest.approx(27.5) and "seed_wall_seconds" not in row


# ----------------------------------------------------------------------------------------------
# The TRPO speed kind trpo-profile, at tiny sizes
# ----------------------------------------------------------------------------------------------

TRPO_LAB = {"trpo-profile": "trpo_profile_args"}


def test_a_run_resumed_from_the_completion_cache_is_marked(tmp_path):
    # ICPI logs model/replayed per step: answers an earlier, stopped attempt left in the completion cache. Such a
    # run's wall time covers only what it computed: the row keeps the count per seed, and the report says so.
    s = bench.S("ppo_cartpole", "CartPole-v1", "resumed", 1000, (1, 2, 3), ())
    out = _store(tmp_path)
    runs1, runs2 = str(tmp_path / "runs1"), str(tmp_path / "runs2")
    job = _marker_run(runs1, s, 1, [1.0, 2.0], seconds=50.0)
    _write_events(os.path.join(job.run_dir, "runs", "r"), "model/replayed", [40.0, 0.0, 0.0])
    _marker_run(runs1, s, 2, [3.0, 4.0], seconds=90.0)  # logged no count (older code): unknown, not zero
    assert bench.main(["--mode", "collect", "--runs-dir", runs1, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["seed_replayed"] == {"1": 40}
    text = open(out["--results-md"]).read()
    assert "| 1 2 | 2.50 ± 1.00 | - | n/a | 70 s (resumed) |" in text
    assert ("Resumed: seed 1 replayed 40 cached answers recorded by an earlier, stopped attempt (a resumed run's "
            "wall time covers only the rest); seed 2 logged no count (`model/replayed`), so whether it replayed is "
            "not known here.") in text
    # a later collect of seed 3, which counted and replayed nothing, keeps seed 1's count
    job = _marker_run(runs2, s, 3, [5.0], seconds=10.0)
    _write_events(os.path.join(job.run_dir, "runs", "r"), "model/replayed", [0.0, 0.0])
    assert bench.main(["--mode", "collect", "--seeds", "3", "--runs-dir", runs2, *_flags(out)], registry=[s]) == 0
    (row,) = bench.store.load(out["--results-dir"])["rows"]
    assert row["seeds"] == [1, 2, 3] and row["seed_replayed"] == {"1": 40, "3": 0}
    assert "; seed 2 logged no count" in open(out["--results-md"]).read()
    # a row whose counted seeds replayed nothing has no mark, but still names the seed that logged no count
    s3 = bench.replace(s, name="counted-zero")
    job = _marker_run(runs2, s3, 1, [1.0], seconds=10.0)
    _write_events(os.path.join(job.run_dir, "runs", "r"), "model/replayed", [0.0])
    _marker_run(runs2, s3, 2, [2.0], seconds=10.0)
    assert bench.main(["--mode", "collect", "--settings", "counted-zero", "--runs-dir", runs2, *_flags(out)],
                      registry=[s3]) == 0
    text = open(out["--results-md"]).read()
    assert "| 1 2 | 1.50 ± 0.50 | - | n/a | 10 s |" in text
    assert " Seed 2 logged no count (`model/replayed`), so whether it replayed is not known here." in text
    # a row where nothing was replayed has no mark
    s2 = bench.replace(s, name="whole")
    _marker_run(runs2, s2, 1, [1.0], seconds=10.0)
    assert bench.main(["--mode", "collect", "--settings", "whole", "--runs-dir", runs2, *_flags(out)],
                      registry=[s, s2]) == 0
    rows = {r["setting"]: r for r in bench.store.load(out["--results-dir"])["rows"]}
    assert "seed_replayed" not in rows["whole"] and "(resumed)" not in bench.report.resumed_mark(rows["whole"])


def test_trpo_lab_speed_entries_parse_with_their_kinds_flags():
    entries = [e for e in bench.SPEED if e.kind in TRPO_LAB]
    assert {e.name for e in entries} == {"trpo-profile"}
    for e in entries:
        assert e.kind in bench.speed.KINDS
        getattr(bench.speed, TRPO_LAB[e.kind])(list(e.flags))  # argparse exits on an unknown or malformed flag
    profile = bench.speed.trpo_profile_args(list(next(e for e in entries if e.name == "trpo-profile").flags))
    assert (profile.before, profile.repeats, profile.steps_per_env) == ("759e27f", 3, 1500)


def _measure(tmp_path, monkeypatch, entry):
    monkeypatch.setattr(bench, "SPEED", [entry])
    out = _store(tmp_path)
    assert bench.main(["--mode", "speed", "--speed", entry.name, *_flags(out)]) == 0
    (stored,) = bench.store.load(out["--results-dir"])["speed"]
    assert stored["name"] == entry.name and stored["kind"] == entry.kind and stored["source"] == "harness"
    assert stored["flags"] == list(entry.flags) and stored["seconds"] > 0
    return stored, open(out["--results-md"]).read()


def test_speed_kind_trpo_profile_tiny(tmp_path, monkeypatch):
    # HEAD's script against the working tree (git show); 30 x 10 steps, one round
    entry = bench.Speed("tiny-profile", "trpo-profile", ("--before", "HEAD", "--repeats", "1", "--steps-per-env", "30",
                                                        "--rollout-steps", "30"))
    stored, text = _measure(tmp_path, monkeypatch, entry)
    d = stored["data"]
    assert list(d["updates"]) == ["before", "after"] and d["batch"] == 300
    for runs in d["updates"].values():
        (r,) = runs
        assert set(r) == {"value_fit", "gradient", "cg", "line_search", "update_total", "lbfgs_evaluations", "kl"}
        assert r["update_total"] > 0 and r["lbfgs_evaluations"] > 0 and 0 < r["kl"] < 0.05
    assert d["max_param_diff_vs_first"]["after"] < 1e-10  # the same code on the same batch and networks
    s = bench.speed.summary(stored)
    assert s["speedup"]["before"] == 1.0 and s["rollout"]["raw_steps_per_s"] > 0 and s["rollout"]["script_s"] > 0
    assert "### tiny-profile (trpo-profile; machine M" in text and "| part | before (HEAD) | after |" in text
    assert "| update_total |" in text and "Rollout of 300 steps" in text


def test_imported_value_dtype_row_renders():
    # the 1M-step result, imported from the lab tool until its checkpoint exists again, renders without timings
    data = bench.store.load(os.path.join(ROOT, "benchmark", "results"))
    (e,) = [e for e in data["speed"] if e["name"] == "trpo-value-dtype-1m"]
    assert e["source"] == "imported" and e["imported"]["command"]
    text = "\n".join(bench.speed.render([e], {}))
    assert "imported: `OMP_NUM_THREADS=1 python benchmark/trpo_value_fit_dtype.py" in text
    assert "| float32 | 361.25 | 199.48 | 28 | 0.9618 | n/a |" in text


@pytest.mark.parametrize("df", [1.0, 2.0, 3.3, 30.0])
def test_t_quantile_against_closed_forms_and_the_cdf(df):
    import math

    p = 0.975
    q = bench.report.t_quantile(p, df)
    if df == 1.0:  # Cauchy: tan(pi (p - 1/2))
        assert q == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-5)
    elif df == 2.0:  # (2p - 1) / sqrt(2 p (1 - p))
        assert q == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-6)
    else:  # the CDF at q by a different route (regularised incomplete beta by series) is p
        x = df / (df + q * q)  # P(|T| > q) = I_x(df/2, 1/2), the incomplete beta integral by the midpoint rule
        n = 400_000
        a, b = df / 2, 0.5
        us = [(i + 0.5) / n * x for i in range(n)]
        beta = math.exp(math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
        tail = sum(u ** (a - 1) * (1 - u) ** (b - 1) for u in us) * x / n / beta
        assert 1 - tail / 2 == pytest.approx(p, abs=2e-4)


def test_welch_interval_by_hand_and_the_differences_table():
    # a = 1 2 3 (var 1), b = 4 5 6.5 (var 19/12): se^2 = 1/3 + 19/36 = 31/36, df = (31/36)^2 / ((1/3)^2/2 + (19/36)^2/2)
    w = bench.report.welch([1.0, 2.0, 3.0], [4.0, 5.0, 6.5])
    df = (31 / 36) ** 2 / ((1 / 3) ** 2 / 2 + (19 / 36) ** 2 / 2)
    assert w["diff"] == pytest.approx(-19 / 6) and w["df"] == pytest.approx(df)
    half = bench.report.t_quantile(0.975, df) * (31 / 36) ** 0.5
    assert (w["low"], w["high"]) == (pytest.approx(-19 / 6 - half), pytest.approx(-19 / 6 + half))
    assert 2.7 < half / (31 / 36) ** 0.5 < 2.9  # t(0.975, 3.8) ~ 2.83
    pooled = (1 + 19 / 12) / 2
    w2 = bench.report.welch([1.0, 2.0, 3.0], [4.0, 6.0])  # unequal sizes: se^2 = 1/3 + 2/2
    assert w2["df"] == pytest.approx((4 / 3) ** 2 / ((1 / 3) ** 2 / 2 + 1 ** 2 / 1))
    assert w["seeds_needed"] == pytest.approx(2 * (1.959964 + 0.841621) ** 2 * pooled / (19 / 6) ** 2)

    def row(setting, per_seed, machine="M"):
        return {"script": "s", "env": "E", "steps": 10, "setting": setting, "machine": machine,
                "per_seed": {str(i): v for i, v in enumerate(per_seed)}}

    contrasts = [("q", "s", "E", 10, "a", "b")]
    lines = bench.report.contrast_lines([row("a", [1, 2, 3]), row("b", [4, 5, 6.5])], contrasts)
    assert any("| q | `a` minus `b` | E, 10 | 3 vs 3 | -3.17 |" in x and x.endswith("| M |") for x in lines)
    lines = bench.report.contrast_lines([row("a", [1, 2, 3]), row("b", [4, 5, 6.5], "N")], contrasts)
    assert "differ: M vs N" in lines[-1]
    assert bench.report.contrast_lines([row("a", [1, 2, 3]), row("b", [4])], contrasts) == []  # one seed: no interval
