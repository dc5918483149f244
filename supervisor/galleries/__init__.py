"""The galleries the supervisor keeps (DESIGN.md §4e): what it does for the gallery control
messages and the ``duomo gallery`` commands.

- ``keeper``: the config's gallery models (``GalleryModel``: the file, its params, the pipeline
  that enrols into it), and each operation on one — its record (``ipc.gallery_records``), a page
  of its identities, an enrolment, a removal — on the file itself, opened per operation.

A served gallery (``worker.executors.gallery``) sees a change at its next batch by itself; the
file (``worker.galleries.store``) is the source of truth.
"""
