"""GPUDirect Storage (cuFile through kvikio): read an expert file straight into device memory.

Optional and separate from the mainline. `choose_gds(mode, device)` decides whether the path
can run and says why in words for the start line; `CuFileReader.read_into_device(path, dst)`
is the read. Without a CUDA device, without kvikio, or with kvikio in compatibility mode
(no nvidia-fs driver: it would read through a host bounce buffer, no better than the pool),
the pool path runs. Only the decision is tested on CPU; the read itself needs a GDS machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrt.errors import CheckpointError, StreamrtError


@dataclass(frozen=True)
class GdsChoice:
    active: bool
    why: str  # for the start line: "cuFile on (kvikio 24.12)", "cuFile off (kvikio not installed)"


def choose_gds(mode: str, device, *, import_kvikio=None) -> GdsChoice:
    """`--gds auto|on|off` on `device`. `on` where it cannot run is a one-line error.
    `mode` is RuntimeOptions.gds, checked there; `import_kvikio` is injectable (tests)."""
    if mode == "off":
        return GdsChoice(False, "cuFile off (--gds off)")
    why = None
    if getattr(device, "kind", "cpu") != "cuda":
        why = "no CUDA device"
    else:
        try:
            kvikio = (import_kvikio or _import_kvikio)()
        except ImportError:
            why = "kvikio not installed"
        else:
            try:
                compat = bool(kvikio.defaults.compat_mode())
            except Exception as e:  # a broken install is a fallback, not a crash
                compat, why = True, f"kvikio unusable: {e}"
            if compat and why is None:
                why = "kvikio in compatibility mode: no GPUDirect Storage driver"
            if why is None:
                return GdsChoice(True, f"cuFile on (kvikio {getattr(kvikio, '__version__', '?')})")
    if mode == "on":
        raise StreamrtError(f"--gds on: GPUDirect Storage unavailable ({why}); use --gds auto or off")
    return GdsChoice(False, f"cuFile off ({why})")


def _import_kvikio():
    import kvikio  # noqa: F401  (optional dependency)

    return kvikio


class CuFileReader:
    """Whole-file reads into device tensors with kvikio.CuFile (releases the GIL while reading)."""

    def __init__(self) -> None:
        self._kvikio = _import_kvikio()

    def read_into_device(self, path, dst, nbytes: int) -> int:  # pragma: no cover - needs a GDS machine
        try:
            with self._kvikio.CuFile(str(path), "r") as f:
                got = f.pread(dst[:nbytes], nbytes, 0).get()
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"expert file {path}: cuFile read failed ({e})") from None
        if got != nbytes:
            raise CheckpointError(f"expert file {path}: short read ({got} of {nbytes} bytes: truncated?); "
                                  f"run 'streamrt verify'")
        return got
