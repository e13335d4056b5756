"""Verifiable instructions in the style of IFEval (one of the paper's six benchmarks), built offline: each
prompt carries the rule its answer must follow, and `passes` checks the rule in code, so a real model's
quality is scored without a judge.

    from extras.real.checks import check_question, passes
    q = check_question(random.Random(0))  # {"task": "check", "kind", "prompt", "rule"}
    passes(q, "Gravity pulls things together.")

Eight kinds, drawn in equal shares; the word lists come from extras/real/words.py:
  one_sentence   "... in one sentence."                 exactly one sentence, on one line
  three_tips     "... exactly three tips, numbered ..."  exactly three lines numbered 1, 2, 3
  haiku          "a haiku ... in three lines"            exactly three non-empty lines
  use_word       "... uses the word X"                    X appears as a whole word
  no_repeat      "... with no word repeated"              no word (letters only, any case) twice
  under_20       "... in under 20 words"                  at most 19 words
  plural         "What is the plural of X?"               the plural appears as a whole word
  language       "What language is spoken in X?"          the country's main language appears
"""
import re

from extras.real import words as lists

PLURALS = {
    "child": "children", "mouse": "mice", "goose": "geese", "tooth": "teeth", "foot": "feet", "man": "men",
    "woman": "women", "person": "people", "ox": "oxen", "leaf": "leaves", "knife": "knives", "wolf": "wolves",
    "shelf": "shelves", "loaf": "loaves", "half": "halves", "city": "cities", "baby": "babies", "party": "parties",
    "story": "stories", "berry": "berries", "box": "boxes", "fox": "foxes", "bus": "buses", "glass": "glasses",
    "brush": "brushes", "church": "churches", "match": "matches", "potato": "potatoes", "tomato": "tomatoes",
    "hero": "heroes", "cactus": "cacti", "fungus": "fungi", "crisis": "crises", "sheep": "sheep", "deer": "deer",
    "fish": "fish", "apple": "apples", "river": "rivers", "candle": "candles", "garden": "gardens",
    "planet": "planets", "window": "windows", "pencil": "pencils", "rabbit": "rabbits", "castle": "castles",
    "bottle": "bottles", "key": "keys", "toy": "toys", "day": "days", "monkey": "monkeys",
}
LANGUAGES = {
    "France": "French", "Spain": "Spanish", "Italy": "Italian", "Germany": "German", "Japan": "Japanese",
    "Portugal": "Portuguese", "Greece": "Greek", "Russia": "Russian", "China": "Chinese", "Poland": "Polish",
    "Sweden": "Swedish", "Norway": "Norwegian", "Finland": "Finnish", "Denmark": "Danish", "Hungary": "Hungarian",
    "Turkey": "Turkish", "Thailand": "Thai", "Vietnam": "Vietnamese", "Iran": "Persian", "Mexico": "Spanish",
    "Argentina": "Spanish", "Colombia": "Spanish", "Peru": "Spanish", "Chile": "Spanish", "Cuba": "Spanish",
    "Brazil": "Portuguese", "Egypt": "Arabic", "Iraq": "Arabic", "Morocco": "Arabic", "Austria": "German",
    "Australia": "English", "Ireland": "English", "Nepal": "Nepali", "Korea": "Korean", "Indonesia": "Indonesian",
    "the Netherlands": "Dutch", "Ukraine": "Ukrainian", "Romania": "Romanian", "Czechia": "Czech",
    "Israel": "Hebrew", "Saudi Arabia": "Arabic", "Iceland": "Icelandic", "Croatia": "Croatian",
}


def words(text):
    return re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)?", text)


def lines(text):
    return [line for line in text.strip().splitlines() if line.strip()]


def whole_word(word, text):
    return re.search(rf"(?<![A-Za-z]){re.escape(word.lower())}(?![A-Za-z])", text.lower()) is not None


def one_sentence(text, rule):
    pieces = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    return len(lines(text)) == 1 and len(pieces) == 1 and text.strip()[-1:] in ".!?"


def three_tips(text, rule):
    numbers = [int(m) for m in re.findall(r"(?m)^\s*(\d+)[.)]\s+\S", text)]
    return numbers == [1, 2, 3]


def no_repeat(text, rule):
    found = [w.lower() for w in words(text)]
    return bool(found) and len(found) == len(set(found))


PASSES = {
    "one_sentence": one_sentence,
    "three_tips": three_tips,
    "haiku": lambda text, rule: len(lines(text)) == 3,
    "use_word": lambda text, rule: whole_word(rule["word"], text),
    "no_repeat": no_repeat,
    "under_20": lambda text, rule: 0 < len(words(text)) < 20,
    "plural": lambda text, rule: whole_word(rule["word"], text),
    "language": lambda text, rule: whole_word(rule["word"], text),
}


# kind -> (prompt template, the list its slot draws from, the rule of an entry)
TEMPLATES = {
    "one_sentence": ("Explain {} in one sentence.", lists.TOPICS, lambda w: {}),
    "three_tips": ("Give exactly three tips for {}, as a numbered list.", lists.ACTIVITIES, lambda w: {}),
    "haiku": ("Write a haiku about {}, in three lines.", lists.TOPICS, lambda w: {}),
    "use_word": ("Write one sentence that uses the word \"{}\".", lists.NOUNS, lambda w: {"word": w}),
    "no_repeat": ("Describe {} in a few words, with no word repeated.", lists.A_NOUN, lambda w: {}),
    "under_20": ("Tell me about {} in under 20 words.", lists.TOPICS, lambda w: {}),
    "plural": ("What is the plural of \"{}\"?", sorted(PLURALS), lambda w: {"word": PLURALS[w]}),
    "language": ("What language is mostly spoken in {}?", sorted(LANGUAGES), lambda w: {"word": LANGUAGES[w]}),
}


def check_question(rng):
    """One verifiable instruction: {"task": "check", "question", "prompt", "kind", "rule"}."""
    kind = rng.choice(sorted(TEMPLATES))
    template, entries, rule = TEMPLATES[kind]
    entry = rng.choice(entries)
    prompt = template.format(entry)
    return {"task": "check", "question": prompt, "prompt": prompt, "kind": kind, "rule": rule(entry)}


def passes(example, text):
    """Whether text (an answer, its end of turn left out) follows the example's instruction."""
    return bool(PASSES[example["kind"]](text, example["rule"]))
