"""`python -m keel.cli`, as `keel`."""

import sys

from keel.cli import main

sys.exit(main())
