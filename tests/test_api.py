"""The Python API (`streamrt.load` -> `Engine`): the same tokens and logits as `streamrt run`,
streaming pieces that join to the whole reply, close / context manager, and bad arguments
refused with a TypeError or ValueError naming them."""

from __future__ import annotations

import json
import pydoc

import pytest

import streamrt
from streamrt.api.engine import Engine
from streamrt.api.session import Session
from streamrt.chat import ChatProfile
from streamrt.cli.main import main
from streamrt.tokenizer import ByteTokenizer

PROMPT = "What is the capital of France?"
N = 40  # enough for the embedded model's short think channel and the first words of its answer


@pytest.fixture(scope="module")
def engine():
    with streamrt.load(device="cpu") as e:
        yield e


def test_greedy_stream_equals_the_cli(engine, capsys):
    """Streamed pieces join to the text `streamrt run --greedy --json` reports, from the same
    logits (the hash covers the prefill and every decode step); a second generation while one
    streams is refused, and the engine serves again once the stream is done."""
    it = engine.generate(PROMPT, max_new_tokens=N, stream=True)
    pieces = [next(it)]
    with pytest.raises(RuntimeError, match="still streaming"):
        engine.generate(PROMPT, max_new_tokens=N)
    pieces += list(it)
    api_hash = engine.stats.logits_hash
    assert all(isinstance(p, str) and p for p in pieces) and len(pieces) > 1

    assert main(["run", "--prompt", PROMPT, "--greedy", "--json", "--max-new-tokens", str(N), "--device", "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert "".join(pieces) == cli["content"] != ""
    assert api_hash == cli["stats"]["logits_hash"]

    whole = engine.generate(PROMPT, max_new_tokens=N, greedy=True)
    assert whole == cli["content"] and engine.stats.logits_hash == api_hash
    message = engine.chat([{"role": "user", "content": PROMPT}], max_new_tokens=N)
    assert message["role"] == "assistant" and message["content"] == cli["content"]
    assert message.get("reasoning_content", "") == cli["thinking"]


def test_seeded_sampling_equals_the_cli(engine, capsys):
    """temperature / top_p / seed reach the sampler as the flags do: the same logits and tokens."""
    text = engine.generate(PROMPT, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    api_hash = engine.stats.logits_hash
    argv = ["run", "--prompt", PROMPT, "--json", "--max-new-tokens", "24", "--temperature", "0.8", "--top-p", "0.9",
            "--seed", "7", "--device", "cpu"]
    assert main(argv) == 0
    cli = json.loads(capsys.readouterr().out)
    assert (text, api_hash) == (cli["content"], cli["stats"]["logits_hash"])
    sampling = streamrt.Sampling(temperature=0.8, top_p=0.9, seed=7)
    assert engine.generate(PROMPT, max_new_tokens=24, sampling=sampling) == text
    assert engine.stats.logits_hash == api_hash


class _Scripted(Session):
    """A session that needs no model: counts closes."""

    name = "scripted"

    def __init__(self):
        self.tokenizer = ByteTokenizer(512)
        self.chat = ChatProfile()
        self.closed = 0

    def tokens(self, ids, sampling):
        yield from ()
        raise AssertionError("not reached in these tests")

    def close(self):
        self.closed += 1


def test_close_and_the_context_manager():
    session = _Scripted()
    with Engine(session) as e:
        assert "scripted" in repr(e)
    assert session.closed == 1 and "closed" in repr(e)
    e.close()  # idempotent
    assert session.closed == 1
    with pytest.raises(RuntimeError, match="closed"):
        e.generate(PROMPT)
    with pytest.raises(RuntimeError, match="closed"):
        e.chat([{"role": "user", "content": PROMPT}])


def test_load_opens_without_loading_weights(tmp_path):
    """load() reads the tree's manifest, config and tokenizer; the weights wait for a generation."""
    with streamrt.load(device="cpu", window=64) as e:
        assert e.name and e._session.runtime is None


@pytest.mark.parametrize("kw, err, names", [
    ({"windw": 3}, TypeError, "'windw'"),
    ({"window": 0}, ValueError, "window must be >= 1"),
    ({"window": "8"}, TypeError, "window must be int"),
    ({"gpu_mem": "lots"}, ValueError, "gpu_mem"),
    ({"copies": "maybe"}, ValueError, "copies"),
    ({"device": "tpu"}, ValueError, "device"),
    ({"backend": "cuda"}, ValueError, "backend"),
    ({"stats_json": "/proc/streamrt-api/stats.json"}, ValueError, "stats_json"),
    ({"prefill_chunk": 0}, ValueError, "prefill_chunk"),
    ({"prefill_chunk": "64"}, TypeError, "prefill_chunk"),
    ({"model": 3}, TypeError, "model must be a path"),
])
def test_bad_load_arguments_name_themselves(kw, err, names):
    with pytest.raises(err, match=names) as e:
        streamrt.load(**kw)
    assert "--" not in str(e.value)  # the keyword as the caller wrote it, not the flag


def test_a_missing_model_directory_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=f"model {tmp_path / 'nope'}: no such directory"):
        streamrt.load(tmp_path / "nope")


@pytest.mark.parametrize("call, err, names", [
    (lambda e: e.generate(""), ValueError, "prompt is empty"),
    (lambda e: e.generate(42), TypeError, "prompt must be a str"),
    (lambda e: e.generate(PROMPT, temprature=0.5), TypeError, "'temprature'"),
    (lambda e: e.generate(PROMPT, top_p=0), ValueError, "top_p"),
    (lambda e: e.generate(PROMPT, max_new_tokens=0), ValueError, "max_new_tokens"),
    (lambda e: e.generate(PROMPT, seed=-1), ValueError, "seed"),
    (lambda e: e.generate(PROMPT, greedy=1), TypeError, "greedy"),
    (lambda e: e.generate(PROMPT, sampling={"temperature": 1}), TypeError, "sampling must be"),
    (lambda e: e.chat("hi"), TypeError, "messages must be"),
    (lambda e: e.chat([{"role": "user", "content": 3}]), ValueError, "messages"),
    (lambda e: e.chat([{"role": "user", "content": "hi"}], tools="get_weather"), TypeError, "tools"),
])
def test_bad_generation_arguments_name_themselves(call, err, names):
    with pytest.raises(err, match=names):
        call(Engine(_Scripted()))


def test_sampling_checks_its_fields():
    s = streamrt.Sampling(temperature=0.7, seed=5)
    assert not s.is_greedy and streamrt.Sampling().is_greedy and streamrt.Sampling(greedy=True).is_greedy
    with pytest.raises(ValueError, match="temperature"):
        streamrt.Sampling(temperature=float("nan"))
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        streamrt.Sampling(max_new_tokens=2.5)


def test_help_shows_the_api():
    text = pydoc.render_doc(streamrt, renderer=pydoc.plaintext)
    for name in ("load(model", "class Engine", "class Sampling", "generate(", "chat("):
        assert name in text, name
    assert set(streamrt.__all__) >= {"load", "Engine", "Sampling"}
    with pytest.raises(AttributeError):
        getattr(streamrt, "no_such_name")
