"""What the commands of ``flows.commands`` share: one-line input errors and flag parsing
(``inputs``, ``common``), the options several commands declare once (``options``, the workload
flags of ``workload``, the task runner of ``fanout``), running a flow against the Prefect API
(``prefect_api``) and a tracked stream's early tracking writer (``stream_writer``)."""
