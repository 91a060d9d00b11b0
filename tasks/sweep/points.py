"""The sweep's points: one combination of sampling parameters each, and where they come from.

A point (temperature, top_p, top_k, base seed, max_tokens and any extra request-body field)
gets N samples of the same prompt; sample i uses ``seed + i`` so the point is reproducible and
its samples independent. A point's ``key`` hashes its parameters with the prompt, the sample
count and the target's identity (server kind + model + model file hash, never URL or port): a
rerun of the same sweep finds the points already finished by it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.config import SweepConfig


@dataclass(frozen=True)
class SweepPoint:
    """One point's sampling parameters (sent to the target as they are; None = not sent).

    ``extra`` holds extra request-body fields as sorted ``(name, JSON text)`` pairs, so the
    point stays hashable.
    """

    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    max_tokens: int = 32
    extra: tuple[tuple[str, str], ...] = ()

    @classmethod
    def make(cls, *, extra_body: Mapping[str, Any] | None = None, **values: Any) -> SweepPoint:
        extra = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in (extra_body or {}).items()))
        return cls(extra=extra, **values)

    def extra_body(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.extra}

    def params(self) -> dict[str, Any]:
        """The point as flat params: the sampling fields, then ``extra_body.<name>``."""
        data: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
        }
        data.update({f"extra_body.{k}": v for k, v in self.extra_body().items()})
        return data

    def sampling(self, sample: int) -> dict[str, Any]:
        """What a request of sample ``sample`` sends (seed + sample), None fields left out."""
        sent = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed + sample,
        }
        sent.update(self.extra_body())
        return {k: v for k, v in sent.items() if v is not None}

    def key(self, context: Mapping[str, Any] | None = None) -> str:
        """A short stable hash of the parameters and ``context`` (prompt, samples, target
        identity): names runs and matches a resumed point."""
        text = json.dumps({"point": self.params(), **(context or {})}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def expects_determinism(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def label(self) -> str:
        parts = [f"T={self.temperature}"]
        parts += [f"{k}={v}" for k, v in (("top_p", self.top_p), ("top_k", self.top_k)) if v is not None]
        parts += [f"seed={self.seed}", f"max_tokens={self.max_tokens}"]
        parts += [f"{k}={v}" for k, v in self.extra]
        return " ".join(parts)


def grid(
    temperatures: Sequence[float],
    top_ps: Sequence[float | None] = (None,),
    top_ks: Sequence[int | None] = (),
    *,
    seed: int = 0,
    max_tokens: int = 32,
    extra_body: Mapping[str, Any] | None = None,
) -> list[SweepPoint]:
    """The cross product temperature x top_p x top_k, temperature-major, in the order given
    (no top_k values = top_k not sent)."""
    return [
        SweepPoint.make(
            temperature=t, top_p=p, top_k=k, seed=seed, max_tokens=max_tokens, extra_body=extra_body
        )
        for t, p, k in itertools.product(temperatures, top_ps or (None,), top_ks or (None,))
    ]


def points_from_config(cfg: SweepConfig) -> list[SweepPoint]:
    """The sweep's points: the explicit ``points`` when given (unset seed / max_tokens = the
    sweep's; top_p / top_k unset = not sent), else the grid temperature x top_p x top_k with
    the sweep's seed, max_tokens and extra_body."""
    if cfg.points:
        return [
            SweepPoint.make(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=cfg.seed if p.seed is None else p.seed,
                max_tokens=p.max_tokens or cfg.max_tokens,
                extra_body=p.extra_body,
            )
            for p in cfg.points
        ]
    return grid(
        cfg.temperature,
        cfg.top_p,
        cfg.top_k,
        seed=cfg.seed,
        max_tokens=cfg.max_tokens,
        extra_body=cfg.extra_body,
    )
