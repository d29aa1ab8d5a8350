"""Tokenizers: tiktoken BPE when the checkpoint ships `tiktoken.model`, byte-level otherwise.

Both carry K3's 256 reserved special ids (spec/MODEL.md §8.2) at the end of the
vocabulary: `special_id = vocab_size - 256 + (k3_id - 163584)` (docs/CONTRACTS.md, Tokens).
`encode(text)` is for ordinary text only and never yields a special id, even for a literal
`<|open|>`: user, tool and attribute text must not be able to forge frame structure.
Structural markers are encoded by name through `special_id(name)`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import os
from pathlib import Path
from typing import Iterable

from streamrt.errors import CheckpointError, ConfigError, clip
from streamrt.jsonio import load_json, type_name

K3_SPECIAL_BASE = 163584
NUM_SPECIALS = 256

# K3 ids of the named specials (spec/MODEL.md §8.2); the rest are reserved.
K3_NAMED_SPECIALS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "[start_header_id]": 163590,
    "[end_header_id]": 163591,
    "[EOT]": 163593,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<osagent_mode>": 163649,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
STRUCTURAL = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
# Generation stops on end-of-message and end-of-turn (K3 stop ids 163586, 163593) and [EOS].
STOP_NAMES = ("<|end_of_msg|>", "[EOT]", "[EOS]")

# Kimi's pre-tokenizer regex (K3 `tokenization.py`): Han runs are their own pieces; the
# `&&[^\p{Han}]` class intersections keep letter runs from swallowing ideographs.
K3_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class StreamDecoder:
    """Incremental id -> text: holds back a multi-byte character split across tokens."""

    def __init__(self, tokenizer: "Tokenizer", *, show_special: bool = False):
        self._tok = tokenizer
        self._show_special = show_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if self._tok.is_special(token_id):
            # A special ends any pending partial character: flush it as U+FFFD first.
            head = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return head + (self._tok.special_name(token_id) if self._show_special else "")
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


class MissingSpecial(ConfigError):
    """A special token the chat format is built from was renamed (tokenizer_config.json)."""


class Tokenizer:
    """Shared special-token table and decoding; subclasses supply ordinary-token bytes."""

    kind = "base"

    def __init__(self, vocab_size: int, special_names: dict[str, int] | None = None):
        if vocab_size < 2 * NUM_SPECIALS:
            raise ConfigError(f"vocab_size {vocab_size} is too small: need >= {2 * NUM_SPECIALS}")
        self.vocab_size = vocab_size
        self.special_base = vocab_size - NUM_SPECIALS
        names = {f"<|reserved_token_{k}|>": k for k in range(K3_SPECIAL_BASE, K3_SPECIAL_BASE + NUM_SPECIALS)}
        for name, k3 in K3_NAMED_SPECIALS.items():
            names.pop(f"<|reserved_token_{k3}|>", None)
            names[name] = k3
        for name, k3 in (special_names or {}).items():
            names.pop(self._name_of_k3(names, k3), None)
            names[name] = k3
        self._id_of = {name: self.from_k3_id(k3) for name, k3 in names.items()}
        self._name_of = {i: n for n, i in self._id_of.items()}
        for name in STRUCTURAL:
            if name not in self._id_of:
                raise MissingSpecial(f"tokenizer has no structural special {name}")
        self.eos_id = self._id_of["<|end_of_msg|>"]
        self.stop_ids = frozenset(self._id_of[n] for n in STOP_NAMES if n in self._id_of)

    @staticmethod
    def _name_of_k3(names: dict[str, int], k3: int) -> str | None:
        for n, v in names.items():
            if v == k3:
                return n
        return None

    def from_k3_id(self, k3_id: int) -> int:
        """The CONTRACTS rule: K3's special layout, moved to the end of this vocabulary."""
        if not K3_SPECIAL_BASE <= k3_id < K3_SPECIAL_BASE + NUM_SPECIALS:
            raise ValueError(f"{k3_id} is not a K3 special id")
        return self.special_base + (k3_id - K3_SPECIAL_BASE)

    # ---- specials ---------------------------------------------------------------------

    def special_id(self, name: str) -> int:
        try:
            return self._id_of[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}") from None

    def special_name(self, token_id: int) -> str | None:
        return self._name_of.get(int(token_id))

    def is_special(self, token_id: int) -> bool:
        return self.special_base <= int(token_id) < self.vocab_size

    def encode_special(self, name: str) -> list[int]:
        return [self.special_id(name)]

    # ---- ordinary text ----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of an ordinary token; b"" for a special or an unused id."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int], *, show_special: bool = True) -> str:
        """Never raises on bad UTF-8 or unknown ids: invalid bytes become U+FFFD."""
        dec = StreamDecoder(self, show_special=show_special)
        return "".join(dec.feed(int(i)) for i in ids) + dec.flush()

    def stream_decoder(self, *, show_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, show_special=show_special)


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are bytes (synthetic and small models); 256..vocab-257 are unused."""

    kind = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        return bytes((token_id,)) if 0 <= token_id < 256 else b""


class TiktokenTokenizer(Tokenizer):
    """K3's BPE (`tiktoken.model`: base64 token and rank per line) plus the special table."""

    kind = "tiktoken"

    def __init__(self, model_file: Path, vocab_size: int, special_names: dict[str, int] | None = None):
        super().__init__(vocab_size, special_names)
        import tiktoken

        ranks = read_bpe_ranks(model_file)
        if not ranks:
            raise CheckpointError(f"{model_file}: empty tiktoken BPE file")
        top = max(ranks.values())
        if top >= self.special_base:
            raise CheckpointError(
                f"{model_file}: BPE rank {top} collides with the special ids "
                f"(vocab_size {vocab_size}, specials from {self.special_base})"
            )
        self._bytes = {rank: tok for tok, rank in ranks.items()}
        # No specials inside tiktoken: ordinary encoding can then never produce one.
        self._enc = tiktoken.Encoding(
            name=f"streamrt-{model_file.parent.name}", pat_str=K3_PAT_STR, mergeable_ranks=ranks, special_tokens={}
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes.get(int(token_id), b"")


UTF8_BYTES = tuple(b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5)


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model` lines: base64 token, rank. Read directly, because tiktoken's loader
    caches by path in a temp dir and would serve a stale file after the tree changes."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc.strerror})") from None
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> its line
    for n, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path}: line {n} is not '<base64 token> <rank>'") from None
        # tiktoken panics (a BaseException, not an error) on a repeated token or rank: a
        # truncated or bit-flipped file makes either
        if rank < 0 or rank in seen:
            why = "negative" if rank < 0 else f"already given on line {seen[rank]}"
            raise CheckpointError(f"{path}: line {n}: rank {rank} is {why}; the file is corrupt")
        if token in ranks:
            raise CheckpointError(f"{path}: line {n}: token {token[:20]!r} repeats line {seen[ranks[token]]}; "
                                  "the file is corrupt")
        ranks[token] = rank
        seen[rank] = n
    # byte-level BPE: tiktoken panics on a byte of the text it has no rank for. Every byte UTF-8
    # text can hold needs one (not 0xc0, 0xc1, 0xf5-0xff, which no UTF-8 text holds).
    missing = [b for b in UTF8_BYTES if bytes([b]) not in ranks]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} of the {len(UTF8_BYTES)} bytes UTF-8 text holds have no token "
                              f"(the first: 0x{missing[0]:02x}); the file is corrupt or truncated")
    return ranks


TOKENIZER_CONFIG = "tokenizer_config.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG_MAX_BYTES = 16 << 20  # 256 added tokens take ~50 KB; a replaced file must not cost minutes to parse
_ADDED_TOKENS_SHAPE = 'added_tokens_decoder must be an object of id -> {"content": str, ...}'


def read_tokenizer_config(path: Path) -> dict:
    """`tokenizer_config.json`, its `added_tokens_decoder` checked: the file is the user's to
    edit (docs/CONTRACTS.md) and outside the checksums, so anything wrong in it is a one-line
    CheckpointError naming the file and the field."""
    data = load_json(path, what="tokenizer config", expect=dict, max_bytes=TOKENIZER_CONFIG_MAX_BYTES,
                     unique_keys=True)
    decoder = data.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise CheckpointError(f"{path}: {_ADDED_TOKENS_SHAPE}, got {type_name(decoder)}")
    for key, entry in decoder.items():
        field = f"added_tokens_decoder[{clip(key, 40)!r}]"
        try:
            int(key)
        except ValueError:
            raise CheckpointError(f"{path}: {field}: the key is not a token id (an integer)") from None
        if not isinstance(entry, dict):
            raise CheckpointError(f'{path}: {field} must be an object with a string "content", got {type_name(entry)}')
        if not isinstance(entry.get("content"), str):
            got = type_name(entry["content"]) if "content" in entry else "nothing"
            raise CheckpointError(f"{path}: {field}.content must be a string, got {got}")
    return data


def check_tokenizer_config(path: Path) -> None:
    """Everything streamrt reads from a tree's `tokenizer_config.json` (`path`): the added tokens and the
    `streamrt_chat` block (ChatProfile's rules). For `verify` and `convert`, which must refuse
    a broken edit that `run` would refuse."""
    _special_names_from_config(path)
    # imported here: streamrt.chat imports this module
    from streamrt.chat.profile import ChatProfile

    ChatProfile.from_tree(path.parent)  # reads path: the profile lives in the same file


def _special_names_from_config(path: Path) -> dict[str, int]:
    """Names of added tokens in `tokenizer_config.json`, as K3 ids (ids outside the block are
    ignored); refused, naming the file, where one renames a special the chat format is built from."""
    out = {}
    for key, entry in read_tokenizer_config(path).get("added_tokens_decoder", {}).items():
        k3 = int(key)
        if K3_SPECIAL_BASE <= k3 < K3_SPECIAL_BASE + NUM_SPECIALS:
            out[entry["content"]] = k3
    try:
        Tokenizer(2 * NUM_SPECIALS, out)  # the specials' table alone
    except MissingSpecial as e:
        raise MissingSpecial(f"{path}: {e} (added_tokens_decoder renames it)") from None
    return out


def load_tokenizer(model_dir: str | Path | None, vocab_size: int, eos_token_id: int | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint directory (release or streamrt tree)."""
    root = Path(model_dir) if model_dir is not None else None
    names: dict[str, int] = {}
    if root is not None and (root / TOKENIZER_CONFIG).is_file():
        names = _special_names_from_config(root / TOKENIZER_CONFIG)
    # lexists: a directory or a dangling link in tiktoken.model's place is an error, not bytes
    if root is not None and os.path.lexists(root / TIKTOKEN_MODEL):
        tok: Tokenizer = TiktokenTokenizer(root / TIKTOKEN_MODEL, vocab_size, names)
    else:
        tok = ByteTokenizer(vocab_size, names)
    if eos_token_id is not None and eos_token_id != tok.eos_id:
        where = f"{root / 'config.json'}: " if root is not None else ""
        raise ConfigError(
            f"{where}eos_token_id {eos_token_id} is not <|end_of_msg|> "
            f"(expected {tok.eos_id} for vocab_size {vocab_size})"
        )
    return tok
