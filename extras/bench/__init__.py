"""Measurement: the paper's tables in miniature (eval.py, report.py), statistics (stats.py), the masks and
training-step benchmarks, memory, the one-GPU check and its estimate (gpu_check.py), the precision probe
(precision.py, train.py --precision auto). May import the root (sample, train, common.py), the engine
(extras/engine), the chunked loss (extras/real/chunked_ce.py) and extras/checkpoints (gpu_check: the hf preset's
schedule), no other room.
"""
