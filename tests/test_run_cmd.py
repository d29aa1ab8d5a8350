"""`streamrt run`: flag and model-dir errors are one line with exit 2; streaming, JSON and chat
output over a scripted session (the runtime's own generate is tested with the model)."""

import json

import pytest

from streamrt import default_model
from streamrt.cli import run as run_cmd
from streamrt.chat import encode_segments, render
from streamrt.cli.main import main
from streamrt.cli.run import GenStats, Session
from streamrt.tokenizer import ByteTokenizer


def _one_line_error(capsys, argv, fragment):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("streamrt: "), err
    assert fragment in err, err


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--max-new-tokens", "ten"], "--max-new-tokens must be an integer"),
        (["--top-p", "2"], "--top-p must be in (0, 1], got 2"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--temperature", "nan"], "--temperature must be finite"),
        (["--seed", "-3"], "--seed must be >= 0"),
        (["--window", "0"], "--window must be >= 1"),
        (["--host-mem", "lots"], "--host-mem: expected a size"),
    ],
)
def test_bad_flag_values_are_one_line_exit_2(capsys, flags, fragment):
    _one_line_error(capsys, ["run", "--prompt", "hi", *flags], fragment)


def test_bad_model_dirs_are_one_line_exit_2(capsys, tmp_path):
    _one_line_error(capsys, ["run", "--prompt", "hi", "--model", str(tmp_path / "nope")], "no such directory")
    (tmp_path / "file").write_text("x")
    _one_line_error(capsys, ["run", "--prompt", "hi", "--model", str(tmp_path / "file")], "not a directory")
    _one_line_error(capsys, ["run", "--prompt", "hi", "--model", str(tmp_path)], "no manifest.json")
    (tmp_path / "config.json").write_text("{}")
    _one_line_error(capsys, ["run", "--prompt", "hi", "--model", str(tmp_path)], "streamrt convert")


def test_missing_input_and_bad_messages_file_are_one_line_exit_2(capsys, tmp_path):
    _one_line_error(capsys, ["run"], "give --prompt TEXT, --chat or --messages")
    _one_line_error(capsys, ["run", "--messages", str(tmp_path / "m.json")], "no such messages file")
    (tmp_path / "m.json").write_text(json.dumps([{"role": "user", "content": 3}]))
    _one_line_error(capsys, ["run", "--messages", str(tmp_path / "m.json")],
                    "messages[0].content: Input should be a valid string")


def test_selfcheck_bad_cycles_is_one_line_exit_2(capsys):
    _one_line_error(capsys, ["selfcheck", "--cycles", "0"], "--cycles must be >= 1")


# ---- a scripted session: the model's output is fixed, everything around it is real ---------------

TOK = ByteTokenizer(512)


def _reply_ids(msg, thinking=True):
    full = render([msg], add_generation_prompt=False, thinking=thinking)
    return encode_segments(TOK, full[len(render([], thinking=thinking)) :])


class ScriptedSession(Session):
    name = "scripted"

    def __init__(self, replies):
        self.tokenizer = TOK
        self.replies = list(replies)
        self.prompts = []

    def generate(self, ids, sampling, on_token):
        self.prompts.append(list(ids))
        out = self.replies.pop(0)[: sampling.max_new_tokens]
        for t in out:
            on_token(t)
        stop = "stop" if out and out[-1] in TOK.stop_ids else "length"
        return GenStats(len(ids), len(out), 0.01, 0.5, stop, {"device": 0.25, "host": 1.0})


WEATHER = {
    "role": "assistant",
    "reasoning_content": "Use the tool.",
    "content": "Let me check.",
    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    holder = {}

    def open_session(model_dir, args, *, progress):
        holder["dir"] = model_dir
        return holder["session"]

    monkeypatch.setattr(run_cmd, "open_session", open_session)
    return holder, tmp_path


def test_prompt_streams_answer_tool_call_json_and_stats(scripted, capsys):
    holder, tree = scripted
    holder["session"] = ScriptedSession([_reply_ids(WEATHER)])
    assert main(["run", "--model", str(tree), "--prompt", "Weather in Paris?"]) == 0
    out, err = capsys.readouterr()
    # the id the server gives the same call (functions.NAME:IDX, IDX from 0 over the conversation)
    assert out == ('Let me check.\n{"tool_call": {"id": "functions.get_weather:0", "name": "get_weather", '
                   '"arguments": {"city": "Paris"}}}\n')
    assert "Use the tool" not in out
    assert "tok/s decode" in err and "device 25.0%" in err
    prompt = TOK.decode(holder["session"].prompts[0])
    assert prompt.endswith('<|open|>message role="user"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
                           '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_show_thinking_and_a_reply_cut_at_the_token_limit(scripted, capsys):
    holder, tree = scripted
    holder["session"] = ScriptedSession([_reply_ids(WEATHER)])
    assert main(["run", "--model", str(tree), "--prompt", "x", "--show-thinking", "--max-new-tokens", "60"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("<think>\nUse the tool.\n</think>\nLet me check.")
    assert "reply cut at --max-new-tokens 60" in err and "malformed" not in err


def test_malformed_model_output_is_reported_once_on_stderr(scripted, capsys):
    holder, tree = scripted
    sep, eom = TOK.special_id("<|sep|>"), TOK.eos_id
    holder["session"] = ScriptedSession([TOK.encode("hm") + [sep, sep] + TOK.encode("ok") + [eom]])
    assert main(["run", "--model", str(tree), "--prompt", "x", "--show-thinking"]) == 0
    out, err = capsys.readouterr()
    assert out == "<think>\nhmok\n</think>\n"
    assert "3 malformed frame(s) in the model output (first: unexpected special token <|sep|>)" in err


def test_json_output_is_one_parseable_object(scripted, capsys):
    holder, tree = scripted
    holder["session"] = ScriptedSession([_reply_ids(WEATHER)])
    assert main(["run", "--model", str(tree), "--prompt", "x", "--json", "--greedy"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["tool_calls"] == [{"id": "functions.get_weather:0", "name": "get_weather",
                                   "arguments": {"city": "Paris"}}]
    assert data["thinking"] == "Use the tool." and data["content"] == "Let me check."
    assert data["finish_reason"] == "tool_calls" and data["parse_errors"] == []
    assert data["stats"]["new_tokens"] > 0 and data["stats"]["decode_tok_s"] > 0


def test_messages_file_with_tools_frames_the_declaration(scripted, capsys, tmp_path):
    holder, tree = scripted
    holder["session"] = ScriptedSession([_reply_ids({"role": "assistant", "content": "ok"}, thinking=False)])
    f = tmp_path / "conv.json"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools}))
    assert main(["run", "--model", str(tree), "--messages", str(f), "--no-thinking"]) == 0
    prompt = TOK.decode(holder["session"].prompts[0])
    assert prompt.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools')
    assert prompt.endswith("<|open|>response<|sep|>")
    assert capsys.readouterr().out == "ok\n"


def test_chat_keeps_history_and_reset_clears_it(scripted, capsys, monkeypatch):
    import io

    holder, tree = scripted
    replies = [_reply_ids({"role": "assistant", "content": a}) for a in ("Paris.", "Lyon.", "Nice.")]
    holder["session"] = ScriptedSession(replies)
    monkeypatch.setattr("sys.stdin", io.StringIO("capital of France?\n\nand the second city?\n/reset\nthird?\n"))
    assert main(["run", "--model", str(tree), "--chat", "--json"]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["content"] for t in turns] == ["Paris.", "Lyon.", "Nice."]
    second, third = (TOK.decode(p) for p in holder["session"].prompts[1:])
    assert "capital of France?" in second and "Paris." in second and "and the second city?" in second
    assert "capital of France?" not in third and "third?" in third


def test_default_model_is_built_once_into_the_cache_with_a_notice(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMRT_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "packaged_model_dir", lambda: None)
    built = []

    def fake_build(target):
        built.append(target)
        target.mkdir(parents=True)
        (target / "manifest.json").write_text("{}")

    monkeypatch.setattr(default_model, "build_synthetic_tree", fake_build)
    notices = []
    first = default_model.default_model_dir(notices.append)
    second = default_model.default_model_dir(notices.append)
    assert first == second and first.is_relative_to(tmp_path) and built == [first]
    assert len(notices) == 1 and "tiny-k3.1-pro" in notices[0] and "\n" not in notices[0]


# ---- the real model: a synthetic tiny-k3.1-pro tree -------------------------------------------


@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory):
    synth = pytest.importorskip("streamrt.checkpoint.synth")
    pytest.importorskip("streamrt.checkpoint.reader")
    tree = tmp_path_factory.mktemp("tiny") / "tree"
    synth.synth("tiny-k3.1-pro", tree, seed=0, fmt="streamrt", device="cpu", progress=False)
    return tree


def test_inconsistent_variant_is_one_line_exit_2(capsys, tiny_tree, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_tree, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["text_config"]["dsa_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    _one_line_error(capsys, ["run", "--model", str(bad), "--prompt", "hi"], "dsa_config missing")


def test_run_on_tiny_streams_json_with_rates(capsys, tiny_tree):
    argv = ["run", "--model", str(tiny_tree), "--prompt", "hi", "--json", "--greedy", "--max-new-tokens", "3",
            "--device", "cpu"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert 1 <= data["stats"]["new_tokens"] <= 3 and data["stats"]["prompt_tokens"] > 10
    assert set(data["stats"]["hits"]) <= {"device", "host"} and data["stats"]["hits"]
    assert data["finish_reason"] in ("stop", "length", "tool_calls")


def test_ignore_eos_generates_every_requested_token(capsys):
    """The embedded model ends this greedy reply with its end-of-turn token well inside 80
    tokens; --ignore-eos keeps going to the limit (finish_reason "length")."""
    argv = ["run", "--prompt", "Tell me a story about a dragon.", "--json", "--greedy", "--max-new-tokens", "80",
            "--device", "cpu"]
    assert main(argv) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert main(argv + ["--ignore-eos"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert stopped["finish_reason"] == "stop" and stopped["stats"]["new_tokens"] < 80, stopped
    assert full["finish_reason"] == "length" and full["stats"]["new_tokens"] == 80, full


def test_tool_call_ids_count_the_conversations_calls_as_the_server_does(scripted, capsys, tmp_path):
    from streamrt.chat.tools import prior_calls as server_prior_calls

    holder, tree = scripted
    holder["session"] = ScriptedSession([_reply_ids(WEATHER)])
    earlier = {"id": "functions.get_weather:0", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [earlier]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
                {"role": "user", "content": "And in Paris?"}]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(messages))
    assert main(["run", "--model", str(tree), "--messages", str(path)]) == 0
    out = capsys.readouterr().out
    n = server_prior_calls(messages)
    assert n == 1 and f'"id": "functions.get_weather:{n}"' in out, out


@pytest.mark.parametrize("as_json", [False, True])
def test_a_reply_the_context_ends_says_so(scripted, capsys, as_json):
    """The session stops at the model's context ("length" with fewer tokens than asked): the
    reply says why it ended, not silently, and not as if --max-new-tokens had cut it."""
    holder, tree = scripted
    cut = _reply_ids(WEATHER)[:7]  # mid-reply, as a context limit cuts it
    holder["session"] = ScriptedSession([cut])
    argv = ["run", "--model", str(tree), "--prompt", "x"] + (["--json"] if as_json else [])
    assert main(argv) == 0
    out, err = capsys.readouterr()
    prompt = len(holder["session"].prompts[0])
    assert f"reply cut at the model's context: prompt {prompt} + reply 7 tokens" in err, err
    assert "--max-new-tokens" not in err
    if as_json:
        assert json.loads(out)["finish_reason"] == "length"
