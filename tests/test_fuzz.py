"""Fuzz every reader of user or disk input: mutated safetensors headers, configs,
release indexes, manifests, expert headers and messages files. Seeded (the same cases every
run), bounded (about a minute on 2 cores, >= 1,000 cases in all).

Each case must end in success or in the project's own error type (`StreamrtError` and
subclasses: one line for the user), within CASE_SECONDS, without growing the peak RSS by
more than CASE_RSS_BYTES. While the suite runs, the address space is capped a little above
what the process already holds, so an allocation bomb becomes a MemoryError (reported as a
foreign exception) instead of taking the machine down.
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import signal
import struct
import time
import traceback
from pathlib import Path

import pytest

from streamrt.errors import StreamrtError

SEED = 26
CASE_SECONDS = 10.0
CASE_RSS_BYTES = 1 << 30
MAX_MESSAGE = 2000  # characters: longer is a finding too (implausible configs should stay < 300)
AS_HEADROOM = 4 << 30  # address space allowed above what the process holds when the suite starts
ROOT = Path(__file__).parents[1]



# ---- mutation --------------------------------------------------------------------------------

INTERESTING = [
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**64 + 1, 2**70, -(2**70), 10**30, 1e308, -1e-308, 0.5,
    "", "x" * 10_000, "\udcff", "../../etc/passwd", "BF16", "F16", "U8", "I64", "kimi_k31", "kimi_linear",
    [], [1], [[]], [-1, 2**40], [0, 0, 0, 0, 0, 0, 0, 0, 0], {}, {"a": 1}, list(range(64)),
]
JSON_TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"9" * 5000, b'"\\ud800"', b"\xff", b"\xc3",
               b"[" * 2000, b"{" * 2000, b'{"a":' * 2000, b"null", b"[]", b"{}", b'"', b"\\", b"\x00", b",", b":"]


def _paths(doc, prefix=()):
    """Every (path, value) inside a JSON document, breadth first (capped: big indexes)."""
    out, queue = [], [(prefix, doc)]
    while queue and len(out) < 4000:
        path, v = queue.pop(0)
        out.append((path, v))
        if isinstance(v, dict):
            queue += [(path + (k,), x) for k, x in list(v.items())[:200]]
        elif isinstance(v, list):
            queue += [(path + (i,), x) for i, x in enumerate(v[:50])]
    return out


class Deep:
    """n nested lists, kept symbolic so deepcopy and json.dumps (both recursive) never see the
    nesting; `dumps` writes the brackets, `materialize` builds the lists (iteratively)."""

    def __init__(self, n: int):
        self.n = n

    def __deepcopy__(self, memo):
        return self


def _deep(n: int) -> Deep:
    return Deep(n)


def _deep_marker(o):
    if isinstance(o, Deep):
        return f"\x00DEEP{o.n}\x00"
    raise TypeError(type(o).__name__)


def materialize(doc):
    """The document with every Deep replaced by real nested lists (for dict-level readers)."""
    if isinstance(doc, Deep):
        v: list = []
        for _ in range(doc.n - 1):
            v = [v]
        return v
    if isinstance(doc, dict):
        return {k: materialize(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [materialize(v) for v in doc]
    return doc


def mutate_json(doc, rng: random.Random):
    """A structural mutation: replace, delete, retype or duplicate one value, or nest it."""
    doc = copy.deepcopy(doc)
    paths = _paths(doc)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        path, value = rng.choice(paths)
        if not path:
            return rng.choice([[doc], _deep(rng.choice((70, 1000))), [], "x", 3, None])
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            parent[key]  # noqa: B018 - the path is still there after an earlier mutation
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, (dict, list)):  # an earlier mutation made it a string: "x"[0] reads
            continue
        op = rng.randrange(7)
        if op == 0:
            parent[key] = copy.deepcopy(rng.choice(INTERESTING))
        elif op == 1 and isinstance(parent, dict):
            del parent[key]
        elif op == 2:
            parent[key] = [value] if not isinstance(value, list) else {"v": value}
        elif op == 3:
            parent[key] = _deep(rng.choice((10, 100, 1000)))
        elif op == 4 and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = rng.choice([value + 1, value - 1, -value, value * 2**32, value * 1000, str(value)])
        elif op == 5 and isinstance(value, str):
            parent[key] = rng.choice([value + "x", value[:-1], value.upper(), value * 3, value + "\udcff"])
        elif op == 6 and isinstance(parent, dict):
            parent[rng.choice(["__metadata__", "extra", str(key) + "_", "", "\x00"])] = copy.deepcopy(value)
    return doc


def dumps(doc) -> bytes:
    text = json.dumps(doc, ensure_ascii=False, default=_deep_marker)
    while "\\u0000DEEP" in text:
        i = text.index('"\\u0000DEEP')
        j = text.index('\\u0000"', i + 8)
        n = int(text[i + 11 : j])
        text = text[:i] + "[" * n + "]" * n + text[j + 7 :]
    return text.encode("utf-8", "surrogatepass")


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """A byte-level mutation: flip, overwrite, insert, delete, truncate or splice a token."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        if not b:
            b += rng.choice(JSON_TOKENS)
            continue
        i = rng.randrange(len(b))
        op = rng.randrange(7)
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i] = rng.randrange(256)
        elif op == 2:
            b[i:i] = rng.choice(JSON_TOKENS)
        elif op == 3:
            del b[i : i + rng.randrange(1, 64)]
        elif op == 4:
            del b[rng.randrange(len(b) + 1) :]
        elif op == 5:
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randrange(1, 128)]
        else:
            b[i : i + 1] = rng.choice(JSON_TOKENS)
    return bytes(b)


def mutate_doc(doc, rng: random.Random) -> bytes:
    """Structure or bytes, or both: the document as a reader would find it on disk."""
    r = rng.random()
    if r < 0.5:
        return dumps(mutate_json(doc, rng))
    if r < 0.85:
        return mutate_bytes(dumps(doc), rng)
    return mutate_bytes(dumps(mutate_json(doc, rng)), rng)


# ---- running cases ---------------------------------------------------------------------------


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout(f"case ran past {CASE_SECONDS} s")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def capped_memory():
    """Cap the address space a little above what the process holds (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = _vm_size() + AS_HEADROOM
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (ValueError, OSError):
        pass
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _where(frames) -> str:
    """file:line of the innermost streamrt frame of a traceback."""
    return next((f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in reversed(frames)
                 if f.filename.startswith(str(ROOT / "streamrt"))), "?")


def run_cases(reader: str, cases, call) -> int:
    """Feed each (case_id, input) to `call`; collect foreign exceptions, slow and fat cases."""
    foreign: dict[str, str] = {}
    other: list[str] = []
    n = 0
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case_id, data in cases:
            n += 1
            rss0, t0 = _maxrss_bytes(), time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
            try:
                call(data)
            except StreamrtError as e:
                if "\n" in str(e) or len(str(e)) > MAX_MESSAGE:  # a user error is one readable line
                    frames = traceback.extract_tb(e.__traceback__)
                    foreign[case_id] = (f"{_where(frames)}: {type(e).__name__} message of {len(str(e))} chars, "
                                        f"{str(e).count(chr(10)) + 1} line(s): {str(e)[:100]}")
            except CaseTimeout:
                other.append(f"{case_id}: over {CASE_SECONDS} s")
            except BaseException as e:  # noqa: BLE001 - a foreign exception is the finding
                if isinstance(e, KeyboardInterrupt):
                    raise
                last = traceback.format_exception_only(type(e), e)[-1].strip()[:200]
                foreign[case_id] = f"{_where(traceback.extract_tb(e.__traceback__))}: {last}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            dt, grew = time.perf_counter() - t0, _maxrss_bytes() - rss0
            if dt > CASE_SECONDS:
                other.append(f"{case_id}: {dt:.1f} s")
            if grew > CASE_RSS_BYTES:
                other.append(f"{case_id}: peak RSS grew {grew / 2**30:.2f} GiB")
    finally:
        signal.signal(signal.SIGALRM, old)
    RAN[reader] = n
    lines = [f"{k}: {v}" for k, v in sorted(foreign.items())] + other
    if lines:
        pytest.fail(f"{reader}: {n} cases, {len(foreign)} foreign exception(s), {len(other)} limit breach(es):\n"
                    + "\n".join(lines[:40]))
    return n


RAN: dict[str, int] = {}  # reader -> cases run in this session (test_fuzz_case_count)
READERS = ("safetensors", "config", "release", "manifest", "expert", "messages")


def cases(reader: str, count: int, make):
    rng = random.Random(f"{SEED}/{reader}")
    for i in range(count):
        yield f"{reader}/{i:04d}", make(rng)


# ---- inputs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_tree() -> Path:
    from streamrt.default_model import packaged_model_dir

    d = packaged_model_dir()
    if d is None:
        pytest.skip("no packaged default model")
    return d


@pytest.fixture(scope="module")
def release_tree(tmp_path_factory) -> Path:
    from streamrt.checkpoint.synth import synth

    out = tmp_path_factory.mktemp("fuzz") / "release"
    synth("tiny-k3", out, seed=0, fmt="release", device="cpu", progress=False)
    return out


def _st_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_file(header: bytes, data: bytes, rng: random.Random) -> bytes:
    n = len(header)
    r = rng.random()
    if r < 0.1:
        n = rng.choice([0, 1, n - 1, n + 1, n + len(data) + 1, 2**63, 2**64 - 1, 100 << 20])
    return struct.pack("<Q", n) + header + data


def test_fuzz_safetensors_read_header(tmp_path, default_tree, capped_memory):
    """read_header, then (when it parses) the dense header check against the config."""
    from streamrt.checkpoint.reader import check_dense_header, open_tree
    from streamrt.checkpoint.safetensors_io import read_header

    plane = sorted((default_tree / "dense").glob("plane.*.safetensors"))[0]
    rel = plane.relative_to(default_tree).as_posix()
    tree = open_tree(default_tree)
    hdr, data = _st_parts(plane)
    f = tmp_path / "x.safetensors"

    def make(rng):
        if rng.random() < 0.1:
            return mutate_bytes(struct.pack("<Q", len(dumps(hdr))) + dumps(hdr) + data[:64], rng)
        return _st_file(mutate_doc(hdr, rng), data, rng)

    def call(raw):
        f.write_bytes(raw)
        check_dense_header(tree, rel, read_header(f))

    assert run_cases("safetensors", cases("safetensors", 260, make), call) == 260


def test_fuzz_config(tmp_path, default_tree, capped_memory):
    from streamrt.config import config_from_dict, load_config

    base = json.loads((default_tree / "config.json").read_text())
    f = tmp_path / "config.json"

    def call(item):
        kind, payload = item
        if kind == "dict":
            config_from_dict(payload, name="fuzz", source="fuzz.json")
        else:
            f.write_bytes(payload)
            load_config(f)

    def make(rng):
        return ("dict", materialize(mutate_json(base, rng))) if rng.random() < 0.5 else ("file", mutate_doc(base, rng))

    assert run_cases("config", cases("config", 260, make), call) == 260


def test_fuzz_release_index(tmp_path, release_tree, capped_memory):
    from streamrt.checkpoint.release import open_release

    index_name = "model.safetensors.index.json"
    base_index = json.loads((release_tree / index_name).read_text())
    base_config = json.loads((release_tree / "config.json").read_text())
    case_dir = tmp_path / "rel"
    case_dir.mkdir()
    for p in release_tree.iterdir():
        if p.name not in (index_name, "config.json"):
            os.symlink(p, case_dir / p.name)

    def make(rng):
        if rng.random() < 0.75:
            return mutate_doc(base_index, rng), dumps(base_config)
        return dumps(base_index), mutate_doc(base_config, rng)

    def call(item):
        index, config = item
        (case_dir / index_name).write_bytes(index)
        (case_dir / "config.json").write_bytes(config)
        open_release(case_dir)

    assert run_cases("release", cases("release", 140, make), call) == 140


def test_fuzz_manifest_open_tree(tmp_path, default_tree, capped_memory):
    from streamrt.checkpoint.reader import open_tree
    from streamrt.checkpoint.verify import verify_tree

    base = json.loads((default_tree / "manifest.json").read_text())
    case_dir = tmp_path / "tree"
    case_dir.mkdir()
    for p in default_tree.iterdir():
        if p.name not in ("manifest.json",) and not p.name.startswith("."):
            os.symlink(p, case_dir / p.name)

    def call(raw):
        (case_dir / "manifest.json").write_bytes(raw)
        open_tree(case_dir)
        verify_tree(case_dir, progress=False, workers=2)  # the fast verify walks every entry

    assert run_cases("manifest", cases("manifest", 220, lambda rng: mutate_doc(base, rng)), call) == 220


def test_fuzz_expert_header(default_tree, capped_memory):
    from streamrt.checkpoint.expert_file import HEADER_BYTES, ExpertLayout, parse_header
    from streamrt.config import load_config

    layout = ExpertLayout.for_config(load_config(default_tree))
    path = sorted((default_tree / "experts").rglob("*.nvfp4"))[0]
    head = path.read_bytes()[:HEADER_BYTES]
    size = path.stat().st_size

    def make(rng):
        b = bytearray(head)
        r = rng.random()
        if r < 0.4:  # one field of the fixed part or a section record set to an interesting integer
            off = rng.choice([8, 12, 16, 20, 24, 28] + [32 + 8 * i for i in range(12)])
            width = 4 if off < 32 else 8
            v = rng.choice([0, 1, 2, 255, 4096, 2**31, 2**32 - 1, 2**63, 2**64 - 1, rng.randrange(2**32)])
            b[off : off + width] = (v % 2**(8 * width)).to_bytes(width, "little")
            return bytes(b), size
        if r < 0.9:
            return mutate_bytes(bytes(b), rng)[: HEADER_BYTES + 64], rng.choice([size, size, size - 1, 0, None, 2**40])
        return bytes(b[: rng.randrange(HEADER_BYTES)]), size

    def call(item):
        data, file_size = item
        parse_header(data, layout, name="E0000.nvfp4", file_size=file_size)

    assert run_cases("expert", cases("expert", 1000, make), call) == 1000


def test_fuzz_messages_file(tmp_path, capped_memory):
    from streamrt.chat import load_messages_file

    base = json.loads((ROOT / "examples" / "weather.json").read_text())
    f = tmp_path / "messages.json"

    def call(raw):
        f.write_bytes(raw)
        load_messages_file(f)

    assert run_cases("messages", cases("messages", 220, lambda rng: mutate_doc(base, rng)), call) == 220


def test_fuzz_case_count():
    """The suite's size: at least 1,000 cases over all readers (runs last)."""
    if set(RAN) != set(READERS):
        pytest.skip(f"only {sorted(RAN)} ran in this session")
    assert sum(RAN.values()) >= 1000, RAN
