"""`tokenizer_config.json` is the user's to edit (docs/CONTRACTS.md, reader.USER_EDITABLE): a
valid edit runs and verifies; a broken one is one line naming the file and the field, exit 2,
from `run`, `verify` and `convert` alike, before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from streamrt.checkpoint.convert import convert
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree
from streamrt.cli.main import main
from streamrt.errors import CheckpointError, StreamrtError
from streamrt.tokenizer import load_tokenizer

CONFIG = "tokenizer_config.json"
SHAPE = 'added_tokens_decoder must be an object of id -> {"content": str, ...}'
ENTRY = "added_tokens_decoder['163590']"


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trees")
    synth("tiny-k3", root / "tree", seed=0, fmt="streamrt", device="cpu", progress=False)
    synth("tiny-k3", root / "release", seed=0, fmt="release", device="cpu", progress=False)
    return {"tree": root / "tree", "release": root / "release"}


def _restoring(root: Path):
    """`root`, with its tokenizer config and manifest put back after the test edits them."""
    saved = {name: (root / name).read_bytes() for name in (CONFIG, "manifest.json") if (root / name).is_file()}
    yield root
    for name, data in saved.items():
        (root / name).write_bytes(data)


@pytest.fixture
def tree(synthesized):
    yield from _restoring(synthesized["tree"])


@pytest.fixture
def release(synthesized):
    yield from _restoring(synthesized["release"])


def _config(root: Path) -> dict:
    return json.loads((root / CONFIG).read_text())


def _open_tokenizer(root: Path):
    """As `run` opens it (api/session.py): the tree's vocabulary and eos id."""
    cfg = open_tree(root).config
    return load_tokenizer(root, cfg.vocab_size, cfg.eos_token_id)


def _with_decoder(decoder) -> Callable[[dict], dict]:
    def edit(cfg: dict) -> dict:
        cfg["added_tokens_decoder"] = decoder
        return cfg
    return edit


def _with_entry(key: str, entry) -> Callable[[dict], dict]:
    def edit(cfg: dict) -> dict:
        cfg["added_tokens_decoder"][key] = entry
        return cfg
    return edit


def _break(root: Path, bad) -> None:
    """bad: raw bytes for the whole file, or an edit of its parsed content."""
    data = bad if isinstance(bad, bytes) else json.dumps(bad(_config(root))).encode()
    (root / CONFIG).write_bytes(data)


BROKEN = {
    "decoder-int": (_with_decoder(5), f"{SHAPE}, got integer"),
    "decoder-string": (_with_decoder("abc"), f"{SHAPE}, got string"),
    "decoder-array": (_with_decoder([1, 2]), f"{SHAPE}, got array"),
    "decoder-null": (_with_decoder(None), f"{SHAPE}, got null"),
    "content-array": (_with_entry("163590", {"content": [1]}), f"{ENTRY}.content must be a string, got array"),
    "content-object": (_with_entry("163590", {"content": {}}), f"{ENTRY}.content must be a string, got object"),
    "content-missing": (_with_entry("163590", {"special": True}), f"{ENTRY}.content must be a string, got nothing"),
    "entry-string": (_with_entry("163590", "[EOT]"), f'{ENTRY} must be an object with a string "content", got string'),
    "key-not-an-id": (_with_entry("abc", {"content": "x"}), "added_tokens_decoder['abc']: the key is not a token id"),
    "deep-nesting": (b"[" * 200_000 + b"]" * 200_000, "tokenizer config: nested more than 64 levels deep"),
    "not-an-object": (b"[]", "tokenizer config: expected a JSON object, got array"),
    "truncated": (b'{"added_tokens_decoder": {', "tokenizer config: invalid JSON at line 1"),
    "not-utf8": (b'{"a": "\xff"}', "tokenizer config: not UTF-8"),
    "key-twice": (b'{"added_tokens_decoder": {}, "added_tokens_decoder": 5}', "appears twice in one object"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_tokenizer_config_is_one_line_naming_file_and_field(tree, case):
    bad, fragment = BROKEN[case]
    _break(tree, bad)
    with pytest.raises(CheckpointError) as exc:
        _open_tokenizer(tree)
    message = str(exc.value)
    assert message.startswith(f"{tree / CONFIG}: ") and fragment in message, message
    assert "\n" not in message and len(message) < 300


def test_an_edited_streamrt_chat_block_and_custom_names_still_load(tree):
    cfg = _config(tree)
    cfg["streamrt_chat"] = {"thinking_effort": None, "multi_turn": False}
    cfg["added_tokens_decoder"]["163600"] = {"content": "<|custom|>", "special": True}
    cfg["added_tokens_decoder"]["7"] = {"content": "outside the specials: ignored"}
    (tree / CONFIG).write_text(json.dumps(cfg, indent=1))
    tok = _open_tokenizer(tree)
    assert tok.special_name(tok.from_k3_id(163600)) == "<|custom|>"
    del cfg["added_tokens_decoder"]  # optional: a tree may name no added tokens
    (tree / CONFIG).write_text(json.dumps(cfg))
    assert _open_tokenizer(tree).special_id("<|open|>") == tok.special_id("<|open|>")


@pytest.mark.parametrize("case", ["decoder-int", "deep-nesting"])
def test_run_with_a_broken_tokenizer_config_exits_2_with_one_line(tree, case):
    bad, fragment = BROKEN[case]
    _break(tree, bad)
    p = subprocess.run([sys.executable, "-m", "streamrt", "run", "--model", str(tree), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"streamrt: {tree / CONFIG}: "), p.stderr
    assert fragment in p.stderr


# ---- verify: the user's edits are not checksum failures, broken edits are reported ----------------


def _verify_cli(capsys, root: Path, *flags: str) -> tuple[int, str, str]:
    rc = main(["verify", "--no-progress", *flags, str(root)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("full", [False, True])
def test_verify_accepts_an_edited_streamrt_chat_block(tree, capsys, full):
    before = (tree / CONFIG).stat().st_size
    cfg = _config(tree)
    cfg["streamrt_chat"] = {"thinking_effort": "low", "multi_turn": False}
    (tree / CONFIG).write_text(json.dumps(cfg))  # compact: the size differs from the manifest's
    assert (tree / CONFIG).stat().st_size != before
    rc, out, err = _verify_cli(capsys, tree, *(["--full"] if full else []))
    assert rc == 0 and "verify: OK" in out and err == "", out + err


BROKEN_PROFILE = {
    "multi-turn-string": (lambda cfg: {**cfg, "streamrt_chat": {"multi_turn": "yes"}},
                          "streamrt_chat.multi_turn must be true or false"),
    "unknown-effort": (lambda cfg: {**cfg, "streamrt_chat": {"thinking_effort": "huge"}},
                       "streamrt_chat.thinking_effort 'huge'"),
}


@pytest.mark.parametrize("case", ["content-array", "deep-nesting", *BROKEN_PROFILE])
def test_verify_reports_a_broken_tokenizer_config(tree, capsys, case):
    bad, fragment = {**BROKEN, **BROKEN_PROFILE}[case]
    _break(tree, bad)
    bad_files, _ = verify_tree(tree, progress=False)
    assert [rel for rel, _ in bad_files] == [CONFIG]
    assert fragment in bad_files[0][1]
    rc, out, err = _verify_cli(capsys, tree)
    assert rc == 1 and err.startswith(f"BAD {tree}/{CONFIG}: ") and err.count("\n") == 1, err


def test_verify_checks_a_tokenizer_config_the_manifest_does_not_list(tree):
    m = json.loads((tree / "manifest.json").read_text())
    del m["files"][CONFIG]  # as in the embedded tree: run reads the file all the same
    (tree / "manifest.json").write_text(json.dumps(m))
    assert verify_tree(tree, progress=False)[0] == []
    _break(tree, BROKEN["decoder-int"][0])
    assert verify_tree(tree, progress=False)[0] == [(CONFIG, f"{SHAPE}, got integer")]


# ---- convert: a broken file is refused before DST is touched -------------------------------------


def test_convert_refuses_a_broken_tokenizer_config_before_writing(release, tmp_path, capsys):
    _break(release, BROKEN["content-array"][0])
    dst = tmp_path / "out"
    assert main(["convert", "--no-progress", str(release), str(dst)]) == 2
    err = capsys.readouterr().err
    assert err == f"streamrt: {release / CONFIG}: {BROKEN['content-array'][1]}\n"
    assert not dst.exists()


def test_convert_refuses_a_broken_streamrt_chat_block_and_keeps_a_previous_dst(release, tmp_path):
    dst = tmp_path / "out"
    convert(release, dst, progress=False)
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    bad, fragment = BROKEN_PROFILE["multi-turn-string"]
    _break(release, bad)
    with pytest.raises(StreamrtError, match=f"tokenizer_config.json: {fragment}"):
        convert(release, dst, progress=False)
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before


def test_convert_refuses_a_broken_tiktoken_model_before_writing(release, tmp_path, capsys):
    model = release / "tiktoken.model"
    good = model.read_bytes()
    try:
        lines = good.splitlines()
        lines[len(lines) // 2] = b"not base64 at all"
        model.write_bytes(b"\n".join(lines) + b"\n")
        dst = tmp_path / "out"
        assert main(["convert", "--no-progress", str(release), str(dst)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"streamrt: {model}: ") and err.count("\n") == 1, err
        assert not dst.exists()
    finally:
        model.write_bytes(good)
