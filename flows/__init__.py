"""The Prefect flows (the DAGs) and the CLI.

Offline by design: no telemetry pings from Prefect or MLflow. Set here, before either is
imported by any entry point (the CLI, `infermeter serve`, the tests); so is loopback's bypass
of the user's proxy (``tasks.engines.loopback``).
"""

import os

from tasks.engines.loopback import keep_loopback_off_proxies
from tasks.phases import mark

mark("interpreter_ready")  # the first of our modules any entry point imports

for _name, _value in {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

# the user's HTTP(S)_PROXY is for remote endpoints: our own 127.0.0.1 services bypass it
keep_loopback_off_proxies()
