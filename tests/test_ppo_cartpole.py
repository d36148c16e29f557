import glob
import os
import signal
import time
from dataclasses import asdict, fields
from typing import Optional

import numpy as np
import pytest
import torch

import ppo_cartpole as ppo
from conftest import all_scalars, only_run_dir, read_scalars, run_script, same_numbers, stop_when_printed

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
    # the logits agree with torch's to float rounding (the draws above agree exactly)
    x = torch.from_numpy(obs)
    logits = x
    for m in agent.actor:
        logits = m(logits)
    layers = [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in agent.actor if hasattr(m, "weight")]
    h = obs
    for W, b in layers[:-1]:
        h = np.maximum(h @ W.T + b, 0.0)
    assert np.allclose(h @ layers[-1][0].T + layers[-1][1], logits.detach().numpy(), atol=1e-5)


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


def test_every_finished_episode_is_logged(tmp_path):
    cwd = str(tmp_path)
    out = run_script(
        "ppo_cartpole.py",
        "--total-timesteps",
        "2000",
        "--num-envs",
        "8",
        "--num-steps",
        "64",
        "--seed",
        "3",
        "--learning-rate",
        "1e-3",
        cwd=cwd,
    ).stdout
    assert "2048 of 2048 steps" in out  # the budget, rounded up to whole rollouts
    assert ("device: cuda" if torch.cuda.is_available() else "device: cpu") in out
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
    run_script("ppo_cartpole.py", "--total-timesteps", "40000", "--learning-rate", "1e-3", "--seed", "1", cwd=cwd)
    rets = [v for _, v in read_scalars(only_run_dir(cwd), "charts/episodic_return")]
    # a random policy averages ~22
    assert np.mean(rets[:20]) < 60
    assert np.mean(rets[-50:]) > 120, np.mean(rets[-50:])


def test_save_model_eval_equals_eval_checkpoint(tmp_path):
    cwd = str(tmp_path)
    out = run_script(
        "ppo_cartpole.py", "--total-timesteps", "1024", "--seed", "6", "--save-model", "--eval-episodes", "3", cwd=cwd
    ).stdout
    run = only_run_dir(cwd)
    ckpt = os.path.join(run, "ppo_cartpole.pt")
    assert "checkpoint saved to" in out and os.path.isfile(ckpt) and not glob.glob(ckpt + ".tmp*")
    in_run = out.split("eval: ")[1].split(" (")[0]
    out = run_script("ppo_cartpole.py", "--eval-checkpoint", ckpt, "--eval-episodes", "3", cwd=cwd).stdout
    assert out.split("eval: ")[1].split(" (")[0] == in_run and "seeds from 10006" in out
    (eval_run,) = glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10006__*"))
    assert [v for _, v in read_scalars(eval_run, "eval/episodic_return")] == [
        v for _, v in read_scalars(run, "eval/episodic_return")
    ]
    # --seed given with --eval-checkpoint replaces the training seed of the evaluation's seeds
    out = run_script(
        "ppo_cartpole.py", "--eval-checkpoint", ckpt, "--eval-episodes", "1", "--seed", "2", cwd=cwd
    ).stdout
    assert "seeds from 10002" in out and glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10002__*"))
    # and in this process: the guarded loader gives the same weights back
    agent, train, run_name = ppo.agent_from_checkpoint(ckpt)
    assert train["env_id"] == "CartPole-v1" and train["seed"] == 6 and run_name == os.path.basename(run)
    saved = torch.load(ckpt, weights_only=True)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in agent.state_dict().items())


# ---------------------------------------------------------------------------------------------
# Safeguards: hostile inputs end in one sentence, before anything is written
# ---------------------------------------------------------------------------------------------


def test_every_numeric_flag_has_a_range_and_the_defaults_pass():
    numeric = {f.name for f in fields(ppo.Args) if f.type in (int, float, Optional[int], Optional[float])}
    assert numeric == set(ppo.RANGES)
    ppo.check_args(ppo.Args())


def _checkpoint(folder, kind):
    """A checkpoint file in `folder`, good or spoiled as `kind` says."""
    path = os.path.join(folder, f"{kind}.pt")
    ckpt = {
        "model": ppo.Agent(4, 2).state_dict(),
        "args": asdict(ppo.Args(seed=1)),
        "run_name": "CartPole-v1__ppo_cartpole__1__1",
    }
    if kind == "missing_model":
        del ckpt["model"]
    elif kind == "mistyped_seed":
        ckpt["args"]["seed"] = "1"
    elif kind == "other_env":
        ckpt["args"]["env_id"] = "Acrobot-v1"
    elif kind == "misshapen":
        ckpt["model"]["actor.0.weight"] = torch.zeros(3, 3)
    elif kind == "nan_weights":
        ckpt["model"]["critic.0.bias"][0] = float("nan")
    elif kind == "unsafe_run_name":
        ckpt["run_name"] = "../../outside"
    elif kind == "foreign":
        ckpt = {"weights": [1, 2, 3]}
    elif kind == "pickle":
        ckpt = {"model": ppo.Args()}  # arbitrary objects: refused by weights_only loading
    if kind == "text":
        with open(path, "w") as f:
            f.write("not a checkpoint\n")
    elif kind != "missing_file":
        torch.save(ckpt, path)
    if kind == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return path


def _training_state(folder, kind):
    """A run folder holding a training state, good or spoiled as `kind` says."""
    folder.mkdir()
    args = ppo.Args(seed=1, total_timesteps=5120)
    envs = ppo.gym.wrappers.vector.RecordEpisodeStatistics(
        ppo.gym.vector.SyncVectorEnv(
            [ppo.make_env("CartPole-v1")] * 4, autoreset_mode=ppo.gym.vector.AutoresetMode.SAME_STEP
        )
    )
    obs = envs.reset(seed=1)[0]
    agent = ppo.Agent(4, 2)
    objects = dict(agent=agent, optimizer=torch.optim.Adam(agent.parameters()), action_rng=np.random.default_rng(1))
    state = ppo.training_state(args, 1, 512, {**objects, "envs": envs, "next_obs": obs})
    if kind == "foreign":
        state["script"] = "another.py"
    elif kind == "missing_key":
        del state["objects"]["optimizer"]
    elif kind == "misshapen":
        state["objects"]["agent"]["actor.0.weight"] = torch.zeros(3, 3)
    elif kind == "other_num_envs":  # the flags say 8 envs, the envs saved are 4
        state["args"]["num_envs"] = 8
    elif kind == "out_of_range":
        state["args"]["gamma"] = 2.0
    ppo.save_checkpoint(str(folder / "training_state.pt"), state)


def _bad(flags, message):
    return pytest.param(flags, message, id=" ".join(flags)[:60])


@pytest.mark.parametrize(
    "flags, message",
    [
        # numbers: one table of ranges, finite, seeds 0..2**32-1, sizes that fit in memory
        _bad(("--num-envs", "0"), "--num-envs must be in [1, 1024], got 0"),
        _bad(("--num-envs", "5000"), "--num-envs must be in [1, 1024], got 5000"),
        _bad(("--num-steps", "0"), "--num-steps must be in [1, 10000000], got 0"),
        _bad(("--update-epochs", "0"), "--update-epochs must be in [1, 10000], got 0"),
        _bad(("--num-minibatches", "0"), "--num-minibatches must be in [1, 10000000], got 0"),
        _bad(("--num-minibatches", "1000"), "--num-minibatches 1000 must divide the rollout of 512 samples"),
        _bad(("--num-minibatches", "512"), "--norm-adv needs minibatches of 2 samples or more, but 512 minibatches"),
        _bad(("--total-timesteps", "0"), "--total-timesteps must be in [1, 1000000000000], got 0"),
        _bad(("--total-timesteps", str(10**30)), "--total-timesteps must be in [1, 1000000000000]"),
        _bad(("--learning-rate", "inf"), "--learning-rate must be in (0, 1], got inf"),
        _bad(("--learning-rate", "nan"), "--learning-rate must be in (0, 1], got nan"),
        _bad(("--learning-rate", "0"), "--learning-rate must be in (0, 1], got 0.0"),
        _bad(("--gamma", "2"), "--gamma must be in [0, 1], got 2.0"),
        _bad(("--gae-lambda", "-0.5"), "--gae-lambda must be in [0, 1], got -0.5"),
        _bad(("--clip-coef", "0"), "--clip-coef must be in (0, 10], got 0.0"),
        _bad(("--ent-coef", "-0.1"), "--ent-coef must be in [0, 100], got -0.1"),
        _bad(("--vf-coef", "inf"), "--vf-coef must be in [0, 100], got inf"),
        _bad(("--max-grad-norm", "0"), "--max-grad-norm must be in (0, 1000000.0], got 0.0"),
        _bad(("--target-kl", "-inf"), "--target-kl must be in (0, 1000000.0], got -inf"),
        _bad(("--eval-episodes", "0"), "--eval-episodes must be in [1, 1000000], got 0"),
        _bad(("--torch-threads", "0"), "--torch-threads must be in [1, 1024], got 0"),
        _bad(("--checkpoint-every", "0"), "--checkpoint-every must be in [1, 1000000000], got 0"),
        _bad(("--seed", "-1"), "--seed must be in [0, 4294967295], got -1"),
        _bad(("--seed", str(2**32)), "--seed must be in [0, 4294967295], got 4294967296"),
        _bad(("--num-envs", "1024", "--num-steps", "10000000"), "over half of this machine's memory"),
        # run names are plain names
        _bad(("--exp-name", "../outside"), "--exp-name must be a plain name"),
        _bad(("--exp-name", "a/b"), "--exp-name must be a plain name"),
        _bad(("--exp-name", ".."), "--exp-name must be a plain name"),
        _bad(("--exp-name", ""), "--exp-name must be a plain name"),
        _bad(("--exp-name", "x" * 201), "--exp-name must be a plain name"),
        _bad(("--exp-name", "training_state"), "--exp-name training_state is the name of the run's training state"),
        # envs that do not exist or do not fit
        _bad(("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
        _bad(("--env-id", "CartPol-v1"), "Did you mean: `CartPole`.\n"),  # gymnasium's question, one full stop
        _bad(("--env-id", "Pendulum-v1"), "needs a flat Box observation and Discrete actions"),
        # flags that are not (or no longer) flags: tyro's own message, exit 2
        _bad(("--batch-size", "3"), None),
        _bad(("--track",), None),
        _bad(("--seed", "1.5"), None),
        # checkpoints: missing, foreign, spoiled; --eval-checkpoint takes no training flags
        _bad(("--eval-checkpoint", "ckpt:missing_file"), "cannot read the checkpoint"),
        _bad(("--eval-checkpoint", "given"), "not a regular file"),
        _bad(("--eval-checkpoint", "fifo"), "not a regular file"),
        _bad(("--eval-checkpoint", "ckpt:text"), "not a torch file"),
        _bad(("--eval-checkpoint", "ckpt:truncated"), "not a torch file"),
        _bad(("--eval-checkpoint", "ckpt:pickle"), "not a torch file"),
        _bad(("--eval-checkpoint", "ckpt:foreign"), "is not a ppo_cartpole.py checkpoint"),
        _bad(("--eval-checkpoint", "ckpt:missing_model"), "is not a ppo_cartpole.py checkpoint"),
        _bad(("--eval-checkpoint", "ckpt:mistyped_seed"), "is not a ppo_cartpole.py checkpoint"),
        _bad(("--eval-checkpoint", "ckpt:unsafe_run_name"), "is not a ppo_cartpole.py checkpoint"),
        _bad(("--eval-checkpoint", "ckpt:other_env"), "holds no network of this script's shapes for Acrobot-v1"),
        _bad(("--eval-checkpoint", "ckpt:misshapen"), "holds no network of this script's shapes"),
        _bad(("--eval-checkpoint", "ckpt:nan_weights"), "holds no network of this script's shapes"),
        _bad(
            ("--eval-checkpoint", "ckpt:good", "--num-envs", "8", "--save-model"),
            "takes no training flags, got --save-model --num-envs",
        ),
        _bad(("--eval-checkpoint", "ckpt:good", "--env-id", "Acrobot-v1"), "takes no training flags, got --env-id"),
        # --resume: a folder that is not a run of this script with these flags
        _bad(("--resume", "given"), "holds no training_state.pt"),
        _bad(("--resume", "nowhere"), "--resume nowhere is not a run folder"),
        _bad(("--resume", "resume:foreign"), "is not a training state of this version of ppo_cartpole.py"),
        _bad(("--resume", "resume:good", "--num-envs", "8"), "but --num-envs 8 differs from its 4"),
        _bad(("--resume", "resume:missing_key"), "is a damaged training state (no 'optimizer')"),
        _bad(("--resume", "resume:misshapen"), "is a damaged training state (Error(s) in loading state_dict"),
        _bad(("--resume", "resume:other_num_envs"), "env layers saved where the run's flags make"),
        _bad(("--resume", "resume:out_of_range"), "is a damaged training state (--gamma must be in [0, 1], got 2.0)"),
        _bad(("--resume", "resume:good", "--eval-checkpoint", "x"), "takes no training flags, got --resume"),
        # a run folder that cannot be made (a file named runs stands where the folder would go)
        _bad(("--total-timesteps", "512", "runs-is-a-file"), "cannot create the run folder"),
    ],
)
def test_hostile_input_ends_in_one_sentence_and_writes_nothing(tmp_path, monkeypatch, capsys, flags, message):
    given = tmp_path / "given"
    given.mkdir()
    if "runs-is-a-file" in flags:
        flags = tuple(f for f in flags if f != "runs-is-a-file")
        (tmp_path / "runs").write_text("")
    for f in flags:
        if f.startswith("resume:"):
            _training_state(given / f[7:], f[7:])
    if "fifo" in flags:  # a named pipe where the checkpoint should be: opening it would wait for a writer forever
        os.mkfifo(given / "fifo.pt")

    def path_of(f):  # the file or folder a flag value names
        if f.startswith("ckpt:"):
            return _checkpoint(str(given), f[5:])
        if f.startswith("resume:"):
            return str(given / f[7:])
        return {"given": str(given), "fifo": str(given / "fifo.pt")}.get(f, f)

    flags = [path_of(f) for f in flags]
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(given))
    monkeypatch.chdir(tmp_path)

    def no_training(*a, **kw):  # a row that got past the checks and the restore would log here: fail at once instead
        raise AssertionError("the run started")

    monkeypatch.setattr("torch.utils.tensorboard.SummaryWriter", no_training)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # the script's entry point, as its __main__ calls it (tyro's own errors exit 2 from inside it)
        code = ppo.cli(flags)
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
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(given))) == before  # nothing written


@pytest.mark.parametrize(
    "error, why",
    [
        (OSError(28, "No space left on device"), "No space left on device"),
        (RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed"), "is the disk full?"),
    ],
)
def test_a_failed_save_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch, capsys, error, why):
    path = tmp_path / "ppo_cartpole.pt"
    path.write_bytes(b"the previous checkpoint")

    def broken_save(obj, f):  # writes part of the file, then fails as a full disk does
        with open(f, "wb") as out:
            out.write(b"partial")
        raise error

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(ppo.UserError, match="could not save the checkpoint") as e:
        ppo.save_checkpoint(str(path), {"model": {}})
    assert f"{why}); the file there, if any, is unchanged" in str(e.value) and "enforce" not in str(e.value)
    assert os.listdir(tmp_path) == ["ppo_cartpole.pt"] and path.read_bytes() == b"the previous checkpoint"


def test_a_signal_during_evaluation_stops_after_the_episode(capsys):
    stop = ppo.StopSignal()

    class Writer:  # the signal arrives while the first episode is logged
        def add_scalar(self, tag, value, step):
            stop.handle(signal.SIGINT, None)

    ppo.evaluate(ppo.Agent(4, 2), "CartPole-v1", 5, 10_000, Writer(), stop)
    assert "over 1 of 5 episodes" in capsys.readouterr().out


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_after_the_update_keeps_the_checkpoint_and_exits_with_its_status(tmp_path, sig, code):
    # the first line is printed once the handler is in place and the run folder exists
    flags = ("--total-timesteps", "100000000", "--save-model")
    proc = stop_when_printed("ppo_cartpole.py", *flags, cwd=tmp_path, line="logging to runs/", sig=sig)
    err = proc.stderr.read()
    assert proc.returncode == code and "Traceback" not in err and "stopping at the next safe point" in err, err
    run = only_run_dir(str(tmp_path))
    assert os.path.isfile(os.path.join(run, "training_state.pt")) and not glob.glob(os.path.join(run, "*.tmp*"))
    agent, train, _ = ppo.agent_from_checkpoint(os.path.join(run, "ppo_cartpole.pt"))
    assert train["total_timesteps"] == 100000000 and len(read_scalars(run, "losses/policy_loss")) >= 1


@pytest.mark.parametrize("last", [False, True], ids=["updates-left", "during-the-last-update"])
def test_the_stop_message_says_continue_only_when_updates_remain(tmp_path, monkeypatch, capsys, last):
    """A signal during the last update stops a complete run: the exit status says a signal came, the summary line
    offers no --resume; with updates left it does. Either way the --save-model evaluation is skipped."""
    monkeypatch.chdir(tmp_path)
    stop, gae, updates = ppo.StopSignal(), ppo.compute_gae, []

    def gae_then_signal(*a):  # the signal arrives during update 1 or during update 2, the last
        updates.append(len(updates) + 1)
        if updates[-1] == (2 if last else 1):
            stop.handle(signal.SIGTERM, None)
        return gae(*a)

    monkeypatch.setattr(ppo, "compute_gae", gae_then_signal)
    assert ppo.main(ppo.Args(total_timesteps=1024, save_model=True), stop) == 143
    out = capsys.readouterr().out
    summary = out.strip().splitlines()[-1]
    assert ("1024 of 1024 steps" if last else "512 of 1024 steps") in summary and "checkpoint saved to" in summary
    assert ("interrupted (continue it: --resume" in summary) != last and "eval:" not in out
    run = only_run_dir(str(tmp_path))
    assert torch.load(os.path.join(run, "training_state.pt"), weights_only=True)["update"] == len(updates)


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


def test_run_folders_are_unique(tmp_path):
    names = {ppo.make_run_dir("CartPole-v1__ppo_cartpole__1", root=str(tmp_path)) for _ in range(3)}
    assert len(names) == 3 and all(os.path.isdir(tmp_path / n) for n in names)


# ---------------------------------------------------------------------------------------------
# Stopping and resuming
# ---------------------------------------------------------------------------------------------


def test_the_training_state_restores_exactly(tmp_path):
    """Save a state mid-episode, put it into freshly made objects, and save again: every tensor, random stream,
    counter and env attribute comes back the same, and both copies then step the same."""
    args = ppo.Args(num_envs=3, seed=7)
    make = [ppo.make_env("CartPole-v1") for _ in range(3)]
    mode = ppo.gym.vector.AutoresetMode.SAME_STEP

    def fresh():
        envs = ppo.gym.wrappers.vector.RecordEpisodeStatistics(ppo.gym.vector.SyncVectorEnv(make, autoreset_mode=mode))
        agent = ppo.Agent(4, 2)
        return envs, agent, torch.optim.Adam(agent.parameters(), eps=1e-5), np.random.default_rng(0)

    envs, agent, optimizer, rng = fresh()
    obs = envs.reset(seed=7)[0]
    for _ in range(30):  # some episodes end, the others are in progress
        obs = envs.step(rng.integers(0, 2, 3))[0]
    agent.get_value(torch.zeros(2, 4)).sum().backward()
    optimizer.step()
    np.random.rand(3)
    path = str(tmp_path / "state.pt")

    def objects(envs, agent, optimizer, rng):
        return dict(agent=agent, optimizer=optimizer, action_rng=rng, envs=envs)

    ppo.save_checkpoint(
        path, ppo.training_state(args, 5, 640, {**objects(envs, agent, optimizer, rng), "next_obs": obs})
    )
    twin_envs, twin_agent, twin_optimizer, twin_rng = fresh()
    twin_envs.reset(seed=123)
    twin = objects(twin_envs, twin_agent, twin_optimizer, twin_rng)
    state = ppo.load_checkpoint(path)
    iteration, step, values = ppo.restore_training_state(path, state, twin, {"next_obs": obs * 0}, args)
    twin_obs = values["next_obs"]
    assert (iteration, step) == (5, 640) and np.array_equal(twin_obs, obs)
    a = ppo.training_state(args, 5, 640, {**objects(envs, agent, optimizer, rng), "next_obs": obs})
    b = ppo.training_state(args, 5, 640, {**twin, "next_obs": twin_obs})
    assert repr(a) == repr(b)  # tensors, numbers and generator states alike
    for _ in range(40):  # and the two copies go on the same way
        action = rng.integers(0, 2, 3)
        assert np.array_equal(twin_rng.integers(0, 2, 3), action)
        one, two = envs.step(action), twin_envs.step(action)
        assert all(np.array_equal(x, y) for x, y in zip(one[:4], two[:4]))
    assert list(envs.return_queue) == list(twin_envs.return_queue)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_run_resumes_to_the_numbers_of_an_uninterrupted_one(tmp_path, sig):
    """SIGTERM saves the state at the update it stops after; SIGKILL loses the updates since the last checkpoint,
    which the resumed run does again, hiding their first logging. Either way the resumed run's TensorBoard series
    equal, bit for bit, those of a run that was never stopped."""
    flags = ["--total-timesteps", "20480", "--seed", "4", "--checkpoint-every", "5"]  # the last one before 12: 10
    (tmp_path / "stopped").mkdir()
    proc = stop_when_printed("ppo_cartpole.py", *flags, cwd=tmp_path / "stopped", line="update 12/40", sig=sig)
    run = only_run_dir(str(tmp_path / "stopped"))
    assert proc.returncode == (143 if sig == signal.SIGTERM else -9)
    out = run_script("ppo_cartpole.py", "--resume", run, cwd=str(tmp_path / "stopped")).stdout
    assert "20480 of 20480 steps" in out and only_run_dir(str(tmp_path / "stopped")) == run
    (tmp_path / "whole").mkdir()
    run_script("ppo_cartpole.py", *flags, cwd=str(tmp_path / "whole"))
    resumed, whole = all_scalars(run), all_scalars(only_run_dir(str(tmp_path / "whole")))
    assert len(whole["losses/policy_loss"]) == 40 and resumed == whole


def test_resuming_a_complete_run_finishes_it_with_the_flags_that_do_not_change_training(tmp_path):
    """A run killed after its last update is resumed, not refused: no update runs again, and --save-model given
    with --resume (the run had none) saves and evaluates the model."""
    cwd = str(tmp_path)
    run_script("ppo_cartpole.py", "--total-timesteps", "1024", "--seed", "2", cwd=cwd)
    run = only_run_dir(cwd)
    out = run_script("ppo_cartpole.py", "--resume", run, "--save-model", "--eval-episodes", "2", cwd=cwd).stdout
    assert "1024 of 1024 steps" in out and "checkpoint saved to" in out and "interrupted" not in out
    assert [step for step, _ in read_scalars(run, "losses/policy_loss")] == [512, 1024]
    assert os.path.isfile(os.path.join(run, "ppo_cartpole.pt")) and len(read_scalars(run, "eval/episodic_return")) == 2


def test_resume_dot_from_inside_the_run_folder_keeps_the_run_name(tmp_path):
    cwd = str(tmp_path)
    run_script("ppo_cartpole.py", "--total-timesteps", "512", "--save-model", "--eval-episodes", "1", cwd=cwd)
    run = only_run_dir(cwd)
    out = run_script("ppo_cartpole.py", "--resume", ".", cwd=run).stdout
    assert f"\n{os.path.basename(run)}: 512 of 512 steps" in out and "eval: " in out  # the run's --save-model
    _, _, run_name = ppo.agent_from_checkpoint(os.path.join(run, "ppo_cartpole.pt"))
    assert run_name == os.path.basename(run)
    out = run_script("ppo_cartpole.py", "--eval-checkpoint", "ppo_cartpole.pt", "--eval-episodes", "1", cwd=run).stdout
    assert f"logging to runs/{os.path.basename(run)}-eval__10001__" in out


def test_an_env_whose_state_is_not_saved_restarts_its_episodes_on_resume(tmp_path):
    """LunarLander's Box2D world is not in the training state: the resumed run resets its envs (seeded by the run's
    seed and the update), logs no cut-off episode and no step twice, and reaches its budget."""
    flags = ("--env-id", "LunarLander-v3", "--num-envs", "2", "--num-steps", "64", "--total-timesteps", "2560")
    flags += ("--checkpoint-every", "2", "--seed", "3")  # 20 updates of 128 steps, a line every 2
    proc = stop_when_printed("ppo_cartpole.py", *flags, cwd=tmp_path, line="update 2/20", sig=signal.SIGTERM)
    run = only_run_dir(str(tmp_path))
    state = torch.load(os.path.join(run, "training_state.pt"), weights_only=True)
    assert proc.returncode == 143 and state["objects"]["envs"] is None and state["update"] < 20
    out = run_script("ppo_cartpole.py", "--resume", run, cwd=str(tmp_path)).stdout
    assert "2560 of 2560 steps" in out
    assert [step for step, _ in read_scalars(run, "losses/policy_loss")] == [128 * k for k in range(1, 21)]
    lengths = read_scalars(run, "charts/episodic_length")
    after = [(step, length) for step, length in lengths if step > state["global_step"]]
    assert after and all(step - 2 * length >= state["global_step"] for step, length in after), after


def test_a_resumed_run_starts_its_event_file_in_a_later_second(tmp_path):
    """TensorBoard orders a run's event files by name, which starts with the second they were made in."""
    made = int(time.time())
    (tmp_path / f"events.out.tfevents.{made}.host.1.0").write_bytes(b"")
    ppo.wait_for_a_new_second(str(tmp_path))
    assert time.time() >= made + 1


def test_an_event_file_from_the_future_delays_a_resume_by_2_seconds_at_most(tmp_path, monkeypatch):
    (tmp_path / f"events.out.tfevents.{int(time.time()) + 3600}.host.1.0").write_bytes(b"")
    slept = []
    monkeypatch.setattr(ppo.time, "sleep", slept.append)
    ppo.wait_for_a_new_second(str(tmp_path))
    assert slept == [2.0]
