"""Peak memory of one MARS training step of a model shaped exactly like Qwen2.5-0.5B-Instruct.

    python -m extras.bench.memory          # minutes, ~9 GB of RAM -> docs/memory_qwen2.5-0.5b.json
    python -m extras.bench.memory --compare_ce   # float32, the loss's logits in chunks against all at once
                                                 # -> docs/memory_ce_qwen2.5-0.5b.json

Random weights built from the configuration alone (nothing is downloaded): hidden 896, 24
layers, 14 query heads and 2 key/value heads of 64, SwiGLU width 4864, vocabulary 151,936 rows,
tied embeddings, q/k/v biases, rope_theta 1e6, RMSNorm eps 1e-6. One step as
python -m extras.real.train takes it: mars.mars_loss on one sequence of 512 tokens (a 32-token
prompt, the rest response, so 2 x 480 logit rows) with the loss's logits in chunks
(extras/real/chunked_ce.py), backward, the gradient clip, AdamW (fused, as train.py). Two
precisions, each in a fresh process so that each peak is its own: float32, and bfloat16 as
--precision bfloat16 runs it (float32 weights, gradients and AdamW states; forward and backward
under train.autocast: bf16 autocast, flash attention at this length). Memory is the process's
resident set (getrusage's peak and /proc's current VmRSS), on this CPU: torch has no allocator
statistics for the CPU.
"""
import json
import os
import platform
import resource
import subprocess
import sys
import time

from common import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
OUT = os.path.join(ROOT, "docs", "memory_qwen2.5-0.5b.json")
QWEN25_05B = dict(vocab_size=151936, max_seq_len=32768, n_layer=24, n_head=14, n_kv_head=2, n_embd=896, head_dim=64,
                  intermediate_size=4864, rope_base=1e6, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True)
T, PROMPT, B = 512, 32, 4
LIMIT_S = 300  # per precision


def gib(kib):
    return round(kib / 2**20, 3)


def rss():
    """(current, peak) resident set in KiB."""
    with open("/proc/self/status") as f:
        current = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def one_step(dtype, ce="chunked"):
    sys.path.insert(0, ROOT)
    import torch

    import train
    import mars
    from extras.real import chunked_ce
    from model import GPT, GPTConfig
    if ce == "whole":  # every logit of the loss at once: what the chunks save
        chunked_ce.CE_CHUNK = 2**62
    torch.manual_seed(0)
    marks = {"imports": rss()}
    model = chunked_ce.chunked(GPT(GPTConfig(**QWEN25_05B)))  # as extras.real.train's
    n_params = sum(p.numel() for p in model.parameters())
    marks["weights"] = rss()
    x = torch.randint(0, 151665, (1, T))
    y = torch.full((1, T), -1)
    y[0, PROMPT - 1:] = torch.randint(0, 151665, (T - PROMPT + 1,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-6, betas=(0.9, 0.999), weight_decay=0.0, fused=True)
    t0 = time.time()
    with train.autocast("cpu", dtype, T):
        loss, _, _ = mars.mars_loss(model, x, y, mask_id=151665, B=B)
    marks["forward"] = rss()
    loss.backward()
    marks["backward"] = rss()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks["optimizer_step"] = rss()
    return {"dtype": dtype, "ce": ce, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "ce_chunk": chunked_ce.CE_CHUNK, "n_params": n_params, "loss": loss.item(),
            "seconds": round(time.time() - t0, 1),
            "threads": torch.get_num_threads(), "logit_rows": 2 * int((y != -1).sum()),
            "rss_gib": {k: {"current": gib(c), "peak": gib(p)} for k, (c, p) in marks.items()}}


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("--one", choices=["float32", "bfloat16"], help="internal: measure one precision in this process "
                                                                  "and print its JSON line")
    p.add_argument("--ce", choices=["chunked", "whole"], default="chunked", help="internal, with --one: the loss's "
                   "logits in chunks (extras/real/chunked_ce.py, as extras.real.train runs) or all at once")
    p.add_argument("--compare_ce", action="store_true", help="float32 only, chunked against whole: the memory the "
                   "chunked cross-entropy saves (-> docs/memory_ce_qwen2.5-0.5b.json)")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_step(args.one, args.ce)))
        return
    runs = []
    settings = [("float32", "chunked"), ("float32", "whole")] if args.compare_ce else [("float32", "chunked"),
                                                                                       ("bfloat16", "chunked")]
    for dtype, ce in settings:
        try:
            proc = subprocess.run([sys.executable, "-m", "extras.bench.memory", "--one", dtype, "--ce", ce],
                                  capture_output=True, text=True, check=True, timeout=LIMIT_S)
            runs.append(json.loads(proc.stdout.splitlines()[-1]))
        except subprocess.TimeoutExpired:  # a CPU without bf16 matrix instructions emulates them, slowly
            runs.append({"dtype": dtype, "not_measured": f"one step did not finish in {LIMIT_S} s on this CPU"})
        print(json.dumps(runs[-1]), flush=True)
    n = runs[0]["n_params"]
    rows = runs[0]["logit_rows"]
    result = {
        "what": __doc__.strip().splitlines()[0], "config": QWEN25_05B, "tokens": T, "prompt_tokens": PROMPT,
        "micro_batch": 1, "B": B, "runs": runs,
        "arithmetic_gib": {  # what the numbers above are made of, and what they mean for one GPU
            "weights_fp32": round(4 * n / 2**30, 2), "grads_fp32": round(4 * n / 2**30, 2),
            "adamw_states_fp32": round(8 * n / 2**30, 2), "weights_grads_adamw": round(16 * n / 2**30, 2),
            "logits_fp32_one_copy": round(rows * QWEN25_05B["vocab_size"] * 4 / 2**30, 2),
            "qwen2.5_7b_weights_grads_adamw": round(16 * 7.62e9 / 2**30, 1)},
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Linux RSS",
        "cpu_model": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                          None),
        "cpu_capability": runs[0].get("cpu_capability"),
    }
    out = OUT.replace("memory_", "memory_ce_") if args.compare_ce else OUT
    result["command"] = "python -m extras.bench.memory" + (" --compare_ce" if args.compare_ce else "")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
