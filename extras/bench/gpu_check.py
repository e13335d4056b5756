"""The one-GPU path, measured: the toy's full `python train.py` (time, and quality against the CPU run's goals);
training's tokens/s and peak memory for the toy and SmolLM2 (short runs: the toy also at a larger batch and, on
CUDA, under --compile); decoding's tokens/s and wall-clock speedup over AR for both, at batch 1, 4, 8 and 16, with
the sliding and the block cache, eager and in CUDA graphs (engine.CudaGraphs): the paper's Table 5 in miniature.
Beside them, the full recipes' GPU time estimated from their FLOPs (no GPU needed), its assumed utilization beside
the measured one.

    python -m extras.bench.gpu_check                       # on a GPU: everything -> docs/gpu_check.json
    python -m extras.bench.gpu_check --real_ckpt out/smollm/mars.pt   # SmolLM2 decoding a trained MARS checkpoint
    python -m extras.bench.gpu_check --estimate_only       # the estimate alone, on any machine
    python -m extras.bench.gpu_check --device cpu --preset tiny --skip_real --skip_full --steps 3 \\
        --n_train 1000 --toy_batches 16 --batches 2 --graphs off captured     # on a CPU (the test)

Every run is a train.py command, run in this process; the JSON records each command, the precision train.py
chose, its stages' steps/s (overall, and over the second half: after compilation and warm-up), tokens/s, achieved
TFLOP/s and the share of the GPU's peak, and its peak memory (per row too). SmolLM2 trains on --data (the distilled
rows of extras.real.distill, as docs/real_models.md makes them) or, without it, 64 of the toy's examples: short
rows, whose memory per row is not a real recipe's. Its decoding reads --real_ckpt, else the few steps trained here,
whose masks have learnt nothing: their speedup is not MARS's.
"""
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from extras.checkpoints import hf_train
import data
from extras.engine import engine
import train
from common import check_device, load_checkpoint, model_from_checkpoint
from common import Parser, add_device, run_cli
from extras.bench.eval import machine
from model import GPT, GPTConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"  # the measured files the estimate reads
TAU, REAL_ROWS, REAL_BATCH = 0.9, 64, 64  # decoding's tau; SmolLM2's rows here, and its batch (the 2026-12-04 runs')
MAX_NEW_TOKENS = {"toy": 64, "smollm2": 128}  # as sample.py and extras.real.eval decode them
ROW_SAMPLE = 2000  # training rows whose mean length counts a stage's tokens
GOALS = {"ar_accuracy": 0.96, "tokens_per_forward": 3.0, "points_below_tau_1": 0.01, "seconds": 300}  # issue 45's
GPUS = {  # dense peak TFLOP/s (no sparsity), from the vendors' data sheets: an assumption of the estimate
    "H100 SXM, bf16": 989, "H200, bf16": 989, "A100, bf16": 312, "L4, bf16": 121, "T4, fp16": 65, "T4, fp32": 8.1}
UTILIZATION = 0.3  # the share of the peak a training step sustains: an assumption, typical of small models
FIELDS = {
    "seconds": "wall clock of the whole train.py command: data, tokenizer, steps, checkpoints, its own evaluation",
    "steps_per_s": "optimizer steps over the stage's training loop seconds (train.py's elapsed_s, validation "
                   "excluded); steady_steps_per_s: over the second half of the steps (after compilation and warm-up)",
    "tokens_per_s": "steady steps/s x batch x the mean training row's tokens (the clean stream's: a MARS step also "
                    "reads their noisy copy)",
    "tflops": "6 N FLOPs per position a step processes (MARS: both streams, an upper bound) at the steady rate; "
              "utilization: that over the GPU's dense peak in GPUS (null where the GPU or its precision is not listed)",
    "peak_memory_gib": "torch.cuda.max_memory_allocated over the command; per_row_mib: over the micro-batch's rows; "
                       "null on a CPU",
    "decoding": "tokens/s of generate_batch over prompts in batches (its clock waits for the GPU), after a first "
                "pass over the same prompts (the CUDA graphs captured, compiled) whose seconds are first_pass_s; "
                f"AR: the MARS checkpoint at B = 1; MARS at tau {TAU}; speedup: over AR at the same batch and graphs "
                "mode; per_token_per_forward: speedup over tokens per forward (1.0 where a window of B costs what "
                "a window of 1 does)",
}


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--out", default="docs/gpu_check.json", help="the JSON to write (default docs/gpu_check.json)")
    p.add_argument("--preset", choices=["tiny", "cpu", "gpu"], default="gpu", help="the toy's preset (default gpu; "
                   "tiny: seconds on a CPU)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of each stage of the short runs "
                   "(default 100)")
    p.add_argument("--n_train", type=int, default=20000, help="the short runs' training examples (default 20000, "
                   "fewer than the preset's, so that building them takes seconds)")
    p.add_argument("--toy_batches", type=int, nargs="+", help="the toy's short runs' batches (default the preset's "
                   "and 4 times it)")
    p.add_argument("--skip_full", action="store_true", help="leave out the toy's full train.py run")
    p.add_argument("--data", help="the JSONL SmolLM2 trains on (default: a JSONL of 64 of the toy's examples, "
                                  "written here)")
    p.add_argument("--real_ckpt", help="a trained SmolLM2 MARS checkpoint to decode (default: the few steps "
                                       "trained here)")
    p.add_argument("--skip_real", action="store_true", help="leave out SmolLM2, in the runs and in the estimate")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16], help="decoding's batch sizes "
                   "(default 1 4 8 16)")
    p.add_argument("--graphs", nargs="+", choices=engine.GRAPH_MODES, help="decoding's engine.GRAPH_MODES "
                   "(default all three on CUDA, off on a CPU)")
    p.add_argument("--estimate_only", action="store_true", help="run nothing; write the estimate alone")
    add_device(p)
    args = p.parse_args(argv)
    if min(args.steps, args.n_train, *args.batches, *(args.toy_batches or [1])) < 1:
        p.error("--steps, --n_train, --batches and --toy_batches must be at least 1")
    if args.real_ckpt and not os.path.exists(args.real_ckpt):  # before an hour of runs, not after
        p.error(f"--real_ckpt {args.real_ckpt} does not exist")
    cuda = args.device.startswith("cuda")
    args.graphs = args.graphs or (list(engine.GRAPH_MODES) if cuda else ["off"])
    args.toy_batches = args.toy_batches or [train.PRESETS[args.preset]["batch_size"] * k for k in (1, 4)]
    return args


def peak_memory(device, reset=False):
    """GiB of CUDA memory allocated at most since the last reset (None on a CPU: CUDA's counter alone exists)."""
    if not device.startswith("cuda"):
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def run_train(argv, device):
    """train.py's main in this process (its own Ctrl-C handler put back after): (its seconds, peak memory)."""
    handler, t = signal.getsignal(signal.SIGINT), time.perf_counter()
    peak_memory(device, reset=True)
    try:
        train.main(argv)
    finally:
        signal.signal(signal.SIGINT, handler)
    return time.perf_counter() - t, peak_memory(device)


def peak_tflops(device_name, dtype):
    """The GPUS peak of a GPU by name, in the precision a run trained in; None if not listed (or a CPU)."""
    kind = "bf16" if dtype == "bfloat16" else "fp32"
    return next((peak for gpu, peak in GPUS.items() if gpu.split()[0].rstrip(",") in device_name
                 and gpu.endswith(kind)), None)


def stage_figures(ckpt, history, device_name):
    """A stage's speed from its log: steps/s overall and over the second half, tokens/s (the mean row's tokens from
    the first ROW_SAMPLE training rows), TFLOP/s and utilization."""
    cfg, name, B = ckpt["train_config"], ckpt["stage"], ckpt.get("mars", {}).get("B", 1)
    _, tok = model_from_checkpoint(ckpt, "cpu")
    examples = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])["train"][:ROW_SAMPLE]
    rows = data.tokenize(examples, tok, cfg["max_seq_len"], B)
    row_tokens = sum(len(ids) for ids, _ in rows) / len(rows)
    half, last = history[len(history) // 2], history[-1]
    steady = (last["iter"] - half["iter"]) / max(last["elapsed_s"] - half["elapsed_s"], 1e-9) if len(history) > 1 \
        else last["iter"] / last["elapsed_s"]
    batch = train.schedule_of(train.Config(**cfg), name)[0]  # the hf preset's follows the data
    tokens_per_s = steady * batch * row_tokens
    positions = tokens_per_s * (2 if name == "mars" else 1)
    flops = 6 * parameters(ckpt["model_config"]) * positions
    peak = peak_tflops(device_name, cfg["precision"])
    return {"stage": name, "steps": last["iter"], "batch_size": batch, "micro_batch": cfg["micro_batch"] or batch, "row_tokens": round(row_tokens, 1),
            "loop_seconds": last["elapsed_s"], "steps_per_s": round(last["iter"] / last["elapsed_s"], 3),
            "steady_steps_per_s": round(steady, 3), "tokens_per_s": round(tokens_per_s),
            "tflops": round(flops / 1e12, 3), "utilization": peak and round(flops / 1e12 / peak, 4)}


def training_run(name, argv, out_dir, stages, device_name, device):
    """One train.py command and its stages' figures (their checkpoints in out_dir)."""
    seconds, peak = run_train(argv, device)
    figures = []
    for stage in stages:
        ckpt = load_checkpoint(os.path.join(out_dir, f"{stage}.pt"))
        figures.append(stage_figures(ckpt, ckpt["history"], device_name))
    micro = max(s["micro_batch"] for s in figures)
    result = {"run": name, "command": shlex.join(["python", "train.py", *argv]),
              "precision": ckpt["train_config"]["precision_why"], "seconds": round(seconds, 2), "stages": figures,
              "peak_memory_gib": peak, "peak_memory_per_row_mib": peak and round(1024 * peak / micro, 1)}
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def quality(out_dir, device):
    """The full run's held-out quality: train.py's summary, MARS at tau 0.95 on the same prompts, and the goals."""
    with open(os.path.join(out_dir, "summary.json")) as f:
        table = json.load(f)
    ckpt = load_checkpoint(os.path.join(out_dir, "mars.pt"), device)
    cfg = ckpt["train_config"]
    test = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])["test"][:cfg["summary_limit"]]
    table.append({"model": "MARS tau=0.95", "threshold": 0.95,
                  **train.evaluate(*model_from_checkpoint(ckpt, device), test, B=ckpt["mars"]["B"], tau=0.95)})
    ar, tau_1, tau_95 = table[0], table[1], table[-1]
    goals = {"AR SFT accuracy >= 96%": ar["accuracy"] >= GOALS["ar_accuracy"],
             "tau 0.95: >= 3.0 tokens per forward": tau_95["tokens_per_forward"] >= GOALS["tokens_per_forward"],
             "tau 0.95: within 1 point of tau 1.0":
                 tau_95["accuracy"] >= tau_1["accuracy"] - GOALS["points_below_tau_1"]}
    return {"summary": table, "goals": goals}


def toy_runs(args, tmp, device_name):
    """The toy's full run (time and quality), then its short runs (each batch; compiled on CUDA)."""
    where = ["--device", args.device]
    runs = []
    if not args.skip_full:
        out = os.path.join(tmp, "full")
        full = training_run("toy, full", ["--preset", args.preset, "--out_dir", out, *where], out, ("ar", "mars"),
                            device_name, args.device)
        full["quality"] = quality(out, args.device)
        full["quality"]["goals"]["the run in 5 minutes or less"] = full["seconds"] <= GOALS["seconds"]
        runs.append(full)
    short = ["--preset", args.preset, "--n_train", str(args.n_train), "--ar_iters", str(args.steps), "--mars_iters",
             str(args.steps), "--eval_every", str(args.steps), "--save_every", str(args.steps), "--summary_limit",
             "0", *where]
    compiled = [(args.toy_batches[0], True)] if args.device.startswith("cuda") else []  # a CUDA question
    for i, (batch, compile_) in enumerate([(b, False) for b in args.toy_batches] + compiled):
        out = os.path.join(tmp, f"short{i}")
        argv = [*short, "--batch_size", str(batch), "--out_dir", out] + (["--compile"] if compile_ else [])
        runs.append(training_run(f"toy, {args.steps} steps a stage, batch {batch}" + (", compiled" if compile_ else ""),
                                 argv, out, ("ar", "mars"), device_name, args.device))
    return runs


def toy_data_jsonl(path):
    """REAL_ROWS of the toy's training examples as {prompt, response} lines: SmolLM2's handful of rows."""
    with open(path, "w", encoding="utf-8") as f:
        for e in data.build_instruction_set(0, n_train=REAL_ROWS, n_val=0, n_test=0)["train"]:
            f.write(json.dumps({"prompt": e["prompt"], "response": e["response"]}) + "\n")
    return path


def real_run(args, tmp, device_name):
    """SmolLM2's MARS stage, --steps steps of REAL_BATCH rows in one micro-batch (as the 2026-12-04 runs trained)."""
    out, rows = os.path.join(tmp, "smollm2"), args.data or toy_data_jsonl(os.path.join(tmp, "rows.jsonl"))
    argv = ["--stage", "mars", "--init_from", "smollm2", "--data", rows, "--mars_iters", str(args.steps),
            "--batch_size", str(REAL_BATCH), "--micro_batch", str(REAL_BATCH), "--eval_every", str(args.steps),
            "--save_every", str(args.steps), "--summary_limit", "0", "--out_dir", out, "--device", args.device]
    run = training_run("smollm2 mars", argv, out, ("mars",), device_name, args.device)
    run["rows"] = "--data" if args.data else f"{REAL_ROWS} of the toy's examples (short rows)"
    return run


def timed(model, tok, prompts, batch, max_new_tokens, options):
    """Decoding the prompts `batch` at a time twice, the second pass timed: tokens/s, tokens per forward, and the
    first pass's seconds (CUDA graphs captured, or compiled, there)."""
    passes = []
    for _ in range(2):
        tokens = forwards = seconds = 0
        for i in range(0, len(prompts), batch):
            done = engine.generate_batch(model, prompts[i:i + batch], tok.eot, tok.mask, n_vocab=tok.n_vocab,
                                         max_new_tokens=max_new_tokens, **options)
            tokens += sum(len(r.tokens) for r in done)
            forwards += sum(r.forwards for r in done)
            seconds += done[0].seconds
        passes.append((tokens, forwards, seconds))
    (_, _, first), (tokens, forwards, seconds) = passes
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": float(f"{tokens / seconds:.4g}"),
            "tokens_per_forward": round(tokens / forwards, 3), "first_pass_s": round(first, 3)}


def decoding(name, path, args, trained):
    """A MARS checkpoint's decoding grid: per graphs mode and batch, AR and MARS with each cache, and MARS's
    wall-clock speedup over AR."""
    ckpt = load_checkpoint(path, args.device)
    model, tok = model_from_checkpoint(ckpt, args.device)
    model.eval()
    cfg, B = ckpt["train_config"], ckpt["mars"]["B"]
    splits = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])
    prompts = [tok.prompt_ids(e["prompt"]) for e in splits["test"] + splits["val"] + splits["train"]]
    rows = []
    for graphs in args.graphs:
        for batch in args.batches:
            some = prompts[:max(8, 2 * batch)]
            row = {"graphs": graphs, "batch": batch, "prompts": len(some),
                   "ar": timed(model, tok, some, batch, MAX_NEW_TOKENS[name], dict(B=1, graphs=graphs))}
            for cache in ("sliding", "block"):
                r = timed(model, tok, some, batch, MAX_NEW_TOKENS[name], dict(B=B, tau=TAU, cache=cache, graphs=graphs))
                r["speedup"] = float(f"{r['tokens_per_s'] / row['ar']['tokens_per_s']:.3g}")
                r["per_token_per_forward"] = float(f"{r['speedup'] / r['tokens_per_forward']:.3g}")
                row[cache] = r
            print(f"decoding {name}: {json.dumps(row)}", flush=True)
            rows.append(row)
    return {"model": name, "checkpoint": path if trained else "the few steps trained here", "trained": trained,
            "B": B, "tau": TAU, "max_new_tokens": MAX_NEW_TOKENS[name], "rows": rows}


def measure(args, tmp, device_name):
    """The training runs and the decoding grids: (training, decoding, SmolLM2's model config or None)."""
    runs = toy_runs(args, tmp, device_name)
    toy = os.path.join(tmp, "full" if not args.skip_full else "short0", "mars.pt")
    grids = [decoding("toy", toy, args, trained=not args.skip_full)]
    if args.skip_real:
        return runs, grids, None
    runs.append(real_run(args, tmp, device_name))
    real = args.real_ckpt or os.path.join(tmp, "smollm2", "mars.pt")
    grids.append(decoding("smollm2", real, args, trained=bool(args.real_ckpt)))
    return runs, grids, load_checkpoint(real)["model_config"]


def parameters(model_config):
    """Parameters of a model config, counted on the meta device (nothing allocated; tied embeddings once)."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(GPTConfig(**model_config)).parameters())


def estimate(recipes, gpus=GPUS, utilization=UTILIZATION):
    """Each recipe ({name, parameters, stages: [{steps, tokens_per_step}]}) with its training FLOPs, 6 N per token
    trained (forward and backward; attention's own FLOPs left out), and its seconds on each GPU at `utilization`
    of the GPU's peak."""
    out = []
    for r in recipes:
        flops = sum(6 * r["parameters"] * s["tokens_per_step"] * s["steps"] for s in r["stages"])
        out.append({**r, "flops": float(f"{flops:.4g}"),
                    "seconds": {g: float(f"{flops / (peak * 1e12 * utilization):.3g}") for g, peak in gpus.items()}})
    return out


def toy_recipe(preset):
    """The toy's full recipe: the preset's steps and batch, its tokens per sequence measured on the cpu preset
    (docs/padding_cpu.json: the same data and vocabulary, length-bucketed batches; stage 2 counts both streams)."""
    p = train.PRESETS[preset]
    cfg = {"vocab_size": p["vocab_size"], **{k: p[k] for k in train.MODEL_KEYS}}
    with open(DOCS / "padding_cpu.json") as f:
        padding = json.load(f)
    per_seq = {r["stage"]: r["positions_per_batch"] / padding["batch_size"] for r in padding["rows"]
               if r["buckets"] > 1}
    return {"name": f"toy, {preset} preset", "parameters": parameters(cfg), "model_config": cfg,
            "stages": [{"stage": s, "steps": p[f"{s}_iters"], "batch_size": p["batch_size"],
                        "tokens_per_sequence": round(per_seq[s], 1),
                        "tokens_per_step": round(p["batch_size"] * per_seq[s])} for s in ("ar", "mars")],
            "source": "docs/padding_cpu.json (tokens per sequence, cpu preset)"}


def real_recipe(model_config):
    """SmolLM2's recipe (docs/real_models.md): MARS on the distilled rows of docs/distill_smollm2_cpu.json, 5
    epochs, the hf preset's schedule on them (hf_train.hf_schedule); 2T tokens per row, the clean and noisy
    streams concatenated (an upper bound: mars_loss leaves out the noisy prompt blocks nothing reads)."""
    with open(DOCS / "distill_smollm2_cpu.json") as f:
        rows = json.load(f)["train"]
    hf = hf_train.HF_PRESET
    batch, steps, lr, why = hf_train.hf_schedule(rows["n"], hf["epochs"], {}, hf["micro_batch"])
    return {"name": "SmolLM2-135M-Instruct, MARS stage", "parameters": parameters(model_config),
            "stages": [{"stage": "mars", "steps": steps, "batch_size": batch, "lr": lr, "schedule": why,
                        "rows": rows["n"], "tokens_per_sequence": 2 * rows["mean_row_tokens"],
                        "tokens_per_step": round(batch * 2 * rows["mean_row_tokens"])}],
            "source": "docs/distill_smollm2_cpu.json (rows and their mean tokens)"}


def estimated(args, real_config, runs):
    """The estimate section: its assumptions, the utilization the training runs measured, the recipes' FLOPs and
    GPU time."""
    recipes = [toy_recipe("gpu")]
    if not args.skip_real:
        real_config = real_config or load_checkpoint("smollm2")["model_config"]
        recipes.append(real_recipe(real_config))
    measured = {f"{r['run']}, {s['stage']}": s["utilization"] for r in runs or [] for s in r["stages"]}
    return {"what": "an estimate from FLOPs, not a measurement",
            "assumptions": {"flops_per_token": "6 N: forward and backward, N every parameter (tied embeddings "
                            "once: the output layer's matmul); attention's own FLOPs and the optimizer left out",
                            "utilization": UTILIZATION,
                            "peak_tflops": GPUS, "T4": "this project trains a T4 in float32 (no native bf16; fp16 "
                            "needs loss scaling, which it does not do): its fp16 row is for comparison"},
            "measured_utilization": measured or None,
            "recipes": estimate(recipes)}


def table(estimate):
    """The estimate as docs/gpu.md shows it: the time of each recipe on each GPU."""
    recipes, shown = estimate["recipes"], lambda s: f"{s:.2g} s" if s < 60 else f"{s / 60:.2g} min"
    lines = ["| GPU (assumed peak TFLOP/s) | " + " | ".join(f"{r['name']}: {r['flops']:.3g} FLOPs" for r in recipes)
             + " |", "|---" * (1 + len(recipes)) + "|"]
    for gpu, peak in estimate["assumptions"]["peak_tflops"].items():
        lines.append(f"| {gpu} ({peak:g}) | " + " | ".join(shown(r["seconds"][gpu]) for r in recipes) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = get_args(argv)
    check_device(args.device)  # before any run: the device's name goes into the file
    command = shlex.join(["python", "-m", "extras.bench.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    cuda = args.device.startswith("cuda")
    device_name = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    runs, grids, real_config = None, None, None
    if not args.estimate_only:
        with tempfile.TemporaryDirectory() as tmp:
            runs, grids, real_config = measure(args, tmp, device_name)
    result = {"command": command, "machine": machine(), "device": args.device, "torch": torch.__version__,
              "device_name": device_name, "training": runs, "decoding": grids, "fields": FIELDS,
              "estimate": estimated(args, real_config, runs)}
    if args.estimate_only:
        result["unmeasured"] = "--estimate_only: nothing was run"
    elif not cuda:
        result["cpu_note"] = ("on a CPU: peak memory and utilization null (CUDA's counters), no compiled training "
                              "run (a CUDA question), and graphs 'captured' runs its fixed shapes uncaptured")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(table(result["estimate"]) + f"\n\nwrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
