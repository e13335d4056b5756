"""Prompts the model writes itself (extras/real/self_prompts.py): the opening it is given, the filters, the
deduplication, nucleus sampling, and the command end to end with its resume."""
import json

import pytest
import torch

import common
from conftest import assert_one_line_error, run_cli
from extras.real import self_prompts as sp


def test_the_opening_is_the_template_up_to_the_users_words(tiny_run):
    tok = common.model_from_checkpoint(common.load_checkpoint(tiny_run / "ar.pt"))[1]
    opening = sp.opening_ids(tok)
    assert tok.prompt_ids("Hello there")[:len(opening)] == opening
    assert tok.prompt_ids("Hello there")[len(opening):len(opening) + 2] != opening[-2:]


@pytest.mark.parametrize("text,finished,why", [
    ("Can you give me some tips for a new employee?", True, None),
    ("Write a haiku about autumn.", True, None),
    ("I'm planning a trip to Rome. What should I see first?", True, None),
    ("", True, "empty"), ("   \n", True, "empty"),
    ("Can you help me plan a launch of my", False, "cut off"),
    ("word " * 80 + "?", True, "too long"),
    ("The AI assistant is designed to assist users with their questions.", True, "not a request"),
    ("You are a helpful assistant. What is 2 + 2?", True, "not a request"),
    ("Dear team, the meeting moved to Friday.", True, "not a request"),
    ("What is this <|im_start|> token?", True, "not a request"),
])
def test_the_filters(text, finished, why):
    assert sp.rejection(text, finished, ["<|im_start|>"]) == why


def test_exact_and_near_duplicates_are_dropped():
    d = sp.Deduplicator()
    assert d.reason("What makes a good protagonist in a story?") is None
    assert d.reason("What makes a good protagonist in a story?") == "duplicate"
    assert d.reason("what makes a GOOD protagonist in a story") == "near duplicate"  # case and punctuation
    long = "Can you give me some tips for a new employee on how to manage their personal life?"
    assert d.reason(long) is None
    assert d.reason(long.replace("personal life?", "time at work?")) == "near duplicate"  # the same ten first words
    assert d.reason("What makes a good antagonist in a story?") is None


def test_nucleus_sampling_keeps_the_smallest_set_reaching_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {int(sp.top_p_sample(logits, 1.0, 0.75, g)) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.75; 0.15 and 0.05 are past the nucleus
    assert {int(sp.top_p_sample(logits, 1.0, 1.0, g)) for _ in range(600)} == {0, 1, 2, 3}


def test_the_command_keeps_n_requests_writes_its_stats_and_resumes(tiny_run, tmp_path, monkeypatch):
    """The tiny toy model is not a chat model: every filter passes here, so that the path is what is tested."""
    monkeypatch.setattr(sp, "rejection", lambda text, finished, specials: None if text.strip() else "empty")
    out, stats = tmp_path / "p.jsonl", tmp_path / "s.json"
    args = ["--ckpt", str(tiny_run / "ar.pt"), "--n", "6", "--batch", "4", "--max_tokens", "5", "--out", str(out),
            "--stats", str(stats), "--device", "cpu"]
    sp.main(args)
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    s = json.loads(stats.read_text())
    assert len(kept) == 6 and all(r["source"] == "self" for r in kept) and len({r["prompt"] for r in kept}) == 6
    assert s["kept"] == 6 and s["read"] == 6 + sum(s["dropped"].values()) and s["examples"] == [r["prompt"] for r in kept]
    assert s["command"].startswith("python -m extras.real.self_prompts") and 0 < s["distinct_share"] <= 1
    partial = tmp_path / "p.jsonl.partial"  # an interrupted run: its whole batches are read again, not sampled
    partial.write_text("".join(json.dumps({"batch": 0, "text": f"planted {i}", "finished": True}) + "\n"
                               for i in range(4)) + '{"batch": 1, "te')
    sp.main(args)
    kept = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert kept[:4] == [f"planted {i}" for i in range(4)] and not partial.exists()


def test_a_model_that_writes_no_request_is_one_line(tiny_run, tmp_path):
    proc = run_cli(["extras/real/self_prompts.py", "--ckpt", tiny_run / "ar.pt", "--n", "2", "--batch", "8",
                    "--max_tokens", "3", "--out", tmp_path / "p.jsonl", "--device", "cpu"])
    assert_one_line_error(proc)
    assert "is this a chat model?" in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_nucleus_sampling_on_cuda_draws_on_the_device():
    """The (rows, vocab) probabilities stay on the GPU: the draw takes the device's generator, the token stays there."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 256, device="cuda"))
    g = torch.Generator("cuda").manual_seed(0)
    drawn = sp.top_p_sample(logits, 1.0, 0.75, g)
    assert drawn.is_cuda and set(drawn.tolist()) == {0, 1}
