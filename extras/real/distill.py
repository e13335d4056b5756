"""Self-distillation: a model's own greedy answers to a prompt set, as MARS training data.

    python -m extras.real.distill --ckpt smollm2 --out out/smollm/distilled.jsonl --val out/smollm/val.jsonl \
        --heldout out/smollm/heldout.jsonl --stats docs/distill_smollm2_cpu.json

MARS teaches a model to write several of its own next tokens per forward. Trained on someone else's
answers, it would also drift towards their text; trained on its own greedy answers it keeps its own
distribution: the clean (AR) stream relearns what it already writes, and every draft the masks learn to
predict is a token the base model would have written there. So the data is the base model's answers,
decoded greedily (B = 1, tau = 1: plain AR) with the KV cache, many prompts at a time, through the model's
own chat template (Tokenizer.prompt_ids).

The prompts are built here, offline, from a seed; nothing is downloaded. Three kinds:
  - the toy's ten task families (data.py's generators, with their openers);
  - general instructions: the templates of GENERAL filled from word lists (data.py's and the ones below),
    the model's ordinary English (explanations, tips, lists, short poems), asking for short answers;
  - checkable instructions (extras/real/checks.py: "in one sentence", "exactly three tips", ...), each with
    a checker in code.
  - with --self_prompts, requests the model wrote itself (python -m extras.real.self_prompts: Magpie's way), a
    source of any size that follows the model's own users rather than a generator's.
Each template kind is drawn as distinct questions (an opener does not make a new question) from its own seeded
generator; each record says its source ("template" or "self"). The self-written requests have held-out and
validation slices of their own (--heldout_self), so that tokens per forward is also measured on the model's own
distribution. The held-out file is the first --n_heldout checkable instructions, never trained on; then come
the validation prompts (with the model's answers, for choosing a recipe), then the training prompts.

Answers cut off by --max_new_tokens (no end of turn; mostly loops) are not in the training file; they go
to a file of their own beside it, so a run can train on them too. The files are written at the end,
atomically; answers go to <out>.partial as they come, so an interrupted run resumes where it stopped
(rerun the same command).
"""
import json
import os
import random
import shlex
import sys
import time
from collections import deque

import torch

import data
from extras.engine import engine
from common import UserError
from common import Parser, add_device, run_cli
from extras.bench.eval import machine
from extras.checkpoints import foreign
from extras.real import checks
from extras.real.words import A_NOUN, A_PLACE, ACTIVITIES, ADJECTIVES, TOPICS

# General instructions: a template and the word list (extras/real/words.py) each slot draws from (two slots draw
# distinct entries).
GENERAL = [  # the checkable instructions (extras/real/checks.py) are a kind of their own, not here
    ("What do you know about {}? Answer briefly.", TOPICS), ("Why is {} useful? Answer in two sentences.", TOPICS),
    ("Give one tip for {}.", ACTIVITIES), ("Give three short tips for {}.", ACTIVITIES),
    ("What is the first step in {}?", ACTIVITIES), ("Describe {} in one sentence.", A_NOUN),
    ("Write a two-line poem about {}.", A_NOUN), ("Give a word that rhymes with {}.", data.WORDS),
    ("Write a short title for a story about {}.", A_NOUN),
    ("What is the difference between {} and {}? Answer in one sentence.", A_NOUN),
    ("Name three things you can find in {}.", A_PLACE), ("Describe {} in two sentences.", A_PLACE),
    ("Tell me one fact about {}.", sorted(data.CAPITALS)), ("Give a synonym for {}.", ADJECTIVES),
    ("Use the word {} in a sentence.", ADJECTIVES),
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


KINDS = {"toy": toy_question, "general": general_question, "check": checks.check_question}
ALL_KINDS = (*KINDS, "self")  # the template kinds, and the requests the model wrote (--self_prompts)


def prompt_sets(n_train, n_val, n_heldout, shares, seed):
    """{"heldout", "val", "train"}: lists of {"task", "prompt", ...}. The held-out set is the first n_heldout
    checkable instructions (extras/real/checks.py), scored by their checkers and never trained on; validation
    (for choosing a recipe) and training take each kind in `shares` ({kind: share}). Each kind draws distinct
    questions from its own seeded generator, held-out first, then validation, then training, so no two sets
    share a question and the held-out set does not depend on the other sizes."""
    sets = {"heldout": [], "val": [], "train": []}
    for kind, share in shares.items():
        sizes = {"heldout": n_heldout if kind == "check" else 0, "val": round(n_val * share),
                 "train": round(n_train * share)}
        total = sum(sizes.values())
        questions = distinct_questions(KINDS[kind], total, random.Random(f"{seed}-{kind}")) if total else []
        start = 0
        for name, n in sizes.items():
            for q in questions[start:start + n]:
                del q["question"]
                sets[name].append(q)
            start += n
    for name, prompts in sets.items():
        random.Random(f"{seed}-{name}").shuffle(prompts)  # the kinds interleaved
    return sets


def read_self_prompts(path, n_heldout, n_val, n_train):
    """{"heldout", "val", "train"} of the self-written requests in path (python -m extras.real.self_prompts), in
    file order: the first n_heldout held out, the next n_val for validation, then n_train (0: the rest) to train."""
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable JSONL ({e})") from None
    if not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) and r["prompt"].strip() for r in records):
        raise UserError(f"{path}: expected one {{\"prompt\": text}} per line (python -m extras.real.self_prompts)")
    if len(records) <= n_heldout + n_val:
        raise UserError(f"{path} holds {len(records)} requests: more than --n_heldout_self + --n_val_self "
                        f"({n_heldout + n_val}) are needed, the rest to train on")
    prompts = [{"task": "self", "prompt": r["prompt"].strip(), "source": "self"} for r in records]
    return {"heldout": prompts[:n_heldout], "val": prompts[n_heldout:n_heldout + n_val],
            "train": prompts[n_heldout + n_val:][:n_train or None]}


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


def write_json(path, record):
    """Atomically, as write_jsonl."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
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
                                   "source": p.get("source", "template"), "split": p.get("split"),
                                   "cut_off": r.tokens[-1:] != [tok.eot], "ids_kept": ids[n:-1] == answer}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            progress.report(len(done), sum(not d["cut_off"] for d in done.values()), len(r.tokens))
    progress.report(len(done), sum(not d["cut_off"] for d in done.values()), 0, last=True)
    return [done[i] for i in range(len(prompts))]


def row_stats(records, tok):
    """Lengths, in tokens, of the answers and of the training rows (the template's prompt, the answer, its end)."""
    rows = [tok.example_ids(r["prompt"], r["response"]) for r in records]  # (ids, prompt length) per row
    n = max(len(rows), 1)
    return {"n": len(records), "mean_row_tokens": round(sum(len(ids) for ids, _ in rows) / n, 1),
            "max_row_tokens": max((len(ids) for ids, _ in rows), default=0),
            "mean_answer_tokens": round(sum(len(ids) - k for ids, k in rows) / n, 1)}


def kind(record):
    """The kind of prompt a record answers: toy (one of the toy's families), general, check or self (written by
    the model)."""
    return record["task"] if record["task"] in ("general", "check", "self") else "toy"


def statistics(command, sets, records, tok, args, seconds):
    """What the distillation made, for docs/: prompts per kind, answers kept and cut off, lengths, time."""
    kept = [r for r in records if not r["cut_off"]]
    return {"command": command, "machine": machine(), "ckpt": args.ckpt, "max_new_tokens": args.max_new_tokens,
            "prompts": {name: {k: sum(kind(p) == k for p in v) for k in ALL_KINDS} for name, v in sets.items()},
            "train": {"answered": sum(r["split"] == "train" for r in records),
                      "kept": sum(r["split"] == "train" for r in kept),
                      "cut_off": sum(r["split"] == "train" and r["cut_off"] for r in records),
                      "cut_off_by_kind": {k: sum(r["split"] == "train" and r["cut_off"] and kind(r) == k
                                                 for r in records) for k in ALL_KINDS},
                      "retokenize_to_the_same_ids": sum(r["ids_kept"] for r in kept if r["split"] == "train"),
                      **row_stats([r for r in kept if r["split"] == "train"], tok)},
            "val": {"answered": sum(r["split"] == "val" for r in records),
                    "cut_off": sum(r["split"] == "val" and r["cut_off"] for r in records)},
            "seconds": round(seconds, 1)}


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ckpt", default="smollm2", help="the model whose answers are distilled: a GGUF file or short "
                   "name, a Hugging Face directory or one of our checkpoints (default smollm2)")
    p.add_argument("--out", required=True, help="the training JSONL to write: one {prompt, response} per finished "
                   "answer; the answers cut off at the budget go beside it, to <out stem>_cut_off.jsonl")
    p.add_argument("--heldout", required=True, help="the held-out JSONL to write: checkable instructions, {task, "
                   "prompt, kind, rule} per line, never trained on (python -m extras.real.eval --heldout)")
    p.add_argument("--val", required=True, help="the validation JSONL to write: {task, prompt, response, cut_off} "
                   "with the model's own answer, for choosing a recipe (never the held-out prompts)")
    p.add_argument("--self_prompts", help="a JSONL of requests the model wrote (python -m extras.real.self_prompts): "
                   "the first --n_heldout_self are held out, the next --n_val_self validate, the rest are trained on")
    p.add_argument("--heldout_self", help="the held-out JSONL to write of the self-written requests (with "
                   "--self_prompts): {task, prompt, source} per line, never trained on")
    p.add_argument("--n_heldout_self", type=int, default=64, help="self-written requests held out (default 64)")
    p.add_argument("--n_val_self", type=int, default=24, help="self-written requests for validation (default 24)")
    p.add_argument("--n_train_self", type=int, default=0, help="self-written requests to train on, the next ones "
                   "(default 0: all the rest)")
    p.add_argument("--stats", help="a JSON to write the distillation's statistics and command to (e.g. "
                   "docs/distill_smollm2_cpu.json)")
    p.add_argument("--n_train", type=int, default=1200, help="training prompts to answer (default 1200)")
    p.add_argument("--n_val", type=int, default=48, help="validation prompts (default 48)")
    p.add_argument("--n_heldout", type=int, default=320, help="held-out checkable instructions (default 320)")
    p.add_argument("--shares", type=float, nargs=3, default=[0.4, 0.4, 0.2], metavar=("TOY", "GENERAL", "CHECK"),
                   help="shares of training and validation prompts from the toy's task families, general "
                   "instructions and checkable instructions (default 0.4 0.4 0.2)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="the answer's budget (default 128)")
    p.add_argument("--batch", type=int, default=32, help="prompts decoded together (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the held-out split (default 0)")
    add_device(p)
    args = p.parse_args(argv)
    if min(args.n_train, args.max_new_tokens, args.batch) < 1 or min(args.n_heldout, args.n_val) < 0:
        p.error("--n_train, --max_new_tokens and --batch must be at least 1, --n_heldout and --n_val at least 0")
    if min(args.shares) < 0 or abs(sum(args.shares) - 1) > 1e-6:
        p.error("--shares must be three non-negative shares that add up to 1")
    files = [f for f in (args.out, args.heldout, args.val, args.heldout_self) if f]
    if len({os.path.abspath(f) for f in files}) < len(files):
        p.error("--out, --heldout, --val and --heldout_self must be different files")
    if bool(args.self_prompts) != bool(args.heldout_self) or min(args.n_heldout_self, args.n_val_self, args.n_train_self) < 0:
        p.error("--self_prompts and --heldout_self go together; --n_heldout_self, --n_val_self and --n_train_self "
                "must be >= 0")
    return args


@torch.inference_mode()
def main(argv=None):
    args, t0 = get_args(argv), time.time()
    command = shlex.join(["python", "-m", "extras.real.distill", *(sys.argv[1:] if argv is None else argv)])
    sets = prompt_sets(args.n_train, args.n_val, args.n_heldout, dict(zip(KINDS, args.shares)), args.seed)
    write_jsonl(args.heldout, sets["heldout"])
    print(f"{args.heldout}: {len(sets['heldout'])} held-out checkable instructions")
    if args.self_prompts:
        own = read_self_prompts(args.self_prompts, args.n_heldout_self, args.n_val_self, args.n_train_self)
        write_jsonl(args.heldout_self, own["heldout"])
        print(f"{args.heldout_self}: {len(own['heldout'])} held-out self-written requests")
        for name in ("val", "train"):
            sets[name] += own[name]
    _, model, tok = foreign.load(args.ckpt, args.device)
    prompts = [{**p, "split": name} for name in ("val", "train") for p in sets[name]]
    try:
        records = distill(model.eval(), tok, prompts, args.out + ".partial", args.batch, args.max_new_tokens)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"the answers so far are in {args.out}.partial; rerun the same command to resume") \
            from None
    write_jsonl(args.val, [{k: r[k] for k in ("task", "source", "prompt", "response", "cut_off")}
                           for r in records if r["split"] == "val"])
    train = [r for r in records if r["split"] == "train"]
    stem = os.path.splitext(args.out)[0]
    for path, rows in ((args.out, [r for r in train if not r["cut_off"]]),
                       (stem + "_cut_off.jsonl", [r for r in train if r["cut_off"]])):
        write_jsonl(path, [{"prompt": r["prompt"], "response": r["response"]} for r in rows])
        print(f"{path}: {len(rows)} answers")
    os.remove(args.out + ".partial")
    if args.stats:
        stats = statistics(command, sets, records, tok, args, time.time() - t0)
        write_json(args.stats, stats)
        print(f"{args.stats}: {json.dumps(stats['train'])}")


if __name__ == "__main__":
    run_cli(main)
