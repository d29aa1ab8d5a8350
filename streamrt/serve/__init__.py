"""The server behind `streamrt serve`: OpenAI-compatible, continuous batching (flags: streamrt.cli.serve).

    app.py       the FastAPI app: routes, API key, request counts
    routes.py    chat / completions: parse, render, submit, answer (JSON or SSE)
    schemas.py   pydantic request and response bodies
    errors.py    OpenAI's error JSON
    replies.py   generated ids -> reasoning, content, tool calls (through streamrt.chat)
    engine.py    continuous batching: rows join and leave the decode batch at step boundaries
    runner.py    the loaded model: prefill and batched decode on the StreamingRuntime
    metrics.py   Prometheus metrics
"""
