"""data.py and tokenizer.py: the instruction set, its checkers, the toy tokenizer, batching, JSONL loading;
and what common.py refuses to load as a checkpoint of ours."""
import json
import re

import pytest
import torch

import common
import data
import tokenizer
from conftest import assert_one_line_error, run_cli
from extras.real import records


# ---------------------------------------------------------------------------
# The built-in instruction set

def test_instruction_set_is_deterministic_and_seeded():
    a = data.build_instruction_set(0, n_train=300, n_val=50, n_test=100)
    b = data.build_instruction_set(0, n_train=300, n_val=50, n_test=100)
    c = data.build_instruction_set(1, n_train=300, n_val=50, n_test=100)
    assert a == b
    assert a["train"] != c["train"]
    assert a["val"] != c["val"] or a["test"] != c["test"]


def test_splits_are_disjoint_by_prompt(splits):
    train = {e["prompt"] for e in splits["train"]}
    val = {e["prompt"] for e in splits["val"]}
    test = {e["prompt"] for e in splits["test"]}
    assert len(val) > 0 and len(test) > 0
    assert not (train & val) and not (train & test) and not (val & test)
    # val and test hold distinct prompts
    assert len(val) == len(splits["val"]) and len(test) == len(splits["test"])


def test_instruction_set_size_and_families():
    s = data.build_instruction_set(0, n_train=40000)
    assert len(s["train"]) >= 0.99 * 40000
    families = {e["task"] for e in s["train"]}
    assert len(families) >= 8
    for split in ("val", "test"):
        assert {e["task"] for e in s[split]} == families, split
    for e in s["train"][:100]:
        assert set(e) == {"task", "prompt", "response", "answer"}


def test_held_out_set_is_large_and_balanced():
    s = data.build_instruction_set(0, n_train=4000)
    counts = {}
    for e in s["test"]:
        counts[e["task"]] = counts.get(e["task"], 0) + 1
    assert len(s["test"]) == 2000 and set(counts.values()) == {200}, counts


def test_mars_batches_pad_each_sequence_to_a_multiple_of_B_with_trained_end_tokens():
    rows = [([7, 8, 9, 10, 11, 12], 3), ([7, 8, 9, 10], 2)]  # (chat ids, prompt length)
    x, y = data.make_batch(rows, pad_id=0, multiple=4)
    # 6 ids become 8, trained on; 4 stay 4, and the batch pads them untrained; x = ids[:-1]
    assert x.tolist() == [[7, 8, 9, 10, 11, 12, 0], [7, 8, 9, 0, 0, 0, 0]]
    assert y.tolist() == [[-1, -1, 10, 11, 12, 0, 0], [-1, 9, 10, -1, -1, -1, -1]]
    plain_x, plain_y = data.make_batch(rows, pad_id=0)
    assert plain_y.tolist() == [[-1, -1, 10, 11, 12], [-1, 9, 10, -1, -1]]


def corrupt(response, answer):
    """Change one character (the last digit or letter) of the answer where it sits in the response."""
    i = response.rfind(answer)
    assert i >= 0, (response, answer)
    j = max(k for k in range(i, i + len(answer)) if response[k].isalnum())
    c = response[j]
    new = ("1" if c == "0" else "0") if c.isdigit() else ("b" if c.lower() == "a" else "a")
    return response[:j] + new + response[j + 1:]


def test_checkers_accept_gold_and_reject_corrupted(splits):
    seen = set()
    for split in ("train", "val", "test"):
        for e in splits[split][:2000]:
            seen.add(e["task"])
            assert data.check(e, e["response"]), e
            assert data.check(e, "  " + e["response"] + "\n"), e  # surrounding whitespace is fine
            bad = corrupt(e["response"], e["answer"])
            assert bad != e["response"]
            assert not data.check(e, bad), (e, bad)
            assert not data.check(e, ""), e
    assert seen == set(data.TASKS)


# ---------------------------------------------------------------------------
# Tokenizer

ROUND_TRIP = [
    "", " ", "hello world", "What is 12 + 34?", "  leading and trailing  ", "tabs\tand\nnewlines\r\n",
    "héllo wörld", "日本語のテキスト", "emoji 🤖🚀 ok", "Ünïcödé — dashes – and “quotes”",
    "Spell the word apple.", "a p p l e reversed is e l p p a", "1234567890", "x" * 300,
    "<|mask|>", "<|endoftext|> <|user|> <|assistant|>", "a<|mask|>b<|mask|><|mask|>", "<|mask", "|>",
]


def test_tokenizer_round_trip(tok, splits):
    for s in ROUND_TRIP + [e["prompt"] + "\n" + e["response"] for e in splits["test"][:100]]:
        ids = tok.encode(s)
        assert all(0 <= i < tok.n_vocab for i in ids)
        assert tok.decode(ids) == s


def test_tokenizer_vocab_and_specials(tok):
    assert tok.n_vocab <= 512
    specials = {tok.eot, tok.mask, tok.user, tok.assistant}
    assert len(specials) == 4 and max(specials) == tok.n_vocab - 1
    assert tok.decode([tok.mask]) == "<|mask|>"
    assert tok.decode([tok.eot]) == "<|endoftext|>"


def test_digits_are_one_token_each(tok):
    for text in ("12345", " 12345", "The answer is 907.", "x 31415926 y"):
        for tid in tok.encode(text):
            piece = tok.decode([tid])
            if any(c.isdigit() for c in piece):
                assert piece.strip().isdigit() and len(piece.strip()) == 1, (text, piece)
    pieces = [tok.decode([t]) for t in tok.encode("12345")]
    assert [p.strip() for p in pieces] == list("12345")


def test_special_token_text_is_ordinary_text(tok):
    specials = {tok.eot, tok.mask, tok.user, tok.assistant}
    for s in ("<|mask|>", "<|endoftext|>", "<|user|>", "<|assistant|>",
              "Repeat <|mask|> and <|endoftext|> after <|user|><|assistant|>"):
        ids = tok.encode(s)
        assert not specials & set(ids), s
        assert tok.decode(ids) == s
    ids = tok.prompt_ids("say <|mask|>")
    assert ids[:2] == [tok.eot, tok.user] and ids[-1] == tok.assistant
    assert tok.mask not in ids


def test_tokenizer_state_round_trip(tok, tmp_path):
    state = tok.state()
    path = tmp_path / "tok.pt"
    torch.save({"tokenizer": state}, path)
    loaded = torch.load(path, weights_only=True)["tokenizer"]
    tok2 = tokenizer.Tokenizer.from_state(loaded)
    assert tok2.n_vocab == tok.n_vocab
    assert (tok2.eot, tok2.mask, tok2.user, tok2.assistant) == (tok.eot, tok.mask, tok.user, tok.assistant)
    for s in ROUND_TRIP:
        assert tok2.encode(s) == tok.encode(s)
        assert tok2.decode(tok.encode(s)) == s


def test_pattern_and_tokens_alone_load_as_the_toy(tok):
    """A state of only {"pattern", "tokens"} is the toy's: its chat format,
    <|endoftext|><|user|>prompt<|assistant|>response<|endoftext|>, and the specials after the vocabulary."""
    toy = tokenizer.Tokenizer.from_state({"pattern": tok.pattern, "tokens": tok.state()["tokens"]})
    n = len(tok.state()["tokens"])
    assert (toy.eot, toy.mask, toy.user, toy.assistant, toy.n_vocab) == (n, n + 1, n + 2, n + 3, n + 4)
    prompt = [n, n + 2, *tok.encode("Hi <|user|>"), n + 3]
    assert toy.example_ids("Hi <|user|>", "Yo") == (prompt + tok.encode("Yo") + [n], len(prompt))
    assert toy.prompt_ids([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}]) == [n, n + 2, *tok.encode("a"), n + 3, *tok.encode("b"),
                                                                  n, n + 2, *tok.encode("c"), n + 3]
    with pytest.raises(ValueError, match="user and assistant turns only"):
        toy.prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


def test_long_whitespace_is_refused_not_a_panic(tok, monkeypatch):
    """tiktoken's regex engine panics (pyo3's PanicException, a BaseException) on a run of about a million
    spaces: encode refuses text longer than MAX_CHARS with a ValueError naming the limit, and any panic
    left becomes a ValueError too."""
    fits = "a" + " " * (tokenizer.MAX_CHARS - 1)
    assert tok.decode(tok.encode(fits)) == fits
    for text in ("a" + " " * 1_000_000, " " * 1_000_000 + "b", "x" * (tokenizer.MAX_CHARS + 1)):
        with pytest.raises(ValueError, match="the tokenizer takes at most 500,000"):
            tok.encode(text)
    with pytest.raises(ValueError, match="the tokenizer takes at most 500,000"):
        tok.prompt_ids("Hi" + " " * 1_000_000)
    monkeypatch.setattr(tokenizer, "MAX_CHARS", 10 ** 7)  # without the limit, tiktoken panics
    with pytest.raises(ValueError, match="the tokenizer failed on this text"):
        tok.encode("a" + " " * 1_000_000)


# ---------------------------------------------------------------------------
# Batching

def test_example_ids_layout(tok):
    ids, n_prompt = tok.example_ids("What is 2 + 3?", "The answer is 5.")
    assert ids[:n_prompt] == tok.prompt_ids("What is 2 + 3?")
    assert ids[n_prompt:] == tok.encode("The answer is 5.") + [tok.eot]


def test_make_batch_targets_cover_exactly_the_response(tok, splits):
    examples = splits["train"][:7]
    rows = [tok.example_ids(e["prompt"], e["response"]) for e in examples]
    x, y = data.make_batch(rows, tok.eot)
    T = max(len(ids) - 1 for ids, _ in rows)
    assert x.shape == y.shape == (len(rows), T)
    assert len({len(ids) for ids, _ in rows}) > 1, "want ragged rows"
    for i, (e, (ids, n_prompt)) in enumerate(zip(examples, rows)):
        L = len(ids) - 1
        assert x[i, :L].tolist() == ids[:-1]
        assert (x[i, L:] == tok.eot).all()  # padding
        targets = y[i][y[i] != -1].tolist()
        assert targets == tok.encode(e["response"]) + [tok.eot]
        # and they sit where x holds the token before each of them
        assert (y[i, :n_prompt - 1] == -1).all()
        assert y[i, n_prompt - 1:L].tolist() == ids[n_prompt:]
        assert (y[i, L:] == -1).all()


def test_tokenize_drops_too_long(tok):
    ex = [dict(prompt="hi", response="ok"), dict(prompt="hi " * 100, response="ok")]
    rows = data.tokenize(ex, tok, max_seq_len=64)
    assert len(rows) == 1 and rows[0] == tok.example_ids("hi", "ok")


def test_tokenize_measures_the_length_after_the_mars_padding(tok):
    """An example that fits the context only before its <|endoftext|> padding to a multiple of B is dropped."""
    ids, _ = tok.example_ids("hi", "ok")
    fits = len(ids) - 1  # the inputs are ids[:-1]
    ex = [dict(prompt="hi", response="ok")]
    assert data.tokenize(ex, tok, fits) and data.tokenize(ex, tok, fits, multiple=1)
    B = next(b for b in (3, 4, 5, 6, 7) if len(ids) % b)  # a B that pads it
    assert not data.tokenize(ex, tok, fits, multiple=B)
    x, _ = data.make_batch(data.tokenize(ex, tok, fits + B, multiple=B), tok.eot, B)
    assert x.shape[1] <= fits + B


# ---------------------------------------------------------------------------
# Users' JSONL data

def test_load_jsonl_both_formats(tmp_path):
    """The toy's reader takes {prompt, response}; extras' reader (records.read_record), handed to
    data's functions, takes conversations too, and names what the toy's reader refuses."""
    path = tmp_path / "d.jsonl"
    lines = []
    for i in range(60):
        if i % 2:
            lines.append({"prompt": f"question {i}?", "response": f"answer {i}"})
        else:
            lines.append({"messages": [{"role": "user", "content": f"question {i}?"},
                                       {"role": "assistant", "content": f"answer {i}"}]})
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    s = data.load_jsonl(str(path), read=records.read_record)
    loaded = sorted((e["prompt"], e["response"]) for split in s.values() for e in split)
    assert loaded == sorted((f"question {i}?", f"answer {i}") for i in range(60))
    for split, examples in s.items():
        for e in examples:
            assert data.split_of(e["prompt"]) == split
    for r in lines[1::2]:  # the toy's form reads the same through either reader
        assert data.read_record(r) == records.read_record(r)
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: malformed record (expected "
                                                   '{"prompt": "...", "response": "..."}; python -m '
                                                   "extras.real.train --data reads")):
        data.load_jsonl(str(path))


def test_the_root_checks_exactly_and_records_falls_back_to_it(tmp_path):
    """data.check knows the toy's tasks and "custom" (exact); records.check scores task "number" by
    its final number (tests/test_hf_train.py) and is data.check on everything else."""
    e = {"task": "number", "prompt": "Q2", "answer": "72"}
    assert not data.check(e, "so she has 72.0") and data.check(e, " 72 ")  # the root: exact
    assert records.check(e, "so she has 72.0")
    toy = data.build_instruction_set(0, n_train=20, n_val=0, n_test=0)["train"][:5]
    assert all(records.check(x, x["response"]) and data.check(x, x["response"]) for x in toy)
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "Q1", "answer": "48/2 = 24\n#### 24"}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: no response to train on")):
        data.load_jsonl(str(path), read=records.read_record)
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: malformed record (expected {{")):
        data.read_jsonl(str(path))


@pytest.mark.parametrize("read", [data.read_record, records.read_record])
@pytest.mark.parametrize("bad", [
    "{not json",
    '{"prompt": "only a prompt"}',
    '{"prompt": 3, "response": "x"}',
    '{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}',
    '{"messages": [{"role": "user", "content": "q"}]}',
    '[1, 2]',
])
def test_load_jsonl_malformed_line_names_file_and_line(tmp_path, bad, read):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n' + bad + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: malformed record (")):
        data.load_jsonl(str(path), read=read)


def test_train_cli_bad_jsonl_is_one_line_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"\n')
    proc = run_cli(["train.py", "--data", path, "--preset", "tiny", "--out_dir", tmp_path / "out"], timeout=120)
    assert_one_line_error(proc)
    assert "bad.jsonl:2:" in proc.stderr


# ---------------------------------------------------------------------------
# Checkpoints: common.py reads our .pt files alone, tensors and plain types alone


class Runs:
    """Pickled as a call of print: loading it without weights_only would run it."""

    def __reduce__(self):
        return print, ("a pickled object ran",)


def test_load_checkpoint_refuses_a_pickled_object(tmp_path, capsys):
    path = tmp_path / "object.pt"
    torch.save({"model": Runs(), "model_config": {}, "tokenizer": {}}, path)
    with pytest.raises(common.UserError, match=re.escape(f"not a readable checkpoint of this project: {path}")) as e:
        common.load_checkpoint(path)
    assert "\n" not in str(e.value) and "ran" not in capsys.readouterr().out
    with pytest.raises(common.UserError, match=re.escape(f"checkpoint not found: {tmp_path / 'x.pt'} "
                                                         "(train one with: python train.py)")):
        common.load_checkpoint(tmp_path / "x.pt")


def test_a_real_models_tokenizer_is_for_extras(tok):
    """A state with its own chat template (a real model's) loads through extras/checkpoints, not the toy's class."""
    state = {**tok.state(), "chat_template": "{{ messages }}"}
    with pytest.raises(ValueError, match="a real model's tokenizer and chat template: python -m extras.engine"):
        tokenizer.Tokenizer.from_state(state)
    ckpt = {"model": {}, "model_config": {}, "tokenizer": state}
    with pytest.raises(common.UserError, match="a real model's tokenizer and chat template: python -m extras.engine"):
        common.model_from_checkpoint(ckpt)
