"""``python -m gateway``: one gateway worker (``gateway.main``)."""

import sys

from gateway.main import main

sys.exit(main())
