"""Measurement: the paper's tables in miniature (eval.py, report.py), statistics (stats.py), the masks and
training-step benchmarks, memory, the one-GPU check and its estimate (gpu_check.py). May import the root (sample, train,
checkpoint.py), the engine (extras/engine) and the chunked loss (extras/real/chunked_ce.py), no other room.
"""
