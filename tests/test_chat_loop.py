"""`streamrt run --chat`: turn 2 on the embedded model, Ctrl-C during a reply."""

import io
import json

import pytest

from streamrt.cli import run as run_cmd
from streamrt.chat import ChatProfile, encode_segments, render
from streamrt.cli.main import main
from streamrt.cli.run import GenStats, Session
from streamrt.tokenizer import ByteTokenizer

TOK = ByteTokenizer(512)
END = "<|close|>message<|sep|><|end_of_msg|>"


def _reply_ids(content):
    full = render([{"role": "assistant", "content": content}], add_generation_prompt=False)
    return encode_segments(TOK, full[len(render([])) :])


class FakeSession(Session):
    """Scripted replies; a reply given as an exception raises it after its first few tokens."""

    name = "fake"

    def __init__(self, replies, chat=ChatProfile()):
        self.tokenizer, self.chat = TOK, chat
        self.replies, self.prompts = list(replies), []

    def generate(self, ids, sampling, on_token):
        self.prompts.append(TOK.decode(ids))
        out = self.replies.pop(0)
        if isinstance(out, BaseException):
            for t in _reply_ids("Half a reply")[:21]:  # through "Half"
                on_token(t)
            raise out
        for t in out:
            on_token(t)
        return GenStats(len(ids), len(out), 0.01, 0.5, "stop", {})


@pytest.fixture
def chat(monkeypatch, tmp_path):
    """Run `streamrt run --chat` on a fake session with the given stdin lines."""
    (tmp_path / "manifest.json").write_text("{}")

    def go(session, lines, *flags):
        monkeypatch.setattr(run_cmd, "open_session", lambda model_dir, args, progress: session)
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
        return main(["run", "--model", str(tmp_path), "--chat", *flags])

    return go


def test_ctrl_c_during_a_reply_ends_the_reply_not_the_session(chat, capsys):
    session = FakeSession([KeyboardInterrupt(), _reply_ids("Oslo.")])
    assert chat(session, ["Capital of Norway, at length?", "Capital of Norway?"]) == 0
    out, err = capsys.readouterr()
    assert out == "Half\nOslo.\n"  # the cut reply's line was ended before the next one
    assert "streamrt: reply interrupted" in err and "streamrt: interrupted" not in err
    # The unanswered question left the history: the next turn is framed without it.
    assert session.prompts[1] == (
        '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think '
        "in your thinking channel (not including the response channel), supported values include `low`, `medium`, "
        "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`." + END
        + '<|open|>message role="user"<|sep|>Capital of Norway?' + END
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


def test_a_single_exchange_model_frames_each_line_on_its_own(chat, capsys):
    session = FakeSession([_reply_ids("Madrid."), _reply_ids("Cairo.")], ChatProfile(None, multi_turn=False))
    assert chat(session, ["Capital of Spain?", "Capital of Egypt?"], "--json") == 0
    assert [json.loads(line)["content"] for line in capsys.readouterr().out.splitlines()] == ["Madrid.", "Cairo."]
    assert session.prompts[1] == (
        '<|open|>message role="user"<|sep|>Capital of Egypt?' + END
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


@pytest.mark.slow
def test_embedded_model_answers_the_second_question_not_the_first(monkeypatch, capsys):
    # Before the fix turn 2 was framed after turn 1 and the model answered "...Spain is Madrid."
    lines = "What is the capital of Spain?\nWhat is the capital of Egypt?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["run", "--chat", "--json", "--max-new-tokens", "96"]) == 0
    replies = [json.loads(line)["content"] for line in capsys.readouterr().out.splitlines()]
    assert replies == ["The capital of Spain is Madrid.", "The capital of Egypt is Cairo."]
