"""The verdicts of the notebooks' exercises.

A check runs your function beside the project's own on several inputs (random ones from fixed
seeds, and the edge cases) and prints and returns one verdict: "right" (equal on every input),
"not done yet" (it still raises NotImplementedError, or returns None) or "wrong: ..." (the known
mistake it makes, where its outputs are those of a version with that mistake, and where its output
first differs). A check never raises, so that Run All goes on. `compare` sets a prediction beside
what the run gives. Worked solutions: notebooks/solutions/; tests/test_checks.py feeds every check
known-wrong versions.
"""
import copy

import torch
import torch.nn.functional as F

import data
import mars
import sample
from model import GPT, GPTConfig

RIGHT, NOT_DONE = "right", "not done yet"
V, EOT, MASK = 40, 38, 39  # the checks' vocabulary: ordinary ids 0..37, then <|endoftext|> and <|mask|>


class Verdict(Exception):
    """A check's verdict, raised where it is decided."""


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


def known_mistake(mistakes, seen, same):
    """The first known mistake whose outputs are the function's on every input, or None. seen: [(inputs,
    output)]; mistakes(*inputs) -> {mistake: what a version with it returns}."""
    versions = [(mistakes(*inputs), got) for inputs, got in seen]
    return next((name for name in versions[0][0] if all(same(got, wrong[name]) for wrong, got in versions)), None)


def wrong(mistake, difference):
    """The verdict: the mistake, when it is a known one, then where the output first differs."""
    return Verdict(f"wrong: {mistake}. First difference: {difference}" if mistake else f"wrong: {difference}")


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


def mask_mistakes(T, B):
    """The known wrong masks: {mistake: the MARS mask with one quadrant (query stream -> key stream) changed}."""
    pos = torch.arange(T)
    i, j, block_i, block_j = pos[:, None], pos[None, :], pos[:, None] // B, pos[None, :] // B

    def changed(query, key, rule):  # 0: noisy, 1: clean
        m = mars.mars_attention_mask(T, B)
        m[query * T:(query + 1) * T, key * T:(key + 1) * T] = rule
        return m
    return {  # blocks counted over the 2T indices: a clean key's, (T + j) // B, never precedes a noisy query's
        "noisy -> clean is empty: are the blocks counted over the 2T indices? block(p) = p // B, with p the "
        "position in its own stream (0..T-1)": changed(0, 1, False),
        "noisy -> clean includes the query's own block, where the clean stream holds the very tokens the noisy "
        "one must predict: earlier blocks only": changed(0, 1, block_j <= block_i),
        "noisy -> noisy sees the whole block, later positions too: causal within the block":
            changed(0, 0, block_j == block_i),
        "noisy -> noisy crosses blocks: its own block only": changed(0, 0, j <= i),
        "clean -> noisy is allowed: the clean stream is a plain AR model, it never sees the noisy one":
            changed(1, 0, j <= i),
    }


def check_mask_rule(fn):
    """fn(seq_len, B) -> bool (2T, 2T) mask over [noisy | clean], against mars.mars_attention_mask."""
    def run():
        seen = []
        for T, B in [(12, 4), (8, 4), (7, 3), (5, 1), (4, 4), (3, 8), (10, 2), (1, 1)]:
            where = f"seq_len = {T}, B = {B}"
            got = as_tensor(call(fn, where, T, B), (2 * T, 2 * T), where)
            if got.dtype != torch.bool:
                raise Verdict(f"wrong: a {got.dtype} mask, expected torch.bool (True = may attend) (on {where})")
            seen.append(((T, B), got))
        for (T, B), got in seen:
            want = mars.mars_attention_mask(T, B)
            bad = (got != want).nonzero().tolist()
            if bad:
                i, j = bad[0]
                kind = ["noisy", "clean"][i >= T] + " -> " + ["noisy", "clean"][j >= T]
                raise wrong(known_mistake(mask_mistakes, seen, torch.equal),
                            f"on seq_len = {T}, B = {B}, query {stream(i, T)} -> key {stream(j, T)} ({kind}): "
                            f"expected {bool(want[i, j])}, got {bool(got[i, j])} ({len(bad)} entries differ)")
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

def loss_model():
    """A small random model whose predictions are sharp (the final norm scaled up), so that token losses, and the
    ways to average them, differ widely."""
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(0)
        net = GPT(GPTConfig(vocab_size=V, max_seq_len=64, n_layer=1, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        net.norm_f.weight.mul_(10)
    return net


def loss_cases():
    """(x, y, B, ar_weight, the [noisy | clean] logits (b, 2T, V) of loss_model under the MARS mask)."""
    net = loss_model()
    for seed, rows, B, ar_weight in [(0, 3, 4, 1.0), (1, 4, 4, 0.5), (2, 2, 2, 2.0), (3, 1, 4, 1.0), (4, 5, 4, 0.0)]:
        x, y = batches(seed, rows, B)
        T = x.shape[1]
        ids = torch.cat([mars.noisy_copy(x, y, MASK), x], dim=1)
        with torch.no_grad():  # every position, none left out: the logits line up with the T targets
            logits = net(ids, positions=torch.arange(T).repeat(2), attn_mask=mars.mars_attention_mask(T, B))
        yield x, y, B, ar_weight, logits


def token_losses(logits, targets):
    """The cross-entropy at each position (b, T), 0 where the target is -1."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=-1, reduction="none")


def stand_in(logits):
    """A model for mars.mars_loss whose forward gives these [noisy | clean] logits: the reference loss, and its
    gradient, as functions of them. (mars_loss may leave leading noisy positions out: the first ones go.)"""
    return lambda ids, targets, **_: token_losses(logits[:, -ids.shape[1]:], targets)


def loss_mistakes(noisy_ce, clean_ce, targets, ar_weight):
    """What the known wrong versions return, from the token losses (b, T): {mistake: (loss, noisy, clean)}."""
    where = targets != -1
    per_sequence = lambda ce: (ce.sum(1) / where.sum(1).clamp_min(1)).mean()  # the right mean
    weighed = lambda noisy, clean: (noisy + ar_weight * clean, noisy, clean)
    noisy, clean = per_sequence(noisy_ce), per_sequence(clean_ce)
    return {
        "a token mean over the whole batch: take each sequence's mean over its own targets, then the mean over "
        "the sequences (a short answer weighs as much as a long one)": weighed(noisy_ce[where].mean(),
                                                                               clean_ce[where].mean()),
        "divided by T, every position: divide each sequence's sum by its number of targets":
            weighed(noisy_ce.mean(), clean_ce.mean()),
        "ar_weight (alpha) on the noisy term: the loss is noisy + ar_weight * clean": (ar_weight * noisy + clean,
                                                                                        noisy, clean),
        "ar_weight left out: the loss is noisy + ar_weight * clean": (noisy + clean, noisy, clean),
        "noisy and clean swapped: noisy_logits are the forward's first half, logits[:, :T]": weighed(clean, noisy),
    }


def close(got, want):
    """(loss, noisy, clean) against (loss, noisy, clean)."""
    return all(torch.allclose(g.double(), w.double(), rtol=1e-5, atol=1e-5) for g, w in zip(got, want))


def check_mars_loss(fn):
    """fn(noisy_logits, clean_logits, targets, ar_weight) -> (loss, noisy, clean), against mars.mars_loss on the
    same logits: the three values, then the gradient of loss with respect to both halves' logits."""
    def run():
        seen, cases = [], []
        with torch.enable_grad():
            for x, y, B, ar_weight, logits in loss_cases():
                T = x.shape[1]
                where = f"a batch x of shape {tuple(x.shape)}, B = {B}, ar_weight = {ar_weight}"
                halves = [logits[:, :T].clone().requires_grad_(), logits[:, T:].clone().requires_grad_()]
                out = call(fn, where, halves[0].clone(), halves[1].clone(), y.clone(), ar_weight)
                if not isinstance(out, (tuple, list)) or len(out) != 3:
                    raise Verdict(f"wrong: returned a {type(out).__name__}, not (loss, noisy, clean) (on {where})")
                if not isinstance(out[0], torch.Tensor):
                    raise Verdict(f"wrong: loss is a {type(out[0]).__name__}, not a tensor: .item() (or float()) "
                                  "cuts it off from the logits, and nothing could train. Keep the tensors")
                got = [as_tensor(part, (), f"{name}, {where}").detach()
                       for name, part in zip(["loss", "noisy", "clean"], out)]
                if not out[0].requires_grad:
                    raise Verdict("wrong: loss carries no gradient, and nothing could train: build it from the "
                                  "logits with tensor operations (no .item(), torch.tensor(...) or .detach())")
                want = mars.mars_loss(stand_in(torch.cat(halves, dim=1)), x, y, MASK, B, ar_weight)
                grads = torch.autograd.grad(out[0], halves, allow_unused=True)  # None: no gradient at all
                seen.append(((*[token_losses(half.detach(), y) for half in halves], y, ar_weight), got))
                cases.append((where, [w.detach() for w in want], grads, torch.autograd.grad(want[0], halves)))
        for (_, got), (where, want, _, _) in zip(seen, cases):
            if not close(got, want):
                said = [f"{name} expected {w.item():.5f}, got {g.item():.5f}"
                        for name, g, w in zip(["loss", "noisy", "clean"], got, want) if not close([g], [w])]
                raise wrong(known_mistake(loss_mistakes, seen, close), f"on {where}: {'; '.join(said)}")
        for where, _, got, want in cases:  # the values are right: now what training would do with them
            for half, g, w in zip(["noisy", "clean"], got, want):
                g = torch.zeros_like(w) if g is None else g
                if not torch.allclose(g, w, rtol=1e-4, atol=1e-7):
                    if not g.any():
                        raise Verdict(f"wrong: the {half} term carries no gradient, so training would not move it "
                                      f"(is it computed from {half}_logits.detach(), or from .item() numbers?)")
                    r, q = (g - w).abs().amax(-1).gt(1e-7).nonzero()[0].tolist()
                    raise Verdict(f"wrong: the values are right, but not the gradient of loss with respect to "
                                  f"{half}_logits: on {where}, it first differs at row {r}, position {q} (max abs "
                                  f"diff {(g - w).abs().max():.3g})")
    return verdict("check_mars_loss", run)


# ---------------------------------------------------------------------------
# 03: the acceptance rule, and one window of the loop

ACCEPT_CASES = [  # (confidences, tau): the edge cases, then random ones
    ([[0.95, 0.97, 0.91, 0.62]], 0.9),  # it stops at the first confidence below tau
    ([[0.2, 0.9, 0.9, 0.5]], 0.9),  # equal to tau in float32, not in float64
    ([[0.9, 0.75, 0.75, 0.2]], 0.75),  # equal to tau, in either precision
    ([[0.4, 1.0, 1.0, 1.0]], 1.0),  # tau = 1.0 commits one token, even after confidences of exactly 1.0
    ([[0.1, 0.2, 0.95, 0.99]], 0.9),  # the first prediction is committed even below tau
    ([[0.99, 0.95, 0.97, 1.0]], 0.9),  # every prediction passes
    ([[0.95, 0.3, 0.99, 0.99]], 0.9),  # nothing after a miss is committed
    ([[0.7], [0.1], [1.0]], 0.5),  # B = 1
]


def up_to_first_miss(ok):
    """How many predictions each row commits where ok (b, B) says which pass: the first always, then up to the
    first that does not."""
    ok = ok.clone()
    ok[:, 0] = True
    return ok.long().cumprod(dim=1).sum(dim=1)


def accept_mistakes(conf, tau):
    """What the known wrong versions of accept commit: {mistake: (b,)}."""
    passes = (conf >= tau) & (tau < 1)
    with_first = passes.clone()
    with_first[:, 0] = True
    return {
        "`>` where the rule is `>=`: a confidence equal to tau is committed too": up_to_first_miss(conf > tau),
        "it goes on after the first confidence below tau: it stops there, and commits nothing after it":
            with_first.long().sum(dim=1),
        "a confidence equal to tau is not committed, as it is compared in float64: conf is float32 and tau a "
        "Python float (float64), and 0.9 in float32 is 0.8999999762. Compare in conf's dtype, on the tensor "
        "(conf >= tau, as mars.accept does), not on .item() or .tolist() numbers":
            up_to_first_miss((conf.double() >= tau) & (tau < 1)),
        "at tau = 1.0 it commits more than one: a float32 probability can round to 1.0, and tau >= 1 commits "
        "exactly one": up_to_first_miss(conf >= tau),
        "the first prediction (the AR token) is not always committed: it is, whatever its confidence":
            passes.long().cumprod(dim=1).sum(dim=1),
    }


def check_accept(fn):
    """fn(conf, tau) -> (b,) how many predictions each row commits, against mars.accept."""
    g = torch.Generator().manual_seed(0)
    cases = ACCEPT_CASES + [(torch.rand(shape, generator=g).tolist(), tau)
                            for shape, tau in [((6, 4), 0.5), ((5, 8), 0.3), ((4, 4), 0.05), ((3, 4), 1.0)]]

    def run():
        seen = []
        for rows, tau in cases:
            conf = torch.tensor(rows)
            where = f"{len(rows)} rows of {len(rows[0])} confidences, tau = {tau}"
            seen.append(((conf, tau), as_tensor(call(fn, where, conf.clone(), tau), (len(rows),), where)))
        same = lambda got, want: torch.equal(got.double(), want.double())
        for (conf, tau), got in seen:
            want = mars.accept(conf, tau)
            bad = (got.double() != want.double()).nonzero().flatten().tolist()
            if bad:
                r = bad[0]
                shown = ", ".join(f"{c:.2f}" for c in conf[r].tolist())
                raise wrong(known_mistake(accept_mistakes, seen, same),
                            f"confidences [{shown}] at tau = {tau}: expected {int(want[r])}, got {got[r].item()}")
    return verdict("check_accept", run)


def top_choice(model, token):
    """A copy of model whose top choice is always `token`: its logit raised by 100."""
    def raise_logit(module, args, logits):
        bump = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bump[token] = 100
        return logits + bump
    raised = copy.deepcopy(model)
    raised.register_forward_hook(raise_logit)
    return raised


def window_mistake(got, tok, B):
    """The known mistake that a window's wrong ids show, or None."""
    if tok.mask in got:
        return "it committed <|mask|>, a placeholder that is never an output: mars.banned rules it out"
    if tok.eot in got[:-1]:
        return "it commits past <|endoftext|>: the answer ends at the first one (mars.through_eot)"
    if len(got) > B:
        return f"it commits {len(got)} tokens, more than a window's B = {B} predictions"


def check_window(fn, model, tok, B, prompts, taus=(1.0, 0.9, 0.6, 0.3)):
    """fn(model, prompt, tau) -> the ids the first forward of the paper's loop commits for the prompt, against
    the first forward of sample.generate, for every prompt and tau; then on the first prompts with the model's
    top choice made <|endoftext|> (every answer shorter than B) and then <|mask|>."""
    def run():
        models = [(model, prompts, ""),  # then with every answer shorter than B, and with <|mask|> to ban
                  (top_choice(model, tok.eot), prompts[:3], ", the model's top choice made <|endoftext|>"),
                  (top_choice(model, tok.mask), prompts[:3], ", the model's top choice made <|mask|>")]
        for net, some, which in models:
            for tau in taus:
                for i, prompt in enumerate(some):
                    where = f"prompt {i} ({len(prompt)} ids), tau = {tau}{which}"
                    got = torch.as_tensor(call(fn, where, net, list(prompt), tau)).flatten().tolist()
                    _, chunks = sample.generate(net, [prompt], tok.eot, tok.mask, B, tau=tau, max_new_tokens=B,
                                                n_vocab=tok.n_vocab)[0]
                    want = chunks[0]
                    if got != want:
                        k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                        raise wrong(window_mistake(got, tok, B),
                                    f"on {where}: expected {tok.decode(want)!r} (ids {want}), got ids {got}; "
                                    f"they first differ at index {k}")
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


def lookup(prediction, key):
    """prediction[key], where the key may also be written as text: "4" for 4."""
    if key in prediction:
        return prediction[key]
    return {str(k).strip(): v for k, v in prediction.items()}.get(str(key))


def compare(prediction, run, tol=0.0):
    """Print your prediction beside what the run gives; return "match", "no match" or "no prediction yet"
    (prediction None). A dict is compared key by key (a key may be written as text: "4" for 4), then summed
    up on one line: "match" when every key matches, "no prediction yet" while a key is None and none differs.
    Never raises."""
    if not isinstance(run, dict):
        return compare_one(prediction, run, tol)
    if prediction is not None and not isinstance(prediction, dict):
        print(f"your prediction: {shown(prediction)}; the run: {run}; no match (a dict with these keys is due)")
        return "no match"
    said = [compare_one(lookup(prediction or {}, k), v, tol, f"{k}: ") for k, v in run.items()]
    result = "no match" if "no match" in said else "no prediction yet" if "no prediction yet" in said else "match"
    print(f"overall: {result}")
    return result
