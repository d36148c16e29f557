import glob
import importlib.util
import os

import numpy as np
import pytest
import torch

import trpo_gpt2_halfcheetah as trpo
from conftest import only_run_dir, read_scalars, run_script

SCRIPT = "trpo_gpt2_halfcheetah.py"


# ------------------------------------------------------------------------------------------------
# Math helpers against closed forms and torch.distributions
# ------------------------------------------------------------------------------------------------


def test_normal_log_density_and_kl_match_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean0, mean1 = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g,
                                                                                      dtype=torch.float64)
    ls0, ls1 = 0.3 * torch.randn(1, 3, generator=g, dtype=torch.float64), 0.3 * torch.randn(1, 3, generator=g,
                                                                                           dtype=torch.float64)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    d0 = torch.distributions.Independent(torch.distributions.Normal(mean0, ls0.exp().expand(5, 3)), 1)
    d1 = torch.distributions.Independent(torch.distributions.Normal(mean1, ls1.exp().expand(5, 3)), 1)
    assert torch.allclose(trpo.normal_log_density(x, mean0, ls0), d0.log_prob(x))
    assert torch.allclose(trpo.diag_gaussian_kl(mean0, ls0, mean1, ls1), torch.distributions.kl_divergence(d0, d1))
    assert torch.allclose(trpo.diag_gaussian_entropy(ls0).expand(5), d0.entropy())
    assert torch.allclose(trpo.diag_gaussian_kl(mean0, ls0, mean0, ls0), torch.zeros(5, dtype=torch.float64))


def test_conjugate_gradient_solves_spd_system():
    g = torch.Generator().manual_seed(1)
    M = torch.randn(8, 8, generator=g, dtype=torch.float64)
    A = M @ M.T + 0.5 * torch.eye(8, dtype=torch.float64)
    b = torch.randn(8, generator=g, dtype=torch.float64)
    x = trpo.conjugate_gradient(lambda v: A @ v, b, nsteps=20, residual_tol=1e-20)
    assert torch.allclose(A @ x, b, atol=1e-8)
    assert torch.allclose(x, torch.linalg.solve(A, b), atol=1e-8)
    # with few iterations it is not converged (the iteration cap is respected)
    x2 = trpo.conjugate_gradient(lambda v: A @ v, b, nsteps=2)
    assert (A @ x2 - b).norm() > 1e-3


def test_fvp_equals_explicit_fisher_on_tiny_mlp_policy():
    torch.manual_seed(0)
    policy = trpo.MLPPolicy(3, 2, hidden=4).double()
    with torch.no_grad():
        policy.action_log_std.fill_(0.2)
    names = [n for n, _ in policy.named_parameters() if n != "action_log_std"] + ["action_log_std"]
    named = dict(policy.named_parameters())
    params = [named[n] for n in names]  # mean parameters first, the log-std last
    obs = torch.randn(6, 3, dtype=torch.float64)

    def kl_fn():
        mean, ls = policy(obs), policy.action_log_std
        return trpo.diag_gaussian_kl(mean.detach(), ls.detach(), mean, ls).mean()

    damping = 0.1
    fvp = trpo.make_fvp(kl_fn, params, damping)
    # Explicit Fisher of a Gaussian with state-independent log-std: for the mean parameters
    # mean_i J_i^T diag(1/sigma^2) J_i (J_i the Jacobian of sample i's mean); for log-std 2 I.
    n_mean = sum(p.numel() for p in params[:-1])
    x0 = trpo.flat_params(params[:-1])

    def mean_of(flat):
        tensors, i = {}, 0
        for n, p in zip(names[:-1], params[:-1]):
            tensors[n] = flat[i:i + p.numel()].view_as(p)
            i += p.numel()
        return torch.func.functional_call(policy, tensors, (obs,))

    J = torch.autograd.functional.jacobian(mean_of, x0)  # (6, 2, n_mean)
    prec = torch.exp(-2 * policy.action_log_std.detach())[0]
    F = torch.zeros(n_mean + 2, n_mean + 2, dtype=torch.float64)
    F[:n_mean, :n_mean] = torch.einsum("nap,a,naq->pq", J, prec, J) / obs.shape[0]
    F[n_mean:, n_mean:] = 2 * torch.eye(2, dtype=torch.float64)
    for seed in range(3):
        v = torch.randn(n_mean + 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(fvp(v), F @ v + damping * v, atol=1e-10)


def test_fvp_on_tiny_gpt2_policy_matches_finite_difference_of_kl_gradient():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    gpt = GPT2Model._from_config(cfg, attn_implementation="eager").eval()
    policy = trpo.GPT2Policy(gpt, 4, 2, "embed", "per-dim", hidden=8).double().eval()
    params = [p for p in policy.parameters() if p.requires_grad]
    obs = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        old_mean = policy(obs).clone()
        old_ls = policy.action_log_std.clone()

    def kl_at_current():
        mean, ls = policy(obs), policy.action_log_std
        return trpo.diag_gaussian_kl(old_mean, old_ls, mean, ls).mean()

    def kl_old_detached():
        mean, ls = policy(obs), policy.action_log_std
        return trpo.diag_gaussian_kl(mean.detach(), ls.detach(), mean, ls).mean()

    fvp = trpo.make_fvp(kl_old_detached, params, damping=0.0)
    x0 = trpo.flat_params(params)
    v = torch.randn_like(x0)
    fv = fvp(v)  # before the parameters are perturbed in place below
    eps = 1e-5
    grads = []
    for sign in (1, -1):
        trpo.set_flat_params(params, x0 + sign * eps * v)
        grads.append(trpo.flat_grad(kl_at_current(), params))
    trpo.set_flat_params(params, x0)
    fd = (grads[0] - grads[1]) / (2 * eps)
    assert torch.allclose(fv, fd, rtol=1e-5, atol=1e-8)
    assert fv.norm() > 1e-3


def _quadratic_problem():
    """loss(x) = -(x . d) (the surrogate improves along d), KL(x) = 0.5 |x|^2 * scale."""
    d = torch.tensor([1.0, 0.0], dtype=torch.float64)
    return d


def test_line_search_accepts_a_good_step():
    d = _quadratic_problem()
    calls = []

    def eval_fn(x):
        calls.append(x.clone())
        return float(-(x @ d)), float(0.5 * (x @ x))

    x0 = torch.zeros(2, dtype=torch.float64)
    ok, xnew, tried = trpo.line_search(eval_fn, x0, torch.tensor([0.1, 0.0], dtype=torch.float64), 0.1, max_kl=0.01)
    assert ok and tried == 1 and torch.allclose(xnew, torch.tensor([0.1, 0.0], dtype=torch.float64))


def test_line_search_backtracks_on_kl_and_rejects_kl_breaking_step():
    d = _quadratic_problem()
    x0 = torch.zeros(2, dtype=torch.float64)
    full = torch.tensor([1.0, 0.0], dtype=torch.float64)

    # KL 0.5 * |x|^2: the full step (KL 0.5) and its halves 0.125, 0.03125 break max_kl 0.01;
    # the 4th try (x = 0.125, KL 0.0078) is the first inside: the reference (no KL check) took the first.
    def eval_fn(x):
        return float(-(x @ d)), float(0.5 * (x @ x))

    ok, xnew, tried = trpo.line_search(eval_fn, x0, full, 1.0, max_kl=0.01)
    assert ok and tried == 4 and torch.allclose(xnew, full / 8)

    # A step whose KL is too large at every fraction tried is rejected: the old parameters stay.
    ok, xnew, tried = trpo.line_search(lambda x: (float(-(x @ d)), 1.0), x0, full, 1.0, max_kl=0.01)
    assert not ok and tried == 10 and torch.equal(xnew, x0)


def test_line_search_rejects_a_surrogate_lowering_step():
    d = _quadratic_problem()
    x0 = torch.zeros(2, dtype=torch.float64)
    # The step goes against d: the loss rises at every fraction (KL is fine), so nothing is accepted.
    ok, xnew, _ = trpo.line_search(lambda x: (float(-(x @ d)), 0.0), x0, torch.tensor([-0.1, 0.0],
                                   dtype=torch.float64), 0.1, max_kl=0.01)
    assert not ok and torch.equal(xnew, x0)
    # An improvement far below the expected one (ratio < 0.1 at every fraction) is rejected too.
    ok, _, _ = trpo.line_search(lambda x: (float(-(x @ d)), 0.0), x0, torch.tensor([1e-3, 0.0],
                                dtype=torch.float64), 1.0, max_kl=0.01)
    assert not ok


def test_running_mean_std_matches_numpy_and_clips():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(101, 4))
    rms = trpo.RunningMeanStd(4, clip=5.0)
    for chunk in np.array_split(data, 7):  # uneven chunks: the merged statistics must be exact
        rms.update(chunk)
    assert rms.count == 101
    assert np.allclose(rms.mean, data.mean(0)) and np.allclose(rms.std, data.std(0, ddof=1))
    z = rms.normalize(np.array([data.mean(0) + 100 * data.std(0, ddof=1), data.mean(0)]))
    assert np.allclose(z[0], 5.0) and np.allclose(z[1], 0.0, atol=1e-6)


def test_value_fit_lbfgs_reduces_error():
    torch.manual_seed(0)
    obs = torch.randn(256, 3, dtype=torch.float64)
    targets = 3 * obs[:, 0] - obs[:, 1] ** 2 + 1.0
    vnet = trpo.ValueNet(3, 16).double()
    with torch.no_grad():
        before = float((vnet(obs) - targets).pow(2).mean())
    after = trpo.fit_value_lbfgs(vnet, obs, targets, l2_reg=1e-3, max_iter=25)
    assert after < 0.2 * before, (before, after)


# ------------------------------------------------------------------------------------------------
# GPT-2 policy details (in process, the tiny model saved by conftest)
# ------------------------------------------------------------------------------------------------


def test_text_encoding_reads_last_real_token_despite_padding(tiny_gpt2_dir):
    args = trpo.Args(llm=tiny_gpt2_dir, state_encoding="text", instruction="run forward as fast as possible")
    policy = trpo.build_policy(args, 3, 2)
    assert not policy.training and policy.transformer.config.resid_pdrop == 0.0
    obs = torch.tensor([[0.1, -2.25, 3.0], [-4.99, 0.0, 1.5]])
    enc = policy.encode(obs)
    assert (enc["attention_mask"].sum(1) > 0).all()
    with torch.no_grad():
        both = policy.mean_from(enc)
        alone = torch.cat([policy.mean_from(policy.encode(obs[i:i + 1])) for i in range(2)])
        again = policy.mean_from(enc)
    assert torch.allclose(both, alone, atol=1e-5)  # padding did not leak into the read-out
    assert torch.equal(both, again)  # dropout off: deterministic
    # the instruction is tokenized once, at construction, and prefixed to every state
    assert policy.prefix_ids.tolist() == policy.tokenizer("run forward as fast as possible")["input_ids"]
    assert policy.obs_to_text(np.array([[0.1, -2.25]])) == ["0.10 -2.25"]


def test_finetune_blocks_trains_only_last_blocks_and_head(tiny_gpt2_dir):
    args = trpo.Args(llm=tiny_gpt2_dir, finetune_blocks=1, instruction="run forward", state_encoding="embed",
                     batch_size=64, fvp_subsample=2, max_kl=0.05)
    policy = trpo.build_policy(args, 3, 2)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert all(n.startswith(("transformer.h.1.", "transformer.ln_f.", "head.", "action_mean", "action_log_std",
                             "proj")) for n in trainable)
    assert any(n.startswith("transformer.h.1.") for n in trainable) and "proj.weight" in trainable
    assert not any(n.startswith(("transformer.h.0.", "transformer.wte", "transformer.wpe")) for n in trainable)
    # the instruction embedding (frozen token embeddings) is computed once and cached
    obs = torch.randn(64, 3)
    policy(obs)
    cached = policy._prefix_cache
    policy(obs)
    assert cached is not None and policy._prefix_cache is cached
    # a TRPO step changes only trainable parameters and respects the trust region
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    params = [p for p in policy.parameters() if p.requires_grad]
    actions = torch.randn(64, 2)
    adv = torch.randn(64)
    stats = trpo.trpo_step(policy, params, policy.encode(obs), actions, adv, args)
    assert stats["accepted"] and 0 < stats["kl"] <= args.max_kl and stats["surrogate"] > stats["surrogate_before"]
    for n, p in policy.named_parameters():
        changed = not torch.equal(p.detach(), before[n])
        if n.startswith(("transformer.h.0.", "transformer.wte", "transformer.wpe")):
            assert not changed, n
    assert not torch.equal(policy.proj.weight.detach(), before["proj.weight"])
    # all blocks (-1) with the embed encoding and no instruction: everything but the unused token embeddings
    policy = trpo.build_policy(trpo.Args(llm=tiny_gpt2_dir), 3, 2)
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    assert frozen == {"transformer.wte.weight"}


# ------------------------------------------------------------------------------------------------
# The script as a user runs it
# ------------------------------------------------------------------------------------------------


def _short(seed, *extra):
    # 2 envs x 1000 steps per update; HalfCheetah episodes are 1000 steps (truncation)
    return ("--policy", "mlp", "--total-timesteps", "4000", "--batch-size", "2000", "--num-envs", "2",
            "--seed", str(seed), *extra)


def test_mlp_smoke_every_episode_logged_and_seeded_runs_identical(tmp_path):
    logs = []
    for k in range(2):
        cwd = str(tmp_path / f"r{k}")
        os.makedirs(cwd)
        run_script(SCRIPT, *_short(7), cwd=cwd)
        run = only_run_dir(cwd)
        logs.append((read_scalars(run, "charts/episodic_return"), read_scalars(run, "losses/kl")))
    rets, kls = logs[0]
    # 4000 steps over 2 envs = 4 finished episodes, two pairs ending on the same step
    assert len(rets) == 4 and sorted({s for s, _ in rets}) == [2000, 4000]
    lens = read_scalars(run, "charts/episodic_length")
    assert [v for _, v in lens] == [1000.0] * 4
    assert logs[0] == logs[1]  # seeded CPU runs reproduce exactly
    assert len(kls) == 2 and all(0 <= v <= 0.01 for _, v in kls)
    for tag in ("charts/SPS", "losses/surrogate", "losses/value_loss", "losses/entropy", "charts/line_search_steps",
                "charts/step_accepted", "time/rollout_seconds", "time/update_seconds", "time/cg_seconds",
                "time/value_fit_seconds", "time/grad_seconds", "time/line_search_seconds"):
        assert len(read_scalars(run, tag)) == 2, tag


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_value_fit_overlap_computes_the_same_numbers_bit_for_bit(tmp_path, dtype):
    # issue 17: the value fit of update k runs in a second thread beside the policy step and rollout k+1; the same
    # operations on the same numbers, so the weights and every logged loss equal the in-line run's exactly. In
    # float32 the fit's observations share memory with the rollout buffer unless copied: a missing copy shows here.
    out = {}
    for overlap in ("--overlap-value-fit", "--no-overlap-value-fit"):
        cwd = str(tmp_path / overlap)
        os.makedirs(cwd)
        run_script(SCRIPT, *_short(3, "--total-timesteps", "6000", "--mlp-dtype", dtype, "--save-model",
                                   "--eval-episodes", "1", overlap), cwd=cwd)
        run = only_run_dir(cwd)
        ckpt = torch.load(glob.glob(os.path.join(run, "*.pt"))[0], weights_only=True)
        out[overlap] = (ckpt, {tag: read_scalars(run, tag) for tag in ("losses/value_loss", "losses/kl",
                                                                        "losses/explained_variance")})
    (a, sa), (b, sb) = out.values()
    assert sa == sb and len(sa["losses/value_loss"]) == 3  # every update's value loss, under its own step
    assert [s for s, _ in sa["losses/value_loss"]] == [2000, 4000, 6000]
    for net in ("policy", "value"):
        assert a[net].keys() == b[net].keys()
        for k in a[net]:
            assert torch.equal(a[net][k], b[net][k]), (net, k)
    # and the value net did train: the checkpoint's is not the initial one (output layer starts at bias 0)
    assert float(a["value"]["net.4.bias"].abs()) > 0


def test_learns_inverted_pendulum(tmp_path):
    cwd = str(tmp_path)
    run_script(SCRIPT, "--policy", "mlp", "--env-id", "InvertedPendulum-v5", "--batch-size", "2000", "--num-envs",
               "2", "--total-timesteps", "30000", "--seed", "1", cwd=cwd)
    rets = [v for _, v in read_scalars(only_run_dir(cwd), "charts/episodic_return")]
    # a random policy lasts ~7 steps; seeds 1, 2, 3 average 203, 158, 215 over their last 20
    # episodes after 30k steps here
    assert np.mean(rets[:20]) < 20
    assert np.mean(rets[-20:]) > 60, np.mean(rets[-20:])


def test_mlp_checkpoint_save_load_evaluate(tmp_path):
    cwd = str(tmp_path)
    out = run_script(SCRIPT, *_short(5, "--total-timesteps", "2000", "--save-model", "--eval-episodes", "1"),
                     cwd=cwd).stdout
    ckpts = glob.glob(os.path.join(cwd, "runs", "*", "trpo_gpt2_halfcheetah.pt"))
    assert len(ckpts) == 1 and "eval:" in out
    eval_in_run = float(out.split("eval:")[1].split()[0])
    # loads in another process and evaluates (deterministic mean action, frozen obs statistics)
    out = run_script(SCRIPT, "--eval-checkpoint", ckpts[0], "--eval-episodes", "1", cwd=cwd).stdout
    assert "over 1 episodes" in out
    assert float(out.split(": ")[1].split()[0]) == pytest.approx(eval_in_run, abs=0.01)
    policy, obs_rms, train_args = trpo.load_checkpoint(ckpts[0])
    assert train_args["seed"] == 5 and obs_rms.count == 2000 + 2  # every observation seen, incl. the resets
    assert trpo.evaluate(policy, obs_rms, "HalfCheetah-v5", 1, seed=0) == trpo.evaluate(
        policy, obs_rms, "HalfCheetah-v5", 1, seed=0)


def test_gpt2_embed_instruction_smoke_and_checkpoint(tmp_path, tiny_gpt2_dir):
    cwd = str(tmp_path)
    # InvertedPendulum: same code path as HalfCheetah, but its evaluation episodes are short
    out = run_script(SCRIPT, "--llm", tiny_gpt2_dir, "--state-encoding", "embed", "--embed-tokens", "per-dim",
                     "--env-id", "InvertedPendulum-v5",
                     "--instruction", "run forward as fast as possible", "--batch-size", "200", "--num-envs", "2",
                     "--total-timesteps", "400", "--fvp-subsample", "2", "--save-model", "--eval-episodes", "1",
                     cwd=cwd).stdout
    run = only_run_dir(cwd)
    assert [v for _, v in read_scalars(run, "charts/step_accepted")] == [1.0, 1.0]
    assert all(0 < v <= 0.01 for _, v in read_scalars(run, "losses/kl"))
    eval_in_run = float(out.split("eval:")[1].split()[0])
    ckpt = glob.glob(os.path.join(run, "*.pt"))[0]
    out = run_script(SCRIPT, "--eval-checkpoint", ckpt, "--eval-episodes", "1", cwd=cwd).stdout
    assert float(out.split(": ")[1].split()[0]) == pytest.approx(eval_in_run, abs=0.01)


def test_gpt2_text_encoding_smoke_with_bf16_rollouts(tmp_path, tiny_gpt2_dir):
    cwd = str(tmp_path)  # --bf16: the rollout forwards in bfloat16 autocast (CPU here), the update float32
    run_script(SCRIPT, "--llm", tiny_gpt2_dir, "--state-encoding", "text", "--instruction", "run forward",
               "--finetune-blocks", "1", "--batch-size", "100", "--num-envs", "2", "--total-timesteps", "100",
               "--fvp-subsample", "4", "--cg-iters", "5", "--bf16", cwd=cwd)
    run = only_run_dir(cwd)
    assert len(read_scalars(run, "losses/kl")) == 1
    assert 0 <= read_scalars(run, "losses/kl")[0][1] <= 0.01


@pytest.mark.parametrize("flags, message", [
    (("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
    (("--env-id", "CartPole-v1", "--policy", "mlp"), "needs a continuous (Box) action space"),
    (("--llm", "/no/such/folder/gpt2", "--batch-size", "100", "--num-envs", "2"),
     "--llm folder '/no/such/folder/gpt2' does not exist"),
    (("--llm", "/no/such/folder/gpt2", "--llm-init", "random"), "--llm folder '/no/such/folder/gpt2' does not exist"),
    (("--num-envs", "7"), "must divide --batch-size"),
    (("--eval-checkpoint", "missing.pt"), "does not exist"),
    (("--policy", "lstm"), "--policy must be"),
    (("--policy", "mlp", "--bf16"), "--bf16 applies to --policy gpt2 only"),
    pytest.param(("--policy", "mlp", "--cuda"), "torch sees no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is present")),
    pytest.param(("--eval-checkpoint", "missing.pt", "--cuda"), "torch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")),
    (("--policy", "mlp", "--tf32"), "--tf32 applies to CUDA matmuls only"),
    pytest.param(("--policy", "mlp", "--capture-video"), "moviepy", marks=pytest.mark.skipif(
        importlib.util.find_spec("moviepy") is not None, reason="moviepy is installed")),
])
def test_bad_input_one_clear_sentence(tmp_path, flags, message):
    proc = run_script(SCRIPT, *flags, cwd=str(tmp_path), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_is_fast(tmp_path):
    proc = run_script(SCRIPT, "--help", cwd=str(tmp_path))
    assert "--fvp-subsample" in proc.stdout and "--state-encoding" in proc.stdout


def test_chunked_update_equals_whole_batch_update():
    # --update-chunk splits the gradient, the Fisher-vector products and the line search into chunks;
    # the step must be the same as with the whole batch in one piece.
    results = []
    for chunk in (16384, 7):
        torch.manual_seed(0)
        policy = trpo.MLPPolicy(3, 2, hidden=8).double()
        params = list(policy.parameters())
        g = torch.Generator().manual_seed(1)
        obs = torch.randn(40, 3, generator=g, dtype=torch.float64)
        actions = torch.randn(40, 2, generator=g, dtype=torch.float64)
        adv = torch.randn(40, generator=g, dtype=torch.float64)
        args = trpo.Args(update_chunk=chunk, fvp_subsample=3)
        stats = trpo.trpo_step(policy, params, policy.encode(obs), actions, adv, args)
        results.append((trpo.flat_params(params), stats["kl"], stats["accepted"]))
    assert results[0][2] and results[1][2]
    assert torch.allclose(results[0][0], results[1][0], atol=1e-10)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-8)


# ------------------------------------------------------------------------------------------------
# Issue 15: bad numbers, loading, evaluation seeds, run names, Ctrl-C
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    (dict(policy="mlp", batch_size=0), "--batch-size must be >= 1"),
    (dict(max_kl=0.0), "--max-kl must be > 0"),
    (dict(cg_iters=0), "--cg-iters must be >= 1"),
    (dict(llm_layers=-3), "--llm-layers must be >= 0"),
    (dict(llm_embd=-1), "--llm-embd and --llm-heads must be >= 0"),
    (dict(gamma=2.0), "--gamma must be in [0, 1]"),
    (dict(gae_lambda=-1.0), "--gae-lambda must be in [0, 1]"),
    (dict(damping=-0.1), "--damping must be >= 0"),
    (dict(max_backtracks=0), "--max-backtracks must be >= 1"),
    (dict(accept_ratio=1.0), "--accept-ratio must be in [0, 1)"),
    (dict(vf_iters=0), "--vf-iters must be >= 1"),
    (dict(l2_reg=-1.0), "--l2-reg must be >= 0"),
    (dict(obs_clip=0.0), "--obs-clip must be > 0"),
    (dict(update_chunk=0), "--update-chunk must be >= 1"),
    (dict(hidden_size=0), "--hidden-size must be >= 1"),
    (dict(finetune_blocks=-2), "--finetune-blocks must be >= -1"),
    (dict(eval_episodes=0), "--eval-episodes must be >= 1"),
    (dict(total_timesteps=0), "--total-timesteps must be >= 1"),
    (dict(fvp_subsample=0), "--fvp-subsample must be >= 1"),
    (dict(progress_every=-1), "--progress-every must be >= 0"),
    (dict(llm="/no/such/folder"), "--llm folder '/no/such/folder' does not exist"),
])
def test_validate_args_one_sentence_per_bad_number(kw, message):
    import re

    with pytest.raises(SystemExit, match=re.escape(message)):
        trpo.validate_args(trpo.Args(**kw))
    trpo.validate_args(trpo.Args())  # the defaults are fine
    trpo.validate_args(trpo.Args(policy="mlp", llm="/no/such/folder"))  # --llm matters only for gpt2


def test_track_without_wandb_is_one_sentence(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit, match="--track needs the wandb package"):
        trpo.validate_args(trpo.Args(policy="mlp", track=True))


def test_run_time_fields_are_not_flags(tmp_path):
    for flag in ("--num-steps", "--num-iterations"):
        proc = run_script(SCRIPT, "--policy", "mlp", flag, "3", cwd=str(tmp_path), check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, flag
    assert not os.path.exists(tmp_path / "runs")


def test_budget_rule_and_helpers(tmp_path):
    assert trpo.num_rollouts(1_000_000, 15_000) == 67 and trpo.num_rollouts(30_000, 15_000) == 2
    assert trpo.eval_seed(543) == 10543 and trpo.eval_seed(543, 1) == 10001
    assert trpo.returns_text([]) == "no episode has finished yet"
    base = trpo.run_base_name(trpo.Args(policy="mlp", seed=3))
    assert base == "HalfCheetah-v5__trpo_gpt2_halfcheetah__policy-mlp__3"
    assert "policy-gpt2" in trpo.run_base_name(trpo.Args(seed=3))
    names = {trpo.make_run_dir(base, root=str(tmp_path)) for _ in range(3)}
    assert len(names) == 3 and all(os.path.isdir(tmp_path / n) for n in names)


def test_llm_location_local_or_hub(tmp_path, monkeypatch):
    assert trpo.is_local_path("/abs/gpt2") and trpo.is_local_path("./gpt2") and trpo.is_local_path("~/gpt2")
    assert not trpo.is_local_path("gpt2") and not trpo.is_local_path("openai-community/gpt2")
    with pytest.raises(SystemExit, match="--llm folder '/no/such' does not exist"):
        trpo.llm_location("/no/such")
    assert trpo.llm_location(str(tmp_path))[:2] == (str(tmp_path), True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, local_only, why = trpo.llm_location("gpt2")
    assert local_only and "HF_HUB_OFFLINE" in why
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(trpo, "hub_reachable", lambda timeout=3.0: False)
    _, local_only, why = trpo.llm_location("gpt2")
    assert local_only and "cannot be reached" in why
    monkeypatch.setattr(trpo, "hub_reachable", lambda timeout=3.0: True)
    assert trpo.llm_location("gpt2")[1] is False  # the hub answers: ask it


def test_hub_reachable_is_quick_when_nothing_listens(monkeypatch):
    import socket
    import time

    with socket.socket() as s:  # a port that is surely closed: bind, then let it go
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.time()
    assert trpo.hub_reachable(timeout=2.0) is False
    assert time.time() - t0 < 2.5


def test_offline_hub_id_fails_fast_with_one_paragraph(tmp_path):
    import subprocess
    import sys
    import time

    from conftest import ROOT

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, SCRIPT), "--llm", "gpt2", "--batch-size", "100",
                           "--num-envs", "2"], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.time() - t0
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "HF_HUB_OFFLINE is set" in proc.stderr and "--llm-init random" in proc.stderr
    assert not glob.glob(str(tmp_path / "runs" / "*" / "events.*"))
    # the import of torch, gymnasium, MuJoCo and transformers is most of it (no retries)
    assert elapsed < 120, elapsed


def test_random_init_text_encoding_needs_a_tokenizer_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    args = trpo.Args(llm_init="random", state_encoding="text", llm_layers=1, llm_embd=32, llm_heads=2)
    with pytest.raises(SystemExit, match="--state-encoding text and --instruction need the tokenizer of 'gpt2'"):
        trpo.build_policy(args, 17, 6)
    # the embed encoding builds GPT-2 small's architecture with no file at all
    policy = trpo.build_policy(trpo.Args(llm_init="random", llm_layers=1, llm_embd=32, llm_heads=2), 17, 6)
    assert len(policy.transformer.h) == 1 and policy.transformer.config.n_embd == 32


def test_progress_bars_silenced_without_a_terminal():
    from transformers.utils import logging as tf_logging

    assert trpo.silence_progress_bars(True, True) is False
    assert trpo.silence_progress_bars(False, True) is True and not tf_logging.is_progress_bar_enabled()
    tf_logging.enable_progress_bar()
    assert trpo.silence_progress_bars(True, False) is True and not tf_logging.is_progress_bar_enabled()
    tf_logging.enable_progress_bar()


def test_save_model_eval_equals_eval_checkpoint_weights_only_and_directory(tmp_path):
    cwd = str(tmp_path)
    out = run_script(SCRIPT, *_short(9, "--total-timesteps", "1500", "--save-model", "--eval-episodes", "1"),
                     cwd=cwd).stdout
    run = only_run_dir(cwd)
    assert os.path.basename(run).startswith("HalfCheetah-v5__trpo_gpt2_halfcheetah__policy-mlp__9__")
    assert "2000 steps (--total-timesteps 1500 rounded up to whole batches)" in out
    assert ": 2000 steps, mean return of the last 2 episodes" in out
    ckpt = os.path.join(run, "trpo_gpt2_halfcheetah.pt")
    c = torch.load(ckpt, weights_only=True)  # tensors and plain Python values only
    assert c["run_name"] == os.path.basename(run)
    assert read_scalars(run, "losses/policy_loss") and read_scalars(run, "losses/value_loss")
    in_run = out.split("eval: ")[1].split(" over")[0]
    out = run_script(SCRIPT, "--eval-checkpoint", ckpt, "--eval-episodes", "1", cwd=cwd).stdout
    assert out.split(": ")[1].split(" over")[0] == in_run and "seeds 10009..10009" in out
    assert len(glob.glob(os.path.join(cwd, "runs", os.path.basename(run) + "-eval__10009__*"))) == 1
    proc = run_script(SCRIPT, "--eval-checkpoint", run, cwd=cwd, check=False)
    assert proc.returncode != 0 and "is a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_saves_checkpoint_closes_and_exits_with_one_line(tmp_path):
    from test_gpt2ppo_lunar import interrupt_after_first_update

    cwd = str(tmp_path)
    rc, out, err = interrupt_after_first_update(
        SCRIPT, ("--policy", "mlp", "--env-id", "InvertedPendulum-v5", "--batch-size", "200", "--num-envs", "2",
                 "--total-timesteps", "10000000", "--save-model", "--no-progress"), cwd)
    assert rc == 130 and "Traceback" not in err, err
    last = out.strip().splitlines()[-1]
    assert "interrupted after" in last and "checkpoint saved to" in last
    policy, obs_rms, a = trpo.load_checkpoint(glob.glob(os.path.join(cwd, "runs", "*", "*.pt"))[0])
    assert a["policy"] == "mlp" and obs_rms.count > 0
