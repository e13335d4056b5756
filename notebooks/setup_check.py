"""Before class: is this machine ready for the course, and how long will its course run take?

    python notebooks/setup_check.py     # from the repository root: 10-30 seconds

Prints the machine, whether each package the notebooks need imports, the precision
`python train.py` picks here, and the course run's minutes, estimated from a few timed
training steps of its model. Exit status 1, with a pip line per missing package.
"""
import importlib
import os
import platform
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules, from wherever this runs

# what the notebooks import ("a or b": either) -> the pip line that installs it
NEEDED = {"torch": "pip install torch  (on Linux, the CPU build: "
                   "add --index-url https://download.pytorch.org/whl/cpu)",
          "numpy": "pip install numpy", "tiktoken": "pip install tiktoken",
          "rustbpe": "pip install rustbpe", "matplotlib": "pip install matplotlib",
          "notebook or jupyterlab": "pip install notebook",
          "ipykernel": "pip install ipykernel"}
SEQ_LEN, PROMPT_LEN = 40, 16  # a typical course example: its tokens, and its prompt's


def imports(names):
    """Whether one of the modules "a or b" imports."""
    for name in names.split(" or "):
        try:
            importlib.import_module(name)
            return True
        except Exception:  # a broken install fails in other ways than ImportError
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


def main():
    print(f"Python {platform.python_version()} on {platform.system()} {platform.machine()}")
    missing = [names for names in NEEDED if not imports(names)]
    print("packages:", ", ".join(f"{names} {'MISSING' if names in missing else 'ok'}"
                                 for names in NEEDED))
    if "torch" not in missing:
        import torch
        cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no"
        mps = "yes, unused" if torch.backends.mps.is_available() else "no"  # the CPU path
        print(f"torch {torch.__version__}; {cpu_name()}, {os.cpu_count()} cores, "
              f"CPU capability {torch.backends.cpu.get_cpu_capability()}; "
              f"CUDA: {cuda}; MPS: {mps}")
    if missing:
        for names in missing:
            print(f"missing: {names}: {NEEDED[names]}")
        print("or all at once: pip install -r requirements-course.txt")
        return 1
    import train
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
