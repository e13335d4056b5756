"""Where a training step's time goes, what bounds it, and how much of a batch is padding (the
cpu preset by default).

    python -m extras.bench.profile_train   # -> docs/padding_cpu.json, docs/profile_muon_cpu.json
    python -m extras.bench.profile_train --steps 10 --threads 2 --dtypes float32 --batches 0

Both use the preset's training set (the cpu preset: 40,000 examples, tokenized with its own
tokenizer) and batches drawn as train.py draws them: uniformly (--buckets 1, before) or from
length buckets (the default).

Padding (padding_<preset>.json; --batches 0 skips it): over --batches batches per row, the
fraction of the positions fed to the model that hold no token of a row (padding) and that
carry a loss, counted by running the real losses on a model stand-in. Stage 2 feeds
[noisy | clean], each row first padded with <|endoftext|> to a multiple of B (trained, so not
padding), without the noisy prompt blocks mars_loss leaves out; "in_full" counts the whole
[noisy | clean] input, as the loss fed it before (buckets 1, in_full: the old batches).

Profile (profile_<preset>.json; a Muon preset's: profile_muon_<preset>.json): the preset's
model and optimizers, --steps steps of each stage after a warm-up, at each thread count and
dtype: mean milliseconds per step of data (drawing and padding the batch), forward (the
loss), backward, optimizer (clip, then each optimizer's step and zero_grad), and their sum,
the step. And what bounds a step, in float32:
- its model FLOPs, from the matmul shapes (M x K x N): 2 M K N a product, x3 with the
  backward; every linear over the positions fed (stage 2: [noisy | clean] without its idle
  noisy positions), attention's QK^T and AV over the full t x t, the head over the positions
  with a target; and Muon's Newton-Schulz products (5 iterations of X X^T, A A, B X);
- the FLOP/s it achieves, in all and per part;
- the machine's: one 2048^3 matmul in float32 and in bf16 (emulated where the CPU has no
  native bf16: smaller where that is too slow), Newton-Schulz alone, and one step's matmuls
  alone (the forward product and both backward ones), at each thread count;
- the host overhead: a step's data + forward + backward time at batch 1 (a bound: it holds
  a row's work too), and that time's intercept against the step's model FLOPs over steps at
  batch 1, 8, 32 and the preset's.
Plus what mask and rotary tables cost per forward.
"""
import collections
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

PEAK_N = 2048  # the peak's matmul: n x n x n
NS_STEPS = 5  # train.orthogonalise's iterations


class Counter(torch.nn.Module):
    """Stands in for the model: counts the positions fed and the logits asked for, returns
    their cross-entropy as zeros."""

    def __init__(self):
        super().__init__()
        self.fed, self.loss, self.starts = 0, 0, []

    def forward(self, ids, targets=None, positions=None, attn_mask=None, cache=None):
        self.fed += ids.numel()
        self.loss += int((targets != -1).sum())
        # stage 2's positions are start..T-1 (noisy), then 0..T-1 (clean)
        clean = None if positions is None else int((positions == 0).nonzero()[-1, 0])
        self.starts.append(0 if clean is None else ids.shape[1] - 2 * clean)
        return torch.zeros(targets.shape)


def padding(stage, n_batches, seed=0):
    """Fractions of the fed positions that are padding and that carry a loss, over one Stage's
    batches; for stage 2 also without leaving out the noisy prompt blocks (the [noisy | clean]
    input in full)."""
    m, g, real, left_out = Counter(), torch.Generator().manual_seed(seed), 0, 0
    for _ in range(n_batches):
        drawn = data.draw_batch(stage.buckets, stage.batch_size, g)
        rows = [stage.seqs[i] for i in drawn]
        x, y = data.make_batch(rows, stage.tok.eot, stage.multiple)
        stage.loss(m, x, y)
        lengths = [len(ids) + (-len(ids) % stage.multiple) - 1 for ids, _ in rows]  # inputs
        start = m.starts[-1]
        real += sum(lengths) if stage.name == "ar" else sum(2 * n - start for n in lengths)
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


def best_ms(fn, *a, least=0.02):
    """The fastest call of fn(*a) in ms, after a warm-up: of 3 calls, more until `least`
    seconds."""
    fn(*a)
    times = []
    while len(times) < 3 or sum(times) < least:
        times.append(timed(fn, *a)[1])
    return 1000 * min(times)


def fed(stage, x, y):
    """(rows, positions, logits) a step's forward computes: stage 2's [noisy | clean] input
    without its idle noisy positions; logits only where there is a target."""
    if stage.name == "ar":
        return x.shape[0], x.shape[1], int((y != -1).sum())
    ids, _, targets, _ = mars.mars_input(x, y, stage.tok.mask, stage.cfg.B)
    return ids.shape[0], ids.shape[1], int((targets != -1).sum())


def matmuls(model, rows, t, logits):
    """A forward's products as (name, batch, M, K, N, count): each layer's linears over the
    rows x t positions, attention's per row and head over the full t x t (a masked kernel
    computes it all), the head over the logits asked for."""
    c, layer, bt = model.config, model.layers[0], rows * t
    out = [(name, 1, bt, m.in_features, m.out_features, c.n_layer)
           for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    bh = rows * c.n_head
    out += [("QK^T", bh, t, c.head_dim, t, c.n_layer),
            ("AV", bh, t, t, c.head_dim, c.n_layer)]
    return out + [("lm_head", 1, logits, c.n_embd, c.vocab_size, 1)]


def step_gflop(products):
    """A training step's: 2 M K N a product, x3 for the backward's two of the same size."""
    return 3 * sum(2 * b * M * K * N * n for _, b, M, K, N, n in products) / 1e9


def phases(stage):
    """One step as train.train takes it (one process, no accumulation), its phases timed
    apart, and what its forward computes (fed)."""
    def draw():
        return stage.batch(stage.next_batch())
    (x, y), t_data = timed(draw)
    with stage.amp():
        (loss, _), t_fwd = timed(stage.loss, stage.model, x, y)
    _, t_bwd = timed(loss.backward)
    t = {"data": t_data, "forward": t_fwd, "backward": t_bwd}
    params, clip = stage.raw_model.parameters(), stage.cfg.grad_clip
    _, t["clip"] = timed(torch.nn.utils.clip_grad_norm_, params, clip)
    for opt in stage.optimizers:  # Muon's step, AdamW's
        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)
        _, t[type(opt).__name__] = timed(update)
    return t, fed(stage, x, y)


def profile(stage, steps):
    """Mean ms per phase over `steps` steps (after a warm-up), the optimizer's and the step's
    (their sums), the mean model GFLOP of a step; each step's (GFLOP, seconds of data, forward
    and backward); the first step's fed. Every setting draws the same batches (the order is
    reseeded)."""
    stage.order.manual_seed(0)
    phases(stage)
    runs = [phases(stage) for _ in range(steps)]
    ms = {k: 1000 * sum(t[k] for t, _ in runs) / steps for k in runs[0][0]}
    opt = {k: ms.pop(k) for k in list(ms)[3:]}  # clip and each optimizer
    ms["optimizer"] = sum(opt.values())
    ms["step"] = sum(ms.values())
    points = [(step_gflop(matmuls(stage.raw_model, *shape)),
               t["data"] + t["forward"] + t["backward"]) for t, shape in runs]
    gflop = sum(g for g, _ in points) / steps
    row = {"ms": {k: round(v, 1) for k, v in ms.items()},
           "optimizer_ms": {k: round(v, 1) for k, v in opt.items()}, "gflop": round(gflop, 3)}
    return row, points, runs[0][1]


def achieved(row, ns_gflop):
    """GFLOP/s of the step (model FLOPs), forward (a third), backward (two thirds) and
    optimizer (Newton-Schulz's)."""
    ms, g = row["ms"], row["gflop"]
    work = {"step": g, "forward": g / 3, "backward": 2 * g / 3, "optimizer": ns_gflop}
    return {k: round(f / ms[k] * 1000, 1) for k, f in work.items()}


def newton_schulz(optimizers):
    """Muon's orthogonalisations of a step, per shape: (shape, count, GFLOP) of 5 iterations
    of X X^T, A A and B X on each m x n matrix (m <= n)."""
    shapes = collections.Counter(tuple(p.shape) for opt in optimizers
                                 if isinstance(opt, train.Muon)
                                 for group in opt.param_groups for p in group["params"])
    return [(s, n, NS_STEPS * n * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) / 1e9)
            for s, n in shapes.items()]


def peak(dtype, budget=2.0):
    """GFLOP/s of an n x n x n matmul in dtype, the best of 3 calls (fewer past `budget` s),
    at n = PEAK_N or, where that would take over `budget` s a call (emulated bf16 can be
    very slow), the largest power of 2 from 256 that does not; and n."""
    n = 256
    while True:
        a, b = (torch.randn(n, n, dtype=dtype) for _ in range(2))
        times = []
        while len(times) < 3 and sum(times) < budget:
            times.append(timed(torch.matmul, a, b)[1])
        if n == PEAK_N or 8 * min(times) > budget:
            return round(2 * n ** 3 / min(times) / 1e9, 1), n
        n *= 2


def alone(products):
    """Each product's three in a training step (the forward A B; the backward G B^T and
    A^T G), alone in float32: ms and GFLOP/s of each; and their sum over the step in ms."""
    out, floor, seen = [], 0.0, {}
    for name, batch, M, K, N, count in products:
        if (batch, M, K, N) not in seen:
            lead = (batch,) if batch > 1 else ()
            A, B, G = (torch.randn(*lead, r, c) for r, c in ((M, K), (K, N), (M, N)))
            pairs = ((A, B), (G, B.mT), (A.mT, G))
            seen[batch, M, K, N] = [best_ms(torch.matmul, *p) for p in pairs]
        ms, gflop = seen[batch, M, K, N], 2 * batch * M * K * N / 1e9
        floor += count * sum(ms)
        out.append({"name": name, "ms": [round(v, 4) for v in ms],
                    "gflop_s": [round(gflop / v * 1000, 1) for v in ms]})
    return out, floor


def intercept(points):
    """Least squares of y on x: (intercept, slope)."""
    mx, my = (sum(v) / len(points) for v in zip(*points))
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x, _ in points))
    return my - slope * mx, slope


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
    p.add_argument("--preset", choices=list(train.PRESETS), default="cpu",
                   help="the preset to measure (default cpu)")
    p.add_argument("--steps", type=int, default=6,
                   help="timed steps per stage and setting (default 6)")
    p.add_argument("--batches", type=int, default=1000,
                   help="batches counted per padding row; 0: no padding file (default 1000)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="torch threads to time (default 1 2); the first also times the rest")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"],
                   help="autocast precisions to time, with length buckets at the first thread "
                        "count")
    p.add_argument("--out_dir", default="docs",
                   help="where padding_<preset>.json and profile_[muon_]<preset>.json go "
                        "(default docs)")
    return p.parse_args(argv)


def write_padding(stages, targs, args, common):
    rows = []
    for name, s in stages.items():
        for n in (1, targs.buckets):
            s.buckets = data.length_buckets(s.seqs, n, s.multiple, min_seqs=8 * targs.batch_size)
            rows.append({"stage": name, "buckets": n, **padding(s, args.batches)})
            print(rows[-1], flush=True)
    with open(os.path.join(args.out_dir, f"padding_{args.preset}.json"), "w") as f:
        json.dump({**common, "what": "fractions of the positions fed to the model: padding (no "
                   "token of a row) and loss (a target); buckets 1 = uniform batches (before), "
                   "else length buckets (after); stage 2 without the noisy prompt blocks "
                   "mars_loss leaves out, in_full with them (before); "
                   f"{args.batches} batches per row", "rows": rows}, f, indent=1)


def bounds(net, one, ns, threads):
    """At each thread count: the float32 and bf16 peaks, Newton-Schulz alone per shape, and
    each stage's one step's products alone (their sum, and its GFLOP/s)."""
    out = {}
    for n in threads:
        torch.set_num_threads(n)
        (f32, f32_n), (bf16, bf16_n) = peak(torch.float32), peak(torch.bfloat16)
        ns_ms = {f"{s[0]} x {s[1]}": best_ms(train.orthogonalise, torch.randn(k, *s))
                 for s, k, _ in ns}
        steps = {}
        for name, shape in one.items():
            products = matmuls(net, *shape)
            times, ms = alone(products)
            steps[name] = {"ms": round(ms, 1),
                           "gflop_s": round(step_gflop(products) / ms * 1000, 1),
                           "products": times}
        out[n] = {"peak_gflop_s": {"float32": f32, "bfloat16": bf16},
                  "peak_n": {"float32": f32_n, "bfloat16": bf16_n},
                  "newton_schulz_ms": {k: round(v, 2) for k, v in ns_ms.items()},
                  "one_step_alone": steps}
        print({n: out[n]["peak_gflop_s"]}, ns_ms, flush=True)
    return out


def summarise(rows, measured, overhead, ns_gflop):
    """Per stage, the first setting's row (float32, buckets) against what bounds it."""
    out = {}
    for name in overhead:
        row = next(r for r in rows if r["stage"] == name)
        ms, rate, peaks = row["ms"], row["gflop_s"]["step"], measured["peak_gflop_s"]
        g, muon = row["gflop"], row["optimizer_ms"].get("Muon", 0.0)
        ns_ms = sum(measured["newton_schulz_ms"].values())
        fast = measured["one_step_alone"][name]["gflop_s"]
        out[name] = {
            "threads": row["threads"], "step_ms": ms["step"], "model_gflop": g,
            "gflop_s": rate, "float32_peak_gflop_s": peaks["float32"],
            "percent_of_float32_peak": round(100 * rate / peaks["float32"], 1),
            "bfloat16_peak_gflop_s": peaks["bfloat16"],
            "percent_of_bfloat16_peak": round(100 * rate / peaks["bfloat16"], 1),
            "forward_backward_ms": round(ms["forward"] + ms["backward"], 1),
            "matmuls_alone_gflop_s": fast,
            "forward_backward_at_matmuls_alone_ms": round(g / fast * 1000, 1),
            "optimizer_ms": ms["optimizer"],
            "optimizer_percent_of_step": round(100 * ms["optimizer"] / ms["step"], 1),
            "muon_ms": muon, "muon_percent_of_step": round(100 * muon / ms["step"], 1),
            "newton_schulz_gflop": round(ns_gflop, 3),
            "newton_schulz_percent_of_flops": round(100 * ns_gflop / (ns_gflop + g), 1),
            "newton_schulz_alone_ms": round(ns_ms, 1),
            "host_ms": overhead[name]["host_ms"],
            "host_percent_of_step": round(100 * overhead[name]["host_ms"] / ms["step"], 1)}
    return out


def main(argv=None):
    args = get_args(argv)
    command = " ".join(["python -m extras.bench.profile_train",
                        *(sys.argv[1:] if argv is None else argv)])
    load_before, where = os.getloadavg()[0], machine()  # torch's default threads here
    targs = train.get_config(["--preset", args.preset, "--device", "cpu", "--out_dir",
                              tempfile.mkdtemp(), "--precision", "float32"])  # rows set theirs
    torch.manual_seed(0)
    net, tok, splits, _ = train.start_stage("ar", None, targs, None, print)
    stages = {name: train.Stage(name, net, tok, splits, targs) for name in ("ar", "mars")}
    buckets = {name: s.buckets for name, s in stages.items()}
    common = {"command": command, "machine": where,
              "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "batch_size": targs.batch_size, "B": targs.B,
              "train_seqs": {name: len(s.seqs) for name, s in stages.items()},
              "tokenizer": tok.n_vocab}
    if args.batches:
        write_padding(stages, targs, args, common)
    ns = newton_schulz(stages["ar"].optimizers)  # each stage's Muon takes the same matrices
    ns_gflop = sum(g for *_, g in ns)

    settings = [(t, "float32", targs.buckets) for t in args.threads]
    settings += [(args.threads[0], "float32", 1)]
    settings += [(args.threads[0], d, targs.buckets) for d in args.dtypes if d != "float32"]
    rows, points, one = [], {}, {}
    for threads, dtype, n in settings:
        torch.set_num_threads(threads)
        for name, s in stages.items():
            s.buckets = buckets[name] if n == targs.buckets else data.length_buckets(s.seqs, 1)
            s.cfg = targs.replace(precision=dtype)
            row, pts, shape = profile(s, args.steps)
            rows.append({"stage": name, "threads": threads, "dtype": dtype, "buckets": n,
                         **row, "gflop_s": achieved(row, ns_gflop)})
            points.setdefault(name, pts)  # the first setting's: float32, buckets
            one.setdefault(name, shape)
            print(rows[-1], flush=True)

    torch.set_num_threads(args.threads[0])
    overhead, sizes = {}, sorted({1, 8, 32, targs.batch_size})
    for name, s in stages.items():  # float32, buckets, smaller batches
        s.buckets, s.cfg, runs = buckets[name], targs, {targs.batch_size: points[name]}
        for size in sizes:
            if size != targs.batch_size:
                s.batch_size = size
                runs[size] = profile(s, args.steps)[1]
        s.batch_size = targs.batch_size
        mean = [[sum(v) / len(v) for v in zip(*runs[size])] for size in sizes]
        host, slope = intercept([p for size in sizes for p in runs[size]])
        overhead[name] = {"batch_sizes": sizes, "gflop": [round(g, 3) for g, _ in mean],
                          "ms": [round(1000 * t, 1) for _, t in mean],
                          "host_ms": round(1000 * mean[0][1], 1),
                          "intercept_ms": round(1000 * host, 1),
                          "marginal_gflop_s": round(1 / slope, 1)}
        print(name, overhead[name], flush=True)

    measured = bounds(net, one, ns, args.threads)
    one_step = {}
    for name, shape in one.items():
        products = matmuls(net, *shape)
        one_step[name] = {"rows": shape[0], "positions": shape[1], "logits": shape[2],
                          "gflop": round(step_gflop(products), 3),
                          "products": [{"name": p, "batch": b, "M x K x N": f"{M} x {K} x {N}",
                                        "count": n} for p, b, M, K, N, n in products]}
    summary = summarise(rows, measured[args.threads[0]], overhead, ns_gflop)
    note = (f"load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after, on "
            f"{os.cpu_count()} cores: where it exceeds the threads used, other jobs shared the "
            "cores and the times are slower and noisier than on an idle machine; compare rows "
            "of one file")
    what = (f"the {args.preset} preset's training step. rows: mean ms per step (step = data + "
            "forward + backward + optimizer; optimizer_ms: clip and each optimizer's step with "
            "zero_grad), gflop: the mean model GFLOP of a step (2 M K N a product, x3 with the "
            "backward), gflop_s: achieved (step: model FLOPs / step; forward: a third of them; "
            "backward: two thirds; optimizer: Newton-Schulz's FLOPs / optimizer). one_step: "
            "the first timed step's forward products (M x K x N, count; batch: a batched "
            "product's). newton_schulz: Muon's orthogonalisations per step (5 iterations of "
            "X X^T, A A, B X). by_threads: an n^3 matmul's best GFLOP/s per dtype (n: peak_n), "
            "Newton-Schulz alone (ms per shape group), one step's products alone in float32 "
            "([forward, G B^T, A^T G] ms and GFLOP/s; ms: their sum over the step). overhead: "
            "a step's mean data + forward + backward ms and model GFLOP at batch_sizes; "
            "host_ms: the ms at the first (a bound on the host overhead); intercept_ms and "
            "marginal_gflop_s (1 / slope): least squares of those seconds on the GFLOP over "
            "every step. "
            "summary: the first thread count's float32 bucketed rows against those figures")
    name = f"profile_{'muon_' if ns else ''}{args.preset}.json"  # Muon's beside AdamW's
    with open(os.path.join(args.out_dir, name), "w") as f:
        json.dump({**common, "what": what, "note": note, "steps": args.steps,
                   "summary": summary, "rows": rows, "one_step": one_step,
                   "newton_schulz": [{"shape": f"{s[0]} x {s[1]}", "count": k,
                                      "gflop": round(g, 3)} for s, k, g in ns],
                   "by_threads": measured, "overhead": overhead,
                   "per_forward_ms": per_forward()}, f, indent=1)


if __name__ == "__main__":
    run_cli(main)
