"""The run machinery the three torch scripts share, one table over the three: a bad path, a damaged, foreign or
impossible file, a second process, a read-only or full disk, a signal during a save, a tracker that refuses to start,
a folder changed during the run. Each ends in one sentence and exit 2, with nothing written or lost."""

import contextlib
import glob
import importlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from conftest import ROOT, bad, cli_in_process

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
    "wandb_id": lambda s: s.update(wandb_id=torch.zeros(3)),
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
                threading.Timer(20, lambda p=path: open(p, "w").close()).start()
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


NOT_OURS, NO_FIT = "is not a checkpoint or training state of {script}.py", "does not fit this run of {script}.py: "


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "flags, message",
    [
        # flags
        bad(
            ("--exp-name", "../up"), "--exp-name must be a plain name other than training_state (its --save-model file"
        ),
        bad(("--exp-name", "x" * 240), "that keeps the run's folder names within 255 characters, got 'xxx"),
        bad(("--exp-name", "training_state"), "--exp-name must be a plain name other than training_state"),
        bad(("--seed", "-1"), "--seed must be in [0, 4294967295], got -1"),
        bad(("--seed", "1.5"), None),  # (tyro's own message)
        bad(("--total-timesteps", "0"), "--total-timesteps must be in [1, "),
        # --eval-checkpoint: a path that is no checkpoint of this script, or one that does not fit its own flags
        bad(("--eval-checkpoint", "missing"), "missing.pt: No such file or directory"),
        bad(("--eval-checkpoint", "folder"), "folder.pt' is not a regular file"),
        bad(("--eval-checkpoint", "fifo"), "fifo.pt' is not a regular file"),
        bad(("--eval-checkpoint", "loop"), "loop.pt: Too many levels of symbolic links"),
        bad(("--eval-checkpoint", "text"), NOT_OURS),
        bad(("--eval-checkpoint", "truncated"), NOT_OURS),
        bad(("--eval-checkpoint", "pickle"), NOT_OURS),
        bad(("--eval-checkpoint", "foreign"), NOT_OURS),
        bad(("--eval-checkpoint", "state"), "is a training state: continue its run with --resume "),
        bad(("--eval-checkpoint", "ckpt:nan"), NO_FIT + "it.objects."),
        bad(("--eval-checkpoint", "ckpt:shape"), NO_FIT + "it.objects."),
        bad(("--eval-checkpoint", "ckpt:dtype"), NO_FIT + "it.objects."),
        bad(("--eval-checkpoint", "ckpt:missing_object"), NO_FIT + "it.objects is not a dict of "),
        bad(("--eval-checkpoint", "ckpt:extra_key"), NO_FIT + "it is not a dict of "),
        bad(("--eval-checkpoint", "ckpt:other_version"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:mistyped_flag"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:bad_run_name"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:long_run_name"), "was made by another version of {script}.py"),
        bad(("--eval-checkpoint", "ckpt:float8"), NO_FIT + '"isfinite" not implemented for'),
        bad(("--eval-checkpoint", "ckpt", "--total-timesteps", "5"), "takes no training flags, got --total-timesteps"),
        # --resume: no run folder, other flags, a damaged training state, a held or read-only folder
        bad(("--resume", "nowhere"), "nowhere/training_state.pt: No such file or directory"),
        bad(("--resume", "run", "--seed", "9"), "--resume continues a run: --seed 9 is not its 5"),
        bad(("--resume", "run", "--eval-checkpoint", "x"), "takes no training flags, got --resume"),
        bad(("--resume", "run:nan"), NO_FIT + "it.objects."),
        bad(("--resume", "run:shape"), NO_FIT + "it.objects."),
        bad(("--resume", "run:missing_object"), NO_FIT + "it.objects is not a dict of "),
        bad(("--resume", "run:objects_list"), NO_FIT + "it.objects is not a dict of "),
        bad(("--resume", "run:extra_key"), NO_FIT + "it is not a dict of "),
        bad(("--resume", "run:other_version"), "was made by another version of {script}.py"),
        bad(("--resume", "run:past_budget"), NO_FIT + "its update is not within its budget"),
        bad(("--resume", "run:update_str"), NO_FIT + "its update is not within its budget"),
        bad(("--resume", "run:torch_rng"), NO_FIT + "it.random.torch is not a torch.uint8 tensor of shape"),
        bad(("--resume", "run:env_attribute"), NO_FIT + "it.objects.envs."),
        bad(("--resume", "run:env_none"), NO_FIT + "it.objects.envs."),
        bad(("--resume", "run:env_object"), NO_FIT + "a Tensor cannot replace its "),
        bad(("--resume", "run:float8"), NO_FIT),
        bad(("--resume", "run:sparse"), NO_FIT),
        bad(("--resume", "run:wandb_id"), NO_FIT + "it.wandb_id is tensor("),
        bad(("--resume", "run:torch_rng_content"), NO_FIT),
        bad(("--resume", "run:generator_state"), NO_FIT),
        bad(("--resume", "run:queue_count"), NO_FIT + "a queue of "),
        bad(("--resume", ""), "a path must be one line of text, got ''"),
        bad(("--resume", "a\nb"), "a path must be one line of text, got 'a\\nb'"),
        bad(("--eval-checkpoint", "bad\udcff"), "a path must be one line of text, got 'bad\\udcff'"),  # (undecodable)
        bad(("--resume", "locked"), "another process (pid 4242) is running "),
        bad(("--resume", "lock_link"), ".lock: Too many levels of symbolic links"),
        bad(("--resume", "lock_fifo"), ".lock: Illegal seek"),
        bad(("--resume", "read_only"), ".lock: Read-only file system"),
        # a run folder that cannot be made: a file named runs stands where the folder would go
        bad(("!runs_is_a_file",), ": Not a directory"),
        # a tracker that refuses to start: its own checks, before the run is left in a folder
        bad(("--track", "!wandb_mode_bogus"), "--track: W&B refused to start the run ("),
        bad(("--track", "!no_login"), "--track: W&B refused to start the run ("),
    ],
)
def test_hostile_input_ends_in_one_sentence_and_writes_nothing(script, flags, message, tmp_path, made, monkeypatch):
    if "!runs_is_a_file" in flags:
        (tmp_path / "runs").write_text("")
    if "!wandb_mode_bogus" in flags:
        monkeypatch.setenv("WANDB_MODE", "bogus")
    if "!no_login" in flags:  # no key, no netrc (a home without one), not offline, no terminal to ask at
        for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "no-home"))
    try:
        real = prepare(script, [f for f in flags if not f.startswith("!")], tmp_path, made)
        new_run = not any(f in ("--eval-checkpoint", "--resume") for f in real)
        args = [*TINY[script], *real] if new_run else real
        before = tree(tmp_path)
        if "--track" in args:  # in a process of its own: W&B keeps its settings in the process that imported it
            proc = subprocess.run(
                [sys.executable, os.path.join(ROOT, f"{script}.py"), *args],
                cwd=tmp_path,
                text=True,
                capture_output=True,
                timeout=300,
                stdin=subprocess.DEVNULL,
            )
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            code, out, err = cli_in_process(script, args, tmp_path)
        assert code == 2 and "Traceback" not in err, out + err
        if message is not None:
            assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
            assert message.format(script=script) in err, err
        assert tree(tmp_path) == before  # nothing written, in the folders given either
    finally:
        while LOCKS:
            LOCKS.pop().kill()
        while MOUNTS:
            subprocess.run(["umount", "--lazy", MOUNTS.pop()], check=True)


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
        f"error: '{run}/training_state.pt' was made by another version of {script}.py (its flags "
        "or run name differ).\n",
    )
    assert tree(tmp_path) == before


def stopped_run(script: str, cwd, flags=()) -> str:
    """A tiny run (with `flags`) stopped (a SIGTERM asked before it began) after its first of two updates: its run
    folder."""
    module = importlib.import_module(script)
    stop = module.StopSignal()
    stop.exit_status = 128 + signal.SIGTERM
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert (
                module.main(module.cli.__globals__["tyro"].cli(module.Args, args=[*TINY[script], *flags]), stop) == 143
            )
    finally:
        os.chdir(here)
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


def test_a_resume_whose_envs_keep_no_state_says_their_episodes_start_anew(tmp_path):
    """(The common text, so one script.) Box2D's envs hold no state the scripts save."""
    note = "note: ppo_cartpole.py does not save LunarLander-v3's state: its episodes in progress start anew"
    for env, cwd in (("LunarLander-v3", tmp_path / "box2d"), ("CartPole-v1", tmp_path / "classic")):
        cwd.mkdir()
        run = stopped_run("ppo_cartpole", cwd, ["--env-id", env])
        code, out, err = cli_in_process("ppo_cartpole", ["--resume", run], cwd)
        assert code == 0 and (note in out) == (env == "LunarLander-v3"), out + err


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


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_videos_folder_replaced_during_the_run_ends_it_in_one_sentence(script, tmp_path, made):
    """The videos folder is made where it is used, at the evaluation: a file standing there by then is one sentence
    naming it, the run's training state and checkpoint kept."""
    run = shutil.copytree(made(script)["run"], tmp_path / "run")
    (run / "videos").write_text("not a folder")
    state = (run / "training_state.pt").read_bytes()
    code, out, err = cli_in_process(script, ["--resume", run, "--save-model", "--capture-video"], tmp_path)
    assert code == 2 and err == f"error: {run}/videos: File exists.\n", out + err
    assert (run / "training_state.pt").read_bytes() == state and (run / f"{script}.pt").is_file()
