"""`streamrt serve`: an OpenAI- and Anthropic-compatible server with continuous batching (flags: streamrt.cli.serve).

    app.py       the FastAPI app: routes, API key, request counts
    routes.py    chat / completions: parse, render, submit, answer (JSON or SSE); the ChatTurn all chat APIs share
    anthropic.py /v1/messages and count_tokens: Anthropic's Messages API (blocks, SSE events, its error shape)
    responses.py /v1/responses: OpenAI's Responses API, stateless (items, SSE events)
    schemas.py   pydantic request and response bodies
    errors.py    OpenAI's error JSON (Anthropic's on /v1/messages)
    replies.py   generated ids -> reasoning, content, tool calls (through streamrt.chat)
    engine.py    continuous batching: rows join and leave the decode batch at step boundaries
    runner.py    the loaded model: prefill and batched decode on the StreamingRuntime
    metrics.py   Prometheus metrics
"""
