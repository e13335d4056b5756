"""The names extras/real/ and extras/bench/gpu_check.py import from here; they live in config.py (the command
lines' conventions) and checkpoint.py (loading)."""
from checkpoint import UserError, check_device, load_checkpoint, model_from_checkpoint  # noqa: F401
from config import Parser, add_device, run_cli, threshold  # noqa: F401
