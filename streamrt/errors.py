"""User-facing errors.

Every error a user can cause (a bad file, a wrong flag, an inconsistent checkpoint) is a
`StreamrtError`: the CLI prints its message on one line and exits with its `exit_code`,
never a traceback. Messages name the file, tensor or field at fault.
"""


class StreamrtError(Exception):
    """An error the user can act on; the CLI prints `streamrt: <message>` and exits 2."""

    exit_code = 2


class ConfigError(StreamrtError):
    """A model configuration is invalid or inconsistent; the message names the field path."""


class CheckpointError(StreamrtError):
    """A checkpoint file or tree is missing, truncated, corrupt or disagrees with its config."""


def clip(text: str, limit: int = 160) -> str:
    """A name or value from a file, cut for a one-line message (a file can hold anything)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
