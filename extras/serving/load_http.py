"""The load experiment over HTTP (python -m extras.serving.serve --http_load): the three-phase trace of
extras/serving/scheduler.py sent to the server (extras/serving/server.py) by one real HTTP client per request,
on the wall clock."""
import http.client
import json
import os
import sys
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np

from common import UserError
from extras.bench.eval import machine
from extras.real import records
from extras.serving.scheduler import (PHASES, Adaptive, Fixed, ServingEngine, WallClock, by_phase, calibrate,
                                      load_mars, make_trace, prompts_for_load)
from extras.serving.report import goals, markdown
from extras.serving.server import Server


def send(url, rec, max_tokens, t0):
    """One client: a streamed chat completion; fills rec with its times (s since t0), text and usage."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = {"messages": [{"role": "user", "content": rec.example["prompt"]}], "max_tokens": max_tokens, "stream": True}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = resp.read().decode()
            return
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                rec.error = event["error"]["message"]
            elif event.get("usage"):
                rec.usage, rec.finish = event["usage"], time.perf_counter() - t0
            else:
                rec.first_token = rec.first_token or time.perf_counter() - t0
                rec.text += event["choices"][0]["delta"].get("content", "")
    finally:
        conn.close()


def drive(url, trace, max_tokens):
    """Open loop: each (arrival, example) is sent at its time by its own client thread, whatever the others wait."""
    recs = [SimpleNamespace(arrival=a, example=e, first_token=None, finish=None, text="", usage=None, error=None)
            for a, e in trace]
    threads, t0 = [], time.perf_counter()
    for rec in recs:
        time.sleep(max(0.0, rec.arrival - (time.perf_counter() - t0)))
        threads.append(threading.Thread(target=send, args=(url, rec, max_tokens, t0), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    failed = [r for r in recs if r.error or r.usage is None]
    if failed:
        raise UserError(f"{len(failed)} of {len(recs)} HTTP requests failed, e.g.: {failed[0].error}")
    return recs


def summarise_http(recs, start, end, slo):
    """summarise's metrics, from what the clients saw."""
    lat, ttft = [r.finish - r.arrival for r in recs], [r.first_token - r.arrival for r in recs]
    tokens, forwards = sum(r.usage["completion_tokens"] for r in recs), sum(r.usage["forwards"] for r in recs)
    pct = lambda xs, q: float(np.percentile(xs, q))
    return dict(requests=len(recs), p50_latency=pct(lat, 50), p99_latency=pct(lat, 99), p50_ttft=pct(ttft, 50),
                p99_ttft=pct(ttft, 99), tokens_per_second=tokens / (end - start),
                goodput=sum(x <= slo for x in lat) / (end - start), tokens_per_forward=tokens / forwards,
                mean_tau=sum(r.usage["tau"] * r.usage["forwards"] for r in recs) / forwards,
                accuracy=sum(records.check(r.example, r.text) for r in recs) / len(recs))


def http_load(args):
    """The three-phase trace sent by one HTTP client per request, on the wall clock, at tau = 1.0 and adaptive.
    The capacity that sets the rates is measured in-process, so the HTTP overhead makes the overload heavier."""
    model, tok, B, ckpt = load_mars(args.ckpt, args.device, args.dtype)
    test, calib = prompts_for_load(ckpt, tok, min(model.config.max_seq_len, args.max_context), args.max_batch,
                                   args.data)
    t0 = time.perf_counter()
    cap, _, slo = calibrate(model, tok, calib, B, args, WallClock, masks=args.masks)
    seconds = args.requests / (cap * sum(m for _, m in PHASES))
    phases = [(name, m * cap, seconds) for name, m in PHASES]
    trace = make_trace(test, phases, args.seed)
    # the experiment measures queueing, not refusals: every request is let in
    args.port, args.max_queue, args.max_connections = 0, len(trace) + 1, len(trace) + 64
    runs, whole = [], []
    for label, policy in {"tau=1.0": Fixed(1.0), "adaptive": Adaptive(ladder=tuple(args.ladder))}.items():
        engine = ServingEngine(model, tok.eot, tok.mask, B, args.max_batch, args.max_new_tokens, n_vocab=tok.n_vocab,
                               max_context=args.max_context, masks=args.masks)
        httpd = Server(engine, tok, policy, args)
        httpd.start()
        t_run = time.perf_counter()
        try:
            recs = drive(httpd.url, trace, args.max_new_tokens)
        finally:
            httpd.stop()
        runs += by_phase(label, recs, phases, lambda rs, a, b: summarise_http(rs, a, b, slo))
        whole.append(runs.pop())
        print(f"  http {label:9s} {len(trace):4d} requests in {time.perf_counter() - t_run:5.1f}s", file=sys.stderr,
              flush=True)
    result = {"clock": "wall, over HTTP", "masks": args.masks, "p99_goal": 0.5, "max_batch": args.max_batch,
              "slo_seconds": slo, "machine": machine(), "runs": runs, "whole_trace": whole, "ckpt": args.ckpt, "B": B,
              "ladder": args.ladder, "capacity": {"tau=1.0": cap}, "seed": args.seed,
              "phases": [{"phase": n, "rate": r, "seconds": s} for n, r, s in phases]}
    result["goals"] = goals(result)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "serve_http.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    print(f"done in {time.perf_counter() - t0:.0f}s: {path}", file=sys.stderr)
