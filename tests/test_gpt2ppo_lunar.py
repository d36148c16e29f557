import glob
import math
import os

import gymnasium as gym
import numpy as np
import pytest
import torch

import gpt2ppo_lunar as g2
from conftest import only_run_dir, read_scalars, run_script

TINY = ("--hidden-size", "16", "--n-head", "2", "--context-len", "8", "--update-epochs", "2",
        "--minibatch-size", "64", "--no-progress")


def _tiny_critic(obs_dim=3, act_dim=2, K=6, dropout=0.0, max_t=50, seed=0):
    torch.manual_seed(seed)
    return g2.GPT2Critic(obs_dim, act_dim, hidden=16, context_len=K, n_layer=2, n_head=2, dropout=dropout,
                         max_timestep=max_t)


# ---------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------


def test_window_reach_closed_form():
    t = np.arange(20)
    assert (g2.window_reach(t, 5, 1) == np.minimum(t, 4)).all()  # the last 5 steps
    assert (g2.window_reach(t, 5, 5) == t % 5).all()  # non-overlapping segments
    # K=4, S=2: windows start at 0, 0, 0, 0, 2, 2, 4, 4, ... -> 2..4 steps once t >= 2
    assert g2.window_reach(t, 4, 2)[:10].tolist() == [0, 1, 2, 3, 2, 3, 2, 3, 2, 3]
    assert g2.window_reach(7, 4, 2) == 3


def test_build_windows_episode_boundary_padding_and_timesteps():
    # one env, K=4: rows 0..2 history (an old episode at t=5,6,7), a reset at row 3.
    K = 4
    obs = torch.arange(1, 9, dtype=torch.float32)[:, None].repeat(1, 2)  # row r holds r+1
    act = torch.arange(1, 9, dtype=torch.float32)[:, None] * 10
    ts = torch.tensor([5, 6, 7, 0, 1, 2, 3, 4])
    reach = torch.from_numpy(g2.window_reach(ts.numpy(), K, 1))
    s, a, t, m = g2.build_windows(obs, act, ts, reach, torch.tensor([3, 4, 6, 7]), K)
    # row 3 is the first step of a new episode: nothing of the old one, 3 padded slots
    assert m[0].tolist() == [False, False, False, True]
    assert s[0, :, 0].tolist() == [0, 0, 0, 4] and t[0].tolist() == [0, 0, 0, 0]
    assert m[1].tolist() == [False, False, True, True]
    assert s[1, :, 0].tolist() == [0, 0, 4, 5] and t[1].tolist() == [0, 0, 0, 1]
    # the action of the previous step is in the window, the current state's action never is
    assert a[1, :, 0].tolist() == [0, 0, 40, 0]
    # full window: rows 4..7, timesteps 1..4
    assert m[3].all() and s[3, :, 1].tolist() == [5, 6, 7, 8] and t[3].tolist() == [1, 2, 3, 4]
    assert a[3, :, 0].tolist() == [50, 60, 70, 0]
    assert s.shape == (4, K, 2) and a.shape == (4, K, 1) and t.dtype == torch.int64


def _naive_window(episode, K, S):
    """The window of the last entry of `episode` (a list of (obs, action_vec, t)), built the slow way."""
    t = episode[-1][2]
    start = 0 if S == 1 and t < K else max(0, S * ((t - K + S) // S))
    part = [e for e in episode if e[2] >= start][-K:]
    return part


@pytest.mark.parametrize("K, S", [(5, 1), (6, 3), (4, 4)])
def test_rollout_windows_equal_training_windows_across_rollouts(K, S):
    """Windows built step by step from the current episode (as a per-env deque during the rollout)
    equal those gathered by index from History after the rollout, across rollout boundaries and
    episode ends; the window of a truncated episode's final observation holds that episode only."""
    N, T, n_rollouts = 3, 7, 4
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=9)] * N,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    eye = np.eye(2, dtype=np.float32)
    hist = g2.History(N, T, K, S, 4, 2)
    rng = np.random.default_rng(0)
    obs, _ = envs.reset(seed=1)
    t_ep = np.zeros(N, dtype=np.int64)
    episodes = [[] for _ in range(N)]
    n_truncated = n_checked = 0
    for _ in range(n_rollouts):
        expected = {}
        finals = []
        for step in range(T):
            hist.put_state(step, obs.astype(np.float32), t_ep)
            for i in range(N):
                episodes[i].append([obs[i].astype(np.float32), np.zeros(2, np.float32), int(t_ep[i])])
                expected[(step, i)] = [(o.copy(), a.copy(), t) for o, a, t in _naive_window(episodes[i], K, S)]
            action = rng.integers(0, 2, N)
            hist.put_action(step, eye[action])
            for i in range(N):
                episodes[i][-1][1] = eye[action[i]]
            obs, _, term, trunc, info = envs.step(action)
            t_ep += 1
            for i in np.flatnonzero(term | trunc):
                if trunc[i] and not term[i]:
                    final = episodes[i] + [[info["final_obs"][i].astype(np.float32), np.zeros(2, np.float32),
                                            int(t_ep[i])]]
                    finals.append((hist.final_window(i, step, info["final_obs"][i]), _naive_window(final, K, S)))
                episodes[i], t_ep[i] = [], 0
        hist.put_state(T, obs.astype(np.float32), t_ep)
        for (step, i), naive in expected.items():
            s, a, t, m = hist.windows(hist.flat_rows(np.array([step]), np.array([i])))
            n = len(naive)
            assert m[0].sum() == n and m[0, K - n:].all()
            assert torch.equal(s[0, K - n:], torch.from_numpy(np.stack([o for o, _, _ in naive])))
            naive_act = np.stack([a_ for _, a_, _ in naive])
            naive_act[-1] = 0.0  # the current action is not in the window
            assert torch.equal(a[0, K - n:], torch.from_numpy(naive_act))
            assert t[0, K - n:].tolist() == [tt for _, _, tt in naive]
            assert not s[0, :K - n].any() and not a[0, :K - n].any()
            n_checked += 1
        for (s, a, t, m), naive in finals:
            n = len(naive)
            assert m[0].sum() == n and t[0, K - n:].tolist() == [tt for _, _, tt in naive]
            assert torch.equal(s[0, K - n:], torch.from_numpy(np.stack([o for o, _, _ in naive])))
            n_truncated += 1
        hist.carry_over()
    envs.close()
    assert n_checked == N * T * n_rollouts and n_truncated > 0


def test_segment_values_equal_per_window_values():
    """The shared-pass values (segments) are exactly each state's own-window value."""
    K, N, T = 6, 2, 20
    for S in (1, 3, 6):
        hist = g2.History(N, T, K, S, 3, 2)
        rng = np.random.default_rng(S)
        t_ep = np.zeros(N, dtype=np.int64)
        for step in range(T + 1):
            hist.put_state(step, rng.normal(size=(N, 3)).astype(np.float32), t_ep)
            if step < T:
                hist.put_action(step, np.eye(2, dtype=np.float32)[rng.integers(0, 2, N)])
            t_ep = np.where(rng.random(N) < 0.1, 0, t_ep + 1)
        critic = _tiny_critic(K=K).eval()
        rows = hist.flat_rows(np.tile(np.arange(T + 1), N), np.repeat(np.arange(N), T + 1))
        seg_rows, _, _ = hist.segments(rows)
        if S > 1:
            assert len(seg_rows) < len(rows) / 2  # the point of segments: fewer passes
        shared = g2.state_values(critic, hist, rows, chunk=4)
        with torch.no_grad():
            own = critic(*hist.windows(rows))[:, -1]
        assert torch.allclose(shared, own, atol=1e-5), S


# ---------------------------------------------------------------------------------------------
# GPT-2 critic
# ---------------------------------------------------------------------------------------------


def test_causality_later_steps_do_not_change_earlier_values():
    critic = _tiny_critic(K=6).eval()
    torch.manual_seed(1)
    s, a = torch.randn(2, 6, 3), torch.randn(2, 6, 2)
    t, m = torch.arange(6).repeat(2, 1), torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        v = critic(s, a, t, m)
        s2, a2 = s.clone(), a.clone()
        s2[:, 3:] += 5.0  # change states from position 3 on ...
        a2[:, 2:] -= 3.0  # ... and the actions taken from position 2 on (they follow state 2's token)
        v2 = critic(s2, a2, t, m)
    assert torch.allclose(v[:, :3], v2[:, :3], atol=1e-6)
    assert (v[:, 3:] - v2[:, 3:]).abs().min() > 1e-4  # later positions do see the change


def test_padding_is_masked_and_positions_contribute_nothing():
    critic = _tiny_critic(K=8).eval()
    assert not critic.gpt2.wpe.weight.any() and not critic.gpt2.wpe.weight.requires_grad
    torch.manual_seed(2)
    s, a = torch.randn(1, 3, 3), torch.randn(1, 3, 2)
    a[:, -1] = 0
    t = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        v_short = critic(s, a, t, torch.ones(1, 3, dtype=torch.bool))[0, -1]
        # the same 3 steps left-padded to 8 with garbage in the padded slots
        pad_s = torch.cat([torch.randn(1, 5, 3) * 100, s], 1)
        pad_a = torch.cat([torch.randn(1, 5, 2) * 100, a], 1)
        pad_t = torch.cat([torch.randint(0, 50, (1, 5)), t], 1)
        mask = torch.tensor([[False] * 5 + [True] * 3])
        v_padded = critic(pad_s, pad_a, pad_t, mask)
        # the timesteps are what tells the steps apart: shifting them changes the value
        v_shifted = critic(s, a, t + 10, torch.ones(1, 3, dtype=torch.bool))[0, -1]
    assert torch.isfinite(v_padded).all()
    assert v_padded[0, -1].item() == pytest.approx(v_short.item(), abs=1e-5)
    assert abs(v_shifted.item() - v_short.item()) > 1e-4


def test_fast_dropout_attention_matches_sdpa_and_drops_at_the_right_rate():
    """The training-pass attention (math path, own dropout draw) computes what torch's SDPA does."""
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 4)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril().expand(3, 1, 7, 7).clone()
    allowed[0, :, :, :3] = False  # window 0 is left-padded by 3 steps
    allowed[0, :, :3, 0] = True  # (its padded rows attend somewhere: only their finiteness matters)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)
    tiny, _ = g2.attention_with_fast_dropout(None, q, k, v, allowed, dropout=1e-12)  # the math path
    assert torch.allclose(tiny, ref, atol=1e-6)
    causal, _ = g2.attention_with_fast_dropout(None, q, k, v, None, dropout=1e-12)  # mask None: causal
    ref_causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert torch.allclose(causal, ref_causal, atol=1e-6)
    # with dropout p the kept weights are scaled by 1/(1-p): with v = one-hot columns the output IS
    # the dropped-and-rescaled weight matrix, so the rate and the scale can be read off it
    p, L = 0.5, 64
    eye = torch.eye(L).expand(40, 1, L, L)
    w, _ = g2.attention_with_fast_dropout(None, torch.zeros(40, 1, L, L), torch.zeros(40, 1, L, L), eye, None,
                                          dropout=p)
    w = w.transpose(1, 2)[:, 0]  # (40, L, L): row i = uniform 1/(i+1) weights, dropped, rescaled
    base = torch.ones(L, L).tril() / torch.arange(1, L + 1)[:, None]
    kept = w > 0
    assert torch.allclose(w[kept], (base / (1 - p)).expand_as(w)[kept], atol=1e-6)
    assert abs(kept.float().sum().item() / (40 * base.gt(0).sum().item()) - (1 - p)) < 0.01
    assert not (w[:, ~base.gt(0)] != 0).any()  # nothing above the diagonal


def test_all_padding_columns_are_trimmed_without_changing_values():
    critic = _tiny_critic(K=8).eval()
    torch.manual_seed(4)
    s, a, t = torch.randn(3, 8, 3), torch.randn(3, 8, 2), torch.randint(0, 40, (3, 8))
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 5:], mask[1, 3:], mask[2, 6:] = True, True, True  # columns 0..2 are padding everywhere
    with torch.no_grad():
        v = critic(s, a, t, mask)
        # reference: each window alone, through the untrimmed GPT-2 (the longest window forces 5 columns)
        for i in range(3):
            first = int(mask[i].int().argmax())
            alone = critic(s[i:i + 1, first:], a[i:i + 1, first:], t[i:i + 1, first:], mask[i:i + 1, first:])
            assert torch.allclose(v[i, first:], alone[0], atol=1e-5)
    assert (v[:, :3] == 0).all() and v.shape == (3, 8)


def test_timestep_embedding_starts_small_like_gpt2_position_embeddings():
    critic = _tiny_critic(K=4, max_t=2000)
    std = critic.embed_timestep.weight.std().item()
    assert std == pytest.approx(critic.gpt2.config.initializer_range, rel=0.1)  # 0.02, not nn.Embedding's 1


def test_dropout_only_in_training_mode():
    critic = _tiny_critic(K=4, dropout=0.5)
    s, a, t, m = torch.randn(3, 4, 3), torch.randn(3, 4, 2), torch.arange(4).repeat(3, 1), torch.ones(3, 4).bool()
    critic.eval()
    with torch.no_grad():
        assert torch.equal(critic(s, a, t, m), critic(s, a, t, m))
    critic.train()
    with torch.no_grad():
        assert not torch.equal(critic(s, a, t, m), critic(s, a, t, m))


def test_actor_heads():
    actor = g2.Actor(5, 3, discrete=True, hidden=8)
    lp, ent = actor.log_prob_entropy(torch.randn(4, 5), torch.tensor([0, 1, 2, 0]))
    assert lp.shape == (4,) and (lp < 0).all() and torch.allclose(ent, torch.full((4,), math.log(3)), atol=1e-2)
    cont = g2.Actor(5, 2, discrete=False, hidden=8)
    assert [n for n, _ in cont.named_parameters() if "log_std" in n] == ["log_std"]  # state-independent
    x = torch.randn(4, 5)
    a = cont.act(x, greedy=True)
    lp, ent = cont.log_prob_entropy(x, a)
    # at the mean with std 1: log N(0; 0, 1) per dim = -0.5 log(2 pi)
    assert torch.allclose(lp, torch.full((4,), -math.log(2 * math.pi)), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# PPO math
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The script end to end
# ---------------------------------------------------------------------------------------------

TAGS = ("charts/episodic_return", "charts/episodic_length", "charts/SPS", "losses/policy_loss",
        "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/explained_variance")


@pytest.mark.parametrize("env_id", ["LunarLander-v3", "BipedalWalker-v3"])
def test_smoke_both_critics(tmp_path, env_id):
    for critic in ("mlp", "gpt2"):
        cwd = str(tmp_path / critic)
        os.makedirs(cwd)
        run_script("gpt2ppo_lunar.py", "--env-id", env_id, "--critic", critic, "--total-timesteps", "512",
                   "--steps-per-epoch", "256", "--num-envs", "2", *TINY, cwd=cwd)
        run = only_run_dir(cwd)
        for tag in TAGS[2:]:
            assert len(read_scalars(run, tag)) == 2, (critic, tag)


def test_acrobot_both_critics_truncation_and_checkpoint_round_trip(tmp_path):
    for critic in ("mlp", "gpt2"):
        cwd = str(tmp_path / critic)
        os.makedirs(cwd)
        out = run_script("gpt2ppo_lunar.py", "--env-id", "Acrobot-v1", "--critic", critic, "--total-timesteps", "1024",
                         "--steps-per-epoch", "512", "--num-envs", "2", *TINY,
                         *(("--save-model", "--eval-episodes", "1") if critic == "gpt2" else ()), cwd=cwd).stdout
        run = only_run_dir(cwd)
        for tag in TAGS[2:]:
            assert len(read_scalars(run, tag)) == 2, (critic, tag)
        # a random Acrobot policy is cut by the env's 500-step limit: 2 envs x 512 steps -> 2
        # truncated episodes of length 500 (bootstrapped, not terminal), none lost
        assert [v for _, v in read_scalars(run, "charts/episodic_length")] == [500.0, 500.0]
    ckpt = glob.glob(os.path.join(cwd, "runs", "*", "gpt2ppo_lunar.pt"))
    assert len(ckpt) == 1 and "eval:" in out
    out = run_script("gpt2ppo_lunar.py", "--eval-checkpoint", ckpt[0], "--eval-episodes", "2", cwd=cwd).stdout
    assert "over 2 episodes" in out and "critic gpt2" in out
    eval_run = glob.glob(os.path.join(cwd, "runs", "*-eval__*"))
    assert len(eval_run) == 1 and len(read_scalars(eval_run[0], "eval/episodic_return")) == 2
    actor, critic, a = g2.load_checkpoint(ckpt[0])
    assert a["env_id"] == "Acrobot-v1" and a["critic"] == "gpt2" and isinstance(critic, g2.GPT2Critic)
    r1 = g2.evaluate(actor, "Acrobot-v1", 1, seed=0)
    assert r1 == g2.evaluate(actor, "Acrobot-v1", 1, seed=0) and -500 <= r1[0] <= 0


def test_seeded_runs_identical_and_gpt2_trained(tmp_path):
    returns = []
    for k in range(2):
        cwd = str(tmp_path / f"r{k}")
        os.makedirs(cwd)
        run_script("gpt2ppo_lunar.py", "--total-timesteps", "512", "--steps-per-epoch", "256", "--seed", "7",
                   "--save-model", "--eval-episodes", "1", *TINY, cwd=cwd)
        returns.append(read_scalars(only_run_dir(cwd), "charts/episodic_return"))
    assert len(returns[0]) >= 3 and returns[0] == returns[1]
    # the GPT-2 blocks and embeddings moved away from their initialisation (the authors' never did),
    # while the zeroed position embeddings stayed zero
    ckpt = glob.glob(str(tmp_path / "r0" / "runs" / "*" / "gpt2ppo_lunar.pt"))[0]
    actor, critic, a = g2.load_checkpoint(ckpt)
    torch.manual_seed(7)
    g2.Actor(8, 4, True, a["hidden_size"])
    init = g2.make_critic("gpt2", 8, 4, a)
    trained = dict(critic.named_parameters())
    for name, p0 in init.named_parameters():
        if name.startswith("gpt2.wpe") or name.startswith("gpt2.wte"):
            assert torch.equal(trained[name], p0), name
        else:
            assert not torch.equal(trained[name], p0), f"{name} was not trained"
    assert not critic.gpt2.wpe.weight.any()


def test_unsupported_spaces_in_process():
    with pytest.raises(SystemExit, match="Discrete or Box action space"):
        g2.check_spaces("X", gym.spaces.Box(-1, 1, (3,)), gym.spaces.MultiDiscrete([2, 3]))
    with pytest.raises(SystemExit, match="flat Box observation"):
        g2.check_spaces("X", gym.spaces.Box(0, 255, (4, 4, 3)), gym.spaces.Discrete(2))
    g2.check_spaces("X", gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,)))  # fine


@pytest.mark.parametrize("kw, message", [
    (dict(steps_per_epoch=100, num_envs=3), "must be a positive multiple"),
    (dict(value_stride=0), "--value-stride must be between 1"),
    (dict(value_stride=65), "--value-stride must be between 1"),
    (dict(n_head=3), "must divide --hidden-size"),
])
def test_bad_arguments_in_process(kw, message):
    with pytest.raises(SystemExit, match=message):
        g2.check_args(g2.Args(**kw))
    g2.check_args(g2.Args())  # the defaults are fine


@pytest.mark.parametrize("flags, message", [
    (("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
    (("--env-id", "Blackjack-v1"), "needs a flat Box observation"),
    (("--eval-checkpoint", "missing.pt"), "does not exist"),
    pytest.param(("--cuda",), "torch sees no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is present")),
    pytest.param(("--eval-checkpoint", "missing.pt", "--cuda"), "torch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")),
])
def test_bad_input_one_clear_sentence(tmp_path, flags, message):
    proc = run_script("gpt2ppo_lunar.py", *flags, cwd=str(tmp_path), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_learns_cartpole_with_gpt2_critic(tmp_path):
    cwd = str(tmp_path)
    run_script("gpt2ppo_lunar.py", "--env-id", "CartPole-v1", "--total-timesteps", "24576", "--seed", "1",
               "--actor-lr", "1e-3", "--value-stride", "8", "--dropout", "0.1", *TINY, cwd=cwd)
    run = only_run_dir(cwd)
    rets = [v for _, v in read_scalars(run, "charts/episodic_return")]
    # CartPole: return == length for every logged episode (none lost or mixed up)
    assert rets == [v for _, v in read_scalars(run, "charts/episodic_length")]
    # a random policy averages ~22; seeds 1, 2, 3 reach 283, 250, 227 over their last 30 episodes here
    assert np.mean(rets[:20]) < 40
    assert np.mean(rets[-30:]) > 100, np.mean(rets[-30:])


def test_capture_video_without_moviepy_is_one_clear_sentence(tmp_path):
    import importlib.util

    if importlib.util.find_spec("moviepy") is not None:
        pytest.skip("moviepy is installed here, so --capture-video records instead of failing")
    proc = run_script("gpt2ppo_lunar.py", "--capture-video", "--total-timesteps", "4096", cwd=str(tmp_path), check=False)
    assert proc.returncode != 0
    assert "--capture-video needs the moviepy package" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# Issue 15: bad numbers, evaluation seeds, run names, Ctrl-C, the authors' update schedule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    (dict(update_epochs=0), "--update-epochs must be >= 1"),
    (dict(minibatch_size=0), "--minibatch-size 0 must divide"),
    (dict(minibatch_size=100), "--minibatch-size 100 must divide --steps-per-epoch 2048"),
    (dict(num_envs=0), "must be a positive multiple of --num-envs 0"),
    (dict(steps_per_epoch=0), "must be a positive multiple"),
    (dict(total_timesteps=0), "--total-timesteps must be >= 1"),
    (dict(actor_lr=-1.0), "--actor-lr and --critic-lr must be > 0"),
    (dict(critic_lr=0.0), "--actor-lr and --critic-lr must be > 0"),
    (dict(gamma=2.0), "--gamma must be in [0, 1]"),
    (dict(gae_lambda=-0.1), "--gae-lambda must be in [0, 1]"),
    (dict(clip_coef=0.0), "--clip-coef must be > 0"),
    (dict(target_kl=0.0), "--target-kl must be > 0"),
    (dict(hidden_size=0), "--hidden-size must be >= 1"),
    (dict(context_len=0), "--context-len must be >= 1"),
    (dict(n_layer=0), "--n-layer and --n-head must be >= 1"),
    (dict(dropout=1.0), "--dropout must be in [0, 1)"),
    (dict(eval_episodes=0), "--eval-episodes must be >= 1"),
    (dict(torch_threads=0), "--torch-threads must be >= 1"),
    (dict(progress_every=-1), "--progress-every must be >= 0"),
])
def test_check_args_one_sentence_per_bad_number(kw, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        g2.check_args(g2.Args(**kw))


def test_track_without_wandb_is_one_sentence(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit, match="--track needs the wandb package"):
        g2.check_args(g2.Args(track=True))


def test_budget_rounds_up_to_whole_rollouts():
    assert g2.num_rollouts(307200, 2048) == 150
    assert g2.num_rollouts(1_000_000, 2048) == 489  # 1,001,472 steps: never fewer than asked
    assert g2.num_rollouts(1, 2048) == 1


def test_run_time_fields_are_not_flags(tmp_path):
    for flag in ("--num-steps", "--num-iterations", "--batch-size"):
        proc = run_script("gpt2ppo_lunar.py", flag, "3", cwd=str(tmp_path), check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, flag
    assert not os.path.exists(tmp_path / "runs")


def test_bad_number_exits_before_any_work_and_leaves_no_run_folder(tmp_path):
    proc = run_script("gpt2ppo_lunar.py", "--update-epochs", "0", "--total-timesteps", "256", cwd=str(tmp_path),
                      check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --update-epochs must be >= 1, got 0."]
    assert not os.path.exists(tmp_path / "runs")


def test_minibatch_plan_schedules():
    batch, n_seg, mbs, epochs = 12, 5, 4, 3
    # authors: one pass in rollout order, `epochs` consecutive steps on each minibatch
    plan = list(g2.minibatch_plan("authors", batch, n_seg, mbs, epochs, np.random.default_rng(0)))
    assert len(plan) == 3 and all(len(group) == epochs for group in plan)
    for k, group in enumerate(plan):
        for mb, seg in group:
            assert mb.tolist() == list(range(4 * k, 4 * k + 4))
            assert seg.tolist() == np.array_split(np.arange(n_seg), 3)[k].tolist()
    # shuffled: `epochs` passes, each a fresh permutation of the rollout and of the segments, drawn
    # exactly as the update drew them before the option existed (cumulative in-place shuffles)
    rng, ref = np.random.default_rng(3), np.random.default_rng(3)
    b_ref, s_ref = np.arange(batch), np.arange(n_seg)
    plan = list(g2.minibatch_plan("shuffled", batch, n_seg, mbs, epochs, rng))
    assert len(plan) == epochs
    for group in plan:
        ref.shuffle(b_ref)
        ref.shuffle(s_ref)
        assert np.concatenate([mb for mb, _ in group]).tolist() == b_ref.tolist()
        assert np.concatenate([seg for _, seg in group]).tolist() == s_ref.tolist()
    # both take the same number of Adam steps
    assert sum(map(len, plan)) == epochs * batch // mbs


def test_eval_seed_rule():
    assert g2.eval_seed(7) == 10007  # after --save-model, and --eval-checkpoint without --seed
    assert g2.eval_seed(7, 3) == 10003  # --eval-checkpoint --seed 3


def test_make_run_dir_is_unique_and_names_the_setting(tmp_path):
    a = g2.Args(seed=5, critic="mlp")
    names = [g2.make_run_dir(g2.run_base_name(a), root=str(tmp_path)) for _ in range(3)]
    assert len(set(names)) == 3 and all(os.path.isdir(tmp_path / n) for n in names)
    assert all(n.startswith("LunarLander-v3__gpt2ppo_lunar__critic-mlp__5__") for n in names)
    assert "critic-gpt2-authors-schedule__5" in g2.run_base_name(g2.Args(seed=5, update_schedule="authors"))


def test_returns_text_says_when_no_episode_finished():
    assert g2.returns_text([]) == "no episode has finished yet"
    assert g2.returns_text([1.0, 3.0]) == "mean return of the last 2 episodes 2.00"


def test_probe_leaves_random_state_and_gradients_alone():
    critic = _tiny_critic(dropout=0.5)
    critic.eval()
    state = torch.get_rng_state()
    est = g2.probe_update_seconds(critic, 3, 2, 6, windows=100, update_epochs=5, device=torch.device("cpu"))
    assert est > 0 and torch.equal(state, torch.get_rng_state())
    assert not critic.training and all(p.grad is None for p in critic.parameters())


def test_save_model_eval_equals_eval_checkpoint_and_directory_is_named(tmp_path):
    cwd = str(tmp_path)
    flags = ("--critic", "mlp", "--total-timesteps", "512", "--steps-per-epoch", "256", "--seed", "4",
             "--save-model", "--eval-episodes", "2", "--no-eval-greedy", "--progress-every", "1", *TINY)
    out = run_script("gpt2ppo_lunar.py", *flags, cwd=cwd).stdout
    run = only_run_dir(cwd)
    assert os.path.basename(run).startswith("LunarLander-v3__gpt2ppo_lunar__critic-mlp__4__")
    assert "update 1/2, 256 steps" in out  # stdout is not a terminal: progress lines
    assert not read_scalars(run, "losses/actor_loss") and not read_scalars(run, "losses/critic_loss")
    assert read_scalars(run, "losses/policy_loss") and read_scalars(run, "losses/value_loss")
    in_run = out.split("eval: ")[1].split(" over")[0]
    ckpt = os.path.join(run, "gpt2ppo_lunar.pt")
    torch.load(ckpt, weights_only=True)  # plain tensors and Python values only
    out = run_script("gpt2ppo_lunar.py", "--eval-checkpoint", ckpt, "--eval-episodes", "2", "--no-eval-greedy",
                     cwd=cwd).stdout
    assert out.split(": ")[1].split(" over")[0] == in_run  # the same rule, the same numbers
    eval_runs = glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10004__*"))
    assert len(eval_runs) == 1  # named after the checkpoint's run and its evaluation seed
    out = run_script("gpt2ppo_lunar.py", "--eval-checkpoint", ckpt, "--eval-episodes", "2", "--no-eval-greedy",
                     "--seed", "9", cwd=cwd).stdout
    assert "seeds 10009..10010" in out
    proc = run_script("gpt2ppo_lunar.py", "--eval-checkpoint", run, cwd=cwd, check=False)
    assert proc.returncode != 0 and "is a directory" in proc.stderr and "Traceback" not in proc.stderr


def interrupt_after_first_update(script: str, flags: tuple, cwd: str, marker: str = "update 1/"):
    """Start a long run, wait for its first progress line, press Ctrl-C (SIGINT); return (rc, stdout, stderr)."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, script), *flags, "--progress-every", "1"], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out, err


def test_ctrl_c_saves_checkpoint_closes_and_exits_with_one_line(tmp_path):
    cwd = str(tmp_path)
    rc, out, err = interrupt_after_first_update(
        "gpt2ppo_lunar.py", ("--critic", "mlp", "--total-timesteps", "10000000", "--steps-per-epoch", "256",
                             "--save-model", *TINY), cwd)
    assert rc == 130 and "Traceback" not in err, err
    last = out.strip().splitlines()[-1]
    assert "interrupted after" in last and "checkpoint saved to" in last
    ckpt = glob.glob(os.path.join(cwd, "runs", "*", "gpt2ppo_lunar.pt"))
    assert len(ckpt) == 1
    actor, critic, a = g2.load_checkpoint(ckpt[0])
    assert a["critic"] == "mlp" and isinstance(actor, g2.Actor)
    assert read_scalars(only_run_dir(cwd), "losses/policy_loss")  # the writer was flushed and closed


def test_slow_update_note_only_when_slow():
    assert g2.slow_update_note(5.0, 150, "cpu", 1) is None
    note = g2.slow_update_note(36.0, 150, "cpu", 1)
    assert "~36 s per update on cpu" in note and "~1.5 h for 150 updates" in note and "--value-stride 64" in note
    assert "--value-stride" not in g2.slow_update_note(36.0, 150, "cpu", 8)
