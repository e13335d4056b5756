"""The precision training runs in: train.py --precision auto, through its seam train.measured_precision. On a
CPU with native bf16 (an AVX512-BF16 EPYC), bf16 autocast made a training step 2.2-2.7x faster; where the CPU
lacks it (e.g. AVX2 only) it is 10-30x slower, so auto times both on the model's shapes at start (choose_dtype)
rather than assume. A GPU is not timed (on the H200 a probe's short runs gave bf16 0.82x and 0.62x float32's
speed, timing launches: docs/gpu.md): bf16 where it is native, else float32.
"""
import math
import time

import torch
import torch.distributed as dist

PROBE_SECONDS = 2.0  # what the precision probe may spend timing runs
BF16_MARGIN = 0.9  # bf16 autocast only where it takes at most 90% of float32's time: noise alone never tips it


def step_timer(model, seq_len, device, autocast):
    """time_run(rows, bf16): seconds of one forward and backward of the model itself, as a training step runs
    it, on `rows` tokens in sequences of up to seq_len, in float32 or under bf16 autocast. The whole step, not
    one matmul: the gain of bf16 on a matmul can be far larger than on a step (norms, attention, softmax and
    the optimizer stay in float32). autocast: train.autocast. The gradients it leaves are dropped; no weight changes."""
    device = torch.device(device)  # zeros as tokens: the values do not change the speed, nor the seeded RNG
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None  # time the work, not its launch

    def time_run(rows, bf16):
        x = torch.zeros(max(1, rows // seq_len), min(rows, seq_len), dtype=torch.long, device=device)
        sync()
        t = time.perf_counter()
        with autocast(device, "bfloat16" if bf16 else "float32", seq_len):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        sync()
        seconds = time.perf_counter() - t
        model.zero_grad(set_to_none=True)
        return seconds
    return time_run


def probe(time_run, tokens, budget=PROBE_SECONDS):
    """(float32 seconds, bf16 seconds, rows): each precision's time for a step's `tokens` tokens, predicted as a
    fixed part plus a cost per token from the best of up to 5 alternating rounds of runs on 1 and on `rows`
    tokens, until the runs have taken `budget` seconds. The fixed part (the gradient of every weight, whatever
    the tokens) dominates a big model's short runs and would hide the precisions' difference, which a step of
    many tokens shows. Runs on 1 and 16 tokens warm up and size the rest: `rows` makes the slower precision's
    cost per token a tenth of the budget."""
    warm = [[min(time_run(n, bf16) for _ in range(2)) for n in (1, 16)] for bf16 in (False, True)]
    per_token = max(max(t16 - t1, 1e-9) / 15 for t1, t16 in warm)
    rows = max(16, min(tokens, int(budget / 10 / per_token)))
    best, spent = {}, 0.0
    for _ in range(5):
        for bf16 in (False, True):
            for n in (1, rows):
                t = time_run(n, bf16)
                best[n, bf16], spent = min(best.get((n, bf16), math.inf), t), spent + t
        if spent > budget:
            break

    def predicted(bf16):
        one, many = best[1, bf16], best[rows, bf16]
        return one + max(many - one, 0.0) * (tokens - 1) / (rows - 1)
    return predicted(False), predicted(True), rows


def decide(float32_s, bfloat16_s):
    """bf16 autocast where it takes at most BF16_MARGIN of float32's time."""
    return "bfloat16" if bfloat16_s <= BF16_MARGIN * float32_s else "float32"


def without_bf16(gpu):
    """The precision record of a GPU without native bf16 (e.g. the T4 of free notebook services): float32, not
    probed. Its fast precision is fp16, whose small gradients underflow unless the loss is scaled, and this
    project does not scale the loss."""
    return {"dtype": "float32", "device": gpu, "reason": f"{gpu} has no native bf16 (not probed), and fp16 would "
            "need loss scaling, which this project does not do"}


def with_bf16(gpu):
    """The precision record of a GPU with native bf16: bf16 autocast, not probed. There it is the known answer (its
    tensor cores run bf16 at twice tf32's rate), and a probe's short runs time kernel launches and whatever else the
    GPU runs rather than the precisions: runs started together on one GPU chose differently (docs/gpu.md)."""
    return {"dtype": "bfloat16", "device": gpu, "reason": f"{gpu} has native bf16 (not probed: on a GPU with native "
            "bf16 it is the known answer, and a probe there times launches and other processes)"}


def choose_dtype(cfg, model, world, autocast=None):
    """--precision auto: on a CPU, predicts both precisions' time for a forward and backward of the model on a step's
    tokens (probe, on one thread) and trains in bf16 autocast only where it is clearly faster; a GPU trains in bf16
    autocast where it has native bf16 (with_bf16), else in float32 (without_bf16), unprobed. Returns the record the
    config keeps (precision_why): the dtype, why, and the timings."""
    if cfg.device.startswith("cuda"):  # emulation counts as support by default: a T4 emulates bf16, slower
        native, gpu = torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_name(cfg.device)
        return with_bf16(gpu) if native else without_bf16(gpu)
    tokens = (cfg.micro_batch or cfg.batch_size // world) * cfg.max_seq_len
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the precisions differ per core; a second thread may wait on a core others hold
    times = torch.tensor(probe(step_timer(model, cfg.max_seq_len, cfg.device, autocast), tokens), device=cfg.device)
    torch.set_num_threads(threads)
    if dist.is_initialized():  # every process trains in rank 0's choice
        dist.broadcast(times, 0)
    fp32, bf16, rows = times.tolist()
    where = f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    reason = (f"bf16 autocast takes {bf16 / fp32:.2f}x float32's time ({1e3 * bf16:.2f} against {1e3 * fp32:.2f} ms "
              f"for a forward and backward of the model on a step's {tokens} tokens, predicted from runs on 1 and "
              f"{int(rows)}, {where}); bf16 needs {BF16_MARGIN}x or less")
    return {"dtype": decide(fp32, bf16), "reason": reason, "float32_ms": round(1e3 * fp32, 3),
            "bfloat16_ms": round(1e3 * bf16, 3), "tokens": tokens, "rows": int(rows), "device": where}
