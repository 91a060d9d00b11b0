"""The answer of a tune run: each measured level a point, the Pareto front, the best under SLOs.

A point is one load level of one configuration (a configuration measured at concurrency 1 and
8 gives two points), with the two sides of the trade-off every serving engine makes:

- ``output_tokens_per_s``: what one instance produces (all output tokens over the level's
  wall time; the level's own figure);
- ``per_user_tokens_per_s`` = 1000 / ``tpot_ms_p50``: how fast one user's text arrives once it
  started (the median request's decode speed), and ``ttft_ms_p99``: how long the unluckiest
  users wait for it to start.

Fronts (vLLM's ``bench sweep plot_pareto`` draws the first; we add the second, the one SLOs on
TTFT care about): a point is on the throughput / per-user front when no other point has at
least its throughput *and* at least its per-user speed, one of them strictly more; on the
throughput / TTFT p99 front likewise with less TTFT p99 better. Points missing a figure (a level
whose requests all failed, or all came in one chunk so TPOT is unknown) are on no front.

With ``tune.repeats`` > 1 a point's figures are the means over its repeats (each repeat a fresh
server, in interleaved rounds: :mod:`tasks.tune.repeats`), and its objective figures carry
Student's t interval over them (``<figure>_ci_low`` / ``_ci_high``, :mod:`tasks.tune.rule`).

Best under the SLOs: among points whose ``goodput_fraction`` (the share of requests within every
SLO, ``tasks.stats``; the mean over the repeats) reaches ``target``, the one with the highest
``goodput_requests_per_s`` (ties: more output tokens/s). Without SLOs, the point with the highest
output tokens/s, and the answer says that is all it means. The top is then *named* best only by
the rule of :mod:`tasks.tune.rule`: where its repeats separate it from every other
configuration's top level; otherwise the answer is "tied within noise", naming the tied ones and
about how many repeats would separate them.

Under ``tune.capacity`` the candidates are the configurations' capacities instead
(:mod:`tasks.tune.capacities`): objective :data:`CAPACITY`, each configuration one point
(level :data:`CAPACITY_LEVEL`) whose sample is its capacity in each repeat, ranked by the mean
and named by the same rule; the search's levels, each at a rate of one repeat's own, are no
sample of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tasks.tune.rule import DEFAULT_CONFIDENCE, MAX_REPEATS, Comparison, decide, repeat_interval

#: the figures a point gives an interval over its repeats (the objectives of the best)
INTERVAL_FIGURES = ("output_tokens_per_s", "goodput_requests_per_s")
#: the objective under ``tune.capacity``: the capacity search's answer, requests/s
CAPACITY = "capacity_requests_per_s"
#: the ``level`` of a configuration's capacity point (not one of its levels)
CAPACITY_LEVEL = -1


@dataclass(frozen=True)
class TunePoint:
    """One level of one configuration.

    Attributes:
        configuration: the configuration's index in the run.
        label: its parameters, ``max_num_seqs=4``.
        level: the level's index within the configuration's workload.
        max_concurrency: the level's concurrency.
        request_rate: its request rate (None = as fast as the concurrency allows).
        output_tokens_per_s, per_user_tokens_per_s, ttft_ms_p99: see the module docstring (None
            when the level cannot say).
        goodput_requests_per_s, goodput_fraction: None without SLOs.
        repeats: the repeats its figures are the means of (1: one pass).
        output_tokens_per_s_ci_low, ..._ci_high, goodput_requests_per_s_ci_low, ..._ci_high:
            Student's t interval of the mean over the repeats (:func:`tasks.tune.repeat_interval`;
            None with one repeat).
        capacity_requests_per_s, ..._ci_low, ..._ci_high: only on a configuration's capacity
            point (``level`` = :data:`CAPACITY_LEVEL`, :mod:`tasks.tune.capacities`): its mean
            capacity over the repeats and Student's t interval (requests/s); else None.
    """

    configuration: int
    label: str
    level: int
    max_concurrency: int
    request_rate: float | None
    output_tokens_per_s: float | None
    per_user_tokens_per_s: float | None
    ttft_ms_p99: float | None
    goodput_requests_per_s: float | None = None
    goodput_fraction: float | None = None
    repeats: int = 1
    output_tokens_per_s_ci_low: float | None = None
    output_tokens_per_s_ci_high: float | None = None
    goodput_requests_per_s_ci_low: float | None = None
    goodput_requests_per_s_ci_high: float | None = None
    capacity_requests_per_s: float | None = None
    capacity_requests_per_s_ci_low: float | None = None
    capacity_requests_per_s_ci_high: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def name(self) -> str:
        """``max_num_seqs=4 c=8`` (with its rate when it has one); a capacity point:
        ``max_num_seqs=4 capacity``."""
        if self.level == CAPACITY_LEVEL:
            return f"{self.label} capacity"
        rate = f" rate={self.request_rate:g}" if self.request_rate is not None else ""
        return f"{self.label} c={self.max_concurrency}{rate}"


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def point(
    configuration: int,
    label: str,
    level: int,
    level_dict: Mapping[str, Any],
    repeat_values: Mapping[str, Sequence[float | None]] | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
) -> TunePoint:
    """A level (``Level.to_dict()`` shape: ``max_concurrency``, ``request_rate``, ``metrics``) as a
    point; ``repeat_values`` (figure -> its value in each repeat, :data:`INTERVAL_FIGURES`) adds
    the intervals over the repeats and their count (the metrics are then the repeats' means)."""
    m = level_dict.get("metrics") or {}
    tpot = _finite(m.get("tpot_ms_p50"))
    intervals: dict[str, Any] = {}
    counts = [1]
    for figure, values in (repeat_values or {}).items():
        found = repeat_interval(values, confidence, floor=0.0)  # rates: never below 0
        if found is not None and figure in INTERVAL_FIGURES:
            intervals[f"{figure}_ci_low"], intervals[f"{figure}_ci_high"] = found.low, found.high
            counts.append(found.count)
    return TunePoint(
        configuration=configuration,
        label=label,
        level=level,
        max_concurrency=int(level_dict.get("max_concurrency") or 0),
        request_rate=_finite(level_dict.get("request_rate")),
        output_tokens_per_s=_finite(m.get("output_tokens_per_s")),
        per_user_tokens_per_s=1000.0 / tpot if tpot and tpot > 0 else None,
        ttft_ms_p99=_finite(m.get("ttft_ms_p99")),
        goodput_requests_per_s=_finite(m.get("goodput_requests_per_s")),
        goodput_fraction=_finite(m.get("goodput_fraction")),
        repeats=int(level_dict.get("repeats") or max(counts)),
        **intervals,
    )


def pareto(points: Sequence[TunePoint], other: str = "per_user_tokens_per_s") -> list[TunePoint]:
    """The points no other point dominates on (output tokens/s up, ``other``): ``other`` is
    ``per_user_tokens_per_s`` (more is better) or ``ttft_ms_p99`` (less is better). Sorted by
    throughput."""
    sign = -1.0 if other == "ttft_ms_p99" else 1.0
    known = [
        (p, p.output_tokens_per_s, sign * getattr(p, other))
        for p in points
        if p.output_tokens_per_s is not None and getattr(p, other) is not None
    ]
    front = [
        p for p, x, y in known if not any(x2 >= x and y2 >= y and (x2 > x or y2 > y) for _, x2, y2 in known)
    ]
    return sorted(front, key=lambda p: p.output_tokens_per_s)


@dataclass(frozen=True)
class Best:
    """The answer: ``point`` (None: no point qualifies, or the top is tied within noise) and
    why (one sentence), with the rule's outcome (:mod:`tasks.tune.rule`).

    Attributes:
        point: the best point, named (None: none qualifies, or tied).
        reason: why, in words (the rule's outcome, the intervals, what would separate a tie).
        rule: :data:`tasks.tune.rule.OUTCOMES`.
        objective: the figure ranked (``output_tokens_per_s``, or ``goodput_requests_per_s``
            under SLOs).
        top: the point with the highest mean objective (named or not).
        comparisons: ``(the other configuration's top point, its comparison with the top)``.
        confidence: the intervals' level and Holm's family-wise one.
    """

    point: TunePoint | None
    reason: str
    rule: str = "none"
    objective: str = "output_tokens_per_s"
    top: TunePoint | None = None
    comparisons: tuple[tuple[TunePoint, Comparison], ...] = field(default=())
    confidence: float = DEFAULT_CONFIDENCE

    @property
    def tied(self) -> list[TunePoint]:
        """The points tied within noise with the top, the top first (empty unless ``tied``)."""
        if self.rule != "tied" or self.top is None:
            return []
        return [self.top] + [p for p, c in self.comparisons if not c.separated]

    @property
    def repeats_to_separate(self) -> int | None:
        """For a tie: the repeats of each that would separate the top from every tied one (the
        largest of theirs; None when one of them never would)."""
        needed = [c.repeats_to_separate for _, c in self.comparisons if not c.separated]
        return max(needed) if needed and None not in needed else None  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """``point`` and ``reason`` as before; the rule under new keys: ``rule``, ``objective``,
        ``confidence``, ``top``, ``tied`` (points), ``repeats_to_separate``, ``comparisons``
        (``point``, ``difference``, ``ci_low``, ``ci_high``, ``p_value``, ``separated``,
        ``repeats_to_separate``, ``more_repeats``)."""
        return {
            "point": self.point.to_dict() if self.point else None,
            "reason": self.reason,
            "rule": self.rule,
            "objective": self.objective,
            "confidence": self.confidence,
            "top": self.top.to_dict() if self.top else None,
            "tied": [p.to_dict() for p in self.tied],
            "repeats_to_separate": self.repeats_to_separate,
            "comparisons": [
                {
                    "point": p.to_dict(),
                    "difference": c.difference,
                    "ci_low": c.ci_low,
                    "ci_high": c.ci_high,
                    "p_value": c.p_value,
                    "separated": c.separated,
                    "repeats_to_separate": c.repeats_to_separate,
                    "more_repeats": c.more_repeats,
                }
                for p, c in self.comparisons
            ],
        }


def qualifying(
    points: Sequence[TunePoint], slos: Mapping[str, float] | None, target: float, objective: str = ""
) -> list[TunePoint]:
    """The points that may be best: capacity points (``objective`` :data:`CAPACITY`) with a
    capacity above 0; with SLOs, those whose goodput fraction reaches ``target`` and that have a
    goodput; without, those with output tokens/s."""
    if objective == CAPACITY:
        return [p for p in points if (p.capacity_requests_per_s or 0.0) > 0]
    if not slos:
        return [p for p in points if p.output_tokens_per_s is not None]
    return [
        p
        for p in points
        if p.goodput_fraction is not None
        and p.goodput_fraction >= target
        and p.goodput_requests_per_s is not None
    ]


def best(
    points: Sequence[TunePoint],
    slos: Mapping[str, float] | None,
    target: float,
    samples: Mapping[tuple[int, int], Sequence[float | None]] | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    objective: str | None = None,
) -> Best:
    """The best point under ``slos`` at goodput fraction ``target`` (module docstring), by the
    rule of :mod:`tasks.tune.rule` over each configuration's top qualifying point.
    ``samples``: ``(configuration, level) -> the objective's value in each repeat`` (without
    it, each point is one pass: the top is named, ``rule = "untested"``). ``objective``:
    :data:`CAPACITY` for capacity points (``tune.capacity``); by default goodput under SLOs,
    else output tokens/s."""
    objective = objective or ("goodput_requests_per_s" if slos else "output_tokens_per_s")
    slo_text = ", ".join(f"{k} <= {v:g}" for k, v in (slos or {}).items())
    meeting = qualifying(points, slos, target, objective)
    if not meeting:
        why = (
            f"no configuration had a capacity: even one request at a time missed {target:.0%} "
            f"within {slo_text}"
            if objective == CAPACITY
            else f"no level had {target:.0%} of its requests within {slo_text}"
            if slos
            else "no level produced output tokens"
        )
        return Best(None, why, "none", objective, confidence=confidence)
    ranked = sorted(
        meeting, key=lambda p: (getattr(p, objective), p.output_tokens_per_s or 0.0), reverse=True
    )
    per_configuration: dict[int, TunePoint] = {}
    for p in ranked:  # each configuration's top level, in rank order
        per_configuration.setdefault(p.configuration, p)
    candidates = list(per_configuration.values())
    top = candidates[0]

    def values(p: TunePoint) -> Sequence[float | None]:
        found = (samples or {}).get((p.configuration, p.level))
        return found if found else [getattr(p, objective)]

    decision = decide([(p.name, values(p)) for p in candidates], confidence)
    comparisons = tuple(zip(candidates[1:], decision.comparisons))
    unit = "req/s" if slos or objective == CAPACITY else "tokens/s"

    def shown(p: TunePoint) -> str:
        found = repeat_interval(values(p), confidence, floor=0.0)
        if found is None or found.low is None or found.high is None:
            return f"{p.name} {getattr(p, objective):.3g} {unit} (one repeat)"
        return f"{p.name} {found.mean:.3g} {unit} [{found.low:.3g}, {found.high:.3g}] ({found.count} repeats)"

    if objective == CAPACITY:
        head = (
            f"highest capacity ({top.capacity_requests_per_s:.3g} req/s, the mean over its repeats "
            f"of the highest request rate with >= {target:.0%} of requests within {slo_text})"
        )
    elif slos:
        head = (
            f"highest goodput ({top.goodput_requests_per_s:.3g} req/s) among levels with "
            f">= {target:.0%} of requests within {slo_text}"
        )
    else:
        head = "highest output tokens/s (no SLOs given: pass --goodput to rank by goodput)"
    level = f"{decision.confidence:.0%}"
    named = {"objective": objective, "top": top, "comparisons": comparisons, "confidence": confidence}
    if decision.outcome == "only":
        return Best(top, f"{head}; the only configuration with a qualifying level", "only", **named)
    if decision.outcome == "untested":
        return Best(
            top,
            f"{head}; not tested against the runner-up {shown(candidates[1])}: one pass each gives "
            "no interval (--repeats 3 or more)",
            "untested",
            **named,
        )
    if decision.outcome == "best":
        p, c = comparisons[0]
        return Best(
            top,
            f"{head}; {shown(top)}, separated from the runner-up {shown(p)}: difference "
            f"{c.difference:+.3g} [{c.ci_low:+.3g}, {c.ci_high:+.3g}] {unit} (Welch, p = {c.p_value:.2g}, "
            f"Holm over {len(comparisons)}; {level} intervals over the repeats)",
            "best",
            **named,
        )
    tied = [(p, c) for p, c in comparisons if not c.separated]
    notes = []  # a tie with a one-repeat configuration says "(one repeat)" where it is shown
    needed = [c.repeats_to_separate for _, c in tied if c.p_value is not None]
    if None in needed:
        never = ", ".join(p.name for p, c in tied if c.p_value is not None and c.repeats_to_separate is None)
        notes.append(
            f"no number of repeats up to {MAX_REPEATS} would separate {never} from the top "
            "(the difference is nothing against the spread)"
        )
    elif needed:
        most = max(needed)  # type: ignore[type-var]
        more = most - min(min(c.counts) for _, c in tied)
        notes.append(
            f"about --repeats {most} ({more} more of each; the measured repeats resume) would "
            "separate them if the differences hold"
        )
    return Best(
        None,
        f"tied within noise on {objective} ({level} intervals over the repeats): "
        + "; ".join(shown(p) for p in [top] + [p for p, _ in tied])
        + "".join(f"; {note}" for note in notes),
        "tied",
        **named,
    )
