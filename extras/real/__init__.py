"""The real-model run: self-distillation of a base model's own answers, their evaluation with checkers and a
control, checkpoint snapshots. May import the root (the engine, checkpoint's loader) and bench.
"""
