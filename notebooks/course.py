"""The course run the notebooks share: `python train.py --preset course`, trained once into
../out/course (notebook 02 trains it, 03 and 04 decode it) and trained again only when it is
missing, was trained with other settings, or retrain=True. Also what every notebook says of
itself: its time and machine (ran), and which function a later cell runs, the student's or
the reference (use)."""
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

import train
from common import load_checkpoint

STARTED = time.time()  # a notebook imports course in its first cell: ran() times from here
# tests/test_notebooks.py sets MARS_QUICK: the same code with fewer steps (its answers are
# mostly wrong), in another folder, where a class never finds a test's checkpoint
QUICK = os.environ.get("MARS_QUICK")  # the quick run's folder under out/
OUT = f"../out/{QUICK}" if QUICK else "../out/course"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGS = ["--preset", "course", "--device", DEVICE, "--out_dir", OUT]
if QUICK:
    ARGS += ["--ar_iters", "150", "--mars_iters", "100", "--summary_limit", "60"]
# settings the weights do not depend on, or that a checkpoint made elsewhere may differ in
HOW = {"eval_every", "save_every", "summary_limit", "micro_batch", "precision"}
RECORD = "course_run.json"  # beside a run train_course trained: its time and machine


def machine():
    """The device a run or a notebook ran on, in words: the GPU, or the CPU with its cores."""
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), name)
    return (f"{name}, {os.cpu_count()} cores "
            f"(torch CPU capability {torch.backends.cpu.get_cpu_capability()})")


def ran():
    """A notebook's last cell: its time since `import course` (its first cell) and the machine."""
    s = time.time() - STARTED
    took = f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"
    print(f"this notebook ran in {took}, from its first cell to its last, on {machine()}")


def use(mine, reference, verdict):
    """mine once its check said right (verdict: what the check returned, "right" or True),
    else reference; says which, so that a later cell runs the student's code when it can."""
    if verdict is True or verdict == "right":
        print(f"using your {mine.__name__} (its check said right)")
        return mine
    print(f"using {reference.__module__}.{reference.__name__}: your {mine.__name__}'s check "
          f"said {verdict!r}, not right")
    return reference


def two_part_loss(noisy_logits, clean_logits, targets, ar_weight):
    """mars.mars_loss's (loss, noisy, clean) from the two halves' logits: notebook 02's
    reference for its Exercise 3, which use() falls back on."""
    n = (targets != -1).sum(1).clamp_min(1)

    def per_sequence(logits):  # each sequence's mean token loss
        return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1,
                               reduction="none").sum(1) / n

    noisy, clean = per_sequence(noisy_logits), per_sequence(clean_logits)
    return (noisy + ar_weight * clean).mean(), noisy.mean(), clean.mean()


def why_train(cfg, path):
    """Why the run cfg describes must train, or None when path already holds it."""
    if not os.path.exists(path):
        return f"there is no {path} yet"
    saved = load_checkpoint(path)
    if not saved.get("done"):
        return f"{path} is unfinished"
    was = saved["train_config"]
    keys = ["preset", "data"] + [k for k in train.PRESETS[cfg.preset] if k not in HOW]
    changed = [f"{k} {was.get(k)} -> {getattr(cfg, k)}" for k in keys
               if was.get(k) != getattr(cfg, k)]
    return f"{path} was trained otherwise ({', '.join(changed)})" if changed else None


def train_course(*flags, retrain=False, replay=False):
    """train.main on the course preset, flags over it, on every core (the notebooks decode on
    one); nothing to do when its out_dir already holds the same run, unless retrain. It
    says how long the run took and where; replay: a reused run's saved log and table too."""
    argv = ARGS + list(flags)
    cfg = train.get_config(argv)
    path = os.path.join(cfg.out_dir, "mars.pt")
    why = "retrain=True" if retrain else why_train(cfg, path)
    if why is None:
        print(f"reusing {path}, trained with the {cfg.preset} preset {how_long(cfg.out_dir)}; "
              "pass retrain=True to train again")
        if replay:
            show_run(cfg.out_dir)
        return
    print(f"training: {why}")
    threads, t0 = torch.get_num_threads(), time.time()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    try:
        train.main(argv)
    finally:
        torch.set_num_threads(threads)
    with open(os.path.join(cfg.out_dir, RECORD), "w") as f:
        json.dump({"seconds": round(time.time() - t0, 1), "machine": machine(), "argv": argv}, f)
    print(f"trained {how_long(cfg.out_dir)}")


def how_long(out_dir):
    """'in N min on MACHINE', from the run's record; a run trained since by other means (a
    terminal) has only its stages' logged time."""
    record, ckpt = os.path.join(out_dir, RECORD), os.path.join(out_dir, "mars.pt")
    if os.path.exists(record) and os.path.getmtime(record) >= os.path.getmtime(ckpt):
        with open(record) as f:
            r = json.load(f)
        return f"in {r['seconds'] / 60:.1f} min on {r['machine']}"
    logs = [os.path.join(out_dir, f"{s}_log.json") for s in ("ar", "mars")]
    seconds = 0.0
    for log in filter(os.path.exists, logs):
        with open(log) as f:
            seconds += json.load(f)[-1].get("stage_seconds", 0.0)
    return f"(its stages: {seconds / 60:.1f} min; trained outside the notebooks, machine not recorded)"


def show_run(out_dir):
    """What a run printed as it trained, from what it saved: each stage's log at every tenth of
    its steps, its validation accuracy, and the held-out table of summary.json."""
    skip = {"iter", "lr", "elapsed_s", "val_accuracy", "val_per_task", "stage_seconds", "precision"}
    for stage in ("ar", "mars"):
        path = os.path.join(out_dir, f"{stage}_log.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            log = json.load(f)
        every = max(1, len(log) // 10)
        print(f"{path}, every {every} steps:")
        for h in log:
            if h["iter"] % every == 0 or h is log[-1]:
                losses = " ".join(f"{k} {v:.3f}" for k, v in h.items() if k not in skip)
                print(f"{stage} {h['iter']}/{log[-1]['iter']} | {losses} | lr {h['lr']:.2e} | "
                      f"{h['elapsed_s']:.0f} s")
        last = log[-1]
        if "val_accuracy" in last:
            print(f"validation accuracy {100 * last['val_accuracy']:.1f}%: " + ", ".join(
                f"{k} {100 * v:.0f}" for k, v in last["val_per_task"].items()))
    if os.path.exists(os.path.join(out_dir, "summary.json")):
        table, pair = summary(out_dir)
        print(f"\nheld-out test set ({table[0]['n']} prompts)\n"
              "| model | accuracy | tokens/forward |\n|---|---|---|")
        for r in table:
            print(f"| {r['model']} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} |")
        if pair:
            lo, hi = pair["ci"]
            print(f"MARS tau=1.0 minus stage 1: {100 * pair['diff']:+.1f} points [{100 * lo:+.1f}, "
                  f"{100 * hi:+.1f}] on the same prompts")


def summary(out_dir):
    """A run's summary.json: (its table, MARS tau=1.0 minus stage 1 on the same prompts with a
    95% interval; None from a summary written before train.summary paired them)."""
    with open(os.path.join(out_dir, "summary.json")) as f:
        saved = json.load(f)
    return (saved["table"], saved["mars_tau1_minus_ar"]) if isinstance(saved, dict) else (saved, None)


def mars_checkpoint():
    """The course run's mars.pt, trained first if it is missing or was trained otherwise."""
    train_course()
    return os.path.join(OUT, "mars.pt")
