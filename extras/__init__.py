"""Beyond the paper: the tools around the method, one room per concern, each run as
python -m extras.<room>.<tool>. They import the root; the root reaches them only through
checkpoint.foreign() (extras/checkpoints/foreign.py), and no two rooms import each other in a circle.

    checkpoints/  Hugging Face directories and GGUF files in and out
    serving/      the continuous-batching scheduler, the HTTP server, the load experiment
    bench/        the paper's tables in miniature, statistics, benchmarks
    real/         the real-model run: self-distillation, its evaluation, snapshots
"""
