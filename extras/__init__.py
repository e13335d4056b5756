"""Beyond the paper: the tools around the method, one room per concern, each run as
python -m extras.<room>.<tool>. They import the root; the root reaches them only through its seams,
one function each that imports lazily (docs/architecture.md), and no two rooms import each other in a
circle.

    engine/       the batched engine, its static cache and CUDA graphs, the step-cost model
    checkpoints/  Hugging Face directories and GGUF files in and out, the hf preset and schedule
    serving/      the continuous-batching scheduler, the HTTP server, the load experiment
    bench/        the paper's tables in miniature, statistics, benchmarks, the precision probe
    real/         the real-model run: self-distillation, its evaluation, snapshots, options beyond the paper
"""
