"""Foreign checkpoints: Hugging Face directories and GGUF files in and out, their tokenizers and chat
templates, and the start of a training stage from a real model. May import the root's model, tokenizer and
data, and extras.real.teacher (foreign.py hands train.py its Teacher), never checkpoint (it imports foreign.py, the root's one seam), except export.py, a command line it never imports.
"""
