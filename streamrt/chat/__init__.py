"""Kimi K3 XTML chat frames (spec/MODEL.md §8.2): render, encode, and parse the model's output.

A frame is `<|open|>tag attrs<|sep|> … <|close|>tag<|sep|>`; every message ends with
`<|end_of_msg|>`. Only the markers are special ids. Tag names, attributes and all user, tool
and model text are ordinary tokens, encoded segment by segment the way the reference
encoder splits them (BPE merges never cross a segment boundary, so the split is part of
the format). The rules follow Moonshot's encoding helpers (`encoding.py`, `tokenization.py`, as
carried by NeMo Automodel's `kimi_k3` package); `tests/test_chat_reference.py` spells them out.

The parser is incremental over token ids and total: any id sequence yields events, and a
malformed or truncated frame yields `ParseError` events, never an exception.

    xtml.py           markers, roles, argument types, escaping, tool-declaration framing
    tools.py          tool calls and their arguments both ways; tool results in call order
    render.py         messages -> segments -> ids (`render`, `encode_chat`)
    events.py         what the parser yields
    parser.py         `ChatParser`
    reply.py          events -> messages (`Reply`, `parse_conversation`)
    profile.py        `ChatProfile`: the framing defaults a model's tree states
    messages_file.py  `--messages FILE.json`
"""

from streamrt.chat.events import (ArgumentOpen, ArgumentText, ArgumentValue, CallOpen, ContentText, EndOfMessage,
                                  Event, MessageStart, ParseError, ResponseText, ThinkText, ToolCall)
from streamrt.chat.messages_file import load_messages_file
from streamrt.chat.parser import ChatParser
from streamrt.chat.profile import PROFILE_FILE, PROFILE_KEY, ChatProfile
from streamrt.chat.render import RESPONSE_FORMATS, Segment, encode_chat, encode_segments, render, render_text
from streamrt.chat.reply import Reply, parse_conversation
from streamrt.chat.tools import arg_text, arg_type, typed_value
from streamrt.chat.xtml import (
    ARG_TYPES,
    CLOSE,
    DYNAMIC_TOOLS_HEAD,
    END_OF_MSG,
    OPEN,
    ROLES,
    SEP,
    THINKING_EFFORTS,
    TOOL_DECLARE_HEAD,
    TOOL_DECLARE_TAIL,
    ChatFormatError,
    compact_json,
    escape_attr,
    tool_declare_body,
    unescape_attr,
)

__all__ = [
    "ARG_TYPES", "ArgumentOpen", "ArgumentText", "ArgumentValue", "CallOpen",
    "CLOSE", "DYNAMIC_TOOLS_HEAD", "END_OF_MSG", "OPEN", "PROFILE_FILE", "PROFILE_KEY",
    "RESPONSE_FORMATS", "ROLES", "SEP", "THINKING_EFFORTS", "TOOL_DECLARE_HEAD", "TOOL_DECLARE_TAIL",
    "ChatFormatError", "ChatParser", "ChatProfile", "ContentText", "EndOfMessage", "Event", "MessageStart",
    "ParseError", "Reply", "ResponseText", "Segment", "ThinkText", "ToolCall",
    "arg_text", "arg_type", "compact_json", "encode_chat", "encode_segments", "escape_attr",
    "load_messages_file", "parse_conversation", "render", "render_text", "tool_declare_body",
    "typed_value", "unescape_attr",
]
