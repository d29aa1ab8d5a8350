"""streamrt: run KimiLinear MoE models (Kimi K3, K3.1 Pro) on one GPU by streaming routed experts.

Python API (the command line, `streamrt run` / `serve`, drives the same engine):

    import streamrt

    with streamrt.load() as engine:               # the small embedded model; or load("path/to/tree")
        print(engine.generate("What is the capital of France?", max_new_tokens=64))
        for piece in engine.generate("Count to five.", stream=True, temperature=0.7, seed=1):
            print(piece, end="", flush=True)
        reply = engine.chat([{"role": "user", "content": "Hi!"}])   # an OpenAI-style message

load(model=None, **runtime options) -> Engine
    `model`: a converted streamrt tree (`streamrt convert`), None for the embedded model. The
    keywords are `streamrt run`'s runtime flags by their Python names: device="cuda",
    backend="nvrtc", gpu_mem="40G", host_mem="96G", window=..., gpu_experts=..., trace="t.json"...
Engine.generate(prompt, max_new_tokens=None, *, system=None, thinking=True, stream=False, **sampling)
    The reply text to one user message (as `streamrt run --prompt` prints it); stream=True yields
    pieces. Sampling keywords: greedy, temperature (default 0: greedy), top_p, seed, ignore_eos,
    or sampling=Sampling(...).
Engine.chat(messages, tools=None, max_new_tokens=None, *, stream=False, **sampling)
    The assistant message (content, reasoning_content, tool_calls); stream=True yields events.
Engine.close(), or use the engine as a context manager.

A bad argument is a TypeError or ValueError naming it; a bad model tree is a StreamrtError.
"""

__version__ = "0.1.0"
__all__ = ["Engine", "Sampling", "load", "__version__"]

_API = {"Engine": "streamrt.api.engine", "load": "streamrt.api.engine", "Sampling": "streamrt.api.sampling"}


def __getattr__(name: str):
    # Imported on first use: `import streamrt` (the CLI's version string, a config read) stays light.
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'streamrt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
