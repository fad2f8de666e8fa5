import sys

from runyard.cli import main

sys.exit(main())
