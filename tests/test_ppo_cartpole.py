import glob
import os

import numpy as np
import pytest
import torch

import ppo_cartpole as ppo
from conftest import only_run_dir, read_scalars, run_script


def test_value_loss_clipping():
    new, old, ret = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([3.0])
    assert ppo.value_loss(new, old, ret, 0.2, clip_vloss=False).item() == pytest.approx(0.5)
    # clipped prediction 0.2 -> error 2.8^2 is larger than 1^2
    assert ppo.value_loss(new, old, ret, 0.2, clip_vloss=True).item() == pytest.approx(0.5 * 2.8 ** 2)


def test_actor_is_three_relu_layers_with_softmax():
    agent = ppo.Agent(4, 2, hidden=16)
    linears = [m for m in agent.actor if isinstance(m, torch.nn.Linear)]
    relus = [m for m in agent.actor if isinstance(m, torch.nn.ReLU)]
    assert len(linears) == 4 and len(relus) == 3
    probs = agent.log_probs(torch.randn(5, 4)).exp()
    assert probs.shape == (5, 2)
    assert torch.allclose(probs.sum(-1), torch.ones(5))


def _short(seed, *extra):
    return ("--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "128", "--seed", str(seed),
            "--learning-rate", "1e-3", *extra)


def test_seeded_runs_are_identical(tmp_path):
    returns = []
    for k in range(2):
        cwd = str(tmp_path / f"r{k}")
        os.makedirs(cwd)
        run_script("ppo_cartpole.py", *_short(7), cwd=cwd)
        returns.append(read_scalars(only_run_dir(cwd), "charts/episodic_return"))
    assert len(returns[0]) > 20
    assert returns[0] == returns[1]


def test_every_finished_episode_is_logged(tmp_path):
    cwd = str(tmp_path)
    run_script("ppo_cartpole.py", *_short(3, "--num-envs", "8", "--num-steps", "64"), cwd=cwd)
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
    for tag in ("charts/SPS", "losses/policy_loss", "losses/value_loss", "losses/entropy",
                "losses/approx_kl", "losses/clipfrac", "losses/explained_variance", "charts/learning_rate"):
        assert read_scalars(run, tag), tag


def test_learns_cartpole(tmp_path):
    cwd = str(tmp_path)
    run_script("ppo_cartpole.py", "--total-timesteps", "40000", "--learning-rate", "1e-3", "--seed", "1", cwd=cwd)
    rets = [v for _, v in read_scalars(only_run_dir(cwd), "charts/episodic_return")]
    # a random policy averages ~22; seeds 1-5 reach 240-313 over their last 100 episodes here
    assert np.mean(rets[:20]) < 60
    assert np.mean(rets[-50:]) > 120, np.mean(rets[-50:])


def test_checkpoint_save_load_evaluate(tmp_path):
    cwd = str(tmp_path)
    out = run_script("ppo_cartpole.py", *_short(5, "--save-model", "--eval-episodes", "3"), cwd=cwd).stdout
    ckpts = glob.glob(os.path.join(cwd, "runs", "*", "ppo_cartpole.pt"))
    assert len(ckpts) == 1 and "eval:" in out
    # the checkpoint loads in another process and evaluates
    out = run_script("ppo_cartpole.py", "--eval-checkpoint", ckpts[0], "--eval-episodes", "4", cwd=cwd).stdout
    assert "over 4 episodes" in out
    eval_runs = glob.glob(os.path.join(cwd, "runs", "*-eval__*"))
    assert len(eval_runs) == 1
    assert len(read_scalars(eval_runs[0], "eval/episodic_return")) == 4
    # and in this process: same weights, same greedy returns as evaluate() computes
    agent, train_args = ppo.load_checkpoint(ckpts[0])
    assert train_args["env_id"] == "CartPole-v1" and train_args["seed"] == 5
    r1 = ppo.evaluate(agent, "CartPole-v1", 2, seed=0)
    r2 = ppo.evaluate(agent, "CartPole-v1", 2, seed=0)
    assert r1 == r2 and all(r >= 1 for r in r1)


@pytest.mark.parametrize("flags, message", [
    (("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
    (("--env-id", "Pendulum-v1"), "needs a Discrete action space"),
    (("--eval-checkpoint", "missing.pt"), "does not exist"),
    (("--num-minibatches", "1000", "--total-timesteps", "1024"), "--num-minibatches 1000 must divide"),
    pytest.param(("--cuda",), "torch sees no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is present")),
    pytest.param(("--eval-checkpoint", "missing.pt", "--cuda"), "torch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")),
])
def test_bad_input_one_clear_sentence(tmp_path, flags, message):
    proc = run_script("ppo_cartpole.py", *flags, cwd=str(tmp_path), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sample_categorical_matches_softmax():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[1.0, 3.0, 0.0 + 1e-12], [2.0, 1.0, 1.0]]))
    draws = np.stack([ppo.sample_categorical(logits, rng) for _ in range(20000)])
    freq0 = np.bincount(draws[:, 0], minlength=3) / len(draws)
    freq1 = np.bincount(draws[:, 1], minlength=3) / len(draws)
    assert np.allclose(freq0, [0.25, 0.75, 0.0], atol=0.015)
    assert np.allclose(freq1, [0.5, 0.25, 0.25], atol=0.015)


def test_numpy_actor_matches_torch_actor():
    # the rollout samples from a numpy copy of the actor: it must compute the same logits
    torch.manual_seed(0)
    agent = ppo.Agent(4, 3, hidden=16)
    x = torch.randn(7, 4)
    expected = agent.actor(x).detach().numpy()
    layers = agent.actor_layers_numpy()
    got = ppo.mlp_forward_numpy(layers, x.numpy())
    assert got.shape == (7, 3)
    assert np.allclose(got, expected, atol=1e-5)
    # a snapshot, not a view: changing the module afterwards leaves the copy as it was, and a
    # fresh export sees the change
    with torch.no_grad():
        agent.actor[0].weight.add_(1.0)
    assert np.array_equal(ppo.mlp_forward_numpy(layers, x.numpy()), got)
    assert not np.allclose(ppo.mlp_forward_numpy(agent.actor_layers_numpy(), x.numpy()), got, atol=1e-3)


def test_capture_video_without_moviepy_is_one_clear_sentence(tmp_path, script="ppo_cartpole.py"):
    import importlib.util

    if importlib.util.find_spec("moviepy") is not None:
        pytest.skip("moviepy is installed here, so --capture-video records instead of failing")
    proc = run_script(script, "--capture-video", "--total-timesteps", "4096", cwd=str(tmp_path), check=False)
    assert proc.returncode != 0
    assert "--capture-video needs the moviepy package" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# Issue 15: bad numbers, evaluation seeds, run names, Ctrl-C
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    (dict(num_envs=0), "--num-envs must be >= 1"),
    (dict(num_steps=0), "--num-steps must be >= 1"),
    (dict(num_minibatches=0), "--num-minibatches 0 must divide"),
    (dict(num_envs=3, num_steps=5, num_minibatches=4), "--num-minibatches 4 must divide"),  # was 5 of 3
    (dict(update_epochs=0), "--update-epochs must be >= 1"),
    (dict(learning_rate=-1.0), "--learning-rate must be > 0"),
    (dict(hidden_size=0), "--hidden-size must be >= 1"),
    (dict(gamma=2.0), "--gamma must be in [0, 1]"),
    (dict(gae_lambda=1.5), "--gae-lambda must be in [0, 1]"),
    (dict(clip_coef=0.0), "--clip-coef must be > 0"),
    (dict(ent_coef=-0.1), "--ent-coef must be >= 0"),
    (dict(vf_coef=-1.0), "--vf-coef must be >= 0"),
    (dict(max_grad_norm=0.0), "--max-grad-norm must be > 0"),
    (dict(target_kl=-0.01), "--target-kl must be > 0"),
    (dict(eval_episodes=0), "--eval-episodes must be >= 1"),
    (dict(total_timesteps=0), "--total-timesteps must be >= 1"),
    (dict(torch_threads=0), "--torch-threads must be >= 1"),
    (dict(progress_every=-5), "--progress-every must be >= 0"),
])
def test_check_args_one_sentence_per_bad_number(kw, message):
    import re

    with pytest.raises(SystemExit, match=re.escape(message)):
        ppo.check_args(ppo.Args(**kw))
    ppo.check_args(ppo.Args())  # the defaults are fine


def test_track_without_wandb_is_one_sentence(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit, match="--track needs the wandb package"):
        ppo.check_args(ppo.Args(track=True))


def test_budget_rounds_up_to_whole_rollouts_and_summary_states_steps_run(tmp_path):
    assert ppo.num_rollouts(500_000, 512) == 977 and ppo.num_rollouts(2048, 512) == 4
    out = run_script("ppo_cartpole.py", "--total-timesteps", "600", "--num-steps", "128", cwd=str(tmp_path)).stdout
    assert "2 rollouts of 512 steps = 1024 steps (--total-timesteps 600 rounded up to whole rollouts)" in out
    assert ": 1024 steps, mean return of the last" in out


def test_run_time_fields_are_not_flags_and_bad_numbers_leave_no_run_folder(tmp_path):
    for flag in ("--batch-size", "--minibatch-size", "--num-iterations"):
        proc = run_script("ppo_cartpole.py", flag, "3", cwd=str(tmp_path), check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, flag
    proc = run_script("ppo_cartpole.py", "--num-minibatches", "1000", "--total-timesteps", "1024", cwd=str(tmp_path),
                      check=False)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "runs")


def test_eval_seed_rule_and_unique_run_dirs(tmp_path):
    assert ppo.eval_seed(5) == 10005 and ppo.eval_seed(5, 2) == 10002
    names = {ppo.make_run_dir("CartPole-v1__ppo_cartpole__1", root=str(tmp_path)) for _ in range(3)}
    assert len(names) == 3 and all(os.path.isdir(tmp_path / n) for n in names)
    assert ppo.returns_text([]) == "no episode has finished yet"


def test_save_model_eval_equals_eval_checkpoint(tmp_path):
    cwd = str(tmp_path)
    out = run_script("ppo_cartpole.py", *_short(6, "--save-model", "--eval-episodes", "3", "--no-eval-greedy"),
                     cwd=cwd).stdout
    run = only_run_dir(cwd)
    ckpt = os.path.join(run, "ppo_cartpole.pt")
    torch.load(ckpt, weights_only=True)
    in_run = out.split("eval: ")[1].split(" over")[0]
    out = run_script("ppo_cartpole.py", "--eval-checkpoint", ckpt, "--eval-episodes", "3", "--no-eval-greedy",
                     cwd=cwd).stdout
    assert out.split(": ")[1].split(" over")[0] == in_run
    assert len(glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10006__*"))) == 1
    proc = run_script("ppo_cartpole.py", "--eval-checkpoint", run, cwd=cwd, check=False)
    assert proc.returncode != 0 and "is a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_saves_checkpoint_closes_and_exits_with_one_line(tmp_path):
    from test_gpt2ppo_lunar import interrupt_after_first_update

    cwd = str(tmp_path)
    rc, out, err = interrupt_after_first_update("ppo_cartpole.py", ("--total-timesteps", "100000000", "--save-model",
                                                                     "--no-progress"), cwd)
    assert rc == 130 and "Traceback" not in err, err
    last = out.strip().splitlines()[-1]
    assert "interrupted after" in last and "checkpoint saved to" in last
    agent, a = ppo.load_checkpoint(glob.glob(os.path.join(cwd, "runs", "*", "ppo_cartpole.pt"))[0])
    assert a["env_id"] == "CartPole-v1"
    assert read_scalars(only_run_dir(cwd), "losses/policy_loss")
