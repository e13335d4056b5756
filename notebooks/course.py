"""The course run the notebooks share: `python train.py --preset course`, trained once into
../out/course (notebook 02 trains it, 03 and 04 decode it) and trained again only when it is
missing, was trained with other settings, or retrain=True."""
import os

import torch

import train
from common import load_checkpoint

# tests/test_notebooks.py sets MARS_QUICK: the same code with fewer steps (its answers are
# mostly wrong), in another folder, where a class never finds a test's checkpoint
QUICK = bool(os.environ.get("MARS_QUICK"))
OUT = "../out/course_quick" if QUICK else "../out/course"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGS = ["--preset", "course", "--device", DEVICE, "--out_dir", OUT]
if QUICK:
    ARGS += ["--ar_iters", "150", "--mars_iters", "100", "--summary_limit", "60"]
# settings the weights do not depend on, or that a checkpoint made elsewhere may differ in
HOW = {"eval_every", "save_every", "summary_limit", "micro_batch", "precision"}


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


def train_course(*flags, retrain=False):
    """train.main on the course preset, flags over it, on every core (the notebooks decode on
    one); nothing to do when its out_dir already holds the same run, unless retrain."""
    argv = ARGS + list(flags)
    cfg = train.get_config(argv)
    path = os.path.join(cfg.out_dir, "mars.pt")
    why = "retrain=True" if retrain else why_train(cfg, path)
    if why is None:
        print(f"reusing {path}, trained with the {cfg.preset} preset; "
              "pass retrain=True to train again")
        return
    print(f"training: {why}")
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    try:
        train.main(argv)
    finally:
        torch.set_num_threads(threads)


def mars_checkpoint():
    """The course run's mars.pt, trained first if it is missing or was trained otherwise."""
    train_course()
    return os.path.join(OUT, "mars.pt")
