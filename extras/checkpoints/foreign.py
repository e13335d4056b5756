"""Any checkpoint as the root's objects: a Hugging Face directory, a GGUF file or an installed
one's short name (smollm2), or one of our .pt files, a real model's tokenizer included. The
root reads only the toy's .pt files (common.load_checkpoint); every extras/ tool that takes a
real model loads it here, into the same checkpoint dict, a GPT (common.build_model) and its
tokenizer (hf_tokenizer.tokenizer_from_state: the toy's Tokenizer or an HFTokenizer).
"""
import os

import common
from extras.checkpoints.hf_tokenizer import tokenizer_from_state
from extras.checkpoints.installed import SHORT_NAMES


def names_model(path):
    """Whether a path names a real model itself (a Hugging Face directory, a GGUF file, or an
    installed GGUF file's short name, e.g. smollm2, where no file or directory has that name),
    not one of our checkpoints."""
    path = str(path)
    short = path in SHORT_NAMES and not os.path.exists(path)
    return os.path.isdir(path) or path.endswith(".gguf") or short


def read_checkpoint(path, device="cpu", dtype=None):
    """The checkpoint dict of a real model (weights in dtype, default float32) or of our .pt
    file (as saved; build_model casts), or UserError with a one-line reason."""
    path = str(path)
    common.check_device(device)  # before any file: a device the machine lacks is the first error
    if not names_model(path):
        if not os.path.exists(path):
            raise common.UserError(f"checkpoint not found: {path} (our .pt file, a Hugging Face "
                                   f"directory, a .gguf file or {', '.join(SHORT_NAMES)})")
        return common.load_checkpoint(path, device)
    try:  # the formats' own libraries load for a real model only: the course's install has neither
        from extras.checkpoints import gguf_file, hf
    except ImportError as e:
        raise common.UserError(f"{path}: reading it needs {e.name}: pip install -r requirements.txt") from None
    try:
        file = gguf_file.named_file(path)
        if file:
            return gguf_file.read_checkpoint(file, device, dtype)
        return hf.read_checkpoint(path, device, dtype)
    except (ValueError, OSError, KeyError) as e:
        raise common.UserError(f"{path}: {e}") from None


def load(path, device="cpu", dtype=None):
    """(checkpoint, model, tokenizer) of any checkpoint read_checkpoint reads; the model on
    device, in dtype (default: as read)."""
    ckpt = read_checkpoint(path, device, dtype)
    return ckpt, common.build_model(ckpt, device, dtype), tokenizer_from_state(ckpt["tokenizer"])
