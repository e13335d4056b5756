"""The root's one door into extras/: what checkpoint.foreign() returns, for a checkpoint that is not one of ours.

checkpoint.py reads a Hugging Face directory or a GGUF file (or an installed one's short name) through
read_checkpoint, asks names_model whether a path is such a model, rebuilds a tokenizer whose chat
template is a model's own (tokenizer_from_state: jinja2), and train.py starts a stage from a real
model with start_real_stage and trains on the base model's distribution with Teacher (--targets soft).
Nothing here imports checkpoint: it imports this module, inside checkpoint.foreign() only.
"""
from extras.checkpoints import gguf_file, hf
from extras.checkpoints.hf_tokenizer import tokenizer_from_state
from extras.checkpoints.hf_train import names_model, start_real_stage
from extras.real.teacher import Teacher

__all__ = ["Teacher", "names_model", "read_checkpoint", "start_real_stage", "tokenizer_from_state"]


def read_checkpoint(path, device="cpu", dtype=None):
    """A real model as a checkpoint dict of this project (weights in dtype, default float32), or ValueError,
    OSError or KeyError saying what is wrong (a short name not installed: how to install it)."""
    file = gguf_file.named_file(path)
    return gguf_file.read_checkpoint(file, device, dtype) if file else hf.read_checkpoint(path, device, dtype)
