"""Where a run keeps what must outlive its processes: one location, named by an absolute
path or a URI, that every actor reads and writes the same way, whatever its working
directory or node.

A location is what Ray Train's ``RunConfig(storage_path=...)`` takes, resolved the same
way, through :func:`pyarrow.fs.FileSystem.from_uri`:

- a local path (``runs``, ``/mnt/nfs/runs``): made absolute where it is given (the driver),
  so a worker in another working directory writes to the same folder. On a cluster it must
  be a shared filesystem (NFS, EFS, a Lustre mount): a plain local disk is another folder
  on every node;
- a URI: ``s3://bucket/runs`` (options as a query: ``?region=us-east-1&endpoint_override=
  localhost:9000``), ``gs://``, ``hdfs://``, ``abfs://``, ``file://``. Credentials come
  from the environment, as pyarrow (and Ray Train) finds them.

:class:`StoragePath` reads like :class:`pathlib.Path` (``location / "step_000004"``,
``read_text``, ``is_dir``, ``iterdir``) and pickles as its URI, so a task or an actor gets
a handle it rebuilds itself. Code that needs a local folder (Hugging Face's
``save_pretrained`` / ``from_pretrained``, ``torch.save``) goes through
:meth:`StoragePath.staged_directory` (write locally, uploaded at the end) and
:meth:`StoragePath.as_directory` (downloaded first); on a local filesystem both are the
folder itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

__all__ = ["StoragePath"]

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_COPY_CHUNK = 64 * 1024 * 1024  # bytes per transfer: large checkpoint files in few calls


class StoragePath:
    """A file or folder on a local, shared or cloud filesystem (see the module).

    ``StoragePath("runs")`` is ``<cwd>/runs`` of the process that made it, from then on;
    ``StoragePath("s3://bucket/runs") / "tspo"`` is ``s3://bucket/runs/tspo``. ``str()``
    gives the plain path for a local path, else the URI; ``os.fspath()`` works on local
    ones only.
    """

    __slots__ = ("_rel", "_root")

    def __init__(self, location: str | os.PathLike[str] | StoragePath):
        if isinstance(location, StoragePath):
            self._root, self._rel = location._root, location._rel
            return
        text = os.fspath(location)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"a storage location is a path or a URI such as s3://bucket/runs, got {text!r}"
            )
        self._root = text if _URI.match(text) else os.path.abspath(os.path.expanduser(text))
        self._rel = ""

    @classmethod
    def _at(cls, root: str, rel: str) -> StoragePath:
        path = cls.__new__(cls)
        path._root, path._rel = root, rel
        return path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:  # a task rebuilds it from strings
        return (StoragePath._at, (self._root, self._rel))

    # ----------------------------------------------------------------- names
    def __truediv__(self, name: str | os.PathLike[str]) -> StoragePath:
        return StoragePath._at(self._root, posixpath.join(self._rel, os.fspath(name)))

    @property
    def name(self) -> str:
        return posixpath.basename(self._rel or self._fs_and_root()[1].rstrip("/"))

    def __str__(self) -> str:
        if not self._rel:
            return self._root
        if not _URI.match(self._root):
            return os.path.join(self._root, self._rel)
        parts = urlsplit(self._root)  # the options (?region=...) stay after the path
        path = parts.path.rstrip("/") + "/" + quote(self._rel)
        query = f"?{parts.query}" if parts.query else ""
        return f"{parts.scheme}://{parts.netloc}{path}{query}"

    def __repr__(self) -> str:
        return f"StoragePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoragePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __fspath__(self) -> str:
        local = self.local_path
        if local is None:
            raise TypeError(
                f"{self} is not on this machine's filesystem: read it with as_directory(), "
                "write it with staged_directory()"
            )
        return str(local)

    # ----------------------------------------------------------------- the filesystem
    def _fs_and_root(self) -> tuple[Any, str]:
        return _filesystem(self._root)

    @property
    def _fs(self) -> Any:
        return self._fs_and_root()[0]

    @property
    def _path(self) -> str:
        root = self._fs_and_root()[1]
        return posixpath.join(root, self._rel) if self._rel else root

    @property
    def is_local(self) -> bool:
        """Whether this machine's filesystem holds it (a local disk, or a shared one mounted
        here): then files are written in place and folders renamed atomically."""
        from pyarrow.fs import LocalFileSystem

        return isinstance(self._fs, LocalFileSystem)

    @property
    def local_path(self) -> Path | None:
        """The path on this machine (None for an object store)."""
        return Path(self._path) if self.is_local else None

    def _type(self) -> Any:
        return self._fs.get_file_info(self._path).type

    def exists(self) -> bool:
        from pyarrow.fs import FileType

        return self._type() != FileType.NotFound

    def is_file(self) -> bool:
        from pyarrow.fs import FileType

        return self._type() == FileType.File

    def is_dir(self) -> bool:
        """A folder; on an object store, a prefix that holds something."""
        from pyarrow.fs import FileType

        return self._type() == FileType.Directory

    def iterdir(self) -> list[StoragePath]:
        """What the folder holds, one level ([] when it does not exist)."""
        from pyarrow.fs import FileSelector

        infos = self._fs.get_file_info(FileSelector(self._path, allow_not_found=True))
        return sorted((self / posixpath.basename(i.path.rstrip("/")) for i in infos), key=str)

    def mkdir(self) -> None:
        """Make the folder and its parents (present already is fine)."""
        self._fs.create_dir(self._path, recursive=True)

    def delete(self) -> None:
        """Delete the file, or the folder with everything in it; absent is fine."""
        from pyarrow.fs import FileType

        kind = self._type()
        if kind == FileType.Directory:
            self._fs.delete_dir(self._path)
        elif kind != FileType.NotFound:
            self._fs.delete_file(self._path)

    def rename(self, target: StoragePath) -> None:
        """Move to ``target`` on the same filesystem (atomic on a local one; an object store
        copies, so the checkpoint code renames only local folders)."""
        self._fs.move(self._path, StoragePath(target)._path)

    # ----------------------------------------------------------------- contents
    def read_bytes(self) -> bytes:
        with self._fs.open_input_stream(self._path) as stream:
            return stream.read()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_bytes(self, data: bytes | memoryview | Any) -> None:
        """Write ``data`` (bytes or an Arrow buffer), replacing the file; its folder is made."""
        self._fs.create_dir(posixpath.dirname(self._path), recursive=True)
        with self._fs.open_output_stream(self._path) as stream:
            stream.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[Path]:
        """This folder as a local one for the ``with`` block: itself on a local filesystem,
        else a temporary download of it, deleted after."""
        local = self.local_path
        if local is not None:
            yield local
            return
        if not self.is_dir():
            raise FileNotFoundError(f"{self} does not exist (or holds nothing)")
        folder = Path(tempfile.mkdtemp(prefix="ray_credit_download_"))
        try:
            _copy(self._path, str(folder), source=self._fs)
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def staged_directory(self) -> Iterator[Path]:
        """A local folder to write this folder's contents into: itself on a local
        filesystem (made first), else a temporary one uploaded here when the block ends
        without an error (and deleted either way)."""
        local = self.local_path
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            yield local
            return
        folder = Path(tempfile.mkdtemp(prefix="ray_credit_upload_"))
        try:
            yield folder
            _copy(str(folder), self._path, destination=self._fs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@functools.lru_cache(maxsize=32)
def _filesystem(root: str) -> tuple[Any, str]:
    """pyarrow's filesystem and path for ``root``, once per process (resolving an S3
    bucket's region is a request)."""
    import pyarrow as pa
    from pyarrow.fs import FileSystem, LocalFileSystem

    if not _URI.match(root):
        return LocalFileSystem(), root
    try:
        fs, path = FileSystem.from_uri(root)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise ValueError(
            f"{root}: pyarrow cannot open this location ({err}); give a path, or a URI of a "
            "filesystem pyarrow knows: s3://, gs://, hdfs://, abfs://, file://"
        ) from None
    return fs, path.rstrip("/") or path


def _copy(src: str, dst: str, *, source: Any = None, destination: Any = None) -> None:
    """A folder's contents copied into ``dst`` (made as needed), as Ray Train copies its
    checkpoints: ``pyarrow.fs.copy_files`` in large chunks, without threads into S3 (a
    threaded upload there can hang: apache/arrow#32372)."""
    import pyarrow.fs as pafs

    local = pafs.LocalFileSystem()
    destination = destination or local
    s3 = getattr(pafs, "S3FileSystem", ())  # absent from a pyarrow built without S3
    pafs.copy_files(
        src,
        dst,
        source_filesystem=source or local,
        destination_filesystem=destination,
        chunk_size=_COPY_CHUNK,
        use_threads=not isinstance(destination, s3),
    )
