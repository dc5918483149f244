"""``python -m duomo.gateway``: one gateway worker (``gateway.main``)."""

import sys

from duomo.gateway.main import main

sys.exit(main())
