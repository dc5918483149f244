"""The sinks the supervisor runs (DESIGN.md §4d): the config's ``sinks:``, delivered by one sink
worker process it starts, restarts and stops.

- ``hub``: the sinks now, the sink worker (run by ``ChildProcesses``), what it last reported,
  and where a source's events go (``SinkHub.plan``).

The delivery itself is ``duomo.sinks``' (``sinks.worker``: a process of its own, so a slow broker
never touches the supervisor); the record on the wire is ``ipc.sink_records``'.
"""
