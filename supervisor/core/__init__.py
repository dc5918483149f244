"""The engine: the served models, their budgeted loads and evictions, and where they compute.

``engine`` (the in-process API over the models), ``registry`` (config entries to served
models), ``background_loads`` (loads no operator asked for), ``memory`` (the ledger and the
budgets), ``placement`` (core pools and device gates) and ``device_telemetry`` (what each device
reports). Usable without the process shell: ``Engine`` is what ``duomo infer -c`` and the tests
drive in-process.
"""
