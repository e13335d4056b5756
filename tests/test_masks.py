"""masks="auto" (cost.py): the choice of how many masks a forward feeds, the step-cost model it reads, and the
engine under it: masks made free is the fixed mode, masks made prohibitive is AR, lossless stays AR; on random
float64 models (conftest) with injected cost models, and once with a profiled one."""
import json
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from extras.engine import cost
from extras.engine import engine
from conftest import EOT, MASK, assert_one_line_error, random_model, random_prompts, run_cli
from extras.bench import masks_bench

PROMPTS = random_prompts((3, 7, 12, 5, 1))
N = 40  # max_new_tokens
FREE = lambda batch, width: 1.0  # noqa: E731  masks cost nothing
PROHIBITIVE = lambda batch, width: 1e4 ** width  # noqa: E731  each position costs 10,000 times all before it
CACHES = [dict(cache="sliding"), dict(cache="none"), dict(cache="block", B_cache=5), dict(lossless=True)]


@pytest.fixture(scope="module", params=[2, 8], ids=lambda s: f"model{s}")
def m(request):
    return random_model(seed=request.param)


def gen(m, prompts=PROMPTS, **kw):
    return engine.generate_batch(m, prompts, EOT, MASK, **{"max_new_tokens": N, **kw})


def toks(gens):
    return [g.tokens for g in gens]


def masks_fed(trace):
    return [e["fed"].count(MASK) for e in trace]


# ---------------------------------------------------------------------------
# The choice

def one(p, step_cost, fed=None):
    """best_masks for a batch of one request that may feed len(p) masks."""
    return cost.best_masks([p], step_cost, None if fed is None else [fed])[0]


@pytest.mark.parametrize("fed", [None, 3])
def test_best_masks_at_the_extremes(fed):
    # E(k) = 1, 1.5, 1.75 at a cost of the width: sliding 1/1 > 1.5/2.5; on 3 carried anyway 1/3 < 1.5/4 > 1.75/5
    assert one([0.5, 0.5], lambda b, w: w, fed) == {None: 0, 3: 1}[fed]
    for p in ([0.9, 0.5, 0.1], [1e-3] * 3, [1.0] * 7):
        assert one(p, FREE, fed) == len(p)  # free: every mask that can commit
        assert one(p, PROHIBITIVE, fed) == 0  # plain AR
    slope = lambda batch, width: 1 + 0.01 * width  # noqa: E731
    assert one([0.0] * 3, slope, fed) == 0  # masks never accepted pay nothing back
    assert one([0.0] * 3, FREE, fed) == 0  # on a tie, the fewest
    assert one([], slope, fed) == 0


def test_best_masks_is_monotone():
    """Fewer masks as a position costs more (any cache); more as acceptance grows, for a window whose
    other positions are fixed (the block cache's); fewer as the batch makes every position dearer."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = list(np.sort(rng.uniform(0, 1, 3))[::-1])
        for fed in (None, 1, 6):
            ks = [one(p, lambda b, w: 1 + s * w, fed) for s in (0.0, 0.05, 0.2, 0.5, 2.0)]
            assert ks == sorted(ks, reverse=True) and ks[0] == 3
        line = lambda b, w: 1 + 0.3 * w  # noqa: E731
        ks = [one(list(np.minimum(np.array(p) * f, 1)), line, fed=4) for f in (0.25, 0.5, 1.0, 1.5, 3.0)]
        assert ks == sorted(ks)
    per_batch = lambda b, w: 1 + 0.02 * b * w  # noqa: E731
    ks = [cost.best_masks([[0.8, 0.6, 0.4]] * b, per_batch) for b in (1, 4, 16, 64)]
    assert [k[0] for k in ks] == sorted([k[0] for k in ks], reverse=True) and ks[0] == [3] and ks[-1] == [0] * 64


def test_one_number_of_masks_for_the_batch():
    """A forward costs its widest row: every row takes the masks that do not widen it, up to its own most; a
    row whose masks would widen a whole batch that gains little from them goes without."""
    assert cost.best_masks([[0.9] * 3, [0.9], []], FREE) == [3, 1, 0]
    line = lambda b, w: 1 + w  # noqa: E731
    assert one([0.01] * 3, line, fed=1) == 0
    assert cost.best_masks([[0.9] * 3, [0.01] * 3], line, fed=[8, 1]) == [3, 3]  # free beside a wider row
    dear = lambda b, w: 1 + 0.1 * b * w  # noqa: E731
    assert one([1.0] * 3, dear) == 3
    assert cost.best_masks([[1.0] * 3] + [[0.01] * 3] * 31, dear) == [0] * 32


def test_the_sliding_cache_pays_for_what_it_commits():
    """In the sliding cache a committed token is fed by the next forward: with positions that cost as much as a
    forward's fixed part, three masks at 80% acceptance lose to AR, though they would win on a window that
    carries its tokens anyway."""
    line = lambda b, w: 1.0 + w  # noqa: E731
    assert one([0.8] * 3, line) == 0
    assert one([0.8] * 3, line, fed=8) == 3


def test_acceptance_is_learnt_per_request_from_an_engine_wide_prior():
    eng = SimpleNamespace(B=4, kv=object(), max_accept=None)
    auto = cost.AutoMasks(eng, step_cost=lambda b, w: 1 + 0.2 * w)
    good, bad, new = (engine.Request([], n_masks=3, left=50) for _ in range(3))
    assert auto.rates(new, 3) == [1.0] * 3  # before any evidence: optimistic, so masks get tried
    for _ in range(20):
        auto.observe([good, bad], [3, 0])  # good: all three accepted; bad: none
    assert auto.total == [[40, 20, 20], [20, 20, 20]] and good.acceptance == [[20] * 3] * 2
    good_p, bad_p, new_p = (auto.rates(r, 3) for r in (good, bad, new))
    assert good_p == pytest.approx([(20 + 2 * 21 / 41) / 22, 1, 1])
    assert bad_p[0] < 0.1 < 0.5 < new_p[0] < good_p[0]
    chosen = []
    for batch in ([good], [bad], [new], [good, bad]):
        for r in batch:
            r.n_masks = 3
        auto.size(batch)
        chosen.append([r.n_masks for r in batch])
    assert chosen[:2] == [[3], [0]] and chosen[2][0] > 0 and chosen[3] == [3, 3]  # beside good, bad's are free
    # never more than the fixed mode feeds, the request's budget or max_accept allows
    good.n_masks, good.left = 3, 2
    auto.size([good])
    assert good.n_masks == 1
    auto.max_accept, good.n_masks, good.left = 2, 3, 50
    auto.size([good])
    assert good.n_masks == 1


# ---------------------------------------------------------------------------
# The step-cost model

def test_step_cost_is_monotone_and_extends_beyond_its_grid():
    c = cost.StepCost([1, 4], [1, 8], [[2.0, 1.0], [3.0, 5.0]])  # noise: width 8 "cheaper" at batch 1
    assert c(1, 1) == 2.0 and c(1, 8) == 2.0 and c(4, 8) == 5.0
    assert c(2.5, 4.5) == pytest.approx(0.5 * (2.0 + 4.0))
    assert c(4, 15) == pytest.approx(5.0 + 7 * 2 / 7)  # the last segment's slope, on
    assert c(1, 100) == 2.0


def test_measured_profiles_once_per_model_and_grows_when_asked_for_more():
    model = random_model(seed=5)
    first = cost.measured(engine.decode_step, model, MASK, 4, B=4)
    assert first.batches == [1, 2, 4] and first.widths == list(range(1, 9))
    assert np.all(np.isfinite(first.seconds)) and np.all(first.seconds > 0)
    assert cost.measured(engine.decode_step, model, MASK, 3, B=3) is first  # covered: no new profile
    bigger = cost.measured(engine.decode_step, model, MASK, 2, B=5)  # a larger B: wider windows
    assert bigger is not first and bigger.batches == [1, 2, 4] and bigger.widths == list(range(1, 11))
    assert cost.measured(engine.decode_step, model, MASK, 4, B=4) is bigger


# ---------------------------------------------------------------------------
# The engine under masks="auto"

@pytest.mark.parametrize("kw", CACHES, ids=lambda kw: "lossless" if "lossless" in kw else kw["cache"])
def test_free_masks_are_the_fixed_mode(m, kw):
    """B - 1 masks at every forward; under the block cache auto slides, so its fixed mode is the sliding cache's."""
    fixed_kw = dict(kw, cache="sliding") if kw.get("cache") == "block" else kw
    for B, tau in ((4, 0.5), (8, 0.7), (4, 1.0)):
        fixed, auto = gen(m, B=B, tau=tau, **fixed_kw), gen(m, B=B, tau=tau, masks="auto", step_cost=FREE, **kw)
        assert toks(auto) == toks(fixed) and [g.forwards for g in auto] == [g.forwards for g in fixed]
    with_cap = dict(B=4, tau=0.5, max_accept=2)
    assert toks(gen(m, masks="auto", step_cost=FREE, **with_cap, **kw)) == toks(gen(m, **with_cap, **fixed_kw))


@pytest.mark.parametrize("kw", CACHES[:3], ids=lambda kw: kw["cache"])
def test_prohibitive_masks_are_ar(m, kw):
    ar, trace = toks(gen(m, B=1)), []
    assert toks(gen(m, B=4, tau=0.5, masks="auto", step_cost=PROHIBITIVE, trace=trace, **kw)) == ar
    assert not any(masks_fed(trace))
    assert toks(gen(m, B=4, tau=0.5, **kw)) != ar  # so this is not trivial


def test_the_block_cache_under_auto_slides(m):
    """Under auto every forward writes what it fed but its masks (the model is causal: a committed token's K/V
    are final at once), so requests join and leave at any forward, as in the sliding cache, token for token and
    forward for forward; the fixed mode keeps the paper's spans (a forward that caches nothing new)."""
    line = lambda b, w: 1 + 0.3 * b * w  # noqa: E731
    for step_cost in (line, FREE):
        runs = {}
        for cache in ("sliding", "block"):
            trace = []
            gens = gen(m, B=4, tau=0.5, cache=cache, B_cache=8, masks="auto", step_cost=step_cost, trace=trace)
            runs[cache] = toks(gens), trace
        assert runs["block"] == runs["sliding"]  # the same tokens, the same forwards
        assert all(e["cache_after"] > e["cache_before"] for e in runs["block"][1])
    trace = []
    gen(m, B=4, tau=0.5, cache="block", B_cache=8, trace=trace)
    assert any(e["cache_after"] == e["cache_before"] for e in trace)  # the fixed mode's inner forwards


def test_lossless_under_auto_is_ar(m):
    ar = toks(gen(m, B=1))
    for step_cost in (lambda b, w: 1 + 0.1 * b * w, None):  # None: profiled here
        assert toks(gen(m, B=4, lossless=True, masks="auto", step_cost=step_cost)) == ar
    trace = []
    assert toks(gen(m, B=4, lossless=True, masks="auto", step_cost=lambda b, w: 1 + 0.5 * w, trace=trace)) == ar
    assert len(set(masks_fed(trace))) > 1  # the masks did vary: the drafts came from fewer than B - 1 of them


def test_auto_runs_every_way_and_stays_in_bounds(m):
    """Per-request tau (1.0 feeds no masks), sampling, and the profiled cost model; at most the fixed mode's masks."""
    trace = []
    gens = gen(m, B=4, tau=[0.5, 1.0, 0.9, 0.5, 0.7], masks="auto", trace=trace)
    assert all(0 < len(g.tokens) <= N for g in gens) and max(masks_fed(trace)) <= 3
    assert not any(n for e, n in zip(trace, masks_fed(trace)) if e["row"] == 1)
    assert gens[1].tokens == gen(m, [PROMPTS[1]], B=1)[0].tokens
    sampled = []
    for _ in range(2):  # seeded sampling is reproducible, and does sample
        torch.manual_seed(0)
        sampled.append(toks(gen(m, B=4, tau=0.5, temperature=1.0, masks="auto", step_cost=lambda b, w: 1 + 0.2 * w)))
    assert sampled[0] == sampled[1] != toks(gen(m, B=4, tau=0.5, masks="auto", step_cost=lambda b, w: 1 + 0.2 * w))
    with pytest.raises(ValueError, match="masks"):
        gen(m, B=4, masks="some")


# ---------------------------------------------------------------------------
# The measurement

@pytest.mark.slow
def test_masks_bench_end_to_end(tiny_run, tmp_path):
    out = tmp_path / "masks.json"
    args = ["--ckpt", tiny_run / "mars.pt", "--out", out, "--batch_sizes", "1", "3", "--taus", "0.5",
            "--timing_prompts", "6", "--rounds", "2", "--accuracy_prompts", "9", "--B_cache", "4"]
    proc = run_cli(["extras/bench/masks_bench.py", *args], timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m extras.bench.masks_bench --ckpt ") and "round 2/2" in proc.stderr
    assert (result["timing_prompts"], result["rounds"], result["accuracy_prompts"]) == (6, 2, 9)
    assert "| batch | cache |" in proc.stdout and result["step_cost"]["batches"] == [1, 2, 3]
    rows = {(r["batch_size"], r["cache"], r["decoder"]): r for r in result["rows"]}
    assert set(rows) == {(b, c, d) for b in (1, 3) for c, d in ((None, "ar"), *((c, d) for c in ("sliding", "block")
                                                                             for d in ("fixed", "auto")))}
    for (b, cache, decoder), r in rows.items():
        assert len(r["speedup_rounds"]) == 2 and r["speedup"] == statistics.median(r["speedup_rounds"])
        assert r["accuracy_n"] == 9 and 0 <= r["accuracy"] <= 1 and r["tokens_per_forward"] > 0
        if decoder == "ar":
            assert r["speedup"] == 1.0 and r["accuracy_masks_per_forward"] == 0
        if decoder == "fixed" and cache == "sliding":
            assert r["accuracy_masks_per_forward"] == 3  # B - 1, every forward
    assert {c["batch_size"] for c in result["goals"]["rows"]} == {1, 3}
    assert set(result["goals"]) == {"rows", "within_3_percent_of_best", "beats_ar_where_fixed_does_not",
                                    "accuracy_within_half_a_point"}
    assert_one_line_error(run_cli(["extras/bench/masks_bench.py", "--ckpt", tiny_run / "mars.pt", "--rounds", "0"]))


def test_masks_bench_times_prompts_without_answers(tiny_run, tmp_path):
    """extras.real.distill's held-out file holds prompts and checkers, no answers: enough for the timing alone,
    and a clear error where the accuracy passes need answers."""
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"task": "check", "prompt": p, "kind": "under_20", "rule": {}}) + "\n"
                               for p in ("add 2 and 3", "spell cat", "reverse abc")))
    args = ["--ckpt", str(tiny_run / "mars.pt"), "--data", str(prompts)]
    examples = masks_bench.setup(masks_bench.get_args(args + ["--accuracy_prompts", "0"]))[3]
    assert [e["prompt"] for e in examples] == ["add 2 and 3", "spell cat", "reverse abc"]
    with pytest.raises(ValueError, match="heldout.jsonl:1: malformed record .*answer"):
        masks_bench.setup(masks_bench.get_args(args))
