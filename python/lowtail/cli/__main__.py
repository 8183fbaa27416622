"""``python -m lowtail.cli.main``."""

import sys

from lowtail.cli.main import main

sys.exit(main())
