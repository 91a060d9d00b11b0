"""Choosing an audit's baseline and recording the verdict on its run.

The baseline is either pinned by hand (``regression.baseline_run_id``: one run id or several,
comma-separated) or taken from the audit history (:mod:`tasks.report.history`): the finished
audits of the same endpoint and model (identified by server kind + model + model file hash,
never by URL or port) with the same workload, segmented at their change points; the baseline is
the stable stretch since the last confirmed change point. Either way a verdict is only given
between like workloads: the parent runs' params and tags listed in :data:`WORKLOAD_PARAMS` and
:data:`WORKLOAD_TAGS` (prompt lengths, max_tokens, concurrency levels, model file, engine) must
agree, else the result is ``incomparable`` with the differing fields, and no metric is judged
(unless ``regression.force_baseline``). Talks to MLflow only through a
:class:`tasks.tracking.Tracker`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import RegressionConfig
from tasks.report import history as audit_history
from tasks.report.regression import MetricVerdict, counts, counts_text, overall, verdict, verdict_markdown
from tasks.report.samples_file import read_samples
from tasks.stats.samples import Samples
from tasks.stats.spread import SpreadPrior
from tasks.tracking import Tracker

#: The parent run's artifact with the samples behind its headline (``tasks.stats.samples``).
SAMPLES_ARTIFACT = "samples.parquet"

#: Tags that make two audits comparable (the automatic search filters on them).
IDENTITY_TAGS = ("endpoint_kind", "endpoint_model", "endpoint_model_sha256", "model")

#: The parent run's params (the config, flattened by ``tasks.tracking.flatten_params``) that
#: define the workload: the headline metrics of two runs that differ in one of them measure
#: different things (a longer prompt has a longer prefill, more streams queue longer).
WORKLOAD_PARAMS = (
    "profile.model",
    "profile.prompt_lengths",
    "profile.batch_sizes",
    "profile.dtypes",
    "profile.max_new_tokens",
    "profile.prefill_chunk_sizes",
    "profile.num_layers",
    "stream.prompts",
    "stream.prompts.count",
    "stream.input_len",
    "stream.output_len",
    "stream.max_tokens",
    "stream.max_concurrency",
    "stream.request_rate",
    "stream.ignore_eos",
    "stream.api",
    "stream.dataset",
    "stream.duration_s",
    "server.engine",
    "server.model",
    "endpoint.model",
)
#: The parent run's tags that define the workload: the engine and the model file it served.
WORKLOAD_TAGS = ("endpoint_kind", "endpoint_model", "endpoint_model_sha256")

#: Workload params added after audits were first logged, with the value (as logged) that an
#: older baseline, which lacks them, ran with.
ADDED_LATER = {"stream.api": "chat", "stream.dataset": "null", "stream.duration_s": "null"}

#: How many earlier audits the automatic search reads to find N with the same workload.
_SEARCH_DEPTH = 50


@dataclass(frozen=True)
class WorkloadDifference:
    """One workload field that differs: its name (a param such as ``stream.max_tokens`` or a
    tag such as ``endpoint_kind``), the current run's value and the baseline run's (as logged;
    None = not recorded), and the baseline run's id."""

    field: str
    current: str | None
    baseline: str | None
    baseline_run_id: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        return f"{self.field} {self.current or '(none)'} vs {self.baseline or '(none)'}"


def workload(run: Mapping[str, Any]) -> dict[str, str | None]:
    """The workload fields of a run dict (``Tracker.find_runs`` / ``runs_by_id`` shape)."""
    params, tags = run.get("params") or {}, run.get("tags") or {}
    values = {key: params.get(key) for key in WORKLOAD_PARAMS}
    values.update({key: tags.get(key) for key in WORKLOAD_TAGS})
    return values


def _same(a: str | None, b: str | None) -> bool:
    """Equal as logged, or equal as JSON values: ``[1,2]`` (older runs) == ``[1, 2]``."""
    if a == b:
        return True
    if a is None or b is None:
        return False
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def workload_differences(
    current: Mapping[str, str | None], baseline: Mapping[str, str | None], baseline_run_id: str
) -> list[WorkloadDifference]:
    """The workload fields (see :func:`workload`) where ``baseline`` differs from ``current``;
    [] = like with like.

    A baseline that recorded no workload field at all (a run logged by hand, metrics only) has an
    unknown workload and is judged as it is. A field added after a baseline was logged counts as
    its default where it is missing (:data:`ADDED_LATER`), so older audits still compare.
    """
    if all(value is None for value in baseline.values()):
        return []
    current, baseline = (
        {**side, **{k: v for k, v in ADDED_LATER.items() if side.get(k) is None}}
        for side in (current, baseline)
    )
    return [
        WorkloadDifference(key, current.get(key), baseline.get(key), baseline_run_id)
        for key in dict.fromkeys([*current, *baseline])
        if not _same(current.get(key), baseline.get(key))
    ]


@dataclass
class RegressionResult:
    """The verdict. ``status``: ``incomparable`` (the baseline's workload differs: ``differences``
    says how, ``rows`` is empty), else the overall word of :func:`tasks.report.regression.overall`
    (``regressed``, ``improved``, ``unchanged``, ``inconclusive``). ``forced``: judged although
    the workload differs (``force_baseline``). ``baseline_note``: how the baseline was chosen
    (the history's change points, how many audits, what was left out and why). ``history``:
    the history the baseline came from (None when pinned or none)."""

    rows: list[MetricVerdict]
    baseline_label: str
    baseline_run_ids: list[str]
    differences: list[WorkloadDifference] = field(default_factory=list)
    forced: bool = False
    confidence: float = 0.95  #: the intervals' level (``regression.confidence``)
    baseline_note: str = ""
    history: audit_history.History | None = None
    #: (audits so far, audits needed) while the history is too short for a verdict, else None
    building: tuple[int, int] | None = None

    @property
    def incomparable(self) -> bool:
        return bool(self.differences) and not self.forced

    @property
    def regressed(self) -> bool:
        return not self.incomparable and any(row.regressed for row in self.rows)

    @property
    def status(self) -> str:
        if self.building is not None:
            return "building"
        return "incomparable" if self.incomparable else overall(self.rows)

    @property
    def regressed_metrics(self) -> list[str]:
        return [row.metric for row in self.rows if row.regressed] if not self.incomparable else []

    @property
    def improved_metrics(self) -> list[str]:
        return [row.metric for row in self.rows if row.verdict == "improved"] if not self.incomparable else []

    def line(self) -> str:
        """The one line a scheduled run's reader sees: ``regressed (2 regressed, 0 improved,
        6 unchanged, 2 inconclusive)``, or ``incomparable``."""
        if self.building is not None:
            return "building a baseline: {} of {} audits".format(*self.building)
        return self.status if self.incomparable else f"{self.status} ({counts_text(self.rows)})"

    def markdown(self) -> str:
        ids = "\n".join(f"- `{run_id}`" for run_id in self.baseline_run_ids)
        differ = "\n".join(f"- {d.text()} (run `{d.baseline_run_id}`)" for d in self.differences)
        if self.building is not None:
            return (
                f"# Regression verdict: {self.line()}\n\nNo verdict yet: a verdict needs "
                f"{self.building[1]} earlier audits of the same endpoint, model and workload "
                f"(regression.min_baseline_audits); this audit joins them.\n\nAudits so far:\n\n{ids}\n"
            )
        if self.incomparable:
            return (
                "# Regression verdict: incomparable\n\nNo verdict: the baseline's workload differs "
                f"from this run's (rerun with --force-baseline to judge anyway):\n\n{differ}\n\n"
                f"Baseline: {self.baseline_label}\n\nBaseline runs:\n\n{ids}\n"
            )
        text = verdict_markdown(self.rows, self.baseline_label, self.confidence)
        if self.baseline_note:
            text += f"\nHow the baseline was chosen: {self.baseline_note}\n"
        text += f"\nBaseline runs:\n\n{ids}\n"
        if self.forced:
            text += f"\nJudged with --force-baseline although the workload differs:\n\n{differ}\n"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The ``regression`` entry of the audit's ``--json``."""
        return {
            "status": self.status,
            "counts": {} if self.incomparable else counts(self.rows),
            "regressed": self.regressed,
            "regressed_metrics": self.regressed_metrics,
            "improved_metrics": self.improved_metrics,
            "baseline": self.baseline_label,
            "baseline_note": self.baseline_note,
            "baseline_run_ids": self.baseline_run_ids,
            "incomparable": [d.to_dict() for d in self.differences] if self.incomparable else [],
            "forced": self.forced,
            # the thresholds judged by (signed: + where a rise is worse, - where a drop is)
            "thresholds_pct": {row.metric: row.threshold_pct for row in self.rows},
            "building": dict(zip(("audits", "needed"), self.building)) if self.building else None,
            "rows": [row.to_row() for row in self.rows],
        }


def _quote(value: str) -> str:
    return value.replace("'", "\\'")


def pinned_ids(cfg: RegressionConfig) -> list[str]:
    """The run ids ``regression.baseline_run_id`` pins (comma-separated); [] = automatic."""
    return [part.strip() for part in (cfg.baseline_run_id or "").split(",") if part.strip()]


def find_audits(tracker: Tracker, run_id: str, tags: Mapping[str, str]) -> list[dict]:
    """The finished audits of the same endpoint and model, newest first, up to
    :data:`_SEARCH_DEPTH`, as ``Tracker`` run dicts (``run_id`` itself left out)."""
    clauses = ["tags.flow = 'audit'", "attributes.status = 'FINISHED'"]
    clauses += [f"tags.{key} = '{_quote(tags[key])}'" for key in IDENTITY_TAGS if tags.get(key)]
    return tracker.find_runs(" and ".join(clauses), max_results=_SEARCH_DEPTH, exclude=run_id)


def choose(
    current: Mapping[str, str | None], candidates: Sequence[dict], last_n: int, force: bool
) -> tuple[list[dict], list[WorkloadDifference]]:
    """(the baseline runs, the workload differences that remain), for candidates that are not
    a history: the last ``last_n`` candidates with the current workload; when none has it: the
    newest candidate's differences, and (``force``) the last ``last_n`` candidates all the same.
    """
    alike = [r for r in candidates if not workload_differences(current, workload(r), r["run_id"])]
    if alike:
        return alike[:last_n], []
    newest = candidates[0]
    differences = workload_differences(current, workload(newest), newest["run_id"])
    return (list(candidates[:last_n]) if force else [newest]), differences


def judge(
    tracker: Tracker,
    run_id: str,
    current: Mapping[str, float],
    tags: Mapping[str, str],
    cfg: RegressionConfig,
    samples: Samples | None = None,
    client_bound: bool = False,
) -> RegressionResult | None:
    """Compare ``current`` (and its ``samples``: the test; None: the legacy rule) with the
    baseline, whose runs' :data:`SAMPLES_ARTIFACT` are read back (a run without one, or with an
    unreadable one, is left out when others kept theirs, else all are judged by the legacy rule,
    and the rows say so); record the verdict on ``run_id``: tags ``verdict`` (the overall word),
    ``regression`` = true / false / incomparable, ``baseline_run_ids``, ``verdict.<metric>``;
    artifacts ``regression.md`` and ``regression.json``. The workload of ``run_id`` is read from
    its logged params and tags. None when there is no baseline yet (the first audit of an
    endpoint and model). ``client_bound``: the current stream level was flagged client-bound
    (its moved stream figures read inconclusive: ``tasks.report.regression.client_limited``).

    The baseline: the pinned runs, else the audit history's stable stretch
    (:meth:`tasks.report.history.History.baseline`, at most ``baseline_last_n`` audits); a
    baseline of fewer than 3 audits borrows the history's run-to-run spread where it has one, a
    longer one where the history knows it on more degrees of freedom
    (:func:`tasks.stats.verdict.change`).

    Raises:
        LookupError: ``baseline_run_id`` (or ``run_id``) names a run that does not exist.
    """
    pinned = pinned_ids(cfg)
    audits = find_audits(tracker, run_id, tags)
    pinned_runs = tracker.runs_by_id(pinned) if pinned else []
    if not pinned_runs and not audits:
        tracker.set_tags(run_id, {"regression": "no_baseline", audit_history.VERDICT_TAG: "building"})
        return None
    [mine] = tracker.runs_by_id([run_id])
    mine["tags"] = {**mine["tags"], **{k: str(v) for k, v in tags.items()}}
    mine_workload = workload(mine)
    alike = [r for r in audits if not workload_differences(mine_workload, workload(r), r["run_id"])]
    history = audit_history.build(list(reversed(alike)), list(cfg.thresholds_pct))
    if not pinned_runs and alike and len(alike) < cfg.min_baseline_audits:
        return _record(
            tracker,
            run_id,
            RegressionResult(
                [],
                "the audits so far",
                [r["run_id"] for r in alike],
                confidence=cfg.confidence,
                history=history,
                building=(len(alike), cfg.min_baseline_audits),
            ),
        )
    note, cuts = "", ()
    if pinned_runs:
        runs, differences = choose(mine_workload, pinned_runs, len(pinned_runs), cfg.force_baseline)
        label = "pinned by hand: run " + ", ".join(pinned)
        note = f"pinned by hand (--baseline): {len(pinned_runs)} run(s)"
    elif alike:
        choice = history.baseline(min_runs=MIN_HISTORY_RUNS, max_runs=cfg.baseline_last_n)
        runs, differences = [alike[len(alike) - 1 - i] for i in reversed(choice.indices)], []
        # every confirmed point cuts the spread's stretches: with the last alone, a slow stretch
        # the metric's own E-Divisive had not cut joined the normal runs' (29 % after the way back)
        label, note, cuts = (
            _label(choice, history),
            choice.note,
            choice.change_points or (choice.change_point,),
        )
        if not runs:  # every earlier audit left out: the newest one, said so
            runs, label = alike[:1], "the newest audit (every earlier one was left out)"
    else:
        runs, differences = choose(mine_workload, audits, cfg.baseline_last_n, cfg.force_baseline)
        label = f"the last {len(runs)} audits of the same endpoint and model (workload differs)"
    ids = [r["run_id"] for r in runs]
    judged = not differences or cfg.force_baseline
    kept = (
        [tracker.read_artifact(r["run_id"], SAMPLES_ARTIFACT, read_samples) for r in runs] if judged else []
    )
    if any(k is not None for k in kept) and not all(k is not None for k in kept):
        # some baseline runs predate the samples: judge on those that kept theirs, and say so
        runs, kept = [r for r, k in zip(runs, kept) if k is not None], [k for k in kept if k is not None]
        ids = [r["run_id"] for r in runs]
        label += f" ({len(runs)} of them kept samples: those)"
    prior = SpreadPrior(cfg.run_spread_prior_pct / 100, cfg.run_spread_prior_runs)
    spreads = history.run_spreads(list(cfg.thresholds_pct), cuts, prior)
    metric_rows = (
        verdict(
            current,
            [r["metrics"] for r in runs],
            cfg.thresholds_pct,
            samples,
            kept,
            cfg.confidence,
            spreads=spreads,
            client_bound=client_bound,
        )
        if judged
        else []
    )
    result = RegressionResult(
        metric_rows,
        label,
        ids,
        differences,
        bool(differences) and cfg.force_baseline,
        cfg.confidence,
        note,
        None if pinned_runs else history,
    )
    return _record(tracker, run_id, result)


def _record(tracker: Tracker, run_id: str, result: RegressionResult) -> RegressionResult:
    """The verdict on ``run_id``: its tags (``verdict``, ``regression``, ``baseline_run_ids``,
    ``verdict.<metric>``) and artifacts (``regression.md``, ``regression.json``)."""
    regression = "incomparable" if result.incomparable else str(result.regressed).lower()
    tracker.set_tags(
        run_id,
        {
            audit_history.VERDICT_TAG: result.status,
            "regression": "building" if result.building else regression,
            "baseline_run_ids": ",".join(result.baseline_run_ids)[:5000],
            **{f"verdict.{row.metric}": row.verdict for row in result.rows},
        },
    )
    tracker.log_text(run_id, result.markdown(), "regression.md")
    tracker.log_dict(run_id, result.to_dict(), "regression.json")
    return result


#: Fewest audits a history baseline should have (fewer: said, and judged on what there is).
MIN_HISTORY_RUNS = 3


def _label(choice: audit_history.BaselineChoice, history: audit_history.History) -> str:
    """``the 3 audits since the change point at <run> (2024-..)`` / ``the last 5 audits``."""
    n = len(choice.indices)
    audits = "audit" if n == 1 else f"{n} audits"
    if choice.change_point is not None:
        since = history.audits[choice.change_point]
        return f"the {audits} since the change point at run {since.run_id} ({since.started})"
    return f"the last {audits} of the same endpoint, model and workload"


def log_history_plots(
    tracker: Tracker, run_id: str, result: RegressionResult, current: Mapping[str, float], folder: Path
) -> list[Path]:
    """``plots/history_<metric>.png`` on ``run_id``: the history the verdict's baseline came from,
    with this audit appended and ringed (:func:`tasks.report.history_plot.history_plots`); []
    when the baseline was pinned or there is no history."""
    if result.history is None or not len(result.history):
        return []
    import time

    from tasks.report.history_plot import history_plots

    me = audit_history.AuditPoint(run_id, "", int(time.time() * 1000), result.status, dict(current))
    history = result.history.with_audit(me)
    paths = history_plots(history, folder, highlight=len(history) - 1)
    for path in paths:
        tracker.log_artifact(run_id, path, "plots")
    return paths
