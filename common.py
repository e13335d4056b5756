"""What every command line shares: one-line errors (UserError, run_cli, Parser), a
read-only Config and flags made from a table of presets, the --device flag, training's
precision there, tau, and our checkpoints: written atomically, loaded as a GPT and the
toy's tokenizer. A checkpoint is a dict of plain types that loads with weights_only=True:
weights, model config, tokenizer, the training config and what resumes a stage.
A real model (a Hugging Face directory, a GGUF file) is read by extras/checkpoints/foreign.py.
"""
import argparse
import contextlib
import os
import sys
from types import SimpleNamespace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import tokenizer
from model import GPT, GPTConfig


class UserError(Exception):
    """A problem the user can fix: reported as one line, exit code 1 (run_cli)."""


def run_cli(main):
    """Run a command-line main: a user's mistake becomes one line on stderr and exit 1,
    Ctrl-C one line and exit 130."""
    try:
        main()
    except BrokenPipeError:  # the reader left (e.g. `| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (UserError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # one line, with what was kept where a command says (its args)
        print(f"\ninterrupted{': ' + str(e) if e.args else ''}", file=sys.stderr)
        sys.exit(130)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, for every CLI of the project."""

    def __init__(self, doc):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


class Config(SimpleNamespace):
    """Settings, read-only: replace(**changes) makes a changed copy."""

    def __setattr__(self, name, value):
        raise AttributeError(f"the config is read-only ({name}): use replace")

    def replace(self, **changes):
        return Config(**{**vars(self), **changes})


def listed(kind):
    """An argparse type: comma-separated values of kind."""
    def parse(text):
        return [kind(v) for v in text.split(",")]
    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse's errors name it
    return parse


def as_typed(value):
    """A table's value as its flag is typed: a list comma-separated, a dict as key:value pairs."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{v:g}" for k, v in value.items())
    return ",".join(map(str, value)) if isinstance(value, list) else value


def add_table(group, rows, help, types, choices):
    """A --key flag for each key of rows ({name: {key: value}}), typed as the first row's
    value (a list's comma-separated) or by types; its help shows each row's value."""
    for key in dict.fromkeys(k for row in rows.values() for k in row):
        values = [row.get(key) for row in rows.values()]
        first = values[0]
        kind = listed(type(first[0])) if isinstance(first, list) else type(first)
        values = [as_typed(v) for v in values]
        shown = ", ".join(f"{name} {v}" for name, v in zip(rows, values))
        if len(set(values)) == 1:
            shown = f"default {values[0]}"
        group.add_argument(f"--{key}", type=types.get(key, kind),
                           choices=choices.get(key), help=f"{help.get(key, '')} ({shown})")


def threshold(text):
    """tau, as a command line or a chat command gives it."""
    try:
        tau = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    # decoding compares in float32
    if not 0 < tau <= 1 or torch.tensor(tau, dtype=torch.float32) == 0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (and above 0 in float32), got {tau}")
    return tau


def default_device():
    """cuda where torch finds a GPU, else cpu: every tool's --device when the flag is not given."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(parser):
    """The --device flag of every command line that loads a model."""
    parser.add_argument("--device", default=default_device(),
                        help="cpu, cuda, cuda:1, ... (default cuda where a GPU is present, else cpu)")


def check_device(device):
    """UserError unless torch can place tensors on this device here (e.g. cuda without a GPU)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError):
        raise UserError(f"device {device!r} is not available on this machine") from None


def precision_rule(device):
    """(dtype, why) of training on device: bf16 where the hardware has it natively, by a
    rule (python -m extras.bench.precision times both). A CPU needs both checks: AVX512
    CPUs may lack bf16, and the bf16 check ignores ATEN_CPU_CAPABILITY=avx2."""
    if device.startswith("cuda"):  # a T4 emulates bf16, which torch counts by default
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        why = f"{torch.cuda.get_device_name(device)} has {'' if native else 'no '}native bf16"
        return ("bfloat16" if native else "float32"), why
    cap = torch.backends.cpu.get_cpu_capability()
    if device == "cpu" and cap == "AVX512" and (torch.cpu._is_avx512_bf16_supported()
                                                or torch.cpu._is_amx_tile_supported()):
        return "bfloat16", f"CPU capability {cap} with native bf16"
    return "float32", f"no native bf16 on {device} (CPU capability {cap})"


def autocast(device, dtype, max_seq_len):
    """bf16 autocast unless float32. On a CPU, bf16 attention over at most 128 positions
    takes the math path: the flash kernel's backward was 17-30% slower there."""
    device, stack = torch.device(device).type, contextlib.ExitStack()
    if dtype != "float32":
        stack.enter_context(torch.autocast(device, getattr(torch, dtype)))
        if device == "cpu" and 2 * max_seq_len <= 128:  # [noisy | clean] positions
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


def save(ckpt, path):
    """Atomic: a temp file, then a rename, so an interrupted save never leaves half a checkpoint."""
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, device="cpu"):
    """One of our .pt checkpoints, or UserError with a one-line reason. Read with
    weights_only=True: a file that pickles anything but tensors and plain types is refused."""
    check_device(device)
    path = str(path)
    real = f"python -m extras.engine --ckpt {path} or python -m extras.real.train --init_from {path}"
    if os.path.isdir(path) or path.endswith(".gguf"):
        raise UserError(f"{path} is a real model, not a checkpoint of ours: read it with {real}")
    if not os.path.isfile(path):
        short = "" if path.endswith(".pt") else f"; a real model's short name (smollm2): {real}"
        raise UserError(f"checkpoint not found: {path} (train one with: python train.py{short})")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
        assert isinstance(ckpt, dict) and {"model", "model_config", "tokenizer"} <= ckpt.keys()
        return ckpt
    except Exception:
        raise UserError(f"not a readable checkpoint of this project: {path}") from None


def build_model(ckpt, device="cpu", dtype=None):
    """The checkpoint's GPT: built on the meta device (a 7B model is never initialised at
    random first), given the checkpoint's tensors, then moved to device and dtype."""
    try:
        with torch.device("meta"):
            model = GPT(GPTConfig(**ckpt["model_config"]))
        # checkpoints written before the layer list was named GPT.layers call it "blocks"
        state = {k.replace("blocks.", "layers.", 1): v for k, v in ckpt["model"].items()}
        model.load_state_dict(state, assign=True)
    except (TypeError, RuntimeError) as e:  # a config field, weight name or shape GPT lacks
        what = " ".join(str(e).split())[:200] or type(e).__name__  # one line: what does not fit
        raise UserError(f"this checkpoint does not fit this version's GPT ({what}): "
                        "retrain it with python train.py") from None
    if model.config.tie_embeddings:  # assign replaced the shared parameter by two
        model.lm_head.weight = model.wte.weight
    return model.to(device=device, dtype=dtype)


def model_from_checkpoint(ckpt, device="cpu", dtype=None):
    """(model, tokenizer) of a checkpoint in the toy's chat format."""
    try:
        tok = tokenizer.Tokenizer.from_state(ckpt["tokenizer"])
    except ValueError as e:  # a real model's tokenizer, which extras/ read
        raise UserError(str(e)) from None
    return build_model(ckpt, device, dtype), tok
