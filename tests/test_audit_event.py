"""Tell someone (issue 28, item 5): a regressed audit emits ``infermeter.audit.regressed`` and
a Prefect automation created by API on the suite's real Prefect server (its triggers and
actions services run in the server process) fires on it: its SendNotification action posts,
through a Custom Webhook notification block, to a small HTTP server of the test, and the test
reads what arrived.

The same automation code is the README's ("Tell someone: an automation on a regressed audit").
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flows.events import AUDIT_REGRESSED, emit_regressed, regressed_event

try:
    from tests import groundtruth_server as gt
except ImportError:  # run from tests/
    import groundtruth_server as gt

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
#: How long the automation may take, event in to webhook out (the triggers service reads the
#: event stream at once; the actions service runs the action when it is told): a deadline for
#: a poll, not a timing assert.
DEADLINE_S = 60.0
#: The notification's body, a Jinja template over the event (the README's).
BODY = (
    "{{ event.resource['prefect.resource.name'] }} regressed: "
    "{% for m in event.payload.metrics %}{{ m.metric }} {{ m.change_pct | round(1) }} %"
    "{% if m.change_pct_ci_low is not none %} [{{ m.change_pct_ci_low | round(1) }} .. "
    "{{ m.change_pct_ci_high | round(1) }}]{% endif %}; {% endfor %}"
    "MLflow run {{ event.payload.mlflow_run_id }} "
    "({{ event.payload.mlflow_run_url or event.payload.runs_url }}), "
    "flow run {{ event.payload.flow_run_id }}"
)


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802  (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.received.append(json.loads(body))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def webhook() -> Iterator[tuple[str, list[dict]]]:
    """A webhook receiver on 127.0.0.1: (its URL, the JSON bodies it received)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", server.received  # type: ignore[attr-defined]
    server.shutdown()
    server.server_close()


def _automation(resource_id: str, url: str, name: str):
    """The README's automation: on each ``infermeter.audit.regressed`` of this endpoint, send a
    notification through a Custom Webhook block that posts ``{"subject", "body"}`` to ``url``.
    Returns the created ``prefect.automations.Automation`` (``.id``)."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(
        name=name, url=url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    )
    block_id = block.save(name, overwrite=True)
    return Automation(
        name=name,
        trigger=EventTrigger(
            expect={AUDIT_REGRESSED},
            match={"prefect.resource.id": resource_id},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            SendNotification(block_document_id=block_id, subject="infermeter: audit regressed", body=BODY)
        ],
    ).create()


@pytest.fixture
def automation(webhook):
    """A factory: the automation for a resource id, deleted (with its block) after the test."""
    from prefect.client.orchestration import get_client

    made = []

    def make(resource_id: str):
        name = f"audit-regressed-{uuid.uuid4().hex[:8]}"
        made.append((_automation(resource_id, webhook[0], name), name))
        return made[-1][0]

    yield make
    with get_client(sync_client=True) as client:
        for auto, name in made:
            client.delete_automation(auto.id)
            client.delete_block_document(client.read_block_document_by_name(name, "custom-webhook").id)


def _received(received: list[dict], needle: str, automation_id, again=None) -> dict:
    """The first notification whose body names ``needle``, polled until :data:`DEADLINE_S`;
    on time out, the automation's own events (triggered, action failed: and why) in the
    message. ``again``: called every 10 s while none came (the server's triggers service loads
    a new automation on its own schedule: an event emitted before that finds nothing to fire,
    seen once on a loaded machine)."""
    deadline = time.monotonic() + DEADLINE_S
    next_again = time.monotonic() + 10
    while time.monotonic() < deadline:
        hits = [r for r in received if needle in r.get("body", "")]
        if hits:
            return hits[0]
        if again is not None and time.monotonic() > next_again:
            again()
            next_again += 10
        time.sleep(0.2)
    raise AssertionError(
        f"no notification naming {needle} in {DEADLINE_S} s: {received}; {_events(automation_id)}"
    )


def _events(automation_id) -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        response = client.request(
            "POST",
            "/events/filter",
            json={"filter": {"any_resource": {"id": [f"prefect.automation.{automation_id}"]}}},
        )
    return [(e["event"], e["payload"]) for e in response.json()["events"]]


@dataclass(frozen=True)
class _Verdict:
    """A verdict as the audit hands it over (``tasks.report.baseline.RegressionResult``:
    ``regressed`` and its ``--json`` form), built here so that this test reads only that
    contract: TTFT p50 and ITL p90 regressed, TPOT unchanged."""

    baseline_run_ids: list[str]
    regressed: bool = True

    def to_dict(self) -> dict:
        def row(metric, change_pct, low, high, verdict):
            return {
                "metric": metric, "baseline": 100.0, "current": 100.0 + change_pct, "change_pct": change_pct,
                "threshold_pct": 15.0, "regressed": verdict == "regressed", "note": "",
                "change_pct_ci_low": low, "change_pct_ci_high": high, "verdict": verdict,
                "p_value": 0.001 if verdict == "regressed" else 0.4, "rule": "samples",
            }  # fmt: skip

        return {
            "status": "regressed",
            "counts": {"regressed": 2, "improved": 0, "unchanged": 1, "inconclusive": 0},
            "regressed": True,
            "regressed_metrics": ["ttft_ms_p50", "itl_ms_p90"],
            "baseline": "median of the last 3 audits",
            "baseline_run_ids": self.baseline_run_ids,
            "rows": [
                row("ttft_ms_p50", 41.25, 30.5, 52.0, "regressed"),
                row("itl_ms_p90", 22.5, 16.0, 29.0, "regressed"),
                row("tpot_ms_mean", 1.0, -3.0, 5.0, "unchanged"),
            ],
        }


def test_a_regressed_verdict_fires_an_automation(automation, webhook):
    model = f"model-{uuid.uuid4().hex[:8]}"
    baselines = ["b1" * 16, "b2" * 16, "b3" * 16]
    tags = {
        "endpoint_kind": "vllm",
        "endpoint_model": model,
        "endpoint_model_sha256": "ab" * 32,
        # a key where a careless user might put one: it must not leave the process
        "endpoint": "https://user:sk-secret-1@llm.example.com:8443/v1?api_key=sk-secret-2",
        "prefect_flow_run_id": "0f0e0d0c-0000-4000-8000-000000000001",
    }
    resource_id = f"infermeter.endpoint.vllm.{model}"
    auto = automation(resource_id)

    event = emit_regressed(_Verdict(baselines), tags, "run" * 8, None, "http://mlflow.example/#/runs")
    assert event is not None and event.event == AUDIT_REGRESSED
    assert event.resource.id == resource_id
    assert event.resource["infermeter.endpoint.url"] == "https://llm.example.com:8443/v1"
    assert event.resource["infermeter.endpoint.model_sha256"] == "ab" * 32
    assert "sk-secret" not in event.model_dump_json()
    assert event.payload["regressed_metrics"] == ["ttft_ms_p50", "itl_ms_p90"]
    assert [(m["metric"], m["change_pct"], m["change_pct_ci_low"]) for m in event.payload["metrics"]] == [
        ("ttft_ms_p50", 41.25, 30.5),
        ("itl_ms_p90", 22.5, 16.0),
    ]
    assert event.payload["baseline_run_ids"] == baselines
    assert event.payload["flow_run_id"] == tags["prefect_flow_run_id"]
    assert {(r.role, r.id) for r in event.related} == {
        ("mlflow-run", "infermeter.mlflow-run." + "run" * 8),
        *(("baseline", f"infermeter.mlflow-run.{b}") for b in baselines),
    }

    again = lambda: emit_regressed(_Verdict(baselines), tags, "run" * 8, None, "http://mlflow.example/#/runs")  # noqa: E731
    got = _received(webhook[1], model, auto.id, again)
    assert got["subject"] == "infermeter: audit regressed"
    assert got["body"] == (
        f"vllm {model} regressed: ttft_ms_p50 41.2 % [30.5 .. 52.0]; itl_ms_p90 22.5 % [16.0 .. 29.0]; "
        f"MLflow run {'run' * 8} (http://mlflow.example/#/runs), flow run {tags['prefect_flow_run_id']}"
    )


def test_an_event_that_cannot_be_sent_does_not_raise(caplog):
    """A notification's failure is a warning: here Prefect refuses an event over its size
    limit (``EventTooLarge``, the one error ``emit_event`` raises)."""
    from prefect.settings import PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES, temporary_settings

    with temporary_settings(updates={PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES: 100}):
        assert emit_regressed(_Verdict(["b1"]), {"endpoint_kind": "vllm"}, "r1") is None
    assert "could not emit the Prefect event infermeter.audit.regressed: EventTooLarge" in caplog.text


def test_the_event_of_an_embedded_endpoint_without_a_run():
    """Untracked (no MLflow run) and the embedded server: no run resource, the URL says so."""
    event = regressed_event(
        _Verdict([]), {"endpoint_kind": "llama.cpp", "model": "gguf:default", "endpoint": "embedded"}, None
    )
    assert event.resource["prefect.resource.id"] == "infermeter.endpoint.llama.cpp.gguf:default"
    assert event.resource["infermeter.endpoint.url"] == "embedded"
    assert (
        event.related == []
        and event.payload["mlflow_run_id"] is None
        and event.payload["flow_run_id"] is None
    )


@pytest.fixture(scope="module")
def instrument():
    with gt.serve() as handle:
        yield handle


def test_a_regressed_audit_fires_the_automation(mlflow_store, workdir, instrument, automation, webhook):
    """An audit of the ground-truth instrument against a planted baseline 10x faster (the
    legacy rule: the planted run kept no samples) regresses, and the automation's webhook
    receives the audit's run id and its regressed metrics."""
    from flows.audit import audit
    from tasks.config import load_config
    from tasks.tracking import Tracker

    cfg = load_config(CONFIGS / "smoke.yaml")
    cfg.name = "audit-regressed-event"
    cfg.tokenize.enabled = cfg.profile.enabled = cfg.sweep.enabled = False
    cfg.endpoint.base_url, cfg.endpoint.model = instrument.base_url, "ticks:4:5:20"  # TTFT 20 ms
    cfg.stream.max_concurrency, cfg.stream.num_requests = [1], 2
    tracker = Tracker(cfg.tracking.experiment)
    planted = tracker.start_run("planted-baseline", tags={"flow": "audit"})
    tracker.log_metrics(planted, {"ttft_ms_p50": 2.0})
    tracker.end_run(planted)
    cfg.regression.baseline_run_id = planted
    cfg.regression.thresholds_pct = {"ttft_ms_p50": 15.0}
    auto = automation("infermeter.endpoint.openai-compatible.ticks:4:5:20")

    state = audit(cfg, return_state=True)
    result = state.result(raise_on_failure=False)
    assert state.is_completed() and result["regression"]["regressed_metrics"] == ["ttft_ms_p50"]

    got = _received(webhook[1], result["mlflow_run_id"], auto.id)
    body = got["body"]
    assert body.startswith("openai-compatible ticks:4:5:20 regressed: ttft_ms_p50 ")
    change_pct = float(body.split("ttft_ms_p50 ")[1].split(" %")[0])
    assert change_pct == round(result["regression"]["rows"][0]["change_pct"], 1) and change_pct > 500
    assert f"flow run {state.state_details.flow_run_id}" in body
    assert result["runs_url"] in body


def test_an_audit_whose_stream_names_no_scheduler_fails_before_any_run(mlflow_store, workdir):
    """A deployment's audit (no CLI checked it) whose ``stream.task_runner`` names an address
    where nothing listens fails in seconds, naming the setting, and leaves no MLflow run."""
    from mlflow.tracking import MlflowClient

    from flows.audit import audit
    from tasks.config import load_config
    from tasks.engines.server import free_port

    cfg = load_config(CONFIGS / "smoke.yaml")
    cfg.name = f"audit-no-scheduler-{uuid.uuid4().hex[:8]}"
    cfg.stream.task_runner = f"dask:tcp://127.0.0.1:{free_port()}"  # nothing listens there
    client = MlflowClient()
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)

    def runs() -> int:
        return len(client.search_runs([experiment.experiment_id])) if experiment else 0

    before = runs()
    state = audit(cfg, return_state=True)
    assert state.is_failed()
    assert "stream.task_runner" in state.message and "no Dask scheduler" in state.message, state.message
    assert runs() == before
