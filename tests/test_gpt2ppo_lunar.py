import dataclasses
import glob
import math
import os

import gymnasium as gym
import numpy as np
import pytest
import torch

import gpt2ppo_lunar as g2
from conftest import ROOT, baseline_script, only_run_dir, read_scalars, run_script, same_numbers

TINY = ("--hidden-size", "16", "--n-head", "2", "--context-len", "8", "--update-epochs", "2", "--minibatch-size", "64")


def _rows(hist, steps, envs):
    """Flat History rows of (rollout step, env) pairs."""
    return (np.asarray(envs) * hist.L + hist.K - 1 + np.asarray(steps)).astype(np.int64)


def _tiny_critic(obs_dim=3, act_dim=2, K=6, dropout=0.0, max_t=50, seed=0):
    torch.manual_seed(seed)
    return g2.GPT2Critic(
        obs_dim, act_dim, hidden=16, context_len=K, n_layer=2, n_head=2, dropout=dropout, max_timestep=max_t
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
    start = 0 if S == 1 and t < K else max(0, S * ((t - K + S) // S))
    part = [e for e in episode if e[2] >= start][-K:]
    return part


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
    tiny, _ = g2.attention_with_fast_dropout(None, q, k, v, allowed, dropout=1e-12)  # the math path
    assert torch.allclose(tiny, ref, atol=1e-6)
    causal, _ = g2.attention_with_fast_dropout(None, q, k, v, None, dropout=1e-12)  # mask None: causal
    ref_causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert torch.allclose(causal, ref_causal, atol=1e-6)
    # with dropout p the kept weights are scaled by 1/(1-p): with v = one-hot columns the output IS
    # the dropped-and-rescaled weight matrix, so the rate and the scale can be read off it
    p, L = 0.5, 64
    eye = torch.eye(L).expand(40, 1, L, L)
    w, _ = g2.attention_with_fast_dropout(
        None, torch.zeros(40, 1, L, L), torch.zeros(40, 1, L, L), eye, None, dropout=p
    )
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
# The script end to end
# ---------------------------------------------------------------------------------------------

TAGS = (
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/SPS",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/approx_kl",
    "losses/explained_variance",
)
BUDGET = ("--total-timesteps", "512", "--steps-per-epoch", "256", "--seed", "3")


@pytest.mark.parametrize(
    "flags",
    [
        ("--critic", "mlp"),
        ("--critic", "gpt2", "--value-stride", "64"),
        ("--critic", "gpt2"),  # exact windows (stride 1), the default
        ("--critic", "gpt2", "--value-stride", "64", "--dropout", "0.1"),
        ("--critic", "gpt2", "--value-stride", "64", "--update-schedule", "authors"),
        (
            "--env-id",
            "BipedalWalker-v3",
            "--critic",
            "gpt2",
            "--value-stride",
            "64",
            "--save-model",
            "--eval-episodes",
            "1",
        ),
    ],
    ids=["mlp", "gpt2-stride64", "gpt2-exact", "dropout0.1", "authors", "bipedal-gpt2-eval"],
)
def test_same_numbers_as_before_the_redesign(tmp_path, flags):
    """Every kept path logs, bit for bit, what the script logged before the redesign (same machine, side by side)."""
    _, run = same_numbers("gpt2ppo_lunar.py", *BUDGET, *flags, tmp_path=tmp_path)
    for tag in TAGS[2:]:
        assert len(read_scalars(run, tag)) == 2, tag
    if "--save-model" in flags:  # every trainable GPT-2 parameter moved; the zeroed position embeddings did not
        actor, critic, a = g2.load_checkpoint(os.path.join(run, "gpt2ppo_lunar.pt"))
        torch.manual_seed(3)
        g2.Actor(24, 4, False, a["hidden_size"])
        init = g2.make_critic("gpt2", 24, 4, a)
        trained = dict(critic.named_parameters())
        for name, p0 in init.named_parameters():
            assert torch.equal(trained[name], p0) == name.startswith(("gpt2.wpe", "gpt2.wte")), name
        assert len(read_scalars(run, "eval/episodic_return")) == 1


def test_acrobot_both_critics_truncation_and_checkpoint_round_trip(tmp_path):
    for critic in ("mlp", "gpt2"):
        cwd = str(tmp_path / critic)
        os.makedirs(cwd)
        out = run_script(
            "gpt2ppo_lunar.py",
            "--env-id",
            "Acrobot-v1",
            "--critic",
            critic,
            "--total-timesteps",
            "1024",
            "--steps-per-epoch",
            "512",
            "--num-envs",
            "2",
            *TINY,
            *(("--save-model", "--eval-episodes", "1") if critic == "gpt2" else ()),
            cwd=cwd,
        ).stdout
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


def test_learns_cartpole_with_gpt2_critic(tmp_path):
    cwd = str(tmp_path)
    run_script(
        "gpt2ppo_lunar.py",
        "--env-id",
        "CartPole-v1",
        "--total-timesteps",
        "24576",
        "--seed",
        "1",
        "--actor-lr",
        "1e-3",
        "--value-stride",
        "8",
        "--dropout",
        "0.1",
        *TINY,
        cwd=cwd,
    )
    run = only_run_dir(cwd)
    rets = [v for _, v in read_scalars(run, "charts/episodic_return")]
    # CartPole: return == length for every logged episode (none lost or mixed up)
    assert rets == [v for _, v in read_scalars(run, "charts/episodic_length")]
    # a random policy averages ~22; seeds 1, 2, 3 reach 283, 250, 227 over their last 30 episodes here
    assert np.mean(rets[:20]) < 40
    assert np.mean(rets[-30:]) > 100, np.mean(rets[-30:])


def test_save_model_eval_equals_eval_checkpoint_and_names(tmp_path):
    cwd = str(tmp_path)
    flags = (
        "--critic",
        "mlp",
        "--total-timesteps",
        "300",
        "--steps-per-epoch",
        "256",
        "--seed",
        "4",
        "--save-model",
        "--eval-episodes",
        "2",
        *TINY,
    )
    out = run_script("gpt2ppo_lunar.py", *flags, cwd=cwd).stdout
    run = only_run_dir(cwd)
    assert os.path.basename(run).startswith("LunarLander-v3__gpt2ppo_lunar__critic-mlp__4__")
    assert "device cpu" in out and "update 1/2, 256 steps" in out  # 300 steps: rounded up to 2 whole rollouts
    assert "512 of 512 steps" in out and len(read_scalars(run, "losses/policy_loss")) == 2
    in_run = out.split("eval: ")[1].strip()
    ckpt = os.path.join(run, "gpt2ppo_lunar.pt")
    torch.load(ckpt, weights_only=True)  # plain tensors and Python values only
    out = run_script("gpt2ppo_lunar.py", "--eval-checkpoint", ckpt, "--eval-episodes", "2", cwd=cwd).stdout
    assert in_run in out and "seeds 10004..10005" in out  # the same rule (10000 + seed + i), the same numbers
    eval_runs = glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10004__*"))
    assert len(eval_runs) == 1
    out = run_script(
        "gpt2ppo_lunar.py", "--eval-checkpoint", ckpt, "--eval-episodes", "2", "--seed", "9", cwd=cwd
    ).stdout
    assert "seeds 10009..10010" in out
    assert g2.make_run_dir("x", root=str(tmp_path / "r")) != g2.make_run_dir("x", root=str(tmp_path / "r"))


def interrupt_after_first_update(
    script: str,
    flags: tuple,
    cwd: str,
    marker: str = "update 1/",
    sig: str = "SIGINT",
    progress: tuple = ("--progress-every", "1"),
):
    """Start a long run, wait for its first progress line, send `sig` (Ctrl-C: SIGINT); return (rc, stdout, stderr).
    Other scripts' tests use it too."""
    import signal
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script), *flags, *progress],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            break
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out, err


def test_checkpoints_written_before_the_redesign_evaluate_the_same(tmp_path):
    """Runs of the benchmark made with the earlier script keep evaluating, to the same numbers."""
    old = baseline_script("gpt2ppo_lunar.py", str(tmp_path / "code"))
    flags = (
        "--env-id",
        "BipedalWalker-v3",
        "--critic",
        "mlp",
        "--total-timesteps",
        "256",
        "--steps-per-epoch",
        "256",
        "--save-model",
        "--eval-episodes",
        "2",
    )
    out = run_script(old, *flags, "--no-progress", cwd=str(tmp_path)).stdout
    ckpt = glob.glob(str(tmp_path / "runs" / "*" / "gpt2ppo_lunar.pt"))[0]
    mean_std = out.split("eval: ")[1].split(" over")[0]
    out = run_script("gpt2ppo_lunar.py", "--eval-checkpoint", ckpt, "--eval-episodes", "2", cwd=str(tmp_path)).stdout
    assert f"over 2 episodes {mean_std} " in out, (mean_std, out)


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_signal_mid_run_keeps_the_checkpoint_and_exits_with_one_line(tmp_path, sig, code):
    """Ctrl-C and SIGTERM (timeout, kill, schedulers) alike: the update finishes, the checkpoint is saved, one line."""
    cwd = str(tmp_path)
    rc, out, err = interrupt_after_first_update(
        "gpt2ppo_lunar.py",
        ("--critic", "mlp", "--total-timesteps", "10000000", "--steps-per-epoch", "256", "--save-model", *TINY),
        cwd,
        sig=sig,
        progress=(),
    )
    assert rc == code and "Traceback" not in err, err
    last = out.strip().splitlines()[-1]
    assert f"stopped by {sig} after" in last and "checkpoint saved to" in last
    ckpt = glob.glob(os.path.join(cwd, "runs", "*", "gpt2ppo_lunar.pt"))
    assert len(ckpt) == 1 and not glob.glob(os.path.join(cwd, "runs", "*", "*.tmp*"))
    actor, critic, a = g2.load_checkpoint(ckpt[0])
    assert a["critic"] == "mlp" and isinstance(actor, g2.Actor)
    assert read_scalars(only_run_dir(cwd), "losses/policy_loss")  # the writer was flushed and closed


def test_stop_during_evaluation_keeps_what_was_done(tmp_path, capsys):
    class Stop:
        signum = 0

    stop, writer = Stop(), g2.SummaryWriter(str(tmp_path))
    log = writer.add_scalar

    def add_scalar(*a, **k):  # Ctrl-C as soon as the first episode is logged
        log(*a, **k)
        stop.signum = 2

    writer.add_scalar = add_scalar
    with pytest.raises(SystemExit) as e:
        g2.evaluate(g2.Actor(4, 2, True, 8), "CartPole-v1", 3, seed=0, stop=stop, writer=writer)
    assert e.value.code == 130 and "evaluation stopped after 1 of 3 episodes" in capsys.readouterr().out
    assert len(read_scalars(str(tmp_path), "eval/episodic_return")) == 1


# ---------------------------------------------------------------------------------------------
# Hostile input: one sentence on stderr, a non-zero exit, nothing written
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A good LunarLander checkpoint and hostile variants of it, in their own folder."""
    d = tmp_path_factory.mktemp("ckpts")
    args = {**dataclasses.asdict(g2.Args(seed=1, critic="mlp")), "max_timestep": 1000}
    good = str(d / "good.pt")
    g2.save_checkpoint(
        good,
        g2.Actor(8, 4, True, 64),
        g2.MLPCritic(8, 64),
        args,
        {"obs_dim": 8, "act_dim": 4, "discrete": True},
        "run1",
    )
    ckpt = torch.load(good, weights_only=True)
    variants = {
        "garbage": b"not a checkpoint at all",
        "truncated": open(good, "rb").read()[:300],
        "foreign": {"model": {}, "step": 3},
        "wrong-type": {**ckpt, "args": {**args, "seed": "one"}},
        "other-env": {**ckpt, "args": {**args, "env_id": "CartPole-v1"}},
        "huge-size": {**ckpt, "args": {**args, "hidden_size": 10**9}},
        "bad-run-name": {**ckpt, "run_name": "../../escape"},
        "wrong-shapes": {**ckpt, "args": {**args, "hidden_size": 32}},
    }
    for name, content in variants.items():
        if isinstance(content, bytes):
            (d / f"{name}.pt").write_bytes(content)
        else:
            torch.save(content, str(d / f"{name}.pt"))
    return d


CKPT_CASES = [
    ("missing", "no such file"),
    ("garbage", "cannot be read"),
    ("truncated", "cannot be read"),
    ("foreign", "keys are missing or of the wrong type"),
    ("wrong-type", "keys are missing or of the wrong type"),
    ("other-env", "are not those of CartPole-v1"),
    ("huge-size", "--hidden-size must be a finite number in"),
    ("bad-run-name", "run name"),
    ("wrong-shapes", "its weights do not fit its args"),
    ("", "is a directory"),
]
HOSTILE = [
    (("--total-timesteps", "0"), "--total-timesteps must be a finite number in [1, "),
    (("--actor-lr", "inf"), "--actor-lr must be a finite number"),
    (("--critic-lr", "nan"), "--critic-lr must be a finite number"),
    (("--gamma", "1.5"), "--gamma must be a finite number in [0.0, 1.0]"),
    (("--gae-lambda", "-0.1"), "--gae-lambda must be"),
    (("--clip-coef", "0"), "--clip-coef must be"),
    (("--dropout", "1.0"), "--dropout must be"),
    (("--max-grad-norm", "-1"), "--max-grad-norm must be"),
    (("--seed", "-1"), "--seed must be a finite number in [0, 4294967295]"),
    (("--seed", str(2**32)), "--seed must be"),
    (("--hidden-size", "0"), "--hidden-size must be"),
    (("--num-envs", "100000"), "--num-envs must be"),
    (("--update-epochs", "0"), "--update-epochs must be"),
    (("--eval-episodes", "0"), "--eval-episodes must be"),
    (("--torch-threads", "0"), "--torch-threads must be"),
    (("--minibatch-size", "100"), "--minibatch-size must divide --steps-per-epoch 2048"),
    (("--steps-per-epoch", "100", "--num-envs", "3"), "must be a multiple of --num-envs 3"),
    (("--value-stride", "65"), "--value-stride must be between 1 and --context-len 64"),
    (("--n-head", "3"), "--n-head 3 must divide --hidden-size 64"),
    (("--hidden-size", "65536", "--n-layer", "96"), "GiB, more than this machine's"),
    (("--context-len", "4096", "--minibatch-size", "2048"), "GiB, more than this machine's"),
    (("--exp-name", "../up"), "--exp-name must be a plain name"),
    (("--exp-name", "a/b"), "--exp-name must be a plain name"),
    (("--exp-name", ".."), "--exp-name must be a plain name"),
    (("--exp-name", "x" * 65), "--exp-name must be a plain name"),
    (("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
    (("--env-id", "Blackjack-v1"), "needs a flat Box observation"),
    (
        ("--eval-checkpoint", "CKPT:good", "--critic", "mlp", "--total-timesteps", "5"),
        "training flags cannot be given with it (--critic --total-timesteps)",
    ),
    *[(("--eval-checkpoint", f"CKPT:{name}"), message) for name, message in CKPT_CASES],
    pytest.param(
        ("--cuda",),
        "torch sees no CUDA device",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present"),
    ),
]


@pytest.mark.parametrize("flags, message", HOSTILE, ids=lambda v: " ".join(v)[:50] if isinstance(v, tuple) else "")
def test_hostile_input_one_sentence_nonzero_exit_nothing_written(
    tmp_path, monkeypatch, capsys, checkpoints, flags, message
):
    import tyro

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    flags = [
        (str(checkpoints / f"{f[5:]}.pt") if f[5:] else str(checkpoints)) if f.startswith("CKPT:") else f for f in flags
    ]
    with pytest.raises(SystemExit) as e:
        g2.main(tyro.cli(g2.Args, args=flags), cuda_asked="--cuda" in flags)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert err.startswith("error: ") and message in err and "\n" not in err and err.endswith("."), err
    assert os.listdir(cwd) == []  # no run folder, no model


def test_not_flags_and_unwritable_runs_end_without_traceback(tmp_path):
    for flag in ("--num-steps", "--batch-size", "--progress-every", "--target-kl"):  # run-time fields, removed flags
        proc = run_script("gpt2ppo_lunar.py", flag, "3", cwd=str(tmp_path), check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, flag
    assert os.listdir(tmp_path) == []
    (tmp_path / "runs").write_text("a file where the runs folder should be")  # as unwritable as it gets, even as root
    proc = run_script("gpt2ppo_lunar.py", "--critic", "mlp", "--total-timesteps", "256", cwd=str(tmp_path), check=False)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: cannot create the run folder runs/")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("failure", ["disk full", "target is a folder"])
def test_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch, capsys, failure):
    path = str(tmp_path / "m.pt")
    spaces = {"obs_dim": 8, "act_dim": 4, "discrete": True}
    args = {**dataclasses.asdict(g2.Args(critic="mlp")), "max_timestep": 1000}
    actor, critic = g2.Actor(8, 4, True, 64), g2.MLPCritic(8, 64)
    if failure == "disk full":
        g2.save_checkpoint(path, actor, critic, args, spaces, "r")
        before = open(path, "rb").read()
        real_save = torch.save

        def full(obj, f):
            real_save(obj, f)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(torch, "save", full)
    else:
        os.makedirs(os.path.join(path, "x"))
    with pytest.raises(SystemExit) as e:
        g2.save_checkpoint(path, actor, critic, args, spaces, "r")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error: could not save the checkpoint") and "\n" not in err
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]  # no temporary file left
    if failure == "disk full":
        assert open(path, "rb").read() == before


def test_every_numeric_field_has_a_range_and_the_targets_hold():
    numeric = {f.name for f in dataclasses.fields(g2.Args) if f.type in ("int", "float", "Optional[int]")}
    assert numeric == set(g2.RANGES)
    g2.check_args(g2.Args())  # the defaults pass
    with open(g2.__file__) as f:
        lines = f.read().splitlines()
    fields = len(dataclasses.fields(g2.Args))
    print(f"gpt2ppo_lunar.py: {len(lines)} lines (target <= 650), {fields} Args fields (target <= 32)")
    assert len(lines) <= 650 and fields <= 32


def test_check_env_refuses_unfit_spaces():
    class MultiAct(TinyBox):
        action_space = gym.spaces.MultiDiscrete([2, 3])

    gym.register("MultiAct-v0", entry_point=MultiAct, max_episode_steps=5)
    gym.register("NoLimit-v0", entry_point=TinyBox)
    with pytest.raises(SystemExit):
        g2.check_env("MultiAct-v0")
    with pytest.raises(SystemExit):
        g2.check_env("NoLimit-v0")
    assert g2.check_env("TinyBox-v0") == (12, 3, 2, False)
    assert g2.check_env("LunarLander-v3") == (1000, 8, 4, True)
