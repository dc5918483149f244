"""Galleries: a model whose weights are enrolled identities (DESIGN.md §4e).

The rooms, each its own module:

- ``entries``: what an identity is as it goes in and comes out (``Identity``), and the checks
  on its name, metadata and vectors;
- ``file_format``: the gallery file's SQLite schema, how it is created and opened, and how a
  foreign, newer or corrupt file is told (``GalleryFileError``);
- ``store``: the gallery file, an embedded SQLite database (``GalleryStore``): create, open
  and check it, add, remove, list, its ``version``;
- ``exchange``: a gallery's export and import (a JSON document);
- ``snapshot``: the identities held in memory as one matrix (``GallerySnapshot``) and the exact
  cosine search over it;
- ``session``: a served gallery file (``GallerySession``): the snapshot it serves, swapped whole
  when the file's ``version`` changes, and the memory it is charged.

The ``gallery`` task (``worker.executors.gallery``) serves a gallery file over these; the
supervisor's tools (enrolment, the CLI) write the file through ``store``, and a serving model
sees the change on its next batch.
"""
