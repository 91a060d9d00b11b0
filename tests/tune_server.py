"""A user's own server for `infermeter tune --serve-cmd` tests: the ground-truth instrument
(tests/groundtruth_server.py) behind a command line of its own, with two parameters a grid can
vary and a test can check:

    python tests/tune_server.py --port N [--startup-delay-s S] [--crash | --no-crash]

``--startup-delay-s``: sleep before listening (the configuration's startup time grows by it);
``--crash``: print a line to stderr and exit 3 before ever being healthy.
"""

import argparse
import asyncio
import contextlib
import sys
import time

import groundtruth_server as gt  # this script's folder is on sys.path when it runs

_plain_send_json = gt._send_json


async def _send_json(writer, status, body):
    """The instrument answers no route but its own; a server of ours answers health as OpenAI
    servers do: ``GET /v1/models`` -> 200 (the instrument serves any model name)."""
    if status == 404 and "no route /v1/models" in str(body):
        return await _plain_send_json(writer, 200, {"object": "list", "data": [{"id": "tune-server"}]})
    return await _plain_send_json(writer, status, body)


gt._send_json = _send_json

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--startup-delay-s", type=float, default=0.0)
parser.add_argument("--crash", action=argparse.BooleanOptionalAction, default=False)
args = parser.parse_args()
if args.crash:
    print("tune_server: crashing before it is healthy, as asked (--crash)", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(args.startup_delay_s)
with contextlib.suppress(KeyboardInterrupt):
    asyncio.run(gt._main(args.port))
