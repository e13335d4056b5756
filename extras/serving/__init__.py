"""Serving: the continuous-batching scheduler and its tau policies (scheduler.py), the OpenAI-compatible
HTTP server and its page (server.py, web/), the load experiment's command (serve.py), its HTTP clients
(load_http.py) and report. May import the root (checkpoint.py), the engine and bench; server.py and
load_http.py import scheduler.py, never serve.py.
"""
