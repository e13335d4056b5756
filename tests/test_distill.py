"""Self-distillation (extras/real/distill.py), the real-model evaluation (extras/real/eval.py) and the snapshots of
a training run (extras/real/snapshots.py), end to end on the tiny run's checkpoints with a few prompts and budgets."""
import contextlib
import io
import json
import os
import sys

import pytest
import torch

import common
import data
from extras.engine import engine
from conftest import assert_one_line_error, run_cli
from extras.real import checks, distill, snapshots
from extras.real import eval as real_eval

N_TRAIN, N_VAL, N_HELDOUT, BUDGET = 40, 10, 8, 10
SHARES = dict(zip(distill.KINDS, (0.4, 0.4, 0.2)))


def question(prompt):
    """A prompt without the toy's opener."""
    opener = max((o for o in data.OPENERS if prompt.startswith(o)), key=len)
    return prompt[len(opener):]


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_distill(args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        distill.main(args)
    return out.getvalue()


def test_held_out_questions_are_checkable_and_never_have_a_training_or_validation_prompt():
    sets = distill.prompt_sets(400, 40, 100, SHARES, seed=3)
    assert sets == distill.prompt_sets(400, 40, 100, SHARES, seed=3)  # seeded
    assert sets["heldout"] == distill.prompt_sets(900, 10, 100, SHARES, seed=3)["heldout"]  # whatever the other sizes
    heldout, val, train = sets["heldout"], sets["val"], sets["train"]
    assert len(heldout) == 100 and len(val) == 40 and len(train) == 400
    assert all(p["task"] == "check" and p["kind"] in checks.PASSES for p in heldout)
    assert {p["kind"] for p in heldout} == set(checks.PASSES)
    questions = [{question(p["prompt"]) for p in s} for s in (heldout, val, train)]
    assert not questions[0] & questions[1] and not questions[0] & questions[2] and not questions[1] & questions[2]
    assert sum(p["task"] == "general" for p in train) == 160 and sum(p["task"] == "check" for p in train) == 80


@pytest.mark.parametrize("kind, rule, good, bad", [
    ("one_sentence", {}, "Gravity pulls masses together.", "Gravity pulls. It is strong."),
    ("three_tips", {}, "Tips:\n1. Plan.\n2. Rest.\n3. Eat well.", "1. Plan.\n2. Rest."),
    ("haiku", {}, "Waves fold on the sand\nsalt wind hums an old refrain\nthe tide keeps its time",
     "A haiku:\nWaves fold on the sand\nsalt wind hums\nthe tide keeps time"),
    ("use_word", {"word": "candle"}, "The candle burned low.", "The candles burned low."),
    ("no_repeat", {}, "A small red kite.", "A small red kite, a big kite."),
    ("under_20", {}, "The sun is a star.", " ".join(["word"] * 20)),
    ("plural", {"word": "mice"}, "The plural of mouse is mice.", "The plural of mouse is mouses."),
    ("language", {"word": "Portuguese"}, "In Brazil people speak Portuguese.", "In Brazil people speak Spanish."),
])
def test_each_checker_passes_what_follows_its_instruction_and_fails_what_does_not(kind, rule, good, bad):
    example = {"kind": kind, "rule": rule}
    assert checks.passes(example, good) and not checks.passes(example, bad)


@pytest.fixture(scope="module")
def distilled(tiny_run, tmp_path_factory):
    """extras.real.distill with the tiny run's AR checkpoint, answers cut off at BUDGET tokens: (its directory, its
    arguments, what it printed)."""
    out = tmp_path_factory.mktemp("distill")
    args = ["--ckpt", str(tiny_run / "ar.pt"), "--out", str(out / "train.jsonl"), "--heldout",
            str(out / "heldout.jsonl"), "--val", str(out / "val.jsonl"), "--stats", str(out / "stats.json"),
            "--n_train", str(N_TRAIN), "--n_val", str(N_VAL), "--n_heldout", str(N_HELDOUT), "--max_new_tokens",
            str(BUDGET), "--batch", "6"]
    return out, args, run_distill(args)


def test_distill_writes_the_models_greedy_answers_and_the_cut_off_ones_apart(tiny_run, distilled):
    out, _, said = distilled
    train, cut, heldout = read(out / "train.jsonl"), read(out / "train_cut_off.jsonl"), read(out / "heldout.jsonl")
    val, stats = read(out / "val.jsonl"), json.loads((out / "stats.json").read_text())
    assert all(r.keys() == {"prompt", "response"} for r in train + cut)
    assert len(heldout) == N_HELDOUT and all(r["task"] == "check" for r in heldout)
    assert len(val) == N_VAL and all(r.keys() == {"task", "source", "prompt", "response", "cut_off"} for r in val)
    assert {r["source"] for r in val} == {"template"}
    assert not {question(r["prompt"]) for r in heldout + val} & {question(r["prompt"]) for r in train + cut}
    assert len(train) + len(cut) == N_TRAIN and 0 < len(cut) < N_TRAIN
    assert stats["train"]["kept"] == len(train) and stats["train"]["cut_off"] == len(cut)
    assert stats["command"].startswith("python -m extras.real.distill") and f"{len(cut)} answers" in said
    assert not (out / "train.jsonl.partial").exists()
    model, tok = common.model_from_checkpoint(common.load_checkpoint(tiny_run / "ar.pt"))
    prompts = [tok.prompt_ids(r["prompt"]) for r in train]
    for r, done in zip(train, engine.generate_batch(model.eval(), prompts, tok.eot, tok.mask, max_new_tokens=BUDGET)):
        assert done.tokens[-1] == tok.eot and tok.decode(done.tokens[:-1]) == r["response"]  # greedy, not cut off


def test_distill_answers_the_self_written_requests_and_holds_some_out(tiny_run, distilled, tmp_path):
    """--self_prompts: the first requests are held out, the next validate, the next are trained on, each record
    with its source; a file of the wrong shape is one line."""
    requests = tmp_path / "self.jsonl"
    requests.write_text("".join(json.dumps({"prompt": f"Request number {i}?", "source": "self"}) + "\n"
                                for i in range(12)))
    out = tmp_path / "d"
    args = ["--ckpt", str(tiny_run / "ar.pt"), "--out", str(out / "train.jsonl"), "--heldout", str(out / "h.jsonl"),
            "--val", str(out / "val.jsonl"), "--n_train", "4", "--n_val", "2", "--n_heldout", "2", "--max_new_tokens",
            "4", "--batch", "6", "--self_prompts", str(requests), "--heldout_self", str(out / "hs.jsonl"),
            "--n_heldout_self", "3", "--n_val_self", "2", "--n_train_self", "5"]
    run_distill(args)
    assert [r["prompt"] for r in read(out / "hs.jsonl")] == [f"Request number {i}?" for i in range(3)]
    val = read(out / "val.jsonl")
    assert sorted(r["prompt"] for r in val if r["source"] == "self") == ["Request number 3?", "Request number 4?"]
    trained = {r["prompt"] for r in read(out / "train.jsonl") + read(out / "train_cut_off.jsonl")}
    assert len(trained) == 5 + 5 and {f"Request number {i}?" for i in range(5, 10)} <= trained  # templates, self
    requests.write_text('{"text": "no prompt here"}\n')
    proc = run_cli(["extras/real/distill.py", *args])
    assert_one_line_error(proc)
    assert "expected one" in proc.stderr


def test_distill_resumes_from_its_partial_file(distilled):
    out, args, _ = distilled
    train = distill.prompt_sets(N_TRAIN, N_VAL, N_HELDOUT, SHARES, seed=0)["train"]
    planted = {"prompt": train[0]["prompt"], "response": "planted", "task": train[0]["task"], "split": "train",
               "cut_off": False, "ids_kept": True}
    partial = out / "train.jsonl.partial"
    partial.write_text(json.dumps(planted) + "\n" + '{"prompt": "a line cut by Ctrl-')
    assert f"resuming: 1 of {N_TRAIN + N_VAL}" in run_distill(args)
    assert {"prompt": train[0]["prompt"], "response": "planted"} in read(out / "train.jsonl") + read(out / "train_cut_off.jsonl")
    partial.write_text(json.dumps({**planted, "prompt": "not one of its prompts"}) + "\n")
    with pytest.raises(common.UserError, match="other prompts"):
        run_distill(args)
    partial.unlink()


def test_real_eval_end_to_end(tiny_run, distilled, tmp_path):
    """The control here is the MARS checkpoint itself, decoded as AR (B = 1) on its own: a model
    that differs from the base, whose answers MARS at tau = 1.0 (B = 4) must give token for
    token."""
    out, mars_ckpt = distilled[0], str(tiny_run / "mars.pt")
    result = tmp_path / "real.json"
    real_eval.main(["--base", str(tiny_run / "ar.pt"), "--ckpt", mars_ckpt, "--control", mars_ckpt,
                    "--heldout", str(out / "heldout.jsonl"), "--n", "6", "--max_new_tokens", "8",
                    "--batch", "4", "--wall_n1", "1", "--wall_n8", "3", "--trend", mars_ckpt,
                    "--trend_n", "3", "--decode_dtype", "float32",  # float32: exact equalities
                    "--out", str(result)])
    r = json.loads(result.read_text())
    assert r["command"].startswith("python -m extras.real.eval --base")
    assert (tmp_path / "real.png").exists()
    assert [s["decoder"] for s in r["sweep"]] == ["MARS " + d for d in (
        "tau=1.0", "tau=0.95", "tau=0.9", "tau=0.8", "tau=0.7", "lossless")]
    steps = torch.load(tiny_run / "mars.pt", weights_only=True)["iter"]
    control, tau_1 = r["control"][0], r["sweep"][0]
    assert r["control_train"]["steps"] == steps > 0  # a trained model, not the base
    same = ("tokens", "forwards", "identical", "agreement", "cut_off", "quality")
    assert {k: control[k] for k in same} == {k: tau_1[k] for k in same}
    assert control["ar_agreement"] == r["ar_agreement"] == tau_1["ar_agreement"]
    assert 0 <= r["ar_agreement"] <= 1
    base = r["base"]
    assert base["quality"]["n"] == 6 and 0 <= base["quality"]["ci"][0] <= base["quality"]["pass"]
    assert base["identical"] == 1 and base["agreement"] == 1 and base["tokens_per_forward"] == 1
    assert tau_1["tokens_per_forward"] == 1  # tau = 1.0 is AR
    lossless = r["sweep"][-1]
    assert lossless["identical_to_mars_ar"] == 1 and lossless["tokens_per_forward"] >= 1  # exact
    assert [(w["batch_size"], w["decoder"]) for w in r["wall"]] == [
        (b, d) for b in (1, 8) for d in ("ar", "tau=0.9", "lossless")]
    assert [p["step"] for p in r["trend"]] == [0, steps]


def test_real_eval_refuses_a_checkpoint_that_is_not_mars(tiny_run, distilled):
    proc = run_cli(["extras/real/eval.py", "--ckpt", tiny_run / "ar.pt", "--base", tiny_run / "ar.pt", "--heldout",
                    distilled[0] / "heldout.jsonl", "--n", "0"])
    assert_one_line_error(proc)
    assert "not a MARS checkpoint" in proc.stderr


def test_snapshots_link_each_saved_checkpoint(tmp_path):
    path = tmp_path / "mars.pt"
    seen = None
    for step in (2, 4):  # saved as a run saves: a temp file, then a rename
        torch.save({"iter": step}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        seen = snapshots.keep(str(path), seen)
        assert snapshots.keep(str(path), seen) == seen  # a file is kept once
    assert sorted(p.name for p in tmp_path.glob("mars_step*.pt")) == ["mars_step2.pt", "mars_step4.pt"]
    assert torch.load(tmp_path / "mars_step2.pt", weights_only=True)["iter"] == 2
    proc = run_cli(["extras/real/snapshots.py", path, "--", sys.executable, "-c", "import sys; sys.exit(3)"])
    assert proc.returncode == 3  # the run's own exit code


@pytest.mark.slow  # a real SIGINT to a process: on a loaded machine its timing is the machine's
def test_ctrl_c_ends_distill_in_one_line_and_keeps_the_answers(tiny_run, tmp_path):
    """Interrupted, a long command says so in one line (no traceback) and keeps what it did: a rerun resumes."""
    import signal
    import subprocess
    import time
    out = tmp_path / "train.jsonl"
    cmd = [sys.executable, "-m", "extras.real.distill", "--ckpt", str(tiny_run / "ar.pt"), "--out", str(out),
           "--heldout", str(tmp_path / "h.jsonl"), "--val", str(tmp_path / "v.jsonl"), "--n_train", "3000",
           "--n_val", "0", "--n_heldout", "0", "--max_new_tokens", "32", "--batch", "4", "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(__file__)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    partial = tmp_path / "train.jsonl.partial"
    deadline = time.time() + 120
    while time.time() < deadline and not (partial.exists() and partial.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted: the answers so far are in"), err
    assert partial.read_text().count("\n") >= 2 and not out.exists()
