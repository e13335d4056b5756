"""Measurement: the paper's tables in miniature (eval.py, report.py), statistics (stats.py), the masks and
training-step benchmarks, memory, the one-GPU check and its estimate (gpu_check.py). May import the root (the
engine, sample, train, checkpoint.py), not another room.
"""
