"""eval.py: the statistics against hand-computed values, then end to end on the
tiny checkpoints: the JSON shape, the plots, and the facts that hold by
construction (lossless = MARS at tau 1.0 = the same AR model)."""
import json

import pytest

from conftest import assert_one_line_error, run_cli
import statistics

import torch

import data
from extras.bench import eval as ev
from extras.engine.engine import generate_batch
from extras.checkpoints import foreign
import common
from stats import mcnemar_p, newcombe_paired, paired, wilson


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


def test_newcombe_paired_interval_at_small_discordant_counts():
    """Newcombe's method 10 by hand, 20 prompts: (both right, a only, b only, neither). Each accuracy gets its
    Wilson interval (p - l, u - p); phi = (both * neither - a_only * b_only - n/2) / sqrt(product of the four
    margins) when that cross term exceeds n/2, 0 when it is in [0, n/2], unshrunk when negative; then
    lower = d - sqrt(da^2 - 2 phi da db + db^2) with da = p1 - l1, db = u2 - p2 (upper: mirrored)."""
    # 0 / 0 discordant: p1 = p2 = 0.75, Wilson(15, 20) = [0.5313, 0.8881], phi = (75 - 10) / 75 = 0.8667
    assert newcombe_paired(15, 0, 0, 5) == pytest.approx([-0.1206, 0.1206], abs=1e-4)  # not [0, 0]
    # 1 / 5: p1 = 0.65 [0.4329, 0.8188], p2 = 0.85 [0.6396, 0.9476], phi = (24 - 5 - 10) / sqrt(13*7*17*3) = 0.1321
    assert newcombe_paired(12, 1, 5, 2) == pytest.approx([-0.4260, 0.0518], abs=1e-4)
    # 2 / 10: p1 = 0.40 [0.2188, 0.6134], p2 = 0.80 [0.5840, 0.9193], phi = (12 - 20) / sqrt(8*12*16*4) = -0.1021
    assert newcombe_paired(6, 2, 10, 2) == pytest.approx([-0.6269, -0.0812], abs=1e-4)
    # swapping the two decoders mirrors the interval; it stays inside [-1, 1] at the extremes
    assert newcombe_paired(6, 10, 2, 2) == pytest.approx([0.0812, 0.6269], abs=1e-4)
    assert -1 <= newcombe_paired(0, 20, 0, 0)[0] < newcombe_paired(0, 20, 0, 0)[1] <= 1


def test_paired_difference():
    # a right on 3 of 4, b on 1 of 4, b's one right answer shared: discordant 2 / 0
    r = paired([1, 1, 1, 0], [1, 0, 0, 0])
    assert (r["a_only"], r["b_only"], r["n"]) == (2, 0, 4)
    assert r["diff"] == 0.5 and r["p_value"] == 0.5
    assert r["ci"] == newcombe_paired(1, 2, 0, 1)
    assert paired([1, 0] * 6 + [0, 1] * 4, [0, 1] * 6 + [1, 0] * 4)["ci"] == newcombe_paired(0, 10, 10, 0)


@pytest.mark.slow
def test_eval_writes_tables(tiny_run, tmp_path):
    # the same MARS checkpoint twice stands in for an ablation; for the control, an AR checkpoint whose answers
    # differ from ar.pt's: the MARS weights without their "mars" entry (any AR checkpoint decodes as one)
    mars_pt, control_pt = tiny_run / "mars.pt", tmp_path / "control.pt"
    control = torch.load(mars_pt, weights_only=True)
    del control["mars"]
    torch.save(control, control_pt)
    proc = run_cli(["extras/bench/eval.py", "--ar_ckpt", tiny_run / "ar.pt", "--ckpt", mars_pt, mars_pt,
                    "--control_ckpt", control_pt, "--out_dir", tmp_path, "--limit", "24",
                    "--thresholds", "0.9", "--speed_thresholds", "0.9", "--speed_prompts", "4", "--repeats", "2",
                    "--batch_sizes", "1", "2", "--B_cache", "4"], fresh=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "eval.json").read_text())
    for plot in ("pareto.png", "metrics.png"):
        assert (tmp_path / plot).stat().st_size > 1000
    assert proc.stdout == ev.markdown(result) + "\n" and result["machine"]  # the tables printed are the JSON's
    ar_row = result["quality"][0]
    assert f"| AR SFT (stage 1) | {100 * ar_row['accuracy']:.1f} | [{100 * ar_row['ci'][0]:.1f}, " in proc.stdout

    quality = {(q["decoder"], q["threshold"]): q for q in result["quality"]}
    assert list(quality) == [("ar", None), ("control", None), ("mars", 1.0), ("mars", 0.9), ("lossless", None)]
    for q in result["quality"] + [r for a in result["ablations"] for r in a["sweep"]]:
        assert q["ci"][0] <= q["accuracy"] <= q["ci"][1] and 0 <= q["ci"][0] and q["ci"][1] <= 1
        assert q["tokens_per_forward"] >= 1 and q["n"] == 24 and "correct" not in q
        assert sum(t["n"] for t in q["per_task"].values()) == 24
    assert quality[("mars", 1.0)]["tokens_per_forward"] == 1.0
    # lossless and tau = 1.0 are AR greedy decoding of the MARS checkpoint, token for token (float32)
    assert result["identical_to_ar"] == {"reference": result["identical_to_ar"]["reference"], "n": 24,
                                         "lossless_differ": 0, "tau1_differ": 0}
    assert quality[("lossless", None)]["tokens_per_forward"] > 1  # and it did take several tokens at once

    # every row's figures are those of its own checkpoint and decoder, recomputed here in-process
    test = data.load_splits(control["train_config"]["data"], control["train_config"]["seed"],
                            control["train_config"]["n_train"])["test"][:24]
    models = {k: common.model_from_checkpoint(common.load_checkpoint(str(path))) for k, path in
              (("ar", tiny_run / "ar.pt"), ("control", control_pt))}
    for key, (m, t) in models.items():
        mine = ev.score(m.eval(), t, test, B=1)
        for field in ("accuracy", "tokens", "forwards", "per_task", "per_length"):
            assert quality[(key, None)][field] == mine[field], (key, field)
    assert quality[("control", None)]["tokens"] != quality[("ar", None)]["tokens"]  # two different models
    # the official counter: at batch 64 every forward of a batch counts once for all its rows
    for q in result["quality"]:
        assert q["batch_size"] == 64 and q["tokens_per_forward_official"] > q["tokens_per_forward"] * 24 / 3
    # answer-length buckets: the reference response in tokens, <|endoftext|> included
    tok = models["ar"][1]
    lengths = [len(tok.encode(e["response"])) + 1 for e in test]
    for bucket, r in quality[("ar", None)]["per_length"].items():
        lo, hi = (int(bucket[:-1]), 10**9) if bucket.endswith("+") else map(int, bucket.split("-"))
        assert r["n"] == sum(lo <= n <= hi for n in lengths) > 0, bucket

    vs_ar, vs_control, vs_tau1 = result["paired"]
    assert (vs_ar["a"], vs_ar["b"], vs_control["b"]) == ("MARS tau=1.0", "AR SFT", "control")
    assert (vs_tau1["a"], vs_tau1["b"]) == ("MARS tau=0.9", "MARS tau=1.0")
    assert vs_ar["diff"] == pytest.approx(quality[("mars", 1.0)]["accuracy"] - quality[("ar", None)]["accuracy"])
    for p in result["paired"]:
        assert p["ci"][0] <= p["diff"] <= p["ci"][1] and 0 <= p["p_value"] <= 1 and p["n"] == 24
        assert p["ci"][1] - p["ci"][0] > 0.05  # Newcombe's interval, not a Wald interval collapsed at 0 discordant

    assert [a["ckpt"] for a in result["ablations"]] == [str(mars_pt)] * 2
    for a in result["ablations"]:
        assert a["label"].startswith(f"B={a['mars']['B']}") and [r["threshold"] for r in a["sweep"]] == [1.0, 0.9]
    assert list(result["metrics"]) == ["prob", "entropy", "margin"] and "nats" in result["entropy_note"]
    assert all([r["threshold"] for r in rows] == [1.0, 0.9] for rows in result["metrics"].values())

    speed = {(s["decoder"], s["batch_size"], s["threshold"], s["cache_block"]) for s in result["speed"]}
    assert speed == {("ar", 1, None, None), ("mars_sliding", 1, 0.9, None), ("mars_block", 1, 0.9, 4),
                     ("mars_nocache", 1, 0.9, None), ("lossless", 1, None, None),
                     ("ar", 2, None, None), ("mars_sliding", 2, 0.9, None), ("mars_block", 2, 0.9, 4)}
    # each decoder's tokens/forward: that of its greedy decoding of the speed prompts, the same in every pass (the
    # block cache's extension forwards count, as in the paper: it can fall below 1); AR's rate: the median of its
    # rates in all the passes it ran against the decoders of its batch size
    mars_model, mars_tok = common.model_from_checkpoint(common.load_checkpoint(str(mars_pt)))
    speed_ids = [mars_tok.prompt_ids(e["prompt"]) for e in test[:4]]
    decoders = {"mars_sliding": dict(cache="sliding"), "mars_block": dict(cache="block", B_cache=4),
                "mars_nocache": dict(cache="none"), "lossless": dict(lossless=True)}
    for s in result["speed"]:
        bs = s["batch_size"]
        if s["decoder"] == "ar":
            ar_rates = [a for x in result["speed"] if x["batch_size"] == bs and x["decoder"] != "ar"
                        for a in x["ar_tokens_per_second_repeats"]]
            assert s["tokens_per_second"] == statistics.median(ar_rates)
            continue
        gens = [g for i in range(0, 4, bs) for g in generate_batch(
            mars_model.eval(), speed_ids[i:i + bs], mars_tok.eot, mars_tok.mask, B=4, tau=s["threshold"] or 1.0,
            masks="fixed", **decoders[s["decoder"]])]
        assert s["tokens_per_forward"] == sum(len(g.tokens) for g in gens) / sum(g.forwards for g in gens)
    for s in result["speed"]:
        if s["decoder"] == "ar":
            assert s["speedup"] == 1.0 and s["tokens_per_forward"] == 1.0
            # AR commits one token per row per forward: the official counter is the batch's average occupancy
            assert s["tokens_per_forward_official"] == 1.0 if s["batch_size"] == 1 else \
                1 < s["tokens_per_forward_official"] <= s["batch_size"]
            continue
        # the speedup is the median over the repeats of each repeat's rate ratio, the bracket their range
        ratios, rates = s["speedup_repeats"], s["tokens_per_second_repeats"]
        ar_rates = s["ar_tokens_per_second_repeats"]
        assert len(ratios) == len(rates) == len(ar_rates) == 2
        assert ratios == pytest.approx([x / a for x, a in zip(rates, ar_rates)], rel=1e-12)
        assert s["speedup"] == statistics.median(ratios) and s["speedup_spread"] == [min(ratios), max(ratios)]
        assert s["tokens_per_second"] == statistics.median(rates)
        if s["batch_size"] == 1:  # official = ours but for tokens accepted past <|endoftext|>
            assert s["tokens_per_forward"] <= s["tokens_per_forward_official"] <= s["tokens_per_forward"] * 1.5
        else:
            assert s["tokens_per_forward_official"] > s["tokens_per_forward"]


def test_eval_masks_auto(tiny_run, tmp_path):
    """--masks auto reaches every MARS decoder: lossless and tau = 1.0 are still AR, token for token."""
    proc = run_cli(["extras/bench/eval.py", "--ar_ckpt", tiny_run / "ar.pt", "--ckpt", tiny_run / "mars.pt", "--out_dir",
                    tmp_path, "--limit", "16", "--thresholds", "0.5", "--speed_thresholds", "0.5", "--speed_prompts",
                    "4", "--repeats", "1", "--batch_sizes", "2", "--B_cache", "4", "--masks", "auto"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["masks"] == "auto" and result["identical_to_ar"]["lossless_differ"] == 0
    assert result["identical_to_ar"]["tau1_differ"] == 0
    tpf = {(q["decoder"], q["threshold"]): q["tokens_per_forward"] for q in result["quality"]}
    assert tpf[("mars", 1.0)] == 1.0 and tpf[("mars", 0.5)] >= 1
    assert {s["decoder"] for s in result["speed"]} == {"ar", "mars_sliding", "mars_block"}
    data_file = tmp_path / "test.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"Add {a} and {a}.", "answer": str(2 * a)}) + "\n"
                                 for a in range(3, 9)))
    proc = run_cli(["extras/bench/eval.py", "--ckpt", tiny_run / "mars.pt", "--data", data_file, "--out_dir", tmp_path,
                    "--masks", "auto"])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "eval_data.json").read_text())
    assert rows["masks"] == "auto" and [r["threshold"] for r in rows["rows"]] == [1.0, 0.95, 0.9]
    assert rows["checkers"] == ["number"]  # read by extras/real/records.py, scored by its final number


def test_eval_scores_numbers_by_the_records_checker(tiny_run):
    """score() checks with records.check: a numeric answer is right when the answer's final
    number is, not only when the whole answer is the number."""
    from extras.real import records
    _, model, tok = foreign.load(tiny_run / "ar.pt")
    prompt = "What is 12 + 34?"
    first = ev.score(model.eval(), tok, [records.read_record({"prompt": prompt, "answer": "0"})], max_new_tokens=24)
    text = tok.answer(first["outputs"][0])
    number = records.final_number(text)
    assert number is not None and text.strip() != number, text  # a worked answer, not a bare number
    again = ev.score(model, tok, [records.read_record({"prompt": prompt, "answer": number})], max_new_tokens=24)
    assert again["correct"] == [1] and first["correct"] == [int(number == "0")]


def test_eval_rejects_missing_and_wrong_checkpoints(tiny_run, tmp_path):
    flags = ["--ar_ckpt", tiny_run / "ar.pt", "--out_dir", tmp_path]
    missing = tmp_path / "missing.pt"
    for ckpts, says in [(["--ckpt", tiny_run / "ar.pt"], f"{tiny_run / 'ar.pt'} is not a MARS checkpoint"),
                        (["--ckpt", tiny_run / "mars.pt", "--control_ckpt", missing], f"checkpoint not found: {missing}"),
                        (["--ckpt", tiny_run / "mars.pt", missing], f"checkpoint not found: {missing}")]:
        proc = run_cli(["extras/bench/eval.py", *flags, *ckpts])
        assert_one_line_error(proc)
        assert proc.stderr.startswith(f"error: {says}"), proc.stderr


# ---------------------------------------------------------------------------
# extras/bench/decode_dtype.py and extras.real.decode_speed: a real model's decoding dtype, chosen by measuring

def test_the_decoding_dtype_is_forced_by_the_flag_or_measured_in_both_dtypes():
    from conftest import random_model
    from extras.bench import decode_dtype
    model = random_model().float()
    assert decode_dtype.choose(model, 4, "bfloat16") == ("bfloat16", {"dtype": "bfloat16",
                                                                      "reason": "--decode_dtype bfloat16"})
    dtype, why = decode_dtype.choose(model, 4)
    assert dtype == why["dtype"] in ("float32", "bfloat16") and "cached forwards of 1 and 5 tokens" in why["reason"]
    assert set(why["seconds"]) == {"float32", "bfloat16"}
    assert all(set(s) == {"1", "5"} and min(s.values()) > 0 for s in why["seconds"].values())
    costs = sum(why["seconds"]["bfloat16"].values()), sum(why["seconds"]["float32"].values())
    assert (dtype == "bfloat16") == (costs[0] <= 0.9 * costs[1])
    assert model.wte.weight.dtype == torch.float32  # measured on copies
    [cast] = decode_dtype.cast([model], "bfloat16")
    assert cast.wte.weight.dtype == torch.bfloat16


def test_decode_speed_writes_the_choice_the_window_costs_and_the_wall_clock(tiny_run, tmp_path):
    from extras.real import decode_speed
    heldout, out = tmp_path / "heldout.jsonl", tmp_path / "speed.json"
    heldout.write_text("".join(json.dumps({"task": "toy", "prompt": e["prompt"]}) + "\n"
                               for e in data.build_instruction_set(0, n_train=8, n_val=0, n_test=0)["train"]))
    decode_speed.main(["--base", str(tiny_run / "ar.pt"), "--mars_ckpt", str(tiny_run / "mars.pt"), "--heldout",
                       str(heldout), "--n1", "1", "--n8", "3", "--max_new_tokens", "6", "--decode_dtype", "float32",
                       "--device", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["decode_dtype"] == {"dtype": "float32", "reason": "--decode_dtype float32"} and r["cpu_capability"]
    assert r["mars_masks"] == "trained" and r["B"] == common.load_checkpoint(str(tiny_run / "mars.pt"))["mars"]["B"]
    for costs in r["window_costs"].values():
        assert list(costs["ms"]) == ["1", "2", "4", "8"] and costs["over_one_token"]["1"] == 1.0
    assert [(w["batch_size"], w["decoder"]) for w in r["wall"]] == [(b, d) for b in (1, 8)
                                                                    for d in ("ar", "tau=0.9", "lossless")]
    over = r["window_costs"]["float32"]["over_one_token"][str(min(r["B"], 8))]
    for w in r["wall"]:
        assert w["seconds"] > 0 and ("predicted_speedup" in w) == (w["decoder"] != "ar")
        if w["decoder"] != "ar":
            assert w["predicted_speedup"] == pytest.approx(w["tokens_per_forward"] / over, abs=2e-3)
