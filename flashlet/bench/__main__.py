import sys

from flashlet.bench.cli import main

sys.exit(main())
