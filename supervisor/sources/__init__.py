"""The camera fleet the supervisor runs (DESIGN.md §4c): managed sources declared in ``sources:``
or added at run time, decoded in source worker processes it starts and restarts.

- ``definition``: what a source is (the fields of a ``sources:`` entry and of ``duomo source add``);
- ``store``: the sources added at run time, in an embedded SQLite database;
- ``workers``: the ``source_workers`` section, how many workers, their command line;
- ``fleet``: what should play, which worker decodes each source, and what the workers said.

The decoding itself is ``video.source_worker``'s (a producer process: ``video`` imports only
``ipc``); the records on the wire are ``ipc.source_records``'.
"""
