"""`--capture-video` where MuJoCo draws (through OSMesa, without a display): a broken GL setting, the camera that
follows the body. (--track and the MP4s of every torch script: tests/test_machinery.py.)"""

import ctypes.util
import os
import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPT_ENV

needs_osmesa = pytest.mark.skipif(ctypes.util.find_library("OSMesa") is None, reason="OSMesa is not installed")


def test_a_broken_mujoco_gl_setting_is_one_sentence_before_anything_is_made(tmp_path):
    """MuJoCo reads MUJOCO_GL when it is first imported: a value it does not know fails the env's check, before the
    renderer's (one frame) and before any folder."""
    flags = ["--policy", "mlp", "--env-id", "InvertedPendulum-v5", "--num-envs", "2", "--batch-size", "10"]
    env = {k: v for k, v in SCRIPT_ENV.items() if not k.startswith(("MUJOCO_GL", "PYOPENGL", "DISPLAY"))}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "trpo_gpt2_halfcheetah.py"), *flags, "--capture-video", "--save-model"],
        cwd=tmp_path,
        env=dict(env, MUJOCO_GL="no-such-gl"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "error: cannot make env 'InvertedPendulum-v5': invalid value for environment variable MUJOCO_GL: no-such-gl.\n"
    )
    assert os.listdir(tmp_path) == []


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
