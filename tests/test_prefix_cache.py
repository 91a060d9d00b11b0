"""The server's prefix cache over a level (tasks/cache.py), on the instrument's ``prefix_cache``
scenario: a cache over the prompt's words whose counters carry vLLM's names, and whose usage
reports ``prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks import cache
from tasks.stream.levels import run_levels
from tasks.stream.settings import Connection, LevelSettings

try:
    from tests import groundtruth_server as gt
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


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
