"""Keep every checkpoint a training run writes: a run replaces <out_dir>/<stage>.pt at each
save, and the trend of a run (python -m extras.real.eval --trend) needs them all.

    python -m extras.real.snapshots out/smollm/mars.pt -- \
        python -m extras.real.train --stage mars --out_dir out/smollm ...

runs the command and, each time the file is replaced (a run writes a temp file, then renames
it), links the new file as <stage>_step<N>.pt beside it (N: its training step). A hard link
copies nothing: the run's next rename leaves the link holding the old file. Exits with the
command's exit code.
"""
import os
import signal
import subprocess
import sys
import time

import torch

from common import Parser, run_cli

POLL_SECONDS = 0.5  # a save closer than this to the next one may go unkept: real runs save minutes apart


def keep(path, seen):
    """Link the file at path as <stem>_step<N>.pt if it is not the one already kept (seen: its inode)."""
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return seen
    if inode == seen:
        return seen
    stem = os.path.splitext(path)[0]
    tmp = f"{stem}_step.tmp"  # link first: the run may replace path again while its step is read
    if os.path.exists(tmp):
        os.remove(tmp)
    os.link(path, tmp)
    step = torch.load(tmp, map_location="cpu", mmap=True, weights_only=True)["iter"]
    os.replace(tmp, f"{stem}_step{step}.pt")
    print(f"snapshots: kept {stem}_step{step}.pt", flush=True)
    return os.stat(f"{stem}_step{step}.pt").st_ino


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("path", help="the checkpoint the run replaces at each save, e.g. out/smollm/mars.pt")
    p.add_argument("command", nargs="+", help="the training command, after --")
    args = p.parse_args(argv)
    seen = os.stat(args.path).st_ino if os.path.exists(args.path) else None  # an earlier run's file is not kept
    run = subprocess.Popen(args.command)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the run too, which saves and stops: then we stop
    while run.poll() is None:
        time.sleep(POLL_SECONDS)
        seen = keep(args.path, seen)
    keep(args.path, seen)
    sys.exit(run.returncode)


if __name__ == "__main__":
    run_cli(main)
