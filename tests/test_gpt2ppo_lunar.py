import glob
import math
import os
import signal
import sys
from collections import deque
from dataclasses import asdict

import gymnasium as gym
import numpy as np
import pytest
import torch

import gpt2ppo_lunar as g2
from conftest import assert_same_scalars, baseline_script, only_run_dir, read_scalars
from conftest import bad as _bad
from conftest import cli_in_process as in_process

TINY = ("--hidden-size", "16", "--n-head", "2", "--context-len", "8", "--update-epochs", "2", "--minibatch-size", "64")


def _rows(hist, steps, envs):
    """Flat History rows of (rollout step, env) pairs."""
    return (np.asarray(envs) * hist.L + hist.K - 1 + np.asarray(steps)).astype(np.int64)


def _tiny_critic(obs_dim=3, act_dim=2, K=6, dropout=0.0, max_t=50, seed=0):
    torch.manual_seed(seed)
    return g2.GPT2Critic(
        obs_dim, act_dim, hidden_size=16, context_len=K, n_layer=2, n_head=2, dropout=dropout, max_timestep=max_t
    )


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
    start = max(0, S * ((t - K + S) // S))
    return [e for e in episode if e[2] >= start][-K:]


@pytest.mark.parametrize("K, S", [(5, 1), (6, 3), (4, 4)])
def test_rollout_windows_equal_training_windows_across_rollouts(K, S):
    """Windows built step by step from the current episode (as a per-env deque during the rollout)
    equal those gathered by index from History after the rollout, across rollout boundaries and
    episode ends; the window of a truncated episode's final observation holds that episode only."""
    N, T, n_rollouts = 3, 7, 4
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=9)] * N, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
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
                    final = episodes[i] + [
                        [info["final_obs"][i].astype(np.float32), np.zeros(2, np.float32), int(t_ep[i])]
                    ]
                    finals.append((hist.final_window(i, step, info["final_obs"][i]), _naive_window(final, K, S)))
                episodes[i], t_ep[i] = [], 0
        hist.put_state(T, obs.astype(np.float32), t_ep)
        for (step, i), naive in expected.items():
            s, a, t, m = hist.windows(_rows(hist, np.array([step]), np.array([i])))
            n = len(naive)
            assert m[0].sum() == n and m[0, K - n :].all()
            assert torch.equal(s[0, K - n :], torch.from_numpy(np.stack([o for o, _, _ in naive])))
            naive_act = np.stack([a_ for _, a_, _ in naive])
            naive_act[-1] = 0.0  # the current action is not in the window
            assert torch.equal(a[0, K - n :], torch.from_numpy(naive_act))
            assert t[0, K - n :].tolist() == [tt for _, _, tt in naive]
            assert not s[0, : K - n].any() and not a[0, : K - n].any()
            n_checked += 1
        for (s, a, t, m), naive in finals:
            n = len(naive)
            assert m[0].sum() == n and t[0, K - n :].tolist() == [tt for _, _, tt in naive]
            assert torch.equal(s[0, K - n :], torch.from_numpy(np.stack([o for o, _, _ in naive])))
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
        rows = _rows(hist, np.tile(np.arange(T + 1), N), np.repeat(np.arange(N), T + 1))
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
    tiny, _ = g2.GPT2Critic.attention(None, q, k, v, allowed, dropout=1e-12)  # the math path
    assert torch.allclose(tiny, ref, atol=1e-6)
    causal, _ = g2.GPT2Critic.attention(None, q, k, v, None, dropout=1e-12)  # mask None: causal
    ref_causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert torch.allclose(causal, ref_causal, atol=1e-6)
    # with dropout p the kept weights are scaled by 1/(1-p): with v = one-hot columns the output IS
    # the dropped-and-rescaled weight matrix, so the rate and the scale can be read off it
    p, L = 0.5, 64
    eye = torch.eye(L).expand(40, 1, L, L)
    w, _ = g2.GPT2Critic.attention(None, torch.zeros(40, 1, L, L), torch.zeros(40, 1, L, L), eye, None, dropout=p)
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
            alone = critic(s[i : i + 1, first:], a[i : i + 1, first:], t[i : i + 1, first:], mask[i : i + 1, first:])
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


def test_minibatch_plan_schedules():
    batch, n_seg, mbs, epochs = 12, 5, 4, 3
    # authors: one pass in rollout order, `epochs` consecutive steps on each minibatch
    plan = list(g2.minibatch_plan("authors", batch, n_seg, mbs, epochs, np.random.default_rng(0)))
    assert len(plan) == 3 * epochs
    for j, (mb, seg) in enumerate(plan):
        k = j // epochs
        assert mb.tolist() == list(range(4 * k, 4 * k + 4))
        assert seg.tolist() == np.array_split(np.arange(n_seg), 3)[k].tolist()
    # shuffled: `epochs` passes, each a fresh permutation of the rollout and of the segments (cumulative in-place
    # shuffles of one generator, as the update always drew them)
    rng, ref = np.random.default_rng(3), np.random.default_rng(3)
    b_ref, s_ref = np.arange(batch), np.arange(n_seg)
    plan = list(g2.minibatch_plan("shuffled", batch, n_seg, mbs, epochs, rng))
    assert len(plan) == epochs * batch // mbs  # both schedules take the same number of Adam steps
    for e in range(epochs):
        ref.shuffle(b_ref)
        ref.shuffle(s_ref)
        group = plan[3 * e : 3 * e + 3]
        assert np.concatenate([mb for mb, _ in group]).tolist() == b_ref.tolist()
        assert np.concatenate([seg for _, seg in group]).tolist() == s_ref.tolist()


def test_compute_gae_bootstraps_truncations_and_cuts_terminations():
    r = np.array([[1.0], [1.0], [1.0]], dtype=np.float32)
    v = np.array([[0.5], [0.5], [0.5]], dtype=np.float32)
    nv = np.array([[0.5], [2.0], [0.5]], dtype=np.float32)  # step 1 was truncated: V(final obs) = 2
    term, done = np.array([[0.0], [0.0], [1.0]]), np.array([[0.0], [1.0], [1.0]])
    adv, ret = g2.compute_gae(r, v, nv, term, done, gamma=0.9, gae_lambda=0.5)
    d2 = 1.0 - 0.5  # terminal: no bootstrap
    d1 = 1.0 + 0.9 * 2.0 - 0.5  # truncated: bootstrap V(final obs), recursion cut
    d0 = 1.0 + 0.9 * 0.5 - 0.5
    assert np.allclose(adv[:, 0], [d0 + 0.45 * d1, d1, d2]) and np.allclose(ret, adv + v)


# ---------------------------------------------------------------------------------------------
# Continuous actions and the critic's modes inside the training loop (one in-process run, spied on)
# ---------------------------------------------------------------------------------------------


class TinyBox(gym.Env):
    """3-d observations, a 2-d action with asymmetric bounds (samples of a std-1 Gaussian often fall outside),
    reward -|a|^2, 12-step episodes (time-limit truncations). Records every action it receives."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = gym.spaces.Box(np.array([-0.3, -1.0], np.float32), np.array([0.2, 0.5], np.float32))
    received: list = []

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.normal(size=3).astype(np.float32), {}

    def step(self, action):
        TinyBox.received.append(np.array(action, copy=True))
        return self.np_random.normal(size=3).astype(np.float32), -float(np.sum(np.square(action))), False, False, {}


gym.register("TinyBox-v0", entry_point=TinyBox, max_episode_steps=12)


@pytest.fixture(scope="module")
def spied_continuous_run(tmp_path_factory):
    """Train the GPT-2 critic (dropout 0.5) on TinyBox in process, recording what the actor sampled, what the env
    received, what History stored, every log-probability call (with a hand-computed diagonal-Gaussian log-prob of
    the same actions) and the mode of every critic pass."""
    rec = {"sampled": [], "stored": [], "logprob": [], "critic": []}
    real_act, real_lp, real_put, real_fwd = (
        g2.Actor.act,
        g2.Actor.log_prob_entropy,
        g2.History.put_action,
        g2.GPT2Critic.forward,
    )

    def act(self, obs, greedy=False):
        a = real_act(self, obs, greedy)
        rec["sampled"].append(a.clone())
        return a

    def log_prob_entropy(self, obs, actions):
        lp, ent = real_lp(self, obs, actions)
        with torch.no_grad():
            mean, log_std = self.head(self.body(obs)), self.log_std
            hand = (-0.5 * ((actions - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        rec["logprob"].append((actions.detach().clone(), lp.detach().clone(), hand, torch.is_inference_mode_enabled()))
        return lp, ent

    def put_action(self, step, actions_vec):
        rec["stored"].append(np.array(actions_vec, copy=True))
        return real_put(self, step, actions_vec)

    def forward(self, states, actions, timesteps, mask):
        rec["critic"].append((self.training, torch.is_grad_enabled(), actions.detach().clone()))
        return real_fwd(self, states, actions, timesteps, mask)

    TinyBox.received.clear()
    cwd = tmp_path_factory.mktemp("tinybox")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setattr(g2.Actor, "act", act)
        mp.setattr(g2.Actor, "log_prob_entropy", log_prob_entropy)
        mp.setattr(g2.History, "put_action", put_action)
        mp.setattr(g2.GPT2Critic, "forward", forward)
        assert (
            g2.main(
                g2.Args(
                    env_id="TinyBox-v0",
                    total_timesteps=96,
                    steps_per_epoch=48,
                    num_envs=2,
                    minibatch_size=16,
                    update_epochs=2,
                    hidden_size=16,
                    n_head=2,
                    context_len=8,
                    dropout=0.5,
                    seed=5,
                )
            )
            == 0
        )
    return rec


def test_continuous_actions_sampled_stored_and_clipped_only_for_the_env(spied_continuous_run):
    """The env receives the Gaussian sample clipped to its bounds; the rollout buffer (hence the log-probs
    PPO's ratio uses) and the critic's history hold the sample itself; every log-prob is the diagonal Gaussian's
    with the state-independent log-std."""
    rec = spied_continuous_run
    sampled = torch.cat(rec["sampled"]).numpy()  # (steps * envs, 2), step-major
    received = np.stack(TinyBox.received)
    low, high = TinyBox.action_space.low, TinyBox.action_space.high
    assert sampled.shape == received.shape == (96, 2)
    assert np.array_equal(received, np.clip(sampled, low, high))
    assert ((sampled < low) | (sampled > high)).mean() > 0.3  # clipping did happen, often
    assert np.array_equal(np.concatenate(rec["stored"]), sampled)  # History: the sample, not the clipped action
    rollout_calls = [c for c in rec["logprob"] if c[3]]  # the old log-probs, computed after each rollout
    assert len(rollout_calls) == 2
    assert np.array_equal(torch.cat([c[0] for c in rollout_calls]).numpy(), sampled)
    for actions, lp, hand, _ in rec["logprob"]:
        assert torch.allclose(lp, hand, atol=1e-5)
    seen = torch.cat([a.reshape(-1, 2) for _, _, a in rec["critic"]]).numpy()
    assert (seen[:, 0] > high[0]).any() and (seen[:, 1] < low[1]).any()  # the critic reads unclipped samples


def test_gpt2_critic_eval_mode_in_rollouts_and_targets_train_mode_in_the_update(spied_continuous_run):
    calls = spied_continuous_run["critic"]
    no_grad = [training for training, grad, _ in calls if not grad]  # rollout values, truncation bootstraps
    with_grad = [training for training, grad, _ in calls if grad]  # the update's training passes
    assert no_grad and with_grad
    assert not any(no_grad), "dropout was on while computing values for the targets"
    assert all(with_grad), "dropout was off in the update"


# ---------------------------------------------------------------------------------------------
# Runs: the same numbers as before the redesign, learning, the budget
# ---------------------------------------------------------------------------------------------

TAGS = (
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/approx_kl",
    "losses/explained_variance",
    "charts/SPS",
)
BUDGET = ("--total-timesteps", "512", "--steps-per-epoch", "256", "--seed", "3")
SMALL = ("--hidden-size", "16", "--n-head", "2", "--update-epochs", "2", "--minibatch-size", "64")  # TINY's widths


def cli_in_process(flags, cwd) -> tuple[int, str, str]:
    return in_process("gpt2ppo_lunar", flags, cwd)


@pytest.fixture(scope="module")
def baseline_module(tmp_path_factory):
    """gpt2ppo_lunar.py as committed at conftest's BASELINE, loaded as a module of its own (skipped without it)."""
    import importlib.util

    path = baseline_script("gpt2ppo_lunar.py", str(tmp_path_factory.mktemp("baseline_code")))
    spec = importlib.util.spec_from_file_location("gpt2ppo_lunar_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _same_numbers_in_process(baseline, flags, tmp_path) -> tuple[str, str]:
    """conftest's same_numbers with both runs in this process, one thread each (as the scripts run in a subprocess with
    OMP_NUM_THREADS=1), which saves two interpreter starts per case: the BASELINE module's main and this script's
    entry point with the same flags, each in its own folder; every scalar the baseline logged (wall-clock tags aside)
    must be logged by the current script with the same steps and values, bit for bit. The two run folders."""
    import contextlib
    import io

    import tyro

    folders = []
    for name in ("baseline", "current"):
        cwd = tmp_path / name
        cwd.mkdir()
        if name == "baseline":
            handlers, here = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}, os.getcwd()
            try:
                os.chdir(cwd)
                with contextlib.redirect_stdout(io.StringIO()):
                    baseline.main(tyro.cli(baseline.Args, args=list(flags)))
            finally:
                os.chdir(here)
                for s, h in handlers.items():
                    signal.signal(s, h)
        else:
            code, _, err = cli_in_process(flags, cwd)
            assert code == 0, err
        folders.append(only_run_dir(str(cwd)))
    assert_same_scalars("gpt2ppo_lunar.py", flags, *folders)
    return folders[0], folders[1]


@pytest.mark.parametrize(
    "flags",
    [
        ("--critic", "mlp"),
        # exact windows (stride 1, the default; 16 steps keep it short); one env runs into Acrobot's 500-step limit: a
        # truncated episode, bootstrapped with V(final observation) over its own window
        ("--env-id", "Acrobot-v1", "--num-envs", "1", "--critic", "gpt2", "--context-len", "16"),
        ("--critic", "gpt2", "--value-stride", "64", "--dropout", "0.1", "--update-schedule", "authors"),
        # continuous actions; the checkpoint and the evaluation after training
        ("--env-id", "BipedalWalker-v3", "--value-stride", "64", "--save-model", "--eval-episodes", "1"),
    ],
    ids=["mlp", "gpt2-exact-acrobot-truncation", "gpt2-stride64-dropout0.1-authors", "bipedal-gpt2-save-eval"],
)
def test_same_numbers_as_before_the_redesign(tmp_path, baseline_module, flags):
    """Every kept path logs, bit for bit, what the script logged before the redesign (same machine, side by side), at
    small sizes (the same paths, a fraction of the time)."""
    old, new = _same_numbers_in_process(baseline_module, (*BUDGET, *SMALL, *flags), tmp_path)
    for tag in TAGS:
        assert len(read_scalars(new, tag)) == 2, tag
    if "Acrobot-v1" in flags:  # a random policy does not swing up within 500 steps
        assert [v for _, v in read_scalars(new, "charts/episodic_length")] == [500.0]
    if "--save-model" in flags:
        # every trainable GPT-2 parameter moved; the zeroed position embeddings did not
        ckpt = g2.load_checkpoint("eval_checkpoint", os.path.join(new, "gpt2ppo_lunar.pt"))
        torch.manual_seed(3)
        g2.Actor(24, 4, False, ckpt["args"]["hidden_size"])
        init = g2.make_critic("gpt2", 24, 4, {**ckpt["args"], "max_timestep": 1600})  # BipedalWalker's limit
        for name, p0 in init.named_parameters():
            assert torch.equal(ckpt["objects"]["critic"][name], p0) == name.startswith(("gpt2.wpe", "gpt2.wte")), name
        # the checkpoint evaluates again to the numbers the earlier script's evaluation after training gave
        code, _, _ = cli_in_process(
            ("--eval-checkpoint", os.path.join(new, "gpt2ppo_lunar.pt"), "--eval-episodes", "1"), tmp_path
        )
        (eval_run,) = glob.glob(str(tmp_path / "runs" / "*-eval__10003__*"))
        assert code == 0 and len(read_scalars(old, "eval/episodic_return")) == 1
        assert read_scalars(eval_run, "eval/episodic_return") == read_scalars(old, "eval/episodic_return")


def test_learns_cartpole_with_gpt2_critic(tmp_path):
    flags = ("--env-id", "CartPole-v1", "--total-timesteps", "24576", "--seed", "1", "--actor-lr", "1e-3")
    code, _, _ = cli_in_process((*flags, "--value-stride", "8", "--dropout", "0.1", *TINY), tmp_path)
    run = only_run_dir(str(tmp_path))
    rets = [v for _, v in read_scalars(run, "charts/episodic_return")]
    # CartPole: return == length for every logged episode (none lost or mixed up)
    assert code == 0 and rets == [v for _, v in read_scalars(run, "charts/episodic_length")]
    # a random policy averages ~22; seeds 1, 2, 3 reach 283, 250, 227 over their last 30 episodes here
    assert np.mean(rets[:20]) < 40
    assert np.mean(rets[-30:]) > 100, np.mean(rets[-30:])


def test_a_budget_rounds_up_to_whole_rollouts_on_the_default_device(tmp_path):
    """(Stopping, resuming, checkpoints, W&B and videos: the rows every torch script shares, in test_machinery.py.)"""
    flags = ("--critic", "mlp", "--total-timesteps", "300", "--steps-per-epoch", "256", "--seed", "4", "--cuda", *TINY)
    code, out, _ = cli_in_process(flags, tmp_path)
    assert code == 0 and os.path.basename(only_run_dir(str(tmp_path))).startswith("LunarLander-v3__gpt2ppo_lunar__4__")
    assert (
        f"device: {'cuda' if torch.cuda.is_available() else 'cpu'}" in out
    )  # --cuda (the default): where torch sees it
    assert "update 1/2, 256 steps" in out and "512 of 512 steps" in out  # 300 steps: rounded up to 2 rollouts


# ---------------------------------------------------------------------------------------------
# Safeguards: hostile inputs end in one sentence, before anything is written (the rows every torch script shares
# are in test_machinery.py)
# ---------------------------------------------------------------------------------------------


def test_the_mlp_critic_is_not_held_to_the_gpt2_critics_sizes():
    """--context-len and --value-stride are GPT-2's: with --critic mlp they neither count in the memory estimate nor
    have to agree (the same sizes with --critic gpt2 are refused)."""
    for sizes in (dict(context_len=4096, minibatch_size=2048), dict(value_stride=65)):
        g2.check_args(g2.Args(critic="mlp", **sizes))
        with pytest.raises(g2.UserError):
            g2.check_args(g2.Args(critic="gpt2", **sizes))


class MultiAct(TinyBox):
    action_space = gym.spaces.MultiDiscrete([2, 3])


gym.register("MultiAct-v0", entry_point=MultiAct, max_episode_steps=5)
gym.register("NoLimit-v0", entry_point=TinyBox)


def _checkpoint(folder, kind):
    """A --save-model checkpoint in `folder` (LunarLander's actor and MLP critic) whose flags `kind` changes."""
    args = g2.Args(critic="mlp")
    changed = {
        "other_env": dict(env_id="CartPole-v1"),
        "out_of_range": dict(hidden_size=10**9),
        "huge_in_range": dict(critic="gpt2", hidden_size=2**16, n_layer=96, n_head=1024, context_len=4096),
    }[kind]
    model = {k: v.state_dict() for k, v in g2.model_objects(args).items()}
    run = {"script": "gpt2ppo_lunar.py", "run_name": "LunarLander-v3__gpt2ppo_lunar__1__1"}
    path = os.path.join(folder, f"{kind}.pt")
    g2.save_checkpoint(path, {**run, "args": {**asdict(args), **changed}, "objects": model})
    return path


def _loop_objects(args: g2.Args) -> dict:
    """What main builds and carries from one update into the next, for `args`, as Run.start takes them (all but
    next_obs)."""
    N, mode = args.num_envs, gym.vector.AutoresetMode.SAME_STEP
    envs = gym.vector.SyncVectorEnv([g2.make_env(args.env_id)] * N, autoreset_mode=mode)
    max_t, obs_dim, act_dim, discrete = g2.env_dims(envs)
    actor = g2.Actor(obs_dim, act_dim, discrete, args.hidden_size)
    critic = g2.make_critic(args.critic, obs_dim, act_dim, {**asdict(args), "max_timestep": max_t})
    T = args.steps_per_epoch // N
    K, S = (args.context_len, args.value_stride) if args.critic == "gpt2" else (1, 1)  # as main: the MLP's window
    return {
        "actor": actor,
        "critic": critic,
        "actor_optimizer": torch.optim.Adam(actor.parameters(), lr=args.actor_lr, eps=1e-5),
        "critic_optimizer": torch.optim.Adam(
            [p for p in critic.parameters() if p.requires_grad], lr=args.critic_lr, eps=1e-5
        ),
        "shuffle_rng": np.random.default_rng(args.seed),
        "history": g2.History(N, T, K, S, obs_dim, act_dim),
        "episode_return": np.zeros(N),
        "episode_length": np.zeros(N, dtype=np.int64),
        "recent_returns": deque(maxlen=100),
        "envs": envs,
    }


def _training_state(folder, kind):
    """A run folder holding a training state (update 1 of 10 of LunarLander, with Adam's moments) whose flags or
    history `kind` changes."""
    folder.mkdir()
    args = g2.Args(seed=1, critic="mlp", total_timesteps=20480)
    objects = _loop_objects(args)
    for name in ("actor_optimizer", "critic_optimizer"):  # one step with zero gradients: moments, weights unchanged
        for group in objects[name].param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        objects[name].step()
    run = g2.Run(args, g2.StopSignal())
    run.objects, run.run_name = {**objects, "next_obs": objects["envs"].reset(seed=1)[0]}, folder.name
    state = run.training_state(1)
    {
        "three_envs": lambda: state["args"].update(num_envs=3),  # flags that cannot run
        "huge": lambda: state["args"].update(critic="gpt2", hidden_size=2**16, n_layer=96, n_head=1024),
        "eight_envs": lambda: state["args"].update(num_envs=8),  # flags that run, but not with this state's history
        "timesteps": lambda: state["objects"]["history"]["ts"].fill_(-1),  # windows that reach before their episodes
    }[kind]()
    g2.save_checkpoint(str(folder / "training_state.pt"), state)


def _tree(folder) -> list[tuple]:
    """Every path under `folder` with its size and modification time."""
    return sorted((str(p.relative_to(folder)), p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    "flags, message",
    [
        # numbers: one table of ranges, finite, seeds 0..2**32-1, sizes that fit in memory
        _bad(("--total-timesteps", "0"), "--total-timesteps must be in [1, 1e12], got 0"),
        _bad(("--actor-lr", "inf"), "--actor-lr must be in (0, 1], got inf"),
        _bad(("--critic-lr", "nan"), "--critic-lr must be in (0, 1], got nan"),
        _bad(("--actor-lr", "0"), "--actor-lr must be in (0, 1], got 0.0"),
        _bad(("--gamma", "1.5"), "--gamma must be in [0, 1], got 1.5"),
        _bad(("--gae-lambda", "-0.1"), "--gae-lambda must be in [0, 1], got -0.1"),
        _bad(("--clip-coef", "0"), "--clip-coef must be in (0, 10], got 0.0"),
        _bad(("--dropout", "1.0"), "--dropout must be in [0, 0.99], got 1.0"),
        _bad(("--max-grad-norm", "-1"), "--max-grad-norm must be in [0, 1e6], got -1.0"),
        _bad(("--seed", "-1"), "--seed must be in [0, 4294967295], got -1"),
        _bad(("--seed", str(2**32)), "--seed must be in [0, 4294967295], got 4294967296"),
        _bad(("--hidden-size", "0"), "--hidden-size must be in [1, 65536], got 0"),
        _bad(("--num-envs", "100000"), "--num-envs must be in [1, 1024], got 100000"),
        _bad(("--update-epochs", "0"), "--update-epochs must be in [1, 10000], got 0"),
        _bad(("--eval-episodes", "0"), "--eval-episodes must be in [1, 1e6], got 0"),
        _bad(("--torch-threads", "0"), "--torch-threads must be in [1, 1024], got 0"),
        _bad(("--minibatch-size", "100"), "--minibatch-size must divide --steps-per-epoch 2048"),
        _bad(("--steps-per-epoch", "100", "--num-envs", "3"), "must be a multiple of --num-envs 3"),
        _bad(("--value-stride", "65"), "--value-stride must be between 1 and --context-len 64, got 65"),
        _bad(("--n-head", "3"), "--n-head 3 must divide --hidden-size 64"),
        _bad(("--hidden-size", "65536", "--n-layer", "96"), "GiB, more than this machine's"),
        _bad(("--context-len", "4096", "--minibatch-size", "2048"), "GiB, more than this machine's"),
        # choices: Literal flags, listed and enforced by tyro (its own message, exit 2)
        _bad(("--critic", "lstm"), None),
        _bad(("--update-schedule", "random"), None),
        # envs that do not exist or do not fit
        _bad(("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
        _bad(("--env-id", "Blackjack-v1"), "needs a flat Box observation"),
        _bad(("--env-id", "MultiAct-v0"), "needs a Discrete or flat Box action space"),
        _bad(("--env-id", "NoLimit-v0"), "has no episode limit"),
        # flags that are not (or no longer) flags, or not of their type: tyro's own message, exit 2
        _bad(("--num-steps", "3"), None),
        _bad(("--batch-size", "3"), None),
        _bad(("--target-kl", "0.1"), None),
        _bad(("--progress-every", "1"), None),
        _bad(("--seed", "1.5"), None),
        # a checkpoint whose flags this script cannot run, or whose env's spaces are not those of its weights
        _bad(("--eval-checkpoint", "ckpt:out_of_range"), "--hidden-size must be in [1, 65536], got 1000000000"),
        _bad(("--eval-checkpoint", "ckpt:huge_in_range"), "GiB, more than this machine's"),
        _bad(
            ("--eval-checkpoint", "ckpt:other_env"),
            "other_env.pt' holds what another run's flags or another version of gpt2ppo_lunar.py made "
            "(it.objects.actor.body.0.weight is not a torch.float32 tensor of shape (64, 4)",
        ),
        # a training state whose flags cannot run (here), or that does not fit the objects they make
        _bad(("--resume", "resume:three_envs"), "--steps-per-epoch must be a multiple of --num-envs 3"),
        _bad(("--resume", "resume:huge"), "GiB, more than this machine's"),
        _bad(
            ("--resume", "resume:eight_envs"),
            "holds what another run's flags or another version of gpt2ppo_lunar.py made "
            "(it.objects.history.obs is not a torch.float32 tensor of shape (8, 257, 8)",
        ),
        _bad(
            ("--resume", "resume:timesteps"),
            "holds what another run's flags or another version of gpt2ppo_lunar.py made "
            "(its history holds windows that reach outside their episodes",
        ),
    ],
)
def test_hostile_input_ends_in_one_sentence_and_writes_nothing(tmp_path, monkeypatch, flags, message):
    given = tmp_path / "given"
    given.mkdir()
    for f in flags:
        if f.startswith("resume:"):
            _training_state(given / f[7:], f[7:])

    def path_of(f):  # the file or folder a flag value names
        if f.startswith("ckpt:"):
            return _checkpoint(str(given), f[5:])
        return str(given / f[7:]) if f.startswith("resume:") else f

    flags = [path_of(f) for f in flags]
    before = _tree(tmp_path)

    def no_run(*a, **kw):  # a row that got past the checks would start logging here: fail at once instead
        raise AssertionError("the run started")

    monkeypatch.setattr("torch.utils.tensorboard.SummaryWriter", no_run)
    # tyro's own errors exit 2 from inside cli; the script's are a UserError, turned into exit 2 by cli alone
    code, _, err = cli_in_process(flags, tmp_path)
    assert code == 2 and "Traceback" not in err
    if message is not None:
        assert err.strip().startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert message in err and err.strip().endswith("."), err
    assert _tree(tmp_path) == before  # nothing written
