"""Wait (up to 180 s) until the server at the URL given answers /health: the device scripts' start-up wait."""

import sys
import time

import httpx

for _ in range(180):
    try:
        if httpx.get(f"{sys.argv[1]}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
