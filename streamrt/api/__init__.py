"""The Python API: `load(model, **runtime options) -> Engine`, `Sampling`.

    engine.py    `load`, `Engine` (generate, chat, streaming, close)
    sampling.py  `Sampling`: how tokens are drawn, and how many
    options.py   runtime options from Python keywords, checked and named as the caller wrote them
    session.py   `Session`: the loaded model and runtime that the API, `run` and `selfcheck` drive
"""

from streamrt.api.engine import Engine, load
from streamrt.api.sampling import Sampling

__all__ = ["Engine", "Sampling", "load"]
