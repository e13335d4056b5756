"""The batched engine and its command (python -m extras.engine): ragged rows, the three caches,
lossless decoding, a tau per request, rows joining and leaving (engine.py), its static cache and
CUDA graphs, and the step-cost model behind masks="auto" (cost.py). May import the root, no
other room; its command (__main__.py) also imports extras.checkpoints (real models) and
extras.real.records (their records and checker).
"""
