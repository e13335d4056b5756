"""The root's one door into extras/: what common.foreign() returns, for a checkpoint that is not one of ours.

common.py reads a Hugging Face directory or a GGUF file (or an installed one's short name) through
read_checkpoint, asks names_model whether a path is such a model, and rebuilds a tokenizer whose chat
template is a model's own (tokenizer_from_state: jinja2). common.py imports this module, inside
common.foreign() only.
"""
import os

from extras.checkpoints import gguf_file, hf
from extras.checkpoints.gguf_file import SHORT_NAMES
from extras.checkpoints.hf_tokenizer import tokenizer_from_state

__all__ = ["names_model", "read_checkpoint", "tokenizer_from_state"]


def read_checkpoint(path, device="cpu", dtype=None):
    """A real model as a checkpoint dict of this project (weights in dtype, default float32), or ValueError,
    OSError or KeyError saying what is wrong (a short name not installed: how to install it)."""
    file = gguf_file.named_file(path)
    return gguf_file.read_checkpoint(file, device, dtype) if file else hf.read_checkpoint(path, device, dtype)


def names_model(path):
    """Whether a path names a real model itself (a Hugging Face directory, a GGUF file, or an installed GGUF
    file's short name, e.g. smollm2, where no file or directory has that name), not one of our checkpoints."""
    return os.path.isdir(path) or path.endswith(".gguf") or path in SHORT_NAMES and not os.path.exists(path)
