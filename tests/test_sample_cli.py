"""sample.py as a command on the trained tiny checkpoints (see conftest.run_cli)."""
import json

import pytest

import data
import sample as sample_py
from conftest import assert_one_line_error, run_cli

KEYS = {"prompt", "text", "tokens", "forwards", "tokens_per_forward", "seconds"}


def sample(*args, stdin=None, fresh=False):
    return run_cli(["sample.py", *args], stdin=stdin, fresh=fresh)


def json_lines(proc):
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_json_output(tiny_run, splits):
    rows = json_lines(sample("--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "3", "--threshold", "0.5"))
    assert [r["prompt"] for r in rows] == [e["prompt"] for e in splits["test"][:3]]  # held-out prompts
    for r in rows:
        assert KEYS <= r.keys()
        assert isinstance(r["text"], str) and 0 < r["tokens"] <= 64
        assert 1 <= r["forwards"] <= r["tokens"]
        assert abs(r["tokens_per_forward"] - r["tokens"] / r["forwards"]) < 1e-9
        assert r["seconds"] >= 0


def test_held_out_answers_are_marked_right_or_wrong(tiny_run):
    proc = sample("--ckpt", tiny_run / "mars.pt", "--num_prompts", "4", "--threshold", "0.5", fresh=True)
    assert proc.returncode == 0, proc.stderr
    stats = [line for line in proc.stdout.splitlines() if "tokens/forward" in line]
    assert len(stats) == 4
    assert all(line.endswith("]  right") or "]  wrong, expected: " in line for line in stats)
    right = sum(line.endswith("]  right") for line in stats)
    assert proc.stdout.rstrip().splitlines()[-1] == f"{right}/4 right"


@pytest.mark.parametrize("cache", ["none", "sliding", "block"])
def test_json_correct_and_chunks_for_every_cache(tiny_run, splits, cache):
    proc = sample("--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "3", "--threshold", "0.5",
                  "--cache", cache, "--B_cache", "4", "--batch_size", "3")
    rows = json_lines(proc)
    assert len(rows) == 3 and proc.stderr.strip().endswith("/3 right")
    for r, e in zip(rows, splits["test"]):
        assert r["correct"] == data.check(e, r["text"])
        assert "".join(r["chunks"]).replace("<|endoftext|>", "") == r["text"]
    rows = json_lines(sample("--ckpt", tiny_run / "mars.pt", "--json", "--prompt", "Write 5 in words."))
    assert "correct" not in rows[0]  # no known answer


def test_threshold_one_equals_ar(tiny_run):
    args = ["--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "6"]
    mars_rows = json_lines(sample(*args, "--threshold", "1.0", "--batch_size", "4"))
    ar_rows = json_lines(sample(*args, "--ar"))
    lossless_rows = json_lines(sample(*args, "--lossless", "--B", "3"))
    assert len(mars_rows) == len(ar_rows) == 6
    assert [r["text"] for r in mars_rows] == [r["text"] for r in ar_rows] == [r["text"] for r in lossless_rows]
    assert [r["prompt"] for r in mars_rows] == [r["prompt"] for r in ar_rows]
    assert all(r["forwards"] == r["tokens"] for r in mars_rows + ar_rows)


def test_batch_one_runs_the_papers_loop(tiny_run, monkeypatch):
    """At batch 1, greedy, with the sliding cache and the prob rule, sample.py decodes with sample.generate (the loop
    the README quotes), one call per prompt, and prints what the engine prints for the same prompts: the same ids,
    chunks and forwards. Batches and the other caches go to the engine, and every output says which decoded and why."""
    calls, generate = [], sample_py.generate
    monkeypatch.setattr(sample_py, "generate", lambda *a, **kw: calls.append(a) or generate(*a, **kw))
    dropped = ("seconds", "tokens_per_second", "route", "why")
    timeless = lambda rows: [{k: v for k, v in r.items() if k not in dropped} for r in rows]
    for flags in (["--threshold", "0.5"], ["--threshold", "1.0"], ["--ar"]):
        args = ["--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "6", *flags]
        calls.clear()
        loop = json_lines(sample(*args))
        assert len(calls) == 6 and {r["route"] for r in loop} == {"paper loop"}, flags
        for engine_flags in (["--batch_size", "2"], ["--cache", "none"]):
            rows = json_lines(sample(*args, *engine_flags))
            assert timeless(rows) == timeless(loop), (flags, engine_flags)
            assert {(r["route"], r["why"]) for r in rows} == {("engine", f"sample.generate does not take "
                                                                  f"{' '.join(engine_flags)}")}
        assert len(calls) == 6  # the engine decoded those
    text = sample("--ckpt", tiny_run / "mars.pt", "--num_prompts", "1", "--batch_size", "2", "--lossless").stdout
    assert text.startswith("route: engine (sample.generate does not take --batch_size 2, --lossless)\n")
    assert loop[0]["forwards"] == loop[0]["tokens"] == len(loop[0]["chunks"])  # --ar: one token per forward


def test_masks_auto_runs_on_the_engine(tiny_run, monkeypatch):
    """--masks auto: the engine decodes (sample.generate feeds fixed masks only); tau = 1.0 and lossless are AR."""
    monkeypatch.setattr(sample_py, "generate", lambda *a, **kw: pytest.fail("--masks auto ran the fixed loop"))
    args = ["--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "6", "--masks", "auto"]
    rows = json_lines(sample(*args, "--threshold", "0.5"))
    assert len(rows) == 6 and all(KEYS <= r.keys() and 1 <= r["forwards"] <= r["tokens"] for r in rows)
    ar = [r["text"] for r in json_lines(sample(*args, "--ar"))]
    assert [r["text"] for r in json_lines(sample(*args, "--lossless"))] == ar
    assert [r["text"] for r in json_lines(sample(*args, "--threshold", "1.0", "--cache", "block"))] == ar
    assert "--masks {fixed,auto}" in sample("--help").stdout


@pytest.mark.parametrize("args", [
    ["--threshold", "0"], ["--threshold", "1.5"], ["--threshold", "abc"], ["--B", "0"],
    ["--batch_size", "0"], ["--B_cache", "0"], ["--temperature", "-1"], ["--ar", "--lossless"], ["--metric", "nope"],
    ["--masks", "some"],
], ids=lambda a: " ".join(a))
def test_bad_flags(tiny_run, args):
    assert_one_line_error(sample("--ckpt", tiny_run / "mars.pt", *args))


def test_missing_and_corrupt_checkpoints(tmp_path):
    proc = sample("--ckpt", tmp_path / "missing.pt")
    assert_one_line_error(proc)
    assert "missing.pt" in proc.stderr
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"\x00garbage\xff" * 100)
    proc = sample("--ckpt", bad)
    assert_one_line_error(proc)
    assert "corrupt.pt" in proc.stderr


def test_ar_checkpoint(tiny_run):
    proc = sample("--ckpt", tiny_run / "ar.pt", "--num_prompts", "1")
    assert_one_line_error(proc)
    assert "--ar" in proc.stderr
    rows = json_lines(sample("--ckpt", tiny_run / "ar.pt", "--ar", "--json", "--num_prompts", "2"))
    assert len(rows) == 2 and all(r["forwards"] == r["tokens"] for r in rows)


def test_prompt_longer_than_context(tiny_run):
    assert_one_line_error(sample("--ckpt", tiny_run / "mars.pt", "--prompt", "word " * 200))


def test_prompt_with_special_token_text(tiny_run):
    rows = json_lines(sample("--ckpt", tiny_run / "mars.pt", "--json", "--prompt", "Repeat <|mask|> and <|endoftext|>.",
                             "--prompt", "Write 5 in words."))
    assert [r["prompt"] for r in rows] == ["Repeat <|mask|> and <|endoftext|>.", "Write 5 in words."]
    assert all(r["tokens"] > 0 for r in rows)


def test_chat(tiny_run):
    proc = sample("--ckpt", tiny_run / "mars.pt", "--chat",
                  stdin="Write 5 in words.\n/tau 0.5\nSpell the word apple.\n/tau 7\n\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    answers = [line for line in proc.stdout.splitlines() if line.startswith("> ")]
    assert answers == ["> Write 5 in words.", "> Spell the word apple."]
    assert proc.stdout.count("tokens/forward") == 2
    assert "tau = 0.5" in proc.stderr
    assert "error: /tau" in proc.stderr  # a bad /tau is reported and the chat goes on


def test_chat_survives_an_overlong_prompt(tiny_run):
    """Like a bad '/tau', a prompt that does not fit is reported and the chat goes on."""
    proc = sample("--ckpt", tiny_run / "mars.pt", "--chat",
                  stdin="Write 5 in words.\n" + "word " * 200 + "\nSpell the word apple.\n")
    assert "Traceback" not in proc.stderr
    assert "error:" in proc.stderr
    answers = [line for line in proc.stdout.splitlines() if line.startswith("> ")]
    assert answers == ["> Write 5 in words.", "> Spell the word apple."], proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr
