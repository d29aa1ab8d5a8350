"""`ChatProfile`: what a model's tree says about its chat framing (`tokenizer_config.json`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from streamrt.chat.xtml import THINKING_EFFORTS, ChatFormatError
from streamrt.errors import clip
from streamrt.jsonio import load_json
from streamrt.tokenizer import TOKENIZER_CONFIG, TOKENIZER_CONFIG_MAX_BYTES

PROFILE_FILE = TOKENIZER_CONFIG
PROFILE_KEY = "streamrt_chat"


@dataclass(frozen=True)
class ChatProfile:
    """The framing defaults a model was trained with, from its tree's `tokenizer_config.json`.

    Without a `streamrt_chat` key (a real K3 tree) they are the reference's: Moonshot's
    `apply_chat_template` renders a `thinking_effort=max` message, and conversations have any
    number of turns. A tree says otherwise with `"streamrt_chat": {"thinking_effort": null,
    "multi_turn": false}` (the embedded model: trained without the message, on one exchange
    per conversation)."""

    thinking_effort: str | None = "max"
    multi_turn: bool = True

    @classmethod
    def from_tree(cls, root: str | Path) -> "ChatProfile":
        path = Path(root) / PROFILE_FILE
        if not path.is_file():
            return cls()
        data = load_json(path, what="tokenizer config", expect=dict, max_bytes=TOKENIZER_CONFIG_MAX_BYTES,
                         error=ChatFormatError)
        spec = data.get(PROFILE_KEY, {})
        if not isinstance(spec, dict):
            raise ChatFormatError(f"{path}: {PROFILE_KEY} must be an object")
        unknown = sorted(set(spec) - {"thinking_effort", "multi_turn"})
        if unknown:
            # a newline would break the one-line error
            key = unknown[0] if unknown[0].isprintable() else repr(unknown[0])
            raise ChatFormatError(
                f"{path}: {PROFILE_KEY}.{clip(key, 60)} is not a known key (thinking_effort, multi_turn)"
            )
        effort = spec.get("thinking_effort", cls.thinking_effort)
        if effort is not None and effort not in THINKING_EFFORTS:
            raise ChatFormatError(
                f"{path}: {PROFILE_KEY}.thinking_effort {effort!r} is not null or one of {', '.join(THINKING_EFFORTS)}"
            )
        multi = spec.get("multi_turn", cls.multi_turn)
        if not isinstance(multi, bool):
            raise ChatFormatError(f"{path}: {PROFILE_KEY}.multi_turn must be true or false")
        return cls(effort, multi)
