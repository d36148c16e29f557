"""Shared test helpers: run a script as a user would (a subprocess in a temporary folder) and
read back what it logged to TensorBoard."""

from __future__ import annotations

import gc
import glob
import os
import subprocess
import sys

import pytest

pytest_plugins = ["slurm_cluster"]  # the slurm_cluster fixture
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


SCRIPT_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def pytest_collection_finish(session):
    """What the test modules' imports made (torch, the scripts, ...) is left out of every later garbage collection:
    a script's error path collects in full before its sentence, a tenth of a second in this process otherwise, and
    the tables of refusals run hundreds of them here."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    """The tests marked slow first: the last to start are short ones, and the workers end together."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Models run in this process on one torch thread, as the scripts run in the suite (OMP_NUM_THREADS=1): a tiny
    model's forward is many times slower on two threads of a shared 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bad(flags, message):
    """One row of a hostile-input table: the flags and the sentence they must end in, the flags as its id."""
    return pytest.param(flags, message, id=" ".join(flags)[:60])


def run_script(script: str, *flags: str, cwd: str, timeout: float = 600, check: bool = True, env=SCRIPT_ENV):
    """Run `python script flags...` in `cwd` (so its runs/ folder lands there), no terminal to read from; `script`
    may be a path."""
    path = script if os.path.isabs(script) else os.path.join(ROOT, script)
    proc = subprocess.run(
        [sys.executable, path, *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(flags)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def read_scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    """All (step, value) events of `tag` in the event files of `run_dir`, in write order."""
    return all_scalars(run_dir, ignore=()).get(tag, [])


def stop_when_printed(script: str, *flags: str, cwd, line: str, sig: int) -> subprocess.Popen:
    """Start `python script flags...` in `cwd`, send `sig` once it prints a line containing `line`, and wait for it;
    fails (instead of waiting forever) when the script ends without printing that line."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script), *flags],
        cwd=cwd,
        env=SCRIPT_ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for out in proc.stdout:
        if line in out:
            proc.send_signal(sig)
            break
    else:
        proc.wait(timeout=60)
        pytest.fail(
            f"{script} {' '.join(flags)} ended ({proc.returncode}) without printing {line!r}: {proc.stderr.read()}"
        )
    proc.stdout.read()
    proc.wait(timeout=300)
    return proc


def only_run_dir(cwd: str) -> str:
    dirs = sorted(glob.glob(os.path.join(cwd, "runs", "*")))
    assert len(dirs) == 1, f"expected one run folder, found {dirs}"
    return dirs[0]


# The scripts as they were before the redesign into minimal scripts: a redesigned script must log the same numbers,
# bit for bit, as this version does with the same flags on the same machine (both run here, side by side, so the
# check holds on any CPU; a clone without this commit skips it).
BASELINE = "17d5a16"
UNTIMED = ("charts/SPS", "time/")  # wall-clock scalars: never the same twice


def baseline_script(script: str, folder: str, commit: str = BASELINE) -> str:
    """`script` as committed at `commit`, written into `folder` under its own name; skips when git or the commit is
    not there."""
    proc = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:{script}"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"baseline {commit} not in this clone: {proc.stderr.strip()[:200]}")
    path = os.path.join(folder, script)
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        f.write(proc.stdout)
    return path


def all_scalars(run_dir: str, ignore: tuple[str, ...] = UNTIMED) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run folder's event files (tags starting with an `ignore` prefix left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"] if not t.startswith(ignore)}


def same_numbers(script: str, *flags: str, tmp_path, baseline_flags=None, commit: str = BASELINE) -> tuple[str, str]:
    """Run the BASELINE version of `script` and the working tree's with the same flags (`baseline_flags` where the
    old spelling differs) side by side (two processes at once, one a core), each in its own folder, and assert
    that every scalar the baseline logged (tags under `UNTIMED` aside) is logged by the current script with the
    same steps and values, bit for bit. Returns the two run folders (baseline, current) for further checks."""
    old = baseline_script(script, str(tmp_path / "baseline_code"), commit)
    runs = []
    for name, path, fl in (("baseline", old, baseline_flags or flags), ("current", os.path.join(ROOT, script), flags)):
        (tmp_path / name).mkdir()
        command = [sys.executable, path, *fl]
        proc = subprocess.Popen(
            command, cwd=tmp_path / name, env=SCRIPT_ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        runs.append((tmp_path / name, proc))
    folders = []
    for cwd, proc in runs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
        folders.append(only_run_dir(str(cwd)))
    assert_same_scalars(script, flags, *folders)
    return folders[0], folders[1]


def assert_same_scalars(script: str, flags, baseline_run: str, current_run: str) -> None:
    """Every scalar of the baseline's run folder (tags under `UNTIMED` aside) logged by the current one with the same
    steps and values, bit for bit."""
    old_scalars, new_scalars = all_scalars(baseline_run), all_scalars(current_run)
    assert old_scalars, f"the baseline run logged no scalars in {baseline_run}"
    for tag, points in old_scalars.items():
        assert new_scalars.get(tag) == points, f"{script} {' '.join(flags)}: '{tag}' differs from {BASELINE}"


def wandb_records(path: str):
    """The records of a .wandb file, parsed with W&B's own protobuf (wandb.proto): the file is W&B's LevelDB-style
    log (a 7-byte header ':W&B', 0xBEE1, version; 32 KiB blocks of records, each behind a 7-byte header of CRC-32,
    length and type: 1 whole, 2 first, 3 middle, 4 last part)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, path
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the rest of the block is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def explicit_fisher(policy, params, obs):
    """A Gaussian policy's Fisher matrix, explicitly: (1/m) sum_i J_i^T diag(1/sigma^2) J_i for the mean
    parameters (J_i the Jacobian of the mean at obs i), 2 I for the log-std; in the order of `params`."""
    import torch

    names = {id(p): n for n, p in policy.named_parameters()}
    sizes = [p.numel() for p in params]

    def mean_of(flat):
        tensors = {names[id(p)]: t.view_as(p) for p, t in zip(params, torch.split(flat, sizes))}
        return torch.func.functional_call(policy, tensors, (obs,), strict=False)

    J = torch.autograd.functional.jacobian(mean_of, torch.cat([p.detach().reshape(-1) for p in params]))
    F = torch.einsum("map,a,maq->pq", J, torch.exp(-2 * policy.action_log_std.detach())[0], J) / obs.shape[0]
    i = 0
    for p, n in zip(params, sizes):
        if p is policy.action_log_std:
            F[i : i + n, i : i + n] += 2 * torch.eye(n, dtype=F.dtype)
        i += n
    return F


def train_tiny_tokenizer(corpus: list[str], vocab_size: int, bos: str, eos: str):
    """A byte-level BPE tokenizer trained on the spot on `corpus` (no download), as a transformers tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus, vocab_size=vocab_size, min_frequency=1, special_tokens=list(dict.fromkeys([bos, eos]))
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=bos, eos_token=eos, unk_token=eos)


def build_tiny_gpt2(folder: str, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, n_positions: int = 512) -> str:
    """Save a tiny random GPT-2 and a byte-level BPE tokenizer trained on the spot into `folder`,
    so that `from_pretrained(folder)` exercises the same loading path as a hub model (offline)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    corpus = [
        "assert state == 3 and state != 4",
        "state = left()",
        "state = right()",
        "reward = try_goal(state)",
        "assert reward == 0",
        "assert reward == 1",
        "assert done",
        "assert not done",
        "state, reward = reset()",
        "0 1 2 3 4 5 6 7 8 9 -0.12 3.45 . , ( ) [ ] = == != < > + -",
        "run forward as fast as possible",
        "C(i=1, j=0) pos vel paddle ball ship aliens",
    ] * 20
    tok = train_tiny_tokenizer(corpus, 400, bos="<|endoftext|>", eos="<|endoftext|>")
    config = GPT2Config(
        vocab_size=len(tok),
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        n_positions=n_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)  # the same tiny model in every session: tests that read its outputs do not flake
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    """A folder holding a tiny GPT-2 (2 layers, width 32) and its tokenizer, built once per session."""
    return build_tiny_gpt2(str(tmp_path_factory.mktemp("tiny_gpt2")))


class FixedTextModel:
    """A stand-in language model for icpi_chain.py's Agent: answers every request with `text` (None: a malformed
    reply), recording the requests."""

    name = "fixed"

    def __init__(self, text):
        self.text, self.requests = text, []

    def count_tokens(self, s):
        import icpi_chain

        return icpi_chain.simple_token_count(s)

    def complete(self, reqs):
        self.requests += reqs
        return [None if self.text is None else (self.text, 1) for _ in reqs]


def post_handler(body, status: int = 200, headers=()):
    """A handler class for http.server that answers every POST with the bytes `body(request_body)`, the HTTP
    `status` and the extra `headers` ((name, value) pairs)."""
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            data = body(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    return Handler


def completions_handler(reply):
    """An OpenAI-compatible /v1/completions handler class whose answer text is `reply(prompt)`."""
    import json

    return post_handler(
        lambda raw: json.dumps({"choices": [{"text": reply(json.loads(raw).get("prompt", ""))}]}).encode()
    )


def cli_in_process(script: str, flags, cwd, on_print=None) -> tuple[int, str, str]:
    """`script`'s entry point run in this process (its imports paid once), in `cwd`, as its __main__ calls it:
    (exit status, stdout, stderr), the status of a SystemExit (tyro's errors, a second signal) included; the signal
    handlers that cli installs and the environment variables it sets (MuJoCo's renderer) are put back afterwards.
    `on_print(text)` sees each text written to stdout, as it is written (where a test sends a signal)."""
    import contextlib
    import importlib
    import io
    import signal

    class Out(io.StringIO):
        def write(self, text):
            super().write(text)
            on_print(text)
            return len(text)

    module, here, environ = importlib.import_module(script), os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.StringIO() if on_print is None else Out(), io.StringIO()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = module.cli([str(f) for f in flags])
            except SystemExit as e:
                code = e.code
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        for s, h in handlers.items():
            signal.signal(s, h)
    return code, out.getvalue(), err.getvalue()


def signal_at(text: str, *signals):
    """A cli_in_process `on_print` that raises `signals` in this thread, each handled before the next (two of a kind
    sent to the process at once may arrive as one), when the script first prints `text` ("logging to": its folder
    made, its handlers in place; ": update k/": update k done)."""
    import signal

    sent = []

    def on_print(printed):
        if text in printed and not sent:
            sent.append(text)
            for s in signals:
                signal.raise_signal(s)

    return on_print
