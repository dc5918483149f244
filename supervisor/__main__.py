"""``python -m duomo.supervisor``: the ``duomo`` command (``supervisor.operators.cli``), for a
checkout or a venv without the console script on its path."""

from duomo.supervisor.operators.cli import main

raise SystemExit(main())
