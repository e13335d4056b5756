"""Foreign checkpoints: Hugging Face directories and GGUF files in and out, their tokenizers and
chat templates, and foreign.load, which reads any checkpoint into the root's objects for the
tools of extras/. Built on the root's model, tokenizer and common; the root imports none of it.
"""
