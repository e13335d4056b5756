"""Self-distillation: a model's own greedy answers to a prompt set, as MARS training data.

    python -m extras.real.distill --ckpt smollm2 --out out/smollm/distilled.jsonl --heldout out/smollm/heldout.jsonl

MARS teaches a model to write several of its own next tokens per forward. Trained on someone else's
answers, it would also drift towards their text; trained on its own greedy answers it keeps its own
distribution: the clean (AR) stream relearns what it already writes, and every draft the masks learn to
predict is a token the base model would have written there. So the data is the base model's answers,
decoded greedily (B = 1, tau = 1: plain AR) with the KV cache, many prompts at a time, through the model's
own chat template (Tokenizer.prompt_ids).

The prompts are built here, offline, from a seed; nothing is downloaded:
  - the toy's ten task families (data.py's generators, with their openers): each prompt keeps its family
    and exact answer, so held-out accuracy can be scored with the family's checker;
  - general instructions: the templates of GENERAL filled from word lists (data.py's and the ones below),
    so that the training text is the model's ordinary English (explanations, tips, lists, short poems), not
    only the toy's formats. They ask for short answers, which fit the token budget.
Each kind is drawn as distinct questions (an opener does not make a new question) from its own seeded
generator; the first --n_heldout of them, in the same proportions, go to the held-out file and are never
trained on (the training prompts are the next questions), whatever --n_train.

Answers cut off by --max_new_tokens (no end of turn) are dropped: they would teach the model to stop
mid-sentence. The training file is written at the end, atomically; finished answers go to <out>.partial
as they come, so an interrupted run resumes where it stopped (rerun the same command).
"""
import json
import os
import random
import time
from collections import deque

import torch

import data
import engine
from cli import Parser, UserError, load_checkpoint, model_from_checkpoint, run_cli

# General instructions: a template and the list each slot draws from (two slots draw distinct entries).
TOPICS = """gravity, photosynthesis, a rainbow, the water cycle, electricity, a volcano, the moon, friendship,
exercise, sleep, recycling, the internet, a computer, music, money, a library, the weather, ocean tides, the
seasons, a battery, a map, a calendar, a thermometer, a bridge, an earthquake, the sun, clouds, a magnet, a
telescope, a vaccine, a river delta, a desert, a rainforest, democracy, a museum, a recipe, a budget, a
password, an email, a bicycle, a compass, a microscope, a solar panel, a windmill, a glacier, a coral reef,
honeybees, a heartbeat, breathing, a shadow""".replace("\n", " ").split(", ")
ACTIVITIES = """learning to cook, studying for an exam, saving money, staying focused, making new friends, running
a first race, planting a garden, writing an email, reading more books, sleeping better, learning a language,
keeping a room tidy, drinking more water, giving a short speech, starting a journal, caring for a cat, walking
a dog, packing for a trip, cooking rice, baking bread, painting a wall, learning to swim, riding a bicycle,
preparing for an interview, taking notes in class""".replace("\n", " ").split(", ")
PLACES = """kitchen, forest, school, hospital, garden, city park, beach, library, farm, train station, museum,
bakery, zoo, desert, office, classroom, supermarket, campsite, airport, castle""".replace("\n", " ").split(", ")
ADJECTIVES = sorted(data.OPPOSITES)
NOUNS = [w for w in data.WORDS if w not in {"useful", "vivid", "urban", "lucky", "quick", "jolly", "noble", "lunar"}]
A_NOUN = [("an " if w[0] in "aeiou" else "a ") + w for w in NOUNS]
A_PLACE = [("an " if w[0] in "aeiou" else "a ") + w for w in PLACES]
GENERAL = [
    ("Explain {} in one sentence.", TOPICS), ("What do you know about {}? Answer briefly.", TOPICS),
    ("Why is {} useful? Answer in two sentences.", TOPICS), ("Write a haiku about {}.", TOPICS),
    ("Give one tip for {}.", ACTIVITIES), ("Give three short tips for {}.", ACTIVITIES),
    ("What is the first step in {}?", ACTIVITIES), ("Write a sentence that uses the word {}.", data.WORDS),
    ("Describe {} in one sentence.", A_NOUN), ("Write a two-line poem about {}.", A_NOUN),
    ("What is the plural of {}?", NOUNS), ("Give a word that rhymes with {}.", data.WORDS),
    ("Write a short title for a story about {}.", A_NOUN),
    ("What is the difference between {} and {}? Answer in one sentence.", A_NOUN),
    ("Name three things you can find in {}.", A_PLACE), ("Describe {} in two sentences.", A_PLACE),
    ("Tell me one fact about {}.", sorted(data.CAPITALS)), ("What language is spoken in {}?", sorted(data.CAPITALS)),
    ("Give a synonym for {}.", ADJECTIVES), ("Use the word {} in a sentence.", ADJECTIVES),
]


def toy_question(rng):
    """One question of the toy's families, drawn in equal shares, and its prompt behind one of data.OPENERS:
    {"task", "question", "prompt", "answer"}."""
    task = rng.choice(sorted(data.TASKS))
    question, _, answer = data.TASKS[task][0](rng)
    return {"task": task, "question": question, "prompt": rng.choice(data.OPENERS) + question, "answer": answer}


def general_question(rng):
    """One general instruction: {"task": "general", "question", "prompt"}."""
    template, words = rng.choice(GENERAL)
    question = template.format(*rng.sample(words, template.count("{}")))
    return {"task": "general", "question": question, "prompt": question}


def distinct_questions(draw, n, rng):
    """The first n distinct questions draw(rng) gives, in draw order; ValueError when draws keep repeating (the
    space is too small)."""
    found = {}
    for _ in range(50 * n):
        if len(found) == n:
            break
        q = draw(rng)
        found.setdefault(q["question"], q)
    if len(found) < n:
        raise ValueError(f"only {len(found)} distinct questions of this kind, {n} asked for")
    return list(found.values())


def prompt_sets(n_train, n_heldout, toy_share, seed):
    """(training prompts, held-out prompts): lists of {"task", "prompt"[, "answer"]}. Each kind (the toy's
    families, general instructions) draws distinct questions from its own seeded generator: the first ones are
    held out, in the same toy/general proportions, the next ones are for training, so a held-out question never
    has a training prompt and the held-out set does not depend on n_train."""
    train, heldout = [], []
    for kind, draw, share in (("toy", toy_question, toy_share), ("general", general_question, 1 - toy_share)):
        n_out, n_in = round(n_heldout * share), round(n_train * share)
        questions = distinct_questions(draw, n_out + n_in, random.Random(f"{seed}-{kind}")) if n_out + n_in else []
        for q in questions:
            del q["question"]
        heldout += questions[:n_out]
        train += questions[n_out:]
    for prompts, name in ((heldout, "heldout"), (train, "train")):
        random.Random(f"{seed}-{name}").shuffle(prompts)  # the families interleaved
    return train, heldout


def decode_all(model, tok, requests, batch, max_new_tokens, B=1):
    """Yields each of `requests` (engine.Request: prompt ids, tau, lossless) as soon as it finishes:
    continuous batching at B with at most `batch` rows, refilled in groups when half have left (a joining
    prompt widens every row's window to its own length, so joins come together)."""
    eng = engine.Engine(model, tok.eot, tok.mask, B, batch, max_new_tokens, n_vocab=tok.n_vocab,
                        max_context=max(len(r.prompt) for r in requests) + max_new_tokens)
    todo = deque(requests)
    while todo or eng.backlog:
        if len(eng.running) <= batch // 2:
            while todo and eng.backlog < batch:
                eng.waiting.append(todo.popleft())
        yield from eng.step()[1]


def write_jsonl(path, records):
    """Atomically: a temp file, then a rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(path + ".tmp", path)


def read_partial(path, prompts):
    """{prompt index: record} of the answers an interrupted run left in path; UserError if they belong to
    another prompt set."""
    if not os.path.exists(path):
        return {}
    where = {p["prompt"]: i for i, p in enumerate(prompts)}
    done = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
                done[where[r["prompt"]]] = r
            except (json.JSONDecodeError, KeyError):  # a line cut by the interruption, or another run's prompt
                if line.endswith("\n"):
                    raise UserError(f"{path} holds answers to other prompts (other flags?): delete it to start "
                                    "again") from None
    return done


class Progress:
    """A line every 30 s and at the end: prompts done, kept and dropped, tokens/s, ETA."""

    def __init__(self, total, done):
        self.total, self.start, self.shown = total, done, None
        self.t0, self.t_line, self.tokens = time.time(), time.time(), 0

    def report(self, done, kept, tokens, last=False):
        self.tokens += tokens
        now = time.time()
        if (now - self.t_line < 30 and not last) or self.shown == done:
            return
        rate = (done - self.start) / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate else float("nan")
        print(f"distilled {done}/{self.total} prompts: kept {kept}, dropped {done - kept} (cut off) | "
              f"{self.tokens / (now - self.t0):.1f} tokens/s | ETA {eta / 60:.1f} min", flush=True)
        self.t_line, self.shown = now, done


def distill(model, tok, prompts, path, batch, max_new_tokens):
    """Decodes every prompt's greedy answer, appending {prompt, response, task, cut_off, ids_kept} to path as
    they finish (resuming from what it holds). Returns the records in prompt order."""
    done = read_partial(path, prompts)
    if done:
        print(f"resuming: {len(done)} of {len(prompts)} prompts were already answered in {path}")
        write_jsonl(path, done.values())  # without a line the interruption cut
    todo = [i for i in range(len(prompts)) if i not in done]
    requests = [engine.Request(tok.prompt_ids(prompts[i]["prompt"]), index=i) for i in todo]
    progress = Progress(len(prompts), len(done))
    with open(path, "a", encoding="utf-8") as f:
        for r in decode_all(model, tok, requests, batch, max_new_tokens) if todo else []:
            p = prompts[r.index]
            answer = [t for t in r.tokens if t != tok.eot]
            response = tok.decode(answer)
            ids, n = tok.example_ids(p["prompt"], response)
            done[r.index] = rec = {"prompt": p["prompt"], "response": response, "task": p["task"],
                                   "cut_off": r.tokens[-1:] != [tok.eot], "ids_kept": ids[n:-1] == answer}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            progress.report(len(done), sum(not d["cut_off"] for d in done.values()), len(r.tokens))
    progress.report(len(done), sum(not d["cut_off"] for d in done.values()), 0, last=True)
    return [done[i] for i in range(len(prompts))]


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ckpt", default="smollm2", help="the model whose answers are distilled: a GGUF file or short "
                   "name, a Hugging Face directory or one of our checkpoints (default smollm2)")
    p.add_argument("--out", required=True, help="the training JSONL to write: one {prompt, response} per line")
    p.add_argument("--heldout", required=True, help="the held-out JSONL to write: {task, prompt[, answer]} per "
                   "line, never trained on (python -m extras.real.eval --heldout)")
    p.add_argument("--n_train", type=int, default=2400, help="training prompts to answer (default 2400), before "
                   "cut-off answers are dropped")
    p.add_argument("--n_heldout", type=int, default=300, help="held-out prompts (default 300)")
    p.add_argument("--toy_share", type=float, default=0.5, help="share of prompts from the toy's task families, "
                   "the rest general instructions (default 0.5)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="the answer's budget; answers it cuts off are "
                   "dropped (default 128)")
    p.add_argument("--batch", type=int, default=32, help="prompts decoded together (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the held-out split (default 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default cpu)")
    args = p.parse_args(argv)
    if min(args.n_train, args.max_new_tokens, args.batch) < 1 or args.n_heldout < 0:
        p.error("--n_train, --max_new_tokens and --batch must be at least 1, --n_heldout at least 0")
    if not 0 <= args.toy_share <= 1:
        p.error("--toy_share must be in [0, 1]")
    if os.path.abspath(args.out) == os.path.abspath(args.heldout):
        p.error("--out and --heldout must be different files")
    return args


@torch.inference_mode()
def main(argv=None):
    args = get_args(argv)
    train, heldout = prompt_sets(args.n_train, args.n_heldout, args.toy_share, args.seed)
    write_jsonl(args.heldout, heldout)
    print(f"{args.heldout}: {len(heldout)} held-out prompts ({sum(p['task'] != 'general' for p in heldout)} from "
          f"the toy's families)")
    model, tok = model_from_checkpoint(load_checkpoint(args.ckpt, args.device), args.device)
    records = distill(model.eval(), tok, train, args.out + ".partial", args.batch, args.max_new_tokens)
    kept = [r for r in records if not r["cut_off"]]
    write_jsonl(args.out, [{"prompt": r["prompt"], "response": r["response"]} for r in kept])
    os.remove(args.out + ".partial")
    print(f"{args.out}: {len(kept)} answers; {len(records) - len(kept)} cut off at {args.max_new_tokens} tokens "
          f"dropped; {sum(r['ids_kept'] for r in kept)} of the kept re-tokenize to the ids the model wrote")


if __name__ == "__main__":
    run_cli(main)
