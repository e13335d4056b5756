"""Self-distillation (extras/real/distill.py), the real-model evaluation (extras/real/eval.py) and the snapshots of
a training run (extras/real/snapshots.py), end to end on the tiny run's checkpoints with a few prompts and budgets."""
import contextlib
import io
import json
import os
import sys

import pytest
import torch

import cli
import data
import engine
from conftest import assert_one_line_error, run_cli
from extras.real import distill, real_eval, snapshots

N_TRAIN, N_HELDOUT, BUDGET = 40, 8, 10


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


def test_held_out_questions_never_have_a_training_prompt():
    train, heldout = distill.prompt_sets(400, 100, 0.5, seed=3)
    assert (train, heldout) == distill.prompt_sets(400, 100, 0.5, seed=3)  # seeded
    assert heldout == distill.prompt_sets(900, 100, 0.5, seed=3)[1]  # whatever the training set's size
    assert len(heldout) == 100 and len(train) == 400 and len({p["prompt"] for p in train}) == 400
    assert not {question(p["prompt"]) for p in heldout} & {question(p["prompt"]) for p in train}
    toy = [p for p in heldout if p["task"] != "general"]
    assert len(toy) == 50 and {p["task"] for p in toy} == set(data.TASKS) and all("answer" in p for p in toy)
    assert len({question(p["prompt"]) for p in toy}) == 50  # distinct questions, whatever their openers


@pytest.fixture(scope="module")
def distilled(tiny_run, tmp_path_factory):
    """extras.real.distill with the tiny run's AR checkpoint, answers cut off at BUDGET tokens: (its directory, its
    arguments, what it printed)."""
    out = tmp_path_factory.mktemp("distill")
    args = ["--ckpt", str(tiny_run / "ar.pt"), "--out", str(out / "train.jsonl"), "--heldout",
            str(out / "heldout.jsonl"), "--n_train", str(N_TRAIN), "--n_heldout", str(N_HELDOUT), "--max_new_tokens",
            str(BUDGET), "--batch", "6"]
    return out, args, run_distill(args)


def test_distill_writes_the_models_greedy_answers_without_cut_off_ones(tiny_run, distilled):
    out, _, said = distilled
    train, heldout = read(out / "train.jsonl"), read(out / "heldout.jsonl")
    assert all(r.keys() == {"prompt", "response"} for r in train)
    assert len(heldout) == N_HELDOUT and all(r.keys() <= {"task", "prompt", "answer"} for r in heldout)
    assert not {question(r["prompt"]) for r in heldout} & {question(r["prompt"]) for r in train}
    dropped = N_TRAIN - len(train)
    assert 0 < dropped < N_TRAIN and f"{dropped} cut off at {BUDGET} tokens dropped" in said
    assert not (out / "train.jsonl.partial").exists()
    model, tok = cli.model_from_checkpoint(cli.load_checkpoint(tiny_run / "ar.pt"))
    prompts = [tok.prompt_ids(r["prompt"]) for r in train]
    for r, done in zip(train, engine.generate_batch(model.eval(), prompts, tok.eot, tok.mask, max_new_tokens=BUDGET)):
        assert done.tokens[-1] == tok.eot and tok.decode(done.tokens[:-1]) == r["response"]  # greedy, not cut off


def test_distill_resumes_from_its_partial_file(distilled):
    out, args, _ = distilled
    train, _ = distill.prompt_sets(N_TRAIN, N_HELDOUT, 0.5, seed=0)
    planted = {"prompt": train[0]["prompt"], "response": "planted", "task": train[0]["task"], "cut_off": False,
               "ids_kept": True}
    partial = out / "train.jsonl.partial"
    partial.write_text(json.dumps(planted) + "\n" + '{"prompt": "a line cut by Ctrl-')
    assert "resuming: 1 of 40" in run_distill(args)
    assert {"prompt": train[0]["prompt"], "response": "planted"} in read(out / "train.jsonl")
    partial.write_text(json.dumps({**planted, "prompt": "not one of its prompts"}) + "\n")
    with pytest.raises(cli.UserError, match="other prompts"):
        run_distill(args)
    partial.unlink()


def test_real_eval_end_to_end(tiny_run, distilled, tmp_path):
    out = distilled[0]
    result = tmp_path / "real.json"
    real_eval.main(["--base", str(tiny_run / "ar.pt"), "--ckpt", str(tiny_run / "mars.pt"), "--heldout",
                    str(out / "heldout.jsonl"), "--n", "6", "--max_new_tokens", "8", "--batch", "4", "--wall_n1", "1",
                    "--wall_n8", "3", "--trend", str(tiny_run / "mars.pt"), "--trend_n", "3", "--out", str(result)])
    r = json.loads(result.read_text())
    assert r["command"].startswith("python -m extras.real.eval --base") and (tmp_path / "real.png").exists()
    assert [s["decoder"] for s in r["sweep"]] == ["tau=1.0", "tau=0.95", "tau=0.9", "tau=0.8", "tau=0.7", "lossless"]
    assert r["base"]["identical"] == 1 and r["base"]["agreement"] == 1 and r["base"]["tokens_per_forward"] == 1
    assert r["sweep"][0]["tokens_per_forward"] == 1  # tau = 1.0 is AR
    lossless = r["sweep"][-1]
    assert lossless["identical_to_mars_ar"] == 1 and lossless["tokens_per_forward"] > 1  # exact, and faster
    assert 0 <= r["ar_agreement"] <= 1 and r["sweep"][0]["identical_to_mars_ar"] == 1
    assert "toy" in r["base"] and r["base"]["toy"]["n"] == sum("answer" in e for e in read(out / "heldout.jsonl")[:6])
    assert [(w["batch_size"], w["decoder"]) for w in r["wall"]] == [(b, d) for b in (1, 8)
                                                                    for d in ("ar", "tau=0.9", "lossless")]
    assert [p["step"] for p in r["trend"]] == [0, torch.load(tiny_run / "mars.pt", weights_only=True)["iter"]]


def test_real_eval_refuses_a_checkpoint_that_is_not_mars(tiny_run, distilled):
    proc = run_cli(["extras/real/eval.py", "--ckpt", tiny_run / "ar.pt", "--base", tiny_run / "ar.pt", "--heldout",
                    distilled[0] / "heldout.jsonl", "--n", "0"])
    assert_one_line_error(proc)
    assert "not a MARS checkpoint" in proc.stderr


def test_snapshots_link_each_saved_checkpoint(tmp_path):
    path = tmp_path / "mars.pt"
    seen = None
    for step in (2, 4):  # saved as train.py saves: a temp file, then a rename
        torch.save({"iter": step}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        seen = snapshots.keep(str(path), seen)
        assert snapshots.keep(str(path), seen) == seen  # a file is kept once
    assert sorted(p.name for p in tmp_path.glob("mars_step*.pt")) == ["mars_step2.pt", "mars_step4.pt"]
    assert torch.load(tmp_path / "mars_step2.pt", weights_only=True)["iter"] == 2
    proc = run_cli(["extras/real/snapshots.py", path, "--", sys.executable, "-c", "import sys; sys.exit(3)"])
    assert proc.returncode == 3  # the run's own exit code
