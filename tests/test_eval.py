"""eval.py end to end on the tiny checkpoints: the JSON shape, the plot, and the
facts that hold by construction (lossless = MARS at tau 1.0 = the same AR model)."""
import json

from conftest import assert_one_line_error, run_cli


def test_eval_writes_tables(tiny_run, tmp_path):
    proc = run_cli(["eval.py", "--ar_ckpt", tiny_run / "ar.pt", "--ckpt", tiny_run / "mars.pt", "--out_dir", tmp_path,
                    "--limit", "24", "--thresholds", "0.9", "0.5", "--speed_prompts", "4", "--repeats", "1",
                    "--batch_sizes", "2", "--cache_blocks", "4"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "eval.json").read_text())
    assert (tmp_path / "pareto.png").stat().st_size > 1000
    assert "| decoder |" in proc.stdout and result["machine"]

    quality = {(q["decoder"], q["threshold"]): q for q in result["quality"]}
    assert list(quality) == [("ar", None), ("mars", 1.0), ("mars", 0.9), ("mars", 0.5), ("lossless", None)]
    for q in result["quality"]:
        assert 0 <= q["accuracy"] <= 1 and q["tokens_per_forward"] >= 1
        assert sum(t["n"] for t in q["per_task"].values()) == 24
    assert quality[("mars", 1.0)]["tokens_per_forward"] == 1.0
    # lossless decoding is AR greedy decoding of the MARS checkpoint: same answers as tau = 1.0
    assert quality[("lossless", None)]["accuracy"] == quality[("mars", 1.0)]["accuracy"]

    speed = {(s["decoder"], s["batch_size"], s["cache_block"]) for s in result["speed"]}
    assert speed == {("ar", 1, None), ("mars_nocache", 1, None), ("lossless", 1, None), ("mars_sliding", 1, None),
                     ("mars_block", 1, 4), ("ar", 2, None), ("mars_sliding", 2, None), ("mars_block", 2, 4)}
    for s in result["speed"]:
        assert s["tokens_per_second"] > 0
        if s["decoder"] == "ar":
            assert s["speedup"] == 1.0


def test_eval_rejects_an_ar_checkpoint_as_mars(tiny_run, tmp_path):
    proc = run_cli(["eval.py", "--ar_ckpt", tiny_run / "ar.pt", "--ckpt", tiny_run / "ar.pt", "--out_dir", tmp_path])
    assert_one_line_error(proc)
