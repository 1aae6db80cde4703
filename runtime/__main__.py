"""`python -m runtime --recipe NAME ...`: what SkyPilot's `run` starts on every node."""

import sys

from runtime.entry import main

sys.exit(main())
