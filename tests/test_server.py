"""server.py: the official openai client against a server on port 0 gets generate's answers (streamed or
not, a tau per request, lossless, 16 clients at once); bad input gets a 4xx and one line of JSON; a full
queue answers 503; a client that hangs up frees its row; the page uses only this server; Ctrl-C stops it;
the load experiment runs over HTTP."""
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import sample
import serve
import server
from conftest import ONE_THREAD, ROOT, run_cli

MAX_NEW = 24


@pytest.fixture(scope="module")
def loaded(tiny_run):
    model, tok = sample.model_from_checkpoint(sample.load_checkpoint(tiny_run / "mars.pt"))
    return model.eval(), tok, sample.load_checkpoint(tiny_run / "mars.pt")["mars"]["B"]


def start(model, tok, B, max_batch=4, max_queue=64, policy=None):
    engine = serve.Engine(model, tok.eot, tok.mask, B, max_batch, MAX_NEW)
    httpd = server.Server(("127.0.0.1", 0), engine, tok, policy or serve.Fixed(0.9), 0.9, max_queue, "mars")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture(scope="module")
def httpd(loaded):
    httpd = start(*loaded)
    yield httpd
    httpd.stop()


@pytest.fixture(scope="module")
def client(httpd):
    return openai.OpenAI(base_url=httpd.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompts(splits):
    return [e["prompt"] for e in splits["test"][:16]]


def expected(loaded, prompt, tau=None, lossless=False):
    model, tok, B = loaded
    g = sample.generate(model, [tok.prompt_ids(prompt)], tok.eot, tok.mask, B=1 if lossless else B,
                        tau=0.9 if tau is None else tau, max_new_tokens=MAX_NEW)[0]
    return tok.decode([t for t in g.tokens if t != tok.eot]), g


def ask(client, prompt, stream=False, **extra):
    """(text, usage, chunks): through the openai client, streamed or not."""
    out = client.chat.completions.create(model="mars", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=MAX_NEW, stream=stream, extra_body=extra)
    if not stream:
        return out.choices[0].message.content, out.usage.model_dump(), None
    chunks, usage = [], None
    for c in out:
        if c.usage:
            usage = c.usage.model_dump()
        elif c.choices and c.choices[0].delta.content is not None:
            chunks.append(c.choices[0].delta.content)
    return "".join(chunks), usage, chunks


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_gets_generate_answers(loaded, client, prompts, stream):
    for prompt in prompts[:3]:
        for extra in ({"tau": 1.0}, {"tau": 0.6}, {}, {"lossless": True}):
            text, usage, chunks = ask(client, prompt, stream, **extra)
            want, g = expected(loaded, prompt, extra.get("tau"), extra.get("lossless", False))
            assert text == want, (prompt, extra)
            if not extra.get("lossless"):  # lossless equals AR's text, in its own number of forwards
                assert usage["forwards"] == g.forwards and usage["completion_tokens"] == len(g.tokens)
                assert usage["tau"] == pytest.approx(extra.get("tau", 0.9))  # the server's default: 0.9
            assert usage["tokens_per_forward"] == pytest.approx(usage["completion_tokens"] / usage["forwards"])
            if stream:  # one event per forward, each the text that forward committed
                assert len(chunks) == usage["forwards"]
                if not extra.get("lossless"):
                    assert chunks == [loaded[1].decode([t for t in c if t != loaded[1].eot]) for c in g.chunks]


def test_sixteen_concurrent_clients(loaded, client, prompts):
    taus = [1.0, 0.9, 0.7, 0.5] * 4
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: ask(client, prompts[i], i % 2 == 1, tau=taus[i]), range(16)))
    for i, (text, usage, _) in enumerate(got):
        want, g = expected(loaded, prompts[i], taus[i])
        assert text == want and usage["forwards"] == g.forwards, i


def post(httpd, body, headers=None, path="/v1/chat/completions"):
    conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=30)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, resp.read().decode()
    conn.close()
    return out


def msg(content):
    return [{"role": "user", "content": content}]


BAD = [  # (body, status, what the message says)
    (b"{not json", 400, "not valid JSON"), (b"[1, 2]", 400, "JSON object"), (b"\xff\xfe", 400, "not valid JSON"),
    ({}, 400, "'messages' is required"), ({"messages": []}, 400, "'messages' must be"),
    ({"messages": "hi"}, 400, "'messages' must be"), ({"messages": [{"role": "user"}]}, 400, "string 'role' and 'content'"),
    ({"messages": [{"role": "system", "content": "be brief"}]}, 400, "prompt is empty"),
    ({"messages": msg("   ")}, 400, "prompt is empty"), ({"messages": msg("nine " * 300)}, 400, "context"),
    ({"messages": msg("hi"), "tau": 0}, 400, "'tau'"), ({"messages": msg("hi"), "tau": 1.5}, 400, "'tau'"),
    ({"messages": msg("hi"), "tau": "0.9"}, 400, "'tau'"), ({"messages": msg("hi"), "tau": True}, 400, "'tau'"),
    ({"messages": msg("hi"), "max_tokens": 0}, 400, "'max_tokens'"), ({"messages": msg("hi"), "max_tokens": 2.5}, 400, "'max_tokens'"),
    ({"messages": msg("hi"), "stream": "yes"}, 400, "'stream'"), ({"messages": msg("hi"), "lossless": 1}, 400, "'lossless'"),
    ({"messages": msg("hi"), "temperature": 0.7}, 400, "greedily"), ({"messages": msg("hi"), "model": 3}, 400, "'model'"),
    ({"messages": msg("hi"), "n": 2}, 400, "'n'"), (b"x" * (server.MAX_BODY + 1), 413, "over the limit"),
]


@pytest.mark.parametrize("body,status,says", BAD, ids=[says for _, _, says in BAD])
def test_bad_input_gets_4xx_and_one_line(httpd, body, status, says):
    got, text = post(httpd, body)
    assert got == status, text
    assert text.endswith("\n") and text.count("\n") == 1 and "Traceback" not in text
    error = json.loads(text)["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_other_bad_requests(httpd, client):
    assert post(httpd, {"messages": msg("hi")}, path="/v1/completions")[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.endheaders()  # no Content-Length
    assert conn.getresponse().status == 411
    with pytest.raises(openai.BadRequestError, match="'tau' must be"):  # what the client's users see
        ask(client, "hi", tau=2.0)
    models = client.models.list().data
    assert [m.id for m in models] == ["mars"]


def slow(model, seconds):
    """The same model, each forward `seconds` slower: long enough to hang up mid-answer or to fill the queue."""
    forward = model.forward
    model.forward = lambda *a, **k: (time.sleep(seconds), forward(*a, **k))[1]


def test_disconnect_mid_stream_frees_the_row(tiny_run, loaded, prompts):
    model, tok = sample.model_from_checkpoint(sample.load_checkpoint(tiny_run / "mars.pt"))
    slow(model.eval(), 0.2)  # ample time to notice the hang-up, even on a busy machine
    lengths = {p: len(expected(loaded, p, 1.0)[1].tokens) for p in prompts[:6]}
    prompt = max(lengths, key=lengths.get)
    assert lengths[prompt] >= 10
    httpd = start(model, tok, loaded[2], max_batch=2)
    try:
        busy = next(p for p in prompts if p != prompt)  # another request keeps the batch going
        other = threading.Thread(target=lambda: post(httpd, {"messages": msg(busy), "tau": 1.0}))
        other.start()
        sock = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=30)
        sock.request("POST", "/v1/chat/completions", json.dumps({"messages": msg(prompt), "tau": 1.0, "stream": True}))
        resp = sock.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        engine = httpd.loop.engine
        job = next(j for j in list(engine.running) if j.prompt == tok.prompt_ids(prompt))
        sock.close()  # hang up mid-answer
        deadline = time.time() + 10
        while job in engine.running and time.time() < deadline:
            time.sleep(0.01)
        assert job.cancelled and job not in engine.running and len(job.tokens) < lengths[prompt]
        other.join(timeout=30)
        assert not engine.running and engine.kv.k.shape[1] == 0  # its cache row is gone too
    finally:
        httpd.stop()


def test_full_queue_answers_503_and_loses_nothing(tiny_run, loaded, prompts):
    model, tok = sample.model_from_checkpoint(sample.load_checkpoint(tiny_run / "mars.pt"))
    slow(model.eval(), 0.02)
    httpd = start(model, tok, loaded[2], max_batch=1, max_queue=2)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: post(httpd, {"messages": msg(p), "tau": 1.0}), prompts[:8]))
    finally:
        httpd.stop()
    statuses = [s for s, _ in got]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 3
    for p, (status, text) in zip(prompts, got):
        if status == 200:  # every accepted request got its own answer
            assert json.loads(text)["choices"][0]["message"]["content"] == expected(loaded, p, 1.0)[0]
        else:
            assert text.count("\n") == 1 and "overloaded" in json.loads(text)["error"]["message"]


def test_adaptive_server_says_the_tau_it_chose(loaded, prompts):
    httpd = start(*loaded, policy=serve.Adaptive(ladder=(0.8, 0.6)))  # light load: the first rung
    try:
        client = openai.OpenAI(base_url=httpd.url + "/v1", api_key="none", max_retries=0, timeout=60)
        text, usage, _ = ask(client, prompts[0])
        assert usage["tau"] == pytest.approx(0.8) and text == expected(loaded, prompts[0], 0.8)[0]
        assert ask(client, prompts[0], tau=1.0)[1]["tau"] == 1.0  # a request's own tau wins
    finally:
        httpd.stop()


def test_page_uses_only_this_server(httpd):
    conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=30)
    conn.request("GET", "/?prompt=hi&taus=1.0,0.9")
    resp = conn.getresponse()
    page = resp.read().decode()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/html")
    assert not re.search(r"(https?:)?//[\w.-]+\.\w", page.replace("http://www.w3.org", ""))  # no other host
    assert not re.search(r"<(script|link|img|iframe)[^>]*(src|href)=", page)  # nothing loaded from a file either
    endpoints = set(re.findall(r"fetch\(\"([^\"]+)\"", page))
    assert endpoints == {"/v1/models", "/v1/chat/completions"}
    assert 'type="range"' in page and "tokens/forward" in page and "tokens/s" in page
    assert len(page.splitlines()) < 500


def test_ctrl_c_stops_the_server(tiny_run):
    proc = subprocess.Popen([sys.executable, "serve.py", "--http", "--port", "0", "--ckpt", str(tiny_run / "mars.pt")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, **ONE_THREAD})
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert url, line + proc.stderr.read()
        conn = http.client.HTTPConnection("127.0.0.1", int(url.group(1)), timeout=30)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


def test_http_load_cli(tiny_run, tmp_path):
    proc = run_cli(["serve.py", "--http_load", "--ckpt", tiny_run / "mars.pt", "--out_dir", tmp_path, "--requests", "40",
                    "--max_batch", "4", "--max_new_tokens", "16"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "serve_http.json").read_text())
    assert result["clock"] == "wall, over HTTP" and "| policy | phase |" in proc.stdout
    assert [(r["policy"], r["phase"]) for r in result["runs"]] == [
        (p, ph) for p in ("tau=1.0", "adaptive") for ph in ("light", "overload", "recovery")]
    assert sum(r["requests"] for r in result["whole_trace"]) == sum(r["requests"] for r in result["runs"]) > 0
    for r in result["runs"] + result["whole_trace"]:
        assert 0 < r["p50_latency"] <= r["p99_latency"] and 0 <= r["accuracy"] <= 1 and r["tokens_per_forward"] >= 1
    by = {(r["policy"], r["phase"]): r for r in result["runs"]}
    assert by[("tau=1.0", "light")]["tokens_per_forward"] == 1.0 and by[("tau=1.0", "light")]["mean_tau"] == 1.0
    assert set(result["goals"]) == {"overload_p99_ratio", "accuracy_points", "light_mean_tau"}
