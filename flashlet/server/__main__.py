import sys

from flashlet.server.cli import main

if __name__ == "__main__":  # spawned engine-core processes import this module too
    sys.exit(main())
