import signal
import sys


def _stop_before_start(signum, frame) -> None:
    # Until main() sets its own handlers nothing has been started (no engine core, no
    # socket served): a stop is a clean exit, as it is at any later moment.
    sys.exit(0)


if __name__ == "__main__":  # spawned engine-core processes import this module too
    # First, before the imports below take their seconds (torch, fastapi).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_before_start)
    from flashlet.server.cli import main

    sys.exit(main())
