"""What every command line shares: one-line errors (UserError, run_cli, Parser), the --device flag and tau,
and checkpoints: writing ours atomically, and loading ours or a real model's through foreign(), the root's seam
to extras/checkpoints. Every checkpoint is a dict of plain types that loads with weights_only=True: weights,
model config, tokenizer, and for ours the training config and what resumes a stage."""
import argparse
import os
import sys

import torch

import tokenizer
from model import GPT, GPTConfig


class UserError(Exception):
    """A problem the user can fix: reported as one line, exit code 1 (run_cli)."""


def run_cli(main):
    """Run a command-line main: a user's mistake becomes one line on stderr and exit 1, Ctrl-C one line and
    exit 130."""
    try:
        main()
    except BrokenPipeError:  # the reader left (e.g. `| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (UserError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C: one line, with what was kept where a command says (its args)
        print(f"\ninterrupted{': ' + str(e) if e.args else ''}", file=sys.stderr)
        sys.exit(130)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, for every CLI of the project."""

    def __init__(self, doc):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def threshold(text):
    """tau, as a command line or a chat command gives it."""
    try:
        tau = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < tau <= 1 or torch.tensor(tau, dtype=torch.float32) == 0:  # decoding compares in float32
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (and above 0 in float32), got {tau}")
    return tau


def default_device():
    """cuda where torch finds a GPU, else cpu: what every tool's --device is when the flag is not given."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(parser):
    """The --device flag of every command line that loads a model; load_checkpoint checks it."""
    parser.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:1, ... (default cuda where a "
                        "GPU is present, else cpu)")


def check_device(device):
    """UserError unless torch can place tensors on this device here (e.g. cuda without a GPU)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError):
        raise UserError(f"device {device!r} is not available on this machine") from None


def foreign():
    """The one seam between the root and extras/: extras/checkpoints/foreign.py, imported here and nowhere else
    in the root, only when a path or a chat template is not the toy's (names_foreign), so the method imports
    without jinja2, safetensors or gguf; where they are missing, that is one line."""
    try:
        from extras.checkpoints import foreign as seam
    except ModuleNotFoundError as e:
        raise UserError(f"a real model needs {e.name}: pip install -r requirements.txt") from None
    return seam


def names_foreign(path):
    """Whether a path names a real model rather than one of our .pt files: a directory, a GGUF file, or a
    missing path not ending in .pt that an installed GGUF file's short name may match (e.g. smollm2)."""
    path = str(path)
    maybe = os.path.isdir(path) or path.endswith(".gguf") or not (os.path.exists(path) or path.endswith(".pt"))
    return maybe and foreign().names_model(path)


def starts_from_hf(path):
    """Whether a run starts from a real model: one named by path (names_foreign), or our checkpoint trained from
    one (it carries "hf"; read with mmap, so its tensors stay on disk). A missing or unreadable .pt file is
    reported when the stage loads it."""
    if path is None or names_foreign(path):
        return path is not None
    try:
        return "hf" in torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return False


def save(ckpt, path):
    """Atomic: a temp file, then a rename, so an interrupted save never leaves half a checkpoint."""
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, device="cpu", dtype=None):
    """The checkpoint dict, or UserError with a one-line reason. `path` is one of our .pt files, or a real
    model read through foreign(): a Hugging Face model directory, a GGUF file or an installed one's short
    name, e.g. smollm2 (weights in dtype, default float32)."""
    check_device(device)
    path = str(path)
    if names_foreign(path):
        try:
            return foreign().read_checkpoint(path, device, dtype)
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"{path}: {e}") from None
    if not os.path.isfile(path):
        raise UserError(f"checkpoint not found: {path} (train one with: python train.py)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
        assert isinstance(ckpt, dict) and {"model", "model_config", "tokenizer"} <= ckpt.keys()
        return ckpt
    except Exception:
        raise UserError(f"not a readable checkpoint of this project: {path}") from None


def tokenizer_from_state(state):
    """A checkpoint's tokenizer; a chat template other than the toy's (a real model's Jinja template) gets its
    renderer through foreign()."""
    if state.get("chat_template", tokenizer.TOY_TEMPLATE) == tokenizer.TOY_TEMPLATE:
        return tokenizer.Tokenizer.from_state(state)
    return foreign().tokenizer_from_state(state)


def model_from_checkpoint(ckpt, device="cpu", dtype=None):
    """(model, tokenizer). The model takes the checkpoint's tensors (built on the meta device, so a
    7B model is never initialised at random first), then moves to device and dtype."""
    try:
        with torch.device("meta"):
            model = GPT(GPTConfig(**ckpt["model_config"]))
        # checkpoints written before the layer list was named GPT.layers call it "blocks": the same weights
        model.load_state_dict({k.replace("blocks.", "layers.", 1): v for k, v in ckpt["model"].items()}, assign=True)
    except (TypeError, RuntimeError) as e:  # a config field or a weight's name or shape this GPT does not have
        what = " ".join(str(e).split())[:200] or type(e).__name__  # one line: what does not fit
        raise UserError(f"this checkpoint does not fit this version's GPT ({what}): retrain it with python train.py") \
            from None
    if model.config.tie_embeddings:  # assign replaced the shared parameter by two
        model.lm_head.weight = model.wte.weight
    return model.to(device=device, dtype=dtype), tokenizer_from_state(ckpt["tokenizer"])
