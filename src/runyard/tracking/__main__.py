"""`python -m runyard.tracking RUN_DIR --parent PID`: the mirror's process (runyard.tracking.process)."""

import sys

from runyard.tracking.process import main

sys.exit(main())
