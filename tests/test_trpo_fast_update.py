"""Issue 17: the faster MLP update of trpo_gpt2_halfcheetah.py computes what the reference update computes.

The closed-form (Gauss-Newton) Fisher-vector product against the explicit Fisher and against the double-backward
product, a whole TRPO step with either, the numpy rollout forward against the module, --mlp-dtype float32."""

import glob
import os

import numpy as np
import pytest
import torch

import trpo_gpt2_halfcheetah as trpo
from conftest import only_run_dir, read_scalars, run_script

SCRIPT = "trpo_gpt2_halfcheetah.py"


def _policy(obs_dim=3, act_dim=2, hidden=4, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    policy = trpo.MLPPolicy(obs_dim, act_dim, hidden=hidden).to(dtype)
    with torch.no_grad():
        policy.action_log_std.copy_(0.3 * torch.randn(1, act_dim))
        for p in policy.parameters():
            p.add_(0.2 * torch.randn_like(p))  # away from the x0.1 / zero-bias initialisation
    return policy


def test_closed_form_fvp_equals_explicit_fisher_in_main_parameter_order():
    policy = _policy()
    params = [p for p in policy.parameters() if p.requires_grad]  # as main(): the log-std comes first
    assert params[0] is policy.action_log_std
    obs = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fvp = trpo.make_mlp_fvp(policy, params, [obs[:4], obs[4:]], 6, damping=0.1)  # two chunks

    # explicit Fisher in the order of `params`: J^T diag(1/sigma^2) J / m for the mean parameters, 2 I for log-std
    def mean_of(flat):
        tensors, i = {}, 0
        for name, p in policy.named_parameters():
            tensors[name] = flat[i:i + p.numel()].view_as(p)
            i += p.numel()
        return torch.func.functional_call(policy, tensors, (obs,))

    x0 = trpo.flat_params(params)
    J = torch.autograd.functional.jacobian(mean_of, x0)  # (6, 2, n), zero columns for the log-std
    prec = torch.exp(-2 * policy.action_log_std.detach())[0]
    F = torch.einsum("nap,a,naq->pq", J, prec, J) / 6
    F[:2, :2] += 2 * torch.eye(2, dtype=torch.float64)
    for seed in range(3):
        v = torch.randn(x0.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(fvp(v), F @ v + 0.1 * v, atol=1e-10)


def test_closed_form_fvp_equals_double_backward_fvp():
    policy = _policy(obs_dim=17, act_dim=6, hidden=64)
    params = list(policy.parameters())
    obs = torch.randn(500, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def kl():
        mean, ls = policy(obs), policy.action_log_std
        return trpo.diag_gaussian_kl(mean.detach(), ls.detach(), mean, ls).sum() / obs.shape[0]

    exact = trpo.make_fvp(kl, params, 0.1)
    closed = trpo.make_mlp_fvp(policy, params, [obs], 500, 0.1)
    for seed in range(2):
        v = torch.randn(sum(p.numel() for p in params), dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed))
        a, b = exact(v), closed(v)
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), float((a - b).abs().max())
    with pytest.raises(ValueError):
        trpo.make_mlp_fvp(policy, params[1:], [obs], 500, 0.1)  # a parameter missing


@pytest.mark.parametrize("subsample, chunk", [(1, 16384), (3, 7)])
def test_trpo_step_same_with_closed_form_and_double_backward_products(subsample, chunk):
    results = []
    for impl in ("auto", "double-backward"):
        policy = _policy(obs_dim=3, act_dim=2, hidden=8)
        params = [p for p in policy.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(1)
        obs = torch.randn(40, 3, generator=g, dtype=torch.float64)
        actions = torch.randn(40, 2, generator=g, dtype=torch.float64)
        adv = torch.randn(40, generator=g, dtype=torch.float64)
        args = trpo.Args(policy="mlp", fvp_impl=impl, fvp_subsample=subsample, update_chunk=chunk)
        stats = trpo.trpo_step(policy, params, policy.encode(obs), actions, adv, args)
        results.append((trpo.flat_params(params), stats))
    (x_a, s_a), (x_b, s_b) = results
    assert s_a["accepted"] and s_b["accepted"]
    assert torch.allclose(x_a, x_b, atol=1e-10)
    assert s_a["kl"] == pytest.approx(s_b["kl"], rel=1e-8) and s_a["line_search_steps"] == s_b["line_search_steps"]


def test_float32_closed_form_fvp_close_to_float64():
    p64 = _policy(obs_dim=17, act_dim=6, hidden=64)
    p32 = trpo.MLPPolicy(17, 6, 64)
    p32.load_state_dict(p64.state_dict())
    obs = torch.randn(1000, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    v = torch.randn(sum(p.numel() for p in p64.parameters()), dtype=torch.float64,
                    generator=torch.Generator().manual_seed(4))
    a = trpo.make_mlp_fvp(p64, list(p64.parameters()), [obs], 1000, 0.1)(v)
    b = trpo.make_mlp_fvp(p32, list(p32.parameters()), [obs.float()], 1000, 0.1)(v.float())
    assert b.dtype == torch.float32
    assert torch.allclose(b.double(), a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))


def test_numpy_rollout_forward_equals_module():
    policy = _policy(obs_dim=17, act_dim=6, hidden=64)
    layers = [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in trpo.mlp_policy_layers(policy)]
    x = np.random.default_rng(0).normal(size=(10, 17)).astype(np.float32)
    out = trpo.mlp_forward_numpy(layers, x)
    with torch.no_grad():
        ref = policy(torch.from_numpy(x).double()).float().numpy()
    assert out.dtype == np.float32 and out.shape == (10, 6)
    assert np.allclose(out, ref, rtol=1e-6, atol=1e-7)


def test_line_search_reuses_the_accepted_evaluation():
    policy = _policy(obs_dim=3, act_dim=2, hidden=4)
    params = list(policy.parameters())
    calls = []
    g = torch.Generator().manual_seed(5)
    obs, actions = torch.randn(30, 3, generator=g, dtype=torch.float64), torch.randn(30, 2, generator=g,
                                                                                     dtype=torch.float64)
    adv = torch.randn(30, generator=g, dtype=torch.float64)
    orig = trpo.set_flat_params

    def counting(ps, flat):
        calls.append(flat)
        orig(ps, flat)

    trpo.set_flat_params = counting
    try:
        stats = trpo.trpo_step(policy, params, policy.encode(obs), actions, adv, trpo.Args(policy="mlp"))
    finally:
        trpo.set_flat_params = orig
    # loss at the old parameters, then one evaluation per step tried, and nothing after the accepted one
    assert stats["accepted"] and len(calls) == 1 + stats["line_search_steps"]
    assert torch.allclose(trpo.flat_params(params), calls[-1])


@pytest.mark.parametrize("flags, message", [
    (("--policy", "mlp", "--mlp-dtype", "float16"), "--mlp-dtype must be 'float64' or 'float32'"),
    (("--policy", "gpt2", "--mlp-dtype", "float32"), "--mlp-dtype applies to --policy mlp only"),
    (("--policy", "mlp", "--fvp-impl", "fast"), "--fvp-impl must be 'auto', 'double-backward' or 'gauss-newton'"),
])
def test_bad_new_flags_one_clear_sentence(tmp_path, flags, message):
    proc = run_script(SCRIPT, *flags, cwd=str(tmp_path), check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_float32_mlp_smoke_save_and_evaluate(tmp_path):
    cwd = str(tmp_path)
    out = run_script(SCRIPT, "--policy", "mlp", "--mlp-dtype", "float32", "--num-envs", "2", "--batch-size", "2000",
                     "--total-timesteps", "4000", "--seed", "3", "--save-model", "--eval-episodes", "1",
                     cwd=cwd).stdout
    run = only_run_dir(cwd)
    kls = [v for _, v in read_scalars(run, "losses/kl")]
    assert len(kls) == 2 and all(0 < v <= 0.01 for v in kls)
    assert len(read_scalars(run, "charts/episodic_return")) == 4
    assert len(glob.glob(os.path.join(cwd, "runs", "*", "*.pt"))) == 1 and "eval:" in out
