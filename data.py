"""The instruction set, its checkers and splits, and batching: text and ids, no models.
Ten task families, generated from a seed, each with one exact answer and a checker, mix
predictable template text ("The answer is") with hard tokens (digits, letters). Of MARS it
knows one number: make_batch pads a sequence to a multiple of B.
"""
import hashlib
import json
import random
import re

import torch

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
    # distinct one-digit numbers: the task tests ordering alone (two-digit numbers would also test
    # copying each number's digits, a second skill for a model this small)
    nums = rng.sample(range(10), rng.randint(4, 7))
    prompt = rng.choice(["Sort from smallest to largest: {}.", "Put these numbers in increasing order: {}."])
    answer = ", ".join(map(str, sorted(nums)))
    return prompt.format(", ".join(map(str, nums))), answer, answer


def task_count(rng):
    w = rng.choice(WORDS)
    # 40% ask for a letter the word lacks: 0 must be a common answer, or a small model never learns to give it
    absent = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in w]
    letter = rng.choice(w) if rng.random() < 0.6 else rng.choice(absent)
    prompt = rng.choice(["How many times does the letter {} appear in {}?",
                         "Count the letter {} in the word {}."]).format(letter, w)
    n = w.count(letter)
    return prompt, f"{spelled(w)} has the letter {letter} {n} time{'' if n == 1 else 's'}.", str(n)


def task_copy(rng):
    words = [rng.choice(SENTENCE_WORDS) for _ in range(rng.randint(3, 6))]
    if rng.random() < 0.5:  # a repeated word: the copy must follow positions, not the word before
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


# Training examples per family, relative. Copy and count get the most: they are the ones
# that need exact attention to the prompt (a repeated word, a letter the word lacks). The
# shares were chosen on validation accuracy only (docs/mix_search_cpu.json).
MIX = {"add": 1.2, "multiples": 0.5, "spell": 0.4, "reverse": 1.0, "sort": 1.5, "count": 3.5,
       "copy": 4.0, "words": 1.0, "convert": 0.8, "facts": 0.5}

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


def check(example, response):
    """True when `response` carries exactly the example's answer (task "custom": the whole
    response, a user's record)."""
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


def build_instruction_set(seed=0, n_train=40000, n_val=500, n_test=2000, tasks=None, mix=None):
    """Deterministic train/val/test lists of {"task", "prompt", "response", "answer"}, of the families in
    `tasks` (default all).

    Train examples may repeat (as in any large instruction set); val and test
    hold distinct prompts, n_val and n_test split equally over the task families
    (2,000 test prompts: one standard error of an accuracy near 90% is 0.7 points).
    `mix` changes some families' training shares (of MIX's): the training examples are then
    drawn again from a stream of their own, so that the held-out prompts stay the same."""
    rng = random.Random(seed)
    chosen = [t for t in TASKS if tasks is None or t in tasks]
    held_out = dict(val=n_val // len(chosen), test=n_test // len(chosen))
    splits = draw(rng, chosen, MIX, n_train, held_out)
    if mix:
        shares = {**MIX, **mix}
        splits["train"] = draw(random.Random(f"train {seed}"), chosen, shares, n_train,
                               dict(val=0, test=0))["train"]
    return splits


def draw(rng, chosen, shares, n_train, held_out):
    """Examples of each chosen family until its quotas are met: training examples by the
    families' shares, held-out ones as many per family, each prompt in its hash's split."""
    splits = {"train": [], "val": [], "test": []}
    for task in chosen:
        quota = {"train": round(n_train * shares[task] / sum(shares[t] for t in chosen)), **held_out}
        split_shares = dict(test=0.25, val=0.06) if task in SMALL_FAMILIES else dict(test=0.04, val=0.04)
        count, seen = dict.fromkeys(splits, 0), set()
        for _ in range(40 * quota["train"]):  # small families run out of new held-out prompts
            if count["train"] >= quota["train"] and count["test"] >= quota["test"]:
                break
            question, response, answer = TASKS[task][0](rng)
            prompt = rng.choice(OPENERS) + question
            split = split_of(prompt, **split_shares)
            if count[split] >= quota[split] or (split != "train" and prompt in seen):
                continue
            seen.add(prompt)
            count[split] += 1
            splits[split].append(dict(task=task, prompt=prompt, response=response, answer=answer))
    for examples in splits.values():  # interleave the families (a prefix of test is a fair sample)
        rng.shuffle(examples)
    return splits


def read_record(rec):
    """A line of a user's JSONL, {"prompt", "response"}, as an example of task "custom"."""
    if not (isinstance(rec, dict) and rec.keys() == {"prompt", "response"}
            and all(isinstance(v, str) for v in rec.values())):
        raise ValueError('expected {"prompt": "...", "response": "..."}; '
                         'python -m extras.real.train --data reads {"messages": [...]}, '
                         'python -m extras.bench.eval --data {"prompt", "answer"}')
    return dict(task="custom", prompt=rec["prompt"], answer=rec["response"].strip(),
                response=rec["response"])


def read_jsonl(path, need_response=False, read=read_record):
    """Every record of a user's JSONL as read(record) reads it, in file order;
    need_response: each must carry one (training data)."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = read(json.loads(line))
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
                raise ValueError(f"{path}:{lineno}: malformed record ({err})") from None
            if need_response and "response" not in e:
                raise ValueError(f"{path}:{lineno}: no response to train on (a file of "
                                 "{prompt, answer} is for python -m extras.bench.eval --data)")
            examples.append(e)
    return examples


def load_jsonl(path, read=read_record):
    """A user's own instruction data, split by the same prompt hash as the built-in set (a
    conversation's key is its messages as JSON)."""
    splits = {"train": [], "val": [], "test": []}
    for e in read_jsonl(path, need_response=True, read=read):
        key = e["prompt"] if isinstance(e["prompt"], str) else json.dumps(e["prompt"], ensure_ascii=False)
        splits[split_of(key)].append(e)
    if not splits["train"]:
        raise ValueError(f"{path}: no training records")
    return splits


def plain_text(example):
    """An example as plain text (a conversation's turns one per line, then the response), for the toy's
    tokenizer to train on."""
    p = example["prompt"]
    return (p if isinstance(p, str) else "\n".join(m["content"] for m in p)) + "\n" + example["response"]


def load_splits(data_path, seed, n_train, tasks=None, read=read_record, mix=None):
    if data_path:
        return load_jsonl(data_path, read)
    return build_instruction_set(seed, n_train, tasks=tasks, mix=mix)


def splits_of(train_config, read=read_record):
    """The splits a checkpoint was trained and scored on, from its train_config: where
    every tool finds a checkpoint's held-out prompts."""
    c = train_config  # data_seed and mix: checkpoints from before they existed lack them
    return load_splits(c["data"], c.get("data_seed", c["seed"]), c["n_train"], c.get("tasks"),
                       read, c.get("mix"))


# ---------------------------------------------------------------------------
# Batching


def tokenize(examples, tok, max_seq_len, multiple=1):
    """[(ids, n_prompt)] for examples that fit the context once make_batch has padded
    them to a multiple of `multiple`; the rest are dropped."""
    out = [tok.example_ids(e["prompt"], e["response"]) for e in examples]
    return [(ids, n) for ids, n in out if len(ids) + (-len(ids) % multiple) - 1 <= max_seq_len]


def length_buckets(seqs, n_buckets, multiple=1, min_seqs=1):
    """Row indices sorted by padded length and cut into n_buckets of equal size (fewer when a bucket
    would hold under min_seqs): a batch drawn from one bucket carries little padding."""
    n_buckets = max(1, min(n_buckets, len(seqs) // max(1, min_seqs)))
    if n_buckets == 1:  # one bucket, in sequence order: the plain uniform draws
        return [list(range(len(seqs)))]
    order = sorted(range(len(seqs)), key=lambda i: -(-len(seqs[i][0]) // multiple))
    return [order[k * len(order) // n_buckets:(k + 1) * len(order) // n_buckets] for k in range(n_buckets)]


def draw_batch(buckets, batch_size, generator):
    """batch_size sequence indices, drawn with replacement from one bucket chosen in proportion to its size,
    so every sequence is as likely as in uniform draws over all sequences."""
    bucket = buckets[0]
    if len(buckets) > 1:
        sizes = torch.tensor([len(b) for b in buckets], dtype=torch.float)
        bucket = buckets[int(torch.multinomial(sizes, 1, generator=generator))]
    return [bucket[i] for i in torch.randint(len(bucket), (batch_size,), generator=generator).tolist()]


def make_batch(seqs, pad_id, multiple=1):
    """Right-padded inputs x and targets y (-1 = no loss). Input x is ids[:-1];
    y[q] = ids[q+1] where that is a response token or the closing <|endoftext|>.

    multiple > 1 (MARS, multiple = B): each sequence is first extended with
    <|endoftext|> to a length that is a multiple of B, and those are trained on,
    so that masks past the end of an answer learn to predict the end (the
    official trainer's AppendEOSBlockWrapper)."""
    seqs = [(ids + [pad_id] * (-len(ids) % multiple), n) for ids, n in seqs]
    T = max(len(ids) - 1 for ids, _ in seqs)
    x = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    y = torch.full((len(seqs), T), -1, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(seqs):
        t = torch.tensor(ids)
        x[i, :len(ids) - 1] = t[:-1]
        y[i, n_prompt - 1:len(ids) - 1] = t[n_prompt:]
    return x, y
