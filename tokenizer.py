"""The tokenizer: byte-level BPE served with tiktoken, either trained here with
rustbpe (our toy) or converted from a Hugging Face tokenizer.json (Qwen2,
Llama 3), and the chat template: prompts are rendered with the model's own
Jinja template. Nothing here knows about models, MARS or the task families.
"""
import datetime
import json
import re
import unicodedata

import jinja2
import rustbpe
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

# GPT-4's split pattern, except that digits are split one per token so that
# arithmetic works digit by digit.
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>"]
# GPT-2's pattern: a ByteLevel pre-tokenizer with use_regex splits with it
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Our toy's chat template, <|endoftext|><|user|>prompt<|assistant|>response<|endoftext|>, as Jinja
TOY_TEMPLATE = ("<|endoftext|>{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
                "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content }}<|endoftext|>"
                "{% else %}{{ raise_exception('this template has user and assistant turns only') }}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MARK = "\ufdd0"  # a Unicode noncharacter: put inside a special token's name in message text, it stays text


def byte_alphabet():
    """GPT-2's printable character for each byte: how byte-level BPE vocabularies spell tokens."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def last_merge(ranks, token):
    """The two tokens whose merge makes `token`: byte-level BPE replayed on its bytes."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        k = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
        if ranks.get(parts[k] + parts[k + 1], float("inf")) >= ranks[token]:
            raise ValueError(f"token {token!r} is not reachable by merges of lower rank: not a BPE vocabulary")
        parts[k:k + 2] = [parts[k] + parts[k + 1]]
    return parts


def render_template(template):
    """A compiled chat template, rendered as transformers' apply_chat_template does (jinja2's
    sandbox, trim_blocks, lstrip_blocks, loop controls, raise_exception, tojson, strftime_now)."""
    def raise_exception(message):
        raise jinja2.TemplateError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    return env.from_string(template).render


class Tokenizer:
    """Byte-level BPE with tiktoken, and a chat template.

    One class serves our toy (trained with rustbpe; template
    <|endoftext|><|user|>prompt<|assistant|>response<|endoftext|>) and a Hugging Face
    tokenizer.json (from_hf): its vocabulary as tiktoken ranks, its Split regex, its
    normaliser (applied here with unicodedata), its added tokens, and the model's own Jinja
    chat template, rendered with jinja2 as transformers does, with what the template adds by
    itself (Qwen2.5's default system prompt, Llama 3's BOS).

    Interface (train.py, eval.py, serve.py and sample.py use only this):
      encode(text) -> ids      plain text; a special token's name in it stays text
      decode(ids) -> str
      prompt_ids(prompt)       the rendered prompt, ending with the assistant's header
      example_ids(prompt, response) -> (ids, n_prompt): ids = prompt_ids(prompt) + the
                               response + the template's end of turn (what the template writes
                               after it, e.g. Qwen's "\\n", is left out); the first n_prompt ids
                               are the prompt, the rest is what training scores
      eot                      the template's end of turn (<|endoftext|>, <|im_end|>, <|eot_id|>)
      mask                     <|mask|>;  n_vocab: ids 0..n_vocab-1 have a token
      state() / from_state()   plain types, for checkpoints (a toy's old {"pattern", "tokens"} loads)
    `prompt` is a string (one user turn) or a list of {"role", "content"} messages ending with a
    user turn. Only the template's own special tokens are special: message text is rendered with
    MARK inside every special token's name, then encoded as plain text without it."""

    def __init__(self, pattern, ranks, specials=None, ordinary=None, chat_template=TOY_TEMPLATE,
                 normalizer=None, template_vars=None):
        self.specials = specials or {s: len(ranks) + i for i, s in enumerate(SPECIAL_TOKENS)}
        self.ordinary = ordinary or {}  # added tokens that are not special: plain text may contain them
        self.enc = tiktoken.Encoding("mars", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={**self.specials, **self.ordinary})
        self.pattern, self.chat_template, self.normalizer = pattern, chat_template, normalizer
        self.template_vars = template_vars or {}  # e.g. bos_token, which Llama 3's template writes
        self.n_vocab = 1 + max([*ranks.values(), *self.specials.values(), *self.ordinary.values()])
        self.render_fn = render_template(chat_template)
        self.split = re.compile("|".join(map(re.escape, sorted(self.specials, key=len, reverse=True))))
        self.mask, self.user, self.assistant = (self.specials.get(s) for s in SPECIAL_TOKENS[1:])
        # the end of turn: the first special token the template writes after an assistant's text
        probe = "Probe" + MARK
        text = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}])
        end = self.split.search(text, text.index(probe) + len(probe)) if probe in text else None
        if end is None:
            raise ValueError("the chat template ends an assistant turn with no special token")
        self.eot = self.specials[end.group()]

    @classmethod
    def train(cls, texts, vocab_size):
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
        return cls(SPLIT_PATTERN, dict(bpe.get_mergeable_ranks()))

    def state(self):
        """Plain types only, so a checkpoint loads with weights_only=True. tokens[id] is the hex
        of the token's bytes ("" for an id held by an added token)."""
        tokens = [""] * (1 + max(self.enc._mergeable_ranks.values()))
        for b, i in self.enc._mergeable_ranks.items():
            tokens[i] = b.hex()
        return {"pattern": self.pattern, "tokens": tokens, "specials": self.specials, "ordinary": self.ordinary,
                "chat_template": self.chat_template, "normalizer": self.normalizer, "template_vars": self.template_vars}

    @classmethod
    def from_state(cls, state):
        ranks = {bytes.fromhex(t): i for i, t in enumerate(state["tokens"]) if t}
        return cls(state["pattern"], ranks, state.get("specials"), state.get("ordinary"),
                   state.get("chat_template", TOY_TEMPLATE), state.get("normalizer"), state.get("template_vars"))

    @classmethod
    def from_hf(cls, tokenizer_json, tokenizer_config, chat_template=None, n_rows=None):
        """From the dicts of tokenizer.json and tokenizer_config.json (chat_template: the text of
        chat_template.jinja, where transformers 5 saves it). n_rows: the model's embedding rows;
        without an added <|mask|>, it takes the first row past the tokenizer (as the official
        trainer's add_special_tokens does: no parameter is added), which must exist."""
        model, added = tokenizer_json["model"], {a["content"]: a for a in tokenizer_json.get("added_tokens", [])}
        if model["type"] != "BPE" or model.get("byte_fallback") or model.get("dropout") \
                or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ValueError("tokenizer.json: only byte-level BPE tokenizers are supported")
        to_byte = {c: b for b, c in byte_alphabet().items()}
        vocab = {s: i for s, i in model["vocab"].items() if s not in added}
        if any(c not in to_byte for s in vocab for c in s):
            raise ValueError("tokenizer.json: the vocabulary is not byte-level (GPT-2's byte alphabet)")
        ranks = {bytes(to_byte[c] for c in s): i for s, i in vocab.items()}
        # tiktoken merges the pair whose result has the lowest rank; Hugging Face applies the merges in
        # their order: the same when every merge's result has a higher id than its parts and than earlier results
        last = -1
        for pair in model["merges"]:
            a, b = pair.split(" ") if isinstance(pair, str) else pair
            r = vocab.get(a + b)
            if r is None or r <= max(last, vocab[a], vocab[b]):
                raise ValueError("tokenizer.json: the BPE merges are not in the order of the vocabulary's ids")
            last = r
        pattern = pre_tokenizer_pattern(tokenizer_json.get("pre_tokenizer"))
        norm = tokenizer_json.get("normalizer")
        forms = [n["type"] for n in (norm["normalizers"] if norm["type"] == "Sequence" else [norm])] if norm else []
        if len(forms) > 1 or not set(forms) <= {"NFC", "NFD", "NFKC", "NFKD"}:
            raise ValueError(f"tokenizer.json: unsupported normalizer {forms} (a Unicode normal form or none)")
        specials = {s: a["id"] for s, a in added.items() if a.get("special")}
        ordinary = {s: a["id"] for s, a in added.items() if not a.get("special")}
        if "<|mask|>" not in added:
            free = 1 + max([*ranks.values(), *(a["id"] for a in added.values())])
            # Llama 3 fills every row: a reserved special token, which no template writes, serves instead
            reserved = sorted((i, s) for s, i in specials.items() if s.startswith("<|reserved_special_token"))
            if n_rows is not None and free >= n_rows:
                if not reserved:
                    raise ValueError(f"no spare embedding row for <|mask|>: the tokenizer has {free} tokens and "
                                     f"the model {n_rows} rows")
                free = specials.pop(reserved[0][1])
            specials["<|mask|>"] = free
        template = chat_template or tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        if not template:
            raise ValueError("no chat template (tokenizer_config.json or chat_template.jinja): use an instruct model")
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        tv = {k: v["content"] if isinstance(v, dict) else v for k in names if (v := tokenizer_config.get(k))}
        return cls(pattern, ranks, specials, ordinary, template, forms[0] if forms else None, tv)

    def to_hf(self):
        """(tokenizer.json, tokenizer_config.json) as dicts: the same tokenizer for `tokenizers` and transformers."""
        alphabet, ranks = byte_alphabet(), self.enc._mergeable_ranks
        spell = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
        merges = [[spell(p) for p in last_merge(ranks, b)] for b, _ in sorted(ranks.items(), key=lambda kv: kv[1])
                  if len(b) > 1]
        added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                  "special": s in self.specials} for s, i in sorted({**self.specials, **self.ordinary}.items(),
                                                                    key=lambda kv: kv[1])]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        tokenizer_json = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": self.normalizer} if self.normalizer else None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated", "invert": False},
                byte_level]},
            "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": True,  # as tiktoken: a piece that is a token is that token
                      "vocab": {spell(b): i for b, i in ranks.items()}, "merges": merges}}
        eot = self.decode([self.eot])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": self.chat_template,
                  **self.template_vars, "eos_token": eot, "pad_token": eot, "mask_token": "<|mask|>",
                  "clean_up_tokenization_spaces": False,
                  "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}}
        return tokenizer_json, config

    def encode(self, text):
        """Plain text: the name of a special token in it stays text (added tokens that are not
        special, e.g. Qwen's <tool_call>, are matched as Hugging Face matches them)."""
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        if self.ordinary:
            return self.enc.encode(text, allowed_special=set(self.ordinary), disallowed_special=())
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(ids)

    def render(self, messages, add_generation_prompt=False):
        """The chat text of messages, as transformers' apply_chat_template(tokenize=False) writes it."""
        try:
            return self.render_fn(messages=messages, add_generation_prompt=add_generation_prompt, **self.template_vars)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None

    def chat_ids(self, text):
        """ids of rendered chat text: special tokens where the template wrote them, the rest plain text."""
        ids, pos = [], 0
        for m in self.split.finditer(text):
            ids += self.encode(text[pos:m.start()].replace(MARK, ""))
            ids.append(self.specials[m.group()])
            pos = m.end()
        return ids + self.encode(text[pos:].replace(MARK, ""))

    def messages(self, prompt, response=None):
        """The conversation, with MARK inside any special token's name its text contains."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not msgs or msgs[-1].get("role") != "user":
            raise ValueError("a prompt's messages must end with a user turn")
        msgs += [] if response is None else [{"role": "assistant", "content": response}]
        if not all(isinstance(m.get("content"), str) for m in msgs):
            raise ValueError("every message needs a string content")
        guard = lambda m: m.group()[0] + MARK + m.group()[1:]  # noqa: E731
        return [{**m, "content": self.split.sub(guard, m["content"].replace(MARK, ""))} for m in msgs]

    def prompt_ids(self, prompt):
        return self.chat_ids(self.render(self.messages(prompt), add_generation_prompt=True))

    def example_ids(self, prompt, response):
        """(ids, n_prompt): see the class docstring."""
        msgs = self.messages(prompt, response)
        head, full = self.render(msgs[:-1], add_generation_prompt=True), self.render(msgs)
        if not full.startswith(head):
            raise ValueError("the chat template does not render the prompt as the start of the conversation")
        p, rest = self.chat_ids(head), self.chat_ids(full[len(head):])
        if self.eot not in rest:
            raise ValueError("the chat template ends the assistant's turn without its end of turn")
        return p + rest[:rest.index(self.eot) + 1], len(p)


def pre_tokenizer_pattern(pre):
    """The split regex of a tokenizer.json pre-tokenizer: Split(regex) + ByteLevel (Qwen2, Llama 3), or
    GPT-2's ByteLevel alone."""
    parts = pre["pretokenizers"] if pre and pre["type"] == "Sequence" else [pre] if pre else []
    kinds = [p["type"] for p in parts]
    if kinds and kinds[-1] == "ByteLevel" and not parts[-1].get("add_prefix_space"):
        if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
            return GPT2_PATTERN
        split = parts[0]
        if kinds == ["Split", "ByteLevel"] and "Regex" in split["pattern"] and split["behavior"] == "Isolated" \
                and not split.get("invert") and not parts[1].get("use_regex", True):
            return split["pattern"]["Regex"]
    raise ValueError(f"tokenizer.json: unsupported pre-tokenizer {kinds} (Split + ByteLevel, as Qwen2 and Llama 3)")
