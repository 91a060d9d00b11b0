"""Tokens: the tokenizers the tokenize stage compares, all offline (:mod:`tokenizers`: the model's
own, tiktoken's cl100k_base, Qwen's BPE, any transformers tokenizer), and the stage itself
(:mod:`stage`: what each prompt costs in tokens, and how each tokenizer splits it).

Imports ``tasks.models`` alone (the model's own tokenizer, read from its source); the config
checks a tokenizer's name here, and the pipeline's tokenize and sweep stages run them.
"""
