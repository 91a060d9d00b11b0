"""Models: where a model comes from, and the architectures built with random weights.

:mod:`sources` (a model spec, ``gguf:``, ``hf:``, ``arch:``, -> the model and its tokenizer,
offline; the repository's root and cache folder), :mod:`arch` (the ``arch:`` presets and what is
built from a transformers config) and :mod:`filehash` (a model file's SHA-256, kept per file).

Imports no other room of ``tasks``: the engines, the profile, the tokenizers and the stream's
inputs read models through this room.
"""
