"""The `--json` outputs are a contract other tools read: key for key what they were.

``tests/data/json_keys.json`` holds every key path of the four commands' outputs, taken from the
code before the stage packages were introduced (issue 10), with the same arguments as below.
Values are not compared (timings differ run to run); a key that appears or disappears fails.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from json_keys import key_paths

BIN = Path(sys.executable).parent / "infermeter"
EXPECTED = json.loads((Path(__file__).parent / "data" / "json_keys.json").read_text())

COMMANDS = {
    "audit": ["audit", "--config", "configs/smoke.yaml"],
    "stream": [
        "stream",
        "--max-concurrency",
        "1,2",
        "--num-requests",
        "2",
        "--max-tokens",
        "4",
        "--warmup",
        "1",
        "--goodput",
        "ttft_ms:5000",
    ],
    "profile": [
        "profile",
        "--model",
        "arch:smollm2-135m",
        "--num-layers",
        "1",
        "--prompt-lengths",
        "8",
        "--batch-sizes",
        "1,2",
        "--max-new-tokens",
        "2",
        "--repeats",
        "1",
    ],
    "sweep": ["sweep", "--temperature", "0.0,1.0", "--samples", "2", "--max-tokens", "4"],
}


@pytest.mark.integration
@pytest.mark.parametrize("name", list(COMMANDS))
def test_json_output_keys_are_unchanged(name, tmp_path):
    out = tmp_path / f"{name}.json"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "INFERMETER_WORK_DIR": str(tmp_path / "work"),
        # a store of its own: the stored keys are a first audit's (no baseline, regression null)
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    result = subprocess.run(
        [str(BIN), *COMMANDS[name], "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    got = key_paths(json.loads(out.read_text()))
    want = set(EXPECTED[name])
    assert not want - got, f"keys gone from {name} --json: {sorted(want - got)}"
    assert not got - want, f"keys new in {name} --json: {sorted(got - want)}"
