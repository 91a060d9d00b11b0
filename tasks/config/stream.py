"""The stream stage's config: load levels, prompts and workloads (synthetic, files, shared-prefix
groups, recorded traces), the client's clocks and the prefix cache's isolation.

Apart from :mod:`tasks.config.stages` (whose ``_Strict`` it uses) because it is the largest.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tasks import metrics
from tasks.config.stages import DEFAULT_STREAM_PROMPTS, _Strict
from tasks.config.taskrunner import TaskRunner


class StreamConfig(_Strict):
    """The remote stream stage: TTFT / ITL / TPOT / E2E under a concurrency sweep."""

    enabled: bool = Field(True, description="Run this stage.")
    prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_STREAM_PROMPTS),
        min_length=1,
        description="Chat prompts, used round-robin.",
    )
    max_tokens: int = Field(64, ge=1, description="max_completion_tokens per request.")
    max_concurrency: list[int] = Field(
        default_factory=lambda: [1, 4], min_length=1, description="Concurrency levels."
    )
    num_requests: int = Field(
        8,
        ge=1,
        description="Measured requests per level (a trace: its first num_requests rows; "
        "`infermeter stream` without --num-requests sends every row).",
    )
    warmup: int = Field(1, ge=0, description="Warm-up requests before each level (excluded).")
    repeats: int = Field(
        1,
        ge=1,
        description="Run each level this many times in a row, each a fresh start (its own warm-up "
        "and prefix-cache reset); figures pooled, the repeats' spread beside them.",
    )
    temperature: float = Field(0.0, ge=0, description="Sampling temperature for load requests.")
    goodput: dict[str, float] = Field(
        default_factory=dict,
        description="SLOs for goodput, e.g. {ttft_ms: 500, tpot_ms: 50} (metric <= value).",
    )
    request_rate: list[float | None] = Field(
        default_factory=lambda: [None],
        min_length=1,
        description="Request rates in requests/s; null = inf (all at once). Levels are the "
        "cross product max_concurrency x request_rate.",
    )
    burstiness: float = Field(
        1.0, gt=0, description="Gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier."
    )
    seed: int = Field(0, description="Seed of the arrival times and of synthetic prompts.")
    input_len: int | None = Field(
        None, ge=1, description="Synthetic prompts of this many random tokens (replaces prompts)."
    )
    output_len: int | None = Field(
        None, ge=1, description="Ask for exactly this many output tokens (max_tokens + ignore_eos)."
    )
    ignore_eos: bool = Field(False, description="Send ignore_eos: true (vLLM, llama.cpp take it).")
    client_bound_tolerance_ms: float = Field(
        1.0,
        gt=0,
        description="On the user clock, a level is client-bound when the client's event-loop lag "
        "p99 exceeds this (ms); on the kernel clock, the error (ms) past which a coalesced ITL "
        "gap is doubtful (client_bound_coalesced_fraction).",
    )
    arrival_clock: Literal["kernel", "user"] = Field(
        "kernel",
        description="Clock of the chunk arrivals: kernel (the kernel's receive time of each read; "
        "Linux with the sse transport, else the user clock, said in the log) or user (when "
        "the client's event loop read it).",
    )
    client_bound_coalesced_fraction: float = Field(
        0.01,
        ge=0,
        le=1,
        description="On the kernel clock, a level is client-bound when more than this fraction "
        "of its ITL gaps may be off by over client_bound_tolerance_ms: chunks that came in one "
        "read (one stamp) after the client's loop had been behind longer than that (chunks a "
        "server wrote together, read late, are exact and not counted).",
    )
    client_processes: int | None = Field(
        None,
        ge=1,
        description="Client processes per level (at most its concurrency), for loads one core "
        "cannot drive; records merged, clocks comparable. Empty = one per 128 concurrent "
        "streams, at most one per CPU core.",
    )
    task_runner: TaskRunner = Field(
        "threads",
        description="Where each level's client runs: threads (client processes on this machine, "
        "client_processes), or spread over Dask workers, one client per worker, each on its share "
        "of the streams and of the schedule, clocks aligned by round trips: dask (a LocalCluster, "
        "one worker per core), dask:N (N workers) or dask:ADDRESS (a scheduler's workers, e.g. "
        "dask:tcp://10.0.0.5:8786).",
    )
    duration_s: float | None = Field(
        None,
        gt=0,
        description="Seconds of sending per level: after it no measured request is sent (those in "
        "flight finish and count); num_requests still caps the level. Empty = no time bound.",
    )
    slice_s: float = Field(
        1.0,
        gt=0,
        description="Window of each level's timeline, in seconds: the client's TTFT / ITL / tokens/s / "
        "requests in flight per window beside the server's gauges (sampled every 250 ms), one "
        "MLflow step per window and a stacked plot per level (AIPerf's time slices).",
    )
    api: Literal["chat", "completions", "responses"] = Field(
        "chat",
        description="Endpoint streamed: chat (/chat/completions), completions (/completions) or "
        "responses (/responses, OpenAI's Responses API: text and reasoning deltas, usage from "
        "response.completed).",
    )
    dataset: str | None = Field(
        None,
        description="Workload file: sharegpt:PATH (ShareGPT JSON), jsonl:PATH (prompt, output_len, "
        "input_len per line), or a recorded trace sent at its recorded times: mooncake:PATH "
        "(timestamp, input_length, output_length, hash_ids per line), trace:PATH (no hash_ids; "
        "timestamps in ms) or azure:PATH (Azure's CSV: TIMESTAMP,ContextTokens,GeneratedTokens); "
        "or whole conversations: sharegpt-multiturn:PATH (the human turns replayed, the replies "
        "live); replaces prompts / input_len.",
    )
    turns: int | None = Field(
        None,
        ge=1,
        description="Synthetic conversations of this many turns, each of input_len random tokens, "
        "sent closed loop with the live history; num_requests then counts conversations and "
        "max_concurrency users.",
    )
    think_time_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="A conversation's think time after each reply (seconds, at most an hour; its mean if drawn).",
    )
    think_time_dist: Literal["fixed", "exponential"] = Field(
        "fixed", description="Think times: fixed, or drawn from an exponential of that mean (seeded)."
    )
    time_scale: float = Field(
        1.0, gt=0, description="A trace's speed: 2 sends it twice as fast (its gaps halved)."
    )
    prefix_groups: int | None = Field(
        None,
        ge=1,
        description="Shared-prefix workload: this many groups, each request opening with its "
        "group's prefix_len tokens, then input_len tokens of its own.",
    )
    prefix_len: int | None = Field(None, ge=1, description="Tokens of each group's shared prefix.")
    prefix_popularity: str = Field(
        "uniform", description="How requests pick a group: uniform, or zipf:S (group k weighted 1/k^S)."
    )
    keep_cache: bool = Field(
        False,
        description="Keep the server's prefix cache warm between levels (default: reset it before "
        "each level's measured requests where the server offers a reset, e.g. vLLM's dev mode).",
    )
    salt: int | None = Field(
        None,
        description="Salt of the random prompt tokens (synthetic, shared-prefix, trace). Empty = "
        "drawn per run and recorded, so a second run does not hit the first's prefix cache.",
    )
    cache_block_size_tokens: int | None = Field(
        None,
        ge=1,
        description="The server's prefix-cache block size in tokens, where its metrics do not "
        "publish it (vLLM's vllm:cache_config_info does: 16 on GPU by default, larger on CPU): "
        "the expected cached share counts whole blocks only. Empty = the server's, else "
        "per-token reuse (SGLang's radix cache, llama.cpp).",
    )

    @field_validator("prefix_popularity")
    @classmethod
    def _popularity(cls, value: str) -> str:
        # the grammar of tasks.workload.prefix.parse_popularity (not imported: the workloads
        # import the stream package, which imports the config)
        kind, _, exponent = value.partition(":")
        try:
            ok = value == "uniform" or (kind == "zipf" and float(exponent) > 0)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{value!r}: write uniform or zipf:S with S > 0 (e.g. zipf:1.1)")
        return value

    @model_validator(mode="after")
    def _workload(self) -> StreamConfig:
        if self.prefix_groups is not None:
            if self.prefix_len is None or self.input_len is None:
                raise ValueError(
                    "prefix_groups (--prefix-groups) needs prefix_len (--prefix-len: the shared tokens) "
                    "and input_len (--input-len: each request's own)"
                )
            if self.dataset:
                raise ValueError(
                    "prefix_groups (--prefix-groups) builds its own prompts: give it or dataset (--dataset), not both"
                )
        elif self.prefix_len is not None:
            raise ValueError(
                "prefix_len (--prefix-len) needs prefix_groups (--prefix-groups: how many shared prefixes)"
            )
        if self.client_processes is not None and self.task_runner != "threads":
            raise ValueError(
                "client_processes (--client-processes) counts client processes on this machine; with "
                f"task_runner {self.task_runner} (--task-runner) each Dask worker runs one client: "
                "set the workers with dask:N, or drop one of them"
            )
        trace = (self.dataset or "").partition(":")[0] in ("mooncake", "trace", "azure")
        if trace and any(r is not None for r in self.request_rate):
            raise ValueError(
                "a trace sets its own send times: drop request_rate (--request-rate); speed it with "
                "time_scale (--time-scale)"
            )
        conversation = self.turns is not None or (self.dataset or "").startswith("sharegpt-multiturn:")
        if self.turns is not None and (self.input_len is None or self.dataset):
            raise ValueError(
                "turns (--turns) builds synthetic conversations: it needs input_len (--input-len: "
                "each turn's tokens) and no dataset (--dataset sharegpt-multiturn:PATH replays a file's)"
            )
        if conversation and (self.api == "completions" or self.prefix_groups is not None):
            given = "--api completions" if self.api == "completions" else "--prefix-groups"
            raise ValueError(
                "a conversation (--turns, --dataset sharegpt-multiturn:PATH) is sent as chat "
                f"messages with its own history: drop {given}"
            )
        if not conversation and (self.think_time_s or self.think_time_dist != "fixed"):
            given = (
                "think_time_s (--think-time-s)"
                if self.think_time_s
                else "think_time_dist (--think-time-dist)"
            )
            raise ValueError(
                f"{given} is about the pause between a conversation's turns: give --turns N or "
                "--dataset sharegpt-multiturn:PATH, or drop it"
            )
        if trace and self.burstiness != 1.0:
            raise ValueError(
                f"stream.burstiness (--burstiness) {self.burstiness:g} shapes the gaps between arrivals "
                "at a request rate, but a trace (--dataset mooncake:/trace:/azure:PATH) is sent at its "
                "recorded times: drop burstiness (speed the trace with time_scale, --time-scale)"
            )
        if not trace and self.time_scale != 1.0:
            raise ValueError(
                "time_scale (--time-scale) speeds a recorded trace: give one with --dataset "
                "mooncake:PATH, trace:PATH or azure:PATH, or drop it"
            )
        return self

    def burstiness_unused(self) -> str | None:
        """Why ``burstiness`` (other than 1) cannot shape this stream's arrivals when its levels
        are its own ``request_rate``s (a stream, an audit; not a capacity search, which sets
        the rates): every rate is inf, all requests at once. None when it can (or is 1)."""
        if self.burstiness == 1.0 or any(rate is not None for rate in self.request_rate):
            return None
        return (
            f"stream.burstiness (--burstiness) {self.burstiness:g} shapes the gaps between arrivals at "
            "a request rate, but every stream.request_rate (--request-rate) is inf (all requests at "
            "once): give a rate (e.g. --request-rate 4) or leave burstiness at 1"
        )

    @field_validator("max_concurrency")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("every concurrency must be >= 1")
        return values

    @field_validator("request_rate")
    @classmethod
    def _rates(cls, values: list[float | None]) -> list[float | None]:
        out: list[float | None] = []
        for v in values:
            if v is None or (math.isinf(v) and v > 0):
                out.append(None)
            elif not (v > 0 and math.isfinite(v)):
                raise ValueError("every request rate must be > 0 (requests/s) or null for inf")
            else:
                out.append(v)
        return out

    @field_validator("goodput")
    @classmethod
    def _slo_names(cls, slos: dict[str, float]) -> dict[str, float]:
        allowed = metrics.SLO_METRICS
        for name, value in slos.items():
            if name not in allowed:
                raise ValueError(f"unknown SLO {name!r}; use one of {sorted(allowed)}")
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a positive number of milliseconds")
        return slos
