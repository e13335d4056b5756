"""The dtype a real model decodes in, chosen as train.py's --precision auto chooses training's (precision.py):
bf16 weights where the device runs the model's cached forward faster in them, float32 otherwise. On a CPU with
native bf16 (AVX512-BF16, AMX) SmolLM2-135M's forward of one token after a 20-token prompt took 18.5 ms in bf16
against 37.1 ms in float32, and a window of 4 tokens 1.06x one token in bf16 against 1.47x in float32 (issue 52);
a CPU without it runs bf16 many times slower. So it is timed, not assumed: a cached forward of 1 and of B + 1
tokens (a MARS window and one more) in both dtypes, bf16 where it takes at most precision.BF16_MARGIN of float32's
time. A GPU with native bf16 decodes in bf16 unprobed, as train.py trains there (train.precision_rule).
"""
import copy
import time

import torch

from extras.bench.precision import BF16_MARGIN

DTYPES = ("auto", "float32", "bfloat16")  # --decode_dtype
PROMPT = 20  # the cached prefix the timed windows follow
ROUNDS = 5  # the best of these per window: a short run's noise is one-sided


def window_seconds(models, widths, prompt=PROMPT, rounds=ROUNDS):
    """{name: {width: seconds}} for models {name: model}: the best of `rounds` cached forwards of a window of `width`
    tokens after a prompt of `prompt` tokens, at batch 1, the models and widths alternating within each round so
    that a slow spell of the machine hits all."""
    caches, best = {}, {name: {w: float("inf") for w in widths} for name in models}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = model.new_cache(1, prompt + max(widths))
            model(torch.zeros(1, prompt, dtype=torch.long, device=model.wte.weight.device), cache=caches[name])
        for _ in range(rounds):
            for name, model in models.items():
                device = model.wte.weight.device
                sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
                for w in widths:
                    caches[name].rollback([prompt])
                    sync()
                    t = time.perf_counter()
                    model(torch.zeros(1, w, dtype=torch.long, device=device), cache=caches[name])
                    sync()
                    best[name][w] = min(best[name][w], time.perf_counter() - t)
    return best


def in_both_dtypes(model):
    """{"float32": a copy of the model in float32, "bfloat16": one in bf16} (the model itself unchanged)."""
    return {name: copy.deepcopy(model).to(getattr(torch, name)) for name in ("float32", "bfloat16")}


def choose(model, B, choice="auto"):
    """(dtype name, record): --decode_dtype's choice for the model, measured under "auto" (the model is left in its
    own dtype; the record says which dtype and why, with the seconds measured)."""
    device = model.wte.weight.device
    if choice != "auto":
        return choice, {"dtype": choice, "reason": "--decode_dtype " + choice}
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return ("bfloat16" if native else "float32"), {
            "dtype": "bfloat16" if native else "float32",
            "reason": f"{torch.cuda.get_device_name(device)} {'has' if native else 'lacks'} native bf16 (not probed)"}
    widths = (1, B + 1)
    seconds = window_seconds(in_both_dtypes(model), widths)
    cost = {name: sum(s.values()) for name, s in seconds.items()}
    dtype = "bfloat16" if cost["bfloat16"] <= BF16_MARGIN * cost["float32"] else "float32"
    shown = ", ".join(f"{name} {1e3 * s[1]:.1f} ms and {1e3 * s[B + 1]:.1f} ms" for name, s in seconds.items())
    return dtype, {"dtype": dtype, "reason": f"measured on {device.type}: cached forwards of 1 and {B + 1} tokens "
                   f"took {shown}; bf16 where it takes at most {BF16_MARGIN} of float32's time",
                   "seconds": {name: {str(w): round(t, 5) for w, t in s.items()} for name, s in seconds.items()}}


def cast(models, dtype):
    """The models in the chosen dtype (their floating weights and buffers: the model's own .to)."""
    return [m.to(getattr(torch, dtype)) for m in models]
