"""``python -m jaxfold.cli``."""

import sys

from jaxfold.cli import main

sys.exit(main())
