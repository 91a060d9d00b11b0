"""The entries of the registry: every metric the project logs, grouped by stage.

Add a metric here (and nowhere else); :mod:`tasks.metrics` answers every question about it.
"""

from __future__ import annotations

from tasks.metrics.derived import LEVEL_DERIVED
from tasks.metrics.metric import STAT_NAMES, Metric

_ALL = STAT_NAMES
_LAT, _TPUT, _MEM = "higher", "lower", "higher"  # the usual worse direction of each kind

#: Every metric the project logs, grouped by stage (order = the doc table's order).
_CI_STREAM = tuple(
    f"{m}_{s}" for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms") for s in ("mean", "p50", "p90", "p99")
)
REGISTRY: tuple[Metric, ...] = (
    # tokenize (tasks/tokenize/stage.py summary_metrics); only the model's own count is comparable
    Metric(
        "token_count_model_total",
        "tokens",
        "tokenize",
        "All prompts' tokens under the model's own tokenizer.",
        "higher",
        comparable=True,
    ),
    Metric(
        "token_count_<tokenizer>_total", "tokens", "tokenize", "All prompts' tokens, per tokenizer.", "higher"
    ),
    Metric(
        "chars_per_token_<tokenizer>_mean",
        "chars/token",
        "tokenize",
        "All prompts' characters over their tokens.",
        "lower",
    ),
    # local profile, per point (tasks/profile/measure.py profile_point, runner.run_sweep)
    Metric(
        "prefill_ms",
        "ms",
        "profile",
        "One forward over the prompt (median of the repeats).",
        _LAT,
        comparable=True,
    ),
    Metric("ttft_local_ms", "ms", "profile", "prefill_ms under the stream stage's name.", _LAT),
    Metric(
        "prefill_tokens_per_s",
        "tokens/s",
        "profile",
        "batch x prompt tokens / prefill time.",
        _TPUT,
        comparable=True,
    ),
    Metric(
        "decode_ms",
        "ms",
        "profile",
        "One decode step (the median repeat's steps).",
        _LAT,
        _ALL,
        comparable=True,
    ),
    Metric("decode_step_ms", "ms", "profile", "Each decode step, one MLflow step each (a series).", _LAT),
    Metric("decode_tokens_per_s", "tokens/s", "profile", "batch / decode_ms_p50.", _TPUT, comparable=True),
    Metric("weights_bytes", "bytes", "profile", "The model's parameters and buffers.", _MEM, comparable=True),
    Metric(
        "kv_cache_bytes",
        "bytes",
        "profile",
        "KV-cache tensors after decode (measured).",
        _MEM,
        comparable=True,
    ),
    Metric("kv_cache_bytes_after_prefill", "bytes", "profile", "KV-cache tensors after prefill.", _MEM),
    Metric(
        "kv_cache_bytes_formula",
        "bytes",
        "profile",
        "batch x positions x 2 x layers x kv_heads x head_dim x dtype bytes.",
        _MEM,
    ),
    Metric("kv_cache_bytes_formula_after_prefill", "bytes", "profile", "The formula after prefill.", _MEM),
    Metric(
        "kv_cache_bytes_seed_formula",
        "bytes",
        "profile",
        "The seed's form (hidden_size: too large under GQA).",
        _MEM,
    ),
    Metric("kv_seed_formula_ratio", "ratio", "profile", "Seed formula / formula (> 1 under GQA)."),
    Metric("kv_cache_positions", "positions", "profile", "Positions in the cache after decode."),
    Metric("kv_cache_positions_after_prefill", "positions", "profile", "Positions after prefill."),
    Metric(
        "peak_memory_bytes",
        "bytes",
        "profile",
        "CUDA: max allocated; CPU: peak RSS minus the RSS before.",
        _MEM,
        comparable=True,
    ),
    Metric("peak_memory_baseline_bytes", "bytes", "profile", "Memory in use before the point."),
    Metric("peak_memory_reserved_bytes", "bytes", "profile", "CUDA: max reserved by the allocator.", _MEM),
    Metric("memory_estimate_bytes", "bytes", "profile", "The runner's estimate before the point.", _MEM),
    Metric(
        "decode_bandwidth_gb_per_s",
        "GB/s",
        "profile",
        "CUDA: bytes read per step x steps / decode time.",
        _TPUT,
    ),
    Metric("gpu_power_w", "W", "profile", "NVML board power, timed runs.", "higher", ("mean", "max")),
    Metric("gpu_utilization_pct", "%", "profile", "NVML utilisation, timed runs.", None, ("mean", "max")),
    Metric("gpu_energy_joules", "J", "profile", "NVML energy counter, end - start.", "higher"),
    Metric("gpu_metric_samples", "count", "profile", "NVML sampling rounds."),
    # the point's settings and the model's shape, echoed as metrics (neutral)
    *(
        Metric(name, unit, "profile", text)
        for name, unit, text in (
            ("prompt_tokens", "tokens", "Prompt length of the point."),
            ("batch_size", "sequences", "Batch size of the point."),
            ("max_new_tokens", "tokens", "Decode steps of the point."),
            ("new_tokens_per_sequence", "tokens", "max_new_tokens + 1 (prefill's token)."),
            ("prefill_chunk_size", "tokens", "Chunked prefill size; 0 = the whole prompt at once."),
            ("prefill_chunks", "count", "Forwards the prefill took."),
            ("repeats", "count", "Timed repeats of the point."),
            ("warmup", "count", "Untimed warm-up runs of the point."),
            ("torch_num_threads", "threads", "torch.get_num_threads() during the point."),
            ("num_layers", "count", "Decoder layers of the model."),
            ("num_attention_heads", "count", "Attention heads per layer."),
            ("num_kv_heads", "count", "Key/value heads per layer (< heads under GQA)."),
            ("head_dim", "count", "Dimension of one attention head."),
            ("hidden_size", "count", "Hidden size of the model."),
            ("profile_points", "count", "Points of the profile grid (stage run)."),
        )
    ),
    Metric("profile_failed_points", "count", "profile", "Points that failed (stage run).", "higher"),
    # --breakdown (issue 12): profiled per-part time and the roofline (tasks/profile/breakdown.py,
    # roofline.py; flattened by breakdown_report.analysis_metrics); profiled runs, not the timed ones
    Metric(
        "breakdown_prefill_<part>_ms", "ms", "profile", "Profiled prefill: one part's exclusive time.", _LAT
    ),
    Metric(
        "breakdown_decode_<part>_ms", "ms", "profile", "Profiled mean decode step: one part's time.", _LAT
    ),
    Metric("copy_bandwidth_gb_per_s", "GB/s", "profile", "Measured copy bandwidth (read + write)."),
    Metric("matmul_flop_per_s", "FLOP/s", "profile", "Measured n x n matmul rate."),
    Metric("ridge_flop_per_byte", "FLOP/B", "profile", "matmul_flop_per_s / copy bandwidth."),
    *(
        Metric(f"{phase}_{name}", unit, "profile", f"{where}: {text}", worse)
        for phase, where in (("prefill", "Prefill"), ("decode", "Mean decode step"))
        for name, unit, text, worse in (
            ("flops", "FLOP", "2 x matmul weights x tokens + causal attention.", None),
            ("bytes", "bytes", "Weights read + KV cache (measured tensors).", None),
            ("arithmetic_intensity_flop_per_byte", "FLOP/B", "flops / bytes.", None),
            ("achieved_flop_per_s", "FLOP/s", "flops / timed time.", _TPUT),
            ("achieved_bandwidth_gb_per_s", "GB/s", "bytes / timed time.", _TPUT),
            ("bandwidth_fraction", "fraction", "Achieved / measured copy bandwidth.", _TPUT),
            ("compute_fraction", "fraction", "Achieved / measured matmul rate.", _TPUT),
            ("memory_bound", "0/1", "1 when intensity < ridge point.", None),
        )
    ),
    # remote stream, per level (tasks/stats.py aggregate_level, tasks/stream/*); DESIGN.md has
    # the contract of each latency
    Metric(
        "ttft_ms", "ms", "stream", "Send -> first text-carrying chunk.", _LAT, _ALL, slo=True, comparable=True
    ),
    Metric(
        "tpot_ms",
        "ms",
        "stream",
        "(e2e_ms - ttft_ms) / (output_tokens - 1), per request.",
        _LAT,
        _ALL,
        slo=True,
        comparable=True,
    ),
    Metric(
        "e2e_ms", "ms", "stream", "Send -> last text-carrying chunk.", _LAT, _ALL, slo=True, comparable=True
    ),
    Metric(
        "itl_ms",
        "ms",
        "stream",
        "Every gap between text chunks, pooled over requests.",
        _LAT,
        _ALL,
        slo=True,
        comparable=True,
    ),
    Metric("num_requests", "count", "stream", "Measured requests (warm-ups excluded)."),
    Metric("num_succeeded", "count", "stream", "Requests with a token and no error."),
    Metric("num_errors", "count", "stream", "Failed requests.", "higher"),
    Metric("error_rate", "fraction", "stream", "num_errors / num_requests.", "higher", comparable=True),
    Metric("errors_<class>", "count", "stream", "Failed requests of one error class.", "higher"),
    Metric("error_after_ms", "ms", "stream", "Send -> the error, failed requests.", None, ("p50", "max")),
    Metric("num_refusals", "count", "stream", "Answers that were refusals (delta.refusal text)."),
    Metric("output_tokens_total", "tokens", "stream", "Output tokens of the successful requests."),
    Metric("input_tokens_total", "tokens", "stream", "Prompt tokens of the successful requests."),
    Metric(
        "total_tokens_per_s",
        "tokens/s",
        "stream",
        "Input + output tokens / wall time.",
        _TPUT,
    ),
    Metric(
        "output_tokens_per_s", "tokens/s", "stream", "All output tokens / wall time.", _TPUT, comparable=True
    ),
    Metric(
        "requests_per_s", "requests/s", "stream", "Successful requests / wall time.", _TPUT, comparable=True
    ),
    Metric(
        "goodput_requests_per_s",
        "requests/s",
        "stream",
        "Requests within every SLO / wall time.",
        _TPUT,
        comparable=True,
    ),
    Metric("goodput_fraction", "fraction", "stream", "Requests within every SLO / requests.", _TPUT),
    Metric("num_short_outputs", "count", "stream", "Successes with fewer tokens than asked.", "higher"),
    Metric(
        "prefix_cache_hit_rate",
        "fraction",
        "stream",
        "Server's prefix-cache hits / queries, counter increases over the level (vLLM; SGLang's cached / prompt tokens).",
    ),
    Metric(
        "cached_token_fraction",
        "fraction",
        "stream",
        "usage cached_tokens (else llama.cpp timings.cache_n) / usage prompt_tokens of the level's successes.",
    ),
    Metric(
        "cache_block_size_tokens",
        "tokens",
        "stream",
        "Cache block size the expected share counts whole blocks of (server's vllm:cache_config_info, else the user's); empty: per-token.",
    ),
    *LEVEL_DERIVED,  # repeats, intervals, turns: tasks/metrics/derived.py
    Metric(
        "recorded_request_rate",
        "requests/s",
        "stream",
        "A replayed trace's requests / its recorded span (beside achieved_request_rate).",
    ),
    Metric(
        "schedule_faithful",
        "0/1",
        "stream",
        "A replayed trace: 1 when send_lateness_ms_p99 <= 10 ms, else 0 (flagged).",
        "lower",
    ),
    Metric(
        "expected_cached_token_fraction",
        "fraction",
        "stream",
        "Prompt tokens a perfect prefix cache would supply, from the workload's construction.",
    ),
    Metric(
        "prefix_cache_reset",
        "0/1",
        "stream",
        "1: the server's prefix cache was reset before the level's measured requests; 0: refused.",
    ),
    Metric(
        "num_decode_unobserved",
        "count",
        "stream",
        "Successes with no visible decode (one token, one chunk or one read): no TPOT, not judged on TPOT/ITL SLOs.",
    ),
    Metric(
        "num_usage_untrusted",
        "count",
        "stream",
        "Requests whose server usage count was not used (the tokenizer counted).",
        "higher",
    ),
    Metric(
        "client_loop_lag_ms",
        "ms",
        "stream",
        "How late the client's event loop read arrived data.",
        _LAT,
        ("p50", "p99", "max"),
    ),
    Metric("client_loop_lag_samples", "count", "stream", "Loop-lag samples kept."),
    Metric(
        "num_clock_fallbacks",
        "count",
        "stream",
        "Requests on the user clock although the kernel's was asked for (the warning names them and why).",
        "higher",
    ),
    Metric(
        "client_bound",
        "0/1",
        "stream",
        "1 when the client may have limited the figures: on the kernel clock, more than "
        "client_bound_coalesced_fraction of the ITL gaps may be off by over the tolerance (chunks "
        "in one read after the loop was behind longer than it; not coalesced_event_fraction), on "
        "the user clock client_loop_lag_ms_p99 past its tolerance.",
        "higher",
    ),
    Metric(
        "coalesced_events",
        "count",
        "stream",
        "Text chunks read late in one read with the chunk before (kernel clock; they share a stamp).",
        "higher",
    ),
    Metric(
        "coalesced_event_fraction",
        "fraction",
        "stream",
        "coalesced_events / ITL gaps (kernel clock).",
        "higher",
    ),
    Metric(
        "achieved_request_rate",
        "requests/s",
        "stream",
        "Measured sends / time from the first to the last send (vLLM #21104).",
        _TPUT,
    ),
    Metric(
        "send_lateness_ms_p50",
        "ms",
        "stream",
        "Send minus the schedule's arrival (a finite rate or a trace; slot wait included), p50.",
        _LAT,
    ),
    Metric(
        "send_lateness_ms_p99",
        "ms",
        "stream",
        "Send minus the schedule's arrival (a finite rate or a trace; slot wait included), p99.",
        _LAT,
    ),
    Metric("client_cpu_us_per_chunk", "us", "stream", "Client CPU time / text chunks received.", _LAT),
    Metric(
        "clock_offset_drift_ms",
        "ms",
        "stream",
        "Change of CLOCK_REALTIME - CLOCK_MONOTONIC over the level (kernel stamps are converted by it).",
        _LAT,
    ),
    Metric("client_processes", "count", "stream", "Client processes that drove the level."),
    Metric("client_workers_lost", "count", "stream", "Dask workers lost mid-level.", "higher"),
    Metric("requests_lost", "count", "stream", "Requests of lost Dask workers never received.", "higher"),
    Metric("server_<series>_delta", "as served", "stream", "Prometheus counter increase over the level."),
    Metric(
        "server_<series>",
        "as served",
        "stream",
        "Prometheus histogram mean and quantiles over the level.",
        None,
        ("mean", "p50", "p90", "p99"),
    ),
    *(
        Metric(
            f"server_{m}_ms",
            "ms",
            "stream",
            f"The server's own {m} (vLLM /metrics).",
            _LAT,
            ("mean", "p50", "p90", "p99"),
        )
        for m in ("ttft", "tpot", "e2e", "itl", "queue")
    ),
    *(
        Metric(f"{m}_ms_mean_client_minus_server", "ms", "stream", f"{m}_ms_mean - server_{m}_ms_mean.")
        for m in ("ttft", "tpot", "e2e", "itl")
    ),
    Metric(
        "server_client_disagree", "0/1", "stream", "1 when client and server TTFT/E2E disagree.", "higher"
    ),
    # capacity search (issue 15, tasks/stream/capacity.py): on the capacity flow's parent run
    Metric(
        "capacity_requests_per_s", "requests/s", "stream", "Highest rate meeting the goodput target.", "lower"
    ),
    Metric("capacity_output_tokens_per_s", "tokens/s", "stream", "Output tokens/s at the capacity.", "lower"),
    Metric("capacity_bracket_low_requests_per_s", "requests/s", "stream", "Capacity bracket: lower end."),
    Metric("capacity_bracket_high_requests_per_s", "requests/s", "stream", "Capacity bracket: upper end."),
    Metric("capacity_levels", "count", "stream", "Levels the capacity search ran."),
    Metric("capacity_level_passed", "0/1", "stream", "1 when the level met the goodput target (level run)."),
    # engine tuning (issue 20, tasks/tune, tasks/pipeline/tune.py): configuration child and parent
    Metric(
        "server_startup_s", "s", "tune", "Server launch until /v1/models answered (configuration run).", _LAT
    ),
    Metric("tune_configurations", "count", "tune", "Configurations of the tune run (parent)."),
    Metric("tune_configurations_failed", "count", "tune", "Configurations that FAILED.", "higher"),
    Metric("tune_configurations_resumed", "count", "tune", "Configurations read back from earlier runs."),
    Metric("tune_pareto_points", "count", "tune", "Levels on the throughput / per-user front."),
    Metric("tune_best_output_tokens_per_s", "tokens/s", "tune", "Output tokens/s of the best level.", _TPUT),
    Metric(
        "tune_best_goodput_requests_per_s", "requests/s", "tune", "Goodput of the best level (SLOs).", _TPUT
    ),
    Metric("tune_best_capacity_requests_per_s", "requests/s", "tune", "Capacity of the best (mean).", _TPUT),
    # sampling sweep, per point (tasks/sweep point_metrics) and on the stage run
    Metric("num_samples", "count", "sweep", "Samples of the point."),
    Metric("num_samples_failed", "count", "sweep", "Samples that failed.", "higher"),
    Metric("identical_fraction", "fraction", "sweep", "Share of samples equal to the commonest."),
    Metric("distinct_1", "fraction", "sweep", "Distinct / all unigrams (model tokens)."),
    Metric("distinct_2", "fraction", "sweep", "Distinct / all bigrams (model tokens)."),
    Metric("output_tokens_mean", "tokens", "sweep", "Mean output length of the samples."),
    Metric("output_tokens_std", "tokens", "sweep", "Population std of the output lengths."),
    Metric("determinism_violated", "0/1", "sweep", "1 when a greedy point's outputs differ.", "higher"),
    Metric("sweep_points", "count", "sweep", "Points of the sweep (stage run)."),
    Metric("sweep_points_skipped", "count", "sweep", "Points resumed from earlier runs."),
    Metric("sweep_points_failed", "count", "sweep", "Points with a failed sample.", "higher"),
    Metric("sweep_determinism_violations", "count", "sweep", "Points with determinism_violated.", "higher"),
    # the sampler's view (issue 12, tasks/sweep/distribution.py): per decode step, one series each
    Metric("next_token_entropy_bits_t<temperature>", "bits", "sweep", "Next-token entropy at a temperature."),
)

#: The figures whose range over a level's repeats is logged (``<figure>_repeat_min`` / ``_max``).
REPEAT_SPREAD = tuple(m.name.removesuffix("_repeat") for m in REGISTRY if m.name.endswith("_repeat"))
