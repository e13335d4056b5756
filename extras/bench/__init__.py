"""Measurement: the paper's tables in miniature (eval.py, report.py), statistics (stats.py), the masks and
training-step benchmarks, memory. May import the root (the engine, sample, train, cli's checkpoints), not
another room.
"""
