"""Training beyond the paper and the real-model run: python -m extras.real.train (train.py's loop
with a Stage subclass: real models, the hf preset, the ablations in options.py, soft targets in
teacher.py, the chunked loss in chunked_ce.py), self-distillation of a base model's own answers,
their evaluation with checkers and a control, checkpoint snapshots. May import the root, the engine,
bench and checkpoints.
"""
