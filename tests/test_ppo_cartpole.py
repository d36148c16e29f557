import contextlib
import fcntl
import glob
import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from typing import Optional

import numpy as np
import pytest
import torch

import ppo_cartpole as ppo
from conftest import (
    ROOT,
    SCRIPT_ENV,
    all_scalars,
    only_run_dir,
    read_scalars,
    run_script,
    same_numbers,
    stop_when_printed,
    wandb_records,
)
from conftest import bad as _bad

# ---------------------------------------------------------------------------------------------
# The math
# ---------------------------------------------------------------------------------------------


def test_value_loss_clipping():
    new, old, ret = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([3.0])
    assert ppo.value_loss(new, old, ret, 0.2, clip_vloss=False).item() == pytest.approx(0.5)
    # clipped prediction 0.2 -> error 2.8^2 is larger than 1^2
    assert ppo.value_loss(new, old, ret, 0.2, clip_vloss=True).item() == pytest.approx(0.5 * 2.8**2)


# compute_gae and clipped_surrogate_loss: hand-computed cases in tests/test_shared_math.py


def test_actor_is_three_relu_layers_with_softmax():
    agent = ppo.Agent(4, 2, hidden=16)
    linears = [m for m in agent.actor if isinstance(m, torch.nn.Linear)]
    relus = [m for m in agent.actor if isinstance(m, torch.nn.ReLU)]
    assert len(linears) == 4 and len(relus) == 3
    probs = agent.log_probs(torch.randn(5, 4)).exp()
    assert probs.shape == (5, 2)
    assert torch.allclose(probs.sum(-1), torch.ones(5))


def test_sample_categorical_matches_softmax():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[1.0, 3.0, 0.0 + 1e-12], [2.0, 1.0, 1.0]]))
    draws = np.stack([ppo.sample_categorical(logits, rng.random((2, 1))) for _ in range(20000)])
    freq0 = np.bincount(draws[:, 0], minlength=3) / len(draws)
    freq1 = np.bincount(draws[:, 1], minlength=3) / len(draws)
    assert np.allclose(freq0, [0.25, 0.75, 0.0], atol=0.015)
    assert np.allclose(freq1, [0.5, 0.25, 0.25], atol=0.015)


def torch_act(agent, obs, uniforms):
    """The plain torch version of Agent.act, its reference: the actor in torch, the same inverse-CDF draw."""
    with torch.inference_mode():
        return ppo.sample_categorical(agent.actor(torch.from_numpy(obs)).numpy(), uniforms)


def test_act_draws_the_actions_of_the_torch_actor_and_follows_every_change_of_its_weights():
    torch.manual_seed(0)
    agent, rng = ppo.Agent(4, 3, hidden=16), np.random.default_rng(0)
    optimizer = torch.optim.Adam(agent.parameters(), lr=0.05, fused=True)  # main's: its step leaves _version alone
    obs, uniforms = rng.standard_normal((256, 4)).astype(np.float32), rng.random((256, 1))

    def same_as_torch():
        return np.array_equal(agent.act(obs, uniforms), torch_act(agent, obs, uniforms))

    assert same_as_torch() and len(set(agent.act(obs, uniforms))) == 3
    for change in ("optimizer step", "load", "in-place edit"):
        before = agent.act(obs, uniforms)
        if change == "optimizer step":
            for _ in range(5):
                optimizer.zero_grad()
                agent.log_probs(torch.from_numpy(obs))[:, 0].sum().backward()
                optimizer.step()
        elif change == "load":
            agent.load_state_dict(ppo.Agent(4, 3, hidden=16).state_dict())
        else:
            with torch.no_grad():
                agent.actor[-1].bias.add_(torch.tensor([3.0, 0.0, -3.0]))
        assert not np.array_equal(agent.act(obs, uniforms), before), change
        assert same_as_torch(), change
    # act's copy keeps torch's layout, W of shape (out, in), and its x @ W.T rounds as a product with a row-ordered
    # (in, out) copy does, for one env as for many: the bits the same-numbers runs are made with
    copy = agent._numpy_actor[1]
    assert [W.shape for W, _ in copy] == [tuple(m.weight.shape) for m in agent.actor if hasattr(m, "weight")]
    for rows in (1, 4):
        x = y = obs[:rows]
        for i, (W, b) in enumerate(copy):
            x, y = x @ W.T + b, y @ np.ascontiguousarray(W.T) + b
            x, y = (np.maximum(x, 0.0), np.maximum(y, 0.0)) if i < len(copy) - 1 else (x, y)
        assert np.array_equal(x, y), rows
        with torch.inference_mode():  # and torch's logits to float rounding
            assert np.allclose(x, agent.actor(torch.from_numpy(obs[:rows])).numpy(), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Runs: the same numbers as before the redesign, every episode logged, learning, checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ("--total-timesteps", "2048", "--seed", "3"),  # the default path
        # Acrobot: episodes of a new policy run into the 500-step time limit, so truncations are bootstrapped; the other
        # options; the evaluation after --save-model
        (
            "--env-id",
            "Acrobot-v1",
            "--total-timesteps",
            "2048",
            "--seed",
            "5",
            "--num-envs",
            "2",
            "--num-minibatches",
            "8",
            "--update-epochs",
            "3",
            "--target-kl",
            "0.005",
            "--no-clip-vloss",
            "--no-norm-adv",
            "--no-anneal-lr",
            "--save-model",
            "--eval-episodes",
            "2",
        ),
    ],
    ids=["default", "acrobot-options-eval"],
)
def test_same_numbers_as_the_baseline(tmp_path, flags):
    old, new = same_numbers("ppo_cartpole.py", *flags, tmp_path=tmp_path)
    lengths = [v for _, v in read_scalars(new, "charts/episodic_length")]
    if "Acrobot-v1" in flags:
        assert 500 in lengths and len(read_scalars(old, "eval/episodic_return")) == 2
    else:
        assert len(lengths) > 20


def run_here(cwd, *flags: str) -> str:
    """The script's entry point in this process (its imports paid once for the module), in `cwd` as a user runs it;
    its standard output. The signal handlers it installs are put back afterwards; it must exit 0."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    here, out = os.getcwd(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            code = ppo.cli(list(flags))
    finally:
        os.chdir(here)
        for s, h in handlers.items():
            signal.signal(s, h)
    assert code == 0, out.getvalue()[-3000:]
    return out.getvalue()


def test_every_finished_episode_is_logged(tmp_path):
    cwd = str(tmp_path)
    flags = ("--total-timesteps", "2000", "--num-envs", "8", "--num-steps", "64", "--seed", "3")
    out = run_here(cwd, *flags, "--learning-rate", "1e-3", "--checkpoint-every", "1")
    assert "2048 of 2048 steps" in out  # the budget, rounded up to whole rollouts
    assert ("device: cuda" if torch.cuda.is_available() else "device: cpu") in out
    # a progress line at every tenth of the 4 updates (every update) but the last, which the final line reports
    assert [line.split(": ")[1].split(",")[0] for line in out.splitlines() if ": update " in line] == [
        f"update {u}/4" for u in (1, 2, 3)
    ]
    assert ", 1536 steps, " in out and "steps/s, mean return of the last " in out
    run = only_run_dir(cwd)
    rets = read_scalars(run, "charts/episodic_return")
    lens = read_scalars(run, "charts/episodic_length")
    assert len(rets) == len(lens)
    # CartPole gives +1 per step, so each episode's return equals its length ...
    assert [v for _, v in rets] == [v for _, v in lens]
    # ... and with 8 envs several episodes end on the same step; none may be lost: the logged
    # lengths account for every step except those of the episodes still running at the end.
    steps_in_finished = sum(v for _, v in lens)
    assert 2048 - 8 * 500 <= steps_in_finished <= 2048
    assert steps_in_finished > 2048 - 8 * 60  # random-ish policy: unfinished tails are short
    same_step = len(rets) - len({s for s, _ in rets})
    assert same_step > 0, "expected at least two episodes ending on the same step"
    for tag in (
        "charts/SPS",
        "losses/policy_loss",
        "losses/value_loss",
        "losses/entropy",
        "losses/approx_kl",
        "losses/clipfrac",
        "losses/explained_variance",
        "charts/learning_rate",
        "time/rollout_seconds",
    ):
        assert read_scalars(run, tag), tag


def test_learns_cartpole(tmp_path):
    cwd = str(tmp_path)
    run_here(cwd, "--total-timesteps", "40000", "--learning-rate", "1e-3", "--seed", "1")
    rets = [v for _, v in read_scalars(only_run_dir(cwd), "charts/episodic_return")]
    # a random policy averages ~22
    assert np.mean(rets[:20]) < 60
    assert np.mean(rets[-50:]) > 120, np.mean(rets[-50:])


def test_save_model_eval_equals_eval_checkpoint(tmp_path):
    cwd = str(tmp_path)
    out = run_here(cwd, "--total-timesteps", "1024", "--seed", "6", "--save-model", "--eval-episodes", "3")
    run = only_run_dir(cwd)
    ckpt = os.path.join(run, "ppo_cartpole.pt")
    assert "checkpoint saved to" in out and os.path.isfile(ckpt) and not glob.glob(ckpt + ".tmp*")
    in_run = out.split("eval: ")[1].split(" (")[0]
    out = run_here(cwd, "--eval-checkpoint", ckpt, "--eval-episodes", "3")
    assert out.split("eval: ")[1].split(" (")[0] == in_run and "seeds from 10006" in out
    (eval_run,) = glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10006__*"))
    assert [v for _, v in read_scalars(eval_run, "eval/episodic_return")] == [
        v for _, v in read_scalars(run, "eval/episodic_return")
    ]
    # --seed given with --eval-checkpoint replaces the training seed of the evaluation's seeds
    out = run_here(cwd, "--eval-checkpoint", ckpt, "--eval-episodes", "1", "--seed", "2")
    assert "seeds from 10002" in out and glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10002__*"))
    # the checkpoint: the run's flags and name, and the agent's weights
    saved = torch.load(ckpt, weights_only=True)
    assert saved["args"]["env_id"] == "CartPole-v1" and saved["args"]["seed"] == 6
    assert saved["run_name"] == os.path.basename(run) and set(saved["objects"]) == {"agent"}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A tiny run with --track (W&B offline, no network, a home without credentials), --save-model and
    --capture-video; then its resume (complete: no update) and --eval-checkpoint --capture-video of its model.
    (working folder, run folder, the outputs)."""
    cwd = str(tmp_path_factory.mktemp("tracked"))
    env = {k: v for k, v in SCRIPT_ENV.items() if not k.startswith("WANDB_")}  # (its own process: W&B keeps its
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", HOME=os.path.join(cwd, "home"))  # settings in one)

    def run(*flags):
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "ppo_cartpole.py"), *flags],
            cwd=cwd,
            env=env,
            text=True,
            capture_output=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    flags = ("--total-timesteps", "512", "--save-model", "--capture-video", "--eval-episodes", "2", "--seed", "3")
    outs = [run(*flags, "--track")]
    folder = only_run_dir(cwd)
    outs.append(run("--resume", folder))
    outs.append(
        run("--eval-checkpoint", os.path.join(folder, "ppo_cartpole.pt"), "--capture-video", "--eval-episodes", "1")
    )
    return cwd, folder, outs


def test_track_mirrors_the_scalars_and_the_flags_into_an_offline_wandb_run_that_a_resume_continues(tracked):
    cwd, run, _ = tracked
    assert not glob.glob(
        os.path.join(run, "wandb", "**", "events.out.tfevents.*"), recursive=True
    )  # scalars mirrored, event files not copied
    first, again = sorted(glob.glob(os.path.join(run, "wandb", "offline-run-*")))  # W&B's files: in the run folder
    run_id = torch.load(os.path.join(run, "training_state.pt"), weights_only=True)["wandb_id"]
    assert first.endswith(f"-{run_id}") and again.endswith(f"-{run_id}")  # the resume continued the same W&B run
    history, config, names = set(), set(), set()
    for record in wandb_records(glob.glob(os.path.join(first, "run-*.wandb"))[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history |= {item.key or "/".join(item.nested_key) for item in record.history.item}
        elif kind == "run":
            config |= {item.key for item in record.run.config.update}
            names.add(record.run.display_name)
        elif kind == "config":
            config |= {item.key for item in record.config.update}
    assert names == {os.path.basename(run)} and {f.name for f in fields(ppo.Args)} <= config
    assert set(all_scalars(run, ignore=())) <= history  # every TensorBoard scalar, eval/episodic_return included
    assert "losses/policy_loss" in history and "charts/episodic_return" in history and "videos/eval/path" in history
    assert not glob.glob(os.path.join(cwd, "wandb")) and not glob.glob(os.path.join(run, "wandb", "**", "*.tfevents*"))


def test_capture_video_records_every_evaluation_episode_as_an_mp4(tracked):
    import imageio

    cwd, run, outs = tracked
    eval_runs = glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10003__*"))
    assert len(eval_runs) == 1 and "videos in " in outs[0] and "videos in " in outs[2]
    for folder, episodes in ((run, 2), (eval_runs[0], 1)):
        lengths = [v for _, v in read_scalars(folder, "eval/episodic_return")]  # CartPole: return = length
        videos = sorted(glob.glob(os.path.join(folder, "videos", "*.mp4")))
        assert [os.path.basename(v) for v in videos] == [f"eval-episode-{i}.mp4" for i in range(episodes)]
        for video, length in zip(videos, lengths):
            shapes = [frame.shape for frame in imageio.get_reader(video, "ffmpeg")]
            # the reset's frame and one per step, as CartPole renders them
            assert len(shapes) == length + 1 and set(shapes) == {(400, 600, 3)}, video


# ---------------------------------------------------------------------------------------------
# Safeguards: hostile inputs end in one sentence, before anything is written
# ---------------------------------------------------------------------------------------------


def test_every_numeric_flag_has_a_range_and_the_defaults_pass():
    numeric = {f.name for f in fields(ppo.Args) if f.type in (int, float, Optional[int], Optional[float])}
    assert numeric == set(ppo.RANGES)
    ppo.check_args(ppo.Args())


@pytest.mark.parametrize(
    "flags, message",
    [
        # this script's numbers, choices and combinations (the common rows: tests/test_machinery.py)
        _bad(("--num-envs", "0"), "--num-envs must be in [1, 4096], got 0"),
        _bad(("--num-envs", "5000"), "--num-envs must be in [1, 4096], got 5000"),
        _bad(("--num-steps", "0"), "--num-steps must be in [1, 1000000000000], got 0"),
        _bad(("--update-epochs", "0"), "--update-epochs must be in [1, 1000000000000], got 0"),
        _bad(("--num-minibatches", "1000"), "--num-minibatches 1000 must divide the rollout of 512 samples"),
        _bad(
            ("--num-minibatches", "512"), "(into minibatches of 2 or more with --norm-adv: one advantage's std is nan)"
        ),
        _bad(("--learning-rate", "inf"), "--learning-rate must be in (0, 1000000.0], got inf"),
        _bad(("--learning-rate", "nan"), "--learning-rate must be in (0, 1000000.0], got nan"),
        _bad(("--learning-rate", "0"), "--learning-rate must be in (0, 1000000.0], got 0.0"),
        _bad(("--gamma", "2"), "--gamma must be in [0, 1], got 2.0"),
        _bad(("--gae-lambda", "-0.5"), "--gae-lambda must be in [0, 1], got -0.5"),
        _bad(("--clip-coef", "0"), "--clip-coef must be in (0, 1000000.0], got 0.0"),
        _bad(("--ent-coef", "-0.1"), "--ent-coef must be in [0, 1000000.0], got -0.1"),
        _bad(("--target-kl", "-inf"), "--target-kl must be in (0, 1000000.0], got -inf"),
        _bad(("--num-envs", "1024", "--num-steps", "1000000000"), "this machine lacks the memory this run needs"),
        _bad(("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
        _bad(("--env-id", "CartPol-v1"), "Did you mean: `CartPole`"),  # gymnasium's question, one sentence
        _bad(("--env-id", "Pendulum-v1"), "needs a flat Box observation and Discrete actions"),
        _bad(("--batch-size", "3"), None),  # (not a flag: tyro's own message)
        _bad(("--capture-video", "!no_pygame"), "--capture-video cannot render CartPole-v1 ("),
        _bad(("--capture-video", "!no_moviepy"), "moviepy"),
    ],
)
def test_hostile_input_ends_in_one_sentence_and_writes_nothing(tmp_path, monkeypatch, capsys, flags, message):
    for package in ("pygame", "moviepy"):  # as if the package were not installed
        if f"!no_{package}" in flags:
            monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.chdir(tmp_path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # the script's entry point, as its __main__ calls it (tyro's own errors exit 2 from inside it)
        code = ppo.cli([f for f in flags if not f.startswith("!")])
    except SystemExit as e:
        code = e.code
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    if message is not None:
        assert err.strip().startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert message in err, err
    assert os.listdir(tmp_path) == []  # nothing written


def test_a_signal_during_evaluation_stops_after_the_episode(capsys):
    stop = ppo.StopSignal()

    class Writer:  # the signal arrives while the first episode is logged
        def add_scalar(self, tag, value, step):
            stop.handle(signal.SIGINT, None)

    ppo.evaluate({"agent": ppo.Agent(4, 2)}, "CartPole-v1", ppo.Args(eval_episodes=5), 10_000, Writer(), stop)
    assert "over 1 of 5 episodes" in capsys.readouterr().out


def test_a_signal_stops_after_the_update_keeps_the_checkpoint_and_exits_with_its_status(tmp_path):
    """Ctrl-C, delivered by the system (SIGTERM: the stopped-run tests below and the stop message test)."""
    # the first line is printed once the handler is in place and the run folder exists
    flags = ("--total-timesteps", "100000000", "--save-model")
    proc = stop_when_printed("ppo_cartpole.py", *flags, cwd=tmp_path, line="logging to runs/", sig=signal.SIGINT)
    err = proc.stderr.read()
    assert proc.returncode == 130 and "Traceback" not in err and "stopping at the next safe point" in err, err
    run = only_run_dir(str(tmp_path))
    assert os.path.isfile(os.path.join(run, "training_state.pt")) and not glob.glob(os.path.join(run, "*.tmp*"))
    saved = torch.load(os.path.join(run, "ppo_cartpole.pt"), weights_only=True)
    assert saved["args"]["total_timesteps"] == 100000000 and len(read_scalars(run, "losses/policy_loss")) >= 1


@pytest.mark.parametrize("last", [False, True], ids=["updates-left", "during-the-last-update"])
def test_the_stop_message_says_continue_only_when_updates_remain(tmp_path, monkeypatch, capsys, last):
    """A signal during the last update stops a complete run: the exit status says a signal came, the summary line
    offers no --resume; with updates left it does. Either way the --save-model evaluation is skipped. While the run
    goes, its folder is locked by this process; a second signal quits at once and says where the last state is."""
    monkeypatch.chdir(tmp_path)
    stop, gae, updates = ppo.StopSignal(), ppo.compute_gae, []

    def gae_then_signal(*a):  # the signal arrives during update 1 or during update 2, the last
        updates.append(len(updates) + 1)
        if updates[-1] == (2 if last else 1):
            stop.handle(signal.SIGTERM, None)
        lock = os.path.join(only_run_dir(str(tmp_path)), ".lock")
        with open(lock) as other:  # another process's attempt: an open file description of its own
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert other.read().strip() == str(os.getpid())
        return gae(*a)

    monkeypatch.setattr(ppo, "compute_gae", gae_then_signal)
    assert ppo.main(ppo.Args(total_timesteps=1024, save_model=True), stop) == 143
    out, err = capsys.readouterr()
    summary = out.strip().splitlines()[-1]
    assert ("1024 of 1024 steps" if last else "512 of 1024 steps") in summary and "checkpoint saved to" in summary
    assert ("interrupted (continue it: --resume" in summary) != last and "eval:" not in out
    assert err == "\nSIGTERM: stopping at the next safe point (again: quit at once)\n"
    run = only_run_dir(str(tmp_path))
    path = os.path.join("runs", os.path.basename(run), "training_state.pt")
    assert torch.load(path, weights_only=True)["update"] == len(updates) and not glob.glob(f"{run}/*.tmp*")
    with open(os.path.join(run, ".lock")) as other:  # the run is over: the folder is free
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(SystemExit) as e:
        stop.handle(signal.SIGINT, None)
    assert e.value.code == 130 and capsys.readouterr().err == (
        f"\nSIGINT again: quitting at once without saving; the last training state is {path} (update {len(updates)})\n"
    )


def test_a_second_signal_before_any_training_state_says_so(capsys):
    stop = ppo.StopSignal()
    stop.handle(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as e:
        stop.handle(signal.SIGTERM, None)
    assert e.value.code == 143
    assert capsys.readouterr().err.endswith(
        "\nSIGTERM again: quitting at once without saving; no training state was saved\n"
    )


def test_the_logged_events_are_on_disk_before_each_training_state(tmp_path, monkeypatch):
    """A SIGKILL after a training state is saved loses no event of the updates it holds: the event file is flushed
    first (here its records reach the disk only when flushed, as a buffered file's do)."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    write, flush, held, on_disk = RecordWriter.write, RecordWriter.flush, [], []

    def release(self):
        for data in held:
            write(self, data)
        held.clear()
        flush(self)

    monkeypatch.setattr(RecordWriter, "write", lambda self, data: held.append(data))
    monkeypatch.setattr(RecordWriter, "flush", release)
    save = ppo.save_checkpoint

    def count_then_save(path, checkpoint):
        on_disk.append(len(read_scalars(os.path.dirname(path), "losses/policy_loss")))
        save(path, checkpoint)

    monkeypatch.setattr(ppo, "save_checkpoint", count_then_save)
    monkeypatch.chdir(tmp_path)
    ppo.main(ppo.Args(total_timesteps=1536, checkpoint_every=1))
    assert on_disk == [1, 2, 3]


def test_run_folders_are_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {ppo.make_run_dir("CartPole-v1__ppo_cartpole__1") for _ in range(3)}
    assert len(names) == 3 and all(os.path.isdir(tmp_path / "runs" / n) for n in names)


# ---------------------------------------------------------------------------------------------
# Stopping and resuming
# ---------------------------------------------------------------------------------------------


def test_the_training_state_restores_exactly(tmp_path):
    """Save a state mid-episode, put it into freshly made objects, and save again: every tensor, random stream,
    counter and env attribute comes back the same, and both copies then step the same."""
    args = ppo.Args(num_envs=3, seed=7)

    def fresh():
        agent = ppo.Agent(4, 2)
        optimizer = torch.optim.Adam(agent.parameters(), eps=1e-5)
        objects = dict(agent=agent, optimizer=optimizer, action_rng=np.random.default_rng(0))
        return {**objects, "envs": ppo.make_envs("CartPole-v1", 3), "next_obs": np.zeros((3, 4), np.float32)}

    run, twin = ppo.Run(args, ppo.StopSignal()), ppo.Run(args, ppo.StopSignal())
    run.objects, run.run_name = fresh(), "run"
    envs, rng = run.objects["envs"], run.objects["action_rng"]
    run.objects["next_obs"] = envs.reset(seed=7)[0]
    for _ in range(30):  # some episodes end, the others are in progress
        run.objects["next_obs"] = envs.step(rng.integers(0, 2, 3))[0]
    x = torch.zeros(2, 4)
    (run.objects["agent"].get_value(x).sum() + run.objects["agent"].log_probs(x).sum()).backward()
    run.objects["optimizer"].step()
    np.random.rand(3)
    ppo.save_checkpoint(str(tmp_path / "training_state.pt"), run.training_state(5))
    twin.objects, twin.run_dir, twin.state = fresh(), str(tmp_path), ppo.load_checkpoint(tmp_path / "training_state.pt")
    twin.objects["envs"].reset(seed=123)
    np.random.rand(5)
    twin.restore()
    assert twin.update == 5 and np.array_equal(twin.objects["next_obs"], run.objects["next_obs"])
    assert repr(twin.training_state(5)) == repr(run.training_state(5))  # tensors, numbers, generator states alike
    for _ in range(40):  # and the two copies go on the same way
        action = rng.integers(0, 2, 3)
        assert np.array_equal(twin.objects["action_rng"].integers(0, 2, 3), action)
        one, two = envs.step(action), twin.objects["envs"].step(action)
        assert all(np.array_equal(x, y) for x, y in zip(one[:4], two[:4]))
    assert list(envs.return_queue) == list(twin.objects["envs"].return_queue)


RESUMED = ("--total-timesteps", "2560", "--num-steps", "32", "--seed", "4", "--checkpoint-every", "5")  # 20 updates


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The scalars of a run of RESUMED's flags that was never stopped."""
    cwd = str(tmp_path_factory.mktemp("whole"))
    run_script("ppo_cartpole.py", *RESUMED, cwd=cwd)
    return all_scalars(only_run_dir(cwd))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_run_resumes_to_the_numbers_of_an_uninterrupted_one(tmp_path, sig, uninterrupted):
    """SIGTERM saves the state at the update it stops after; SIGKILL loses the updates since the last checkpoint
    (the last one before 12: 10), which the resumed run does again, hiding their first logging. Either way the resumed
    run's TensorBoard series equal, bit for bit, those of a run that was never stopped."""
    proc = stop_when_printed("ppo_cartpole.py", *RESUMED, cwd=tmp_path, line="update 12/20", sig=sig)
    run = only_run_dir(str(tmp_path))
    assert proc.returncode == (143 if sig == signal.SIGTERM else -9)
    out = run_script("ppo_cartpole.py", "--resume", run, cwd=str(tmp_path)).stdout
    assert "2560 of 2560 steps" in out and only_run_dir(str(tmp_path)) == run
    resumed = all_scalars(run)
    assert len(uninterrupted["losses/policy_loss"]) == 20 and resumed == uninterrupted


def test_resuming_a_complete_run_from_inside_its_folder_finishes_it_and_clears_a_killed_save(tmp_path):
    """A run killed after its last update is resumed, not refused: no update runs again, --save-model given with
    --resume (the run had none) saves and evaluates the model, `--resume .` keeps the run's name, and the temporary
    file that a save killed before its rename left behind is removed."""
    cwd = str(tmp_path)
    run_here(cwd, "--total-timesteps", "512", "--seed", "2")
    run = only_run_dir(cwd)
    stale = os.path.join(run, "training_state.pt.tmp99999")
    with open(stale, "wb") as f:
        f.write(b"half a training state")
    out = run_here(run, "--resume", ".", "--save-model", "--eval-episodes", "2")
    assert f"\n{os.path.basename(run)}: 512 of 512 steps" in out and "checkpoint saved to" in out
    assert "interrupted" not in out and not os.path.exists(stale)
    assert [step for step, _ in read_scalars(run, "losses/policy_loss")] == [512]
    assert os.path.isfile(os.path.join(run, "ppo_cartpole.pt")) and len(read_scalars(run, "eval/episodic_return")) == 2
    assert torch.load(os.path.join(run, "ppo_cartpole.pt"), weights_only=True)["run_name"] == os.path.basename(run)
    out = run_here(run, "--eval-checkpoint", "ppo_cartpole.pt", "--eval-episodes", "1")
    assert f"logging to runs/{os.path.basename(run)}-eval__10002__" in out


def test_an_env_whose_state_is_not_saved_restarts_its_episodes_on_resume(tmp_path):
    """LunarLander's Box2D world is not in the training state: the resumed run starts new episodes from the envs as
    main made them, logs no cut-off episode and no step twice, and reaches its budget."""
    flags = ("--env-id", "LunarLander-v3", "--num-envs", "2", "--num-steps", "32", "--total-timesteps", "1280")
    flags += ("--checkpoint-every", "2", "--seed", "3")  # 20 updates of 64 steps, a line every 2
    proc = stop_when_printed("ppo_cartpole.py", *flags, cwd=tmp_path, line="update 2/20", sig=signal.SIGTERM)
    run = only_run_dir(str(tmp_path))
    state = torch.load(os.path.join(run, "training_state.pt"), weights_only=True)
    assert proc.returncode == 143 and state["objects"]["envs"] is None and state["update"] < 20
    out = run_here(str(tmp_path), "--resume", run)
    assert "1280 of 1280 steps" in out
    assert [step for step, _ in read_scalars(run, "losses/policy_loss")] == [64 * k for k in range(1, 21)]
    lengths, stopped_at = read_scalars(run, "charts/episodic_length"), state["update"] * 64
    after = [(step, length) for step, length in lengths if step > stopped_at]
    assert after and all(step - 2 * length >= stopped_at for step, length in after), after


def test_a_resumed_run_starts_its_event_file_in_a_later_second(tmp_path):
    """TensorBoard orders a run's event files by name, which starts with the second they were made in: a run resumed
    at once writes its new event file in a later second than the last one."""
    cwd = str(tmp_path)
    run_here(cwd, "--total-timesteps", "512")
    run_here(cwd, "--resume", only_run_dir(cwd))
    seconds = sorted(int(f.split(".")[3]) for f in os.listdir(only_run_dir(cwd)) if f.startswith("events.out"))
    assert len(seconds) == 2 and seconds[1] > seconds[0]


def test_an_event_file_from_the_future_delays_a_resume_by_2_seconds_at_most(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert ppo.main(ppo.Args(total_timesteps=512)) == 0
    run = only_run_dir(str(tmp_path))
    open(os.path.join(run, f"events.out.tfevents.{int(time.time()) + 3600}.host.1.0"), "wb").close()
    slept = []
    monkeypatch.setattr(ppo.time, "sleep", slept.append)
    assert ppo.main(ppo.Args(resume=run)) == 0 and slept == [2.0]
