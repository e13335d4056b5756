"""extras.serving.scheduler's ServingEngine and the command extras.serving.serve: the engine decodes each request
as it decodes it alone, tau = 1.0 rows carry no masks, cancelled requests leave, the adaptive policy's
hysteresis, and the command end to end."""
import json

import pytest

import common
from extras.engine import cost
from extras.engine.engine import generate_batch
from extras.serving import scheduler
from conftest import EOT, MASK, assert_one_line_error, random_model, random_prompts, run_cli


def serve_all(engine, requests, joins):
    """Step until every request has finished; requests[i] is submitted before step joins[i].
    Returns the (batch, width) of every forward."""
    shapes, step = [], 0
    while any(r.finish is None for r in requests):
        engine.waiting.extend(r for r, j in zip(requests, joins) if j == step)
        stepped, finished, width = engine.step()
        for r in stepped:
            r.admitted = step if r.admitted is None else r.admitted
        for r in finished:
            r.finish = step
        shapes.append((len(stepped), width))
        step += 1
    return shapes


def check_against_generate(model, prompts, taus, joins, eot, mask, B=4, max_batch=3, max_new_tokens=20):
    engine = scheduler.ServingEngine(model, eot, mask, B, max_batch, max_new_tokens)
    requests = [scheduler.Timed(p, arrival=j, tau=t) for p, t, j in zip(prompts, taus, joins)]
    shapes = serve_all(engine, requests, joins)
    batches = [b for b, _ in shapes]
    assert max(batches) == max_batch and len(set(batches)) > 1  # rows really joined and left mid-flight
    assert len({r.admitted for r in requests}) > 2
    for r in requests:
        alone = generate_batch(model, [r.prompt], eot, mask, B=B, tau=r.tau, max_new_tokens=max_new_tokens)[0]
        assert r.tokens == alone.tokens, (r.tau, len(r.prompt))
        assert r.forwards == alone.forwards and r.tau_sum == pytest.approx(r.tau * r.forwards)


def test_engine_equals_generate_alone_random_model():
    model = random_model()
    lengths = [3, 9, 50, 17, 1, 30, 47, 12, 5]  # 47 and 50 run into the context (64)
    taus = [0.9, 1.0, 0.5, 0.9, 0.7, 1.0, 0.9, 0.5, 0.99]
    joins = [0, 0, 0, 1, 2, 2, 5, 9, 9]
    check_against_generate(model, random_prompts(lengths), taus, joins, EOT, MASK)


def test_engine_equals_generate_alone_tiny_checkpoint(tiny_run, splits):
    model, tok = common.model_from_checkpoint(common.load_checkpoint(tiny_run / "mars.pt"))
    model.eval()
    prompts = [tok.prompt_ids(e["prompt"]) for e in splits["test"][:8]]
    taus = [0.9, 1.0, 0.5, 0.8, 1.0, 0.3, 0.9, 0.6]
    check_against_generate(model, prompts, taus, [0, 0, 1, 1, 3, 4, 4, 8], tok.eot, tok.mask, max_new_tokens=24)


def test_tau_one_rows_carry_no_masks():
    """At tau = 1.0 a MARS engine feeds what an AR (B = 1) engine feeds: after the prefill, one token a row."""
    model, prompts = random_model(), random_prompts([5, 8, 3, 11])
    shapes, outputs = {}, {}
    for name, B, tau in [("ar", 1, 1.0), ("tau=1.0", 4, 1.0), ("tau=0.5", 4, 0.5)]:
        requests = [scheduler.Timed(p, arrival=0, tau=tau) for p in prompts]
        shapes[name] = serve_all(scheduler.ServingEngine(model, EOT, MASK, B, 4, 12), requests, [0] * 4)
        outputs[name] = [r.tokens for r in requests]
    assert shapes["ar"] == shapes["tau=1.0"] and outputs["ar"] == outputs["tau=1.0"]
    assert shapes["tau=1.0"][0] == (4, 11) and {w for _, w in shapes["tau=1.0"][1:]} == {1}
    assert all(w >= 4 for _, w in shapes["tau=0.5"][1:])  # the new token(s) and B - 1 = 3 masks
    assert len(shapes["tau=0.5"]) < len(shapes["tau=1.0"])


def test_tau_is_read_at_every_step():
    model, prompts = random_model(), random_prompts([6, 6])
    engine = scheduler.ServingEngine(model, EOT, MASK, 4, 2, 30)
    requests = [scheduler.Timed(p, arrival=0, tau=0.5) for p in prompts]
    engine.waiting.extend(requests)
    widths = []
    for step in range(6):
        if step == 3:
            requests[0].tau = requests[1].tau = 1.0  # a policy lowers the load mid-request
        widths.append(engine.step()[2])
    assert min(widths[1:3]) >= 4 and widths[3:] == [1, 1, 1]
    assert max(r.forwards for r in requests) == 6  # one ran all six: 0.75 is the mean tau a server reports for it
    assert [r.tau_sum for r in requests] == [0.5 * min(r.forwards, 3) + 1.0 * max(r.forwards - 3, 0) for r in requests]


def test_adaptive_hysteresis():
    policy = scheduler.Adaptive(ladder=(1.0, 0.99, 0.95, 0.9))
    light = [policy(0.4) for _ in range(200)]
    heavy = [policy(3.0) for _ in range(200)]
    back = [policy(0.2) for _ in range(300)]
    assert set(light) == {1.0}  # nothing traded when nothing needs to be
    assert heavy[-1] == 0.9 and all(a >= b for a, b in zip(heavy, heavy[1:]))  # down the ladder under load
    assert back[-1] == 1.0 and all(a <= b for a, b in zip(back, back[1:]))  # and back up when it drains
    # a load hovering at a threshold, as Poisson arrivals make it: tau changes at most once, never flip-flops
    noisy = [policy(1.0 + (0.5 if i % 2 else -0.5) + 0.1 * ((i * 7) % 5 - 2)) for i in range(1000)]
    assert sum(a != b for a, b in zip(noisy, noisy[1:])) <= 1


def test_make_trace_phases():
    examples = [{"prompt": str(i)} for i in range(50)]
    trace = scheduler.make_trace(examples, [("light", 20.0, 5.0), ("overload", 60.0, 5.0)], seed=3)
    assert trace == scheduler.make_trace(examples, [("light", 20.0, 5.0), ("overload", 60.0, 5.0)], seed=3)
    times = [t for t, _ in trace]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 10
    light, overload = sum(t < 5 for t in times), sum(t >= 5 for t in times)
    assert 60 < light < 140 and 240 < overload < 360  # Poisson counts around 100 and 300
    assert {e["prompt"] for _, e in trace[:50]} == {str(i) for i in range(50)}  # each prompt once before reuse
    # the sweep's traces: one seed, three times the rate = the same requests, three times closer together
    slow, fast = (scheduler.make_trace(examples, [("sweep", rate, 60.0 / rate)], seed=4) for rate in (10.0, 30.0))
    assert [e for _, e in slow] == [e for _, e in fast]
    assert [t for t, _ in slow] == pytest.approx([3 * t for t, _ in fast])


@pytest.mark.slow
def test_cli_end_to_end(tiny_run, tmp_path):
    proc = run_cli(["extras/serving/serve.py", "--ckpt", tiny_run / "mars.pt", "--out_dir", tmp_path, "--requests", "40",
                    "--sweep", "0.5", "1.5", "--sweep_requests", "12", "--max_batch", "4", "--max_new_tokens", "16"],
                   timeout=120, fresh=True)
    assert proc.returncode == 0, proc.stderr
    assert "| policy | phase |" in proc.stdout and "ETA" in proc.stderr
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 10000
    assert result["clock"] == "virtual" and result["max_batch"] == 4 and result["slo_seconds"] > 0 and result["machine"]
    keys = {"policy", "phase", "rate", "requests", "p50_latency", "p99_latency", "p50_ttft", "p99_ttft",
            "tokens_per_second", "goodput", "tokens_per_forward", "mean_tau", "accuracy"}
    runs = result["runs"]
    assert [(r["policy"], r["phase"]) for r in runs] == [(p, ph) for p in ("ar", "tau=1.0", "tau=0.9", "adaptive")
                                                          for ph in ("light", "overload", "recovery")]
    # every policy serves the trace's arrivals of each phase: the trace its phases, seed and prompts make
    ckpt = common.load_checkpoint(str(tiny_run / "mars.pt"))
    model, tok = common.model_from_checkpoint(ckpt)
    test, _ = scheduler.prompts_for_load(ckpt, tok, model.config.max_seq_len, 4)
    phases = [(p["phase"], p["rate"], p["seconds"]) for p in result["phases"]]
    arrivals, start, count = [t for t, _ in scheduler.make_trace(test, phases, result["seed"])], 0.0, {}
    for name, _, secs in phases:
        count[name], start = sum(start <= t < start + secs for t in arrivals), start + secs
    assert [w["requests"] for w in result["whole_trace"]] == [len(arrivals)] * 4 and min(count.values()) > 0
    for r in runs:
        assert keys <= r.keys() and r["requests"] == count[r["phase"]]
        assert 0 < r["p50_latency"] <= r["p99_latency"] and 0 < r["p50_ttft"] <= r["p99_ttft"]
        assert 0 <= r["accuracy"] <= 1 and r["tokens_per_forward"] >= 1 and 0 < r["mean_tau"] <= 1
    by = {(r["policy"], r["phase"]): r for r in runs}
    assert by[("tau=0.9", "light")]["mean_tau"] == pytest.approx(0.9) and by[("tau=1.0", "light")]["tokens_per_forward"] == 1.0
    for phase in ("light", "overload", "recovery"):  # tau = 1.0 costs exactly what AR costs
        assert {k: v for k, v in by[("ar", phase)].items() if k != "policy"} == \
               {k: v for k, v in by[("tau=1.0", phase)].items() if k != "policy"}
    assert len(result["sweep"]) == 8 and set(result["goals"]) == {"overload_p99_ratio", "accuracy_points", "light_mean_tau"}


def test_cli_masks_auto_sizes_windows_by_the_clocks_cost_model(tiny_run, tmp_path, monkeypatch):
    """--masks auto on the virtual clock: the engine reads the clock's own step-cost model (no second profile)."""
    monkeypatch.setattr(cost, "measured", lambda *a, **kw: pytest.fail("a second cost model was profiled"))
    proc = run_cli(["extras/serving/serve.py", "--ckpt", tiny_run / "mars.pt", "--out_dir", tmp_path, "--requests", "40",
                    "--sweep", "1.0", "--sweep_requests", "10", "--max_batch", "4", "--max_new_tokens", "16",
                    "--masks", "auto"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["masks"] == "auto" and result["step_cost"]["widths"][0] == 1
    by = {(r["policy"], r["phase"]): r for r in result["runs"]}
    for phase in ("light", "overload", "recovery"):  # tau = 1.0 feeds no masks in either mode
        assert by[("tau=1.0", phase)]["tokens_per_forward"] == 1.0
        assert {k: v for k, v in by[("ar", phase)].items() if k != "policy"} == \
               {k: v for k, v in by[("tau=1.0", phase)].items() if k != "policy"}
        low = by[("tau=0.9", phase)]  # the same arrivals, at tau 0.9 in every forward, 1 to B tokens a forward
        assert low["requests"] == by[("ar", phase)]["requests"] and low["mean_tau"] == pytest.approx(0.9)
        assert 1 <= low["tokens_per_forward"] <= result["B"]


BAD_FLAGS = [(["--max_batch", "0"], "--max_batch must be at least 1"),
             (["--ladder", "1.0", "1.2"], "argument --ladder: must be in (0, 1]"),
             (["--ladder", "0.9", "0.95"], "--ladder needs at least two taus, strictly decreasing"),
             (["--ladder", "1.0"], "--ladder needs at least two taus"),
             (["--clock", "sundial"], "argument --clock: invalid choice: 'sundial'"),
             (["--requests", "many"], "argument --requests: invalid int value: 'many'"),
             (["--sweep", "0"], "--sweep rates and --slo must be positive"),
             (["--slo", "-1"], "--sweep rates and --slo must be positive"),
             (["--ckpt", "missing.pt"], "checkpoint not found: missing.pt"),
             (["--masks", "some"], "argument --masks: invalid choice: 'some'")]


@pytest.mark.parametrize("args,says", BAD_FLAGS)
def test_bad_flags_one_line_error(args, says):
    proc = run_cli(["extras/serving/serve.py", *args])
    assert_one_line_error(proc)
    assert proc.stderr.startswith(f"error: {says}"), proc.stderr


def test_rejects_an_ar_checkpoint(tiny_run, tmp_path):
    proc = run_cli(["extras/serving/serve.py", "--ckpt", tiny_run / "ar.pt", "--out_dir", tmp_path])
    assert_one_line_error(proc)
    assert f"{tiny_run / 'ar.pt'} is a stage-1 (AR) checkpoint: serve needs a MARS checkpoint" in proc.stderr


def test_cache_is_copied_only_when_rows_change():
    """A step where no row joins or leaves must not touch the cache (it used to copy it twice per forward)."""
    engine = scheduler.ServingEngine(random_model(), EOT, MASK, 4, 2, 8)
    calls = []
    for name in ("add_rows", "keep_rows"):
        method = getattr(engine.kv, name)
        setattr(engine.kv, name, lambda *a, method=method, name=name: (calls.append(name), method(*a))[1])
    requests = [scheduler.Timed(p, arrival=0, tau=1.0) for p in random_prompts([5, 7])]
    engine.waiting.extend(requests)
    engine.step()
    assert calls == ["add_rows"]  # both rows joined in one call
    k = engine.kv.k
    for _ in range(3):  # nobody joins or leaves: the same tensor, no copy
        stepped, finished, _ = engine.step()
        assert len(stepped) == 2 and not finished and engine.kv.k is k
    assert calls == ["add_rows"]
    requests[0].cancelled = True  # a row leaves: now the cache shrinks, once
    assert len(engine.step()[0]) == 1 and calls == ["add_rows", "keep_rows"] and engine.kv.k.shape[1] == 1


def test_cancelled_requests_leave_before_the_next_forward():
    model = random_model()
    engine = scheduler.ServingEngine(model, EOT, MASK, 4, 3, 30)
    requests = [scheduler.Timed(p, arrival=0, tau=0.7) for p in random_prompts([4, 6, 9, 5])]
    engine.waiting.extend(requests)
    engine.step()
    assert requests[1] in engine.running and requests[2] in engine.running and len(engine.waiting) == 1
    requests[1].cancelled = requests[3].cancelled = True  # one running, one still waiting
    rest = [id(r) for r in engine.running if not r.cancelled]
    stepped, _, _ = engine.step()
    assert [id(r) for r in stepped] == rest and engine.kv.k.shape[1] == len(engine.running)
    assert requests[3].forwards == 0 and not engine.waiting and requests[1].forwards == 1
    serve_all(engine, [requests[2]], [-1])
    alone = generate_batch(model, [requests[2].prompt], EOT, MASK, B=4, tau=0.7, max_new_tokens=30)[0]
    assert requests[2].tokens == alone.tokens  # the others go on undisturbed


def test_engine_lossless_equals_ar():
    """lossless rows run through the same step: AR's output, in fewer forwards, beside threshold rows."""
    model, prompts = random_model(), random_prompts([3, 9, 20, 6, 12])
    engine = scheduler.ServingEngine(model, EOT, MASK, 4, 3, 24)
    requests = [scheduler.Timed(p, arrival=0, lossless=i != 2, tau=0.5 if i == 2 else 1.0)
                for i, p in enumerate(prompts)]
    serve_all(engine, requests, [0, 0, 0, 1, 2])
    fewer = 0
    for r in requests:
        ar = generate_batch(model, [r.prompt], EOT, MASK, B=1, max_new_tokens=24)[0]
        if r.lossless:
            assert r.tokens == ar.tokens
            fewer += r.forwards < ar.forwards
        else:
            assert r.tokens == generate_batch(model, [r.prompt], EOT, MASK, B=4, tau=0.5, max_new_tokens=24)[0].tokens
    assert fewer >= 2  # the drafts were really accepted
