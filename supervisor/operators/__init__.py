"""The operator's surface: the ``duomo`` command line and what it prints (status tables, the
live watch, ``duomo source``, ``duomo inspect``, the environment check), and the Prometheus
series with the operators' HTTP port. Reads records, never engine internals, except the
in-process commands (``duomo infer -c``) that run an engine of their own.
"""
