"""icpi_chain.py --track: the run mirrored into Weights & Biases, offline here (no network, no account), read back
from the offline run's own file; and the two ways --track cannot start, each one sentence that leaves nothing behind."""

import glob
import json
import os
import signal
import sys
from dataclasses import fields

import pytest

import icpi_chain as ic
from conftest import all_scalars, only_run_dir, wandb_records

WANDB_ENV = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_CACHE_DIR", "NETRC")


def test_track_mirrors_the_scalars_and_the_flags_into_an_offline_wandb_run(tmp_path, monkeypatch, capsys):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("HOME", str(home))):
        monkeypatch.setenv(name, value)  # no netrc read, nothing uploaded
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # W&B puts its own in place for good: the test's back after
    flags = ["--model", "oracle", "--total-steps", "12", "--track", "--wandb-project-name", "icpi-test"]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert ic.cli(flags) == 0, capsys.readouterr().err[-3000:]
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        import wandb

        wandb.teardown()  # W&B's service process, started by this run, ends with it
    run = only_run_dir(str(work))
    assert os.listdir(work) == ["runs"]  # W&B's files are in the run folder
    assert not glob.glob(
        os.path.join(run, "wandb", "**", "events.out.tfevents.*"), recursive=True
    )  # scalars mirrored, event files not copied
    [path] = glob.glob(os.path.join(run, "wandb", "offline-run-*", "run-*.wandb"))
    records = list(wandb_records(path))
    [info] = [r.run for r in records if r.HasField("run")]
    assert info.display_name == os.path.basename(run) and info.project == "icpi-test"
    config = {item.key: json.loads(item.value_json) for item in info.config.update}
    assert set(config) - {"_wandb"} == {f.name for f in fields(ic.Args)}
    assert (config["total_steps"], config["model"], config["track"], config["wandb_entity"]) == (
        12,
        "oracle",
        True,
        None,
    )
    history: dict = {}
    for r in records:
        if r.HasField("history"):
            for item in r.history.item:
                history.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
    scalars = all_scalars(run, ignore=())
    assert set(scalars) <= set(history) and {"charts/regret", "charts/episodic_return", "model/calls"} <= set(scalars)
    for tag in ("charts/regret", "charts/episodic_return", "charts/used_model", "model/calls"):
        assert history[tag] == pytest.approx([v for _, v in scalars[tag]], rel=1e-6), tag


@pytest.mark.parametrize("case", ["no wandb package", "no way to log in"])
def test_track_refused_by_wandb_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch, capsys, case):
    """W&B's own checks refuse the run (its package, its credentials): one sentence; the run folder made before is
    gone, and nothing is written under `~`."""
    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    monkeypatch.chdir(tmp_path)
    if case == "no wandb package":
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    code = ic.cli(["--model", "oracle", "--total-steps", "3", "--track", "--cache", str(tmp_path / "c.sqlite")])
    err = capsys.readouterr().err
    message = {
        "no wandb package": "--track: W&B refused to start the run (import of wandb halted",
        "no way to log in": "--track: W&B refused to start the run (No API key configured",
    }[case]
    assert code == 2 and err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == ["home"] and os.listdir(tmp_path / "home") == []
