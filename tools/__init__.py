"""Operator tools around the supervisor: model preparation, ATC conversion, the benchmark
(``tools.bench``, run as ``duomo bench``), the soak and the Ascend smoke kit."""
