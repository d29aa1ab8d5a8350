"""The XTML vocabulary (spec/MODEL.md §8.2): markers, roles, argument types, attribute
escaping, the tool-declaration framing, and `ChatFormatError`: what the renderer and the
parser share."""

from __future__ import annotations

import json
import re
from typing import Any

from streamrt.errors import StreamrtError

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")
THINKING_EFFORTS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(StreamrtError):
    """Messages or tools that cannot be rendered (bad role, content, arguments, file)."""



def escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


_UNESCAPE = re.compile(r"&(amp|quot);")


def unescape_attr(value: str) -> str:
    # One pass, so "&amp;quot;" comes back as "&quot;" and not as '"'.
    return _UNESCAPE.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)



def compact_json(value: Any) -> str:
    """Compact, key-sorted JSON: the tool-declaration body."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)



TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
TOOL_DECLARE_TAIL = "\n```"


# A system message carrying `tools` extends the toolset mid-conversation (the reference's
# "dynamic" declaration); its content, if any, is not rendered.
DYNAMIC_TOOLS_HEAD = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
)


def tool_declare_body(tools: list, *, dynamic: bool = False) -> str:
    return f"{DYNAMIC_TOOLS_HEAD if dynamic else TOOL_DECLARE_HEAD}{compact_json(tools)}{TOOL_DECLARE_TAIL}"

