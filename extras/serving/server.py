"""An OpenAI-compatible HTTP server on the continuous-batching engine (engine.py) and its page:
`python -m extras.serving.serve --http` (see --help); extras/serving/load_http.py sends it the load experiment.

uvicorn speaks HTTP (h11) and Starlette routes. One engine thread owns the model and steps the engine
(extras.serving.scheduler.ServingEngine) as the load experiment does; a request waits on an asyncio queue that the
thread feeds, one event per forward. The request schema (Chat) names any field we do not implement in a
400; errors keep OpenAI's shape. Another site's page cannot drive the server (HostCheck, read_json, CORS
only with --cors).
SIGINT or SIGTERM: no new requests; those in flight get GRACE seconds, then an error each; exit 0.
Our extensions: "tau" and "lossless" in the body; "forwards", "tokens_per_forward" and "tau" (the mean)
in the usage; "mars" (tokens, tau) in each streamed forward; "B" and "masks" (--masks) in /v1/models.
"""
import asyncio
import json
import os
import resource
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import numpy as np
import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from common import UserError
from extras.serving.scheduler import Served

MAX_BODY = 1 << 20  # bytes of a request body; a longer one is read no further than 16x that, then 413
BACKLOG = 2048  # connections the kernel queues before they are accepted: a burst of clients is never reset
GRACE = 3.0  # seconds the requests in flight get to finish at shutdown
MAX_DEPTH = 16  # levels of JSON nesting in a body (a chat request has 4)
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web", "index.html")


class ApiError(Exception):
    """An answer other than 200: a status and a one-line JSON error, as OpenAI's API gives them."""

    def __init__(self, status, message, kind="invalid_request_error", param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(e):
    """The response of an ApiError. It closes the connection: the request's body may be left unread."""
    headers = {**e.headers, "Connection": "close", **({"Retry-After": "1"} if e.status == 503 else {})}
    return Response(json.dumps(e.body) + "\n", e.status, headers, media_type="application/json")


# ---------------------------------------------------------------------------
# The engine thread

@dataclass(eq=False)
class Job(Served):
    pinned: bool = False  # the client chose its tau: the policy leaves it alone
    posted: int = 0  # tokens already posted to the client
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)  # the client's
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("chunk", ids, tau), ("done",), ("error", message)

    def post(self, *event):  # from the engine thread: asyncio's queues are not thread-safe, call_soon_threadsafe is
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody waits for this job any more
            pass


class EngineThread(threading.Thread):
    """Owns the engine: moves submitted jobs into it, sets the tau of the unpinned ones from the policy,
    steps, and posts each job's new tokens. Nothing else touches the model."""

    def __init__(self, engine, policy, max_queue):
        super().__init__(name="engine", daemon=True)
        self.engine, self.policy, self.max_queue = engine, policy, max_queue
        self.inbox, self.cond, self.deadline = [], threading.Condition(), None

    def submit(self, job):
        with self.cond:
            if self.deadline is not None:
                raise ApiError(503, "the server is shutting down", "server_error")
            if len(self.inbox) + len(self.engine.waiting) >= self.max_queue:
                raise ApiError(503, f"the server is overloaded: {self.max_queue} requests are waiting; retry later",
                               "server_error", code="overloaded")
            self.inbox.append(job)
            self.cond.notify()

    def close(self, grace):
        """No new jobs; those in flight get `grace` seconds to finish, then an error."""
        with self.cond:
            self.deadline = time.monotonic() + grace
            self.cond.notify()

    def run(self):
        engine = self.engine
        while True:
            with self.cond:
                while not (self.inbox or engine.backlog or self.deadline):
                    self.cond.wait()
                engine.waiting.extend(self.inbox)
                self.inbox.clear()
            if self.deadline and (not engine.backlog or time.monotonic() > self.deadline):
                break
            tau = self.policy(engine.backlog / engine.max_batch)
            for job in list(engine.waiting) + engine.running:
                job.tau = job.tau if job.pinned else tau
            try:
                stepped, finished, _ = engine.step()
            except Exception as e:  # a bug must not hang every client: each gets an error, the server goes on
                traceback.print_exc()
                self.fail(f"the engine failed: {e}")
                continue
            for job in stepped:
                job.post("chunk", job.tokens[job.posted:], job.tau)
                job.posted = len(job.tokens)
            for job in finished:
                job.post("done")
        self.fail("the server is shutting down")

    def fail(self, message):
        for job in list(self.engine.waiting) + self.engine.running:
            job.cancelled = True  # the engine drops it before its next forward
            job.post("error", message)


async def events(job):
    """(ids, tau) of each forward until the job is done; an ApiError if it fails."""
    while (event := await job.events.get())[0] == "chunk":
        yield event[1:]
    if event[0] == "error":
        raise ApiError(503, event[1], "server_error")


def usage(job):
    n, f = len(job.tokens), max(job.forwards, 1)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n,
            "forwards": job.forwards, "tokens_per_forward": round(n / f, 6), "tau": round(job.tau_sum / f, 6)}


# ---------------------------------------------------------------------------
# The request schema

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "1" is not a number, true is not 1


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class Chat(Strict):
    """POST /v1/chat/completions. OpenAI's fields that this server honours, three OpenAI knobs at the only
    value greedy decoding has, and our extensions. Any other field is a 400 naming it; null means left out."""
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: the finish event carries the usage anyway
    temperature: Literal[0] | None = Field(None, description="this server decodes greedily")
    top_p: Literal[1] | None = Field(None, description="this server decodes greedily")
    n: Literal[1] | None = Field(None, description="one answer per request")
    tau: float | None = Field(None, gt=0, le=1, description="the MARS threshold: a number in (0, 1]")
    lossless: bool = False

    @field_validator("tau")
    @classmethod
    def representable(cls, tau):
        if np.float32(tau) == 0:  # decoding compares in float32: 0 there would accept every prediction
            raise ValueError("tau rounds to 0 in float32")
        return tau


def parse(body):
    """A Chat from the JSON body, or an ApiError (400) naming the field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return Chat.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(map(str, err["loc"]))
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"'{param}' is not supported by this server", param=param) from None
        why = Chat.model_fields[err["loc"][0]].description
        say = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]  # a validator's own words
        raise ApiError(400, f"'{param}': {say}" + (f" ({why})" if why else ""), param=param) from None


async def read_json(request):
    """The body as JSON: counted as it arrives (a Content-Length may lie), MAX_BODY at most, else 413."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":  # a form or text/plain post from another site's page
        raise ApiError(415, f"the body must be JSON, sent with Content-Type: application/json (got {kind!r})")
    body, size = bytearray(), 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY:
                body += chunk
            elif size > 16 * MAX_BODY:  # not worth reading away to be heard
                break
    except ClientDisconnect:
        raise ApiError(400, "the body is incomplete: the client closed the connection") from None
    if size > MAX_BODY:
        raise ApiError(413, f"the body is over the limit of {MAX_BODY} bytes")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        raise ApiError(400, "the body is not valid JSON (or nested too deeply)") from None
    level, depth = [value], 0
    while level:  # how deep, without recursion: a request is a few levels deep
        depth, level = depth + 1, [v for x in level if isinstance(x, (list, dict))
                                   for v in (x.values() if isinstance(x, dict) else x)]
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the body is nested too deeply (at most {MAX_DEPTH} levels)")
    return value


# ---------------------------------------------------------------------------
# The endpoints

class Api:
    def __init__(self, worker, tok, tau, name):
        self.worker, self.tok, self.tau, self.name = worker, tok, tau, name
        self.started = int(time.time())
        with open(PAGE, "rb") as f:
            self.html = f.read()

    def app(self, hosts, cors=None):
        cors = [Middleware(CORSMiddleware, allow_origins=[cors], allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "Authorization"])] if cors else []
        return Starlette(routes=[Route("/", self.page), Route("/v1/models", self.models),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])],
                         middleware=[Middleware(HostCheck, hosts=hosts), *cors],
                         exception_handlers={ApiError: lambda _, e: error(e), HTTPException: http_error, Exception:
                                             lambda *_: error(ApiError(500, "internal error", "server_error"))})

    async def page(self, request):
        return HTMLResponse(self.html)

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.started,
                                                         "owned_by": "mars-minimal", "B": self.worker.engine.B,
                                                         "masks": "auto" if self.worker.engine.auto else "fixed"}]})

    async def chat(self, request):
        chat = parse(await read_json(request))
        job = Job(await self.prompt(chat.messages), lossless=chat.lossless, pinned=chat.tau is not None,
                  max_new_tokens=chat.max_tokens or chat.max_completion_tokens, tau=chat.tau or self.tau)
        self.worker.submit(job)
        head = {"id": f"chatcmpl-{id(job):x}", "created": int(time.time()), "model": self.name}
        if chat.stream:
            return StreamingResponse(self.stream(job, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in events(job):
            pass
        return JSONResponse({**head, "object": "chat.completion", "usage": usage(job), "choices": [
            {"index": 0, "message": {"role": "assistant", "content": self.text(job.tokens)},
             "finish_reason": self.finish_reason(job)}]})

    async def prompt(self, messages):
        """The prompt's ids: the whole conversation in the model's chat format, which decides what it
        accepts (a Hugging Face template renders system turns; the toy's format has none: a 400)."""
        messages = [m.model_dump() for m in messages]
        if messages[-1]["role"] != "user":
            raise ApiError(400, "the conversation must end with a user message, which the answer follows",
                           param="messages")
        if not messages[-1]["content"].strip():
            raise ApiError(400, "the prompt is empty: the last user message has no content", param="messages")
        try:  # in a thread: a long prompt must not stall the other clients
            ids = await asyncio.to_thread(self.tok.prompt_ids, messages)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # ValueError, or a Rust tokenizer's panic (pyo3's PanicException)
            raise ApiError(400, f"no prompt can be made of these messages: {e}", param="messages") from None
        if len(ids) >= self.worker.engine.max_seq:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, and the model's context is "
                           f"{self.worker.engine.max_seq}", param="messages", code="context_length_exceeded")
        return ids

    def text(self, ids):
        return self.tok.answer(ids)

    def finish_reason(self, job):
        return "stop" if job.tokens[-1:] == [self.tok.eot] else "length"

    async def stream(self, job, head):
        """Server-sent events: one per forward (what it committed), then the finish with the usage, then [DONE]."""
        head, sent, seen, k = {**head, "object": "chat.completion.chunk"}, "", [], 0
        try:
            async for ids, tau in events(job):
                seen += ids
                text = self.text(seen)
                if seen[-1:] != [self.tok.eot]:
                    text = text.rstrip("\ufffd")  # a character cut between two forwards waits for its end
                delta = {"content": text[len(sent):], **({"role": "assistant"} if k == 0 else {})}
                sent, k = text, k + 1
                yield sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                           "mars": {"forward": k, "tokens": len(ids), "tau": tau}})
            yield sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": self.finish_reason(job)}],
                       "usage": usage(job)})
        except ApiError as e:  # the status is sent: the error is the last event, as in OpenAI's streams
            yield sse(e.body)
        finally:  # also when the client has gone (the task is cancelled): its row leaves; a done job has left
            job.cancelled = True
        yield "data: [DONE]\n\n"


def sse(obj):
    return f"data: {json.dumps(obj)}\n\n"


def http_error(request, e):
    """Starlette's 404 and 405, in OpenAI's shape."""
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, e.detail)
    return error(ApiError(e.status_code, message, headers=e.headers))


class HostCheck:
    """Refuse a Host header that names another server: a page elsewhere whose name is rebound to this
    address (DNS rebinding) cannot read the answers. A request with no Host (HTTP/1.0) is not a browser's."""

    def __init__(self, app, hosts):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        host = Headers(scope=scope).get("host") if scope["type"] == "http" else None
        try:
            ours = host is None or urlsplit("//" + host).hostname in self.hosts
        except ValueError:  # e.g. an unclosed "["
            ours = False
        if not ours:
            e = ApiError(400, f"the Host header {host!r} names another server; run with --allow_host NAME to accept "
                         "it", param="Host", code="invalid_host")
            return await error(e)(scope, receive, send)
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------
# The server

class Protocol(H11Protocol):
    """uvicorn's h11 connection, with three rules it lacks:
    - a connection beyond --max_connections is closed at once (uvicorn's 503 there comes only with a request:
      idle connections would pile up to the open-files limit, where asyncio spins, CPython issue 151615);
    - a request must arrive whole within --timeout of the connection opening or of the last answer;
    - a client that half-closes after sending its request still gets the answer. So a non-streaming client
      that hangs up is seen only when its answer is written; a streaming one, at the next forward."""

    def connection_made(self, transport):
        super().connection_made(transport)
        self.deadline = None
        if len(self.connections) > self.limit_concurrency:
            transport.close()
        else:
            self.arm()

    def on_response_complete(self):
        super().on_response_complete()
        self.arm()

    def arm(self):
        if self.deadline:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(self.timeout_keep_alive, self.expire)

    def expire(self):
        c = self.cycle
        if c is None or c.more_body or c.response_complete:  # still waiting for (the rest of) a request
            self.transport.close()

    def connection_lost(self, exc):
        if self.deadline:
            self.deadline.cancel()
        super().connection_lost(exc)

    def eof_received(self):
        c = self.cycle
        if c is not None and not c.more_body and not c.response_complete:
            c.keep_alive = False  # answer, then close
            return True  # keep the transport open for writing
        return None


def open_files(n):
    """Raise the soft limit of open files to n if need be, or say that the hard limit is below it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            raise UserError(f"--max_connections needs {n} open files, and this process may open {hard} (ulimit -n)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


class Server(uvicorn.Server):
    """uvicorn with the engine thread, on a socket bound here (a bad --host or --port is one line); engine: a
    ServingEngine. serve_forever() until SIGINT or SIGTERM; or start() and stop() from another thread."""

    def __init__(self, engine, tok, policy, args, name="mars"):
        open_files(args.max_connections + 64)  # each connection holds one; the model and threads a few
        try:
            self.sock = socket.create_server((args.host, args.port), backlog=BACKLOG,
                                             family=socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        except (OSError, OverflowError) as e:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {getattr(e, 'strerror', None) or e}") from None
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.worker = EngineThread(engine, policy, args.max_queue)
        hosts = {host, "localhost", "127.0.0.1", "::1", *(h.lower() for h in args.allow_host)}
        app = Api(self.worker, tok, args.tau, name).app(hosts, args.cors)
        super().__init__(uvicorn.Config(app, http=Protocol, ws="none", lifespan="off", log_config=None,
                                        log_level="error", access_log=False, proxy_headers=False, backlog=BACKLOG,
                                        limit_concurrency=args.max_connections, timeout_keep_alive=args.timeout,
                                        timeout_graceful_shutdown=GRACE + 2))
        self.worker.start()

    async def shutdown(self, sockets=None):
        self.worker.close(GRACE)
        await super().shutdown(sockets)

    def serve_forever(self):
        """Until SIGINT or SIGTERM, which uvicorn raises again once stopped: to handlers that ignore it, so exit 0."""
        ignore = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.run(sockets=[self.sock])
        finally:
            for s, handler in ignore.items():
                signal.signal(s, handler)
        self.worker.join(GRACE)

    def start(self):
        self.thread = threading.Thread(target=self.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.started and self.thread.is_alive():
            time.sleep(0.01)

    def stop(self):
        self.should_exit = True
        self.thread.join()
        self.worker.join(GRACE)
