"""The course run the notebooks share: `python train.py --preset course`, trained once into ../out/course
(notebook 02 trains it; 03 and 04 decode it, training it first when it is missing)."""
import os

import torch

import train

# tests/test_notebooks.py sets MARS_QUICK: the same code with fewer steps (its answers are mostly wrong), in
# another folder, so that a test never leaves its checkpoint where a class would find it
QUICK = bool(os.environ.get("MARS_QUICK"))
OUT = "../out/course_quick" if QUICK else "../out/course"
ARGS = ["--preset", "course", "--device", "cpu", "--out_dir", OUT]
ARGS += ["--ar_iters", "150", "--mars_iters", "100", "--summary_limit", "60"] if QUICK else []


def train_course(*flags):
    """train.main on the course preset, with both cores (the notebooks decode on one); flags override."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    try:
        train.main(ARGS + list(flags))
    finally:
        torch.set_num_threads(threads)


def mars_checkpoint():
    """The course run's mars.pt, trained first if it is missing."""
    path = os.path.join(OUT, "mars.pt")
    if not os.path.exists(path):
        train_course()
    return path
