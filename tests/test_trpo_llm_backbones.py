"""Issue 12: --finetune-blocks beyond the model, --fvp-subsample over every env, any causal LM as the backbone
(a tiny Llama beside the tiny GPT-2), the offline SmolLM2 policy, and the Gauss-Newton Fisher-vector product."""

import os

import pytest
import torch

import trpo_gpt2_halfcheetah as trpo
from conftest import run_script

SCRIPT = "trpo_gpt2_halfcheetah.py"


# ------------------------------------------------------------------------------------------------
# 1. the two bugs
# ------------------------------------------------------------------------------------------------


def test_finetune_blocks_equal_to_the_number_of_blocks_trains_every_block(tiny_gpt2_dir):
    policy = trpo.build_policy(trpo.Args(llm=tiny_gpt2_dir, finetune_blocks=2), 3, 2)  # the tiny GPT-2 has 2
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    for i in (0, 1):
        assert any(n.startswith(f"transformer.h.{i}.") for n in trainable)
    assert any(n.startswith("transformer.ln_f.") for n in trainable)
    assert not any(n.startswith(("transformer.wte", "transformer.wpe")) for n in trainable)


def test_finetune_blocks_beyond_the_model_is_one_sentence(tiny_gpt2_dir, workdir):
    with pytest.raises(SystemExit) as e:
        trpo.build_policy(trpo.Args(llm=tiny_gpt2_dir, finetune_blocks=3), 3, 2)
    assert "--finetune-blocks 3 exceeds the 2 blocks" in str(e.value)
    # through the command line, with --llm-layers truncation (the issue's `--llm-layers 2 --finetune-blocks 3`)
    proc = run_script(SCRIPT, "--llm-init", "random", "--llm-layers", "2", "--llm-embd", "16", "--llm-heads", "2",
                      "--finetune-blocks", "3", "--total-timesteps", "10", "--batch-size", "10", cwd=workdir,
                      check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--finetune-blocks 3 exceeds the 2 blocks" in proc.stderr
    assert not os.path.exists(os.path.join(workdir, "runs"))


@pytest.mark.parametrize("num_envs, k, n", [(10, 5, 1500), (10, 10, 1500), (4, 3, 40), (3, 2, 30)])
def test_fvp_subsample_covers_every_env(num_envs, k, n):
    rows = trpo.fvp_rows(n, num_envs, k)
    envs, steps = rows % num_envs, rows // num_envs
    assert set(envs.tolist()) == set(range(num_envs))  # every env is in the subset ...
    assert (steps % k == 0).all()  # ... at every k-th time step
    full_steps = n // num_envs
    for e in range(num_envs):  # and every env gets the same share of the kept time steps
        assert (envs == e).sum() == len(range(0, full_steps, k))
    assert torch.equal(trpo.fvp_rows(n, num_envs, 1), torch.arange(n))
