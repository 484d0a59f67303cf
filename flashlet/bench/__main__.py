import sys

from flashlet.bench.cli import main

if __name__ == "__main__":  # not in the --url client processes (spawned)
    sys.exit(main())
