"""The tokenizer: byte-level BPE trained with rustbpe and served by tiktoken, and the toy's
chat format, <|endoftext|><|user|>prompt<|assistant|>response<|endoftext|>. A Hugging Face
model's tokenizer.json and Jinja chat template become the same class in extras/checkpoints/hf_tokenizer.py.
Nothing here knows about models or the task families; of MARS it knows only the <|mask|> token it reserves.
"""
import re
import unicodedata

import tiktoken

# GPT-4's split pattern, except that digits are split one per token so that
# arithmetic works digit by digit.
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>"]
MARK = "\ufdd0"  # a Unicode noncharacter: put inside a special token's name in message text, it stays text
# tiktoken's regex engine panics when its backtracking stack passes 1,000,000 entries, and the \s+(?!\S)
# of GPT-style patterns (ours, Qwen's, Llama's) takes one per character of a whitespace run: refuse longer text
MAX_CHARS = 500_000
# The toy's chat format as a Jinja template: a checkpoint stores it to name its format, and an
# export gives it to transformers. ToyChat writes the same text in plain Python.
TOY_TEMPLATE = ("<|endoftext|>{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
                "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content }}<|endoftext|>"
                "{% else %}{{ raise_exception('this template has user and assistant turns only') }}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ToyChat:
    """The toy's chat renderer: <|endoftext|>, then <|user|>text for a user turn and
    <|assistant|>text<|endoftext|> for an assistant's. A renderer is called as
    chat(messages, add_generation_prompt) -> text and carries what a checkpoint saves of it
    (template, variables); extras/checkpoints/hf_tokenizer.JinjaChat is the other one."""
    template, variables = TOY_TEMPLATE, {}

    def __call__(self, messages, add_generation_prompt=False):
        parts = ["<|endoftext|>"]
        for m in messages:
            if m.get("role") == "user":
                parts += ["<|user|>", m["content"]]
            elif m.get("role") == "assistant":
                parts += ["<|assistant|>", m["content"], "<|endoftext|>"]
            else:
                raise ValueError("chat template: this template has user and assistant turns only")
        return "".join(parts + ["<|assistant|>"] * add_generation_prompt)


def encode_dropping(enc, pattern, tokenless, text):
    """Tokenizer.encode for text with a byte that has no token (tiktoken panics on one): each piece of the split
    pattern loses such bytes before BPE, as Hugging Face's BPE drops a symbol it has no token for (its
    neighbours may then merge). `regex`, tiktoken's own dependency, splits as tiktoken's Rust code does."""
    import regex
    ids = []
    for piece in regex.findall(pattern, text):
        kept = bytes(b for b in piece.encode("utf-8", "surrogatepass") if b not in tokenless)
        ids += enc._encode_single_piece(kept) if kept else []  # one piece: no second split
    return ids


class Tokenizer:
    """Byte-level BPE with tiktoken, and a chat renderer.

    Interface (train.py, sample.py and extras/ use only this):
      encode(text) -> ids      plain text; a special token's name in it stays text
      decode(ids) -> str       answer(ids): the text without the end of turn, which the answer is not part of
      prompt_ids(prompt)       the rendered prompt, ending with the assistant's header
      example_ids(prompt, response) -> (ids, n_prompt): ids = prompt_ids(prompt) + the response + the
                               chat's end of turn (what it writes after that, e.g. Qwen's "\\n", is left
                               out); the first n_prompt ids are the prompt, the rest is what training scores
      eot                      the chat's end of turn (<|endoftext|>, <|im_end|>, <|eot_id|>)
      mask                     <|mask|>;  n_vocab: ids 0..n_vocab-1 have a token
      state() / from_state()   plain types, for checkpoints (the toy's: "pattern" and "tokens" are enough)
    `prompt` is a string (one user turn) or a list of {"role", "content"} messages ending with a user turn.
    Only the chat's own special tokens are special: message text is rendered with MARK inside every special
    token's name, then encoded as plain text without it."""

    def __init__(self, pattern, ranks, specials=None, ordinary=None, normalizer=None, chat=None):
        self.specials = specials or {s: len(ranks) + i for i, s in enumerate(SPECIAL_TOKENS)}
        self.ordinary = ordinary or {}  # added tokens that are not special: plain text may contain them
        self.enc = tiktoken.Encoding("mars", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={**self.specials, **self.ordinary})
        self.pattern, self.normalizer, self.chat = pattern, normalizer, chat or ToyChat()
        self.n_vocab = 1 + max([*ranks.values(), *self.specials.values(), *self.ordinary.values()])
        self.tokenless = set(range(256)) - {b[0] for b in ranks if len(b) == 1}  # tiktoken panics on these bytes
        self.split = re.compile("|".join(map(re.escape, sorted(self.specials, key=len, reverse=True))))
        self.mask, self.user, self.assistant = (self.specials.get(s) for s in SPECIAL_TOKENS[1:])
        # the end of turn: the first special token the chat writes after an assistant's text
        probe = "Probe" + MARK
        text = self.chat([{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}])
        end = self.split.search(text, text.index(probe) + len(probe)) if probe in text else None
        if end is None:
            raise ValueError("the chat template ends an assistant turn with no special token")
        self.eot = self.specials[end.group()]

    @classmethod
    def train(cls, texts, vocab_size):
        import rustbpe  # only training needs it: a checkpoint's tokenizer is served by tiktoken alone
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
                "chat_template": self.chat.template, "normalizer": self.normalizer,
                "template_vars": dict(self.chat.variables)}

    @classmethod
    def from_state(cls, state, chat=None):
        """chat: the renderer of a state whose template is not the toy's (a Hugging Face model's Jinja template),
        built by the caller (common.tokenizer_from_state), so that this module needs no jinja2."""
        ranks = {bytes.fromhex(t): i for i, t in enumerate(state["tokens"]) if t}
        if chat is None and state.get("chat_template", TOY_TEMPLATE) != TOY_TEMPLATE:
            raise ValueError("this tokenizer has its own chat template: give from_state its renderer "
                             "(common.tokenizer_from_state builds it)")
        return cls(state["pattern"], ranks, state.get("specials"), state.get("ordinary"), state.get("normalizer"),
                   chat or ToyChat())

    def encode(self, text):
        """Plain text: the name of a special token in it stays text (added tokens that are not
        special, e.g. Qwen's <tool_call>, are matched as Hugging Face matches them)."""
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        if len(text) > MAX_CHARS:
            raise ValueError(f"text of {len(text):,} characters: the tokenizer takes at most {MAX_CHARS:,}")
        try:
            if self.tokenless and not self.tokenless.isdisjoint(text.encode("utf-8", "surrogatepass")):
                return encode_dropping(self.enc, self.pattern, self.tokenless, text)
            if self.ordinary:
                return self.enc.encode(text, allowed_special=set(self.ordinary), disallowed_special=())
            return self.enc.encode_ordinary(text)
        except BaseException as e:  # a Rust panic (pyo3's PanicException) is not an Exception
            if type(e).__name__ != "PanicException":
                raise
            raise ValueError(f"the tokenizer failed on this text ({str(e).splitlines()[0]})") from None

    def decode(self, ids):
        return self.enc.decode(ids)

    def answer(self, ids):
        return self.decode([t for t in ids if t != self.eot])

    def chat_ids(self, text):
        """ids of rendered chat text: special tokens where the chat wrote them, the rest plain text."""
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
        return self.chat_ids(self.chat(self.messages(prompt), add_generation_prompt=True))

    def example_ids(self, prompt, response):
        """(ids, n_prompt): see the class docstring."""
        msgs = self.messages(prompt, response)
        head, full = self.chat(msgs[:-1], add_generation_prompt=True), self.chat(msgs)
        if not full.startswith(head):
            raise ValueError("the chat template does not render the prompt as the start of the conversation")
        p, rest = self.chat_ids(head), self.chat_ids(full[len(head):])
        if self.eot not in rest:
            raise ValueError("the chat template ends the assistant's turn without its end of turn")
        return p + rest[:rest.index(self.eot) + 1], len(p)
