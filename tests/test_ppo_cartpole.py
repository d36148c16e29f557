import contextlib
import fcntl
import glob
import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, fields
from typing import Optional

import numpy as np
import pytest
import torch

import ppo_cartpole as ppo
from conftest import (
    all_scalars,
    checkpoint_file,
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
    # the guarded loader gives the same weights back
    agent, train, run_name = ppo.agent_from_checkpoint(ckpt)
    assert train["env_id"] == "CartPole-v1" and train["seed"] == 6 and run_name == os.path.basename(run)
    saved = torch.load(ckpt, weights_only=True)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in agent.state_dict().items())


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A tiny run with --track (W&B offline, no network, a home without credentials), --save-model and
    --capture-video; then its resume (complete: no update) and --eval-checkpoint --capture-video of its model.
    (working folder, run folder, the outputs)."""
    cwd = str(tmp_path_factory.mktemp("tracked"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("HOME", os.path.join(cwd, "home"))
        mp.delenv("WANDB_API_KEY", raising=False)
        flags = ("--total-timesteps", "512", "--save-model", "--capture-video", "--eval-episodes", "2", "--seed", "3")
        outs = [run_here(cwd, *flags, "--track")]
        run = only_run_dir(cwd)
        outs.append(run_here(cwd, "--resume", run))
    ckpt = os.path.join(run, "ppo_cartpole.pt")
    outs.append(run_here(cwd, "--eval-checkpoint", ckpt, "--capture-video", "--eval-episodes", "1"))
    return cwd, run, outs


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
    return checkpoint_file(path, kind, lambda p: torch.save(ckpt, p))


def _obj(state, name):
    return state["objects"][name]


DAMAGE = {  # a training state spoiled in one way: what Run.start must refuse before it writes anything
    "foreign": lambda s: s.update(script="another.py"),
    "unknown_key": lambda s: s.update(extra=1),
    "missing_key": lambda s: _obj(s, "agent") and s["objects"].pop("optimizer"),
    "misshapen": lambda s: _obj(s, "agent").update({"actor.0.weight": torch.zeros(3, 3)}),
    "other_num_envs": lambda s: s["args"].update(num_envs=8),  # the flags say 8 envs, the envs saved are 4
    "out_of_range": lambda s: s["args"].update(gamma=2.0),
    "update_str": lambda s: s.update(update="1"),
    "update_bool": lambda s: s.update(update=True),
    "step_float": lambda s: s.update(global_step=512.0),
    "negative": lambda s: s.update(update=-1, global_step=-512),
    "inconsistent": lambda s: s.update(global_step=1024),
    "past_budget": lambda s: s.update(update=11, global_step=11 * 512),
    "nan_weights": lambda s: _obj(s, "agent")["critic.0.bias"].__setitem__(0, float("nan")),
    "moment_shape": lambda s: _obj(s, "optimizer")["state"][0].update(exp_avg=torch.zeros(3)),
    "nan_moment": lambda s: _obj(s, "optimizer")["state"][2]["exp_avg"].__setitem__(0, float("inf")),
    "negative_moment": lambda s: _obj(s, "optimizer")["state"][2]["exp_avg_sq"].__setitem__(0, -1.0),
    "torch_rng": lambda s: s.update(torch_rng=torch.zeros(10, dtype=torch.uint8)),
    "numpy_rng": lambda s: s["numpy_rng"].__setitem__(1, 1000),
    "action_rng": lambda s: _obj(s, "action_rng").update(bit_generator="MT19937"),
    "env_shape": lambda s: _obj(s, "envs")[5].update(state=torch.zeros(5, dtype=torch.float64)),
    "env_counter": lambda s: _obj(s, "envs")[2].update(_elapsed_steps="7"),
    "env_nan": lambda s: _obj(s, "envs")[0]["episode_returns"].__setitem__(0, float("nan")),
    "env_layers": lambda s: _obj(s, "envs").pop(),
    "obs_shape": lambda s: s["objects"].update(next_obs=torch.zeros(3, 4)),
}


def _training_state(folder, kind):
    """A run folder holding a training state (after one update of 512 steps of a 5120-step run) and the lock file of
    the process that made it, good or spoiled as `kind` says."""
    folder.mkdir()
    args = ppo.Args(seed=1, total_timesteps=5120)
    envs = ppo.make_envs("CartPole-v1", 4)
    obs = envs.reset(seed=1)[0]
    agent = ppo.Agent(4, 2)
    optimizer = torch.optim.Adam(agent.parameters(), eps=1e-5, fused=True)
    agent.get_value(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # Adam's moments exist
    objects = dict(agent=agent, optimizer=optimizer, action_rng=np.random.default_rng(1), envs=envs, next_obs=obs)
    state = ppo.training_state(args, 1, 512, objects)
    DAMAGE.get(kind, lambda s: None)(state)
    ppo.save_checkpoint(str(folder / "training_state.pt"), state)
    (folder / ".lock").write_text("1\n")
    if kind == "symlink_loop":
        os.remove(folder / "training_state.pt")
        os.symlink("training_state.pt", folder / "training_state.pt")


def _mount(*args):
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} is not permitted here: {proc.stderr.strip()}")


def _files(root, folder_times=True):
    """Every file and folder under `root` with its size and modification time (a folder's time only with
    `folder_times`)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            keep = folder_times or name in files
            found[os.path.relpath(os.path.join(folder, name), root)] = (st.st_size, st.st_mtime_ns if keep else 0)
    return found


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
        # --track and --capture-video: what they need is checked before anything is made
        _bad(("--track", "!no_wandb"), "--track needs the wandb package (pip install wandb)"),
        _bad(
            ("--track", "!no_login"), "--track needs a way to log in to Weights & Biases: WANDB_API_KEY, `wandb login`"
        ),
        _bad(("--capture-video", "!no_pygame"), "--capture-video cannot render CartPole-v1 (pygame is not installed"),
        _bad(
            ("--eval-checkpoint", "ckpt:good", "--capture-video", "!no_pygame"), "install pygame (pip install pygame)"
        ),
        _bad(("--eval-checkpoint", "ckpt:good", "--track"), "takes no training flags, got --track"),
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
        _bad(("--resume", "resume:unknown_key"), "is a damaged training state (unknown keys extra)"),
        _bad(("--resume", "resume:missing_key"), "is a damaged training state (objects action_rng, agent, envs, next"),
        _bad(("--resume", "resume:misshapen"), "(agent.actor.0.weight is a torch.float32 tensor of shape (3, 3), not"),
        _bad(
            ("--resume", "resume:other_num_envs"),
            "damaged training state (global_step 512 is not update 1 times the 1024 steps of an update)",
        ),
        _bad(("--resume", "resume:out_of_range"), "is a damaged training state (--gamma must be in [0, 1], got 2.0)"),
        # every key, type, shape and range of a training state, against the run's flags and its fresh objects
        _bad(("--resume", "resume:update_str"), "damaged training state (its update is '1', not of type int)"),
        _bad(("--resume", "resume:update_bool"), "damaged training state (its update is True, not of type int)"),
        _bad(("--resume", "resume:step_float"), "damaged training state (its global_step is 512.0, not of type int)"),
        _bad(("--resume", "resume:negative"), "damaged training state (negative counters: update -1"),
        _bad(
            ("--resume", "resume:inconsistent"), "(global_step 1024 is not update 1 times the 512 steps of an update)"
        ),
        _bad(("--resume", "resume:past_budget"), "(update 11 is past the run's budget of 10 updates)"),
        _bad(("--resume", "resume:nan_weights"), "(agent.critic.0.bias holds a value that is not finite)"),
        _bad(("--resume", "resume:moment_shape"), "(optimizer.state[0].exp_avg has shape (3,), not (64, 4))"),
        _bad(("--resume", "resume:nan_moment"), "(optimizer.state[2].exp_avg holds a value that is not finite)"),
        _bad(("--resume", "resume:negative_moment"), "(optimizer.state[2].exp_avg_sq holds a negative value)"),
        _bad(("--resume", "resume:torch_rng"), "(torch_rng is a torch.uint8 tensor of shape (10,), not a torch.uint8"),
        _bad(("--resume", "resume:numpy_rng"), "(numpy_rng's position 1000 is outside [0, 624])"),
        _bad(("--resume", "resume:action_rng"), "(action_rng.bit_generator is 'MT19937', not 'PCG64')"),
        _bad(("--resume", "resume:env_shape"), "(envs[5].state is a Tensor, not a tensor of shape (4,))"),
        _bad(("--resume", "resume:env_counter"), "(envs[2]._elapsed_steps is '7', not a number)"),
        _bad(("--resume", "resume:env_nan"), "(envs[0].episode_returns holds a value that is not finite)"),
        _bad(("--resume", "resume:env_layers"), "(envs has 17 env layers, not 18)"),
        _bad(
            ("--resume", "resume:obs_shape"), "(next_obs is a torch.float32 tensor of shape (3, 4), not a torch.float32"
        ),
        _bad(("--resume", "resume:symlink_loop"), "(Too many levels of symbolic links)"),
        # the run folder: one process at a time, and writable before anything is written
        _bad(("--resume", "resume:locked"), f"another process (pid {os.getpid()}) is running "),
        _bad(("--resume", "resume:read_only"), "cannot write into the run folder "),
        _bad(("--resume", "resume:full_disk"), "(No space left on device)"),
        _bad(("--resume", "resume:videos_read_only", "--save-model", "--capture-video"), "into the videos folder "),
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
    mounted, held, full_disk = [], [], "resume:full_disk" in flags
    try:
        for f in flags:
            if f == "resume:full_disk":  # a tiny file system, filled up once the run folder is in it
                (given / "full_disk").mkdir()
                _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(given / "full_disk"))
                mounted.append(given / "full_disk")
            if f.startswith("resume:"):
                folder = given / f[7:]
                if f == "resume:full_disk":
                    folder = folder / "run"
                _training_state(folder, f[7:])
                if f == "resume:full_disk":
                    with open(given / "full_disk" / "filler", "wb", buffering=0) as filler:
                        with pytest.raises(OSError):
                            while True:
                                filler.write(b"\0" * 4096)
                if f in ("resume:read_only", "resume:videos_read_only"):
                    if f == "resume:videos_read_only":
                        folder = folder / "videos"
                        folder.mkdir()
                    _mount("--bind", str(folder), str(folder))
                    mounted.append(folder)
                    _mount("-o", "remount,ro,bind", str(folder))
                if f == "resume:locked":  # another process's lock: an open file description of its own
                    held.append(open(folder / ".lock", "w"))
                    fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held[-1].write(f"{os.getpid()}\n")
                    held[-1].flush()
        if "fifo" in flags:  # a named pipe where the checkpoint should be: opening it would wait for a writer forever
            os.mkfifo(given / "fifo.pt")

        def path_of(f):  # the file or folder a flag value names
            if f.startswith("ckpt:"):
                return _checkpoint(str(given), f[5:])
            if f.startswith("resume:"):
                return str(given / f[7:] / ("run" if f == "resume:full_disk" else ""))
            return {"given": str(given), "fifo": str(given / "fifo.pt")}.get(f, f)

        if "!no_wandb" in flags:  # as if the package were not installed
            monkeypatch.setitem(sys.modules, "wandb", None)
        if "!no_pygame" in flags:
            monkeypatch.setitem(sys.modules, "pygame", None)
        if "!no_login" in flags:  # no key, no netrc (a home without one), not offline
            for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL"):
                monkeypatch.delenv(name, raising=False)
            monkeypatch.setenv("HOME", str(tmp_path / "no-home"))
        flags = [path_of(f) for f in flags if not f.startswith("!")]
        # the probe of a full disk makes and removes a file: the folder's time changes, nothing in it does
        before = _files(tmp_path, folder_times=not full_disk)
        monkeypatch.chdir(tmp_path)

        def no_training(*a, **kw):  # a row that got past the checks and the restore would log here: fail at once
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
        assert _files(tmp_path, folder_times=not full_disk) == before  # nothing written or touched
    finally:
        for f in held:
            f.close()
        for folder in reversed(mounted):
            subprocess.run(["umount", "--lazy", str(folder)], check=True)  # even while a file in it is open


def test_a_signal_during_evaluation_stops_after_the_episode(capsys):
    stop = ppo.StopSignal()

    class Writer:  # the signal arrives while the first episode is logged
        def add_scalar(self, tag, value, step):
            stop.handle(signal.SIGINT, None)

    ppo.evaluate(ppo.Agent(4, 2), "CartPole-v1", 5, 10_000, Writer(), stop)
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
    agent, train, _ = ppo.agent_from_checkpoint(os.path.join(run, "ppo_cartpole.pt"))
    assert train["total_timesteps"] == 100000000 and len(read_scalars(run, "losses/policy_loss")) >= 1


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
    iteration, step, values = ppo.restore_training_state(state, twin, {"next_obs": obs * 0}, args)
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
    _, _, run_name = ppo.agent_from_checkpoint(os.path.join(run, "ppo_cartpole.pt"))
    assert run_name == os.path.basename(run)
    out = run_here(run, "--eval-checkpoint", "ppo_cartpole.pt", "--eval-episodes", "1")
    assert f"logging to runs/{os.path.basename(run)}-eval__10002__" in out


def test_an_env_whose_state_is_not_saved_restarts_its_episodes_on_resume(tmp_path):
    """LunarLander's Box2D world is not in the training state: the resumed run resets its envs (seeded by the run's
    seed and the update), logs no cut-off episode and no step twice, and reaches its budget."""
    flags = ("--env-id", "LunarLander-v3", "--num-envs", "2", "--num-steps", "32", "--total-timesteps", "1280")
    flags += ("--checkpoint-every", "2", "--seed", "3")  # 20 updates of 64 steps, a line every 2
    proc = stop_when_printed("ppo_cartpole.py", *flags, cwd=tmp_path, line="update 2/20", sig=signal.SIGTERM)
    run = only_run_dir(str(tmp_path))
    state = torch.load(os.path.join(run, "training_state.pt"), weights_only=True)
    assert proc.returncode == 143 and state["objects"]["envs"] is None and state["update"] < 20
    out = run_here(str(tmp_path), "--resume", run)
    assert "1280 of 1280 steps" in out
    assert [step for step, _ in read_scalars(run, "losses/policy_loss")] == [64 * k for k in range(1, 21)]
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
