"""The line protocol between the harness and its workers: a worker prints JSON
lines on stdout ({"ready": ...} once initialised, then its result), waits for
"go" on stdin before its measured part, and holds its GPU memory until stdin
closes (so racing workers and NVML samples see everything held at once).
Errors are results too ({"error": ...}): a worker never exits silently."""

import json
import sys
import traceback


def say(**obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def ready(**info):
    say(ready=True, **info)
    if sys.stdin.readline().strip() != "go":
        sys.exit(0)  # the harness gave up on us


def hold():
    while sys.stdin.readline():
        pass


def main(fn):
    """Runs fn(); any exception becomes an {"error": ...} line and exit 1."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported, never swallowed
        if isinstance(e, SystemExit):
            raise
        say(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
        sys.exit(1)
