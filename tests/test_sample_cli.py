"""sample.py and the engine's command (python -m extras.engine) on the trained tiny checkpoints (see
conftest.run_cli): sample.py runs the paper's loop and names the engine for the engine's flags."""
import json

import pytest
import torch

import common
import data
import sample as sample_py
from conftest import assert_one_line_error, run_cli

KEYS = {"prompt", "text", "tokens", "forwards", "tokens_per_forward", "seconds", "correct", "ids", "chunks"}
ENGINE = "extras/engine/__main__.py"


def sample(*args, stdin=None, fresh=False):
    return run_cli(["sample.py", *args], stdin=stdin, fresh=fresh)


def engine(*args, stdin=None, fresh=False):
    return run_cli([ENGINE, *args], stdin=stdin, fresh=fresh)


def json_lines(proc):
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def mars_answer(tiny_run, prompt, tau):
    """(tokenizer, prompt ids, answer ids, chunks): sample.generate on mars.pt, as sample.py runs it."""
    model, tok = common.model_from_checkpoint(common.load_checkpoint(str(tiny_run / "mars.pt")))
    ids = tok.prompt_ids(prompt)
    (out, chunks), = sample_py.generate(model, [ids], tok.eot, tok.mask, 4, tau, 64, tok.n_vocab)
    return tok, ids, out, chunks


def test_json_output(tiny_run, splits):
    """Each answer's fields: what sample.generate commits for its prompt, decoded, counted and checked; the
    rates from its tokens, forwards and seconds."""
    rows = json_lines(sample("--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "3", "--threshold", "0.5"))
    assert [r["prompt"] for r in rows] == [e["prompt"] for e in splits["test"][:3]]  # held-out prompts
    for r, e in zip(rows, splits["test"]):
        assert KEYS <= r.keys() and "route" not in r  # sample.py runs the paper's loop only
        tok, _, out, chunks = mars_answer(tiny_run, e["prompt"], 0.5)
        assert (r["ids"], r["chunks"], r["text"]) == (out, [tok.decode(c) for c in chunks], tok.answer(out))
        assert (r["tokens"], r["forwards"], r["correct"]) == (len(out), len(chunks), data.check(e, r["text"]))
        assert r["tokens_per_forward"] == r["tokens"] / r["forwards"]
        assert r["seconds"] > 0 and r["tokens_per_second"] == r["tokens"] / r["seconds"]


def test_held_out_answers_are_marked_right_or_wrong(tiny_run):
    proc = sample("--ckpt", tiny_run / "mars.pt", "--num_prompts", "4", "--threshold", "0.5", fresh=True)
    assert proc.returncode == 0, proc.stderr
    stats = [line for line in proc.stdout.splitlines() if "tokens/forward" in line]
    assert len(stats) == 4
    assert all(line.endswith("]  right") or "]  wrong, expected: " in line for line in stats)
    right = sum(line.endswith("]  right") for line in stats)
    assert proc.stdout.rstrip().splitlines()[-1] == f"{right}/4 right"


@pytest.mark.parametrize("flag", ["--lossless", "--batch_size", "--cache", "--B_cache", "--temperature",
                                  "--seed", "--metric", "--max_accept", "--masks", "--B", "--dtype"])
def test_the_engines_flags_name_the_engines_command(flag):
    """A flag sample.py no longer takes: one line naming python -m extras.engine, exit 2."""
    proc = sample("--ckpt", "unread.pt", flag, *([] if flag == "--lossless" else ["2"]))
    assert_one_line_error(proc)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {flag} is the engine's flag: python -m extras.engine {flag} ..."
    assert flag not in sample("--help").stdout.split()


def test_help_lists_every_flag_with_help():
    """sample.py's --help: its own flags; the engine's: sample.py's and every engine flag, each with its
    help text."""
    from extras.engine import __main__ as command
    short = ["--ckpt", "--threshold", "--tau", "--prompt", "--num_prompts", "--ar", "--max_new_tokens",
             "--device", "--json", "--chat"]
    assert all(flag in sample("--help").stdout for flag in short)
    p = command.parser()
    flags = [s for a in p._actions for s in a.option_strings if s not in ("-h", "--help")]
    assert sorted(flags) == sorted(short + [f for f in sample_py.ENGINE_FLAGS])
    assert all(a.help for a in p._actions)
    help_text = engine("--help").stdout
    assert help_text.startswith("usage: python -m extras.engine") and all(f in help_text for f in flags)


@pytest.mark.parametrize("cache", ["none", "sliding", "block"])
def test_json_correct_and_chunks_for_every_cache(tiny_run, splits, cache):
    proc = engine("--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "3", "--threshold", "0.5",
                  "--cache", cache, "--B_cache", "4", "--batch_size", "3")
    rows = json_lines(proc)
    assert len(rows) == 3 and proc.stderr.strip().endswith("/3 right")
    for r, e in zip(rows, splits["test"]):
        assert r["correct"] == data.check(e, r["text"])
        assert "".join(r["chunks"]).replace("<|endoftext|>", "") == r["text"]
    rows = json_lines(sample("--ckpt", tiny_run / "mars.pt", "--json", "--prompt", "Write 5 in words."))
    assert rows[0]["correct"] is None  # no known answer


def test_threshold_one_equals_ar(tiny_run):
    args = ["--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "6"]
    mars_rows = json_lines(engine(*args, "--threshold", "1.0", "--batch_size", "4"))
    ar_rows = json_lines(sample(*args, "--ar"))
    lossless_rows = json_lines(engine(*args, "--lossless", "--B", "3"))
    assert len(mars_rows) == len(ar_rows) == 6
    assert [r["text"] for r in mars_rows] == [r["text"] for r in ar_rows] == [r["text"] for r in lossless_rows]
    assert [r["prompt"] for r in mars_rows] == [r["prompt"] for r in ar_rows]
    assert all(r["forwards"] == r["tokens"] for r in mars_rows + ar_rows)


@pytest.mark.slow
def test_the_engines_command_runs_the_papers_loop_without_an_engine_flag(tiny_run, monkeypatch):
    """sample.py decodes with sample.generate (the loop the README quotes), one call per prompt; so does the
    engine's command without an engine flag (--B and --dtype are the loop's), with one the engine decodes. All
    print the same ids, chunks and forwards, and the engine's command says which decoded and why."""
    calls, generate = [], sample_py.generate
    monkeypatch.setattr(sample_py, "generate", lambda *a, **kw: calls.append(a) or generate(*a, **kw))
    dropped = ("seconds", "tokens_per_second", "route", "why")
    timeless = lambda rows: [{k: v for k, v in r.items() if k not in dropped} for r in rows]
    for flags in (["--threshold", "0.5"], ["--threshold", "1.0"], ["--ar"]):
        args = ["--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "6", *flags]
        calls.clear()
        loop = json_lines(sample(*args))
        assert len(calls) == 6, flags
        rows = json_lines(engine(*args, "--dtype", "float32"))
        assert len(calls) == 12 and timeless(rows) == timeless(loop), flags
        assert {r["route"] for r in rows} == {"paper loop"}
        for engine_flags in (["--batch_size", "2"], ["--cache", "none"]):
            rows = json_lines(engine(*args, *engine_flags))
            assert timeless(rows) == timeless(loop), (flags, engine_flags)
            assert {(r["route"], r["why"]) for r in rows} == {("engine", f"sample.generate does not take "
                                                                  f"{' '.join(engine_flags)}")}
        assert len(calls) == 12  # the engine decoded those
    text = engine("--ckpt", tiny_run / "mars.pt", "--num_prompts", "1", "--batch_size", "2", "--lossless").stdout
    assert text.startswith("route: engine (sample.generate does not take --batch_size 2, --lossless)\n")
    assert loop[0]["forwards"] == loop[0]["tokens"] == len(loop[0]["chunks"])  # --ar: one token per forward


def test_masks_auto_runs_on_the_engine(tiny_run, monkeypatch):
    """--masks auto: the engine decodes (sample.generate feeds fixed masks only); tau = 1.0 and lossless are AR."""
    monkeypatch.setattr(sample_py, "generate", lambda *a, **kw: pytest.fail("--masks auto ran the fixed loop"))
    args = ["--ckpt", tiny_run / "mars.pt", "--json", "--num_prompts", "6", "--masks", "auto"]
    rows = json_lines(engine(*args, "--threshold", "0.5"))
    assert len(rows) == 6 and all(KEYS <= r.keys() and 1 <= r["forwards"] <= r["tokens"] for r in rows)
    ar = [r["text"] for r in json_lines(engine(*args, "--ar"))]
    assert [r["text"] for r in json_lines(engine(*args, "--lossless"))] == ar
    assert [r["text"] for r in json_lines(engine(*args, "--threshold", "1.0", "--cache", "block"))] == ar
    assert "--masks {fixed,auto}" in engine("--help").stdout


@pytest.mark.parametrize("args", [["--threshold", "0"], ["--threshold", "1.5"], ["--threshold", "abc"],
                                  ["--bogus"]], ids=lambda a: " ".join(a))
def test_bad_flags(tiny_run, args):
    for command in (sample, engine):
        assert_one_line_error(command("--ckpt", tiny_run / "mars.pt", *args))


@pytest.mark.parametrize("args, says", [
    (["--B", "0"], "--B must be at least 1"), (["--batch_size", "0"], "--batch_size must be at least 1"),
    (["--B_cache", "0"], "--B_cache must be at least 1"), (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--ar", "--lossless"], "--ar and --lossless"), (["--lossless", "--temperature", "1"], "--lossless is greedy"),
    (["--metric", "nope"], "invalid choice: 'nope'"), (["--masks", "some"], "invalid choice: 'some'"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_the_engines_bad_flags(tiny_run, args, says):
    proc = engine("--ckpt", tiny_run / "mars.pt", *args)
    assert_one_line_error(proc)
    assert says in proc.stderr


def test_missing_and_corrupt_checkpoints(tmp_path):
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"\x00garbage\xff" * 100)
    for command in (sample, engine):
        proc = command("--ckpt", tmp_path / "missing.pt")
        assert_one_line_error(proc)
        assert "missing.pt" in proc.stderr
        proc = command("--ckpt", bad)
        assert_one_line_error(proc)
        assert "corrupt.pt" in proc.stderr


@pytest.mark.parametrize("name", ["dir", "model.gguf", "smollm2", "real.pt"])
def test_a_real_model_names_the_engines_command(tiny_run, tmp_path, name):
    """sample.py reads our toy checkpoints only: a real model (its path, or our .pt of one, with its own chat
    template) is one line naming the engine's command."""
    path = tmp_path / name
    if name == "dir":
        path.mkdir()
    elif name.endswith(".gguf"):
        path.write_bytes(b"GGUF")
    elif name.endswith(".pt"):
        ckpt = torch.load(tiny_run / "mars.pt", weights_only=True)
        ckpt["tokenizer"]["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
        torch.save(ckpt, path)
    proc = sample("--ckpt", path if name != "smollm2" else name)
    assert_one_line_error(proc)
    assert "python -m extras.engine --ckpt" in proc.stderr


def test_ar_checkpoint(tiny_run):
    proc = sample("--ckpt", tiny_run / "ar.pt", "--num_prompts", "1")
    assert_one_line_error(proc)
    assert "--ar" in proc.stderr
    rows = json_lines(sample("--ckpt", tiny_run / "ar.pt", "--ar", "--json", "--num_prompts", "2"))
    assert len(rows) == 2 and all(r["forwards"] == r["tokens"] for r in rows)
    # the engine's --B: an AR checkpoint's masks are untrained, but tau 1.0 commits the AR token alone
    masks = json_lines(engine("--ckpt", tiny_run / "ar.pt", "--B", "4", "--threshold", "1.0", "--json",
                              "--num_prompts", "2"))
    assert [r["ids"] for r in masks] == [r["ids"] for r in rows]


def test_prompt_longer_than_context(tiny_run):
    for command in (sample, engine):
        proc = command("--ckpt", tiny_run / "mars.pt", "--prompt", "word " * 200)
        assert_one_line_error(proc)
        assert "-token prompt fills the" in proc.stderr
    assert_one_line_error(engine("--ckpt", tiny_run / "mars.pt", "--prompt", "word " * 200, "--batch_size", "2"))


def test_prompt_with_special_token_text(tiny_run):
    rows = json_lines(sample("--ckpt", tiny_run / "mars.pt", "--json", "--prompt", "Repeat <|mask|> and <|endoftext|>.",
                             "--prompt", "Write 5 in words."))
    assert [r["prompt"] for r in rows] == ["Repeat <|mask|> and <|endoftext|>.", "Write 5 in words."]
    for r in rows:  # the special tokens' text is text: no <|mask|> id, and <|endoftext|> only where every chat opens
        tok, ids, out, _ = mars_answer(tiny_run, r["prompt"], 0.9)
        assert tok.mask not in ids and ids.count(tok.eot) == 1 and r["prompt"] in tok.decode(ids)
        assert r["ids"] == out and r["tokens"] == len(out) >= 1


@pytest.mark.parametrize("command", [sample, engine])
def test_chat(tiny_run, command):
    proc = command("--ckpt", tiny_run / "mars.pt", "--chat",
                   stdin="Write 5 in words.\n/tau 0.5\nSpell the word apple.\n/tau 7\n\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    answers = [line for line in proc.stdout.splitlines() if line.startswith("> ")]
    assert answers == ["> Write 5 in words.", "> Spell the word apple."]
    assert proc.stdout.count("tokens/forward") == 2
    assert "tau = 0.5" in proc.stderr
    assert "error: must be in (0, 1]" in proc.stderr  # a bad /tau is reported and the chat goes on


def test_chat_survives_an_overlong_prompt(tiny_run):
    """Like a bad '/tau', a prompt that does not fit is reported and the chat goes on."""
    proc = sample("--ckpt", tiny_run / "mars.pt", "--chat",
                  stdin="Write 5 in words.\n" + "word " * 200 + "\nSpell the word apple.\n")
    assert "Traceback" not in proc.stderr
    assert "error:" in proc.stderr
    answers = [line for line in proc.stdout.splitlines() if line.startswith("> ")]
    assert answers == ["> Write 5 in words.", "> Spell the word apple."], proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr
