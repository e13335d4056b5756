"""notebooks/checks.py: every check says "right" to the reference, "not done yet" to the unfilled
stub, and "wrong: ..." to known-wrong versions of the method, naming the mistake where it is a known one
and saying where the output first differs otherwise; none raises, whatever the function does."""
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import mars
from conftest import EOT, MASK, ROOT, V, random_model, random_prompts

sys.path.insert(0, str(ROOT / "notebooks"))
import checks  # noqa: E402

B = 4


def stub(*args):
    raise NotImplementedError  # your code here


def returns_none(*args):
    pass


def crashes(*args):
    raise ZeroDivisionError("a student's bug")


def assert_verdicts(check, right, wrongs, *context):
    """wrongs: {the mistake: (a version with it, what its verdict says)}; a known mistake's verdict names it and
    then says where the output first differs."""
    assert check(right, *context) == "right"
    for not_done in (stub, returns_none, lambda *a: ...):
        assert check(not_done, *context) == "not done yet"
    assert check(crashes, *context).startswith("wrong: raised ZeroDivisionError: a student's bug")
    for name, (wrong, says) in wrongs.items():
        said = check(wrong, *context)
        assert said.startswith("wrong: ") and says in said, f"{name}: {said}"


# ---------------------------------------------------------------------------
# 01: the mask rule and the noisy copy

def mask_from(T, B, noisy_noisy, noisy_clean, clean_noisy=None):
    pos = torch.arange(T)
    blk = pos // B
    causal = pos[None, :] <= pos[:, None]
    top = torch.cat([noisy_noisy(pos, blk, causal), noisy_clean(blk)], dim=1)
    bottom = torch.cat([torch.zeros_like(causal) if clean_noisy is None else clean_noisy, causal], dim=1)
    return torch.cat([top, bottom], dim=0)


within_block = lambda pos, blk, causal: causal & (blk[None, :] == blk[:, None])
earlier_blocks = lambda blk: blk[None, :] < blk[:, None]


def blocks_over_2T(T, B):
    """Blocks counted over the 2T indices of [noisy | clean], not over each stream's positions."""
    idx = torch.arange(2 * T)
    i, j, noisy = idx[:, None], idx[None, :], idx < T
    same_block = i // B == j // B
    return ((noisy[:, None] & noisy[None, :] & same_block & (j <= i))
            | (noisy[:, None] & ~noisy[None, :] & (j // B < i // B))
            | (~noisy[:, None] & ~noisy[None, :] & (j <= i)))


def test_check_mask_rule():
    wrongs = {
        "bidirectional within the block": (lambda T, B: mask_from(
            T, B, lambda pos, blk, causal: blk[None, :] == blk[:, None], earlier_blocks), "sees the whole block"),
        "noisy -> clean including its own block": (lambda T, B: mask_from(
            T, B, within_block, lambda blk: blk[None, :] <= blk[:, None]), "includes the query's own block"),
        "clean -> noisy allowed": (lambda T, B: mask_from(
            T, B, within_block, earlier_blocks, torch.arange(T)[None, :] <= torch.arange(T)[:, None]),
            "clean -> noisy is allowed"),
        "noisy -> noisy causal across blocks": (lambda T, B: mask_from(
            T, B, lambda pos, blk, causal: causal, earlier_blocks), "noisy -> noisy crosses blocks"),
        "blocks counted over 2T": (blocks_over_2T, "counted over the 2T indices"),
        "an int mask": (lambda T, B: mars.mars_attention_mask(T, B).long(), "expected torch.bool"),
        "(T, T) only": (lambda T, B: mars.mars_attention_mask(T, B)[:T, :T], "shape"),
        "clean -> clean sees later positions (no known mistake)": (
            lambda T, B: torch.cat([mars.mars_attention_mask(T, B)[:T], torch.ones(T, 2 * T, dtype=torch.bool)]),
            "wrong: on seq_len = 12, B = 4, query c0 -> key n0 (clean -> noisy): expected False, got True"),
    }
    assert_verdicts(checks.check_mask_rule, mars.mars_attention_mask, wrongs)
    said = checks.check_mask_rule(wrongs["noisy -> clean including its own block"][0])
    assert "First difference: on seq_len = 12, B = 4, query n0 -> key c0 (noisy -> clean): expected False, " \
           "got True" in said


def is_response(y):
    r = torch.zeros_like(y, dtype=torch.bool)
    r[:, 1:] = y[:, :-1] != -1
    return r


def in_place(x, y, mask_id):
    x[is_response(y)] = mask_id
    return x


def test_check_noisy_copy():
    wrongs = {
        "masks where y has a target (the <|assistant|> position too)": (
            lambda x, y, m: torch.where(y != -1, torch.full_like(x, m), x), "(a prompt position, holding id"),
        "leaves the end-of-text padding unmasked": (
            lambda x, y, m: torch.where(is_response(y) & (x != checks.EOT), torch.full_like(x, m), x),
            "(a response position, holding <|endoftext|>): expected <|mask|>, got <|endoftext|>"),
        "masks to the end of the row (the right padding too)": (
            lambda x, y, m: torch.where(is_response(y).cummax(1).values, torch.full_like(x, m), x),
            "(right padding after the answer, holding <|endoftext|>): expected <|endoftext|>, got <|mask|>"),
        "changes x in place": (in_place, "in place"),
    }
    assert_verdicts(checks.check_noisy_copy, mars.noisy_copy, wrongs)


# ---------------------------------------------------------------------------
# 02: the two-part loss

def token_losses(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1, reduction="none")


def two_part_loss(noisy_logits, clean_logits, targets, ar_weight):
    n = (targets != -1).sum(1).clamp_min(1)
    noisy, clean = token_losses(noisy_logits, targets).sum(1) / n, token_losses(clean_logits, targets).sum(1) / n
    return (noisy + ar_weight * clean).mean(), noisy.mean(), clean.mean()


def token_mean(noisy_logits, clean_logits, targets, ar_weight):
    where = targets != -1
    noisy = token_losses(noisy_logits, targets)[where].mean()
    clean = token_losses(clean_logits, targets)[where].mean()
    return noisy + ar_weight * clean, noisy, clean


def weight_on_noisy(noisy_logits, clean_logits, targets, ar_weight):
    _, noisy, clean = two_part_loss(noisy_logits, clean_logits, targets, ar_weight)
    return ar_weight * noisy + clean, noisy, clean


def over_all_positions(noisy_logits, clean_logits, targets, ar_weight):
    T = targets.shape[1]
    noisy, clean = token_losses(noisy_logits, targets).sum(1) / T, token_losses(clean_logits, targets).sum(1) / T
    return (noisy + ar_weight * clean).mean(), noisy.mean(), clean.mean()


def as_floats(noisy_logits, clean_logits, targets, ar_weight):
    loss, noisy, clean = two_part_loss(noisy_logits, clean_logits, targets, ar_weight)
    return loss.item(), noisy.item(), clean.item()


def detached_clean(noisy_logits, clean_logits, targets, ar_weight):
    return two_part_loss(noisy_logits, clean_logits.detach(), targets, ar_weight)


def sums_over_sequences(noisy_logits, clean_logits, targets, ar_weight):
    return tuple(part * targets.shape[0] for part in two_part_loss(noisy_logits, clean_logits, targets, ar_weight))


def test_check_mars_loss():
    wrongs = {
        "the token mean": (token_mean, "a token mean over the whole batch"),
        "ar_weight on the noisy term": (weight_on_noisy, "ar_weight (alpha) on the noisy term"),
        "divides by T": (over_all_positions, "divided by T"),
        "noisy and clean swapped": (lambda n, c, t, a: two_part_loss(c, n, t, a), "noisy and clean swapped"),
        "without ar_weight": (lambda n, c, t, a: two_part_loss(n, c, t, 1.0), "ar_weight left out"),
        "one number": (lambda n, c, t, a: two_part_loss(n, c, t, a)[0], "not (loss, noisy, clean)"),
        ".item() floats": (as_floats, "loss is a float, not a tensor: .item()"),
        "a new tensor from .item()": (lambda *a: tuple(torch.tensor(v) for v in as_floats(*a)),
                                      "loss carries no gradient"),
        "the clean term from clean_logits.detach()": (detached_clean, "the clean term carries no gradient"),
        "sums over the sequences (no known mistake)": (
            sums_over_sequences, "wrong: on a batch x of shape (3, 11), B = 4, ar_weight = 1.0: loss expected "),
    }
    assert_verdicts(checks.check_mars_loss, two_part_loss, wrongs)
    said = checks.check_mars_loss(token_mean)
    assert "First difference: on a batch x of shape (3, 11), B = 4, ar_weight = 1.0: loss expected" in said


def test_the_loss_cases_reproduce_mars_loss_on_the_model():
    """The check's premise: mars_loss on the stand-in for the full forward's logits is mars_loss on the model
    (which may leave idle noisy positions out), and the cases do leave some out."""
    skipped, net = 0, checks.loss_model()
    for x, y, B_, ar_weight, logits in checks.loss_cases():
        with torch.no_grad():
            reference = mars.mars_loss(net, x, y, checks.MASK, B_, ar_weight)
        from_logits = mars.mars_loss(checks.stand_in(logits), x, y, checks.MASK, B_, ar_weight)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(from_logits, reference))
        skipped += mars.idle_noisy_positions(y, B_)
    assert skipped > 0


# ---------------------------------------------------------------------------
# 03: accept and one window

def my_accept(conf, tau):
    ok = conf >= tau if tau < 1 else torch.zeros_like(conf, dtype=torch.bool)
    ok[:, 0] = True
    return ok.long().cumprod(dim=1).sum(dim=1)


def strict(conf, tau):
    ok = conf > tau
    ok[:, 0] = True
    return ok.long().cumprod(dim=1).sum(dim=1)


def no_stop(conf, tau):
    ok = (conf >= tau) & (tau < 1)
    ok[:, 0] = True
    return ok.long().sum(dim=1)


def no_tau_1_rule(conf, tau):
    ok = conf >= tau
    ok[:, 0] = True
    return ok.long().cumprod(dim=1).sum(dim=1)


def first_not_forced(conf, tau):
    return ((conf >= tau) & (tau < 1)).long().cumprod(dim=1).sum(dim=1)


def float64_loop(conf, tau):
    """A Python loop over conf.tolist(): float32 confidences compared with tau in float64."""
    counts = []
    for row in conf.tolist():
        n = 1
        while n < len(row) and tau < 1 and row[n] >= tau:
            n += 1
        counts.append(n)
    return torch.tensor(counts)


def test_check_accept():
    wrongs = {"> instead of >=": (strict, "`>` where the rule is `>=`"),
              "does not stop at the first miss": (no_stop, "it goes on after the first confidence below tau"),
              "float64 against float32": (float64_loop, "compared in float64: conf is float32"),
              "commits 2 at tau 1.0 after a confidence of 1.0": (no_tau_1_rule, "at tau = 1.0 it commits more"),
              "the first prediction not always committed": (first_not_forced, "the first prediction (the AR token)"),
              "one too many (no known mistake)": (lambda c, t: my_accept(c, t) + 1,
                                                  "wrong: confidences [0.95, 0.97, 0.91, 0.62] at tau = 0.9: "
                                                  "expected 3, got 4")}
    assert_verdicts(checks.check_accept, my_accept, wrongs)


def window_with(offset=0, masks=B - 1, rule=my_accept, ban=True, end=True):
    def one_window(model, prompt, tau):
        n_masks = masks if tau < 1 else 0
        ids = prompt + [MASK] * n_masks
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, len(prompt) - 1 + offset:]
        tokens, conf = mars.choose(mars.banned(logits, MASK, V) if ban else logits)
        n = int(rule(conf[None], tau)[0])
        return mars.through_eot(tokens[:n].tolist(), EOT) if end else tokens[:n].tolist()
    return one_window


def test_check_window():
    model = random_model(seed=3)
    tok = SimpleNamespace(eot=EOT, mask=MASK, n_vocab=V, decode=lambda ids: " ".join(map(str, ids)))
    prompts = random_prompts([3, 5, 8, 4, 6, 7, 9, 5])
    wrongs = {"without through_eot": (window_with(end=False), "past <|endoftext|>"),
              "without banned": (window_with(ban=False), "committed <|mask|>"),
              "feeds B masks, commits up to B + 1": (window_with(masks=B), "more than a window's B = 4"),
              "reads the predictions one position late": (window_with(offset=1), "raised IndexError"),
              "does not stop at the first miss": (window_with(rule=no_stop), "first differ"),
              "never commits more than one": (window_with(rule=lambda c, t: torch.ones(1, dtype=torch.long)),
                                              "first differ")}
    assert_verdicts(checks.check_window, window_with(), wrongs, model, tok, B, prompts)
    assert "the model's top choice made <|endoftext|>" in checks.check_window(window_with(end=False), model, tok, B,
                                                                               prompts)


# ---------------------------------------------------------------------------
# 04: the adaptive policy's rung

def next_rung(rung, load, gap=0.5):
    if rung < 3 and load > 1.0 + 0.5 * rung:
        return rung + 1
    if rung > 0 and load < 1.0 + 0.5 * (rung - 1) - gap:
        return rung - 1
    return rung


def test_check_next_rung():
    wrongs = {"no gap": (lambda r, load: next_rung(r, load, gap=0.0), "smoothed load 0.5: expected rung 1, got 0"),
              ">= at the threshold": (lambda r, load: next_rung(r, load + 1e-9) if load == 1.0 + 0.5 * r else
                                      next_rung(r, load), "smoothed load 1.0: expected rung 0, got 1"),
              "several rungs at once": (lambda r, load: min(3, sum(load > 1.0 + 0.5 * k for k in range(3))),
                                        "expected rung 1, got 2"),
              "never climbs back": (lambda r, load: max(r, next_rung(r, load)), "load 0.0: expected rung 0, got 1"),
              "past the last rung": (lambda r, load: r + 1 if load > 1.0 + 0.5 * r else next_rung(r, load),
                                     "expected rung 3, got 4")}
    assert_verdicts(checks.check_next_rung, next_rung, wrongs)


# ---------------------------------------------------------------------------
# Predictions

@pytest.mark.parametrize("prediction, run, tol, said", [
    (None, 3, 0, "no prediction yet"),
    (3, 3, 0, "match"),
    (2, 3, 0, "no match"),
    (0.91, 0.9100000262, 1e-6, "match"),
    (["c1", "n4", "c0"], {"n4", "c0", "c1"}, 0, "match"),
    (["n4"], {"n4", "c0"}, 0, "no match"),
    ({"4": 48, " 2": 60}, {4: 48, 2: 60}, 0, "match"),
    ({"0.9": 3, 1.0: 1}, {0.9: 3, 1.0: 1}, 0, "match"),
    ("Noisy ", "noisy", 0, "match"),
    ("yes", True, 0, "match"),
    (1, False, 0, "no match"),
    ("three", 3, 0, "no match"),
    ({"a": None, "b": None}, {"a": 1, "b": 2}, 0, "no prediction yet"),
    ({"a": 1, "b": None}, {"a": 1, "b": 2}, 0, "no prediction yet"),
    ({"a": 2, "b": None}, {"a": 1, "b": 2}, 0, "no match"),
    ({"a": 1, "b": 2}, {"a": 1, "b": 2}, 0, "match"),
    ([1, 2], {"a": 1}, 0, "no match"),
])
def test_compare(prediction, run, tol, said, capsys):
    assert checks.compare(prediction, run, tol) == said
    assert said in capsys.readouterr().out
