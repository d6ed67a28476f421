"""`python -m snapshotter.fusefs STATE_FILE`: run one image's mount process (see process.py)."""

import sys

from snapshotter.fusefs.process import main

sys.exit(main())
