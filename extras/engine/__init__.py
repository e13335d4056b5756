"""The batched engine: ragged rows, the three caches, lossless decoding, a tau per request, rows joining and
leaving (engine.py), its static cache and CUDA graphs, and the step-cost model behind masks="auto" (cost.py).
May import the root (model, mars, data), never another room.
"""
