"""What a user types or a disk holds is decoded and validated at
the edge (one line, exit 2, never a traceback), and output paths are checked before any work
starts and written atomically."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from streamrt.cli import run as run_cmd
from streamrt import fileio, output_paths
from streamrt.checkpoint.reader import open_tree, read_manifest
from streamrt.cli.main import main
from streamrt.errors import CheckpointError, ConfigError, StreamrtError
from streamrt.jsonio import json_depth, load_json
from streamrt.runtime.stats import write_stats_json
from streamrt.tokenizer import ByteTokenizer

DEEP = "[" * 1000 + "]" * 1000



def expect_project_error(case: str, fn, *args, **kwargs) -> StreamrtError:
    try:
        fn(*args, **kwargs)
    except StreamrtError as e:
        assert "\n" not in str(e), str(e)
        return e
    pytest.fail(f"{case}: no error raised")


def _one_line_error(capsys, argv, fragment, rc=2):
    got = main(argv)
    out, err = capsys.readouterr()
    assert got == rc, out + err
    assert err.count("\n") == 1 and err.startswith("streamrt: "), err
    assert fragment in err, err
    return err


@pytest.fixture
def tree(default_model_copy) -> Path:
    return default_model_copy  # conftest.py


@pytest.fixture
def no_session(monkeypatch):
    """Fail the test if a model would be loaded: these errors must come before any work."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(run_cmd, "open_session", refuse)


# ---- the JSON helper ---------------------------------------------------------------------


def test_load_json_one_line_errors_for_every_kind_of_bad_bytes(tmp_path):
    cases = {
        b"[" * 1000 + b"]" * 1000: "nested more than 64 levels deep",
        b"[" * 200000: "nested more than 64 levels deep",
        b'{"a": "\xff"}': "not UTF-8 (byte 0xff at offset 7)",
        b'{"a": NaN}': "non-standard JSON constant NaN",
        b"1" * 5000: "invalid JSON",
        b'{"a": 1,}': "invalid JSON at line 1 column 9",
        b"[1, 2]": "expected a JSON object, got array",
    }
    for raw, fragment in cases.items():
        with pytest.raises(CheckpointError, match="^f.json: thing: ") as e:
            load_json(raw, what="thing", name="f.json", expect=dict)
        assert fragment in str(e.value) and "\n" not in str(e.value)
    f = tmp_path / "big.json"
    f.write_bytes(b"[" + b"0," * 1000 + b"0]")
    with pytest.raises(ConfigError, match="over the 100-byte limit"):
        load_json(f, what="config", max_bytes=100, error=ConfigError)
    with pytest.raises(CheckpointError, match="cannot read manifest"):
        load_json(tmp_path / "missing.json", what="manifest")
    assert load_json(b'\xef\xbb\xbf{"a": [1, {"b": "[[["}]}', what="x") == {"a": [1, {"b": "[[["}]}


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a[[[": [[1]], "b\\"[": {}}') == 3
    assert json_depth(b'"\\\\" [[]]') == 2
    assert json_depth(b"[" * 10_000, limit=64) > 64


# ---- finding 3: typed input --------------------------------------------------------------


def test_non_utf8_prompt_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "streamrt", "run", "--prompt", b"caf\xe9 ol\xe9"],
                       capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert "--prompt: not valid UTF-8 (byte 0xe9 at position 3)" in err


def test_non_utf8_system_is_one_line_exit_2(capsys, no_session):
    _one_line_error(capsys, ["run", "--prompt", "hi", "--system", "ol\udce9"], "--system: not valid UTF-8 (byte 0xe9")


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--prompt", "hi", "--seed", str(2**70)],
     "--seed must be at most 17592186044415, got 1180591620717411303424"),
    (["run", "--prompt", "hi", "--seed", "9" * 5000], "--seed must be an integer of at most 40 characters"),
    (["run", "--prompt", "hi", "--max-new-tokens", str(10**9)], "--max-new-tokens must be at most 1048576"),
    (["run", "--prompt", "hi", "--gpu-experts", str(10**12)], "--gpu-experts must be at most 1048576"),
    (["run", "--prompt", "hi", "--window", str(2**40)], "--window must be at most 16777216"),
    (["run", "--prompt", "hi", "--stage-depth", str(2**40)], "--stage-depth must be at most 65536"),
    (["run", "--prompt", "hi", "--host-mem", "9" * 400], "--host-mem: expected a size"),
    (["run", "--prompt", "hi", "--gpu-mem", "4096TiB"], "--gpu-mem: at most 1125899906842624 bytes (1 PiB)"),
    (["selfcheck", "--cycles", str(10**9)], "--cycles must be at most 1000"),
])
def test_integers_range_checked_at_the_edge(capsys, no_session, argv, fragment):
    _one_line_error(capsys, argv, fragment)


def test_verify_workers_out_of_range(capsys, tree):
    _one_line_error(capsys, ["verify", str(tree), "--workers", "-1"], "--workers must be between 1 and 1024, got -1")
    _one_line_error(capsys, ["verify", str(tree), "--workers", "0"], "--workers must be between 1 and 1024, got 0")


def test_convert_and_synth_workers_out_of_range(capsys, tmp_path):
    _one_line_error(capsys, ["convert", str(tmp_path), str(tmp_path / "o"), "--workers", "-1"],
                    "--workers must be between 1")
    _one_line_error(capsys, ["synth", "--config", "tiny-k3", "--out", str(tmp_path / "s"), "--workers", "0"],
                    "--workers must be between 1")


def test_read_only_dst_is_one_line(capsys, tmp_path):
    # /proc takes no new files even for root (chmod does not stop root)
    _one_line_error(capsys, ["convert", str(tmp_path), "/proc/streamrt-test-dst"], "cannot write in its parent /proc")
    (tmp_path / "f").write_text("x")
    _one_line_error(capsys, ["convert", str(tmp_path), str(tmp_path / "f")], "DST exists and is not a directory")


class _Session(run_cmd.Session):
    name = "scripted"

    def __init__(self):
        self.tokenizer = ByteTokenizer(512)


def test_non_utf8_chat_line_is_rejected_and_the_session_goes_on(monkeypatch, capsys):
    seen = []

    def one_reply(session, ids, sampling, thinking, printer):
        from streamrt.chat import Reply

        seen.append(ids)
        return Reply(), run_cmd.GenStats()

    monkeypatch.setattr(run_cmd, "_one_reply", one_reply)
    monkeypatch.setattr(run_cmd, "encode_chat", lambda tok, history, *a, **k: [m["content"] for m in history])
    stdin = io.TextIOWrapper(io.BytesIO(b"first\n\xff\xfe bad\nsecond\n"), encoding="utf-8")
    args = type("A", (), {"json": True, "show_thinking": False})()
    sampling = run_cmd.Sampling(4, 0.0, 1.0, 0, True)
    assert run_cmd._chat_loop(_Session(), [], sampling, True, args, stdin) == 0
    err = capsys.readouterr().err
    assert "streamrt: chat input not valid UTF-8 (byte 0xff at offset 0); line ignored" in err
    assert [ids[0::2] for ids in seen] == [["first"], ["first", "second"]]  # the history survived the bad line


def test_read_user_line_text_streams_with_surrogates():
    assert isinstance(run_cmd.read_user_line(io.StringIO("ok\udcff\n")), StreamrtError)
    assert run_cmd.read_user_line(io.StringIO("ok\n")) == "ok\n"
    assert run_cmd.read_user_line(io.StringIO("")) is None


# ---- finding 3: what a disk holds ------------------------------------------------------------


def _manifest(tree: Path) -> dict:
    return json.loads((tree / "manifest.json").read_text())


def _put(tree: Path, m) -> None:
    (tree / "manifest.json").write_text(json.dumps(m))


def test_manifest_checksum_that_is_a_number(tree, capsys):
    m = _manifest(tree)
    m["checksum"] = 64
    _put(tree, m)
    e = expect_project_error("manifest-checksum-number", open_tree, tree)
    assert "unknown checksum rule 64" in str(e)
    m["checksum"] = "blake2b64-tree-64MiB"
    m["files"]["config.json"]["blake2b"] = 12345
    _put(tree, m)
    e = expect_project_error("manifest-file-checksum-number", open_tree, tree)
    assert "files['config.json'].blake2b is 12345, not 16 hex digits" in str(e)
    _one_line_error(capsys, ["verify", str(tree)], "not 16 hex digits")


def test_bit_flipped_manifest_is_one_line(tree, capsys):
    raw = bytearray((tree / "manifest.json").read_bytes())
    raw[10] |= 0x80  # a continuation byte where ASCII was: invalid UTF-8
    (tree / "manifest.json").write_bytes(bytes(raw))
    e = expect_project_error("manifest-bit-flip", read_manifest, tree)
    assert "manifest: not UTF-8" in str(e)
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "hi"], "manifest: not UTF-8")


def test_manifest_nested_1000_deep_and_wrong_types(tree):
    (tree / "manifest.json").write_text('{"format": "streamrt", "x": ' + DEEP + "}")
    assert "nested more than 16 levels deep" in str(expect_project_error("manifest-nested-1000", read_manifest, tree))
    _put(tree, [1, 2])
    assert "expected a JSON object, got array" in str(expect_project_error("manifest-list", read_manifest, tree))
    m = {"format": "streamrt", "format_version": 2, "checksum": "blake2b64-tree-64MiB", "files": {"a": [1]},
         "tensor_names": [], "geometry": {}}
    _put(tree, m)
    assert "files['a'] is a JSON array" in str(expect_project_error("manifest-entry-list", read_manifest, tree))
    m["files"] = {"../../etc/passwd": {"size": 1, "blake2b": "0" * 16}}
    _put(tree, m)
    assert "not a path inside the tree" in str(expect_project_error("manifest-escape", read_manifest, tree))


def test_release_index_that_is_a_list(tmp_path):
    from streamrt.checkpoint.release import open_release

    root = tmp_path / "rel"
    root.mkdir()
    shutil.copy(Path(__file__).parents[1] / "streamrt" / "configs" / "tiny-k3.json", root / "config.json")
    (root / "model.safetensors.index.json").write_text("[1, 2, 3]")
    expect_project_error("release-index-list", open_release, root)


def test_config_json_nested_1000_deep(tmp_path):
    from streamrt.config import load_config

    f = tmp_path / "config.json"
    f.write_text('{"text_config": ' + DEEP + "}")
    expect_project_error("config-json-nested-1000", load_config, f)


def test_safetensors_header_nested_1000_deep(tmp_path):
    from streamrt.checkpoint.safetensors_io import read_header

    raw = ('{"t": ' + DEEP + "}").encode()
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    expect_project_error("safetensors-header-nested-1000", read_header, f)


# ---- finding 4: output paths -------------------------------------------------------------------


def test_stats_json_directory_fails_before_any_work(capsys, tmp_path, no_session):
    _one_line_error(capsys, ["run", "--prompt", "hi", "--stats-json", str(tmp_path)],
                    f"--stats-json {tmp_path}: is a directory")


def test_trace_unwritable_fails_before_any_work(capsys, tmp_path, no_session):
    _one_line_error(capsys, ["run", "--prompt", "hi", "--trace", "/proc/streamrt-test.json"],
                    "--trace /proc/streamrt-test.json: cannot write in /proc")
    (tmp_path / "file").write_text("x")
    _one_line_error(capsys, ["run", "--prompt", "hi", "--trace", str(tmp_path / "file" / "t.json")],
                    f"{tmp_path / 'file'} is not a directory")
    _one_line_error(capsys, ["selfcheck", "--stats-json", str(tmp_path)], "is a directory")


def test_an_output_in_a_missing_directory_is_refused_and_nothing_made(capsys, tmp_path, no_session):
    """A typo in --trace / --stats-json must not build directories (it made /nonexistent/)."""
    for flag in ("--trace", "--stats-json"):
        path = tmp_path / "a" / "b" / "out.json"
        _one_line_error(capsys, ["run", "--prompt", "hi", flag, str(path)],
                        f"{flag} {path}: directory {path.parent} does not exist")
    _one_line_error(capsys, ["selfcheck", "--trace", str(tmp_path / "a" / "t.json")], "does not exist")
    assert os.listdir(tmp_path) == []  # no directory made, the probe left nothing behind
    p = output_paths.check_output_path(tmp_path / "stats.json", "--stats-json")
    assert p == tmp_path / "stats.json" and os.listdir(tmp_path) == []


def test_stats_and_trace_written_atomically(tmp_path, monkeypatch):
    from streamrt.trace import write_trace

    f = tmp_path / "stats.json"
    write_stats_json(f, {"tokens": 1})
    assert json.loads(f.read_text()) == {"tokens": 1}

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", fail)
    with pytest.raises(CheckpointError, match="stats.json: disk full"):
        write_stats_json(f, {"tokens": 2})
    assert json.loads(f.read_text()) == {"tokens": 1}  # the old file, whole
    with pytest.raises(StreamrtError, match="trace.json: disk full"):
        write_trace(tmp_path / "trace.json", {"traceEvents": []})
    assert sorted(os.listdir(tmp_path)) == ["stats.json"]  # no temp files left


def test_trace_summarize_of_a_deep_or_undecodable_file_is_one_line(capsys, tmp_path):
    f = tmp_path / "t.json"
    f.write_text('{"traceEvents": ' + DEEP + "}")
    _one_line_error(capsys, ["trace", "summarize", str(f)], "nested more than 64 levels deep")
    f.write_bytes(b'{"traceEvents": ["\xff"]}')
    _one_line_error(capsys, ["trace", "summarize", str(f)], "not UTF-8 (byte 0xff at offset 18)")


# ---- adversarial review: usage errors, devices, side files, checks before loading ---------------


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--prompt", "hi", "--window", "abc"],
     "argument --window: invalid int value: 'abc' (see streamrt run --help)"),
    (["run", "--prompt", "hi", "--gpu-experts", "1.5"], "argument --gpu-experts: invalid int value"),
    (["inspect", "tiny-k3", "--gpus", "x"], "argument --gpus: invalid int value"),
    (["nosuch"], "invalid choice: 'nosuch'"),
])
def test_usage_errors_are_one_line(capsys, no_session, argv, fragment):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("streamrt: "), err
    assert fragment in err and "usage:" not in err, err


@pytest.mark.parametrize("device, fragment", [
    ("cuda:x", "--device: expected auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    ("cuda:", "--device: expected auto, cpu, cuda or cuda:N"),
])
def test_malformed_device_is_one_line(capsys, no_session, device, fragment):
    _one_line_error(capsys, ["run", "--prompt", "hi", "--device", device], fragment)


def test_cuda_device_without_cuda_is_refused_with_gpus_too(capsys, no_session, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spawned = []
    monkeypatch.setattr("streamrt.parallel.launch.run_ranks", lambda *a, **k: spawned.append(a) or 0)
    _one_line_error(capsys, ["run", "--prompt", "hi", "--gpus", "2", "--device", "cuda"],
                    "--device cuda: no CUDA device is available")
    assert not spawned  # the ranks used to fall back to the CPU and ignore --device cuda


def test_repeated_bpe_rank_is_one_line_not_a_panic(tmp_path):
    from streamrt.tokenizer import load_tokenizer

    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 1\nYw== 1\n")  # a truncated line's rank
    with pytest.raises(CheckpointError, match=r"tiktoken.model: line 3: rank 1 is already given on line 2"):
        load_tokenizer(tmp_path, 1024)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYQ== 1\n")
    with pytest.raises(CheckpointError, match="line 2: token b'a' repeats line 1"):
        load_tokenizer(tmp_path, 1024)


def test_listed_side_files_missing_or_edited_are_refused(tree, capsys):
    m = _manifest(tree)
    m["files"]["tiktoken.model"] = {"size": 10, "blake2b": "0" * 16}  # listed, absent: was a byte fallback
    _put(tree, m)
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "hi"], "tiktoken.model: missing (listed in")
    del m["files"]["tiktoken.model"]
    _put(tree, m)
    cfg = (tree / "config.json").read_text()
    (tree / "config.json").write_text(cfg.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 2e-05'))
    assert (tree / "config.json").read_text() != cfg
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "hi"], "config.json: checksum mismatch")


def test_an_edited_tokenizer_config_is_the_users_to_set(tree):
    from streamrt.checkpoint.reader import open_tree

    (tree / "tokenizer_config.json").write_text('{"streamrt_chat": {"multi_turn": false}}')
    m = _manifest(tree)
    m["files"]["tokenizer_config.json"] = {"size": 3, "blake2b": "0" * 16}  # as converted, then edited
    _put(tree, m)
    open_tree(tree).check_side_files()


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if dense weights would load: these errors need only the config and tokenizer."""
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the input was checked")

    monkeypatch.setattr("streamrt.loader.load_placed", refuse)


def test_prompt_over_the_context_is_refused_before_the_weights_load(tree, capsys, no_weights):
    ctx = json.loads((tree / "config.json").read_text())["text_config"]["max_position_embeddings"]
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "x" * (ctx + 10)],
                    f"but the model's context is {ctx} tokens")


@pytest.mark.parametrize("flags, fragment", [
    (["--host-mem", "1"], "--host-mem 1 bytes holds no"),
    (["--gpu-experts", "1"], "--gpu-experts 1: one layer request needs"),
])
def test_budgets_the_tree_cannot_meet_are_refused_before_the_weights_load(tree, capsys, no_weights, flags, fragment):
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "hi", "--device", "cpu", *flags], fragment)


def test_manifest_that_is_a_directory_and_a_string_version(tree, capsys):
    m = _manifest(tree)
    m["format_version"] = "2"
    _put(tree, m)
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "hi"], "format_version is '2', not an integer")
    (tree / "manifest.json").unlink()
    (tree / "manifest.json").mkdir()
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "hi"], "manifest.json is not a file")


def test_empty_prompt_and_empty_messages_path(capsys, no_session):
    _one_line_error(capsys, ["run", "--prompt", ""], "--prompt is empty")
    _one_line_error(capsys, ["run", "--prompt", "  \n"], "--prompt is empty")
    _one_line_error(capsys, ["run", "--messages", ""], "--messages: empty path")


def test_synth_bad_device_leaves_no_output(capsys, tmp_path):
    out = tmp_path / "s"
    _one_line_error(capsys, ["synth", "--config", "tiny-k3", "--out", str(out), "--device", "cuda:x"],
                    "--device: expected")
    _one_line_error(capsys, ["synth", "--config", "tiny-k3", "--out", str(out), "--device", "auto"], "got 'auto'")
    assert not out.exists()  # a traceback mid-write used to leave a partial tree
    (tmp_path / "f").write_text("x")
    _one_line_error(capsys, ["synth", "--config", "tiny-k3", "--out", str(tmp_path / "f")],
                    "exists and is not a directory")


@pytest.mark.parametrize("flags, fragment", [
    (["--link-gbps", "nan"], "--link-gbps must be a finite number > 0, got nan"),
    (["--hbm-gbps", "inf", "--gpu-mem", "80G"], "--hbm-gbps must be a finite number > 0, got inf"),
    (["--disk-gbps", "inf", "--host-mem", "1G"], "--disk-gbps must be a finite number > 0"),
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
])
def test_inspect_bad_numbers(capsys, flags, fragment):
    _one_line_error(capsys, ["inspect", "tiny-k3", *flags], fragment)
    _one_line_error(capsys, ["inspect", ""], "NAME|PATH is empty")


def test_outputs_never_overwrite_the_tree_or_an_input(tree, capsys, tmp_path, no_weights):
    before = (tree / "manifest.json").read_bytes()
    _one_line_error(capsys,
                    ["run", "--model", str(tree), "--prompt", "hi", "--stats-json", str(tree / "manifest.json")],
                    "is manifest.json of the model tree")
    _one_line_error(capsys, ["run", "--model", str(tree), "--prompt", "hi", "--trace", str(tree / "config.json")],
                    "is config.json of the model tree")
    assert (tree / "manifest.json").read_bytes() == before
    out = str(tmp_path / "o.json")
    _one_line_error(capsys, ["run", "--prompt", "hi", "--stats-json", out, "--trace", out],
                    "the same file as --stats-json")
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    _one_line_error(capsys, ["run", "--messages", str(msgs), "--stats-json", str(msgs)], "the same file as --messages")


def test_verify_names_a_directory_where_a_file_belongs(tree, capsys):
    rel = next(r for r in _manifest(tree)["files"] if r.startswith("experts/"))
    (tree / rel).unlink()
    (tree / rel).mkdir()
    assert main(["verify", str(tree)]) == 1
    assert f"BAD {tree / rel}: not a regular file" in capsys.readouterr().err


def test_an_unfinished_conversion_is_named_with_the_command_that_finishes_it(capsys, tmp_path):
    """A DST a killed `convert` left (its state, no manifest yet) is not called a release: the
    message gives the command that resumes it, with the source its state recorded."""
    dst = tmp_path / "half done"
    (dst / ".convert").mkdir(parents=True)
    (dst / "config.json").write_text("{}")  # copied early by convert: it looks like a release
    src = tmp_path / "the release"
    (dst / ".convert" / "state.json").write_text(json.dumps({"source": str(src)}))
    err = _one_line_error(capsys, ["run", "--model", str(dst), "--prompt", "hi"], "an unfinished conversion")
    assert f"streamrt convert '{src}' '{dst}'" in err
    (dst / ".convert" / "state.json").write_text("{")  # unreadable state: the command still reads right
    _one_line_error(capsys, ["run", "--model", str(dst), "--prompt", "hi"], f"streamrt convert SRC '{dst}'")


def test_synth_refused_for_space_leaves_no_directory(capsys, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: seen.append(Path(p)) or shutil._ntuple_diskusage(2**40, 2**40 - 2**10, 2**10))
    out = tmp_path / "c"
    # sizes in units that say something: the old "needs 0.0 GiB, only 0.0 GiB free" did not
    err = _one_line_error(capsys, ["synth", "--config", "tiny-k3", "--out", str(out)], "only 1.0 KiB free")
    assert re.search(r"needs \d+\.\d (KiB|MiB)", err), err
    assert seen == [tmp_path]  # the nearest directory that exists
    assert not out.exists()
    deep = tmp_path / "a" / "b" / "c"  # a missing parent is an error, not a tree of new directories
    _one_line_error(capsys, ["synth", "--config", "tiny-k3", "--out", str(deep)], "does not exist")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("src, dst, name", [("", "out", "SRC"), ("rel", "", "DST"), ("rel", "  ", "DST")])
def test_convert_refuses_an_empty_path(capsys, tmp_path, monkeypatch, src, dst, name):
    """An unset shell variable is not the current directory."""
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, ["convert", src, dst], f"convert: {name} is empty")
    assert list(tmp_path.iterdir()) == []


# ---- bad input found by fuzzing the command line -------------------------------------


def _tiny_config(tmp_path: Path, **text) -> Path:
    """tiny-k3.1-pro's config.json with `text` set in its text_config."""
    from importlib import resources

    cfg = json.loads(resources.files("streamrt").joinpath("configs", "tiny-k3.1-pro.json").read_bytes())
    cfg.setdefault("text_config", cfg).update(text)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_tiktoken_model_without_every_single_byte_is_refused(tmp_path):
    """tiktoken panics (a BaseException) on a byte it has no rank for: refused when read."""
    from streamrt.tokenizer import load_tokenizer, read_bpe_ranks

    lines = [f"{__import__('base64').b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    assert len(read_bpe_ranks(tmp_path / "tiktoken.model")) == 256
    (tmp_path / "tiktoken.model").write_text("\n".join(lines[:100] + lines[101:]) + "\n")
    e = expect_project_error("byte 0x64 missing", load_tokenizer, tmp_path, 1024)
    assert "1 of the 243 bytes UTF-8 text holds have no token (the first: 0x64)" in str(e)
    (tmp_path / "tiktoken.model").write_text("\n".join(lines[:0xF5]) + "\n")  # no 0xf5-0xff: never in UTF-8 text
    assert len(read_bpe_ranks(tmp_path / "tiktoken.model")) == 0xF5
    (tmp_path / "tiktoken.model").unlink()
    (tmp_path / "tiktoken.model").mkdir()  # a directory in its place: an error, not the byte tokenizer
    assert "unreadable" in str(expect_project_error("a directory", load_tokenizer, tmp_path, 1024))


def test_deeply_nested_json_inside_a_message_is_not_a_recursion_error():
    """Tool-call arguments (a JSON string inside the messages) nested past json's recursion:
    arguments that are not JSON are rendered verbatim; a typed value is refused; a declared
    tool block is not parsed."""
    from streamrt.chat.reply import _json_or_none
    from streamrt.chat.tools import call_parts, typed_value

    deep = "[" * 100_000 + "]" * 100_000
    name, parsed, raw = call_parts({"function": {"name": "f", "arguments": deep}}, "messages[1]")
    assert (name, parsed, raw) == ("f", None, deep)
    with pytest.raises(ValueError, match="not JSON"):
        typed_value("array", deep)
    assert _json_or_none(deep) is None
    assert call_parts({"function": {"name": "f", "arguments": '{"a": [[1]]}'}}, "m")[1] == {"a": [[1]]}


def test_deep_conversion_state_files_are_not_ours(tmp_path):
    """A DST whose state, manifest or journal nests past json's recursion is not a previous
    conversion (refused in one line), and `run`'s hint names no source."""
    from streamrt.checkpoint.dst import prepare_dst, recorded_source

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (dst / ".convert").mkdir(parents=True)
    (dst / ".convert" / "state.json").write_text("[" * 100_000)
    assert recorded_source(dst) is None
    with pytest.raises(CheckpointError, match="is not a previous partial conversion"):
        prepare_dst(src, dst, "fp", {})
    (dst / ".convert" / "state.json").unlink()
    (dst / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="is not a previous partial conversion"):
        prepare_dst(src, dst, "fp", {})
    (dst / ".convert" / "state.json").write_text(json.dumps({"source": "a\nb"}))
    assert recorded_source(dst) is None  # a newline would split the one-line hint


def test_convert_journal_that_is_a_directory_is_one_line(capsys, tmp_path):
    rel, out = tmp_path / "rel", tmp_path / "out"
    assert main(["synth", "--config", "tiny-k3.1-pro", "--out", str(rel)]) == 0
    (out / ".convert" / "journal.jsonl").mkdir(parents=True)
    (out / ".convert" / "state.json").write_text("{}")  # an unfinished conversion of another source
    _one_line_error(capsys, ["convert", "--no-progress", str(rel), str(out)], "is not a previous partial conversion")
    shutil.rmtree(out)
    assert main(["convert", "--no-progress", str(rel), str(out)]) == 0
    (out / ".convert" / "journal.jsonl").mkdir(parents=True)  # a finished conversion: a re-run opens its journal
    capsys.readouterr()
    _one_line_error(capsys, ["convert", "--no-progress", str(rel), str(out)],
                    "journal.jsonl: cannot open the conversion journal")


def test_synth_out_below_a_file_is_one_line(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    _one_line_error(capsys, ["synth", "--config", "tiny-k3.1-pro", "--out", str(tmp_path / "afile" / "x")],
                    "cannot create --out: Not a directory")


@pytest.mark.parametrize("text, fragment", [
    ({"num_expert_group": 32, "topk_group": 1}, "topk_group: 1 groups of 1 experts hold fewer than the 4 experts"),
    ({"dsa_config": {"dsa_layers": [], "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8}},
     "dsa_layers: empty; K3.1 Pro has the indexer"),
])
def test_config_that_cannot_route_or_index_is_refused_when_read(tmp_path, text, fragment):
    from streamrt.config import load_config

    with pytest.raises(ConfigError, match=fragment):
        load_config(_tiny_config(tmp_path, **text))


def test_manifest_key_with_a_control_character_is_refused(tree, capsys):
    m = _manifest(tree)
    m["files"]["a\nb"] = {"size": 1, "blake2b": "0" * 16}
    _put(tree, m)
    _one_line_error(capsys, ["verify", str(tree)], "files key 'a\\nb' is not a path inside the tree")


def test_tied_embeddings_load_one_table(tmp_path):
    """tie_word_embeddings: the tree stores no lm_head; the loaded model's head is the
    embedding table itself."""
    from streamrt.checkpoint.synth import synth
    from streamrt.loader import load_model

    cfg = _tiny_config(tmp_path, tie_word_embeddings=True)
    synth(str(cfg), tmp_path / "t", fmt="streamrt", progress=False)
    model = load_model(tmp_path / "t", dtype=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_model_without_moe_layers_needs_no_expert_slots(tmp_path):
    from streamrt.config import load_config
    from streamrt.runtime.options import RuntimeOptions
    from streamrt.runtime.streams import make_device

    cfg = load_config(_tiny_config(tmp_path, first_k_dense_replace=9))
    assert cfg.expert_files == 0
    assert RuntimeOptions(device="cpu").resolve(cfg, 4096, make_device("cpu")).gpu_experts == 0


def test_a_renamed_structural_special_names_the_tokenizer_config(tmp_path):
    """added_tokens_decoder may rename a special; renaming one the chat format is built from
    (<|open|>: 163587) is refused naming the file: by run and convert (which loads the
    tokenizer as run does), and by verify (check_tokenizer_config)."""
    from streamrt.tokenizer import check_tokenizer_config, load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"163587": {"content": "ZZ"}}}))
    e = expect_project_error("<|open|> renamed", load_tokenizer, tmp_path, 1024)
    assert str(e).startswith(f"{tmp_path / 'tokenizer_config.json'}: tokenizer has no structural special <|open|>")
    e = expect_project_error("verify's check", check_tokenizer_config, tmp_path / "tokenizer_config.json")
    assert "no structural special <|open|> (added_tokens_decoder renames it)" in str(e)
