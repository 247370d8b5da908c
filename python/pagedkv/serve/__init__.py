"""``pagedkv serve``: an OpenAI-compatible HTTP server over :class:`~pagedkv.AsyncLLM`.

Layout (who owns what):

* :mod:`.protocol` — the request models (pydantic) and OpenAI's error body;
* :mod:`.app` — the FastAPI app (routes, error mapping, SSE streaming) and :func:`.app.serve`;
* :mod:`.request_metrics` — request-level Prometheus signals (TTFT, inter-token latency, ...);
* :mod:`.bench` — ``pagedkv bench serve``, the client-side serving benchmark.

Needs the ``pagedkv[serve]`` extra (FastAPI, uvicorn, prometheus_client); nothing here is imported
by ``import pagedkv``.
"""
