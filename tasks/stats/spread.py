"""How much whole runs differ (the run-to-run spread), learned from an endpoint's whole audit
history and a prior of stated strength.

The model (one-way random effects on the log scale; Searle, Casella & McCulloch, *Variance
Components*, 1992, ch. 3): audit ``i`` of a stable segment ``g`` logs a figure whose log is

    y_i = mu_g + b_i + e_i,   b_i ~ N(0, tau^2) (the run-to-run part: the machine's state),
                              e_i ~ N(0, w_i)   (the run's own sampling noise, known from its
                                                 logged interval)

so, pooled over the segments, ``SS = sum_g sum_i (y_i - mean_g y)^2`` is ``(tau^2 + w) x
chi^2(n - G)`` (``n`` audits in ``G`` segments; each segment's mean costs one degree of
freedom, and a change point therefore never counts as spread).

**Metrics that share the spread.** Machine load moves a run's TTFT, ITL, TPOT and E2E together
(and its throughput the other way): on the log scale they share one ``b_i``. Their deviations
from their segment means, averaged per audit with weights ``1 / w_m`` (signed by the metric's
worse direction), are one composite series whose noise is the weighted mean's; the composite
carries what every metric knows of ``tau^2``, and mostly the steadiest metric's (TPOT mean,
whose requests add almost no noise). Metrics share by stage (:data:`tasks.metrics` stage:
``stream``, ``profile``). A metric whose own deviations are too wide for the shared spread
(its ``SS_m / (tau^2 + w_m)`` beyond chi^2's 99th percentile) keeps its own estimate.

**The prior.** ``tau^2`` ~ scaled inverse-chi^2(``nu0``, ``s0^2``): a guessed spread ``s0``
worth ``nu0`` runs (Gelman et al., *Bayesian Data Analysis*, 3rd ed., 2013, sec. 3.3; limma's
moderated variance has the same shape: Smyth, *Stat. Appl. Genet. Mol. Biol.* 3(1), 2004). The
posterior ``p(tau^2 | SS) ~ prior x (tau^2 + w)^(-df/2) exp(-SS / (2 (tau^2 + w)))`` has no
closed form once ``w > 0``; it is evaluated on a grid of ``tau^2``. The verdict draws ``tau^2``
from it (:meth:`RunSpread.variance_draws`), so a new run's deviation is drawn from the
posterior predictive (a normal mixed over the posterior: Student's t in the conjugate case),
with no degrees-of-freedom approximation on the verdict's path.

**The degrees of freedom recorded.** The posterior summarised as a scaled inverse-chi^2 of the
same mean and variance (mean ``nu s^2 / (nu - 2)``, variance ``2 nu^2 s^4 / ((nu - 2)^2 (nu -
4))``, so ``nu = 4 + 2 mean^2 / variance``): the degrees of freedom the spread is known on. In
the conjugate case (``w = 0``) that is exactly ``nu0 + n - G``. ``history_df`` is that minus
the prior's ``nu0``: what the history added (much less than ``n - G`` where the runs' own noise
hides the spread: the data's information on ``tau^2`` scales as ``(tau^2 / (tau^2 + w))^2``,
the moment-matched degrees of freedom of a difference of mean squares, Satterthwaite,
*Biometrics Bulletin* 2, 1946).

Imports numpy and scipy; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: The grid of tau (the spread's sd of the log figure) the posterior is evaluated on: 0.001 %
#: to 300 %, log-spaced (a spread beyond exp(3) per run is not a spread, it is a different
#: machine); the config keeps the prior's spread within 0.1-50 % so that its tails fit.
_GRID_SD = np.geomspace(1e-5, 3.0, 800)
#: A metric keeps its own spread when its deviations are this unlikely under the shared one.
OWN_SPREAD_P = 0.01


@dataclass(frozen=True)
class SpreadPrior:
    """The guessed run-to-run spread ``sd_log`` (0.05: whole runs differ by about 5 %) and its
    weight ``runs`` (nu0: worth that many runs' deviations). ``regression.run_spread_prior_pct``
    and ``regression.run_spread_prior_runs``."""

    sd_log: float = 0.05
    runs: float = 3.0


@dataclass(frozen=True)
class RunSpread:
    """How much whole runs differ: ``sd_log``, the standard deviation of the natural log of a
    run's figure about its segment's (0.05 = runs differ by about 5 %), known on ``df`` degrees
    of freedom (:mod:`tasks.stats.spread`, "The degrees of freedom recorded"), from ``source``.

    ``prior_df``: the prior's weight (nu0; 0 when none); ``history_df``: what the history added
    (``df - prior_df``); ``audits``: the history's audits it used; ``posterior``: the grid of
    ``tau^2`` and its posterior probabilities (empty: the spread is ``sd_log`` on ``df`` as a
    scaled inverse-chi^2, the conjugate case)."""

    sd_log: float
    df: float
    source: str
    prior_df: float = 0.0
    history_df: float = 0.0
    audits: int = 0
    #: of the history's degrees of freedom, those of the newest segment (the baseline's own
    #: stretch: its audits - 1); the rest came from earlier segments
    segment_df: int = 0
    posterior: tuple[tuple[float, ...], tuple[float, ...]] = field(
        default=((), ()), repr=False, compare=False
    )

    def variance_draws(self, size: int, rng: np.random.Generator) -> np.ndarray:
        """``size`` draws of ``tau^2`` from the spread's distribution: its posterior grid, else
        ``df s^2 / chi^2(df)`` (scaled inverse-chi^2: a normal mixed over it is Student's t on
        ``df``, the prediction of a new run from the runs seen: Hahn & Meeker, *Statistical
        Intervals*, 1991, sec. 4.6)."""
        grid, probs = self.posterior
        if grid:
            return rng.choice(np.asarray(grid), size=size, p=np.asarray(probs))
        if self.sd_log <= 0:
            return np.zeros(size)
        df = max(self.df, 1.0)
        return df * self.sd_log**2 / rng.chisquare(df, size)

    @property
    def prior_only(self) -> bool:
        """The prior alone: no audit of the history told anything of the spread."""
        return self.prior_df > 0 and self.audits == 0

    @property
    def trusted(self) -> bool:
        """Whether the history, not the prior, carries most of what is known of the spread."""
        return self.history_df >= max(self.prior_df, 2.0)

    def to_dict(self) -> dict[str, float | str | int | bool]:
        """The record of a verdict's spread: ``run_spread_pct``, its ``df``, ``prior_df``,
        ``history_df``, ``audits``, ``trusted``, ``source``."""
        return {
            "run_spread_pct": round(100 * self.sd_log, 3),
            "df": round(self.df, 2),
            "prior_df": round(self.prior_df, 2),
            "history_df": round(self.history_df, 2),
            "audits": self.audits,
            "segment_df": self.segment_df,
            "trusted": self.trusted,
            "source": self.source,
        }


@dataclass(frozen=True)
class Deviations:
    """One metric's evidence: per audit (oldest first) the deviation of its log figure from its
    segment's mean (NaN: left out), the audit's own sampling variance of the log figure (NaN:
    not logged), and the degrees of freedom (audits kept - segments)."""

    metric: str
    deviations: tuple[float, ...]
    noise_var: tuple[float, ...]
    df: int
    segment_df: int = 0  #: the newest segment's part of ``df``

    @property
    def squares(self) -> float:
        return float(np.nansum(np.square(self.deviations)))

    @property
    def mean_noise(self) -> float:
        """The mean sampling variance of the audits that logged one (NaN: none did)."""
        known = [v for v in self.noise_var if math.isfinite(v)]
        return sum(known) / len(known) if known else float("nan")


def posterior(squares: float, df: float, noise_var: float, prior: SpreadPrior) -> RunSpread:
    """The spread's posterior from a sum of squared log deviations ``squares`` on ``df`` degrees
    of freedom, each deviation carrying ``noise_var`` of sampling variance, under ``prior``
    (module docstring). ``df`` 0: the prior alone.

    Raises:
        ValueError: a prior whose weight or spread is not > 0.
    """
    if not (prior.runs > 0 and prior.sd_log > 0):
        raise ValueError("the spread's prior needs a spread > 0 worth > 0 runs")
    if df <= 0:  # the prior alone, as it is (no grid: its own scaled inverse-chi^2)
        return RunSpread(prior.sd_log, prior.runs, "the prior", prior_df=prior.runs)
    tau2 = _GRID_SD**2
    nu0, s0 = prior.runs, prior.sd_log
    log_p = -(nu0 / 2 + 1) * np.log(tau2) - nu0 * s0**2 / (2 * tau2)
    if df > 0:
        total = tau2 + max(noise_var, 0.0)
        log_p += -(df / 2) * np.log(total) - squares / (2 * total)
    log_p += np.log(tau2)  # the grid is log-spaced: d tau^2 = tau^2 d log tau^2
    probs = np.exp(log_p - log_p.max())
    probs /= probs.sum()
    nu, sd = _as_scaled_inverse_chi2(tau2, probs)
    # what the history added: never more than its audits' own degrees of freedom (the grid's
    # summary of a posterior far out in the prior's tail can read more)
    added = min(max(0.0, nu - nu0), float(df))
    return RunSpread(
        sd, nu0 + added, "the prior", prior_df=nu0, history_df=added, posterior=(tuple(tau2), tuple(probs))
    )


def _as_scaled_inverse_chi2(tau2: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(nu, s) of the scaled inverse-chi^2 closest to a posterior on a grid: ``s^2 = 1 /
    E[1 / tau^2]`` and ``trigamma(nu / 2) = Var(log tau^2)`` (both exact for that family, and
    finite for any ``nu``, where its mean and variance are not for ``nu <= 4``)."""
    from scipy.optimize import brentq
    from scipy.special import polygamma

    s2 = 1.0 / float(np.sum(probs / tau2))
    logs = np.log(tau2)
    var_log = float(np.sum(probs * (logs - np.sum(probs * logs)) ** 2))
    if var_log <= float(polygamma(1, 5e3)):
        return 1e4, math.sqrt(s2)
    nu = brentq(lambda v: float(polygamma(1, v / 2)) - var_log, 1e-3, 1e4)
    return float(nu), math.sqrt(s2)


def shared(
    evidence: Sequence[Deviations], prior: SpreadPrior, signs: Mapping[str, float] | None = None
) -> dict[str, RunSpread]:
    """Each metric's spread where ``evidence`` (metrics of one stage, aligned on the same audits
    and segments) shares one: the composite's posterior (module docstring), or the metric's own
    where its deviations are too wide for it. ``signs``: +1 / -1 per metric (its worse
    direction: a throughput moves against the latencies). Metrics with no logged noise join no
    composite and take the shared spread."""
    from scipy.stats import chi2

    if not evidence:
        return {}
    audits = len(evidence[0].deviations)
    weighted = [e for e in evidence if math.isfinite(e.mean_noise) and e.mean_noise > 0 and e.df >= 1]
    out: dict[str, RunSpread] = {}
    if not weighted:
        alone = posterior(0.0, 0.0, 0.0, prior)
        return {e.metric: alone for e in evidence}
    composite, composite_noise = [], []
    for i in range(audits):
        terms = [
            (1 / e.mean_noise, (signs or {}).get(e.metric, 1.0) * e.deviations[i], e.noise_var[i])
            for e in weighted
            if math.isfinite(e.deviations[i])
        ]
        if not terms:
            continue
        total = sum(w for w, _, _ in terms)
        composite.append(sum(w * d for w, d, _ in terms) / total)
        noise = [v if math.isfinite(v) else 1 / w for w, _, v in terms]
        composite_noise.append(sum((w / total) ** 2 * v for (w, _, _), v in zip(terms, noise)))
    df = max(e.df for e in weighted)
    names = ", ".join(e.metric for e in weighted)
    kept = len(composite)
    pooled = posterior(float(np.sum(np.square(composite))), df, float(np.mean(composite_noise)), prior)
    newest = max(e.segment_df for e in weighted)
    where = f"{df} df" if newest == df else f"{df} df, {newest} of them in the newest segment"
    pooled = _named(
        pooled, f"the audit history ({kept} audits, {where}; shared by {names})", kept, prior, newest
    )
    tau2 = pooled.sd_log**2
    for e in evidence:
        own_noise = e.mean_noise if math.isfinite(e.mean_noise) else 0.0
        if e.df >= 2 and chi2.sf(e.squares / (tau2 + own_noise), e.df) < OWN_SPREAD_P:
            own = posterior(e.squares, e.df, own_noise, prior)
            out[e.metric] = _named(
                own,
                f"the audit history ({e.df} df; its own: wider than the shared)",
                kept,
                prior,
                e.segment_df,
            )
        else:
            out[e.metric] = pooled
    return out


def _named(spread: RunSpread, source: str, audits: int, prior: SpreadPrior, segment_df: int = 0) -> RunSpread:
    text = f"{source}, and the prior ({100 * prior.sd_log:g} % worth {prior.runs:g} runs)"
    return RunSpread(
        spread.sd_log,
        spread.df,
        text,
        spread.prior_df,
        spread.history_df,
        audits,
        segment_df,
        spread.posterior,
    )
