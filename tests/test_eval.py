"""eval.py: the statistics against hand-computed values, then end to end on the
tiny checkpoints: the JSON shape, the plots, and the facts that hold by
construction (lossless = MARS at tau 1.0 = the same AR model)."""
import json

import pytest

from conftest import assert_one_line_error, run_cli
from eval import mcnemar_p, paired, wilson


def test_wilson_interval():
    # 8 of 10: centre (0.8 + 1.96^2/20) / (1 + 1.96^2/10) = 0.7167, half-width 0.2266
    assert wilson(8, 10) == pytest.approx([0.4902, 0.9433], abs=1e-4)
    # 0 of 10 still has an upper bound: 2 * (1.96^2/20) / (1 + 1.96^2/10) = 0.2775
    assert wilson(0, 10) == pytest.approx([0.0, 0.2775], abs=1e-4)
    assert wilson(10, 10) == pytest.approx([0.7225, 1.0], abs=1e-4)


def test_mcnemar_exact_p():
    assert mcnemar_p(1, 9) == 2 * (1 + 10) / 2**10  # P(X <= 1), X ~ Bin(10, 1/2), both tails
    assert mcnemar_p(0, 6) == 2 / 2**6
    assert mcnemar_p(5, 5) == 1.0 and mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(3, 40) == mcnemar_p(40, 3) < 1e-7


def test_paired_difference():
    # a right on 3 of 4, b on 1 of 4, b's one right answer shared: discordant 2 / 0
    r = paired([1, 1, 1, 0], [1, 0, 0, 0])
    assert (r["a_only"], r["b_only"], r["n"]) == (2, 0, 4)
    assert r["diff"] == 0.5 and r["p_value"] == 0.5
    # se = sqrt(discordant - n d^2) / n = sqrt(2 - 1) / 4
    assert r["ci"] == pytest.approx([0.5 - 1.959964 * 0.25, 0.5 + 1.959964 * 0.25])


def test_eval_writes_tables(tiny_run, tmp_path):
    # the same MARS checkpoint twice stands in for an ablation; ar.pt for the control (any AR checkpoint decodes as one)
    mars_pt = tiny_run / "mars.pt"
    proc = run_cli(["eval.py", "--ar_ckpt", tiny_run / "ar.pt", "--ckpt", mars_pt, mars_pt,
                    "--control_ckpt", tiny_run / "ar.pt", "--out_dir", tmp_path, "--limit", "24",
                    "--thresholds", "0.9", "--speed_thresholds", "0.9", "--speed_prompts", "4", "--repeats", "1",
                    "--batch_sizes", "1", "2", "--cache_blocks", "4"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "eval.json").read_text())
    for plot in ("pareto.png", "metrics.png"):
        assert (tmp_path / plot).stat().st_size > 1000
    assert "| decoder |" in proc.stdout and "1.71x" in proc.stdout and result["machine"]

    quality = {(q["decoder"], q["threshold"]): q for q in result["quality"]}
    assert list(quality) == [("ar", None), ("control", None), ("mars", 1.0), ("mars", 0.9), ("lossless", None)]
    for q in result["quality"] + [r for a in result["ablations"] for r in a["sweep"]]:
        assert q["ci"][0] <= q["accuracy"] <= q["ci"][1] and 0 <= q["ci"][0] and q["ci"][1] <= 1
        assert q["tokens_per_forward"] >= 1 and q["n"] == 24 and "correct" not in q
        assert sum(t["n"] for t in q["per_task"].values()) == 24
    assert quality[("mars", 1.0)]["tokens_per_forward"] == 1.0
    # lossless decoding is AR greedy decoding of the MARS checkpoint: same answers as tau = 1.0
    assert quality[("lossless", None)]["accuracy"] == quality[("mars", 1.0)]["accuracy"]
    assert quality[("control", None)]["accuracy"] == quality[("ar", None)]["accuracy"]

    vs_ar, vs_control, vs_tau1 = result["paired"]
    assert (vs_ar["a"], vs_ar["b"], vs_control["b"]) == ("MARS tau=1.0", "AR SFT", "control")
    assert (vs_tau1["a"], vs_tau1["b"]) == ("MARS tau=0.9", "MARS tau=1.0")
    assert vs_ar["diff"] == pytest.approx(quality[("mars", 1.0)]["accuracy"] - quality[("ar", None)]["accuracy"])
    for p in result["paired"]:
        assert p["ci"][0] <= p["diff"] <= p["ci"][1] and 0 <= p["p_value"] <= 1 and p["n"] == 24

    assert [a["ckpt"] for a in result["ablations"]] == [str(mars_pt)] * 2
    for a in result["ablations"]:
        assert a["label"].startswith(f"B={a['mars']['B']}") and [r["threshold"] for r in a["sweep"]] == [1.0, 0.9]
    assert list(result["metrics"]) == ["prob", "entropy", "margin"] and "nats" in result["entropy_note"]
    assert all([r["threshold"] for r in rows] == [1.0, 0.9] for rows in result["metrics"].values())

    speed = {(s["decoder"], s["batch_size"], s["threshold"], s["cache_block"]) for s in result["speed"]}
    assert speed == {("ar", 1, None, None), ("mars_sliding", 1, 0.9, None), ("mars_block", 1, 0.9, 4),
                     ("mars_nocache", 1, 0.9, None), ("lossless", 1, None, None),
                     ("ar", 2, None, None), ("mars_sliding", 2, 0.9, None), ("mars_block", 2, 0.9, 4)}
    for s in result["speed"]:
        lo, hi = s["speedup_spread"]
        # the block cache's extension forwards count (as in the paper): its tokens/forward can fall below 1
        assert s["tokens_per_second"] > 0 and s["tokens_per_forward"] > 0 and lo <= s["speedup"] <= hi
        if s["decoder"] == "ar":
            assert s["speedup"] == 1.0 and s["tokens_per_forward"] == 1.0


def test_eval_rejects_missing_and_wrong_checkpoints(tiny_run, tmp_path):
    common = ["--ar_ckpt", tiny_run / "ar.pt", "--out_dir", tmp_path]
    assert_one_line_error(run_cli(["eval.py", *common, "--ckpt", tiny_run / "ar.pt"]))  # not a MARS checkpoint
    assert_one_line_error(run_cli(["eval.py", *common, "--ckpt", tiny_run / "mars.pt", "--control_ckpt",
                                   tmp_path / "missing.pt"]))
    assert_one_line_error(run_cli(["eval.py", *common, "--ckpt", tiny_run / "mars.pt", tmp_path / "missing.pt"]))
