"""The run machinery the three torch scripts share, one table over the three: a bad path, a damaged, foreign or
impossible file, a second process, a read-only or full disk, a signal during a save, a tracker that refuses to start,
a folder changed during the run. Each ends in one sentence and exit 2, with nothing written or lost. Then what a run
does stopped (by a signal, a kill) and resumed, evaluated from its checkpoint, tracked by W&B and filmed."""

import collections
import contextlib
import ctypes.util
import fcntl
import glob
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (
    ROOT,
    SCRIPT_ENV,
    all_scalars,
    bad,
    cli_in_process,
    read_scalars,
    run_script,
    signal_at,
    stop_when_printed,
    wandb_records,
)

SCRIPTS = ["ppo_cartpole", "gpt2ppo_lunar", "trpo_gpt2_halfcheetah"]
TINY = {  # two updates, a training state after each, the model saved: seconds
    "ppo_cartpole": ["--total-timesteps", "1024", "--num-envs", "2", "--num-steps", "256"],
    "gpt2ppo_lunar": ["--env-id", "Acrobot-v1", "--total-timesteps", "512", "--steps-per-epoch", "256"]
    + ["--num-envs", "2", "--hidden-size", "16", "--n-head", "2", "--context-len", "8", "--minibatch-size", "64"],
    "trpo_gpt2_halfcheetah": ["--policy", "mlp", "--env-id", "InvertedPendulum-v5", "--num-envs", "2"]
    + ["--batch-size", "100", "--total-timesteps", "200", "--no-cuda"],
}


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """Per script, lazily: a complete tiny run with --save-model (its run folder, checkpoint and training state)."""
    runs = {}

    def get(script: str) -> dict:
        if script not in runs:
            cwd = tmp_path_factory.mktemp(script)
            code, out, err = cli_in_process(
                script, [*TINY[script], "--save-model", "--eval-episodes", "1", "--seed", "5"], cwd
            )
            assert code == 0, out + err
            (run,) = glob.glob(str(cwd / "runs" / "*"))
            runs[script] = {"run": run, "ckpt": os.path.join(run, f"{script}.pt"), "state": f"{run}/training_state.pt"}
        return runs[script]

    return get


def damaged(path: str, damage) -> None:
    """The checkpoint or training state at `path`, spoiled in place by `damage(dict)`."""
    saved = torch.load(path, weights_only=True)
    damage(saved)
    torch.save(saved, path)


def first_tensor(saved: dict) -> tuple[dict, str]:
    """The state dict of the first model a checkpoint or training state holds, and its first float tensor's key."""
    model = next(
        v for v in saved["objects"].values() if isinstance(v, dict) and v and all(map(torch.is_tensor, v.values()))
    )
    return model, next(k for k, v in model.items() if v.is_floating_point())


def first(saved, holds) -> dict:
    """The first dict inside a saved state that `holds` (depth first)."""
    if isinstance(saved, dict) and holds(saved):
        return saved
    inner = saved.values() if isinstance(saved, dict) else saved if isinstance(saved, list) else []
    return next((d for v in inner if (d := first(v, holds)) is not None), None)


def env_layer(saved: dict) -> dict:
    """The last layer of a training state's saved envs (the env itself)."""
    return saved["objects"]["envs"][-1]


DAMAGE = {  # a file spoiled in one way: what the script must refuse before it writes anything
    "nan": lambda s: first_tensor(s)[0][first_tensor(s)[1]].view(-1).__setitem__(0, float("nan")),
    "shape": lambda s: first_tensor(s)[0].update({first_tensor(s)[1]: torch.zeros(3, 3)}),
    "dtype": lambda s: first_tensor(s)[0].update({first_tensor(s)[1]: first_tensor(s)[0][first_tensor(s)[1]].long()}),
    "missing_object": lambda s: s["objects"].pop(next(iter(s["objects"]))),
    "objects_list": lambda s: s.update(objects=[1]),
    "extra_key": lambda s: s.update(extra=1),
    "other_version": lambda s: s["args"].update(no_such_flag=1),
    "mistyped_flag": lambda s: s["args"].update(seed="5"),
    "bad_run_name": lambda s: s.update(run_name="../outside"),
    "past_budget": lambda s: s.update(update=3),
    "update_str": lambda s: s.update(update="2"),
    "torch_rng": lambda s: s["random"].update(torch=torch.zeros(10, dtype=torch.uint8)),
    "env_attribute": lambda s: env_layer(s).update(step=5),  # a plain value where the env has a method
    "env_none": lambda s: env_layer(s).update({k: None for k, v in env_layer(s).items() if torch.is_tensor(v)}),
    "torch_rng_content": lambda s: s["random"]["torch"].fill_(255),  # the right form, a state torch refuses
    "generator_state": lambda s: first(s, lambda d: "bit_generator" in d)["state"].update(state=-5),  # numpy refuses
    "queue_count": lambda s: first(s, lambda d: d.keys() == {"values", "count"}).update(count=10**9),
    "float8": lambda s: first_tensor(s)[0].update(
        {first_tensor(s)[1]: first_tensor(s)[0][first_tensor(s)[1]].to(torch.float8_e4m3fn)}
    ),
    "sparse": lambda s: first_tensor(s)[0].update(
        {first_tensor(s)[1]: first_tensor(s)[0][first_tensor(s)[1]].to_sparse()}
    ),
    "env_object": lambda s: env_layer(s).update(action_space=torch.zeros(3)),  # where the env holds an object
    "long_run_name": lambda s: s.update(run_name="x" * 240),  # its evaluation's folder name would not fit
}


def prepare(script: str, flags, tmp_path, made) -> list[str]:
    """The row's flags with its placeholders made real under tmp_path/given: ckpt[:damage], state[:damage],
    run[:damage] (a copy of the tiny run's folder), missing, folder, fifo, loop, text, truncated, pickle, foreign
    (another script's checkpoint), locked (a run folder another process holds), read_only (a run folder on a
    read-only mount), lock_link (a run folder whose lock is a link to a file outside it), lock_fifo (... a FIFO)."""
    given, out = tmp_path / "given", []
    given.mkdir(exist_ok=True)
    for flag in flags:
        kind, _, damage = flag.partition(":")
        if kind in ("ckpt", "state", "run", "locked", "read_only", "lock_link", "lock_fifo"):
            run = shutil.copytree(made(script)["run"], given / f"run{len(out)}")
            path = {"ckpt": f"{run}/{script}.pt", "state": f"{run}/training_state.pt"}.get(kind, str(run))
            if damage:
                damaged(f"{run}/{'training_state' if kind != 'ckpt' else script}.pt", DAMAGE[damage])
            if kind == "locked":  # another process's lock: an open file description of its own
                holder = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
                        "f.write('4242\\n'); f.flush(); print(1, flush=True); time.sleep(60)",
                        f"{run}/.lock",
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                holder.stdout.readline()
                LOCKS.append(holder)
            if kind == "lock_link":  # the lock a link to a file outside the run folder
                (given / "outside.txt").write_text("not the run's\n")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{run}/.lock")
                os.symlink(given / "outside.txt", f"{run}/.lock")
            if kind == "lock_fifo":
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{run}/.lock")
                os.mkfifo(f"{run}/.lock")
            if kind == "read_only":
                mount("--bind", run, run)
                mount("-o", "remount,ro,bind", run)
                MOUNTS.append(run)
            out.append(path)
        elif kind in ("missing", "folder", "fifo", "loop", "text", "truncated", "pickle", "foreign"):
            path = str(given / f"{kind}.pt")
            if kind == "folder":
                os.mkdir(path)
            elif kind == "fifo":  # opening it would wait for a writer forever; a writer after 20 s fails the row
                os.mkfifo(path)
                writer = threading.Timer(20, lambda p=path: open(p, "w").close())
                writer.daemon = True  # (it waits for a reader forever where the script refused the path unopened)
                writer.start()
            elif kind == "loop":
                os.symlink(os.path.basename(path), path)
            elif kind == "text":
                open(path, "w").write("not a checkpoint\n")
            elif kind == "pickle":  # an arbitrary object: refused by weights_only loading
                torch.save({"script": f"{script}.py", "args": threading.Lock}, path)
            elif kind in ("truncated", "foreign"):
                other = SCRIPTS[(SCRIPTS.index(script) + 1) % 3] if kind == "foreign" else script
                shutil.copy(made(other)["ckpt"], path)
                if kind == "truncated":
                    os.truncate(path, os.path.getsize(path) // 2)
            out.append(path)
        else:
            out.append(flag)
    return out


LOCKS, MOUNTS = [], []


def mount(*args):
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} is not permitted here: {proc.stderr.strip()}")


def tree(root) -> dict:
    """Every file and folder under `root` with its size, modification time and content's hash."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            data = (
                open(path, "rb").read() if name in files and os.path.isfile(path) and not os.path.islink(path) else b""
            )
            found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, hash(data))
    return found


NOT_OURS, NO_FIT = "' is not a checkpoint or training state of {script}.py", "or another version of {script}.py made ("


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "flags, message",
    [
        # flags
        bad(("--exp-name", "../up"), "--exp-name must be a plain name, not training_state, that keeps its folders"),
        bad(("--exp-name", "x" * 240), "that keeps its folders' names within 255 characters, got 'xxx"),
        bad(("--exp-name", "training_state"), "--exp-name must be a plain name, not training_state"),
        bad(("--seed", "-1"), "--seed must be in [0, 4294967295], got -1"),
        bad(("--seed", "1.5"), None),  # (tyro's own message)
        bad(("--total-timesteps", "0"), "--total-timesteps must be in [1, "),
        # --eval-checkpoint: a path that is no checkpoint of this script, or one that does not fit its own flags
        bad(("--eval-checkpoint", "missing"), "--eval-checkpoint {given}/missing.pt: No such file or directory"),
        bad(("--eval-checkpoint", "folder"), "--eval-checkpoint '{given}/folder.pt' is not a regular file"),
        bad(("--eval-checkpoint", "fifo"), "--eval-checkpoint '{given}/fifo.pt' is not a regular file"),
        bad(("--eval-checkpoint", "loop"), "--eval-checkpoint {given}/loop.pt: Too many levels of symbolic links"),
        bad(("--eval-checkpoint", "text"), NOT_OURS),
        bad(("--eval-checkpoint", "truncated"), NOT_OURS),
        bad(("--eval-checkpoint", "pickle"), NOT_OURS),
        bad(("--eval-checkpoint", "foreign"), NOT_OURS),
        bad(("--eval-checkpoint", "state"), "training_state.pt' is a training state, which --resume continues"),
        bad(("--eval-checkpoint", "ckpt:nan"), NO_FIT + "it."),
        bad(("--eval-checkpoint", "ckpt:shape"), NO_FIT + "it."),
        bad(("--eval-checkpoint", "ckpt:dtype"), NO_FIT + "it."),
        bad(("--eval-checkpoint", "ckpt:missing_object"), NO_FIT + "it.objects is not a dict of "),
        bad(("--eval-checkpoint", "ckpt:extra_key"), NO_FIT + "it is not a dict of 1 (objects)"),
        bad(("--eval-checkpoint", "ckpt:other_version"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:mistyped_flag"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:bad_run_name"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:long_run_name"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:float8"), NO_FIT + '"isfinite" not implemented for'),
        bad(
            ("--eval-checkpoint", "ckpt", "--total-timesteps", "5"), "an evaluation's flags only, got --total-timesteps"
        ),
        # --resume: no run folder, other flags, a damaged training state, a held or read-only folder
        bad(("--resume", "nowhere"), "--resume nowhere/training_state.pt: No such file or directory"),
        bad(("--resume", "run", "--seed", "9"), "--resume continues a run: --seed 9 is not its 5"),
        bad(
            ("--resume", "run", "--eval-checkpoint", "x"),
            "--eval-checkpoint takes an evaluation's flags only, got --resume",
        ),
        bad(("--resume", "run:nan"), NO_FIT + "it.objects."),
        bad(("--resume", "run:shape"), NO_FIT + "it.objects."),
        bad(("--resume", "run:missing_object"), NO_FIT + "it.objects is not a dict of "),
        bad(("--resume", "run:objects_list"), NO_FIT + "it.objects is not a dict of "),
        bad(("--resume", "run:extra_key"), NO_FIT + "it is not a dict of 2 (random, objects)"),
        bad(("--resume", "run:other_version"), "was made by another version of {script}.py"),
        bad(("--resume", "run:past_budget"), "training_state.pt' holds an update outside its run's budget"),
        bad(("--resume", "run:update_str"), "training_state.pt' holds an update outside its run's budget"),
        bad(("--resume", "run:torch_rng"), NO_FIT + "it.random.torch is not a torch.uint8 tensor of shape"),
        bad(("--resume", "run:env_attribute"), NO_FIT + "it.objects.envs."),
        bad(("--resume", "run:env_none"), NO_FIT + "it.objects.envs."),
        bad(("--resume", "run:env_object"), NO_FIT + "a Tensor cannot replace its "),
        bad(("--resume", "run:float8"), NO_FIT),
        bad(("--resume", "run:sparse"), NO_FIT),
        bad(("--resume", "run:torch_rng_content"), NO_FIT),
        bad(("--resume", "run:generator_state"), NO_FIT),
        bad(("--resume", "run:queue_count"), NO_FIT + "a queue of "),
        bad(("--resume", ""), "--resume must be a path on one line of text, got ''"),
        bad(("--resume", "a\nb"), "--resume must be a path on one line of text, got 'a\\nb'"),
        bad(
            ("--eval-checkpoint", "bad\udcff"), "--eval-checkpoint must be a path on one line of text, got 'bad\\udcff'"
        ),
        bad(("--resume", "locked"), "another process (pid 4242) is running "),
        bad(("--resume", "lock_link"), ".lock: Too many levels of symbolic links"),
        bad(("--resume", "lock_fifo"), ".lock: Invalid argument"),
        bad(("--resume", "read_only"), ".lock: Read-only file system"),
        # a run folder that cannot be made: a file named runs stands where the folder would go
        bad(("!runs_is_a_file",), ": Not a directory"),
    ],
)
def test_hostile_input_ends_in_one_sentence_and_writes_nothing(script, flags, message, tmp_path, made):
    if "!runs_is_a_file" in flags:
        (tmp_path / "runs").write_text("")
    try:
        real = prepare(script, [f for f in flags if not f.startswith("!")], tmp_path, made)
        new_run = not any(f in ("--eval-checkpoint", "--resume") for f in real)
        args = [*TINY[script], *real] if new_run else real
        before = tree(tmp_path)
        code, out, err = cli_in_process(script, args, tmp_path)
        assert code == 2 and "Traceback" not in err, out + err
        if message is not None:
            assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
            assert message.format(script=script, given=tmp_path / "given") in err, err
            named = flags[0] not in ("--resume", "--eval-checkpoint") or flags[0] in err or ".lock" in err
            assert named or "is running" in err, err  # (a path flag's refusal names it, or its folder's lock)
        assert tree(tmp_path) == before  # nothing written, in the folders given either
    finally:
        while LOCKS:
            LOCKS.pop().kill()
        while MOUNTS:
            subprocess.run(["umount", "--lazy", MOUNTS.pop()], check=True)


@pytest.mark.parametrize("wandb_env", ["bogus-mode", "no-login"])
def test_a_tracker_that_refuses_to_start_ends_in_one_sentence_and_writes_nothing(wandb_env, tmp_path):
    """(The common text, so one script.) W&B's own checks refuse the run before it is left in a folder: an unknown
    mode; no key, no netrc (a home without one), not offline, no terminal to ask at. In a process of its own: W&B keeps
    its settings in the process that imported it."""
    env = {k: v for k, v in SCRIPT_ENV.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL")}
    if wandb_env == "bogus-mode":
        env["WANDB_MODE"] = "bogus"
    else:
        env["HOME"] = str(tmp_path / "no-home")
    proc = run_script("ppo_cartpole.py", *TINY["ppo_cartpole"], "--track", cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    err = proc.stderr
    assert err.startswith("error: --track: W&B refused to start the run (") and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == []


def test_a_resumed_run_removes_what_a_killed_save_left_and_nothing_else(tmp_path, made):
    """(The common text, so one script.) A user's file whose name ends like a temporary one stays."""
    (run,) = prepare("ppo_cartpole", ["run"], tmp_path, made)
    for name in ("notes.tmp2024", "training_state.pt.tmp99"):
        open(f"{run}/{name}", "w").write("x")
    code, out, err = cli_in_process("ppo_cartpole", ["--resume", run], tmp_path)
    assert code == 0, out + err
    assert os.path.exists(f"{run}/notes.tmp2024") and not os.path.exists(f"{run}/training_state.pt.tmp99")


def test_an_env_id_of_gymnasiums_module_form_names_a_run_that_resumes(tmp_path):
    """`module:id` names a plain run folder (no `:`), whose training state and checkpoint its run reads back."""
    flags = [*TINY["ppo_cartpole"], "--env-id", "gymnasium:CartPole-v1", "--save-model", "--eval-episodes", "1"]
    assert cli_in_process("ppo_cartpole", flags, tmp_path)[0] == 0
    (run,) = glob.glob(str(tmp_path / "runs" / "gymnasium-CartPole-v1__ppo_cartpole__1__*"))
    for again in (["--resume", run], ["--eval-checkpoint", f"{run}/ppo_cartpole.pt", "--eval-episodes", "1"]):
        code, out, err = cli_in_process("ppo_cartpole", again, tmp_path)
        assert code == 0, out + err


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("error", [SystemExit(130), OSError(28, "No space left on device")], ids=["signal", "full"])
def test_a_save_stopped_by_a_signal_or_a_full_disk_keeps_the_previous_file(script, error, tmp_path, monkeypatch):
    """A second Ctrl-C quits at once, from inside a save if it comes then; a full disk fails a write: the file saved
    before is unchanged, no temporary file stays, and a failed write names the file."""
    module, path = importlib.import_module(script), tmp_path / "training_state.pt"
    path.write_bytes(b"the previous state")

    def fail(fd):
        raise error

    monkeypatch.setattr(module.os, "fsync", fail)
    with pytest.raises(type(error)) as raised:
        module.save_checkpoint(str(path), {"weights": torch.zeros(3)})
    assert os.listdir(tmp_path) == ["training_state.pt"] and path.read_bytes() == b"the previous state"
    if isinstance(error, OSError):
        assert raised.value.filename == str(path) and raised.value.strerror == "No space left on device"


@pytest.mark.parametrize("script", SCRIPTS)
def test_memory_that_torchs_allocator_refuses_ends_in_one_sentence(script, tmp_path, made, monkeypatch):
    """Torch's own allocator refusing a model (here the evaluation's): one sentence, exit 2, no folder; another
    RuntimeError stays a traceback (a bug is not hidden)."""
    module, flags = importlib.import_module(script), ["--eval-checkpoint", made(script)["ckpt"], "--eval-episodes", "1"]
    monkeypatch.setattr(module, "model_objects", lambda args: torch.empty(2**62, dtype=torch.uint8))
    assert cli_in_process(script, flags, tmp_path)[::2] == (
        2,
        "error: this machine lacks the memory this run needs (its flags or a file).\n",
    )
    monkeypatch.setattr(module, "model_objects", lambda args: torch.zeros(2) @ torch.zeros(3))
    with pytest.raises(RuntimeError, match="inconsistent tensor size"):
        cli_in_process(script, flags, tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script, name", [("gpt2ppo_lunar", "critic"), ("trpo_gpt2_halfcheetah", "policy")])
def test_a_files_flag_outside_its_choices_is_refused_before_anything_is_written(script, name, tmp_path, made):
    """tyro checks the choices of a flag given; a flag read from a file is checked by its type, a Literal's members."""
    (run,) = prepare(script, ["run"], tmp_path, made)
    damaged(f"{run}/training_state.pt", lambda s: s["args"].update({name: "bogus"}))
    before = tree(tmp_path)
    code, _, err = cli_in_process(script, ["--resume", run], tmp_path)
    assert (code, err) == (
        2,
        f"error: --resume '{run}/training_state.pt' was made by another version of {script}.py (its flags "
        "or run name differ).\n",
    )
    assert tree(tmp_path) == before


def stopped_run(script: str, cwd, flags=()) -> str:
    """A tiny run (with `flags`) stopped by SIGTERM after its first of two updates: its run folder."""
    assert cli_in_process(script, [*TINY[script], *flags], cwd, signal_at("logging to", signal.SIGTERM))[0] == 143
    (run,) = glob.glob(str(cwd / "runs" / "*"))
    return run


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_full_disk_ends_the_run_in_one_sentence_and_keeps_its_last_training_state(script, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk))
    try:
        run = shutil.copytree(stopped_run(script, tmp_path), disk / "run")
        kept = open(f"{run}/training_state.pt", "rb").read()
        with open(disk / "filler", "wb", buffering=0) as filler:  # the disk full once the run is on it
            with pytest.raises(OSError):
                while True:
                    filler.write(b"\0" * 4096)
        code, out, err = cli_in_process(script, ["--resume", run], tmp_path)
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, out + err
        assert "No space left on device" in err and "Traceback" not in err, err
        assert open(f"{run}/training_state.pt", "rb").read() == kept  # the last good state survives
        assert not glob.glob(f"{run}/*.tmp*")
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_a_disk_full_when_the_log_opens_ends_in_one_sentence_naming_the_run_folder(tmp_path):
    """(The common text, so one script.) The log's writer names no file: the sentence names the run's folder, which
    the refused start removes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount("-t", "tmpfs", "-o", "size=4k", "tmpfs", str(disk))
    try:
        code, out, err = cli_in_process("ppo_cartpole", TINY["ppo_cartpole"], disk)
        assert code == 2 and len(err.strip().splitlines()) == 1, out + err
        assert re.fullmatch(r"error: runs/CartPole-v1__ppo_cartpole__1__\d+: No space left on device\.\n", err), err
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_an_evaluation_on_a_full_disk_ends_in_one_sentence_naming_its_folder(tmp_path, made):
    """(The common text, so one script.) The log's writer fails in its thread, which names no file: the sentence
    names the evaluation's folder."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk))
    try:
        shutil.copy(made("ppo_cartpole")["ckpt"], disk / "model.pt")
        with open(disk / "filler", "wb", buffering=0) as filler:
            with pytest.raises(OSError):
                while True:
                    filler.write(b"\0" * 4096)
        code, out, err = cli_in_process("ppo_cartpole", ["--eval-checkpoint", "model.pt", "--eval-episodes", "3"], disk)
        assert code == 2 and len(err.strip().splitlines()) == 1, out + err
        assert err.startswith("error: No space left on device; the evaluation logs to runs/") and "-eval__" in err, err
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def skip_without_renderer(script: str) -> None:
    """trpo's --capture-video draws MuJoCo through OSMesa (no display): skipped where it is not installed."""
    if script == "trpo_gpt2_halfcheetah" and ctypes.util.find_library("OSMesa") is None:
        pytest.skip("OSMesa is not installed")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_videos_folder_replaced_during_the_run_ends_it_in_one_sentence(script, tmp_path, made):
    """The videos folder is made where it is used, at the evaluation: a file standing there by then is one sentence
    naming it, the run's training state and checkpoint kept."""
    skip_without_renderer(script)
    run = shutil.copytree(made(script)["run"], tmp_path / "run")
    (run / "videos").write_text("not a folder")
    state = (run / "training_state.pt").read_bytes()
    code, out, err = cli_in_process(script, ["--resume", run, "--save-model", "--capture-video"], tmp_path)
    assert code == 2 and err == f"error: {run}/videos: File exists.\n", out + err
    assert (run / "training_state.pt").read_bytes() == state and (run / f"{script}.pt").is_file()


def test_run_folders_made_in_the_same_second_get_their_own_names(tmp_path, monkeypatch):
    """(The common text, so one script.)"""
    monkeypatch.chdir(tmp_path)
    names = {importlib.import_module("ppo_cartpole").make_run_dir("x") for _ in range(3)}
    assert len(names) == 3 and sorted(os.listdir(tmp_path / "runs")) == sorted(names)


# ---- Stopping and resuming, signals, --track and --capture-video: a row a script

LONG = {  # many updates, a training state every few, episodes in progress at each; update k's line, to stop at
    "ppo_cartpole": (["--total-timesteps", "2560", "--num-steps", "32", "--seed", "4", "--checkpoint-every", "5"], 12),
    "gpt2ppo_lunar": (  # each env's first episode runs into Acrobot's 500-step limit in update 16: a truncation
        ["--env-id", "Acrobot-v1", "--total-timesteps", "1280", "--steps-per-epoch", "64", "--num-envs", "2"]
        + ["--seed", "4", "--value-stride", "2", "--checkpoint-every", "3", "--hidden-size", "16", "--n-head", "2"]
        + ["--context-len", "8", "--update-epochs", "2", "--minibatch-size", "64"],
        4,
    ),
    "trpo_gpt2_halfcheetah": (  # HalfCheetah: MuJoCo's integration state, episodes of 1000 steps
        ["--policy", "mlp", "--num-envs", "2", "--batch-size", "1000", "--total-timesteps", "8000", "--seed", "4"]
        + ["--checkpoint-every", "3", "--no-cuda"],
        4,
    ),
}
WALL_CLOCK = ("episode_start_times", "time_queue")  # what gymnasium's RecordEpisodeStatistics keeps of the clock


@pytest.fixture(scope="session")
def whole(tmp_path_factory):
    """Per script, lazily: its LONG run never stopped: (its scalars, its last training state)."""
    runs = {}

    def get(script: str) -> tuple:
        if script not in runs:
            cwd = tmp_path_factory.mktemp(f"{script}-whole")
            assert cli_in_process(script, LONG[script][0], cwd)[0] == 0
            (run,) = glob.glob(str(cwd / "runs" / "*"))
            runs[script] = all_scalars(run), torch.load(f"{run}/training_state.pt", weights_only=True)
        return runs[script]

    return get


def same(a, b) -> bool:
    """Equal through dicts and lists (keys named in WALL_CLOCK aside): tensors in dtype, shape and every element, the
    rest by type and value."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        keys = [k for k in a if k not in WALL_CLOCK]
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in keys)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_run_resumes_to_the_numbers_and_the_state_of_an_uninterrupted_one(script, sig, tmp_path, whole):
    """SIGTERM (to this process, which runs the entry point) as update k's line is printed stops the run after update
    k + 1, its state saved there; SIGKILL (to a subprocess) loses the updates since the last regular training state,
    which the resumed run does again, hiding what they logged. Either way the resumed run (a "resume" flag changed)
    logs, bit for bit, the scalars of a run never stopped, in an event file of a later second, the flags' table once,
    and ends with that run's weights, optimizers, random streams and envs (classic control's, MuJoCo's)."""
    flags, k = LONG[script]
    if sig == signal.SIGTERM:
        code, out, err = cli_in_process(script, flags, tmp_path, signal_at(f": update {k}/", sig))
        assert code == 143 and err == "\nSIGTERM: stopping at the next safe point (again: quit at once)\n", out + err
    else:
        assert stop_when_printed(f"{script}.py", *flags, cwd=tmp_path, line=f": update {k}/", sig=sig).returncode == -9
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))
    scalars, state = whole(script)
    stopped = torch.load(f"{run}/training_state.pt", weights_only=True)["update"]
    every = int(flags[flags.index("--checkpoint-every") + 1])
    assert stopped == k + 1 if sig == signal.SIGTERM else stopped % every == 0 and stopped < state["update"]
    code, out, err = cli_in_process(script, ["--resume", run, "--checkpoint-every", "4"], tmp_path)
    assert code == 0 and re.search(r"(\d+) of \1 steps", out) and "note:" not in out, out + err
    assert glob.glob(str(tmp_path / "runs" / "*")) == [run] and all_scalars(run) == scalars
    resumed = torch.load(f"{run}/training_state.pt", weights_only=True)
    assert resumed["update"] == state["update"] and same(resumed["objects"], state["objects"])
    assert same(resumed["random"], state["random"])
    seconds = sorted(int(f.split(".")[3]) for f in os.listdir(run) if f.startswith("events.out"))
    assert len(seconds) == 2 and seconds[1] > seconds[0]  # TensorBoard orders a run's event files by name
    texts = EventAccumulator(run, size_guidance={"tensors": 0})
    texts.Reload()
    assert len(texts.Tensors("hyperparameters/text_summary")) == 1


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("last", [False, True], ids=["first-update", "last-update"])
def test_a_signal_stops_the_run_after_its_update_and_a_stop_in_the_last_one_leaves_it_complete(
    script, last, tmp_path, monkeypatch
):
    """Ctrl-C during update 1, or SIGTERM during update 2 (the last), of a run: it stops after that update with exit
    128 + the signal, one line on stderr, no evaluation, its training state saved once every event of the updates it
    holds is on disk (records reach the disk here only when flushed); while it runs, its folder is locked by this
    process, its pid in the lock. Stopped in the first update, its last line says how to continue it (its model
    saved); in the last, the run is complete and says nothing of continuing. Resumed from inside its folder
    (`--resume .`: the run keeps its name) with its own --save-model, or with --save-model given now, it does the
    updates left, none again, saves its model and evaluates it."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    module, saves, held, sig = importlib.import_module(script), [], [], signal.SIGTERM if last else signal.SIGINT
    write, flush, save = RecordWriter.write, RecordWriter.flush, module.save_checkpoint

    def release(self):
        for data in held:
            write(self, data)
        held.clear()
        flush(self)

    def spy(path, checkpoint):
        if path.endswith("training_state.pt"):
            saves.append((checkpoint["update"], all_scalars(os.path.dirname(path), ignore=())))
        save(path, checkpoint)

    def on_print(text):
        if ": update 1/" in text if last else "logging to" in text:
            (lock,) = glob.glob(str(tmp_path / "runs" / "*" / ".lock"))
            with open(lock) as other:  # another process's attempt: an open file description of its own
                with pytest.raises(BlockingIOError):
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                assert other.read().strip() == str(os.getpid())
            signal.raise_signal(sig)

    with monkeypatch.context() as m:
        m.setattr(RecordWriter, "write", lambda self, data: held.append(data))
        m.setattr(RecordWriter, "flush", release)
        m.setattr(module, "save_checkpoint", spy)
        model = () if last else ("--save-model", "--eval-episodes", "2")
        code, out, err = cli_in_process(script, [*TINY[script], "--checkpoint-every", "1", *model], tmp_path, on_print)
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))
    rel, summary, logged = os.path.relpath(run, tmp_path), out.strip().splitlines()[-1], all_scalars(run, ignore=())
    assert code == 128 + sig and err == f"\n{sig.name}: stopping at the next safe point (again: quit at once)\n", (
        out + err
    )
    done, total = map(int, re.search(r"(\d+) of (\d+) steps", summary).groups())
    assert done * (1 if last else 2) == total and "eval:" not in out and not glob.glob(f"{run}/*.tmp*")
    assert summary.endswith(
        "; no checkpoint (no --save-model)"
        if last
        else f"; checkpoint saved to {rel}/{script}.pt; interrupted (continue it: --resume {rel})"
    )
    assert [u for u, _ in saves] == ([1, 2] if last else [1])
    for update, on_disk in saves:  # all that was logged up to the update's last step
        end = logged["charts/SPS"][update - 1][0]
        assert on_disk == {t: kept for t, p in logged.items() if (kept := [x for x in p if x[0] <= end])}, update
    with open(f"{run}/.lock") as other:  # the run is over: the folder is free
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    state = open(f"{run}/training_state.pt", "rb").read()
    code, out, err = cli_in_process(
        script, ["--resume", ".", *(("--save-model", "--eval-episodes", "2") if last else ())], run
    )
    name = os.path.basename(run)
    assert code == 0 and f"\n{name}: {total} of {total} steps" in out and "interrupted" not in out, out + err
    assert "over 2 of 2 episodes" in out and len(read_scalars(run, "eval/episodic_return")) == 2
    assert torch.load(f"{run}/{script}.pt", weights_only=True)["run_name"] == name
    assert len(read_scalars(run, "losses/value_loss")) == 2
    assert (open(f"{run}/training_state.pt", "rb").read() == state) == last  # (each update saves one)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "sig, at", [(signal.SIGINT, ": update 1/"), (signal.SIGTERM, ": update 1/"), (signal.SIGINT, "logging to")]
)
def test_a_second_signal_quits_at_once_and_says_where_the_last_training_state_is(script, sig, at, tmp_path):
    """Two signals as update 1 of 2 ends, with no training state saved yet (--checkpoint-every 10, the default) or one
    saved after it; or as the log opens, when the start removes its folder once the log's writer is closed (its
    thread would write into the folder as it goes)."""
    before, threads = sig == signal.SIGINT, set(threading.enumerate())
    flags = [*TINY[script], "--checkpoint-every", "10" if before else "1"]
    code, _, err = cli_in_process(script, flags, tmp_path, signal_at(at, sig, sig))
    runs = glob.glob(str(tmp_path / "runs" / "*"))
    state = os.path.relpath(f"{runs[0]}/training_state.pt", tmp_path) if runs else None
    where = "no training state was saved" if before else f"the last training state is {state} (update 1)"
    assert code == 128 + sig and err == (
        f"\n{sig.name}: stopping at the next safe point (again: quit at once)\n\n{sig.name} again: quitting at once "
        f"without saving; {where}\n"
    )
    if at == "logging to":  # nothing left, and nothing of the run's still running
        assert os.listdir(tmp_path) == [] and set(threading.enumerate()) <= threads
    else:
        assert os.path.exists(f"{tmp_path}/{state}") != before
        assert before or torch.load(f"{tmp_path}/{state}", weights_only=True)["update"] == 1


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("signals", [1, 2], ids=["one", "two"])
def test_a_signal_during_an_evaluation_stops_it_after_the_episode_and_a_second_quits(
    script, signals, tmp_path, made, monkeypatch
):
    """The signals arrive while the first episode's return is logged (trpo: with a perturbed evaluation to follow)."""
    from torch.utils.tensorboard import SummaryWriter

    add, sent, ckpt = SummaryWriter.add_scalar, [], made(script)["ckpt"]

    def add_then_signal(self, *a, **k):
        add(self, *a, **k)
        while len(sent) < signals:
            sent.append(signal.raise_signal(signal.SIGINT))

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_then_signal)
    perturbed = ["--eval-perturbations", "mass=2"] if script == "trpo_gpt2_halfcheetah" else []
    code, out, err = cli_in_process(script, ["--eval-checkpoint", ckpt, "--eval-episodes", "3", *perturbed], tmp_path)
    first = "\nSIGINT: stopping at the next safe point (again: quit at once)\n"
    assert code == 130 and err.startswith(first), out + err
    if signals == 1:
        assert err == first and "over 1 of 3 episodes" in out and "mass=2" not in out
    else:
        assert err[len(first) :].startswith("\nSIGINT again: quitting at once without saving; ") and "eval:" not in out


MODEL = {"ppo_cartpole": {"agent"}, "gpt2ppo_lunar": {"actor", "critic"}}  # what a --save-model checkpoint holds
MODEL["trpo_gpt2_halfcheetah"] = {"policy", "value_net", "obs_rms"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_checkpoint_evaluates_as_its_run_did_seeded_as_its_run_or_by_seed(script, tmp_path, made):
    """A --save-model checkpoint holds the run's flags and name and its model; --eval-checkpoint gives the returns the
    run's own evaluation gave, in a folder named after the run and its seeds: 10000 + the run's --seed, or --seed's."""
    run, ckpt = made(script)["run"], made(script)["ckpt"]
    saved = torch.load(ckpt, weights_only=True)
    assert saved["args"]["seed"] == 5 and saved["run_name"] == os.path.basename(run)
    assert set(saved["objects"]) == MODEL[script] and "update" not in saved
    for seed, first in (((), 10005), (("--seed", "2"), 10002)):
        code, out, err = cli_in_process(script, ["--eval-checkpoint", ckpt, "--eval-episodes", "1", *seed], tmp_path)
        (evaluation,) = glob.glob(f"{tmp_path}/runs/{os.path.basename(run)}-eval__{first}__*")
        assert code == 0 and f"seeds from {first}" in out, out + err
        returns = read_scalars(evaluation, "eval/episodic_return")
        assert len(returns) == 1 and (first != 10005 or returns == read_scalars(run, "eval/episodic_return"))


BOX2D = {  # four updates on an env whose state the scripts do not save (Box2D's world)
    "ppo_cartpole": ["--env-id", "LunarLander-v3", "--total-timesteps", "2048"],
    "gpt2ppo_lunar": ["--env-id", "LunarLander-v3", "--total-timesteps", "1024"],
    "trpo_gpt2_halfcheetah": ["--env-id", "LunarLanderContinuous-v3", "--total-timesteps", "800"]
    + ["--batch-size", "200"],
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_whose_envs_keep_no_state_resumes_with_new_episodes(script, tmp_path):
    """Stopped after its second of four updates and resumed, the run says that its episodes in progress start anew,
    starts them from its envs as made, logs every update once and no episode that began before the resume."""
    stop = signal_at(": update 1/", signal.SIGTERM)
    assert cli_in_process(script, [*TINY[script], *BOX2D[script]], tmp_path, stop)[0] == 143
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))
    state = torch.load(f"{run}/training_state.pt", weights_only=True)
    assert state["objects"]["envs"] is None and state["update"] == 2
    code, out, err = cli_in_process(script, ["--resume", run], tmp_path)
    env = BOX2D[script][1]
    assert code == 0 and f"note: {script}.py does not save {env}'s state: its episodes in progress start anew" in out
    steps = [step for step, _ in read_scalars(run, "losses/value_loss")]
    assert steps == [steps[0] * k for k in range(1, 5)], steps
    after = [(step, length) for step, length in read_scalars(run, "charts/episodic_length") if step > steps[1]]
    assert after and all(step - 2 * length >= steps[1] for step, length in after), after  # (2 envs)


VIDEO = {  # a run whose evaluation returns tell its episodes' steps (a reward of 1 a step: CartPole; InvertedPendulum's
    # but the one that ends it), the frames its env draws
    "ppo_cartpole": ([], (400, 600, 3), 0),
    "gpt2ppo_lunar": (["--env-id", "CartPole-v1"], (400, 600, 3), 0),
    "trpo_gpt2_halfcheetah": ([], (480, 480, 3), 1),
}


def wandb_run(path: str) -> dict:
    """An offline W&B run file's id and name, its config's keys, and each logged key (nested keys joined by '/') with
    the number of records holding it."""
    run = {"id": None, "name": None, "config": set(), "history": collections.Counter()}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, name=record.run.display_name)
            run["config"] |= {item.key for item in record.run.config.update}
        elif kind == "config":
            run["config"] |= {item.key for item in record.config.update}
        elif kind == "history":
            run["history"].update(item.key or "/".join(item.nested_key) for item in record.history.item)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_track_and_capture_video_record_the_run_its_resume_and_its_evaluations(script, tmp_path):
    """A tiny run with --track (W&B offline: no network, no login, a HOME of its own), --save-model and
    --capture-video, then (ppo_cartpole: the common machinery's resume, held once) its resume (complete: it evaluates
    again), each in a process of its own (W&B keeps its settings in the process that imported it); then
    --eval-checkpoint --capture-video of its model. W&B's files are in the run folder: the flags, the run's name and
    every TensorBoard scalar mirrored (the event files not copied), the resume in the same W&B run, with no update
    again. Each evaluation episode is a real MP4: the reset's frame and one a step, as the env draws them (MuJoCo
    through OSMesa, without a display)."""
    import imageio

    skip_without_renderer(script)
    env = {k: v for k, v in SCRIPT_ENV.items() if not k.startswith(("WANDB_", "MUJOCO_GL", "PYOPENGL", "DISPLAY"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", HOME=str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    extra, frame, uncounted = VIDEO[script]

    def mp4s(folder, episodes):
        lengths = [int(v) + uncounted for _, v in read_scalars(folder, "eval/episodic_return")]
        videos = sorted(glob.glob(f"{folder}/videos/*.mp4"))
        assert [os.path.basename(v) for v in videos] == [f"eval-episode-{i}.mp4" for i in range(episodes)]
        for video, length in zip(videos, lengths):  # the reset's frame and one a step (moviepy's clock may drop one)
            shapes = [f.shape for f in imageio.get_reader(video, "ffmpeg")]
            assert len(shapes) in (length, length + 1) and set(shapes) == {frame}, video

    def launch(*flags):
        return run_script(f"{script}.py", *flags, cwd=tmp_path, env=env).stdout

    launch(*TINY[script], *extra, "--track", "--save-model", "--capture-video", "--eval-episodes", "2")
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))
    mp4s(run, 2)
    resume = script == "ppo_cartpole"
    if resume:
        assert ": update" not in launch("--resume", run, "--eval-episodes", "1")
    assert sorted(os.listdir(tmp_path)) == ["home", "runs"]  # W&B's files in the run folder, no event file copied
    assert not glob.glob(f"{run}/wandb/**/*tfevents*", recursive=True)
    state = torch.load(f"{run}/training_state.pt", weights_only=True)
    trained, *resumed = map(wandb_run, sorted(glob.glob(f"{run}/wandb/offline-run-*/run-*.wandb")))
    assert len(resumed) == resume and trained["name"] == os.path.basename(run)
    assert set(state["args"]) <= trained["config"] and set(all_scalars(run, ignore=())) <= set(trained["history"])
    assert trained["history"]["videos/eval/path"] == 2
    for again in resumed:  # the same W&B run, its evaluation's video, no update again (the run was complete)
        assert again["id"] == trained["id"] and again["history"]["videos/eval/path"] >= 1
        assert not [key for key in again["history"] if key.startswith("losses/")]
    flags = ["--eval-checkpoint", f"{run}/{script}.pt", "--capture-video", "--eval-episodes", "1"]
    code, out, err = cli_in_process(script, flags, tmp_path)
    assert code == 0, out + err
    mp4s(glob.glob(f"{run}-eval__*")[0], 1)


@pytest.mark.parametrize("script", ["ppo_cartpole", "gpt2ppo_lunar"])  # (trpo's L-BFGS starts anew at each fit)
def test_an_optimizer_saved_with_other_settings_is_refused(script, tmp_path, made):
    """An optimizer's settings are what the run's flags make, compared by value (the learning rate, which a schedule
    sets each update, aside): a file whose Adam has amsgrad on is refused, not trained with."""
    (run,) = prepare(script, ["run"], tmp_path, made)
    amsgrad = lambda s: first(s, lambda d: "param_groups" in d)["param_groups"][0].update(amsgrad=True)  # noqa: E731
    damaged(f"{run}/training_state.pt", amsgrad)
    before = tree(tmp_path)
    code, out, err = cli_in_process(script, ["--resume", run], tmp_path)
    assert code == 2 and err.endswith("(its optimizer's amsgrad is True, not False as this run's flags make it).\n"), (
        err
    )
    assert tree(tmp_path) == before


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_videos_folder_that_refuses_its_files_ends_the_run_with_the_errors_sentence_last(script, tmp_path, made):
    """The recorder the failed evaluation left open is gone before the sentence is printed: its warning comes first,
    the sentence is the last line (a process of its own: the warning would come as the interpreter exits)."""
    skip_without_renderer(script)
    run = shutil.copytree(made(script)["run"], tmp_path / "run")
    (run / "videos").mkdir()
    if subprocess.run(["chattr", "+i", run / "videos"], capture_output=True).returncode:
        pytest.skip("chattr +i needs root and a file system that keeps the immutable flag")
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, f"{script}.py"), "--resume", run, "--save-model", "--capture-video"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        subprocess.run(["chattr", "-i", run / "videos"], check=True)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith("error: ") and "the last training state is" in last, proc.stderr
