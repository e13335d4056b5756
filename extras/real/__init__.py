"""The real-model run: self-distillation of a base model's own answers, their evaluation with checkers and a
control, checkpoint snapshots; train.py's options beyond the paper (options.py, its hook
train.beyond_the_paper) and soft targets (teacher.py). May import the root (common's loader), the engine
and bench; chunked_ce.py is the real-model loss in chunks that training's hook calls.
"""
