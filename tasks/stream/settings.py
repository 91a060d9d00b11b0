"""What one load level needs, typed: :class:`LevelSettings` (the requests and their arrivals)
and :class:`Connection` (where they go), built once per level from the stage's config.

``--max-concurrency`` reaches the level's ``asyncio.Semaphore`` through one field: the CLI /
YAML fill ``StreamConfig.max_concurrency`` (a list), :func:`settings_from_config` makes one
:class:`LevelSettings` per level with its ``max_concurrency``, and
:func:`tasks.stream.load.run_level` opens ``asyncio.Semaphore(settings.max_concurrency)``.

Imports only the standard library (the config and endpoint types are read by attribute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.config import StreamConfig
    from tasks.endpoint.spec import Endpoint


@dataclass(frozen=True)
class Session:
    """One conversation (``tasks.workload.conversation``): its user turns in order, each
    turn's ``max_tokens`` (None entries / None: the level's), the think time in seconds after
    each turn but the last (``think_s[k]`` after turn ``k + 1``'s reply; empty: none), its
    row in a file (1-based; None: synthetic), and each user turn's token count by the client's
    tokenizer (without special tokens; None: not counted), from which a turn's
    ``input_tokens`` is the client's count of its whole history (``tasks.stream.load``)."""

    turns: tuple[str, ...]
    output_lens: tuple[int | None, ...] | None = None
    think_s: tuple[float, ...] = ()
    row: int | None = None
    turn_tokens: tuple[int | None, ...] | None = None


@dataclass(frozen=True)
class LevelSettings:
    """One load level (vLLM ``benchmark_serving.py``: ``--max-concurrency`` x ``--request-rate``).

    Attributes:
        model: the model name sent in each request.
        prompts: used round-robin: warm-up from the first prompt on, measured requests after
            the warm-up ones (so a server's prefix cache does not hand the first measured
            request the warm-up's prompt).
        max_tokens: ``max_completion_tokens`` (and ``max_tokens``) of each request.
        num_requests: measured requests; warmup: sequential warm-up requests before them.
        max_concurrency: most measured requests in flight at once (>= 1).
        level: the level's index (request ids ``l{level}-w{i}`` / ``l{level}-r{i}``).
        repeats: times the level is run in a row, each a fresh start (its own warm-up and
            prefix-cache reset; ``tasks.scaleout.levels``); repeat: which of them this is (0-based;
            with ``repeats > 1`` the ids carry it: ``l{level}-k{repeat}-r{i}``, :attr:`id_prefix`).
        prompt_tokens: optional token count of each prompt (parallel to ``prompts``), stored
            as ``input_tokens``; None leaves it to the server's usage.
        request_rate: arrivals in requests/s (None = inf: all at once, a closed loop);
            burstiness: gamma shape of the inter-arrival times (1 = Poisson); seed: of the
            arrivals (``tasks.stream.load.arrival_offsets_s``).
        sampling: sampling keys sent with each request (``temperature`` ...).
        extra_body: extra request-body fields (``{"ignore_eos": True}``), or None.
        api_key_env: the NAME of the key's variable, for the message of a 401/403.
        server_pid: the embedded server this command started, where it is the endpoint: a
            request refused or cut after its death is ``server_died``, and the level stops
            sending (``tasks.engines.death``).
        lag_tolerance_ms: the client-bound threshold on the event-loop lag's p99 (ms), for
            the user clock; coalesced_tolerance: on the coalesced fraction of the ITL gaps,
            for the kernel clock (``tasks.stream.quality``).
        duration_s: None, or the seconds of sending: no measured request is sent once this
            long has passed since the first measured arrival (those in flight finish and
            count); ``num_requests`` still caps the level, whichever comes first.
        api: ``"chat"`` (``/chat/completions``), ``"completions"`` (``/completions``) or
            ``"responses"`` (``/responses``: ``tasks.wire.responses``).
        output_lens: optional ``max_tokens`` per prompt (parallel to ``prompts``; a dataset's
            per-request output lengths, sent with ``ignore_eos``; a None entry and None =
            ``max_tokens``).
        schedule_s: a recorded schedule instead of a rate: measured request ``i`` is sent
            ``schedule_s[i]`` seconds after the first (a trace replayed,
            ``tasks.workload.trace``); ``num_requests`` at most its length. None: the rate's.
        prompt_blocks: each prompt's blocks ``((key, tokens), ...)`` (parallel to ``prompts``;
            ``tasks.workload.stage.StageWorkload.blocks``), for the expected prefix-cache share;
            None: not known.
        prompt_groups: each prompt's shared-prefix group (recorded as ``prefix_group``), or None.
        reset_cache: reset the server's prefix cache before the measured requests (where it
            offers a reset: ``tasks.endpoint.endpoint_http.reset_prefix_cache``).
        sessions: conversations instead of single requests: measured "request" ``i`` is the
            closed-loop session ``sessions[i % len]`` of one user (its turns sent one after
            the other, each with the history of earlier turns and the replies the server gave:
            ``tasks.stream.load``); ``num_requests`` counts sessions, ``max_concurrency``
            users. None: single requests.
        cache_block_size_tokens: the server's prefix-cache block size in tokens where its
            metrics do not say it (``StreamConfig.cache_block_size_tokens``): the expected
            share counts whole blocks (``tasks.endpoint.cache.expected_cached_token_fraction``). None:
            the server's ``vllm:cache_config_info``, else per-token reuse.

    ``sampling`` / ``extra_body`` are plain dicts (picklable for client processes); treat
    them as read-only.
    """

    model: str
    prompts: tuple[str, ...]
    max_tokens: int
    num_requests: int
    max_concurrency: int = 1
    warmup: int = 0
    level: int = 0
    prompt_tokens: tuple[int | None, ...] | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0
    sampling: dict[str, Any] | None = None
    extra_body: dict[str, Any] | None = None
    api_key_env: str | None = None
    server_pid: int | None = None
    lag_tolerance_ms: float = 1.0
    coalesced_tolerance: float = 0.01
    duration_s: float | None = None
    api: str = "chat"
    output_lens: tuple[int | None, ...] | None = None
    schedule_s: tuple[float, ...] | None = None
    prompt_blocks: tuple[tuple[tuple[str, int], ...], ...] | None = None
    prompt_groups: tuple[int | None, ...] | None = None
    reset_cache: bool = False
    sessions: tuple[Session, ...] | None = None
    repeats: int = 1
    repeat: int = 0
    cache_block_size_tokens: int | None = None

    def __post_init__(self) -> None:  # lists from callers become tuples (frozen all through)
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if self.prompt_tokens is not None:
            object.__setattr__(self, "prompt_tokens", tuple(self.prompt_tokens))
        if self.output_lens is not None:
            object.__setattr__(self, "output_lens", tuple(self.output_lens))
        if self.schedule_s is not None:
            object.__setattr__(self, "schedule_s", tuple(self.schedule_s))

    #: The fields that hold one entry per prompt (parallel to ``prompts``).
    PER_PROMPT = ("prompts", "prompt_tokens", "output_lens", "prompt_blocks", "prompt_groups")

    def after_warmup(self) -> LevelSettings:
        """These settings with no warm-up and every per-prompt field (:attr:`PER_PROMPT`)
        rotated to start where the measured requests start (``tasks.scaleout.multiproc``: each
        client process sends its share of the measured requests; the warm-up runs apart)."""
        rotated = {}
        for name in self.PER_PROMPT:
            values = getattr(self, name)
            if values:
                turn = self.warmup % len(values)
                rotated[name] = values[turn:] + values[:turn]
        return replace(self, warmup=0, **rotated)

    @property
    def id_prefix(self) -> str:
        """What request and session ids start with: ``l{level}``, or ``l{level}-k{repeat}`` when
        the level is repeated (ids unique across its repeats; :meth:`prompt_index` reads the
        part after the last ``-``)."""
        return f"l{self.level}" if self.repeats == 1 else f"l{self.level}-k{self.repeat}"

    def max_tokens_at(self, index: int) -> int:
        """``max_tokens`` of the request on prompt ``index`` (round-robin, as the prompts)."""
        if not self.output_lens:
            return self.max_tokens
        return self.output_lens[index % len(self.output_lens)] or self.max_tokens

    def prompt_index(self, request_id: str) -> int:
        """The prompt index of a request id (``l{level}-w{i}`` -> i, ``l{level}-r{i}`` and a
        session's turn ``l{level}-r{i}.{turn}`` -> warmup + i; a repeat's ``l{level}-k{k}-...``
        alike), the inverse of
        :func:`tasks.stream.load.run_level`'s numbering."""
        last = request_id.rsplit("-", 1)[1]
        number = int(last[1:].partition(".")[0])
        return number if last[0] == "w" else self.warmup + number

    def asked_max_tokens(self, request_id: str) -> int:
        """``max_tokens`` the request was sent with: a session turn's own, else the prompt's."""
        index = self.prompt_index(request_id)
        turn = request_id.rpartition(".")[2] if "." in request_id else None
        if self.sessions and turn is not None:
            session = self.sessions[(index - self.warmup) % len(self.sessions)]
            return session_max_tokens(session, int(turn) - 1, self.max_tokens)
        return self.max_tokens_at(index)

    @property
    def ignore_eos(self) -> bool:
        """``ignore_eos`` is sent: a short output then means the server did not take it."""
        return bool((self.extra_body or {}).get("ignore_eos"))


def session_max_tokens(session: Session, turn_index: int, default: int) -> int:
    """``max_tokens`` of a session's turn ``turn_index`` (0-based): its own, else ``default``."""
    lens = session.output_lens
    return (lens[turn_index] if lens and turn_index < len(lens) else None) or default


@dataclass(frozen=True)
class Connection:
    """Where a level's requests go: the endpoint's base_url, the key itself (never logged), the
    per-read timeout in seconds, the transport and the arrival clock asked for, the CA bundle
    trusted for its TLS (a path, None: the system store or ``SSL_CERT_FILE``; on a Dask worker
    the path is the worker's) (``tasks.stream.load.make_client``)."""

    base_url: str
    api_key: str | None = None
    request_timeout_s: float = 120.0
    transport: str = "sse"
    arrival_clock: str = "kernel"
    ca_bundle: str | None = None

    @classmethod
    def of(cls, endpoint: Endpoint, arrival_clock: str = "kernel") -> Connection:
        """The endpoint's connection, its key read from the named variable.

        Raises:
            EndpointError: the endpoint's api_key_env names an unset variable.
        """
        return cls(
            endpoint.base_url,
            endpoint.api_key(),
            endpoint.request_timeout_s,
            arrival_clock=arrival_clock,
            ca_bundle=endpoint.ca_bundle,
        )


def level_grid(
    concurrencies: Sequence[int], request_rates: Sequence[float | None] = (None,)
) -> list[tuple[int, float | None]]:
    """The levels: the cross product concurrency x rate, concurrency-major
    (``[1, 4] x [2, None]`` -> ``(1, 2), (1, None), (4, 2), (4, None)``)."""
    return [(c, r) for c in concurrencies for r in (request_rates or [None])]


def level_settings(
    base: LevelSettings,
    concurrencies: Sequence[int],
    request_rates: Sequence[float | None] = (None,),
) -> list[LevelSettings]:
    """One settings per level of :func:`level_grid` (concurrency-major):
    level ``i`` gets ``level=i``, its concurrency and rate, and seed ``base.seed + i`` (each
    level draws its own arrivals)."""
    return [
        replace(base, level=index, max_concurrency=concurrency, request_rate=rate, seed=base.seed + index)
        for index, (concurrency, rate) in enumerate(level_grid(concurrencies, request_rates))
    ]


def settings_from_config(cfg: StreamConfig, endpoint: Endpoint, workload: Any) -> list[LevelSettings]:
    """The stream stage's levels: ``cfg.max_concurrency`` x ``cfg.request_rate``.

    ``workload`` (a ``tasks.workload.stage.StageWorkload``; not imported: the workload is a
    sibling that must not import back): the prompts and their token counts,
    per-request output lengths (then ``ignore_eos`` is sent, so each request produces its row's
    length), blocks and groups, and a trace's schedule and request count.

    ``max_tokens`` is ``cfg.output_len`` when set (then ``ignore_eos`` is sent, as with
    ``cfg.ignore_eos``), else ``cfg.max_tokens``; sampling is ``cfg.temperature``; the prefix
    cache is reset before each level's measured requests unless ``cfg.keep_cache``.
    """
    lens = workload.output_lens
    base = LevelSettings(
        model=endpoint.model,
        prompts=tuple(workload.prompts),
        max_tokens=cfg.output_len or cfg.max_tokens,
        num_requests=workload.num_requests,
        warmup=cfg.warmup,
        prompt_tokens=workload.prompt_tokens,
        burstiness=cfg.burstiness,
        seed=cfg.seed,
        sampling={"temperature": cfg.temperature},
        extra_body={"ignore_eos": True} if (cfg.ignore_eos or cfg.output_len or lens) else None,
        api_key_env=endpoint.api_key_env,
        server_pid=endpoint.server_pid,
        lag_tolerance_ms=cfg.client_bound_tolerance_ms,
        coalesced_tolerance=cfg.client_bound_coalesced_fraction,
        duration_s=cfg.duration_s,
        api=cfg.api,
        output_lens=lens or None,
        schedule_s=workload.schedule_s,
        prompt_blocks=workload.blocks,
        prompt_groups=workload.groups,
        reset_cache=not cfg.keep_cache,
        sessions=workload.sessions,
        repeats=cfg.repeats,
        cache_block_size_tokens=cfg.cache_block_size_tokens,
    )
    return level_settings(base, cfg.max_concurrency, cfg.request_rate)
