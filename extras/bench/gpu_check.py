"""The one-GPU path, checked in minutes and estimated in full: a few steps of each stage of the toy's gpu preset
and of the SmolLM2 recipe (train.py --stage mars --init_from smollm2), each checkpoint then decoding a few prompts,
all timed; and the full runs' GPU time estimated from their FLOPs, which needs no GPU.

    python -m extras.bench.gpu_check                       # on a GPU: measured and estimated -> docs/gpu_check.json
    python -m extras.bench.gpu_check --estimate_only       # the estimate alone, on any machine
    python -m extras.bench.gpu_check --device cpu --preset tiny --skip_real --steps 3 --n_train 1000   # seconds

Each phase is one train.py command, run in this process: the toy's stage 1, its stage 2 from that checkpoint,
then SmolLM2's MARS stage on a handful of rows (--data, or a JSONL of the toy's examples it writes itself). Per
phase the JSON holds the command, the precision train.py chose, seconds, steps/s, tokens/s, peak GPU memory, and
the checkpoint's decoding of a few prompts (AR for stage 1, MARS at tau 0.9 for stage 2): tokens/s and tokens
per forward. The estimate: 6 N FLOPs per token trained (forward and backward) times the tokens of every step of
the full recipes, over an assumed share of a few GPUs' peak throughput; its assumptions are in the JSON.
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

import config
import data
import engine
import train
from checkpoint import check_device, load_checkpoint, model_from_checkpoint
from config import Parser, add_device, run_cli
from extras.bench.eval import machine
from model import GPT, GPTConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"  # the measured files the estimate reads
TAU, N_PROMPTS, REAL_ROWS = 0.9, 8, 64  # the decoding's tau and prompts; the rows SmolLM2 trains on here
GPUS = {  # dense peak TFLOP/s (no sparsity), from the vendors' data sheets: an assumption of the estimate
    "H100 SXM, bf16": 989, "A100, bf16": 312, "L4, bf16": 121, "T4, fp16": 65, "T4, fp32": 8.1}
UTILIZATION = 0.3  # the share of the peak a training step sustains: an assumption, typical of small models
FIELDS = {
    "seconds": "wall clock of the whole train.py command: data, tokenizer, precision probe, steps, checkpoint",
    "steps_per_s": "optimizer steps over the training loop's seconds (train.py's elapsed_s; first steps' warm-up "
                   "included)",
    "tokens_per_s": "steps x batch x the mean training row's tokens, over the loop's seconds (the clean stream's "
                    "tokens: a MARS step also reads their noisy copy)",
    "peak_memory_gib": "torch.cuda.max_memory_allocated over the command; null on a CPU",
    "decode": f"the checkpoint on {N_PROMPTS} prompts in one batch after a warm-up: stage 1 as AR, stage 2 at "
              f"tau {TAU}; tokens_per_forward: output tokens over the forwards each prompt's row took part in",
}


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--out", default="docs/gpu_check.json", help="the JSON to write (default docs/gpu_check.json)")
    p.add_argument("--preset", choices=["tiny", "cpu", "gpu"], default="gpu", help="the toy's preset (default gpu; "
                   "tiny: seconds on a CPU)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of each phase (default 50)")
    p.add_argument("--n_train", type=int, default=20000, help="the toy's training examples (default 20000, fewer "
                   "than the preset's, so that building them takes seconds)")
    p.add_argument("--data", help="the JSONL SmolLM2 trains on (default: a JSONL of 64 of the toy's examples, "
                                  "written here)")
    p.add_argument("--skip_real", action="store_true", help="leave out SmolLM2, in the runs and in the estimate")
    p.add_argument("--estimate_only", action="store_true", help="run nothing; write the estimate alone")
    add_device(p)
    args = p.parse_args(argv)
    if min(args.steps, args.n_train) < 1:
        p.error("--steps and --n_train must be at least 1")
    return args


def peak_memory(device, reset=False):
    """GiB of CUDA memory allocated at most since the last reset (None on a CPU: CUDA's counter alone exists)."""
    if not device.startswith("cuda"):
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def run_train(argv):
    """train.py's main in this process (its own Ctrl-C handler put back after); its seconds."""
    handler, t = signal.getsignal(signal.SIGINT), time.perf_counter()
    try:
        train.main(argv)
    finally:
        signal.signal(signal.SIGINT, handler)
    return time.perf_counter() - t


def decoded(model, tok, prompts, B, device):
    """The decoding of a phase: the prompts in one batch at tau TAU (AR where B is 1), after a warm-up."""
    ids = [tok.prompt_ids(p) for p in prompts]
    engine.generate_batch(model, ids[:1], tok.eot, tok.mask, B=B, tau=TAU, max_new_tokens=2, n_vocab=tok.n_vocab)
    done = engine.generate_batch(model, ids, tok.eot, tok.mask, B=B, tau=TAU, n_vocab=tok.n_vocab)
    tokens, forwards, seconds = sum(len(r.tokens) for r in done), sum(r.forwards for r in done), done[0].seconds
    return {"prompts": len(ids), "tau": TAU if B > 1 else None, "B": B, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "tokens_per_forward": round(tokens / forwards, 3)}


def phase(name, argv, path, device):
    """One train.py command, its checkpoint's figures and its decoding; and the checkpoint's model config."""
    peak_memory(device, reset=True)
    seconds = run_train(argv)
    peak = peak_memory(device)  # training's: before the checkpoint loads again
    ckpt = load_checkpoint(path, device)
    cfg, steps = ckpt["train_config"], ckpt["iter"]
    model, tok = model_from_checkpoint(ckpt, device)
    B = ckpt["mars"]["B"] if "mars" in ckpt else 1
    splits = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])
    rows = data.tokenize(splits["train"], tok, cfg["max_seq_len"], B)
    loop = ckpt["history"][-1]["elapsed_s"]
    prompts = [e["prompt"] for e in (splits["test"] + splits["val"] + splits["train"])[:N_PROMPTS]]
    result = {"phase": name, "command": shlex.join(["python", "train.py", *argv]), "precision": cfg["precision"],
              "steps": steps, "batch_size": cfg["batch_size"], "seconds": round(seconds, 2),
              "loop_seconds": loop, "steps_per_s": round(steps / loop, 3),
              "tokens_per_s": round(steps * cfg["batch_size"] * sum(len(ids) for ids, _ in rows) / len(rows) / loop),
              "peak_memory_gib": peak}
    with torch.inference_mode():
        result["decode"] = decoded(model.eval(), tok, prompts, B, device)
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result, ckpt["model_config"]


def toy_data_jsonl(path):
    """REAL_ROWS of the toy's training examples as {prompt, response} lines: SmolLM2's handful of rows."""
    with open(path, "w", encoding="utf-8") as f:
        for e in data.build_instruction_set(0, n_train=REAL_ROWS, n_val=0, n_test=0)["train"]:
            f.write(json.dumps({"prompt": e["prompt"], "response": e["response"]}) + "\n")
    return path


def measure(args, tmp):
    """The phases, in order: (their results, SmolLM2's model config or None)."""
    shared = ["--device", args.device, "--eval_every", str(args.steps), "--save_every", str(args.steps),
              "--summary_limit", "0"]
    toy = ["--preset", args.preset, "--n_train", str(args.n_train), "--out_dir", os.path.join(tmp, "toy"), *shared]
    ar = os.path.join(tmp, "toy", "ar.pt")
    phases = [phase("toy ar", ["--stage", "ar", "--ar_iters", str(args.steps), *toy], ar, args.device)[0],
              phase("toy mars", ["--stage", "mars", "--init_from", ar, "--mars_iters", str(args.steps), *toy],
                    os.path.join(tmp, "toy", "mars.pt"), args.device)[0]]
    if args.skip_real:
        return phases, None
    rows = args.data or toy_data_jsonl(os.path.join(tmp, "rows.jsonl"))
    real, real_config = phase("smollm2 mars", ["--stage", "mars", "--init_from", "smollm2", "--data", rows,
                                               "--mars_iters", str(args.steps), "--out_dir",
                                               os.path.join(tmp, "smollm2"), *shared],
                              os.path.join(tmp, "smollm2", "mars.pt"), args.device)
    return phases + [real], real_config


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
    p = config.PRESETS[preset]
    cfg = {"vocab_size": p["vocab_size"], **{k: p[k] for k in config.MODEL_KEYS}}
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
    epochs, the hf preset's schedule on them (config.hf_schedule); 2T tokens per row, the clean and noisy
    streams concatenated (an upper bound: mars_loss leaves out the noisy prompt blocks nothing reads)."""
    with open(DOCS / "distill_smollm2_cpu.json") as f:
        rows = json.load(f)["train"]
    hf = config.PRESETS["hf"]
    batch, steps, lr, why = config.hf_schedule(rows["n"], hf["epochs"], {}, hf["micro_batch"])
    return {"name": "SmolLM2-135M-Instruct, MARS stage", "parameters": parameters(model_config),
            "stages": [{"stage": "mars", "steps": steps, "batch_size": batch, "lr": lr, "schedule": why,
                        "rows": rows["n"], "tokens_per_sequence": 2 * rows["mean_row_tokens"],
                        "tokens_per_step": round(batch * 2 * rows["mean_row_tokens"])}],
            "source": "docs/distill_smollm2_cpu.json (rows and their mean tokens)"}


def estimated(args, real_config):
    """The estimate section: its assumptions and the recipes' FLOPs and GPU hours."""
    recipes = [toy_recipe("gpu")]
    if not args.skip_real:
        real_config = real_config or load_checkpoint("smollm2")["model_config"]
        recipes.append(real_recipe(real_config))
    return {"what": "an estimate from FLOPs, not a measurement",
            "assumptions": {"flops_per_token": "6 N: forward and backward, N every parameter (tied embeddings "
                            "once: the output layer's matmul); attention's own FLOPs and the optimizer left out",
                            "utilization": UTILIZATION,
                            "peak_tflops": GPUS, "T4": "this project trains a T4 in float32 (no native bf16; fp16 "
                            "needs loss scaling, which it does not do): its fp16 row is for comparison"},
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
    phases, real_config = None, None
    if not args.estimate_only:
        with tempfile.TemporaryDirectory() as tmp:
            phases, real_config = measure(args, tmp)
    result = {"command": command, "machine": machine(), "device": args.device, "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(args.device) if cuda else "CPU",
              "phases": phases, "fields": FIELDS, "estimate": estimated(args, real_config)}
    if args.estimate_only:
        result["unmeasured"] = "--estimate_only: nothing was run"
    elif not cuda:
        result["peak_memory_note"] = "null on a CPU: torch.cuda.max_memory_allocated counts CUDA memory only"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(table(result["estimate"]) + f"\n\nwrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
