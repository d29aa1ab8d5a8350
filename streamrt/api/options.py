"""Runtime options from Python keywords: `load(model, window=..., gpu_mem="40G", ...)` takes the
fields of `RuntimeOptions` (each the value its flag takes, or the parsed value), checked here so a
bad one is a TypeError or ValueError naming the keyword, not the flag."""

from __future__ import annotations

import re
from dataclasses import fields

from streamrt.errors import StreamrtError
from streamrt.runtime.options import RuntimeOptions, flag_name

# a field's annotation -> the Python types its parsed value may have
_TYPES = {"int | None": (int, type(None)), "int": (int,), "str": (str,), "str | None": (str, type(None)),
          "bool": (bool,)}


def option_names() -> list[str]:
    return [f.name for f in fields(RuntimeOptions)]


def runtime_options(**kw) -> RuntimeOptions:
    """RuntimeOptions from keywords: unknown names are a TypeError; values go through the field's
    flag parser (so gpu_mem="40G" and copies="sync" work as on the command line) and are then
    type-checked; a value out of range is a ValueError naming the keyword."""
    known = {f.name: f for f in fields(RuntimeOptions)}
    for name in kw:
        if name not in known:
            raise TypeError(f"unknown runtime option {name!r}; the options are: {', '.join(known)}")
    values = {}
    try:
        for name, value in kw.items():
            parse = known[name].metadata["flag"].parse
            values[name] = parse(value) if parse is not None and value is not None else value
    except StreamrtError as e:
        raise ValueError(_keyword_message(str(e))) from None
    for name, value in values.items():
        types = _TYPES.get(str(known[name].type), (object,))
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}"[:200])
    try:
        options = RuntimeOptions(**values).check_output_paths()
        check_device(options.device)
    except StreamrtError as e:
        raise ValueError(_keyword_message(str(e))) from None
    return options


def _keyword_message(message: str) -> str:
    """A runtime-option message as the Python caller wrote it: `--gpu-mem` reads `gpu_mem`."""
    for f in fields(RuntimeOptions):
        message = re.sub(re.escape(flag_name(f)) + r"\b", f.name, message)
    return message


def check_device(name: str) -> None:
    """--device: auto, cpu, cuda or cuda:N, and a CUDA one only where torch sees CUDA. Checked
    here because `--gpus N` ranks fall back to the CPU without CUDA: an explicit cuda would be
    ignored there, and `cuda:x` is a ValueError deep in the load."""
    text = str(name)
    if text in ("auto", "cpu"):
        return
    if text != "cuda" and not re.fullmatch(r"cuda:[0-9]{1,4}", text):
        raise StreamrtError(f"--device: expected auto, cpu, cuda or cuda:N, got {text[:40]!r}")
    import torch

    if not torch.cuda.is_available():
        raise StreamrtError(f"--device {text}: no CUDA device is available (torch.cuda.is_available() is False)")
    index = int(text.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise StreamrtError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
