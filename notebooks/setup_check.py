"""Before class: which notebooks this machine is ready for, and how long its course run will take.

    python notebooks/setup_check.py     # from the repository root: 10-30 seconds

For each notebook, what it needs, read from the files (nothing here lists packages by hand):
- what it imports: its code cells' imports and, through the project's modules they import, theirs
  (module level, followed with ast), the standard library left out; each is imported here;
- its install: requirements-course.txt, and on top the `pip install` command a notebook names
  in its first cell (05's); each package they name is looked up as installed.
Then the machine, the precision `python train.py` picks here, and the course run's minutes,
estimated from a few timed training steps of its model. Exit status 1 when one of notebooks
01-04 is not ready, with the pip line that installs what is missing.
"""
import ast
import glob
import importlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the project's modules, from wherever this runs
NOTEBOOKS = sorted(glob.glob(os.path.join(HERE, "0*.ipynb")))
COURSE_INSTALL = os.path.join(ROOT, "requirements-course.txt")
# an import name whose pip name differs (among those the notebooks reach)
PIP_NAMES = {"IPython": "ipython"}
FRONT_ENDS = ("notebook", "jupyterlab")  # the install names the first; either opens the notebooks
TORCH_CPU = "on Linux, install torch's CPU build first: pip install torch --index-url https://download.pytorch.org/whl/cpu"
SEQ_LEN, PROMPT_LEN = 40, 16  # a typical course example: its tokens, and its prompt's


# what a notebook needs, read from the files


def cells(notebook, kind):
    """The sources of a notebook's cells of one kind ("code" or "markdown")."""
    with open(notebook) as f:
        return ["".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == kind]


def module_level(node):
    """The nodes a module runs when it is imported: all but the bodies of its functions."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from module_level(child)


def imported(tree, everywhere):
    """The modules an import in tree may load: `import a.b` -> a.b; `from a import b` -> a and
    a.b (b may be a submodule). everywhere: a notebook's cell (its functions run); else a module's
    level only (a function's import runs only when it is called)."""
    for node in (ast.walk(tree) if everywhere else module_level(tree)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def project_file(name):
    """The file of the project's module `name` (a.b: the repository root's, or notebooks/'s
    checks and course, both on a notebook's path), or None: not the project's."""
    for folder in (ROOT, HERE):
        stem = os.path.join(folder, *name.split("."))
        for path in (stem + ".py", os.path.join(stem, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def needs(notebook):
    """The packages (top-level import names) a notebook imports: in its code cells, and at module
    level in every project module they reach, a package's __init__.py included."""
    code = ["\n".join(l for l in src.splitlines() if not l.lstrip().startswith(("%", "!")))  # IPython's
            for src in cells(notebook, "code")]
    todo, seen, found = [(ast.parse(src), True) for src in code], set(), set()
    while todo:
        tree, everywhere = todo.pop()
        for name in imported(tree, everywhere):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                path = project_file(".".join(parts[:i]))
                if path and path not in seen:
                    seen.add(path)
                    with open(path) as f:
                        todo.append((ast.parse(f.read()), False))
            if not project_file(parts[0]) and parts[0] not in sys.stdlib_module_names:
                found.add(parts[0])
    return found


def requirement_name(line):
    """The package a requirement names (`torch>=2.5` -> torch), or None for a comment or a blank."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#")[0])
    return m.group(1) if m else None


def extra_command(notebook):
    """The `pip install ...` command a notebook names in its first cell beyond the course's install, or None."""
    first = cells(notebook, "markdown")[0]
    m = re.search(r"`(pip install [^`]+)`", first)
    return m.group(1) if m else None


def install(notebook):
    """The packages a notebook's install names: requirements-course.txt's, and its own command's."""
    with open(COURSE_INSTALL) as f:
        names = [n for n in map(requirement_name, f) if n]
    for command in (extra_command(notebook) or "").split("&&"):
        words = command.split()[2:]  # after `pip install`
        names += [requirement_name(w) for w in words if not w.startswith("-")]
    return names


# what this machine has


def imports(name):
    """Whether a module imports here."""
    try:
        importlib.import_module(name)
        return True
    except Exception:  # a broken install fails in other ways than ImportError
        return False


def installed(name):
    """Whether a package is installed here (a front end: any of FRONT_ENDS)."""
    for candidate in (FRONT_ENDS if name in FRONT_ENDS else [name]):
        try:
            importlib.metadata.distribution(candidate)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "an unnamed CPU"


def seconds_per_step(model, opts, loss, amp, sync, steps, warmup=2):
    """The mean seconds of a training step (forward, backward, clip, optimizer)."""
    import torch
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        with amp():
            value = loss(model)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - t0) / steps


def estimate(device, dtype):
    """(stage-1 s/step, stage-2 s/step, minutes) of the course preset, on random tokens."""
    import torch
    import mars
    import train
    from model import GPT, GPTConfig
    p = train.PRESETS["course"]
    torch.manual_seed(0)
    shape = {k: p[k] for k in ("n_layer", "n_head", "n_embd", "max_seq_len", "vocab_size")}
    model = GPT(GPTConfig(**shape)).to(device)
    make = getattr(train, "optimizers", None)
    opts = (make(model, SimpleNamespace(**p), p["lr"]) if make
            else [torch.optim.AdamW(model.parameters(), p["lr"])])
    mask_id = p["vocab_size"] - 1
    x = torch.randint(mask_id, (p["batch_size"], SEQ_LEN), device=device)
    y = torch.full_like(x, -1)
    y[:, PROMPT_LEN - 1:-1] = x[:, PROMPT_LEN:]  # the next tokens, on the response only
    amp = lambda: train.autocast(device, dtype, p["max_seq_len"])
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    t1 = seconds_per_step(model, opts, lambda m: mars.ar_loss(m, x, y), amp, sync, steps=10)
    t2 = seconds_per_step(model, opts, lambda m: mars.mars_loss(m, x, y, mask_id, p["B"])[0],
                          amp, sync, steps=5)
    # 15% more for what is not a training step: the tokenizer, validation, the summary
    minutes = (p["ar_iters"] * t1 + p["mars_iters"] * t2) * 1.15 / 60
    return t1, t2, minutes


def report(notebook):
    """One line on whether this machine is ready for the notebook; True when it is."""
    missing = sorted(PIP_NAMES.get(n, n) for n in needs(notebook) if not imports(n))
    absent = [n for n in install(notebook) if n not in missing and not installed(n)]
    name = os.path.basename(notebook)[:-len(".ipynb")]
    if not missing and not absent:
        print(f"  {name}: ready")
        return True
    why = [f"{', '.join(missing)} does not import"] * bool(missing) + [f"{', '.join(absent)} not installed"] * bool(absent)
    print(f"  {name}: NOT ready: {'; '.join(why)}")
    return False


def main():
    print(f"Python {platform.python_version()} on {platform.system()} {platform.machine()}")
    print("notebooks (what each imports, through the project's modules, and its install):")
    ready = {os.path.basename(nb)[:2]: report(nb) for nb in NOTEBOOKS}
    for nb in NOTEBOOKS:
        if not ready[os.path.basename(nb)[:2]] and extra_command(nb):
            print(f"  {os.path.basename(nb)[:2]}'s install, beyond the course's: {extra_command(nb)}")
    course = all(ready[n] for n in ready if n <= "04")
    if not course:
        print(f"  01-04's install: pip install -r requirements-course.txt ({TORCH_CPU})")
        return 1
    import torch
    import train
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no"
    mps = "yes, unused" if torch.backends.mps.is_available() else "no"  # the CPU path
    print(f"torch {torch.__version__}; {cpu_name()}, {os.cpu_count()} cores, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; CUDA: {cuda}; MPS: {mps}")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # as notebooks/course.py picks
    dtype, why = train.precision_rule(device)
    print(f"precision: {dtype} ({why})")
    threads = torch.get_num_threads()  # a notebook's own, given back after
    # the notebooks' course run trains on every core (notebooks/course.py)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    try:
        t1, t2, minutes = estimate(device, dtype)
    finally:
        torch.set_num_threads(threads)
    print(f"the course preset on {device}: stage 1 {t1 * 1000:.0f} ms a step, "
          f"stage 2 {t2 * 1000:.0f} ms a step")
    print(f"the course run will take about {max(1, round(minutes))} minutes here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
