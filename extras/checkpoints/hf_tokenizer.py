"""Hugging Face tokenizers as HFTokenizer, a tokenizer.Tokenizer: a byte-level BPE tokenizer.json
(Qwen2, Llama 3) becomes tiktoken ranks, its Split regex, its normaliser and its added tokens, and
the model's own Jinja chat template renders prompts as transformers' apply_chat_template does.
to_hf writes ours back; tokenizer_from_state reads any checkpoint's tokenizer.

A chat template is code that came with a download, so it renders in jinja2's sandbox within
limits (JinjaChat): every failure is one ChatTemplateError (a ValueError), "chat template: ...".
"""
import datetime
import functools
import json
import math
import threading
import time
import unicodedata

import jinja2
import regex
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from tokenizer import MARK, MAX_CHARS, TOY_TEMPLATE, Tokenizer

# GPT-2's pattern: a ByteLevel pre-tokenizer with use_regex splits with it
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM's Digits(individual_digits) then ByteLevel, as one pattern: GPT-2's with every digit a piece of its own,
# and a whitespace run that ends at a digit kept whole (inside its piece, (?!\S) saw the piece's end there)
DIGITS_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
PAD = "<|pad|>"  # the padding token an export adds: no chat template writes it into a prompt
RENDER_SECONDS = 1.0  # a real template renders in about a millisecond
MAX_OUTPUT = MAX_CHARS  # longer chat text could not be encoded anyway
clock = threading.local()  # the deadline of the render running in this thread


class TemplateLimit(Exception):
    """A chat template went past a limit (time, output, or an operand too large)."""


class ChatTemplateError(ValueError):
    """Anything a chat template raised while compiling or rendering, as one line."""


def tick():
    if time.monotonic() > getattr(clock, "deadline", math.inf):
        raise TemplateLimit(f"it ran longer than {RENDER_SECONDS:g} s")


def too_big(*values):
    return any(isinstance(v, int) and abs(v) > MAX_OUTPUT for v in values)


def bounded(value):
    """value, unless it is a string or container longer than MAX_OUTPUT."""
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_OUTPUT:
        raise TemplateLimit(f"it made a value longer than {MAX_OUTPUT:,}")
    return value


class Checkpoints(NodeTransformer):
    """Rewrites a parsed template so that each {% for %} iterates through the filter `ticking` and
    each ~ joins through `joined`: with calls and filters (Sandbox.call, Sandbox.checked), these are
    the only ways a template repeats work or grows a string, and each checks the limits."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "ticking", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "joined", [], [], None, None,
                            lineno=node.lineno)


@jinja2.pass_context  # never folded at compile time: it runs under the render's deadline
def ticking(context, items):
    for item in items:
        tick()
        yield item


class Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's sandbox (no unsafe attributes, no mutation, range() at most 100,000 long) where every
    call, filter and loop step checks the render's deadline, and no operator, call or filter takes a
    number over MAX_OUTPUT or makes a value longer than that: one such operation is a single call
    into C, which no deadline can interrupt."""
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         loader=jinja2.FunctionLoader(self.no_loading))
        self.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        self.filters["joined"] = lambda values: "".join(map(str, values))  # what ~ does without autoescape
        self.filters.update({name: self.checked(f) for name, f in self.filters.items()}, ticking=ticking)
        self.globals.update(raise_exception=self.raise_exception,
                            strftime_now=lambda f: datetime.datetime.now().strftime(f))

    @staticmethod
    def no_loading(name):
        raise jinja2.TemplateError(f"it loads another template ({name!r}): a chat template must be self-contained")

    @staticmethod
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    @staticmethod
    def checked(f):
        @functools.wraps(f)  # keeps jinja's pass_context marks
        def call(*args, **kwargs):
            tick()
            if too_big(*args, *kwargs.values()):
                raise TemplateLimit(f"a number over {MAX_OUTPUT:,} passed to {getattr(f, '__name__', 'a filter')}")
            return bounded(f(*args, **kwargs))
        return call

    def call(self, context, obj, /, *args, **kwargs):
        tick()
        if too_big(*args, *kwargs.values()):
            raise TemplateLimit(f"a number over {MAX_OUTPUT:,} passed to {getattr(obj, '__name__', 'a call')}")
        return bounded(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
        counts = [x for x in (left, right) if isinstance(x, int)]
        if operator == "*" and sizes and counts and sizes[0] * abs(counts[0]) > MAX_OUTPUT \
                or operator == "**" and len(counts) == 2 and left.bit_length() * right > 8 * MAX_OUTPUT \
                or operator == "%" and too_big(*(right if isinstance(right, tuple) else (right,))):
            raise TemplateLimit(f"the result of {operator} would be too large")
        return bounded(super().call_binop(context, operator, left, right))


@functools.cache
def sandbox():
    return Sandbox()


def template_failure(e):
    """One line for anything a template raised while compiling or rendering."""
    where = f"line {e.lineno}: " if isinstance(e, jinja2.TemplateSyntaxError) and e.lineno else ""
    what = str(e) if isinstance(e, TemplateLimit) else e.message if isinstance(e, jinja2.TemplateError) \
        and e.message else f"{type(e).__name__}: {e}"
    return ChatTemplateError(f"chat template: {where}{' '.join(str(what).split())[:300]}")


class JinjaChat:
    """A model's chat template as a tokenizer.Tokenizer chat renderer: rendered as transformers'
    apply_chat_template does (jinja2's sandbox, trim_blocks, lstrip_blocks, loop controls,
    raise_exception, tojson, strftime_now), within RENDER_SECONDS and MAX_OUTPUT characters.
    variables: what the template reads besides the messages, e.g. bos_token (Llama 3).

    The deadline is checked inside the render, at every loop step, call and filter (Checkpoints):
    that stops it in whatever thread renders, which a watchdog thread (Python cannot kill one) or
    an alarm signal (main thread only) cannot, and costs no process per prompt."""

    def __init__(self, template, variables=None):
        self.template, self.variables = template, dict(variables or {})
        try:
            self.compiled = sandbox().from_string(Checkpoints().visit(sandbox().parse(template)))
        except Exception as e:
            raise template_failure(e) from None

    def __call__(self, messages, add_generation_prompt=False):
        clock.deadline = time.monotonic() + RENDER_SECONDS
        out, n = [], 0
        try:
            for chunk in self.compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **self.variables):
                n += len(chunk)
                if n > MAX_OUTPUT:
                    raise TemplateLimit(f"it wrote more than {MAX_OUTPUT:,} characters")
                out.append(chunk)
        except Exception as e:
            raise template_failure(e) from None
        finally:
            clock.deadline = math.inf
        return "".join(out)


def encode_dropping(enc, pattern, tokenless, text):
    """The ids of text with a byte that has no token (tiktoken panics on one): each piece of the split
    pattern loses such bytes before BPE, as Hugging Face's BPE drops a symbol it has no token for (its
    neighbours may then merge). `regex`, tiktoken's own dependency, splits as tiktoken's Rust code does."""
    ids = []
    for piece in regex.findall(pattern, text):
        kept = bytes(b for b in piece.encode("utf-8", "surrogatepass") if b not in tokenless)
        ids += enc._encode_single_piece(kept) if kept else []  # one piece: no second split
    return ids


class HFTokenizer(Tokenizer):
    """A real model's tokenizer: Tokenizer with what a tokenizer.json may add (added tokens that
    are not special, e.g. Qwen's <tool_call>, matched in plain text as Hugging Face matches them;
    a Unicode normal form; bytes with no token) and a Jinja chat renderer, whose end of turn is
    found by rendering and whose output is checked."""

    def __init__(self, pattern, ranks, specials, ordinary=None, normalizer=None, chat=None):
        self.ordinary, self.normalizer = ordinary or {}, normalizer
        self.tokenless = set(range(256)) - {b[0] for b in ranks if len(b) == 1}  # tiktoken panics on these
        super().__init__(pattern, ranks, specials, chat)

    def end_of_turn(self):
        """The first special token the chat writes after an assistant's text."""
        probe = "Probe" + MARK
        text = self.chat([{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}])
        end = self.split.search(text, text.index(probe) + len(probe)) if probe in text else None
        if end is None:
            raise ValueError("the chat template ends an assistant turn with no special token")
        return self.specials[end.group()]

    def state(self):
        return {**super().state(), "ordinary": self.ordinary, "normalizer": self.normalizer,
                "template_vars": dict(self.chat.variables)}

    @classmethod
    def from_state(cls, state, chat=None):
        """chat: default the state's own template, rendered by JinjaChat."""
        ranks = {bytes.fromhex(t): i for i, t in enumerate(state["tokens"]) if t}
        chat = chat or JinjaChat(state.get("chat_template", TOY_TEMPLATE), state.get("template_vars"))
        return cls(state["pattern"], ranks, state.get("specials"), state.get("ordinary"),
                   state.get("normalizer"), chat)

    def encode(self, text):
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        return super().encode(text)

    def bpe(self, text):
        if self.tokenless and not self.tokenless.isdisjoint(text.encode("utf-8", "surrogatepass")):
            return encode_dropping(self.enc, self.pattern, self.tokenless, text)
        if self.ordinary:
            return self.enc.encode(text, allowed_special=set(self.ordinary), disallowed_special=())
        return super().bpe(text)

    def example_ids(self, prompt, response):
        """(ids, n_prompt), as Tokenizer's, from a template that renders the prompt as the start of the
        conversation and ends the assistant's turn with its end of turn."""
        msgs = self.messages(prompt, response)
        head, full = self.chat(msgs[:-1], add_generation_prompt=True), self.chat(msgs)
        if not full.startswith(head):
            raise ValueError("the chat template does not render the prompt as the start of the conversation")
        p, rest = self.chat_ids(head), self.chat_ids(full[len(head):])
        if self.eot not in rest:
            raise ValueError("the chat template ends the assistant's turn without its end of turn")
        return p + rest[:rest.index(self.eot) + 1], len(p)


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


def pre_tokenizer_pattern(pre):
    """The split regex of a tokenizer.json pre-tokenizer: Split(regex) + ByteLevel (Qwen2, Llama 3),
    GPT-2's ByteLevel alone, or Digits(individual_digits) + GPT-2's ByteLevel (SmolLM)."""
    parts = pre["pretokenizers"] if pre and pre["type"] == "Sequence" else [pre] if pre else []
    kinds = [p["type"] for p in parts]
    if kinds and kinds[-1] == "ByteLevel" and not parts[-1].get("add_prefix_space"):
        if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
            return DIGITS_GPT2_PATTERN
        split = parts[0]
        if kinds == ["Split", "ByteLevel"] and "Regex" in split["pattern"] and split["behavior"] == "Isolated" \
                and not split.get("invert") and not parts[1].get("use_regex", True):
            return split["pattern"]["Regex"]
    raise ValueError(f"unsupported pre-tokenizer {kinds} (Split + ByteLevel, as Qwen2 and Llama 3; Digits + "
                     "ByteLevel, as SmolLM)")


def bpe_ranks(model, added):
    """tiktoken's ranks of a tokenizer.json BPE model (its added tokens left out)."""
    if model["type"] != "BPE" or model.get("byte_fallback") or model.get("dropout") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError("only byte-level BPE tokenizers are supported")
    to_byte = {c: b for b, c in byte_alphabet().items()}
    vocab = {s: i for s, i in model["vocab"].items() if s not in added}
    if any(c not in to_byte for s in vocab for c in s):
        raise ValueError("the vocabulary is not byte-level (GPT-2's byte alphabet)")
    # tiktoken merges the pair whose result has the lowest rank; Hugging Face applies the merges in
    # their order: the same when every merge's result has a higher id than its parts and than earlier results
    last = -1
    for pair in model["merges"]:
        a, b = pair.split(" ") if isinstance(pair, str) else pair
        r = vocab.get(a + b)
        if r is None or r <= max(last, vocab[a], vocab[b]):
            raise ValueError("the BPE merges are not in the order of the vocabulary's ids")
        last = r
    return {bytes(to_byte[c] for c in s): i for s, i in vocab.items()}


def from_hf(tokenizer_json, tokenizer_config, chat_template=None, n_rows=None):
    """A Tokenizer from the dicts of tokenizer.json and tokenizer_config.json (chat_template: the
    text of chat_template.jinja, where transformers 5 saves it). n_rows: the model's embedding rows;
    without an added <|mask|>, it takes the first row past the tokenizer (as the official trainer's
    add_special_tokens does: no parameter is added), which must exist. ValueError names the file."""
    added = {a["content"]: a for a in tokenizer_json.get("added_tokens", [])}
    try:
        ranks = bpe_ranks(tokenizer_json["model"], added)
        pattern = pre_tokenizer_pattern(tokenizer_json.get("pre_tokenizer"))
    except ValueError as e:
        raise ValueError(f"tokenizer.json: {e}") from None
    norm = tokenizer_json.get("normalizer")
    forms = [n["type"] for n in (norm["normalizers"] if norm["type"] == "Sequence" else [norm])] if norm else []
    if len(forms) > 1 or not set(forms) <= {"NFC", "NFD", "NFKC", "NFKD"}:
        raise ValueError(f"tokenizer.json: unsupported normalizer {forms} (a Unicode normal form or none)")
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    variables = {k: v["content"] if isinstance(v, dict) else v for k in names if (v := tokenizer_config.get(k))}
    specials = {s: a["id"] for s, a in added.items() if a.get("special")}
    ordinary = {s: a["id"] for s, a in added.items() if not a.get("special")}
    if "<|mask|>" not in added:
        free = 1 + max([*ranks.values(), *(a["id"] for a in added.values())])
        # Llama 3 and SmolLM2 fill every row: a special token of the model's own that no chat template writes
        # serves instead, so MARS adds no parameter (Llama 3's reserved tokens; SmolLM2's <empty_output>)
        reserved = sorted((i, s) for s, i in specials.items()
                          if s.startswith("<|reserved_special_token") or s == "<empty_output>")
        if n_rows is not None and free >= n_rows:
            if not reserved:
                raise ValueError(f"no spare embedding row for <|mask|>: tokenizer.json has {free} tokens and "
                                 f"config.json's vocab_size is {n_rows}")
            free = specials.pop(reserved[0][1])
        specials["<|mask|>"] = free
    pad = variables.get("pad_token")
    if pad in specials and specials[pad] == max([*ranks.values(), *specials.values(), *ordinary.values()]) \
            and pad not in (variables.get("eos_token"), variables.get("bos_token")):
        del specials[pad]  # padding past every token, <|mask|> included (our exports add it): never an output
    template = chat_template or tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not template:
        raise ValueError("no chat template (tokenizer_config.json or chat_template.jinja): use an instruct model")
    return HFTokenizer(pattern, ranks, specials, ordinary, forms[0] if forms else None,
                       JinjaChat(template, variables))


def tokenizer_from_state(state):
    """A checkpoint's tokenizer: the toy's (tokenizer.Tokenizer) or a real model's (HFTokenizer)."""
    real = state.get("chat_template", TOY_TEMPLATE) != TOY_TEMPLATE
    real = real or state.get("ordinary") or state.get("normalizer")
    return HFTokenizer.from_state(state) if real else Tokenizer.from_state(state)


def to_hf(tok, pad):
    """(tokenizer.json, tokenizer_config.json) as dicts: the same tokenizer for `tokenizers` and
    transformers, with PAD at id `pad` (an id past tok's) as the padding token."""
    alphabet, ranks = byte_alphabet(), tok.enc._mergeable_ranks
    spell = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
    merges = [[spell(p) for p in last_merge(ranks, b)] for b, _ in sorted(ranks.items(), key=lambda kv: kv[1])
              if len(b) > 1]
    tokens = sorted({**tok.specials, **tok.ordinary, PAD: pad}.items(), key=lambda kv: kv[1])
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": s not in tok.ordinary} for s, i in tokens]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": tok.normalizer} if tok.normalizer else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tok.pattern}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": True,  # as tiktoken: a piece that is a token is that token
                  # the added tokens too, as Hugging Face writes them: transformers renumbers one the vocab lacks
                  "vocab": {**{spell(b): i for b, i in ranks.items()}, **dict(tokens)}, "merges": merges}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat.template,
              **tok.chat.variables, "eos_token": tok.decode([tok.eot]), "pad_token": PAD, "mask_token": "<|mask|>",
              "padding_side": "left",  # decoding appends on the right
              "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}}
    return tokenizer_json, config
