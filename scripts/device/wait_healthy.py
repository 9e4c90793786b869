"""Wait (up to 180 s) until the server at the URL given answers /health: the device scripts' start-up wait."""

import sys

from plait.bench.serve_client import wait_healthy

wait_healthy(sys.argv[1], limit_s=180, poll_s=1.0, probe_timeout_s=2.0)
