"""The Prefect flows (the DAGs) and the CLI.

Offline by design: no telemetry pings from Prefect or MLflow. Set here, before either is
imported by any entry point (the CLI, `infermeter serve`, the tests).
"""

import os

from tasks.phases import mark

mark("interpreter_ready")  # the first of our modules any entry point imports

for _name, _value in {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)
