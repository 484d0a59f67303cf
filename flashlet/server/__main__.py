import sys

from flashlet.server.cli import main

sys.exit(main())
