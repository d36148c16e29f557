"""Device check of trpo_gpt2_halfcheetah.py on CUDA: runs named configurations, prints the time/* scalars,
KL, acceptance and the peak CUDA memory (torch.cuda.max_memory_allocated) of each.

    python benchmark/gpu/trpo_gpu.py B A      # what benchmark/gpu/trpo_h100_*.txt hold (B alone, then A)
    python benchmark/gpu/trpo_gpu.py T        # a CPU dry run of the driver itself (MLP policy, no --cuda)
"""
import glob, json, os, runpy, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "trpo_gpt2_halfcheetah.py")

if sys.argv[1] == "--child":  # run the script in-process, then report the peak memory
    mem_file = sys.argv[2]
    sys.argv = [SCRIPT] + sys.argv[3:]
    import torch
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    finally:
        with open(mem_file, "w") as f:
            json.dump({} if not torch.cuda.is_available() else {"max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                       "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}, f)
    sys.exit(0)

sys.path.insert(0, os.path.join(ROOT, "tests")); sys.path.insert(0, os.path.join(ROOT, "benchmark"))
from conftest import read_scalars  # noqa
tmp = tempfile.mkdtemp()
CONFIGS = {
    "A": ["--cuda", "--llm-init", "random", "--total-timesteps", "30000", "--save-model"],
    # (trpo_h100_B.txt was recorded with --bf16 added, a flag the script has since dropped)
    "B": ["--cuda", "--llm-init", "random", "--total-timesteps", "30000", "--fvp-subsample", "5"],
    "T": ["--policy", "mlp", "--total-timesteps", "2000", "--batch-size", "1000", "--save-model"],
    "D": ["--cuda", "--llm-init", "random", "--state-encoding", "text", "--total-timesteps", "15000",
          "--fvp-subsample", "5", "--update-chunk", "512"],
}
for name in sys.argv[1:]:
    flags = list(CONFIGS[name])
    if name == "D":
        from trpo_speed import make_llm_folder
        flags += ["--llm", make_llm_folder(tmp, small=True)]
    cwd = os.path.join(tmp, name); os.makedirs(cwd)
    mem = os.path.join(cwd, "mem.json")
    t0 = time.time()
    p = subprocess.run([sys.executable, __file__, "--child", mem, *flags], cwd=cwd,
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(f"== {name}: {' '.join(flags)}\nrc {p.returncode}, wall {time.time() - t0:.1f} s")
    print(p.stdout[-3000:]); print(p.stderr[-3000:])
    runs = glob.glob(os.path.join(cwd, "runs", "*"))
    if runs:
        for tag in ("time/rollout_seconds", "time/update_seconds", "time/value_fit_seconds", "time/grad_seconds",
                    "time/cg_seconds", "time/line_search_seconds", "losses/kl", "charts/step_accepted",
                    "charts/SPS"):
            try:
                print(f"{tag}: {[round(v, 4) for _, v in read_scalars(runs[0], tag)]}")
            except Exception as e:  # noqa
                print(f"{tag}: - ({e})")
    if os.path.exists(mem):
        print("cuda memory:", open(mem).read())
    if name in ("A", "T"):
        ckpt = glob.glob(os.path.join(cwd, "runs", "*", "*.pt")) + glob.glob(os.path.join(cwd, "runs", "*", "*", "*.pt"))
        print("checkpoints:", ckpt)
        if ckpt:
            dev = ["--cuda"] if "--cuda" in flags else []
            p = subprocess.run([sys.executable, SCRIPT, "--eval-checkpoint", ckpt[0], "--eval-episodes", "2", *dev],
                               cwd=cwd, capture_output=True, text=True)
            print(f"== eval {' '.join(dev)}: rc {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
