"""Decoding at fixed shapes (engine.CudaGraphs over extras/engine/static_cache.py), as a GPU replays it in CUDA graphs: it
commits token for token what the eager step commits, in the same forwards, in every decoding mode, with requests
joining and leaving. On a CPU the fixed shapes run eagerly (CUDA graphs exist on CUDA only), which checks all but
the capture: that is checked on CUDA, where there is a GPU."""
import gc
import shutil

import pytest
import torch

from extras.engine import engine
from conftest import EOT, MASK, random_model, random_prompts
from extras.engine.engine import Engine, Request, generate_batch
from extras.engine.static_cache import StaticKVCache
from model import GPT, GPTConfig

PROMPTS = [3, 7, 5, 9, 4, 6, 8]  # lengths: ragged rows, and more rows than a power of two
MODES = {
    "ar": dict(B=1),
    "mars": dict(B=4, tau=0.5),
    "tau 1.0": dict(B=4, tau=1.0),
    "a tau per request": dict(B=3, tau=[0.3, 0.9, 1.0, 0.5, 0.7, 0.2, 0.95]),
    "lossless": dict(B=4, lossless=True),
    "entropy, max_accept": dict(B=4, tau=0.6, metric="entropy", max_accept=2),
    "block": dict(B=4, tau=0.5, cache="block", B_cache=6),
    "block, tau 1.0": dict(B=4, tau=1.0, cache="block", B_cache=6),
}


def decoded(model, graphs, device="cpu", **mode):
    trace = []
    done = generate_batch(model, random_prompts(PROMPTS), EOT, MASK, max_new_tokens=20, trace=trace, graphs=graphs,
                          **mode)
    return [(r.tokens, r.chunks, r.forwards) for r in done], trace


def assert_same_trace(got, want):
    """Every forward fed, predicted and committed the same (confidences to float64's rounding)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if k != "conf"} == {k: v for k, v in w.items() if k != "conf"}
        assert g["conf"] == pytest.approx(w["conf"], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_fixed_shapes_commit_what_the_eager_step_commits(mode):
    model = random_model()
    (want, want_trace), (got, got_trace) = (decoded(model, g, **MODES[mode]) for g in ("off", "captured"))
    assert got == want
    assert_same_trace(got_trace, want_trace)
    most = max(len(c) for _, chunks, _ in want for c in chunks)  # tokens a forward committed, at most
    assert most == 1 if mode in ("ar", "tau 1.0", "block, tau 1.0") else most == 2 if "max_accept" in mode else most > 2


def served(model, graphs):
    """Requests joining (two, then four after three steps) and leaving, each with its own tau and budget."""
    prompts = random_prompts([5, 9, 3, 7, 4, 6])
    budgets, taus = [4, 14, 2, 9, 12, 5], [0.5, 0.9, 1.0, 0.3, 0.6, 0.5]
    eng = Engine(model, EOT, MASK, 4, max_batch=3, max_new_tokens=16, graphs=graphs)
    requests = [Request(p, tau=t, max_new_tokens=n) for p, t, n in zip(prompts, taus, budgets)]
    eng.waiting.extend(requests[:2])
    for _ in range(3):
        eng.step()
    eng.waiting.extend(requests[2:])
    while eng.backlog:
        eng.step()
    return [(r.tokens, r.chunks, r.forwards) for r in requests], eng


def test_requests_joining_and_leaving_keep_their_rows():
    """Continuous batching on the static cache: rows join (add_rows) and leave (keep_rows moves the rest up, in
    place); each request commits what it does on the eager engine."""
    model = random_model()
    (want, _), (got, eng) = served(model, "off"), served(model, "captured")
    assert got == want and eng.kv is eng.graphs.cache and isinstance(eng.kv, StaticKVCache)


def sampled(model, prompts, graphs, max_new_tokens=12):
    """Tokens drawn at temperature 1 from the same seed: a sampled step runs eagerly, on the graphs' cache too."""
    torch.manual_seed(3)
    return [r.tokens for r in generate_batch(model, prompts, EOT, MASK, B=4, tau=0.5, temperature=1.0,
                                             max_new_tokens=max_new_tokens, graphs=graphs)]


def test_a_sampled_step_on_the_static_cache_attends_every_key_it_feeds():
    """After a greedy run left the keys attended at 128, a sampled step at later positions sets its own: its queries
    see their own keys, and it draws what the eager engine draws."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=48, max_seq_len=320, n_layer=2, n_head=2, n_embd=32)).double().eval()
    generate_batch(model, random_prompts([4, 5]), EOT, MASK, B=4, tau=0.5, max_new_tokens=4, graphs="captured")
    graphs = engine._shared[model]
    assert graphs.cache.keys == 128
    prompts = random_prompts([150, 170], seed=2)
    assert sampled(model, prompts, "captured") == sampled(model, prompts, "off")
    assert engine._shared[model] is graphs and graphs.cache.keys == 256  # the same cache, its keys set by the step


def test_the_fixed_shapes_compute_the_logits_they_read():
    """A window pads to the next of GRAPH_WIDTHS, its reads separately: MARS at B = 4 feeds up to 7 positions (its
    accepted tokens, then 3 masks) and reads 4, so the logits of 4 columns, not 8, are computed."""
    model = random_model()
    decoded(model, "captured", **MODES["mars"])
    shapes = list(engine._shared[model].captured)
    assert {n_read for *_, n_read in shapes} <= {1, 2, 4}
    assert any(width - 3 == 8 and n_read == 4 for _, width, _, n_read in shapes)


def test_compiled_steps_that_reach_dynamos_recompile_limit_say_so_and_run_uncompiled(monkeypatch, capsys):
    """Dynamo would run them eagerly in silence; here they run uncompiled, said once, and commit the same."""
    def at_the_limit(fn, dynamic):
        def run(*args):
            raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fail_on_recompile_limit_hit")
        return run
    monkeypatch.setattr(engine.torch, "compile", at_the_limit)
    model = random_model()
    (want, _), (got, _) = (decoded(model, g, **MODES["mars"]) for g in ("off", "compiled"))
    assert got == want and "recompile limit" in engine._shared[model].fell_back
    assert capsys.readouterr().out.count("graphs='compiled' fell back") == 1


def test_keep_rows_moves_the_kept_rows_up_in_place():
    cache = StaticKVCache(random_model().config, 4, 8, torch.float64, "cpu")
    cache.add_rows(3)
    for row in range(3):
        cache.k[:, row], cache.v[:, row] = row, -row
    k = cache.k
    cache.rollback([5, 6, 7])
    cache.keep_rows([2, 0])
    assert cache.k is k and cache.lengths == [7, 5]  # the same tensor: a captured graph holds it
    assert (cache.k[:, 0] == 2).all() and (cache.k[:, 1] == 0).all() and (cache.v[:, 0] == -2).all()
    with pytest.raises(ValueError, match="static KV cache full"):
        cache.add_rows(3)


def test_engines_one_after_another_share_the_models_graphs(monkeypatch):
    """generate_batch makes an engine per call: they borrow the model's CudaGraphs one after another (each would
    otherwise capture its shapes again), a live engine keeps it, and weights that moved need new graphs."""
    made, base = [], engine.CudaGraphs
    monkeypatch.setattr(engine, "CudaGraphs", type("Counted", (base,), {
        "__init__": lambda self, *a: made.append(self) or base.__init__(self, *a)}))
    model, prompts = random_model(), random_prompts([4, 6])
    run = lambda: generate_batch(model, prompts, EOT, MASK, B=4, tau=0.5, max_new_tokens=8, graphs="captured")  # noqa
    run()
    run()
    assert len(made) == 1 and engine._shared[model] is made[0] and made[0].captured
    held = Engine(model, EOT, MASK, 4, 2, graphs="captured")  # holds it while it lives
    run()
    assert held.graphs is made[0] and len(made) == 2 and engine._shared[model] is made[0]
    del held
    gc.collect()
    run()
    assert len(made) == 2
    model.float()  # new weights
    run()
    assert len(made) == 3 and engine._shared[model] is made[2]


def test_the_cpu_decodes_eagerly_by_default():
    assert Engine(random_model(), EOT, MASK, 4, 2).graphs is None


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile's CPU backend needs a C++ compiler")
def test_the_compiled_step_commits_what_the_eager_step_commits():
    """graphs="compiled": torch.compile's fused kernels (here inductor's CPU backend) for the fixed shapes (two
    prompts, few shapes: each new one compiles)."""
    model, prompts = random_model(), random_prompts([5, 8])
    out = [[(r.tokens, r.forwards) for r in generate_batch(model, prompts, EOT, MASK, B=4, tau=0.5, max_new_tokens=8,
                                                           graphs=graphs)] for graphs in ("off", "compiled")]
    assert out[0] == out[1] and max(len(tokens) for tokens, _ in out[0]) == 8


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


@CUDA
@pytest.mark.parametrize("graphs", ["captured", "compiled"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graphs_replay_what_the_eager_step_commits(graphs, mode):
    """On CUDA the default: the step's shapes captured once, then replayed, in every decoding mode."""
    model = random_model().cuda()
    (want, want_trace), (got, got_trace) = (decoded(model, g, **MODES[mode]) for g in ("off", graphs))
    assert got == want
    assert_same_trace(got_trace, want_trace)
    shared = engine._shared[model]
    assert shared.captured and all(graph is not None for _, graph, _ in shared.captured.values())
    assert shared.fell_back is None and Engine(model, EOT, MASK, 4, 2).graphs is not None


@CUDA
def test_cuda_graphs_with_requests_joining_and_leaving():
    model = random_model().cuda()
    (want, _), (got, eng) = served(model, "off"), served(model, "captured")
    assert got == want and all(graph is not None for _, graph, _ in eng.graphs.captured.values())


@CUDA
def test_cuda_sampling_on_the_graphs_cache_draws_what_the_eager_engine_draws():
    model = random_model().cuda()
    decoded(model, "captured", **MODES["ar"])  # a greedy run first: the sampled one borrows its cache
    prompts = random_prompts(PROMPTS)
    assert sampled(model, prompts, "captured") == sampled(model, prompts, "off")
