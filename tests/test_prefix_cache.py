"""The server's prefix cache over a level (tasks/endpoint/cache.py), on the instrument's ``prefix_cache``
scenario: a cache over the prompt's words whose counters carry vLLM's names, and whose usage
reports ``prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tasks.endpoint import cache, prometheus
from tasks.scaleout.levels import run_levels
from tasks.stream.settings import Connection, LevelSettings, Session

try:
    from tests import groundtruth_server as gt
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt


@pytest.fixture(scope="module")
def server(instrument) -> gt.GroundTruthServer:
    return instrument


def level(server: gt.GroundTruthServer, prompts: list[str]):
    settings = LevelSettings(
        model="prefix_cache", prompts=prompts, max_tokens=2, num_requests=len(prompts), warmup=0
    )
    (done,) = run_levels(Connection(server.base_url, None, 10.0), [settings], count_tokens=None)
    return done


def test_hit_rate_is_the_counters_increase_over_the_level(server) -> None:
    server.reset()
    shared = level(server, [f"system a b c q{i}" for i in range(4)])  # 5 words, 4 shared
    assert [r.cached_tokens for r in shared.measured] == [0, 4, 4, 4]
    assert all(r.usage_prompt_tokens == 5 for r in shared.measured)
    assert shared.metrics["prefix_cache_hit_rate"] == pytest.approx(12 / 20)
    assert shared.metrics["cached_token_fraction"] == pytest.approx(12 / 20)
    # the counters are cumulative: a level that shares nothing reads 0, not the lifetime 12/24
    # (nor the server's gauge, which says 0.5)
    alone = level(server, ["u1 v", "u2 w"])
    assert alone.metrics["prefix_cache_hit_rate"] == 0.0
    assert alone.metrics["cached_token_fraction"] == 0.0


def test_no_counters_no_usage_details_no_figure() -> None:
    assert cache.prefix_cache_hit_rate(None, {"vllm:prefix_cache_hits_total": 1.0}) is None
    assert cache.prefix_cache_hit_rate({"x": 1.0}, {"x": 2.0}) is None
    v0 = ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total")
    before, after = dict.fromkeys(v0, 10.0), {v0[0]: 13.0, v0[1]: 20.0}
    assert cache.prefix_cache_hit_rate(before, after) == pytest.approx(0.3)
    assert cache.prefix_cache_hit_rate(before, before) is None  # nothing looked up in the level
    assert cache.cached_token_fraction([]) is None


def blocks_of(prompts: list[str], shared: int) -> tuple:
    """Each prompt's blocks for the expected share: its first ``shared`` words under one key,
    then the rest its own (``tasks.workload.stage.StageWorkload.blocks``; tokens = words)."""
    return tuple((("shared", shared), (f"own:{p}", len(p.split()) - shared)) for p in prompts)


def test_the_expected_share_counts_whole_blocks_of_the_servers_size(server, caplog) -> None:
    """A paged cache of 4-word blocks (vLLM publishes its size in ``vllm:cache_config_info``):
    prompts sharing 6 words get 4 from the cache, and the expected share says so (issue 31)."""
    server.reset()
    server.prefix_cache_mode("vllm", block_size=4)
    prompts = [f"s1 s2 s3 s4 s5 s6 q{i}" for i in range(4)]  # 7 words, 6 shared
    settings = LevelSettings(
        model="prefix_cache", prompts=prompts, max_tokens=2, num_requests=4, warmup=0,
        prompt_blocks=blocks_of(prompts, 6), reset_cache=True,
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        (done,) = run_levels(Connection(server.base_url, None, 10.0), [settings], count_tokens=None)
    assert [r.cached_tokens for r in done.measured] == [0, 4, 4, 4]
    m = done.metrics
    assert m["cache_block_size_tokens"] == 4
    assert m["expected_cached_token_fraction"] == pytest.approx(12 / 28)  # not 18 / 28
    assert m["prefix_cache_hit_rate"] == pytest.approx(12 / 28)
    assert "points apart" not in caplog.text


def test_sglang_counters_and_an_unknown_block_size_warned_then_told(server, caplog) -> None:
    """SGLang's counters (cached tokens by cache_source, summed, over prompt tokens; its
    last-batch gauge ignored) with 4-word pages it does not publish: the expected share assumes
    per-token reuse and the 21-point gap is warned with both figures and the cause; told the
    block size (cache_block_size_tokens), the expected share agrees and nothing is said."""
    server.reset()
    server.prefix_cache_mode("sglang", block_size=4)
    prompts = [f"s1 s2 s3 s4 s5 s6 q{i}" for i in range(4)]
    base = LevelSettings(
        model="prefix_cache", prompts=prompts, max_tokens=2, num_requests=4, warmup=0,
        prompt_blocks=blocks_of(prompts, 6), reset_cache=True,
    )  # fmt: skip
    told = replace(base, level=1, cache_block_size_tokens=4)
    with caplog.at_level("WARNING"):
        unknown, known = run_levels(Connection(server.base_url, None, 10.0), [base, told], count_tokens=None)
    assert unknown.metrics["prefix_cache_hit_rate"] == pytest.approx(12 / 28)  # not the gauge
    assert unknown.metrics["cache_block_size_tokens"] is None
    assert unknown.metrics["expected_cached_token_fraction"] == pytest.approx(18 / 28)
    warned = [r.getMessage() for r in caplog.records if "points apart" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("level 0: prefix_cache_hit_rate = 42.9 %")
    assert "expected_cached_token_fraction = 64.3 %" in warned[0] and "block size" in warned[0]
    assert known.metrics["cache_block_size_tokens"] == 4
    assert known.metrics["expected_cached_token_fraction"] == pytest.approx(12 / 28)
    assert known.metrics["prefix_cache_hit_rate"] == pytest.approx(12 / 28)


@pytest.mark.parametrize("transport", ["sse", "openai"])
def test_llamacpp_timings_cache_n_is_read_per_request(server, transport) -> None:
    """llama.cpp's own server reports no cached tokens in its usage but ``timings.cache_n`` in
    its final ``choices: []`` chunk: read per request by both transports (issue 31)."""
    server.reset()
    server.prefix_cache_mode("llamacpp")
    settings = LevelSettings(
        model="prefix_cache", prompts=[f"system a b c q{i}" for i in range(3)], max_tokens=2,
        num_requests=3, warmup=0,
    )  # fmt: skip
    connection = Connection(server.base_url, None, 10.0, transport=transport)
    (shared,) = run_levels(connection, [settings], count_tokens=None)
    assert [r.cached_tokens for r in shared.measured] == [0, 4, 4]
    assert [r.usage_prompt_tokens for r in shared.measured] == [5, 5, 5]  # cache_n + prompt_n
    assert shared.metrics["cached_token_fraction"] == pytest.approx(8 / 15)
    assert shared.metrics["prefix_cache_hit_rate"] is None  # no counters on llama.cpp


@pytest.mark.parametrize("engine", ["llamacpp", "llama-cpp-python"])
def test_a_conversations_prompt_tokens_are_the_clients_count(server, engine) -> None:
    """A turn's prompt tokens are the client's count of what it sent (each user turn's
    ``turn_tokens`` by its tokenizer, the replies' output tokens), not the server's and not
    n/a where the server sends no usage (the embedded llama.cpp server); cached tokens are the
    server's (llama.cpp: ``timings.cache_n``), n/a only where it sends none (issue 31)."""
    server.reset()
    server.prefix_cache_mode(engine)
    session = Session(("w1 w2", "w3 w4 w5"), turn_tokens=(10, 20))
    settings = LevelSettings(
        model="prefix_cache", prompts=("w1 w2",), max_tokens=2, num_requests=1, warmup=0,
        sessions=(session,),
    )  # fmt: skip
    words = lambda text: len(text.split())  # noqa: E731 - the client's tokenizer here
    (talk,) = run_levels(Connection(server.base_url, None, 10.0), [settings], count_tokens=words)
    first, second = sorted(talk.measured, key=lambda r: r.turn)
    assert (first.input_tokens, second.input_tokens) == (10, 10 + 2 + 20)  # the reply "ok ok": 2
    assert talk.metrics["input_tokens_mean_turn2"] == 32
    if engine == "llamacpp":
        assert second.usage_prompt_tokens == 7  # the server's: the words of every message
        assert (first.cached_tokens, second.cached_tokens) == (0, 2)  # turn 1's words
        assert talk.metrics["cached_tokens_mean_turn2"] == 2
    else:
        assert second.usage_prompt_tokens is None and second.cached_tokens is None


def test_sglang_and_vllm_pages_are_parsed_for_the_cache() -> None:
    """The Prometheus text of SGLang (cached tokens by ``cache_source``, summed) and vLLM's
    info gauge (its block size, the one label kept)."""
    page = (
        "# TYPE sglang:cached_tokens counter\n"
        'sglang:cached_tokens_total{model_name="m",cache_source="device"} %d\n'
        'sglang:cached_tokens_total{model_name="m",cache_source="host"} %d\n'
        'sglang:prompt_tokens_total{model_name="m"} %d\n'
        'sglang:cache_hit_rate{model_name="m"} 0.99\n'
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",num_gpu_blocks="None"} 1.0\n'
    )
    before, after = prometheus.parse(page % (10, 5, 100)), prometheus.parse(page % (40, 15, 200))
    assert after["sglang:cached_tokens_total"] == 55.0
    assert cache.prefix_cache_hit_rate(before, after) == pytest.approx(40 / 100)
    assert cache.block_size_tokens(after) == 128
    assert cache.block_size_tokens(prometheus.parse('vllm:cache_config_info{cache_dtype="auto"} 1\n')) is None
    view = prometheus.level_view(before, after)  # the info key is no counter
    assert not any("cache_config_info" in name for name in view)
    # whole blocks: 6 shared of 7, blocks of 4 -> 4 per later request
    requests = [(("p", 6), (f"o{i}", 1)) for i in range(4)]
    assert cache.expected_cached_token_fraction(requests, block_size_tokens=4) == pytest.approx(12 / 28)
    assert cache.expected_cached_token_fraction(requests) == pytest.approx(18 / 28)
    assert cache.expected_cached_token_fraction(requests, block_size_tokens=8) == 0.0


def test_a_reset_refused_by_the_route_and_one_without_an_answer_are_told_apart() -> None:
    import socket

    from tasks.endpoint.cache import reset_refused
    from tasks.endpoint.endpoint_http import reset_prefix_cache

    with socket.socket() as free:  # a port nothing listens on: the server is down
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    why = reset_prefix_cache(f"http://127.0.0.1:{port}/v1", timeout_s=2.0)
    assert why is not None and not why.startswith("HTTP ")
    assert reset_refused(why).startswith(f"the prefix-cache reset got no answer from the server ({why})")
    assert "offers no prefix-cache reset" not in reset_refused(why)
    assert reset_refused("HTTP 404").startswith("the server offers no prefix-cache reset (HTTP 404 at")
