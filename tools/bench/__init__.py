"""``duomo bench``: Duomo against the engine limit, one process per model, Triton and Mosec on a
mixed multi-model load, measured in one run on one machine with the modes interleaved.

Modules: ``workload`` (the workload file), ``answers`` (what counts as a correct answer),
``tally`` (counting answers in the measured window), ``inprocess`` (the executors driven without
IPC: weights and the ``engine`` mode), ``producer`` (a load-generating client process),
``servers`` (starting and stopping each mode's servers), ``peers`` (Triton's and Mosec's own
environments; their apps are in ``peer_apps``), ``sampler`` (memory and CPU of a process tree),
``report`` (JSON, Markdown, PNG) and ``run`` (the phases, and the CLI entry). ``results/`` keeps
the run of record and the runs the docs cite, nothing else. ``experiments`` holds one-off
measurements behind design decisions (its ``README.md`` says what each measured): not part of
the product.
"""
