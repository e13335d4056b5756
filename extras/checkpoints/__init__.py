"""Foreign checkpoints: Hugging Face directories and GGUF files in and out, their tokenizers and chat
templates, and the start of a training stage from a real model with the hf preset and its schedule
(hf_train.py, train.py's seam train.real_model). May import the root's model, tokenizer, data and common.
"""
