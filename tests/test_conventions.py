"""What every script does the same way: importing it changes nothing, Ctrl-C while it starts is one line, and the
code is formatted and linted by ruff (pyproject.toml)."""

import ast
import dataclasses
import difflib
import glob
import importlib
import os
import signal
import subprocess
import sys
from dataclasses import fields
from typing import Annotated, get_args

import pytest
import torch

from conftest import ROOT, cli_in_process

SCRIPTS = ["ppo_cartpole", "gpt2ppo_lunar", "trpo_gpt2_halfcheetah", "icpi_chain"]
TORCH_SCRIPTS = SCRIPTS[:3]

IMPORT = """
import os, signal, sys, threading
sys.path.insert(0, sys.argv[1])
handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
environ, threads = dict(os.environ), threading.active_count()
module = __import__(sys.argv[2])
assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers, "a signal handler was installed"
assert dict(os.environ) == environ, "the environment changed"
assert threading.active_count() == threads, "a thread was started"
assert callable(module.cli) and callable(module.main)
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_importing_a_script_changes_nothing(script, tmp_path):
    env = dict(os.environ, PYGAME_HIDE_SUPPORT_PROMPT="hide")  # what `import gymnasium` itself sets, not the script
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT, ROOT, script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr)
    assert os.listdir(tmp_path) == []  # nothing written


HOLD = """
import builtins, runpy, sys, time
real = builtins.__import__
def held(name, *a, **k):
    if name in ("gymnasium", "numpy") and not getattr(held, "done", False):
        held.done = True
        print("IMPORTING", flush=True)
        time.sleep(30)
    return real(name, *a, **k)
builtins.__import__ = held
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_ctrl_c_while_starting_is_one_line_and_exit_130(script, tmp_path):
    """The first third-party import is held open by an import hook, so the signal lands there on any machine."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, os.path.join(ROOT, f"{script}.py")],
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout.readline().strip() == "IMPORTING"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip()] == ["interrupted while starting"], err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["ruff format", "ruff check"])
def test_ruff_is_clean(command):
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def module_layout(script: str):
    """(the module's AST, the line of its `# ---- Run machinery` banner, the top-level names defined below it)."""
    with open(os.path.join(ROOT, f"{script}.py")) as f:
        source = f.read()
    banner = next(i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# ---- Run machinery"))
    tree = ast.parse(source)
    below = set()
    for node in tree.body:
        if node.lineno > banner:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                below.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                below.update(t.id for t in targets if isinstance(t, ast.Name))
    return tree, banner, below - {"cli"}


def names_used(node) -> set:
    """The names a definition uses, a string annotation's (`Optional["Run"]`) among them."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return names | {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_meets_the_run_machinery_through_four_names(script):
    """`main` reaches below the banner through at most four names (the run object, the argument check, the
    evaluation-only mode, the stop signal)."""
    tree, banner, below = module_layout(script)
    main = next(n for n in tree.body if n.lineno < banner and getattr(n, "name", None) == "main")
    used_by_main = names_used(main) & below
    assert len(used_by_main) <= 4, sorted(used_by_main)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_algorithm_above_the_banner_reaches_below_it_through_four_names(script):
    """All the code above the banner (the model, its loaders' callers, main) reaches below it through at most four
    names: a reader who stops at the banner has read the algorithm, not a sketch of it."""
    tree, banner, below = module_layout(script)
    used = set().union(*(names_used(n) for n in tree.body if n.lineno < banner)) & below
    assert len(used) <= 4, sorted(used)


def definition(script: str, name: str) -> str:
    """The source of the top-level definition `name` in `script`, with the script's own file name replaced."""
    tree, _, _ = module_layout(script)
    with open(os.path.join(ROOT, f"{script}.py")) as f:
        source = f.read()
    for node in tree.body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [getattr(node, "target", None)])]
        if getattr(node, "name", None) == name or name in targets:
            return ast.get_source_segment(source, node).replace(f"{script}.py", "SCRIPT.py")
    raise AssertionError(f"{script}.py defines no {name}")


CONVENTIONS = ["UserError", "PLAIN_NAME", "StopSignal", "flag", "brief", "marks", "cli", "make_run_dir"]


@pytest.mark.parametrize("name", CONVENTIONS)
def test_one_convention_per_concern_in_all_four_scripts(name):
    sources = {script: definition(script, name) for script in SCRIPTS}
    assert len(set(sources.values())) == 1, "\n\n".join(f"# {k}\n{v}" for k, v in sources.items())


def machinery(script: str) -> str:
    """The text of `script` from its `# ---- Run machinery` banner to its `# ---- This script's machinery` one."""
    with open(os.path.join(ROOT, f"{script}.py")) as f:
        lines = f.read().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("# ---- Run machinery"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# ---- This script's machinery"))
    return "".join(lines[start : end + 1])


@pytest.mark.parametrize("script", TORCH_SCRIPTS[1:])
def test_the_torch_scripts_carry_one_machinery_text(script):
    """Below the banner, the three torch scripts share one text, byte for byte, down to their own part: a fix is made
    once and copied, and a diff of two scripts below the banner shows only what really differs."""
    first, this = machinery(TORCH_SCRIPTS[0]), machinery(script)
    diff = "".join(difflib.unified_diff(first.splitlines(True), this.splitlines(True), TORCH_SCRIPTS[0], script, n=1))
    assert this == first, diff[:3000]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_numeric_flag_has_a_range_beside_it_and_the_defaults_pass(script):
    """What a flag is (type, default, doc, range, whether a resume or an evaluation may change it) is written once,
    beside it in `Args`: a number's range is a mark of its type."""
    module = importlib.import_module(script)

    def kinds(hint) -> set:  # the plain types in a flag's type: Annotated's, Optional's members
        return set().union(*map(kinds, get_args(hint)[:1] if hasattr(hint, "__metadata__") else get_args(hint))) or {
            hint
        }

    numeric = {f.name for f in fields(module.Args) if {int, float} & kinds(f.type)}
    ranged = {f.name for f in fields(module.Args) if any(m[0] in "([" for m in module.marks(f.name))}
    assert numeric and numeric == ranged, numeric ^ ranged
    module.check_args(module.Args())
    assert getattr(module.Args(), "cuda", True)  # CUDA whenever torch sees a device; --no-cuda for the CPU


def test_a_flag_added_in_args_alone_gets_its_range_and_its_resume_behaviour(tmp_path, monkeypatch):
    """(The common text, so one script.) A new flag is one field in Args; its marks give it a range and say whether a
    resumed run may change it."""
    ppo = importlib.import_module("ppo_cartpole")
    extra = [
        ("what", Annotated[float, "(0, 1]"], dataclasses.field(default=0.5)),  # what the run computes
        ("how", Annotated[int, "[1, 9]", "resume"], dataclasses.field(default=1)),  # how it computes it
    ]
    monkeypatch.setattr(ppo, "Args", dataclasses.make_dataclass("Args", extra, bases=(ppo.Args,)))
    tiny = ["--total-timesteps", "512", "--num-envs", "2", "--num-steps", "128"]
    assert (
        cli_in_process("ppo_cartpole", [*tiny, "--what", "0"], tmp_path)[2]
        == "error: --what must be in (0, 1], got 0.0.\n"
    )
    assert (
        cli_in_process("ppo_cartpole", [*tiny, "--how", "10"], tmp_path)[2]
        == "error: --how must be in [1, 9], got 10.\n"
    )
    code, out, err = cli_in_process("ppo_cartpole", [*tiny, "--what", "0.25"], tmp_path)
    assert code == 0 and torch.load(glob.glob(f"{tmp_path}/runs/*/training_state.pt")[0])["args"]["what"] == 0.25
    (run,) = glob.glob(f"{tmp_path}/runs/*")
    code, _, err = cli_in_process("ppo_cartpole", ["--resume", run, "--what", "0.75"], tmp_path)
    assert (code, err) == (2, "error: --resume continues a run: --what 0.75 is not its 0.25.\n")
    code, out, err = cli_in_process("ppo_cartpole", ["--resume", run, "--how", "3"], tmp_path)
    assert code == 0 and "Traceback" not in err, out + err
