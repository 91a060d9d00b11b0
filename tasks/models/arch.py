"""``arch:`` architectures: the preset table and what is built from a config with random weights.

What is here works on transformers configs and preset names, never on model specs: the presets
(:data:`ARCH_PRESETS`), a preset's or a config.json's config (:func:`arch_config`), the
random-weight model built from a config (:func:`random_model`), a config's parameter count
(:func:`parameter_count`) and the encode-only tokenizers that make prompt ids for a random-weight
model (:class:`ByteTokenizer`, :class:`FoldedTokenizer`).

Separate from :mod:`tasks.models.sources` (spec -> source -> loaded model) because it is a table and a
few builders that need no source, no cache and no GGUF conversion; :mod:`tasks.models.sources` imports
it, never the other way round. Imports only the standard library, torch and transformers, so it
runs on a GPU box alone (``python -m tasks.profile``).
"""

from __future__ import annotations

from pathlib import Path

#: Architecture presets: the shapes of public models' config.json files (Hugging Face hub:
#: HuggingFaceTB/SmolLM2-135M, meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B), with
#: random weights. ``default_dtype``: the dtype used when none is asked for (7B-shaped models
#: need about 27-32 GB in float32, more than a 24 GiB machine has, so they default to bfloat16).
ARCH_PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(  # 9 heads, 3 KV heads (GQA 3:1), tied embeddings
        default_dtype="float32",
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama-2-7b": dict(  # multi-head attention: 32 heads, 32 KV heads
        default_dtype="bfloat16",
        model_type="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama-3-8b": dict(  # grouped-query attention: 32 heads, 8 KV heads (4:1)
        default_dtype="bfloat16",
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}


def text_config(config):
    """The text decoder's config of a (possibly multimodal) config, else the config itself."""
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older configs take no ``decoder`` argument
        return get()


def arch_config(location: str):
    """The transformers config of an ``arch:`` location: a preset name or a config.json path.

    Raises:
        OSError, ValueError, KeyError: transformers cannot read the config.json.
    """
    from transformers import AutoConfig

    if location in ARCH_PRESETS:
        values = dict(ARCH_PRESETS[location])
        values.pop("default_dtype")
        return AutoConfig.for_model(values.pop("model_type"), **values)
    return AutoConfig.from_pretrained(Path(location).parent)


def random_model(config, dtype: str = "float32", device: str = "cpu"):
    """The model a config describes with random weights, in eval mode.

    ``torch.manual_seed(0)`` and transformers' own initialisation, built directly on ``device``
    in ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``). Allocates every weight.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def parameter_count(config) -> int:
    """Parameters of the model a config describes, counted on the meta device (no memory);
    tied embeddings count once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


class ByteTokenizer:
    """UTF-8 bytes as ids (0..255): prompt ids for any vocabulary of 256 or more."""

    name = "bytes"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


class FoldedTokenizer:
    """A real tokenizer's ids folded into a smaller vocabulary (``id % vocab_size``)."""

    def __init__(self, inner, vocab_size: int, name: str) -> None:
        self.inner, self.vocab_size, self.name = inner, vocab_size, name

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.inner.encode(text, add_special_tokens=add_special_tokens)
        return [i % self.vocab_size for i in ids]
