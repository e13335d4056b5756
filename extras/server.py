"""An OpenAI-compatible HTTP server on serve.py's continuous-batching engine, a page that
shows each forward commit its tokens, and the load experiment sent by real HTTP clients.

    python serve.py --http                    # http://127.0.0.1:8000/: the page; /v1/chat/completions, /v1/models
    python serve.py --http --adaptive         # the server picks each request's tau from the backlog
    python serve.py --http_load               # the load trace over HTTP, wall clock -> out/serve_http.json

Threads: one engine thread owns the model and runs serve.Engine.step, the step the load
experiment runs (no second engine, no copy of the step). The HTTP server gives every
connection a thread; a handler only validates the body, puts a job in the engine's inbox
(bounded: 503 when full) and reads the job's own queue of events, one per forward. A client
that hangs up marks its job cancelled, and the engine drops its row before the next forward.
MARS extensions of the request body: "tau" (0, 1] and "lossless" (true: AR's output, several
tokens per forward, verified against the AR argmax). The usage adds "forwards",
"tokens_per_forward" and "tau" (the mean over the job's forwards, what the policy chose).
"""
import http.client
import json
import os
import queue
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np

import data
import serve
from eval import machine
from cli import run_cli
from sample import threshold
from serve_report import goals, markdown

MAX_BODY = 1 << 20  # bytes of a request body
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web", "index.html")


class ApiError(Exception):
    """An answer other than 200: status and a one-line JSON error, as OpenAI's API gives them."""

    def __init__(self, status, message, kind="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job(serve.Request):
    pinned: bool = False  # the client chose its tau: the policy leaves it alone
    events: queue.Queue = field(default_factory=queue.Queue)  # ("chunk", ids, tau), ("done",), ("error", message)


# ---------------------------------------------------------------------------
# The engine thread

class EngineLoop(threading.Thread):
    """Owns the engine: moves jobs from the inbox into it, sets the tau of the unpinned ones from the
    policy, steps, and posts each job's new tokens to its queue. Nothing else touches the model."""

    def __init__(self, engine, policy, max_queue):
        super().__init__(name="engine", daemon=True)
        self.engine, self.policy, self.max_queue = engine, policy, max_queue
        self.inbox, self.cond, self.stopping, self.steps = [], threading.Condition(), False, 0

    def submit(self, job):
        with self.cond:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", "server_error")
            if len(self.inbox) + len(self.engine.waiting) >= self.max_queue:
                raise ApiError(503, f"the server is overloaded: {self.max_queue} requests are waiting; retry later",
                               "server_error", code="overloaded")
            self.inbox.append(job)
            self.cond.notify()

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.join(timeout=30)

    def run(self):
        engine = self.engine
        while True:
            with self.cond:
                while not (self.inbox or engine.backlog or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    break
                engine.waiting.extend(self.inbox)
                self.inbox.clear()
            tau = self.policy(engine.backlog / engine.max_batch)
            for job in list(engine.waiting) + engine.running:
                if not job.pinned:
                    job.tau = tau
            try:
                _, _, stepped, finished = engine.step(time.perf_counter())
            except Exception as e:  # a bug must not hang every client: each gets a 500, the server goes on
                traceback.print_exc()
                for job in list(engine.waiting) + engine.running:
                    job.events.put(("error", f"the engine failed: {e}"))
                engine.waiting.clear()
                engine.evict([])
                continue
            self.steps += 1
            for job in stepped:
                job.events.put(("chunk", job.chunks[-1], job.tau))
            for job in finished:
                job.events.put(("done",))
        for job in self.inbox + list(engine.waiting) + engine.running:
            job.events.put(("error", "the server is shutting down"))


# ---------------------------------------------------------------------------
# Requests in, answers out

def takes_conversation(tok):
    """Whether tok.prompt_ids renders a whole conversation (a Hugging Face chat template) or one prompt (ours)."""
    try:
        tok.prompt_ids([{"role": "user", "content": "hi"}])
        return True
    except (TypeError, AttributeError):
        return False


def field_of(body, name, kinds, what, ok=lambda v: True, default=None):
    """body[name] checked: of the JSON types `kinds` (a bool is not a number here) and ok(value); else a 400."""
    v, kinds = body.get(name), kinds if isinstance(kinds, tuple) else (kinds,)
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds) or not ok(v):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(v)[:80]}", param=name)
    return v


def parse(body, app):
    """A job from a chat completion request body, or an ApiError (400) saying what is wrong."""
    number = (int, float)
    messages = field_of(body, "messages", list, "a list of {role, content} messages", lambda v: len(v) > 0)
    if messages is None:
        raise ApiError(400, "'messages' is required: a list with at least one user message", param="messages")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ApiError(400, "each message must be an object with a string 'role' and 'content'", param="messages")
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users or not users[-1].strip():
        raise ApiError(400, "the prompt is empty: 'messages' needs a user message with some content", param="messages")
    max_tokens = field_of(body, "max_tokens", int, "an integer >= 1", lambda v: v >= 1,
                          field_of(body, "max_completion_tokens", int, "an integer >= 1", lambda v: v >= 1))
    tau = field_of(body, "tau", number, "a number in (0, 1]", lambda v: 0 < v <= 1)
    temperature = field_of(body, "temperature", number, "a number in [0, 2]", lambda v: 0 <= v <= 2, 0)
    if temperature > 0:
        raise ApiError(400, "this server decodes greedily: 'temperature' must be 0 or left out", param="temperature")
    field_of(body, "n", int, "1 (one choice per request)", lambda v: v == 1)
    field_of(body, "model", str, "a string")
    field_of(body, "stream_options", dict, "an object")
    stream = field_of(body, "stream", bool, "true or false", default=False)
    lossless = field_of(body, "lossless", bool, "true or false", default=False)
    ids = app.tok.prompt_ids(messages if app.conversation else users[-1])
    if len(ids) >= app.max_seq:
        raise ApiError(400, f"the prompt is {len(ids)} tokens, and the model's context is {app.max_seq}",
                       param="messages", code="context_length_exceeded")
    job = Job(arrival=time.perf_counter(), prompt=ids, lossless=lossless, max_new_tokens=max_tokens,
              pinned=tau is not None, tau=app.tau if tau is None else float(tau))
    return job, stream


def usage(job):
    n, f = len(job.tokens), max(job.forwards, 1)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n,
            "forwards": job.forwards, "tokens_per_forward": n / f, "tau": job.tau_sum / f}


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects; streams are chunked
    server_version = "mars-minimal"

    def log_message(self, format, *args):  # quiet: a load test sends hundreds of requests
        pass

    def send(self, status, obj, content_type="application/json"):
        raw = obj if isinstance(obj, bytes) else (json.dumps(obj) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        if status == 503:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        app, path = self.server, urlsplit(self.path).path
        if path in ("/", "/index.html"):
            self.send(200, app.page, "text/html; charset=utf-8")
        elif path == "/v1/models":
            self.send(200, {"object": "list", "data": [{"id": app.name, "object": "model", "created": app.started,
                                                        "owned_by": "mars-minimal", "B": app.B}]})
        else:
            self.send(404, ApiError(404, f"no such endpoint: GET {path}").body)

    def do_POST(self):
        job = None
        try:
            if urlsplit(self.path).path != "/v1/chat/completions":
                raise ApiError(404, f"no such endpoint: POST {self.path}")
            job, stream = parse(self.read_body(), self.server)
            self.server.loop.submit(job)
            (self.stream if stream else self.complete)(job)
        except ApiError as e:
            self.close_connection = True  # the body may be left unread
            self.send(e.status, e.body)
        except (ClientGone, OSError):  # the client hung up: its row leaves before the next forward
            self.close_connection = True
            if job:
                job.cancelled = True
        except Exception as e:  # a bug of ours: logged here, one line of JSON there
            traceback.print_exc()
            self.close_connection = True
            self.send(500, ApiError(500, f"internal error: {e}", "server_error").body)

    def read_body(self):
        try:
            n = int(self.headers.get("Content-Length"))
        except (TypeError, ValueError):
            raise ApiError(411, "a JSON body with a Content-Length header is required") from None
        if n > MAX_BODY:
            left = min(n, 16 * MAX_BODY)  # read it away, so that the client hears the answer
            while left > 0 and (chunk := self.rfile.read(min(left, 65536))):
                left -= len(chunk)
            raise ApiError(413, f"the body is {n} bytes, over the limit of {MAX_BODY}")
        try:
            body = json.loads(self.rfile.read(n))
        except ValueError:  # UnicodeDecodeError included
            raise ApiError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def events(self, job):
        """The job's events until it is done; a hung-up client cancels it (checked every 50 ms)."""
        checked = time.perf_counter()
        while True:
            try:
                event = job.events.get(timeout=0.05)
            except queue.Empty:
                event = None
            if time.perf_counter() - checked > 0.05 or event is None:
                checked = time.perf_counter()
                if self.client_gone():
                    job.cancelled = True
                    raise ClientGone
            if event is None:
                continue
            if event[0] == "error":
                raise ApiError(503, event[1], "server_error")
            if event[0] == "done":
                return
            yield event

    def client_gone(self):
        readable, _, _ = select.select([self.connection], [], [], 0)
        try:
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def head(self, job):
        return {"id": f"chatcmpl-{id(job):x}", "created": int(time.time()), "model": self.server.name}

    def text(self, job):
        return self.server.tok.decode([t for t in job.tokens if t != self.server.tok.eot])

    def finish_reason(self, job):
        return "stop" if job.tokens[-1:] == [self.server.tok.eot] else "length"

    def complete(self, job):
        for _ in self.events(job):
            pass
        self.send(200, {**self.head(job), "object": "chat.completion", "usage": usage(job), "choices": [
            {"index": 0, "message": {"role": "assistant", "content": self.text(job)},
             "finish_reason": self.finish_reason(job)}]})

    def stream(self, job):
        """Server-sent events: one per forward that committed tokens, then the finish with the usage, then [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        head, sent, seen, tok = {**self.head(job), "object": "chat.completion.chunk"}, "", [], self.server.tok
        try:
            for k, (_, ids, tau) in enumerate(self.events(job)):  # the engine may be ahead: read its events only
                seen += ids
                text = tok.decode([t for t in seen if t != tok.eot])
                if seen[-1:] != [tok.eot]:
                    text = text.rstrip("\ufffd")  # a character cut between two forwards waits for its end
                delta = {"content": text[len(sent):], **({"role": "assistant"} if k == 0 else {})}
                sent = text
                self.event({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                            "mars": {"forward": k + 1, "tokens": len(ids), "tau": tau}})
            self.event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": self.finish_reason(job)}],
                        "usage": usage(job)})
        except ApiError as e:  # headers are gone: the error becomes the last event, as OpenAI's streams do
            self.event(e.body)
        self.event("[DONE]")
        self.write_chunk(b"")

    def event(self, obj):
        self.write_chunk(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

    def write_chunk(self, raw):
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            self.wfile.flush()
        except OSError:
            self.close_connection = True
            raise ClientGone from None


class Server(ThreadingHTTPServer):
    """The HTTP server and its engine thread. serve_forever() in one thread; stop() ends both."""
    daemon_threads = True

    def __init__(self, address, engine, tok, policy, tau=0.9, max_queue=64, name="mars"):
        super().__init__(address, Handler)
        self.tok, self.tau, self.name, self.B, self.max_seq = tok, tau, name, engine.B, engine.max_seq
        self.conversation, self.started = takes_conversation(tok), int(time.time())
        with open(PAGE, "rb") as f:
            self.page = f.read()
        self.loop = EngineLoop(engine, policy, max_queue)
        self.loop.start()

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self):
        self.shutdown()
        self.loop.stop()
        self.server_close()


def build(args, model, tok, B, name, port=None, policy=None):
    engine = serve.Engine(model, tok.eot, tok.mask, B, args.max_batch, args.max_new_tokens, tok.n_vocab,
                          args.max_context)
    policy = policy or (serve.Adaptive(ladder=tuple(args.ladder)) if args.adaptive else serve.Fixed(args.tau))
    return Server((args.host, args.port if port is None else port), engine, tok, policy, args.tau, args.max_queue, name)


def run_server(args):
    model, tok, B, _ = serve.load_mars(args.ckpt, args.device, args.dtype)
    name = os.path.splitext(os.path.basename(os.path.normpath(args.ckpt)))[0]
    try:
        httpd = build(args, model, tok, B, name)
    except OSError as e:
        raise serve.UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    how = f"adaptive tau {args.ladder}" if args.adaptive else f"tau {args.tau} unless a request says"
    print(f"serving {args.ckpt} (B = {B}, {how}) on {httpd.url}/ ; Ctrl-C stops", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
    finally:
        httpd.loop.stop()
        httpd.server_close()


# ---------------------------------------------------------------------------
# The load experiment through HTTP: the same trace, real clients, the wall clock

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
        raise serve.UserError(f"{len(failed)} of {len(recs)} HTTP requests failed, e.g.: {failed[0].error}")
    return recs


def summarise_http(recs, start, end, slo):
    """serve.summarise's metrics, from what the clients saw."""
    lat, ttft = [r.finish - r.arrival for r in recs], [r.first_token - r.arrival for r in recs]
    tokens, forwards = sum(r.usage["completion_tokens"] for r in recs), sum(r.usage["forwards"] for r in recs)
    pct = lambda xs, q: float(np.percentile(xs, q))
    return dict(requests=len(recs), p50_latency=pct(lat, 50), p99_latency=pct(lat, 99), p50_ttft=pct(ttft, 50),
                p99_ttft=pct(ttft, 99), tokens_per_second=tokens / (end - start),
                goodput=sum(x <= slo for x in lat) / (end - start), tokens_per_forward=tokens / forwards,
                mean_tau=sum(r.usage["tau"] * r.usage["forwards"] for r in recs) / forwards,
                accuracy=sum(data.check(r.example, r.text) for r in recs) / len(recs))


def http_load(args):
    model, tok, B, ckpt = serve.load_mars(args.ckpt, args.device, args.dtype)
    test, calib = serve.prompts_for_load(ckpt, tok, min(model.config.max_seq_len, args.max_context), args.max_batch,
                                         args.data)
    t0 = time.perf_counter()
    cap, _, slo = serve.calibrate(model, tok, calib, B, args, serve.WallClock)  # in-process, on the wall clock
    seconds = args.requests / (cap * sum(m for _, m in serve.PHASES))
    phases = [(name, m * cap, seconds) for name, m in serve.PHASES]
    trace = serve.make_trace(test, phases, args.seed)
    runs, whole = [], []
    for label, policy in {"tau=1.0": serve.Fixed(1.0), "adaptive": serve.Adaptive(ladder=tuple(args.ladder))}.items():
        httpd = build(args, model, tok, B, "mars", port=0, policy=policy)
        httpd.loop.max_queue = len(trace) + 1  # the experiment measures queueing, not refusals
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        t_run = time.perf_counter()
        try:
            recs = drive(httpd.url, trace, args.max_new_tokens)
        finally:
            httpd.stop()
        runs += serve.by_phase(label, recs, phases, lambda rs, a, b: summarise_http(rs, a, b, slo))
        whole.append(runs.pop())
        print(f"  http {label:9s} {len(trace):4d} requests in {time.perf_counter() - t_run:5.1f}s", file=sys.stderr, flush=True)
    result = {"clock": "wall, over HTTP", "max_batch": args.max_batch, "slo_seconds": slo, "machine": machine(),
              "runs": runs, "whole_trace": whole, "ckpt": args.ckpt, "B": B, "ladder": args.ladder,
              "capacity": {"tau=1.0": cap}, "phases": [{"phase": n, "rate": r, "seconds": s} for n, r, s in phases],
              "seed": args.seed}
    result["goals"] = goals(result)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "serve_http.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    print(f"done in {time.perf_counter() - t0:.0f}s: {path}", file=sys.stderr)


def flags(p):
    def positive(text):
        n = int(text)
        if n < 1:
            raise ValueError(text)
        return n
    p.add_argument("--http", action="store_true", help="serve HTTP: the page at /, /v1/chat/completions, /v1/models")
    p.add_argument("--http_load", action="store_true", help="the load trace sent over HTTP by real clients, wall clock: "
                   "fixed tau = 1.0 and adaptive -> OUT_DIR/serve_http.json")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--tau", type=threshold, default=0.9, help="tau of a request that does not give one (default 0.9)")
    p.add_argument("--adaptive", action="store_true", help="the server picks tau from the backlog (--ladder) for "
                   "every request that does not give its own")
    p.add_argument("--max_queue", type=positive, default=64, help="requests waiting beyond the running batch before "
                   "the server answers 503 (default 64)")


def main(argv=None):
    args = serve.get_args(argv, more=flags)
    (http_load if args.http_load else run_server)(args)


if __name__ == "__main__":
    run_cli(main)
