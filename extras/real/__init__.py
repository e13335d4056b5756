"""The real-model run: self-distillation of a base model's own answers, their evaluation with checkers and a
control, checkpoint snapshots. May import the root (checkpoint's loader), the engine and bench; chunked_ce.py is the real-model
loss in chunks that training's hook calls.
"""
