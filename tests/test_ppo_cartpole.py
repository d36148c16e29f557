import contextlib
import io
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch

import ppo_cartpole as ppo
from conftest import bad as _bad
from conftest import only_run_dir, read_scalars, same_numbers

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
# Runs: the same numbers as before the redesign, every episode logged, learning
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


# ---------------------------------------------------------------------------------------------
# Safeguards: hostile inputs end in one sentence, before anything is written
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        # this script's numbers, choices and combinations (the common rows: tests/test_machinery.py)
        _bad(("--num-envs", "0"), "--num-envs must be in [1, 4096], got 0"),
        _bad(("--num-envs", "5000"), "--num-envs must be in [1, 4096], got 5000"),
        _bad(("--num-steps", "0"), "--num-steps must be in [1, 1e12], got 0"),
        _bad(("--update-epochs", "0"), "--update-epochs must be in [1, 1e12], got 0"),
        _bad(("--num-minibatches", "1000"), "--num-minibatches 1000 must divide the rollout of 512 samples"),
        _bad(
            ("--num-minibatches", "512"), "(into minibatches of 2 or more with --norm-adv: one advantage's std is nan)"
        ),
        _bad(("--learning-rate", "inf"), "--learning-rate must be in (0, 1e6], got inf"),
        _bad(("--learning-rate", "nan"), "--learning-rate must be in (0, 1e6], got nan"),
        _bad(("--learning-rate", "0"), "--learning-rate must be in (0, 1e6], got 0.0"),
        _bad(("--gamma", "2"), "--gamma must be in [0, 1], got 2.0"),
        _bad(("--gae-lambda", "-0.5"), "--gae-lambda must be in [0, 1], got -0.5"),
        _bad(("--clip-coef", "0"), "--clip-coef must be in (0, 1e6], got 0.0"),
        _bad(("--ent-coef", "-0.1"), "--ent-coef must be in [0, 1e6], got -0.1"),
        _bad(("--target-kl", "-inf"), "--target-kl must be in (0, 1e6], got -inf"),
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


# ---------------------------------------------------------------------------------------------
# Stopping and resuming (what every torch script does: tests/test_machinery.py)
# ---------------------------------------------------------------------------------------------


def test_an_event_file_from_the_future_delays_a_resume_by_2_seconds_at_most(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert ppo.main(ppo.Args(total_timesteps=512)) == 0
    run = only_run_dir(str(tmp_path))
    open(os.path.join(run, f"events.out.tfevents.{int(time.time()) + 3600}.host.1.0"), "wb").close()
    slept = []
    monkeypatch.setattr(ppo.time, "sleep", slept.append)
    assert ppo.main(ppo.Args(resume=run)) == 0 and slept == [2.0]
