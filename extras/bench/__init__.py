"""Measurement: the paper's tables in miniature (eval.py, report.py), statistics (stats.py), the masks and
training-step benchmarks, memory, the one-GPU check and its estimate (gpu_check.py), the precision
measurement (precision.py: what train.py's rule picks against what is faster here), the searches behind
the presets (course_search.py). May import the root, the engine, extras/real and extras/checkpoints.
"""
