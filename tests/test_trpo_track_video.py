"""`--track` (Weights & Biases, offline here: no network) and `--capture-video` (MP4s of the evaluation episodes,
MuJoCo through OSMesa without a display): real runs read back with W&B's own record format and imageio."""

import ctypes.util
import glob
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SCRIPT_ENV, read_scalars, wandb_records

SCRIPT = os.path.join(ROOT, "trpo_gpt2_halfcheetah.py")
TINY = ("--policy", "mlp", "--env-id", "InvertedPendulum-v5", "--num-envs", "2", "--batch-size", "10")
TINY += ("--total-timesteps", "20", "--no-cuda")
needs_osmesa = pytest.mark.skipif(ctypes.util.find_library("OSMesa") is None, reason="OSMesa is not installed")


def run(cwd, *flags, **env):
    """The script in a subprocess in `cwd`, with W&B offline and silent and a HOME of its own (no real netrc)."""
    home = os.path.join(cwd, "home")
    os.makedirs(home, exist_ok=True)
    environ = {k: v for k, v in SCRIPT_ENV.items() if not k.startswith(("WANDB_", "MUJOCO_GL", "PYOPENGL"))}
    environ.update(HOME=home, WANDB_SILENT="true", **env)
    environ.pop("DISPLAY", None)
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], cwd=cwd, env=environ, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One tiny run with --track (offline), --save-model and --capture-video: 2 updates, 2 evaluation episodes."""
    cwd = str(tmp_path_factory.mktemp("tracked"))
    if ctypes.util.find_library("OSMesa") is None:
        pytest.skip("OSMesa is not installed")
    proc = run(cwd, *TINY, "--track", "--save-model", "--capture-video", "--eval-episodes", "2", WANDB_MODE="offline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = glob.glob(os.path.join(cwd, "runs", "*"))
    return cwd, run_dir, proc


@needs_osmesa
def test_track_offline_mirrors_the_scalars_and_the_flags_into_the_run_folder(tracked_run):
    cwd, run_dir, _ = tracked_run
    assert not glob.glob(
        os.path.join(run_dir, "wandb", "**", "events.out.tfevents.*"), recursive=True
    )  # scalars mirrored, event files not copied
    (wandb_file,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    history, config = set(), set()
    for record in wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history |= {item.key or "/".join(item.nested_key) for item in record.history.item}
        elif kind == "run":
            config |= {item.key for item in record.run.config.update}
        elif kind == "config":
            config |= {item.key for item in record.config.update}
    scalars = {"charts/episodic_return", "losses/kl", "losses/value_loss", "losses/surrogate", "eval/episodic_return"}
    assert scalars <= history, history
    assert {"env_id", "seed", "policy", "max_kl", "track", "capture_video"} <= config, config
    # the training state keeps the W&B run's id, which a resumed run continues
    state = torch.load(os.path.join(run_dir, "training_state.pt"), weights_only=True)
    assert wandb_file.endswith(f"-{state['wandb_id']}.wandb")
    # nothing of W&B's outside the run folder but its own debug logs under HOME
    assert sorted(os.listdir(cwd)) == ["home", "runs"]


@needs_osmesa
def test_capture_video_records_each_evaluation_episode_as_an_mp4(tracked_run):
    import imageio

    _, run_dir, proc = tracked_run
    videos = sorted(glob.glob(os.path.join(run_dir, "videos", "*.mp4")))
    assert [os.path.basename(v) for v in videos] == ["eval-episode-0.mp4", "eval-episode-1.mp4"]
    lengths = [int(v) for _, v in read_scalars(run_dir, "eval/episodic_return")]  # InvertedPendulum: 1 a step
    for path, length in zip(videos, lengths):
        reader = imageio.get_reader(path, "ffmpeg")
        assert reader.count_frames() == length + 1  # the reset's frame, then one a step
        assert reader.get_data(0).shape == (480, 480, 3)


def test_a_broken_mujoco_gl_setting_is_one_sentence_before_anything_is_made(tmp_path):
    """MuJoCo reads MUJOCO_GL when it is first imported: a value it does not know fails the env's check, before the
    renderer's (one frame) and before any folder."""
    proc = run(str(tmp_path), *TINY, "--capture-video", "--save-model", MUJOCO_GL="no-such-gl")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "error: cannot make env 'InvertedPendulum-v5': invalid value for environment variable MUJOCO_GL: no-such-gl.\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["home"]


@needs_osmesa
@pytest.mark.parametrize("camera", ["the model's track camera", "the default free camera"])
def test_videos_follow_the_body_through_the_models_track_camera(monkeypatch, camera):
    """A HalfCheetah moved 20 m forward is still in the picture of the evaluation's video env; the default camera
    (the script's behaviour without the track camera) has lost it."""
    import gymnasium as gym
    import mujoco

    import trpo_gpt2_halfcheetah as trpo

    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    monkeypatch.setenv("PYOPENGL_PLATFORM", "osmesa")
    track = camera.startswith("the model's")
    env = trpo.video_env("HalfCheetah-v5") if track else gym.make("HalfCheetah-v5", render_mode="rgb_array")
    env.reset(seed=0)
    env.render()  # the first frame, as a video's: the camera is set up here
    data, model = env.unwrapped.data, env.unwrapped.model
    data.qpos[0] += 20.0  # the root's x
    mujoco.mj_forward(model, data)
    frame = env.render().astype(int)
    env.close()
    r, g, b = frame[..., 0], frame[..., 1], frame[..., 2]
    body = (r > 150) & (r - b > 60) & (g > 60)  # the cheetah's tan and pink; the floor and sky are grey-green
    assert (body.sum() > 500) == track, body.sum()
    assert trpo.video_env("InvertedPendulum-v5").unwrapped.mujoco_renderer.camera_id in (-1, None)  # no track camera
