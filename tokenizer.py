"""The toy's tokenizer: byte-level BPE trained with rustbpe and served by tiktoken, and its
chat format, <|endoftext|><|user|>prompt<|assistant|>response<|endoftext|>. Of MARS it knows
only the <|mask|> token it reserves. A real model's tokenizer (its tokenizer.json and Jinja
chat template) is a subclass in extras/checkpoints/hf_tokenizer.py.
"""
import re

import tiktoken

# GPT-4's split pattern, except that digits are split one per token so that
# arithmetic works digit by digit.
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>"]
# a Unicode noncharacter: put inside a special token's name in message text, it stays text
MARK = "\ufdd0"
# tiktoken's regex engine panics when its backtracking stack passes 1,000,000 entries, and
# the \s+(?!\S) of GPT-style patterns takes one per character of a whitespace run
MAX_CHARS = 500_000
# The toy's chat format as a Jinja template: a checkpoint stores it to name its format, and
# an export gives it to transformers. ToyChat writes the same text in plain Python.
TOY_TEMPLATE = ("<|endoftext|>{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
                "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content }}<|endoftext|>"
                "{% else %}{{ raise_exception('this template has user and assistant turns only') }}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ToyChat:
    """The toy's chat renderer, called as chat(messages, add_generation_prompt) -> text."""
    template = TOY_TEMPLATE

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


class Tokenizer:
    """Byte-level BPE with tiktoken, and a chat renderer.

    Interface (train.py, sample.py and extras/ use only this):
      encode(text) -> ids      plain text; a special token's name in it stays text
      decode(ids) -> str       answer(ids): the text without the end of turn
      prompt_ids(prompt)       the rendered prompt, ending with the assistant's header
      example_ids(prompt, response) -> (ids, n_prompt): prompt_ids(prompt) + the response
                               + the end of turn; training scores what follows the prompt
      eot, mask, n_vocab       the end of turn, <|mask|>; ids 0..n_vocab-1 have a token
      state() / from_state()   plain types, for checkpoints
    `prompt` is a string (one user turn) or a list of {"role", "content"} messages ending
    with a user turn. Only the chat's own special tokens are special: message text is
    rendered with MARK inside every special token's name, then encoded without it."""
    ordinary = {}  # added tokens that plain text may contain: a real model's, none here

    def __init__(self, pattern, ranks, specials=None, chat=None):
        self.specials = specials or {s: len(ranks) + i for i, s in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding("mars", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={**self.specials, **self.ordinary})
        self.pattern, self.chat, self.n_vocab = pattern, chat or ToyChat(), self.enc.n_vocab
        names = sorted(self.specials, key=len, reverse=True)
        self.split = re.compile("|".join(map(re.escape, names)))
        self.mask, self.user, self.assistant = (self.specials.get(s) for s in SPECIAL_TOKENS[1:])
        self.eot = self.end_of_turn()

    def end_of_turn(self):  # a real model's tokenizer finds its own by rendering its template
        return self.specials["<|endoftext|>"]

    @classmethod
    def train(cls, texts, vocab_size):
        import rustbpe  # only training needs it: tiktoken serves a checkpoint's tokenizer
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
        return cls(SPLIT_PATTERN, dict(bpe.get_mergeable_ranks()))

    def state(self):
        """Plain types only, so a checkpoint loads with weights_only=True. tokens[id] is the hex
        of the token's bytes ("" for an id held by an added token)."""
        tokens = [""] * (1 + max(self.enc._mergeable_ranks.values()))
        for b, i in self.enc._mergeable_ranks.items():
            tokens[i] = b.hex()
        return {"pattern": self.pattern, "tokens": tokens, "specials": self.specials,
                "chat_template": self.chat.template}

    @classmethod
    def from_state(cls, state, chat=None):
        """chat: a renderer in place of ToyChat. A state with its own chat template is a real
        model's tokenizer, which this class does not read."""
        if state.get("chat_template", TOY_TEMPLATE) != TOY_TEMPLATE:
            raise ValueError("this checkpoint has a real model's tokenizer and chat template: "
                             "python -m extras.engine --ckpt PATH decodes it")
        ranks = {bytes.fromhex(t): i for i, t in enumerate(state["tokens"]) if t}
        return cls(state["pattern"], ranks, state.get("specials"), chat)

    def encode(self, text):
        """Plain text: the name of a special token in it stays text."""
        if len(text) > MAX_CHARS:
            raise ValueError(f"text of {len(text):,} characters: "
                             f"the tokenizer takes at most {MAX_CHARS:,}")
        try:
            return self.bpe(text)
        except BaseException as e:  # a Rust panic (pyo3's PanicException) is not an Exception
            if type(e).__name__ != "PanicException":
                raise
            why = str(e).splitlines()[0]
            raise ValueError(f"the tokenizer failed on this text ({why})") from None

    def bpe(self, text):  # a real model's tokenizer adds what its tokenizer.json asks for
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(ids)

    def answer(self, ids):
        return self.decode([t for t in ids if t != self.eot])

    def chat_ids(self, text):
        """ids of rendered chat text: special tokens where the chat wrote them, else plain text."""
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
        p, rest = self.chat_ids(head), self.chat_ids(full[len(head):])
        return p + rest[:rest.index(self.eot) + 1], len(p)
