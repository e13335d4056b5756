"""Hugging Face directories (extras/checkpoints/hf.py, hf_tokenizer.py and foreign.py, python -m extras.engine on them) against
transformers and tokenizers, offline: tiny random Qwen2 and Llama models and byte-level BPE
tokenizers are built here, never downloaded. Every parameter is perturbed first (transformers
initialises biases to 0 and norms to 1, which would hide a wrong mapping), and the padding rows
of the output head are made to win (the sampler must never emit them)."""
import io
import json
import os
import random
import re
import runpy
import shutil
import unicodedata
from dataclasses import asdict

import pytest
import safetensors.torch
import tokenizers
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

import tokenizer
from extras.checkpoints import foreign, hf, hf_tokenizer
import common
from common import UserError
from extras.engine import engine
from conftest import assert_one_line_error, run_cli
from model import GPT, GPTConfig

QWEN_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Qwen2.5-Instruct's template without its tool-calling branches (same whitespace control)
QWEN_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# Llama-3-Instruct's template
LLAMA3_TEMPLATE = r"""{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

PIECES = ["hello", " world", "The", " the", "café", "cafe\u0301", "A\u030angstr\u00f6m", "naïve", "\ufb01ne", "日本語",
          "中文文本", "한국어", "😀", "👍🏽", "👨\u200d👩\u200d👧", "❤️", "12345", " 3.14", "2024", "7", " ", "  ", "    ",
          "\t", "\n", "\r\n", "\n\n", "'s", "'LL", "I'm", " don't", "!!!", "...", "$", "€", "αβγ", "Привет", "مرحبا",
          "\u00a0", "\u3000", "Ω", "x", "(", ")", "{", "}", "_", "-", ",", ".", "?", "<", "|", ">", "<|", "|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. I'm sure they'll see it, don't you think?",
          "Numbers: 12345, 3.14159 and 2024-06-01! Prices: $5, €7.", "Café, naïve façade, résumé, Ångström.",
          "日本語のテキストと中文文本，还有한국어。", "Emoji: 😀👍🏽🎉❤️", "def f(x):\n    return x ** 2\r\n",
          "  leading   spaces\t\ttabs\n\n\nnewlines", "Привет мир, αβγ, مرحبا"]


def some_strings(n=1200, seed=0):
    rng = random.Random(seed)
    out = PIECES + CORPUS + ["", " ", "\r\n\r\n", "   \n  ", "a" * 50, "1" * 20]
    return out + ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def train_bpe(kind, path):
    """tokenizer.json: byte-level BPE in Qwen2's pipeline (NFC, Split regex + ByteLevel), its specials
    after the vocabulary; or in Llama 3's (no normaliser), its specials first (ids held by added tokens)."""
    t = tokenizers.Tokenizer(models.BPE())
    if kind == "qwen2":
        t.normalizer = normalizers.NFC()
    regex = QWEN_REGEX if kind == "qwen2" else LLAMA3_REGEX
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if kind == "qwen2" else \
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[] if kind == "qwen2" else specials, show_progress=False)
    t.train_from_iterator(CORPUS * 20 + some_strings(200, seed=1), trainer)
    if kind == "qwen2":
        t.add_special_tokens(specials)
    t.save(str(path / "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", chat_template=QWEN_TEMPLATE, eos_token="<|im_end|>",
                  pad_token="<|endoftext|>") if kind == "qwen2" else \
        dict(tokenizer_class="PreTrainedTokenizerFast", chat_template=LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
             eos_token="<|eot_id|>")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return t.get_vocab_size()


def perturb(m, n_tok, seed=0):
    """Every parameter random (norms around 1, biases around 0); the output rows past the tokenizer large.
    A tied model gets smaller embeddings and larger layers, or it would only repeat its input."""
    g = torch.Generator().manual_seed(seed)
    embed, layers = (0.5, 0.4) if m.config.tie_word_embeddings else (1.0, 0.15)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in name else 0.3 * noise if name.endswith("bias") else
                    embed * noise if "embed" in name else layers * noise)
        m.get_output_embeddings().weight[n_tok:] *= 5


def build(kind, path, tie, **shape):
    path.mkdir()
    n_tok = train_bpe(kind, path)
    Config, Model = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if kind == "qwen2" else
                     (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    cfg = Config(vocab_size=n_tok + 6, max_position_embeddings=256, num_hidden_layers=2, tie_word_embeddings=tie,
                 rms_norm_eps=1e-5, **shape)
    torch.manual_seed(0)
    m = Model(cfg).float()
    perturb(m, n_tok)
    m.save_pretrained(path, max_shard_size="40KB" if kind == "qwen2" else "50MB")
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    # Qwen2: untied head, GQA (4 query heads, 2 kv heads), head_dim 16 != 48 / 4, sharded weights
    qwen = build("qwen2", root / "qwen", tie=False, hidden_size=48, intermediate_size=80, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_theta=5000.0)
    # Llama: tied head, one file
    llama = build("llama", root / "llama", tie=True, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=4)
    # laid out like the authors' MARS release: model_type a2d-qwen2, <|mask|> an added token, blk4 in the name
    mars = root / "MARS-tiny-blk4"
    shutil.copytree(qwen, mars)
    cfg = json.loads((mars / "config.json").read_text())
    (mars / "config.json").write_text(json.dumps({**cfg, "model_type": "a2d-qwen2", "architectures": ["A2DQwen2LMHeadModel"]}))
    t = tokenizers.Tokenizer.from_file(str(mars / "tokenizer.json"))
    t.add_special_tokens(["<|mask|>"])
    t.save(str(mars / "tokenizer.json"))
    return {"qwen2": qwen, "llama": llama, "mars": mars}


def ours(path):
    _, model, tok = foreign.load(path)
    return model, tok


def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_logits_equal_transformers_with_shifted_positions_and_cache(dirs, kind):
    model, tok = ours(dirs[kind])
    ref = reference(dirs[kind])
    assert model.config.tie_embeddings == (kind == "llama") and (model.config.n_kv_head < model.config.n_head) == (kind == "qwen2")
    ids = torch.randint(0, tok.n_vocab - 1, (2, 17), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(17) + torch.tensor([[0], [11]])
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=pos).logits
        assert want.abs().max() > 1
        assert (model(ids, positions=pos) - want).abs().max() < 1e-4
        # KV-cached decoding: a prompt of 9, then one token at a time, against transformers' full forward
        want = ref(input_ids=ids).logits
        kv = model.new_cache(2, 32)
        got = torch.cat([model(ids[:, :9], cache=kv)] + [model(ids[:, t:t + 1], cache=kv) for t in range(9, 17)], 1)
        assert (got - want).abs().max() < 1e-4


def run_engine(capsys, monkeypatch, path, *flags, prompt="Hello café 日本 😀 12345", stdin=None):
    """`python -m extras.engine --json ...` in this process; the ids of each answer."""
    capsys.readouterr()
    args = ["--ckpt", str(path), "--json", "--max_new_tokens", "12", "--device", "cpu", *flags]
    if stdin is None:
        args += ["--prompt", prompt]
    else:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        args += ["--chat"]
    monkeypatch.setattr("sys.argv", ["extras/engine", *args])
    runpy.run_module("extras.engine", run_name="__main__")
    return [json.loads(line)["ids"] for line in capsys.readouterr().out.splitlines() if line.strip()]


def hf_greedy(path, tok, prompt="Hello café 日本 😀 12345", n=12):
    """transformers' greedy generate on apply_chat_template's ids, ids without a token suppressed as ours are."""
    hftok = transformers.AutoTokenizer.from_pretrained(path)
    x = hftok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    x = torch.tensor([x["input_ids"]])
    assert x[0].tolist() == tok.prompt_ids(prompt)
    ref = reference(path)
    rows = ref.config.vocab_size
    out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                   eos_token_id=tok.eot, pad_token_id=tok.eot,
                                   suppress_tokens=[tok.mask, *range(tok.n_vocab, rows)])
    return out[0, x.shape[1]:].tolist()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_ar_greedy_generation_through_the_chat_template(dirs, kind, capsys, monkeypatch):
    _, tok = ours(dirs[kind])
    want = hf_greedy(dirs[kind], tok)
    assert len(want) == 12 and any(t != want[0] for t in want)
    assert run_engine(capsys, monkeypatch, dirs[kind], "--ar") == [want]


def test_mars_release_threshold_lossless_caches_chat(dirs, capsys, monkeypatch):
    ckpt = hf.read_checkpoint(dirs["mars"])
    assert ckpt["mars"] == {"B": 4} and ckpt["hf"]["model_type"] == "a2d-qwen2" and "train_config" not in ckpt
    tok = hf_tokenizer.tokenizer_from_state(ckpt["tokenizer"])
    _, plain = ours(dirs["qwen2"])
    assert tok.mask == plain.mask == plain.n_vocab - 1 and tok.decode([tok.mask]) == "<|mask|>"
    want = hf_greedy(dirs["qwen2"], plain)  # the same weights, as transformers' Qwen2
    run = lambda *flags, **kw: run_engine(capsys, monkeypatch, dirs["mars"], *flags, **kw)  # noqa: E731
    assert run("--ar") == [want]
    for flags in [("--threshold", "1.0"), ("--threshold", "1.0", "--cache", "block"), ("--threshold", "1.0", "--cache", "none"),
                  ("--lossless",), ("--lossless", "--cache", "none"), ("--ar", "--cache", "block"), ("--ar", "--cache", "none")]:
        assert run(*flags) == [want], flags
    assert run("--threshold", "1.0", stdin="Hello café 日本 😀 12345\n") == [want]
    got = run("--threshold", "0.01")[0]  # accepts several per forward: only real tokens
    assert len(got) == 12 and all(t < tok.n_vocab and t != tok.mask for t in got)


def test_sampler_never_emits_ids_without_a_token(dirs):
    model, tok = ours(dirs["qwen2"])  # its padding rows' logits are large: unbanned, they win
    prompt = [tok.prompt_ids("Hi there")]
    free = engine.generate_batch(model, prompt, tok.eot, tok.mask, max_new_tokens=12)[0].tokens
    assert any(t >= tok.n_vocab for t in free)
    for kw in [dict(), dict(B=4, tau=0.5), dict(B=4, tau=0.5, cache="block"), dict(B=4, lossless=True),
               dict(temperature=1.0)]:
        got = engine.generate_batch(model, prompt, tok.eot, tok.mask, max_new_tokens=12, n_vocab=tok.n_vocab,
                                    **kw)[0].tokens
        assert len(got) == 12 and max(got) < tok.n_vocab and tok.mask not in got, kw


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_tokenizer_ids_equal_tokenizers(dirs, kind):
    tok = hf_tokenizer.tokenizer_from_state(hf.read_checkpoint(dirs[kind])["tokenizer"])  # through a checkpoint's state
    assert isinstance(tok, hf_tokenizer.HFTokenizer)
    ref = tokenizers.Tokenizer.from_file(str(dirs[kind] / "tokenizer.json"))
    strings = some_strings()
    assert len(strings) >= 1000
    for s in strings:
        ids = tok.encode(s)
        assert ids == ref.encode(s, add_special_tokens=False).ids, repr(s)
        assert tok.decode(ids) == (unicodedata.normalize("NFC", s) if kind == "qwen2" else s)
    if kind == "qwen2":
        assert tok.encode("cafe\u0301") == tok.encode("café")  # NFC, as Qwen2's normaliser


def test_each_saved_state_loads_through_its_class(dirs):
    """A toy's tokenizer state, as written now or with the real models' fields it once carried, loads as
    tokenizer.Tokenizer; a real model's as HFTokenizer; each encodes as the tokenizer that saved it."""
    toy, texts = tokenizer.Tokenizer.train(CORPUS * 5, 300), some_strings(100)
    old = {**toy.state(), "ordinary": {}, "normalizer": None, "template_vars": {}}
    for state in (toy.state(), old):
        again = hf_tokenizer.tokenizer_from_state(state)
        assert type(again) is tokenizer.Tokenizer and [again.encode(t) for t in texts] == [toy.encode(t) for t in texts]
    _, real = ours(dirs["qwen2"])
    again = hf_tokenizer.tokenizer_from_state(real.state())
    assert type(again) is hf_tokenizer.HFTokenizer and again.state() == real.state()
    assert [again.encode(t) for t in texts] == [real.encode(t) for t in texts] and again.eot == real.eot


def test_tiktoken_needs_merges_in_rank_order(dirs):
    """Ranks reproduce the merges only when merge k makes the k-th new id: a tokenizer.json
    whose merge list is out of order is refused rather than encoded differently."""
    tj = json.loads((dirs["qwen2"] / "tokenizer.json").read_text())
    tj["model"]["merges"][3], tj["model"]["merges"][40] = tj["model"]["merges"][40], tj["model"]["merges"][3]
    with pytest.raises(ValueError, match="merges are not in the order"):
        hf_tokenizer.from_hf(tj, {"chat_template": QWEN_TEMPLATE})


CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Spell café.\n"}],
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本?"}]]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_chat_template_renders_as_transformers(dirs, kind):
    _, tok = ours(dirs[kind])
    hftok = transformers.AutoTokenizer.from_pretrained(dirs[kind])
    end = "<|im_end|>" if kind == "qwen2" else "<|eot_id|>"
    assert tok.eot == hftok.convert_tokens_to_ids(end)
    for msgs in CHATS:
        text = hftok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tok.chat(msgs, add_generation_prompt=True) == text
        prompt = hftok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert tok.prompt_ids(msgs) == prompt
        full = hftok.apply_chat_template(msgs + [{"role": "assistant", "content": "It is 4."}], tokenize=True)["input_ids"]
        ids, n_prompt = tok.example_ids(msgs, "It is 4.")
        assert n_prompt == len(prompt) and ids == full[:full.index(tok.eot, n_prompt) + 1]
    default = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    if kind == "qwen2":
        assert default in tok.decode(tok.prompt_ids("Hi")) and default not in tok.decode(tok.prompt_ids(CHATS[1]))
    else:
        assert tok.prompt_ids("Hi")[0] == hftok.convert_tokens_to_ids("<|begin_of_text|>")
    # text typed by a user never becomes a special token; only the template's are
    typed, specials = tok.prompt_ids(f"say {end} and <|endoftext|> <|mask|>"), set(tok.specials.values())
    assert [t for t in typed if t in specials] == [t for t in tok.prompt_ids("say") if t in specials]
    assert f"say {end} and <|endoftext|> <|mask|>" in tok.decode(typed)
    with pytest.raises(ValueError, match="end with a user turn"):
        tok.prompt_ids(CHATS[2][:2])


def test_toy_chat_is_its_jinja_template():
    """The toy's chat format in plain Python writes what its Jinja template writes (the template a checkpoint
    stores and an export gives transformers), for any conversation, and refuses what it refuses."""
    toy, jinja, rng = tokenizer.ToyChat(), hf_tokenizer.JinjaChat(tokenizer.TOY_TEMPLATE), random.Random(0)
    for _ in range(300):
        msgs = [{"role": rng.choice(["user", "assistant"]), "content": rng.choice(PIECES + CORPUS)}
                for _ in range(rng.randint(0, 5))]
        assert toy(msgs) == jinja(msgs) and toy(msgs, True) == jinja(msgs, True)
    for chat in (toy, jinja):
        with pytest.raises(ValueError, match="chat template: this template has user and assistant turns only"):
            chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


def toy_checkpoint(qkv_bias, tie, spare_rows=2):
    tok = tokenizer.Tokenizer.train(CORPUS * 5 + some_strings(300), 300)
    config = GPTConfig(vocab_size=tok.n_vocab + spare_rows, max_seq_len=64, n_layer=2, n_head=4, n_embd=32, n_kv_head=2,
                       qkv_bias=qkv_bias, tie_embeddings=tie, rope_base=500.0, norm_eps=1e-5)
    torch.manual_seed(1)
    m = GPT(config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(0.3 * torch.randn_like(p))
    return {"model": m.state_dict(), "model_config": asdict(config), "tokenizer": tok.state(), "mars": {"B": 8}}


def assert_exported_equal(ckpt, out):
    model, tok = common.build_model(ckpt), hf_tokenizer.tokenizer_from_state(ckpt["tokenizer"])
    ref = reference(out)
    assert type(ref).__name__ == ("Qwen2ForCausalLM" if model.config.qkv_bias else "LlamaForCausalLM")
    ids = torch.randint(0, tok.n_vocab, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert want.abs().max() > 0.5 and (model(ids) - want).abs().max() < 1e-4
    hftok = transformers.AutoTokenizer.from_pretrained(out)
    fast = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for s in some_strings(300):
        assert fast.encode(s, add_special_tokens=False).ids == tok.encode(s), repr(s)
    for msgs in CHATS[:1] + CHATS[2:]:
        assert hftok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"] == tok.prompt_ids(msgs)
    assert hftok.convert_tokens_to_ids("<|mask|>") == tok.mask and hftok.eos_token_id == tok.eot
    back = hf.read_checkpoint(out)  # and the export reads back as it was (a row may have been added for <|pad|>)
    rows = max(model.config.vocab_size, tok.n_vocab + 1)
    assert back.get("mars") == ckpt.get("mars") and back["model_config"] == {**asdict(model.config), "vocab_size": rows}
    again = hf_tokenizer.tokenizer_from_state(back["tokenizer"])
    assert again.prompt_ids(CHATS[2]) == tok.prompt_ids(CHATS[2]) and again.n_vocab == tok.n_vocab


@pytest.mark.parametrize("qkv_bias,tie,old_names", [(False, True, True), (True, False, False)])
def test_export_toy_checkpoint_round_trip(tmp_path, qkv_bias, tie, old_names):
    """old_names: a checkpoint written before GPT.layers, its layers' weights named "blocks.N...", exports the same."""
    ckpt = toy_checkpoint(qkv_bias, tie)
    path = tmp_path / "toy.pt"
    old = {k.replace("layers.", "blocks.", 1): v for k, v in ckpt["model"].items()}
    assert old.keys() != ckpt["model"].keys()
    torch.save({**ckpt, "model": old} if old_names else ckpt, path)
    proc = run_cli(["extras/checkpoints/export.py", path, tmp_path / "out"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mars_block_size"] == 8
    assert_exported_equal(ckpt, tmp_path / "out")


@pytest.mark.parametrize("spare_rows", [0, 2])
def test_export_pad_token_keeps_left_padded_batches_exact(tmp_path, spare_rows):
    """The export's pad token is none of the prompt's tokens (the toy's prompts start with its end-of-text):
    transformers' greedy generate on a left-padded batch equals ours row by row, whether the attention mask
    comes from the tokenizer's padding or, as in the official samplers, from ids != pad_token_id."""
    ckpt = toy_checkpoint(qkv_bias=False, tie=spare_rows == 0, spare_rows=spare_rows)  # 0: as train.py's toy
    hf.export(ckpt, tmp_path)
    model, tok = common.model_from_checkpoint(ckpt)
    pad = json.loads((tmp_path / "config.json").read_text())["pad_token_id"]
    hftok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert pad == tok.n_vocab == hftok.pad_token_id == json.loads((tmp_path / "generation_config.json").read_text())[
        "pad_token_id"] and hftok.padding_side == "left" and hftok.pad_token == "<|pad|>"
    prompts = ["Hi", "What is 12 + 34?", "Café, naïve façade, résumé.", "日本語 😀 and more?"]
    ids = [tok.prompt_ids(p) for p in prompts]
    assert len(set(map(len, ids))) == len(ids) and all(x[0] == tok.eot for x in ids)
    assert pad not in {t for x in ids for t in x}
    batch = hftok.apply_chat_template([[{"role": "user", "content": p}] for p in prompts], add_generation_prompt=True,
                                      padding=True, return_tensors="pt", return_dict=True)
    assert [row[row != pad].tolist() for row in batch["input_ids"]] == ids
    want = [r.tokens for r in engine.generate_batch(model, ids, tok.eot, tok.mask, max_new_tokens=12,
                                                     n_vocab=tok.n_vocab)]
    ref = reference(tmp_path)
    for mask in (batch["attention_mask"], (batch["input_ids"] != pad).long()):
        out = ref.generate(batch["input_ids"], attention_mask=mask, do_sample=False, max_new_tokens=12,
                           suppress_tokens=[tok.mask, *range(tok.n_vocab, ref.config.vocab_size)])
        got = [row.tolist() for row in out[:, batch["input_ids"].shape[1]:]]
        assert [g[:g.index(tok.eot) + 1] if tok.eot in g else g for g in got] == want


def test_export_of_a_hugging_face_model_round_trip(dirs, tmp_path):
    ckpt = hf.read_checkpoint(dirs["qwen2"])
    hf.export(ckpt, tmp_path / "out")
    assert "mars" not in ckpt and "mars_block_size" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert_exported_equal(ckpt, tmp_path / "out")


def test_command_line_refusals(dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(dirs["llama"], bad)
    (bad / "model.safetensors").write_bytes(b"")
    proc = run_cli(["extras/checkpoints/export.py", bad, tmp_path / "out"])
    assert_one_line_error(proc)
    assert f"error: {bad}: model.safetensors: not a readable safetensors file" in proc.stderr
    # no held-out prompts of its own
    proc = run_cli(["extras/engine/__main__.py", "--ckpt", dirs["llama"], "--ar", "--device", "cpu"])
    assert_one_line_error(proc)
    assert "give --prompt or --chat" in proc.stderr
    # the root reads our .pt files alone, and names the command that reads a real model
    proc = run_cli(["sample.py", "--ckpt", dirs["llama"], "--ar", "--device", "cpu"])
    assert_one_line_error(proc)
    assert f"python -m extras.engine --ckpt {dirs['llama']}" in proc.stderr
    with pytest.raises(UserError, match=re.escape(f"{dirs['llama']} is a real model, not a checkpoint of ours")):
        common.load_checkpoint(dirs["llama"])


def damage(path, file, change):
    """path/file rewritten: bytes are its content, a slice keeps that part of it, a dict is merged into its
    JSON, a function maps its tensors."""
    f = path / file
    if isinstance(change, (bytes, slice)):
        f.write_bytes(change if isinstance(change, bytes) else f.read_bytes()[change])
    elif isinstance(change, dict):
        f.write_text(json.dumps({**json.loads(f.read_text()), **change}))
    else:
        save_file(change(safetensors.torch.load_file(f)), f)


LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
W, C, T = "model.safetensors", "config.json", "tokenizer_config.json"
DAMAGED = {  # case: (directory, file, change, what the one-line error says)
    "truncated": ("llama", W, slice(-100), "model.safetensors: not a readable safetensors file"),
    "empty": ("llama", W, b"", "model.safetensors: not a readable safetensors file"),
    "garbage": ("llama", W, b"garbage" * 100, "model.safetensors: not a readable safetensors file"),
    "missing key": ("llama", W, lambda w: {k: v for k, v in w.items() if "layers.1.mlp.up" not in k},
                    "model.safetensors: no weight model.layers.1.mlp.up_proj.weight"),
    "extra key": ("llama", W, lambda w: {**w, "model.layers.0.mlp.fc.weight": w["model.norm.weight"].clone()},
                  "model.safetensors: unexpected weight model.layers.0.mlp.fc.weight"),
    "shape": ("llama", C, {"intermediate_size": 96},
              "model.safetensors: model.layers.0.mlp.gate_proj.weight has shape [64, 32], config.json says [96, 32]"),
    "shard ..": ("qwen2", hf.INDEX, {"weight_map": {"x": "../../x.safetensors"}},
                 "model.safetensors.index.json: shard '../../x.safetensors' is outside the model directory"),
    "shard /etc": ("qwen2", hf.INDEX, {"weight_map": {"x": "/etc/passwd"}}, "shard '/etc/passwd' is outside"),
    "config list": ("llama", C, b"[1, 2]", "config.json: not a JSON object"),
    "config text": ("llama", C, b"{", "config.json: not valid JSON"),
    "model_type": ("llama", C, {"model_type": "mistral"}, "config.json: model_type 'mistral' is not supported"),
    "rope string": ("llama", C, {"rope_scaling": "linear"}, "config.json: rope_scaling must be an object"),
    "rope llama3": ("llama", C, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling 'llama3' is not"),
    "rope yarn": ("llama", C, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_scaling 'yarn' is not"),
    "sliding": ("llama", C, {"use_sliding_window": True}, "config.json: sliding-window attention is not supported"),
    "bias": ("llama", C, {"attention_bias": True}, "config.json: ['attention_bias'] is not supported"),
    "layers string": ("llama", C, {"num_hidden_layers": "2"}, "config.json: num_hidden_layers must be a positive"),
    "no mask row": ("llama", C, {"vocab_size": 100}, "no spare embedding row for <|mask|>"),
    "few rows": ("mars", C, {"vocab_size": 300}, "config.json: vocab_size 300 is smaller than the tokenizer's"),
    "B = 0": ("mars", C, {"mars_block_size": 0}, "config.json: mars_block_size must be an integer >= 1"),
    "tokenizer": ("llama", "tokenizer.json", b"{}", "tokenizer.json: not a tokenizer this loader reads"),
    "syntax": ("llama", T, {"chat_template": "{{ m.content }"}, "tokenizer_config.json: chat template: line 1"),
    "jinja file": ("qwen2", "chat_template.jinja", b"{% if %}", "chat_template.jinja: chat template: line 1"),
    "include": ("llama", T, {"chat_template": "{% include 'x' %}"}, "a chat template must be self-contained"),
    "recursion": ("llama", T, {"chat_template": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"}, "RecursionError"),
    "range": ("llama", T, {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}, "a number over 500,000"),
    "nested loops": ("llama", T, {"chat_template": LOOPS}, "chat template: it ran longer than 1 s"),
    "output": ("llama", T, {"chat_template": "{% for i in range(99999) %}{{ messages }}{% endfor %}"},
               "chat template: it wrote more than 500,000 characters"),
    "doubling": ("llama", T, {"chat_template": "{% set n = namespace(s='ab') %}{% for i in range(99) %}"
                                               "{% set n.s = n.s ~ n.s %}{% endfor %}"}, "a value longer than 500,000"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_directory_is_one_line_naming_the_file(dirs, tmp_path, case):
    kind, file, change, words = DAMAGED[case]
    bad = tmp_path / "MARS-blk4" if kind == "mars" else tmp_path / "bad"
    shutil.copytree(dirs[kind], bad)
    damage(bad, file, change)
    with pytest.raises(UserError, match=f"^{re.escape(str(bad))}: .*{re.escape(words)}") as e:
        foreign.load(bad)
    assert "\n" not in str(e.value) and "retrain" not in str(e.value) and "AR checkpoint" not in str(e.value)


def test_damaged_directory_through_the_engine_command_is_one_line(dirs, tmp_path):
    kind, file, change, words = DAMAGED["shape"]
    bad = tmp_path / "bad"
    shutil.copytree(dirs[kind], bad)
    damage(bad, file, change)
    proc = run_cli(["extras/engine/__main__.py", "--ckpt", bad, "--threshold", "0.9", "--prompt", "hi",
                    "--device", "cpu"])
    assert_one_line_error(proc)
    assert f"error: {bad}: {words}" in proc.stderr


def test_a_template_that_runs_away_on_some_conversations_fails_those_alone(dirs):
    """A template checked at load can still run away on a later conversation: that prompt is a ValueError."""
    tok = hf_tokenizer.from_hf(json.loads((dirs["llama"] / "tokenizer.json").read_text()),
                               {"chat_template": "{% if messages[0].role == 'system' %}" + LOOPS + "{% endif %}"
                                + LLAMA3_TEMPLATE, "bos_token": "<|begin_of_text|>"})
    assert tok.prompt_ids("hi") and tok.decode([tok.eot]) == "<|eot_id|>"
    with pytest.raises(ValueError, match="chat template: it ran longer than 1 s"):
        tok.prompt_ids([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="500,000"):  # text that long stops in the template, or in the tokenizer
        tok.prompt_ids("a" + " " * 1_000_000 + "b")
    with pytest.raises(ValueError, match="the tokenizer takes at most 500,000"):  # else tiktoken panics (Llama 3's regex)
        tok.encode("a" + " " * 1_000_000)


@pytest.mark.skipif(not os.environ.get("MARS_HF_CKPT"), reason="set MARS_HF_CKPT to a real checkpoint directory")
def test_real_checkpoint():
    """E.g. MARS_HF_CKPT=~/models/MARS-Qwen2.5-0.5B-blk4: logits, tokenizer, template and greedy ids as transformers'."""
    path = os.environ["MARS_HF_CKPT"]
    ckpt, model, tok = foreign.load(path)
    ref = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32) if ckpt["hf"]["model_type"] == \
        "a2d-qwen2" else reference(path)
    hftok = transformers.AutoTokenizer.from_pretrained(path)
    ids = hftok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.prompt_ids(CHATS[0]) == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (model(x) - ref(input_ids=x).logits).abs().max() < 1e-3
    want = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16, eos_token_id=tok.eot,
                        suppress_tokens=[tok.mask, *range(tok.n_vocab, model.config.vocab_size)])[0, len(ids):].tolist()
    got = engine.generate_batch(model, [ids], tok.eot, tok.mask, max_new_tokens=16, n_vocab=tok.n_vocab)[0].tokens
    assert got == want
    for s in some_strings(300):
        assert tok.encode(s) == hftok.encode(s, add_special_tokens=False), repr(s)


def test_llama3_without_a_spare_row_takes_a_reserved_token_for_mask(dirs, tmp_path):
    """Llama 3 has as many rows as tokens: <|mask|> takes its first reserved special token, which no
    template writes, so MARS still adds no parameter; the template's own tokens keep their ids."""
    t = tokenizers.Tokenizer.from_file(str(dirs["llama"] / "tokenizer.json"))
    t.add_special_tokens(["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((dirs["llama"] / "tokenizer_config.json").read_text())
    full = json.loads((tmp_path / "tokenizer.json").read_text())
    tok = hf_tokenizer.from_hf(full, config, n_rows=t.get_vocab_size())
    assert tok.mask == t.token_to_id("<|reserved_special_token_0|>")
    assert tok.eot == t.token_to_id("<|eot_id|>")
    with pytest.raises(ValueError, match="no spare embedding row"):  # neither a spare row nor a reserved token
        hf_tokenizer.from_hf(json.loads((dirs["llama"] / "tokenizer.json").read_text()), config,
                               n_rows=tokenizers.Tokenizer.from_file(str(dirs["llama"] / "tokenizer.json")).get_vocab_size())


def test_serving_engine_on_a_mars_release(dirs, tmp_path):
    """The serving scheduler's engine on a Hugging Face MARS directory: its answers are generate's (padding rows past the
    tokenizer banned in both), its KV cache is sized by --max_context, not the model's context, and the
    load experiment asks for --data, since such a model has no held-out prompts of ours."""
    from extras.serving import scheduler
    model, tok, B, ckpt = scheduler.load_mars(str(dirs["mars"]), "cpu")
    prompts = [tok.prompt_ids(p) for p in ("Hello café", "日本語のテキスト", "12345 and 😀")]
    for tau in (1.0, 0.5):
        context = max(map(len, prompts)) + 12  # room for the answers, less than the model's 256
        eng = engine.Engine(model, tok.eot, tok.mask, B, 2, 10, n_vocab=tok.n_vocab, max_context=context)
        assert eng.kv.max_len < model.config.max_seq_len
        requests = [engine.Request(p, tau=tau) for p in prompts]
        eng.waiting.extend(requests)
        while eng.backlog:
            eng.step()
        want = engine.generate_batch(model, prompts, tok.eot, tok.mask, B=B, tau=tau, max_new_tokens=10,
                                     n_vocab=tok.n_vocab)
        assert [r.tokens for r in requests] == [g.tokens for g in want]
        assert all(t < tok.n_vocab and t != tok.mask for r in requests for t in r.tokens)
    with pytest.raises(UserError, match="give --data"):
        scheduler.prompts_for_load(ckpt, tok, 256, 2)
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    test, calib = scheduler.prompts_for_load(ckpt, tok, 256, 2, str(path))
    assert test[0]["answer"] == "5" and len(calib) == 24
