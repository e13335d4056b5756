"""Where a training step's time goes, and how much of a batch is padding (the cpu preset by default).

    python -m extras.bench.profile_train                      # -> docs/padding_cpu.json and docs/profile_cpu.json
    python -m extras.bench.profile_train --steps 30 --threads 1 2 --dtypes float32 bfloat16

Both use the preset's training set (the cpu preset: 40,000 examples, tokenized with its own tokenizer) and
batches drawn as train.py draws them: uniformly (--buckets 1, before) or from length buckets (the default).

Padding (docs/padding_cpu.json): over --batches batches per row, the fraction of the positions fed to the
model that hold no token of a row (padding) and that carry a loss, counted by running the real losses on
a model stand-in. Stage 2 feeds [noisy | clean], each row first padded with <|endoftext|> to a multiple
of B (trained, so not padding), without the noisy prompt blocks mars_loss leaves out; "in_full" counts
the whole [noisy | clean] input, as the loss fed it before (buckets 1, in_full: the old batches).

Profile (docs/profile_cpu.json): the preset's model and optimizer, --steps steps of each stage after a
warm-up, at each thread count and dtype: mean milliseconds per step of data (drawing and padding the
batch), forward (the loss), backward, optimizer (clip, step, zero_grad), and their sum, the step. Plus
what mask and rotary tables cost per forward.
"""
import json
import os
import sys
import tempfile
import time

import torch

import data
import mars
import model as model_py
import train
from common import Parser, run_cli
from extras.bench.eval import machine


class Counter(torch.nn.Module):
    """Stands in for the model: counts the positions fed and the logits asked for, returns their cross-entropy as
    zeros."""

    def __init__(self):
        super().__init__()
        self.fed, self.loss, self.starts = 0, 0, []

    def forward(self, ids, targets=None, positions=None, attn_mask=None, cache=None):
        self.fed += ids.numel()
        self.loss += int((targets != -1).sum())
        # stage 2's positions are start..T-1 (noisy), then 0..T-1 (clean)
        self.starts.append(0 if positions is None else ids.shape[1] - 2 * int((positions == 0).nonzero()[-1, 0]))
        return torch.zeros(targets.shape)


def padding(stage, n_batches, seed=0):
    """Fractions of the fed positions that are padding and that carry a loss, over one Stage's batches;
    for stage 2 also without leaving out the noisy prompt blocks (the [noisy | clean] input in full)."""
    m, g, real, left_out = Counter(), torch.Generator().manual_seed(seed), 0, 0
    for _ in range(n_batches):
        rows = [stage.seqs[i] for i in data.draw_batch(stage.buckets, stage.batch_size, g)]
        x, y = data.make_batch(rows, stage.tok.eot, stage.multiple)
        stage.loss(m, x, y)
        lengths = [len(ids) + (-len(ids) % stage.multiple) - 1 for ids, _ in rows]  # a row's inputs
        real += sum(lengths) if stage.name == "ar" else sum(2 * n - m.starts[-1] for n in lengths)
        left_out += len(rows) * m.starts[-1]

    def fractions(fed, real):
        return {"padding": round(1 - real / fed, 4), "loss": round(m.loss / fed, 4),
                "positions_per_batch": round(fed / n_batches, 1)}
    out = fractions(m.fed, real)
    if stage.name == "mars":
        out["in_full"] = fractions(m.fed + left_out, real + left_out)
    return out


def timed(fn, *a):
    t = time.perf_counter()
    out = fn(*a)
    return out, time.perf_counter() - t


def phases(stage):
    """One step as train.train takes it (one process, no accumulation), its phases timed apart."""
    def draw():
        return stage.batch(stage.next_batch())
    (x, y), t_data = timed(draw)
    with stage.amp():
        (loss, _), t_fwd = timed(stage.loss, stage.model, x, y)
    _, t_bwd = timed(loss.backward)

    def update():
        torch.nn.utils.clip_grad_norm_(stage.raw_model.parameters(), stage.cfg.grad_clip)
        for opt in stage.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    _, t_opt = timed(update)
    return {"data": t_data, "forward": t_fwd, "backward": t_bwd, "optimizer": t_opt}


def profile(stage, steps):
    """Mean milliseconds per phase over `steps` steps (after a warm-up), and per step (their sum). Every
    setting draws the same batches (the order is reseeded)."""
    stage.order.manual_seed(0)
    phases(stage)
    runs = [phases(stage) for _ in range(steps)]
    ms = {k: 1000 * sum(r[k] for r in runs) / steps for k in runs[0]}
    ms["step"] = sum(ms.values())
    return {k: round(v, 1) for k, v in ms.items()}


def per_forward(T=48, B=4, head_dim=64, reps=200):
    """Milliseconds a forward spends on its mask (built, and from the cache) and rotary tables."""
    def ms(fn):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return round(1000 * (time.perf_counter() - t) / reps, 4)
    pos = torch.arange(T).repeat(2)
    return {"T": T, "mask_built": ms(lambda: mars.training_mask.__wrapped__(T, B, torch.device("cpu"))),
            "mask_cached": ms(lambda: mars.training_mask(T, B, torch.device("cpu"))),
            "rotary": ms(lambda: model_py.rotary(pos, head_dim, 10000.0, torch.float32))}


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--preset", choices=list(train.PRESETS), default="cpu", help="the preset to measure (default cpu)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per stage and setting (default 6)")
    p.add_argument("--batches", type=int, default=1000, help="batches counted per padding row (default 1000)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads to time (default 1 2)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="autocast precisions to time, with length buckets at the first thread count")
    p.add_argument("--out_dir", default="docs", help="where padding_<preset>.json and profile_<preset>.json go "
                                                     "(default docs)")
    return p.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    command = " ".join(["python -m extras.bench.profile_train", *(sys.argv[1:] if argv is None else argv)])
    load_before, where = os.getloadavg()[0], machine()  # torch's default threads here; each row sets its own
    targs = train.get_config(["--preset", args.preset, "--device", "cpu", "--out_dir", tempfile.mkdtemp(),
                               "--precision", "float32"])  # each setting below sets its own autocast
    torch.manual_seed(0)
    net, tok, splits, _ = train.start_stage("ar", None, targs, None, print)
    stages = {name: train.Stage(name, net, tok, splits, targs) for name in ("ar", "mars")}
    rows, buckets = [], {name: s.buckets for name, s in stages.items()}
    for name, s in stages.items():
        for n in (1, targs.buckets):
            s.buckets = data.length_buckets(s.seqs, n, s.multiple, min_seqs=8 * targs.batch_size)
            rows.append({"stage": name, "buckets": n, **padding(s, args.batches)})
            print(rows[-1], flush=True)
    settings = [(t, "float32", targs.buckets) for t in args.threads] + [(args.threads[0], "float32", 1)]
    settings += [(args.threads[0], d, targs.buckets) for d in args.dtypes if d != "float32"]
    steps = []
    for threads, dtype, n in settings:
        torch.set_num_threads(threads)
        for name, s in stages.items():
            s.buckets = buckets[name] if n == targs.buckets else data.length_buckets(s.seqs, 1)
            s.cfg = targs.replace(precision=dtype)
            steps.append({"stage": name, "threads": threads, "dtype": dtype, "buckets": n,
                          "ms": profile(s, args.steps)})
            print(steps[-1], flush=True)
    note = (f"load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores: "
            "where it exceeds the threads used, other jobs shared the cores and the times are slower and noisier "
            "than on an idle machine; compare rows of one file")
    common = {"command": command, "machine": where, "batch_size": targs.batch_size, "B": targs.B,
              "train_seqs": {name: len(s.seqs) for name, s in stages.items()}, "tokenizer": tok.n_vocab}
    with open(os.path.join(args.out_dir, f"padding_{args.preset}.json"), "w") as f:
        json.dump({**common, "what": "fractions of the positions fed to the model: padding (no token of a row) "
                   "and loss (a target); buckets 1 = uniform batches (before), else length buckets (after); stage 2 "
                   "without the noisy prompt blocks mars_loss leaves out, in_full with them (before); "
                   f"{args.batches} batches per row", "rows": rows}, f, indent=1)
    with open(os.path.join(args.out_dir, f"profile_{args.preset}.json"), "w") as f:
        json.dump({**common, "what": f"mean ms per training step of the {args.preset} preset; step = data + "
                   "forward + backward + optimizer", "note": note, "steps": args.steps,
                   "rows": steps, "per_forward_ms": per_forward()}, f, indent=1)


if __name__ == "__main__":
    run_cli(main)
