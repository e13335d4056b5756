"""extras.real.recipe end to end at its small preset on the tiny run's checkpoint: every phase, then a rerun that
finds each done."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, assert_one_line_error, run_cli


@pytest.mark.slow
def test_the_small_recipe_runs_every_phase_and_resumes(tiny_run, tmp_path):
    requests = tmp_path / "self.jsonl"  # the toy writes no requests: a chat model's stand-ins
    requests.write_text("".join(json.dumps({"prompt": f"Quick question: Add {i} and {i + 1}.", "source": "self"})
                                + "\n" for i in range(12)))
    cmd = [sys.executable, "-m", "extras.real.recipe", "--preset", "small", "--base", str(tiny_run / "ar.pt"),
           "--self_prompts", str(requests), "--out_dir", str(tmp_path / "r"), "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("[") and "ETA" in line] == \
        ["[1/5] distill", "[2/5] mars", "[3/5] control", "[4/5] eval", "[5/5] eval"]
    real, own = (json.loads((tmp_path / "r" / f).read_text()) for f in ("real.json", "real_self.json"))
    assert real["n"] == 4 and own["n"] == 2 and real["control"] and own["control"]
    assert real["train"]["steps"] == 4 and "quality" in real["base"] and "quality" not in own["base"]
    mars = json.loads((tmp_path / "r" / "mars" / "mars_log.json").read_text())
    assert len(mars) == 4 and real["trend"][0]["step"] == 0 and real["trend"][-1]["step"] == 4  # the base, then kept
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count(": done (") == 5, again.stdout


def test_a_failed_phase_is_one_line(tmp_path):
    proc = run_cli(["extras/real/recipe.py", "--preset", "small", "--base", tmp_path / "none.pt", "--self_prompts",
                    tmp_path / "none.jsonl", "--out_dir", tmp_path / "r", "--device", "cpu"])
    assert proc.returncode == 1 and "error: phase distill failed" in proc.stderr.splitlines()[-1]


def test_the_estimate_follows_the_rows_lengths_and_the_gpu_preset_fits_15_minutes():
    from extras.real import recipe
    gpu = recipe.PRESETS["gpu"]
    minutes = lambda c: sum(recipe.estimate(c).values()) / 60  # noqa: E731
    assert minutes(gpu) <= 15
    longer = recipe.estimate(dict(gpu, max_new_tokens=2 * gpu["max_new_tokens"]))
    shorter = recipe.estimate(gpu)
    assert longer["distill"] > 1.5 * shorter["distill"] and longer["mars"] > shorter["mars"]  # self answers run long
    assert longer["self_prompts"] == shorter["self_prompts"] and longer["loads"] == shorter["loads"]
    first = recipe.fit(gpu, 10)
    assert 9.5 <= minutes(first) <= 10  # sized to fit, not far under
    for k in ("n_self", "n_train", "steps", "max_new_tokens"):
        assert first[k] < gpu[k]
    assert {k: first[k] for k in ("n_heldout", "n_heldout_self", "batch_size")} == \
        {k: gpu[k] for k in ("n_heldout", "n_heldout_self", "batch_size")}  # the evaluation's sets kept
    assert recipe.fit(gpu, 60) is gpu  # a budget never sizes up


def test_a_budget_too_small_is_one_line(tmp_path):
    proc = run_cli(["extras/real/recipe.py", "--preset", "gpu", "--minutes", "0.5", "--out_dir", tmp_path / "r",
                    "--device", "cpu"])
    assert proc.returncode == 1
    assert "error: --minutes 0.5: even the smallest sizes are estimated at" in proc.stderr.splitlines()[-1]
