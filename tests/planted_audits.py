"""What the planted audits of the regression tests share (tests/test_history.py,
tests/test_baseline_workload.py): the identity tags that make audits of one endpoint and model
comparable (``tasks.report.baseline``)."""

#: An audit's identity tags: the flow, the endpoint's engine, model and weights' SHA-256, the model spec.
IDENT = {
    "flow": "audit",
    "endpoint_kind": "llama.cpp",
    "endpoint_model": "m",
    "endpoint_model_sha256": "abc",
    "model": "gguf:default",
}
