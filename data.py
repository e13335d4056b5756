"""The instruction set, the chat template, the tokenizer and batching.

Everything here is about text and token ids; nothing here knows about models
or MARS. The built-in instruction set is generated from a seed: ten task
families, each with one exact answer and a checker, mixing predictable
template text ("The answer is") with genuinely hard tokens (digits, letters).
"""
import datetime
import decimal
import hashlib
import json
import random
import re
import unicodedata

import jinja2
import rustbpe
import tiktoken
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ---------------------------------------------------------------------------
# The task families

WORDS = """apple baker candle garden planet river silver window yellow monkey
orange pencil rabbit forest bottle castle dragon flower guitar hammer island
jacket kitten lemon marble needle pepper rocket saddle tomato violin wagon
basket button cactus donkey engine feather ginger helmet insect jungle
ladder mirror napkin oyster parrot puzzle ribbon shadow tunnel velvet
walnut zebra anchor beetle cherry dinner falcon goblet harbor igloo
kettle lantern meadow noodle paddle quiver rascal sailor timber useful
bridge cloud dream earth flame grape heart juice knife light money night
ocean piano queen smile table uncle voice water youth brick chair dance
eagle field ghost honey ivory jewel lucky magic north olive pearl quick
radio sugar tiger urban vivid whale bread chalk crane daisy flute globe
grass mango nurse otter plant quilt robin salad snake storm sword tulip
vapor whisk yacht amber blaze cabin delta ember frost glove hazel jolly
kayak lunar maple noble opera pixel raven scarf toast viper wheat yeast
ant bee cow dog egg fox hat ink jam key lamp mop nut owl pig rug sun toy
van web yak zip""".split()

SHORT_WORDS = [w for w in WORDS if len(w) <= 5]

SENTENCE_WORDS = """the a my our one small big red blue old new happy quiet
dog cat bird fish horse farmer child teacher king robot ship train
runs sees finds likes makes takes moves jumps sings reads
home today fast slowly here there again now""".split()

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()

UNITS = [  # (from, to, factor)
    ("meters", "centimeters", 100), ("kilometers", "meters", 1000),
    ("kilograms", "grams", 1000), ("liters", "milliliters", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60),
    ("feet", "inches", 12), ("days", "hours", 24), ("weeks", "days", 7),
]

CAPITALS = dict(
    France="Paris", Spain="Madrid", Italy="Rome", Germany="Berlin", Japan="Tokyo",
    Egypt="Cairo", Kenya="Nairobi", Peru="Lima", Chile="Santiago", Canada="Ottawa",
    Mexico="Mexico City", Brazil="Brasilia", India="New Delhi", China="Beijing",
    Russia="Moscow", Greece="Athens", Norway="Oslo", Sweden="Stockholm",
    Finland="Helsinki", Poland="Warsaw", Austria="Vienna", Portugal="Lisbon",
    Ireland="Dublin", Cuba="Havana", Ghana="Accra", Nepal="Kathmandu",
    Thailand="Bangkok", Vietnam="Hanoi", Turkey="Ankara", Iran="Tehran",
    Iraq="Baghdad", Argentina="Buenos Aires", Colombia="Bogota", Australia="Canberra",
    Belgium="Brussels", Denmark="Copenhagen", Hungary="Budapest", Morocco="Rabat",
)
OPPOSITES = dict(
    hot="cold", big="small", fast="slow", happy="sad", light="dark", early="late",
    open="closed", full="empty", hard="soft", high="low", long="short", old="young",
    rich="poor", strong="weak", wet="dry", loud="quiet", first="last", thick="thin",
    up="down", inside="outside", near="far", clean="dirty", heavy="light", win="lose",
    buy="sell", push="pull", north="south", east="west", day="night", front="back",
)
CAPITAL_TEMPLATES = ["What is the capital of {}?", "Name the capital city of {}.",
                     "Which city is the capital of {}?", "Tell me the capital of {}."]
OPPOSITE_TEMPLATES = ["What is the opposite of {}?", "Give the opposite of the word {}.",
                      "Which word means the opposite of {}?", "Tell me the opposite of {}."]


def number_in_words(n):
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    rest = n % 100
    return ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_in_words(rest))


def spelled(word):
    return " ".join(word)


def task_add(rng):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    prompt = rng.choice(["What is {} + {}?", "Add {} and {}.", "Compute {} plus {}."]).format(a, b)
    ones = a % 10 + b % 10
    tens = a // 10 + b // 10 + ones // 10
    carry = f", carry {ones // 10}" if ones >= 10 else ""
    plus = f" + {ones // 10}" if ones >= 10 else ""
    work = f"{a % 10} + {b % 10} = {ones}{carry}. {a // 10} + {b // 10}{plus} = {tens}."
    return prompt, f"{work} The answer is {a + b}.", str(a + b)


def task_multiples(rng):
    k, n = rng.randint(2, 15), rng.randint(3, 8)
    prompt = rng.choice(["List the first {} multiples of {}.", "Write the first {} multiples of {}.",
                         "Count by {1} and give the first {0} numbers."]).format(n, k)
    answer = ", ".join(str(k * i) for i in range(1, n + 1))
    return prompt, answer, answer


def task_spell(rng):
    w = rng.choice(WORDS)
    prompt = rng.choice(["Spell the word {}.", "How do you spell {}?", "Spell {} letter by letter."]).format(w)
    return prompt, spelled(w), spelled(w)


def task_reverse(rng):
    w = rng.choice(SHORT_WORDS)
    prompt = rng.choice(["Reverse the letters of {}.", "Write {} backwards.", "Spell {} in reverse."]).format(w)
    answer = spelled(w[::-1])
    return prompt, f"{spelled(w)} reversed is {answer}", answer


def task_sort(rng):
    # distinct one-digit numbers: a small model learns to order them within the CPU budget
    # (with two-digit numbers it ordered the tens but could not copy the units reliably)
    nums = rng.sample(range(10), rng.randint(4, 7))
    prompt = rng.choice(["Sort from smallest to largest: {}.", "Put these numbers in increasing order: {}."])
    answer = ", ".join(map(str, sorted(nums)))
    return prompt.format(", ".join(map(str, nums))), answer, answer


def task_count(rng):
    w = rng.choice(WORDS)
    # letters the word lacks are 40% of the questions: with fewer, stage 1 answered 1 for them
    absent = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in w]
    letter = rng.choice(w) if rng.random() < 0.6 else rng.choice(absent)
    prompt = rng.choice(["How many times does the letter {} appear in {}?",
                         "Count the letter {} in the word {}."]).format(letter, w)
    n = w.count(letter)
    return prompt, f"{spelled(w)} has the letter {letter} {n} time{'' if n == 1 else 's'}.", str(n)


def task_copy(rng):
    words = [rng.choice(SENTENCE_WORDS) for _ in range(rng.randint(3, 6))]
    if rng.random() < 0.5:  # a repeated word: with few of them, stage 1 copied on from the wrong occurrence
        i = rng.randrange(1, len(words))
        words[i] = words[rng.randrange(i)]
    sentence = " ".join(words).capitalize() + "."
    prompt = rng.choice(["Repeat after me: {}", "Copy this sentence: {}", "Say exactly: {}"]).format(sentence)
    return prompt, sentence, sentence


def task_words(rng):
    n = rng.randint(0, 999)
    prompt = rng.choice(["Write {} in words.", "How do you say {} in words?", "Spell out the number {}."]).format(n)
    return prompt, number_in_words(n), number_in_words(n)


def task_convert(rng):
    src, dst, factor = rng.choice(UNITS)
    v = rng.randint(2, 12)  # within the times tables
    prompt = rng.choice(["Convert {} {} to {}.", "How many {2} are in {0} {1}?"]).format(v, src, dst)
    return prompt, f"{v} {src} is {v * factor} {dst}.", str(v * factor)


def task_facts(rng):
    if rng.random() < 0.5:
        country = rng.choice(sorted(CAPITALS))
        prompt = rng.choice(CAPITAL_TEMPLATES).format(country)
        return prompt, f"The capital of {country} is {CAPITALS[country]}.", CAPITALS[country]
    word = rng.choice(sorted(OPPOSITES))
    prompt = rng.choice(OPPOSITE_TEMPLATES).format(word)
    return prompt, f"The opposite of {word} is {OPPOSITES[word]}.", OPPOSITES[word]


# Training examples per family, relative: the families that need precise copying or
# recall take longer to learn than the template-heavy ones.
MIX = {"add": 0.9, "multiples": 0.6, "spell": 0.5, "reverse": 1.8, "sort": 1.0, "count": 1.9,
       "copy": 1.6, "words": 0.6, "convert": 1.4, "facts": 0.6}

# family -> (generator, how to read the final answer out of a response)
TASKS = {
    "add": (task_add, lambda r: re.search(r"The answer is (\S+)\.$", r)),
    "multiples": (task_multiples, None),
    "spell": (task_spell, None),
    "reverse": (task_reverse, lambda r: re.search(r" reversed is (.+)$", r)),
    "sort": (task_sort, None),
    "count": (task_count, lambda r: re.search(r" (\d+) times?\.$", r)),
    "copy": (task_copy, None),
    "words": (task_words, None),
    "convert": (task_convert, lambda r: re.search(r" is (\d+) \w+\.$", r)),
    "facts": (task_facts, lambda r: re.search(r" is ([^.]+)\.$", r)),
}


# A number as GSM8K chain-of-thought answers write it: sign, optional $, digits with commas, decimals
NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"


def final_number(text):
    """The final answer of a chain of thought, scored as lm-eval's gsm8k_cot does (the paper's
    evaluation): the number after the first "The answer is" (strict match), else the last
    number in the text (flexible extract); None when there is none. Commas and $ are dropped, and
    the number is normalised (1,234.0 -> 1234)."""
    strict = re.search(f"The answer is ({NUMBER})", text)
    numbers = [strict.group(1)] if strict else re.findall(NUMBER, text)
    if not numbers:
        return None
    return format(decimal.Decimal(numbers[-1].replace(",", "").replace("$", "")).normalize(), "f")


def check(example, response):
    """True when `response` carries exactly the example's answer. Task "number" (a user's eval
    JSONL of {prompt, answer}, e.g. GSM8K): the final number of the response equals the answer's."""
    if example["task"] == "number":
        return final_number(response) is not None and final_number(response) == final_number(example["answer"])
    extract = TASKS[example["task"]][1] if example["task"] in TASKS else None
    response = response.strip()
    if extract is None:
        return response == example["answer"]
    m = extract(response)
    return m is not None and m.group(1) == example["answer"]


# ---------------------------------------------------------------------------
# Splits: a prompt belongs to exactly one split, by a stable hash of its text,
# so train, validation and test can never share a prompt.

# How a user may open a request. Every family draws one, which multiplies the
# prompt space of the small families (a few hundred questions each) so that
# they too can hold out a few hundred distinct test prompts.
OPENERS = ["", "Please answer. ", "Quick question: ", "Hi! ", "Here is a task. ", "One more: "]

# Families with a few hundred distinct questions hold out a larger share of their prompts.
SMALL_FAMILIES = {"multiples", "spell", "reverse", "convert", "facts"}


def split_of(prompt, test=0.04, val=0.04):
    """'test', 'val' or 'train': test and val take these shares of the prompt space."""
    u = int(hashlib.md5(prompt.encode()).hexdigest()[:8], 16) / 16**8
    return "test" if u < test else "val" if u < test + val else "train"


def build_instruction_set(seed=0, n_train=40000, n_val=500, n_test=2000):
    """Deterministic train/val/test lists of {"task", "prompt", "response", "answer"}.

    Train examples may repeat (as in any large instruction set); val and test
    hold distinct prompts, n_val and n_test split equally over the task families
    (2,000 test prompts: one standard error of an accuracy near 90% is 0.7 points)."""
    rng = random.Random(seed)
    splits = {"train": [], "val": [], "test": []}
    for task, (generate, _) in TASKS.items():
        quota = {"train": round(n_train * MIX[task] / sum(MIX.values())),
                 "val": n_val // len(TASKS), "test": n_test // len(TASKS)}
        shares = dict(test=0.25, val=0.06) if task in SMALL_FAMILIES else dict(test=0.04, val=0.04)
        count, seen = dict.fromkeys(splits, 0), set()
        for _ in range(40 * quota["train"]):  # small families run out of new held-out prompts
            if count["train"] >= quota["train"] and count["test"] >= quota["test"]:
                break
            question, response, answer = generate(rng)
            prompt = rng.choice(OPENERS) + question
            split = split_of(prompt, **shares)
            if count[split] >= quota[split] or (split != "train" and prompt in seen):
                continue
            seen.add(prompt)
            count[split] += 1
            splits[split].append(dict(task=task, prompt=prompt, response=response, answer=answer))
    for examples in splits.values():  # interleave the families (a prefix of test is a fair sample)
        rng.shuffle(examples)
    return splits


ROLES = ("system", "user", "assistant")


def read_record(rec):
    """One line of a user's JSONL as an example {"task", "prompt", "response" (if any), "answer"}.

    {"prompt", "response"}: one user turn and its answer. {"messages": [...]}: an optional system
    turn, then user and assistant turns, the last an assistant's; only that last turn is trained
    (as the official data map does), everything before it is the prompt, rendered by the model's
    chat template (a lone user turn becomes a plain prompt string). {"prompt", "answer"} without a
    response is for evaluation only ("question" is accepted for "prompt", and GSM8K's "... #### 72"
    answers keep what follows ####). The checker: an answer that is a number is scored by its final
    number (task "number", GSM8K chain-of-thought style: `final_number`), any other text exactly
    (task "custom"); without an "answer" the expected answer is the response."""
    if "messages" in rec:
        msgs = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
        roles = [m["role"] for m in msgs]
        if (len(msgs) < 2 or roles[-2:] != ["user", "assistant"] or "system" in roles[1:]
                or not set(roles) <= set(ROLES) or not all(isinstance(m["content"], str) for m in msgs)):
            raise ValueError("messages must be an optional system turn, then user and assistant turns with text "
                             "content, ending with a user turn and the assistant's answer")
        prompt, response = (msgs[0]["content"] if len(msgs) == 2 else msgs[:-1]), msgs[-1]["content"]
    else:
        prompt, response = rec["prompt"] if "prompt" in rec else rec["question"], rec.get("response")
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string (a conversation goes in messages)")
    if response is None and "answer" not in rec:
        raise ValueError("a record needs a response (to train on) or an answer (to evaluate)")
    answer = response if "answer" not in rec else str(rec["answer"]) if type(rec["answer"]) in (int, float) \
        else rec["answer"]
    if not (isinstance(answer, str) and isinstance(response, (str, type(None)))):
        raise ValueError("response and answer must be strings")
    answer = answer.rsplit("####", 1)[-1].strip() if "answer" in rec else answer.strip()
    task = "number" if "answer" in rec and re.fullmatch(NUMBER, answer) else "custom"
    return dict(task=task, prompt=prompt, answer=answer, **({} if response is None else {"response": response}))


def read_jsonl(path, need_response=False):
    """Every record of a user's JSONL (`read_record`), in file order; need_response: each must
    carry one (training data)."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = read_record(json.loads(line))
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
                raise ValueError(f"{path}:{lineno}: malformed record ({err}); expected {{\"prompt\": ..., "
                                 '"response": ...}, {"messages": [...]} or {"prompt": ..., "answer": ...}') from None
            if need_response and "response" not in e:
                raise ValueError(f"{path}:{lineno}: no response to train on (a file of {{prompt, answer}} is for "
                                 "python eval.py --data)")
            examples.append(e)
    return examples


def load_jsonl(path):
    """A user's own instruction data (`read_record`), split into train/val/test by the same prompt
    hash as the built-in set (a conversation's key is its messages as JSON)."""
    splits = {"train": [], "val": [], "test": []}
    for e in read_jsonl(path, need_response=True):
        key = e["prompt"] if isinstance(e["prompt"], str) else json.dumps(e["prompt"], ensure_ascii=False)
        splits[split_of(key)].append(e)
    if not splits["train"]:
        raise ValueError(f"{path}: no training records")
    return splits


def load_splits(data_path, seed, n_train):
    return load_jsonl(data_path) if data_path else build_instruction_set(seed, n_train)


# ---------------------------------------------------------------------------
# Tokenizer: byte-level BPE served with tiktoken, either trained here with rustbpe
# (our toy) or converted from a Hugging Face tokenizer.json (Qwen2, Llama 3);
# prompts are rendered with the model's own Jinja chat template.

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


def tokenize(examples, tok, max_seq_len, multiple=1):
    """[(ids, n_prompt)] for examples that fit the context once make_batch has padded
    them to a multiple of `multiple`; the rest are dropped."""
    out = [tok.example_ids(e["prompt"], e["response"]) for e in examples]
    return [(ids, n) for ids, n in out if len(ids) + (-len(ids) % multiple) - 1 <= max_seq_len]


def make_batch(rows, pad_id, multiple=1):
    """Right-padded inputs x and targets y (-1 = no loss). Input x is ids[:-1];
    y[q] = ids[q+1] where that is a response token or the closing <|endoftext|>.

    multiple > 1 (MARS, multiple = B): each sequence is first extended with
    <|endoftext|> to a length that is a multiple of B, and those are trained on,
    so that masks past the end of an answer learn to predict the end (the
    official trainer's AppendEOSBlockWrapper)."""
    rows = [(ids + [pad_id] * (-len(ids) % multiple), n) for ids, n in rows]
    T = max(len(ids) - 1 for ids, _ in rows)
    x = torch.full((len(rows), T), pad_id, dtype=torch.long)
    y = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        t = torch.tensor(ids)
        x[i, :len(ids) - 1] = t[:-1]
        y[i, n_prompt - 1:len(ids) - 1] = t[n_prompt:]
    return x, y
