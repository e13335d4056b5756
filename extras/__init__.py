"""Beyond the paper: the tools around the method, one room per concern, each run as
python -m extras.<room>.<tool>. They build on the root: they call its functions, subclass its
Stage and hand it their own readers and checkers; the root imports nothing from here
(docs/architecture.md), and no two rooms import each other in a circle.

    engine/       the batched engine and its command (python -m extras.engine), its static cache
                  and CUDA graphs, the step-cost model
    checkpoints/  Hugging Face directories and GGUF files in and out (into the root's objects)
    serving/      the continuous-batching scheduler, the HTTP server, the load experiment
    bench/        the paper's tables in miniature, statistics, benchmarks, the precision measurement,
                  the searches behind the presets
    real/         training beyond the paper (python -m extras.real.train: real models, ablations),
                  self-distillation, its evaluation, snapshots
"""
