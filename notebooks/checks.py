"""The verdicts of the notebooks' exercises.

A check runs your function beside the project's own on several inputs (random ones from fixed
seeds, and the edge cases) and prints and returns one verdict: "right" (equal on every input),
"not done yet" (it still raises NotImplementedError, or returns None) or "wrong: ..." (what
differed, on which input). A check never raises, so that Run All goes on. `compare` sets a
prediction beside what the run gives. Worked solutions: notebooks/solutions/; tests/test_checks.py
feeds every check known-wrong versions.
"""
import torch

import data
import mars
import sample
from model import GPT, GPTConfig

RIGHT, NOT_DONE = "right", "not done yet"
V, EOT, MASK = 40, 38, 39  # the checks' vocabulary: ordinary ids 0..37, then <|endoftext|> and <|mask|>


class Verdict(Exception):
    """Stops a check at the first input that decides it."""


def verdict(name, check):
    """Run check(), which raises Verdict("wrong: ...") or Verdict(NOT_DONE) or returns; print the verdict."""
    try:
        check()
        said = RIGHT
    except Verdict as v:
        said = str(v)
    except Exception as e:  # the function's output was of a kind the check could not read
        said = f"wrong: its output could not be read ({type(e).__name__}: {e})"
    print(f"{name}: {said}")
    return said


def call(fn, where, *args):
    """fn(*args); NotImplementedError, None or ... mean not done yet; any other exception is wrong."""
    try:
        out = fn(*args)
    except NotImplementedError:
        raise Verdict(NOT_DONE)
    except Exception as e:
        raise Verdict(f"wrong: raised {type(e).__name__}: {e} (on {where})")
    if out is None or out is Ellipsis:
        raise Verdict(NOT_DONE)
    return out


def as_tensor(out, shape, where):
    """out as a tensor of this shape, or the verdict that it is not one."""
    try:
        out = torch.as_tensor(out)
    except Exception:
        raise Verdict(f"wrong: returned a {type(out).__name__}, not a tensor (on {where})")
    if tuple(out.shape) != tuple(shape):
        raise Verdict(f"wrong: shape {tuple(out.shape)}, expected {tuple(shape)} (on {where})")
    return out


def batches(seed, rows, multiple):
    """x, y of data.make_batch for `rows` random examples: [eot] + prompt + response + [eot],
    of different lengths (short rows are right-padded), padded to a multiple of B when multiple > 1."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(rows):
        prompt = torch.randint(0, EOT, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(0, EOT, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist()
        seqs.append(([EOT] + prompt + response + [EOT], 1 + len(prompt)))
    return data.make_batch(seqs, EOT, multiple)


# ---------------------------------------------------------------------------
# 01: the attention mask and the noisy copy

def stream(i, T):
    return f"n{i}" if i < T else f"c{i - T}"


def check_mask_rule(fn):
    """fn(seq_len, B) -> bool (2T, 2T) mask over [noisy | clean], against mars.mars_attention_mask."""
    def run():
        for T, B in [(12, 4), (8, 4), (7, 3), (5, 1), (4, 4), (3, 8), (10, 2), (1, 1)]:
            where = f"seq_len = {T}, B = {B}"
            want = mars.mars_attention_mask(T, B)
            got = as_tensor(call(fn, where, T, B), want.shape, where)
            if got.dtype != torch.bool:
                raise Verdict(f"wrong: a {got.dtype} mask, expected torch.bool (True = may attend) (on {where})")
            bad = (got != want).nonzero().tolist()
            if bad:
                i, j = bad[0]
                kind = ["noisy", "clean"][i >= T] + " -> " + ["noisy", "clean"][j >= T]
                raise Verdict(f"wrong: on {where}, query {stream(i, T)} -> key {stream(j, T)} ({kind}): expected "
                              f"{bool(want[i, j])}, got {bool(got[i, j])} ({len(bad)} entries differ)")
    return verdict("check_mask_rule", run)


def check_noisy_copy(fn):
    """fn(x, y, mask_id) -> the noisy stream, against mars.noisy_copy, on batches like data.make_batch's."""
    name = lambda t: {EOT: "<|endoftext|>", MASK: "<|mask|>"}.get(t, f"id {t}")

    def run():
        for seed, rows, multiple in [(0, 1, 1), (1, 3, 1), (2, 3, 4), (3, 5, 4), (4, 4, 2)]:
            x, y = batches(seed, rows, multiple)
            where = f"a batch x of shape {tuple(x.shape)}" + (f", padded to a multiple of {multiple}"
                                                              if multiple > 1 else "")
            x_in = x.clone()
            got = as_tensor(call(fn, where, x_in, y.clone(), MASK), x.shape, where)
            if not torch.equal(x_in, x):
                raise Verdict(f"wrong: it changed x in place (the clean stream reads x) (on {where})")
            want = mars.noisy_copy(x, y, MASK)
            bad = (got != want).nonzero().tolist()
            if bad:
                r, q = bad[0]
                first = int((y[r] != -1).int().argmax()) + 1  # the row's first response position
                kind = ("a response position" if want[r, q] == MASK else "a prompt position" if q < first
                        else "right padding after the answer")
                raise Verdict(f"wrong: on {where}, row {r}, position {q} ({kind}, holding {name(int(x[r, q]))}): "
                              f"expected {name(int(want[r, q]))}, got {name(int(got[r, q]))} "
                              f"({len(bad)} positions differ)")
    return verdict("check_noisy_copy", run)


# ---------------------------------------------------------------------------
# 02: the two-part loss from the model's logits

def loss_cases():
    """(x, y, B, ar_weight, the [noisy | clean] logits (b, 2T, V)) for a small random model whose predictions
    are sharp (the final norm scaled up), so that token losses, and the ways to average them, differ widely."""
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(0)
        net = GPT(GPTConfig(vocab_size=V, max_seq_len=64, n_layer=1, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        net.norm_f.weight.mul_(10)
    cases = [(0, 3, 4, 1.0), (1, 4, 4, 0.5), (2, 2, 2, 2.0), (3, 1, 4, 1.0), (4, 5, 4, 0.0)]
    for seed, rows, B, ar_weight in cases:
        x, y = batches(seed, rows, B)
        T = x.shape[1]
        ids = torch.cat([mars.noisy_copy(x, y, MASK), x], dim=1)
        with torch.no_grad():  # every position, none left out: the logits line up with the T targets
            logits = net(ids, positions=torch.arange(T).repeat(2), attn_mask=mars.mars_attention_mask(T, B))
            reference = mars.mars_loss(net, x, y, MASK, B, ar_weight)
        yield x, y, B, ar_weight, logits, reference


def check_mars_loss(fn):
    """fn(noisy_logits, clean_logits, targets, ar_weight) -> (loss, noisy, clean), against mars.mars_loss
    on the same model and batch."""
    def run():
        for x, y, B, ar_weight, logits, reference in loss_cases():
            T = x.shape[1]
            where = f"a batch x of shape {tuple(x.shape)}, B = {B}, ar_weight = {ar_weight}"
            out = call(fn, where, logits[:, :T].clone(), logits[:, T:].clone(), y.clone(), ar_weight)
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise Verdict(f"wrong: returned a {type(out).__name__}, not (loss, noisy, clean) (on {where})")
            for part, got, want in zip(["loss", "noisy", "clean"], out, reference):
                got = as_tensor(got, (), f"{part}, {where}").detach().double()
                if not torch.allclose(got, want.double(), rtol=1e-5, atol=1e-5):
                    raise Verdict(f"wrong: {part} on {where}: expected {want.item():.5f}, got {got.item():.5f}")
    return verdict("check_mars_loss", run)


# ---------------------------------------------------------------------------
# 03: the acceptance rule, and one window of the loop

ACCEPT_CASES = [  # (confidences, tau, what the case tests)
    ([[0.95, 0.97, 0.91, 0.62]], 0.9, "it stops at the first confidence below tau"),
    ([[0.2, 0.9, 0.9, 0.5]], 0.9, "a confidence equal to tau is committed"),
    ([[0.4, 1.0, 1.0, 1.0]], 1.0, "tau = 1.0 commits one token, even after confidences of exactly 1.0"),
    ([[0.1, 0.2, 0.95, 0.99]], 0.9, "the first prediction is committed even below tau"),
    ([[0.99, 0.95, 0.97, 1.0]], 0.9, "every prediction passes"),
    ([[0.95, 0.3, 0.99, 0.99]], 0.9, "nothing after a miss is committed"),
    ([[0.7], [0.1], [1.0]], 0.5, "B = 1"),
]


def check_accept(fn):
    """fn(conf, tau) -> (b,) how many predictions each row commits, against mars.accept."""
    g = torch.Generator().manual_seed(0)
    cases = ACCEPT_CASES + [(torch.rand(shape, generator=g).tolist(), tau, "random confidences")
                            for shape, tau in [((6, 4), 0.5), ((5, 8), 0.3), ((4, 4), 0.05), ((3, 4), 1.0)]]

    def run():
        for rows, tau, why in cases:
            conf = torch.tensor(rows)
            where = f"tau = {tau}, {why}"
            got = as_tensor(call(fn, where, conf.clone(), tau), (len(rows),), where)
            want = mars.accept(conf, tau)
            bad = (got.double() != want.double()).nonzero().flatten().tolist()
            if bad:
                r = bad[0]
                shown = ", ".join(f"{c:.2f}" for c in rows[r])
                raise Verdict(f"wrong: confidences [{shown}] at tau = {tau} ({why}): expected {int(want[r])}, "
                              f"got {got[r].item()}")
    return verdict("check_accept", run)


def check_window(fn, model, tok, B, prompts, taus=(1.0, 0.9, 0.6, 0.3)):
    """fn(model, prompt, tau) -> the ids the first forward of the paper's loop commits for the prompt, against
    the first forward of sample.generate, for every prompt and tau."""
    def run():
        for tau in taus:
            for i, prompt in enumerate(prompts):
                where = f"prompt {i} ({len(prompt)} ids), tau = {tau}"
                got = call(fn, where, model, list(prompt), tau)
                got = torch.as_tensor(got).flatten().tolist()
                _, chunks = sample.generate(model, [prompt], tok.eot, tok.mask, B, tau=tau, max_new_tokens=B,
                                            n_vocab=tok.n_vocab)[0]
                if got != chunks[0]:
                    raise Verdict(f"wrong: on {where}: expected {tok.decode(chunks[0])!r} (ids {chunks[0]}), "
                                  f"got ids {got}")
    return verdict("check_window", run)


# ---------------------------------------------------------------------------
# 04: the adaptive policy's ladder

def check_next_rung(fn):
    """fn(rung, load) -> the rung for this forward, against scheduler.Adaptive's default ladder (its smoothing
    set to 1: its smoothed load is the load given), at every rung over a grid of loads, thresholds included."""
    from extras.serving.scheduler import Adaptive

    loads = sorted({i / 4 for i in range(16)} | {0.49, 0.51, 0.99, 1.01, 1.49, 1.51, 2.01})

    def run():
        for rung in range(len(Adaptive.ladder)):
            for load in loads:
                policy = Adaptive(smoothing=1.0, rung=rung)
                policy(load)
                where = f"rung {rung} (tau {Adaptive.ladder[rung]}), smoothed load {load}"
                got = call(fn, where, rung, load)
                if got != policy.rung:
                    raise Verdict(f"wrong: at {where}: expected rung {policy.rung}, got {got}")
    return verdict("check_next_rung", run)


# ---------------------------------------------------------------------------
# Predictions

WORDS = {"yes": True, "true": True, "no": False, "false": False}


def same(prediction, run, tol):
    """A set in any order; yes/no for True/False; text without regard to case; numbers within tol."""
    if isinstance(run, (set, frozenset)):
        return set(prediction) == run
    if isinstance(run, bool):
        if isinstance(prediction, str):
            prediction = WORDS.get(prediction.strip().lower())
        return prediction in (True, False) and bool(prediction) == run
    if isinstance(run, str) or isinstance(prediction, str):
        return str(prediction).strip().lower() == str(run).strip().lower()
    if isinstance(run, (int, float)):
        return abs(float(prediction) - run) <= tol
    return prediction == run


def shown(value):
    if isinstance(value, (set, frozenset)):
        return str(sorted(value))
    return f"{value:.4g}" if isinstance(value, float) else repr(value)


def compare_one(prediction, run, tol, label=""):
    if prediction is None or prediction is Ellipsis:
        print(f"{label}no prediction yet; the run: {shown(run)}")
        return "no prediction yet"
    try:
        result = "match" if same(prediction, run, tol) else "no match"
    except Exception:  # a prediction of another kind: a word where a number was due
        result = "no match"
    print(f"{label}your prediction: {shown(prediction)}; the run: {shown(run)}; {result}")
    return result


def compare(prediction, run, tol=0.0):
    """Print your prediction beside what the run gives; return "match", "no match" or "no prediction yet"
    (prediction None). A dict is compared key by key, then summed up on one line: "match" when every key
    matches, "no prediction yet" while a key is None and none differs. Never raises."""
    if not isinstance(run, dict):
        return compare_one(prediction, run, tol)
    if prediction is not None and not isinstance(prediction, dict):
        print(f"your prediction: {shown(prediction)}; the run: {run}; no match (a dict with these keys is due)")
        return "no match"
    said = [compare_one((prediction or {}).get(k), v, tol, f"{k}: ") for k, v in run.items()]
    result = "no match" if "no match" in said else "no prediction yet" if "no prediction yet" in said else "match"
    print(f"overall: {result}")
    return result
