"""``duomo gallery``: enrol, remove, list and search the people of a gallery model.

::

    duomo gallery add GALLERY NAME IMAGE... [--replace] [--metadata JSON]
    duomo gallery remove GALLERY NAME      # and every trace of it: the file is vacuumed
    duomo gallery list GALLERY [--json] [--embeddings]
    duomo gallery search GALLERY IMAGE [--json]
    duomo gallery export GALLERY FILE      # a JSON document (worker.galleries.exchange)
    duomo gallery import GALLERY FILE [--replace]

With a running supervisor (``--socket``, the default), each is control messages to it
(``galleries``, ``gallery_identities``, ``gallery_add``, ``gallery_remove``:
``supervisor.process.control_messages``), and ``add`` and ``search`` run the gallery's pipeline
through it: a change is live for its next frame. With ``-c CONFIG``, no supervisor is needed:
the command works on the gallery file the config names (``supervisor.galleries.keeper``), and
``add`` and ``search`` run the pipeline in this process (``Engine(loaded, only=[pipeline])``).
``export`` and ``import`` always read and write the file itself (all or nothing), its path from
the config or the supervisor. ``add`` takes exactly one face per image and names the image that
has none, several, or a failed embedding, writing nothing then (``ipc.gallery_faces``).

``list`` never prints an embedding unless ``--embeddings`` asks for them (biometric data: then
as JSON). Exit codes as every ``duomo`` command: 0, 1 (no supervisor, or it failed), 2 (a bad
argument, an unknown gallery or name, an image that cannot enrol).

Registered by ``supervisor.operators.cli``'s parser (``add_parser``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from duomo.ipc.client import Client
from duomo.ipc.command_line import EXIT_INVALID, EXIT_OK, exit_code
from duomo.ipc.errors import DuomoError, InvalidArgumentError
from duomo.ipc.galleries import GalleryHandle, every_page
from duomo.ipc.gallery_faces import enrolment_pipeline, identified_faces, single_embedding
from duomo.ipc.gallery_records import GalleryInfo
from duomo.ipc.json_values import json_default
from duomo.supervisor.config import ConfigError, LoadedConfig, load_config
from duomo.supervisor.operators import text_table
from duomo.supervisor.operators.text_table import Column

LIST_COLUMNS = (
    Column("name"), Column("embeddings", True), Column("enrolled"), Column("metadata")
)  # fmt: skip
SEARCH_COLUMNS = (
    Column("face", True), Column("box"), Column("score", True), Column("identity"),
    Column("similarity", True),
)  # fmt: skip


def add_parser(
    sub: Any, socket_arg: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """``duomo gallery …`` on the CLI's subparsers (``socket_arg`` adds ``--socket``)."""
    gallery = sub.add_parser("gallery", help="the people of a gallery: add, remove, list …")
    verbs = gallery.add_subparsers(dest="verb", required=True)

    add = verbs.add_parser("add", help="enrol a person from images of them, one face each")
    add.add_argument("gallery")
    add.add_argument("name")
    add.add_argument("images", nargs="+", metavar="IMAGE")
    add.add_argument("--replace", action="store_true", help="replace a person of that name")
    add.add_argument("--metadata", default=None, metavar="JSON", help="a JSON object kept")
    add.set_defaults(func=cmd_add)

    remove = verbs.add_parser("remove", help="remove a person, and every trace of them")
    remove.add_argument("gallery")
    remove.add_argument("name")
    remove.set_defaults(func=cmd_remove)

    listing = verbs.add_parser("list", help="the people enrolled (never their embeddings)")
    listing.add_argument("gallery")
    listing.add_argument("--json", action="store_true")
    listing.add_argument(
        "--embeddings", action="store_true", help="with their embeddings (JSON): biometric data"
    )
    listing.set_defaults(func=cmd_list)

    search = verbs.add_parser("search", help="who the gallery finds in an image")
    search.add_argument("gallery")
    search.add_argument("image", metavar="IMAGE")
    search.add_argument("--json", action="store_true")
    search.set_defaults(func=cmd_search)

    export = verbs.add_parser("export", help="write the gallery to a JSON file (biometric data)")
    export.add_argument("gallery")
    export.add_argument("file", type=Path, metavar="FILE")
    export.set_defaults(func=cmd_export)

    imported = verbs.add_parser("import", help="enrol everyone of an export (all or nothing)")
    imported.add_argument("gallery")
    imported.add_argument("file", type=Path, metavar="FILE")
    imported.add_argument("--replace", action="store_true", help="replace people of those names")
    imported.set_defaults(func=cmd_import)

    for verb in (add, remove, listing, search, export, imported):
        verb.add_argument(
            "-c", "--config", type=Path, default=None,
            help="work on the gallery file of this config, without a supervisor",
        )  # fmt: skip
        socket_arg(verb)
    return gallery


class Galleries(Protocol):
    """Where a command's galleries are: a running supervisor, or a config's files."""

    def info(self, gallery: str) -> GalleryInfo: ...

    def answer(self, pipeline: str, image: Any) -> Any: ...

    def add(
        self,
        gallery: str,
        name: str,
        embeddings: list[list[float]],
        replace: bool,
        metadata: dict[str, Any] | None,
    ) -> dict[str, Any]: ...

    def remove(self, gallery: str, name: str) -> None: ...

    def identities(self, gallery: str, embeddings: bool) -> list[dict[str, Any]]: ...


class SupervisorGalleries:
    """The galleries of the running supervisor, through its control messages."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._pipelines: dict[str, Any] = {}  # attached once per command

    def info(self, gallery: str) -> GalleryInfo:
        return GalleryHandle(self.client, gallery).info()

    def answer(self, pipeline: str, image: Any) -> Any:
        if pipeline not in self._pipelines:
            self._pipelines[pipeline] = self.client.model(pipeline, slots=1)
        return self._pipelines[pipeline].infer(image, timeout_s=60)

    def add(
        self,
        gallery: str,
        name: str,
        embeddings: list[list[float]],
        replace: bool,
        metadata: dict[str, Any] | None,
    ) -> dict[str, Any]:
        return GalleryHandle(self.client, gallery).add_embeddings(
            name, embeddings, replace, metadata
        )

    def remove(self, gallery: str, name: str) -> None:
        GalleryHandle(self.client, gallery).remove(name)

    def identities(self, gallery: str, embeddings: bool) -> list[dict[str, Any]]:
        return GalleryHandle(self.client, gallery).identities(embeddings)


class FileGalleries:
    """The galleries of a config, on their files; its pipelines run in this process (an engine
    started on the first image, stopped with ``close``)."""

    def __init__(self, loaded: LoadedConfig) -> None:
        from duomo.supervisor.galleries.keeper import GalleryKeeper

        self.loaded = loaded
        self.keeper = GalleryKeeper(lambda: loaded)
        self._engine: Any = None

    def info(self, gallery: str) -> GalleryInfo:
        return self.keeper.model(gallery).info()

    def answer(self, pipeline: str, image: Any) -> Any:
        if self._engine is None:
            from duomo.supervisor.core.engine import Engine

            engine = Engine(self.loaded, only=[pipeline])
            try:
                engine.start()
            except (ValueError, RuntimeError) as err:  # a thread plan, a model that cannot load
                engine.close()
                raise InvalidArgumentError(f"pipeline {pipeline!r} cannot start: {err}") from None
            except BaseException:
                engine.close()
                raise
            self._engine = engine
        return self._engine.infer(pipeline, image)

    def add(
        self,
        gallery: str,
        name: str,
        embeddings: list[list[float]],
        replace: bool,
        metadata: dict[str, Any] | None,
    ) -> dict[str, Any]:
        return self.keeper.add(gallery, name, embeddings, replace, metadata)

    def remove(self, gallery: str, name: str) -> None:
        self.keeper.remove(gallery, name)

    def identities(self, gallery: str, embeddings: bool) -> list[dict[str, Any]]:
        return every_page(
            lambda after: self.keeper.identities(gallery, after, embeddings=embeddings)
        )

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


class CommandFailed(Exception):
    """A command's failure already printed: its exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def galleries(args: argparse.Namespace) -> Iterator[Galleries]:
    """The galleries the command works on: the config's files (``-c``) or the supervisor's."""
    if args.config is not None:
        try:
            loaded = load_config(args.config)
        except ConfigError as err:
            print(err.render(), file=sys.stderr)
            raise CommandFailed(EXIT_INVALID) from None
        local = FileGalleries(loaded)
        try:
            yield local
        finally:
            local.close()
        return
    try:
        client = Client(args.socket, timeout_s=30)
    except DuomoError as err:
        _say(args, f"{err.message} (start one with: duomo start, or give -c CONFIG)")
        raise CommandFailed(exit_code(err)) from None
    with client:
        yield SupervisorGalleries(client)


def _run(args: argparse.Namespace, work: Callable[[Galleries], int]) -> int:
    """``work`` on the command's galleries; a DuomoError printed, as its exit code."""
    try:
        with galleries(args) as found:
            return work(found)
    except CommandFailed as failed:
        return failed.code
    except DuomoError as err:
        _say(args, err.message)
        return exit_code(err)


def _say(args: argparse.Namespace, message: str) -> None:
    print(f"duomo gallery {args.verb}: {message}", file=sys.stderr)


def cmd_add(args: argparse.Namespace) -> int:
    from duomo.supervisor.operators.image_files import read_image

    metadata = None
    if args.metadata is not None:
        try:
            metadata = json.loads(args.metadata)
        except json.JSONDecodeError as err:
            _say(args, f"--metadata is not JSON: {err}")
            return EXIT_INVALID
        if not isinstance(metadata, dict):
            _say(args, "--metadata must be a JSON object")
            return EXIT_INVALID

    def add(found: Galleries) -> int:
        info = found.info(args.gallery)
        pipeline = enrolment_pipeline(info)
        embeddings = [
            single_embedding(found.answer(pipeline, read_image(path)), info, path)
            for path in args.images
        ]  # every image checked before anything is written
        reply = found.add(args.gallery, args.name, embeddings, args.replace, metadata)
        done = "replaced" if reply["replaced"] else "enrolled"
        count = reply["identity"]["embeddings"]
        print(f"{done} {args.name} in {args.gallery} ({count} embedding{'s' * (count != 1)})")
        return EXIT_OK

    return _run(args, add)


def cmd_remove(args: argparse.Namespace) -> int:
    def remove(found: Galleries) -> int:
        found.remove(args.gallery, args.name)
        print(f"removed {args.name} from {args.gallery} (the file vacuumed: no trace left)")
        return EXIT_OK

    return _run(args, remove)


def cmd_list(args: argparse.Namespace) -> int:
    def listing(found: Galleries) -> int:
        identities = found.identities(args.gallery, args.embeddings)
        if args.json or args.embeddings:
            print(json.dumps(identities, indent=2, ensure_ascii=False))
        elif not identities:
            print(f"nobody in {args.gallery} (enrol: duomo gallery add {args.gallery} NAME IMAGE)")
        else:
            print("\n".join(text_table.render(LIST_COLUMNS, _identity_rows(identities))))
        return EXIT_OK

    return _run(args, listing)


def _identity_rows(identities: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            i["name"], str(i["embeddings"]),
            datetime.datetime.fromtimestamp(i["created"]).isoformat(" ", "seconds"),
            json.dumps(i["metadata"], ensure_ascii=False) if i["metadata"] else "-",
        ]
        for i in identities
    ]  # fmt: skip


def cmd_search(args: argparse.Namespace) -> int:
    from duomo.supervisor.operators.image_files import read_image

    def search(found: Galleries) -> int:
        info = found.info(args.gallery)
        answer = found.answer(enrolment_pipeline(info), read_image(args.image))
        faces = identified_faces(answer, info)
        if args.json:
            shown = {"image": args.image, "gallery": args.gallery, "faces": faces}
            print(json.dumps(shown, default=json_default, ensure_ascii=False))
        elif not faces:
            print(f"{args.image}: no face found")
        else:
            print("\n".join(text_table.render(SEARCH_COLUMNS, _face_rows(faces))))
        return EXIT_OK

    return _run(args, search)


def _face_rows(faces: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for i, face in enumerate(faces):
        identity = face["identity"]
        box = ",".join(f"{v:.0f}" for v in face["box"] or ())
        if "error" in identity:
            who, similarity = f"error: {identity['error'].get('message')}", "-"
        else:
            who = identity["name"] if identity["name"] is not None else "(nobody)"
            found = identity["similarity"]
            similarity = "-" if found is None else f"{found:.3f}"
        rows.append([str(i + 1), box, f"{face['score']:.2f}", who, similarity])
    return rows


def cmd_export(args: argparse.Namespace) -> int:
    from duomo.worker.galleries.exchange import export_gallery

    def export(found: Galleries) -> int:
        with _store(found.info(args.gallery)) as store:
            count = export_gallery(store, args.file)
        print(f"exported {count} of {args.gallery} to {args.file} (biometric data: keep it safe)")
        return EXIT_OK

    return _run(args, export)


def cmd_import(args: argparse.Namespace) -> int:
    from duomo.worker.galleries.exchange import import_gallery
    from duomo.worker.galleries.store import GalleryLimits

    def imported(found: Galleries) -> int:
        info = found.info(args.gallery)
        limits = GalleryLimits(info.max_identities, info.max_embeddings_per_identity)
        with _store(info) as store:
            count = import_gallery(store, args.file, args.replace, limits)
        print(f"imported {count} into {args.gallery} from {args.file}")
        return EXIT_OK

    return _run(args, imported)


def _store(info: GalleryInfo) -> Any:
    """The gallery's file itself, checked to be one of its embedding model (``info`` made it
    if it was missing)."""
    from duomo.worker.galleries.store import GalleryStore

    return GalleryStore.open(Path(info.file), info.embedding_model, info.dimension)
