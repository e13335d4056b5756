"""Shared fixtures: tiny random models, the built-in data and tokenizer, one
trained tiny run (both stages) whose checkpoints several test files share,
and a helper that runs the command-line tools (in this process, or as subprocesses)."""
import contextlib
import importlib
import io
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The test models are tiny: one thread is fastest, and on a busy machine the
# default (one per core) makes every forward wait on the others (~300x slower).
torch.set_num_threads(1)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

import common  # noqa: E402
import data  # noqa: E402
import tokenizer  # noqa: E402
import model  # noqa: E402

LONGEST_FIRST = ("test_notebooks.py", "test_solutions.py", "test_train.py")


SLOW_TIMEOUT = 900  # seconds a slow-tier test may take (the fast tier's is pytest.ini's)


def pytest_collection_modifyitems(config, items):
    """The longest files first: pytest-xdist hands whole files to the cores in collection order (pytest.ini),
    and a long file handed out last would leave the other core idle at the end. Within a file, order is kept.
    In one process (-n 0, as mutmut runs) the order stays. The slow tier's tests get the slow tier's timeout."""
    if config.getoption("numprocesses", None):
        items.sort(key=lambda item: next((i for i, name in enumerate(LONGEST_FIRST) if item.path.name == name),
                                         len(LONGEST_FIRST)))
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


V = 48  # vocabulary of the random test models
EOT, MASK = V - 2, V - 1


def tiny_config(vocab_size=V):
    return model.GPTConfig(vocab_size=vocab_size, max_seq_len=64, n_layer=2, n_head=2, n_embd=32)


def random_model(seed=0, sharp=True):
    """A float64 random GPT. With sharp=True its greedy output is varied (larger
    weights mix the residual stream, so it does not just repeat its input) and
    confident (norm_f scaled by 10 sharpens every softmax without changing any
    argmax), so that MARS acceptance at tau < 1 really commits several tokens."""
    torch.manual_seed(seed)
    m = model.GPT(tiny_config()).double().eval()
    if sharp:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if p.dim() == 2 and not name.startswith("w"):
                    p.normal_(0, 0.2)
            m.wte.weight.mul_(3)
            m.norm_f.weight.mul_(10)
            # the sampler never emits <|mask|>: keep its (tied) output logit near 0, far below the
            # argmax, so that references which do not ban it agree with the sampler
            m.wte.weight[MASK].mul_(0.01)
    return m


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V - 2, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def splits():
    return data.build_instruction_set(0, n_train=4000)


@pytest.fixture(scope="session")
def tok(splits):
    return tokenizer.Tokenizer.train((e["prompt"] + "\n" + e["response"] for e in splits["train"]), 512)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, worker_id):
    """Both training stages of the tiny preset, once per test session: out_dir with ar.pt and mars.pt, read
    only. pytest-xdist's workers share it: the first to ask trains it while the others wait on a lock."""
    import train
    shared = tmp_path_factory.getbasetemp()
    shared = shared if worker_id == "master" else shared.parent
    out = shared / "tiny_run"
    with FileLock(f"{out}.lock"):
        if not (out / "summary.json").exists():
            handler = signal.getsignal(signal.SIGINT)  # train installs its own Ctrl-C handler
            try:
                train.main(["--preset", "tiny", "--out_dir", str(out), "--stage", "all", "--device", "cpu"])
            finally:
                signal.signal(signal.SIGINT, handler)
    return out


SCRIPTS = ("train.py", "sample.py", "extras/engine/__main__.py", "extras/real/train.py", "extras/bench/eval.py",
           "extras/serving/serve.py", "extras/checkpoints/export.py")


def run_cli(args, stdin=None, timeout=300, env=None, cwd=ROOT, fresh=False):
    """Run `python <args>` from the repo root; returns a CompletedProcess (text).

    One of the project's scripts runs in this process: its main, under common.run_cli as its
    `__main__` runs it, with sys.argv, stdin, stdout and stderr swapped in, and an uncaught
    exception printed as the interpreter prints it. That is the script's whole behaviour
    but for what only a process shows, and it saves the seconds a new interpreter spends
    importing torch. fresh=True (a test of the command itself), env, cwd and --http run a
    real subprocess; timeout applies to a subprocess only."""
    args = [str(a) for a in args]
    if fresh or env or cwd != ROOT or args[0] not in SCRIPTS or "--http" in args or "--http_load" in args:
        e = {**os.environ, **ONE_THREAD, **(env or {})}
        command = ["-m", args[0][:-3].replace("/", "."), *args[1:]] if args[0].startswith("extras/") else args
        return subprocess.run([sys.executable, *command], input=stdin, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, env=e)
    main = importlib.import_module(args[0][:-3].replace("/", ".")).main
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, stdin_, cwd_, threads, sigint = sys.argv, sys.stdin, os.getcwd(), torch.get_num_threads(), \
        signal.getsignal(signal.SIGINT)
    sys.argv, sys.stdin = args, io.StringIO(stdin or "")
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                common.run_cli(main)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.stdin = argv, stdin_
        os.chdir(cwd_)
        torch.set_num_threads(threads)
        signal.signal(signal.SIGINT, sigint)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc):
    """A user error: non-zero exit, a single 'error: ...' line on stderr, no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
