"""Where a trace store lives: the one place that decides between a local path and an fsspec URL.

:class:`Location` is what every command and :func:`~tracediff.store.open_store` turn their
argument into. A local path (or a ``file://`` URL) stays a path, read and written with the direct
file code of this package; anything else with a scheme (``s3://``, ``gs://``, ``https://``...) is
an object store reached through fsspec, with the credentials and endpoints fsspec users expect:
the standard environment and config files (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``,
``~/.aws/config``... read by s3fs and botocore themselves) plus explicit ``storage_options``.

:attr:`Location.display` is what messages print: the URL without user, password or query string
(a presigned URL's signature), never a storage option. This module never imports fsspec until a
URL needs it, so local stores do not pay for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tracediff.errors import CorruptStoreError, RemoteStoreError, StoreError, UsageError, first_line

log = logging.getLogger("tracediff")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: Object requests one operation keeps in flight (each a chunk of a few MiB at most).
FETCH_CONCURRENCY = 32
#: Tries of a conditional PUT that S3 answers with 409 (another conditional write of the key in flight).
_CREATE_ATTEMPTS = 5

# Storage options the CLI's --storage-option sets for every URL a command opens (its stores, its
# bank, the stores replay reopens); an explicit ``storage_options`` argument replaces them.
_default_options: dict[str, Any] = {}


def is_url(target: object) -> bool:
    """Whether ``target`` is a URL with a scheme (``s3://...``), not a local path."""
    return isinstance(target, (str, Location)) and (isinstance(target, Location) or _SCHEME.match(target) is not None)


def parse_storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings (the CLI's ``--storage-option``) as fsspec storage options. A value is
    JSON when it parses (``5``, ``true``, ``{"a": 1}``), else the string itself; a dotted key
    (``client_kwargs.region_name=eu-west-1``) sets a key of a nested object."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise UsageError(
                f"--storage-option {item.split('=')[0]!r}: expected KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000"
            )
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        target = out
        *parents, last = key.split(".")
        for part in parents:
            nested = target.setdefault(part, {})
            if not isinstance(nested, dict):
                raise UsageError(f"--storage-option {key}: {part!r} is set to a value already, not an object")
            target = nested
        target[last] = value
    return out


@contextlib.contextmanager
def default_storage_options(options: Mapping[str, Any]) -> Iterator[None]:
    """Within this block, URLs opened without explicit ``storage_options`` use ``options`` (how a
    command's ``--storage-option`` reaches every store it opens, however deep)."""
    global _default_options
    previous = _default_options
    _default_options = dict(options)
    try:
        yield
    finally:
        _default_options = previous


def current_storage_options() -> dict[str, Any]:
    """The storage options URLs opened here without explicit ones get (see
    :func:`default_storage_options`): what a command passes on to processes that open its stores."""
    return dict(_default_options)


def _strip_secrets(url: str) -> str:
    """``url`` without a user:password part, query string or fragment (presigned URLs carry their
    signature there)."""
    match = _SCHEME.match(url)
    if not match:
        return url
    rest = url[match.end() :].split("?", 1)[0].split("#", 1)[0]
    netloc, slash, path = rest.partition("/")
    netloc = netloc.rsplit("@", 1)[-1]
    return f"{match.group(1).lower()}://{netloc}{slash}{path}"


class Location:
    """A trace store's address: a local folder / ``.zarr.zip`` (:attr:`local`), or an fsspec URL
    with its storage options (:attr:`fs`, :attr:`root`).

    Path-like where messages and callers need it (``str()`` is :attr:`display`, ``/ key`` joins,
    :attr:`name`), so a :class:`~tracediff.store.TraceStore`'s ``path`` can be one; reopening it
    (``open_store(store.path)``) keeps the storage options.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        match = _SCHEME.match(url)
        if match is None:
            raise UsageError(f"{url!r}: not a URL (expected SCHEME://...)")
        self.protocol = match.group(1).lower()
        self.url = url.rstrip("/") if len(url) > match.end() + 1 else url
        self.storage_options: dict[str, Any] = dict(_default_options if storage_options is None else storage_options)
        self.local: Path | None = None
        if self.protocol in ("file", "local"):
            self.local = Path(url[match.end() :] or "/")
        self._fs: Any = None

    @classmethod
    def of(
        cls, target: str | os.PathLike[str] | Location, storage_options: Mapping[str, Any] | None = None
    ) -> Location:
        """The location of ``target``: a path, a URL, or a Location (kept, or given new options)."""
        if isinstance(target, Location):
            if storage_options is None:
                return target
            return cls(target.url, storage_options)
        if isinstance(target, str) and _SCHEME.match(target):
            return cls(target, storage_options)
        loc = cls.__new__(cls)
        loc.protocol = "file"
        loc.local = Path(target)
        loc.url = os.fspath(target)
        loc.storage_options = {}
        loc._fs = None
        return loc

    # -- path-like -------------------------------------------------------------------------------
    @property
    def remote(self) -> bool:
        return self.local is None

    @property
    def display(self) -> str:
        """The address as messages print it: a local path as given, a URL without credentials."""
        return os.fspath(self.local) if self.local is not None else _strip_secrets(self.url)

    @property
    def name(self) -> str:
        return _strip_secrets(self.url).rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self.display

    def __repr__(self) -> str:
        return f"Location({self.display!r})"

    def __fspath__(self) -> str:
        if self.local is None:
            raise TypeError(f"{self.display} is a URL, not a local path")
        return os.fspath(self.local)

    def __truediv__(self, key: str) -> Location:
        return Location(f"{self.url.rstrip('/')}/{key}", self.storage_options)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and (self.url, self.storage_options) == (other.url, other.storage_options)

    def __hash__(self) -> int:
        return hash(self.url)

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for worker processes (dask): the filesystem is made again where it is used.
        return {**self.__dict__, "_fs": None}

    def resolve(self) -> Location:
        """Itself (``Path.resolve`` for a URL: the URL is already absolute)."""
        return self

    # -- the filesystem --------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        """The fsspec filesystem of a URL (a sync instance; its coroutines run on its own loop)."""
        if self._fs is None:
            try:
                import fsspec  # noqa: PLC0415
            except ImportError as exc:
                raise UsageError(
                    f"{self.display}: reading URLs needs fsspec (pip install 'tracediff[remote]')"
                ) from exc
            self._fs = self._make_fs(fsspec, asynchronous=False)
            quiet_lost_connections(zarr_loop=False)
        return self._fs

    def _make_fs(self, fsspec: Any, *, asynchronous: bool) -> Any:
        options = dict(self.storage_options)
        # s3fs retries a failed request 5 times inside each of 5 retries of the call: tens of
        # seconds before an unreachable endpoint is reported. ``retries`` sets that count.
        retries = options.pop("retries", None)
        if self.protocol in ("s3", "s3a"):
            # A reader of a store being recorded must see new objects: no cached listings.
            options.setdefault("use_listings_cache", False)
        if retries is not None:
            options["skip_instance_cache"] = True  # not the cached instance other callers share
        if asynchronous:
            options["asynchronous"] = True
        try:
            fs, _ = fsspec.url_to_fs(self.url, **options)
        except ImportError as exc:
            raise UsageError(f"{self.display}: {first_line(exc)}") from exc
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{self.display}: bad storage options ({first_line(exc)})") from exc
        if retries is not None:
            if not isinstance(retries, int) or isinstance(retries, bool) or retries < 1:
                raise UsageError(f"{self.display}: storage option retries={retries!r}: expected an integer >= 1")
            fs.retries = retries
        return fs

    @property
    def root(self) -> str:
        """The store's path inside :attr:`fs` (bucket/prefix for S3)."""
        return self.fs._strip_protocol(self.url).rstrip("/")

    def object_path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def where(self, key: str = "") -> str:
        """What a message names for store key ``key``: the URL (without secrets) and the key."""
        return f"{self.display}/{key}" if key else self.display

    def zarr_store(self, *, read_only: bool) -> Any:
        """zarr's FsspecStore of this URL. Reading: a missing object raises instead of reading as
        the fill value (a chunk of committed rows must exist: a fill value would be a wrong report)."""
        import fsspec  # noqa: PLC0415
        from zarr.storage import FsspecStore  # noqa: PLC0415

        allowed = {"allowed_exceptions": ()} if read_only else {}
        quiet_lost_connections()
        if not getattr(self.fs, "async_impl", False):  # zarr wraps a sync filesystem itself
            return FsspecStore.from_url(self.url, storage_options=self.storage_options, read_only=read_only, **allowed)
        return FsspecStore(fs=self._make_fs(fsspec, asynchronous=True), path=self.root, read_only=read_only, **allowed)

    # -- object operations, errors mapped to one line --------------------------------------------
    def read_object(self, key: str, limit: int | None = None) -> bytes | None:
        """The bytes of object ``key`` (None if absent); with ``limit``, at most ``limit + 1`` bytes
        are fetched (one ranged GET: an oversized object is refused without downloading it)."""
        try:
            if limit is None:
                return self.fs.cat_file(self.object_path(key))
            return self.fs.cat_file(self.object_path(key), start=0, end=limit + 1)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001  (s3fs, aiohttp and botocore raise many types)
            raise remote_error(self.where(key), exc) from exc

    def read_objects(
        self, keys: Sequence[str], limit: int | None = None, spans: Sequence[tuple[int, int]] | None = None
    ) -> list[bytes | BaseException]:
        """The bytes of each object in ``keys``, fetched concurrently (up to FETCH_CONCURRENCY in
        flight); a failed fetch is its exception in the list (FileNotFoundError when absent). With
        ``limit``, at most ``limit + 1`` bytes of each; with ``spans``, bytes [start, end) of each
        (ranged GETs)."""
        paths = [self.object_path(k) for k in keys]
        fs = self.fs
        whole = {} if limit is None else {"start": 0, "end": limit + 1}
        ranges = [whole] * len(paths) if spans is None else [{"start": a, "end": b} for a, b in spans]
        if not getattr(fs, "async_impl", False):
            out: list[bytes | BaseException] = []
            for path, span in zip(paths, ranges, strict=True):
                try:
                    out.append(fs.cat_file(path, **span))
                except Exception as exc:  # noqa: BLE001
                    out.append(exc)
            return out
        from fsspec.asyn import sync  # noqa: PLC0415

        async def fetch_all() -> list[bytes | BaseException]:
            gate = asyncio.Semaphore(FETCH_CONCURRENCY)

            async def one(path: str, span: dict[str, int]) -> bytes | BaseException:
                async with gate:
                    try:
                        return await fs._cat_file(path, **span)
                    except Exception as exc:  # noqa: BLE001
                        return exc

            return await asyncio.gather(*(one(p, r) for p, r in zip(paths, ranges, strict=True)))

        return sync(fs.loop, fetch_all)

    def create_object(self, key: str, data: bytes) -> bool:
        """Write object ``key`` unless it exists: True when this call created it, False when it was
        there (another process wrote it, maybe at this very moment). Shared objects of a store that
        several processes write (its root, its tap groups) are created this way, never by zarr's
        check-then-write, which fails when another process creates the object in between.

        One conditional PUT (``If-None-Match: *``) where the filesystem has them (s3fs); S3 answers
        a conditional PUT racing another one with 409 ConditionalRequestConflict, "retry", which
        this does. A filesystem without conditional writes gets a check, then a PUT: two processes
        may then both write the object, so callers only create this way objects whose contents any
        of them may win with, or read back what is there."""
        path = self.object_path(key)
        for attempt in range(_CREATE_ATTEMPTS):
            try:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except TypeError:  # an fsspec filesystem without conditional writes
                    if self.fs.exists(path):
                        return False
                    self.fs.pipe_file(path, data)
                return True
            except FileExistsError:  # s3fs's translation of 412 PreconditionFailed
                return False
            except Exception as exc:  # noqa: BLE001  (s3fs, aiohttp and botocore raise many types)
                if "ConditionalRequestConflict" in str(exc) and attempt + 1 < _CREATE_ATTEMPTS:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise remote_error(self.where(key), exc, "written") from exc
        return False  # not reached: the last attempt returns or raises

    def delete_all(self) -> None:
        """Delete every object below the store's root (nothing there is not an error)."""
        try:
            self.fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            raise remote_error(self.display, exc, "deleted") from exc

    def list_sizes(self, key: str) -> dict[str, int]:
        """Every object below ``key`` (recursively) and its size, keyed relative to the store root:
        one paginated listing (1000 objects a request on S3), no request per object."""
        base = self.object_path(key)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:  # noqa: BLE001
            raise remote_error(self.where(key), exc, "listed") from exc
        prefix = self.root + "/"
        return {
            name[len(prefix) :]: int(info.get("size") or 0)
            for name, info in found.items()
            if name.startswith(prefix) and info.get("type", "file") != "directory"
        }

    def list_sizes_many(self, keys: Sequence[str]) -> list[dict[str, int]]:
        """:meth:`list_sizes` of each of ``keys``, the listings made concurrently (one round trip
        for a writer group's eight arrays instead of eight)."""
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        if len(keys) <= 1:
            return [self.list_sizes(k) for k in keys]
        with ThreadPoolExecutor(min(len(keys), 8), thread_name_prefix="tracediff-list") as pool:
            return list(pool.map(self.list_sizes, keys))

    def list_folders(self, key: str) -> list[str]:
        """Names of the "folders" (common prefixes) directly below ``key``, sorted."""
        base = self.object_path(key)
        try:
            entries = self.fs.ls(base, detail=True, **({"refresh": True} if self.protocol in ("s3", "s3a") else {}))
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            raise remote_error(self.where(key), exc, "listed") from exc
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")


# -- the event loops' orphaned transport errors ---------------------------------------------------
_quiet_lock = threading.Lock()
_ORPHAN_MESSAGES = ("Task exception was never retrieved", "Future exception was never retrieved")
_TRANSPORT_MODULES = ("aiohttp", "aiobotocore", "botocore", "s3fs", "gcsfs", "adlfs")


def lost_connection(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a request's transport failing (a reset, refused or closed connection, a
    timeout): what the request itself raises too, and its caller retries or reports."""
    if exc is None:
        return False
    if isinstance(exc, (OSError, TimeoutError, asyncio.TimeoutError)):
        return True
    # The clients' own connection errors (aiohttp's ServerDisconnectedError, botocore's
    # EndpointConnectionError, ReadTimeoutError...); their other errors (a refused request, a bad
    # URL) are not the transport's.
    name = type(exc).__name__
    return type(exc).__module__.split(".")[0] in _TRANSPORT_MODULES and any(
        word in name for word in ("Connection", "Disconnect", "Timeout", "Payload"))


def quiet_lost_connections(*, zarr_loop: bool = True) -> None:
    """Keep aiohttp's orphaned helper tasks off the host's stderr. When a connection resets while a
    request is sent, aiohttp's body-writing task ends with the same error the request raises; no
    one awaits that task, so asyncio logs "Task exception was never retrieved" with a traceback
    when it is collected, on a loop thread inside a trainer or server. The request's own error is
    retried and reported in one line (remote_writer, push, read_objects): the orphan's copy goes to
    the debug log. Installed on fsspec's and zarr's I/O loops, in front of the handler each has (again
    if the host set its own since); every other exception still reaches that handler.
    ``zarr_loop=False``: fsspec's loop only (a sync filesystem's; zarr's loop is not started for it)."""
    loops = []
    with contextlib.suppress(ImportError):
        from fsspec.asyn import get_loop  # noqa: PLC0415

        loops.append(get_loop())
    if zarr_loop:
        with contextlib.suppress(ImportError):
            from zarr.core.sync import _get_loop  # noqa: PLC0415  (the loop zarr's sync() runs on)

            loops.append(_get_loop())
    with _quiet_lock:
        for loop in loops:
            current = loop.get_exception_handler()
            if not getattr(current, "tracediff_quiet", False):
                loop.set_exception_handler(_orphan_handler(current))


def _orphan_handler(previous: Any) -> Any:
    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if str(context.get("message", "")).startswith(_ORPHAN_MESSAGES) and lost_connection(exc):
            log.debug("tracediff: an object-store request's helper task ended with %s: %s", type(exc).__name__, exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handle.tracediff_quiet = True  # type: ignore[attr-defined]
    return handle


def remote_error(where: str, exc: BaseException, verb: str = "read") -> StoreError:
    """One line for an object-store failure at ``where`` (URL and key, no secrets): what failed and
    what to check. botocore keeps the endpoint URL in its messages; it names no credential."""
    name = type(exc).__name__
    text = first_line(exc)
    if "not satisfiable" in text:  # a ranged GET past the object's end: the object is short
        return CorruptStoreError(f"{where}: the object is shorter than the store's metadata says (truncated?)")
    if isinstance(exc, PermissionError) or name in ("NoCredentialsError", "PartialCredentialsError", "ClientError"):
        hint = "check the credentials (AWS_ACCESS_KEY_ID / ~/.aws/credentials or --storage-option key=... secret=...)"
    elif isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or "timeout" in name.lower() or "timed out" in text:
        hint = "the object store did not answer in time; retry, or raise --storage-option config_kwargs.read_timeout=SECONDS"
    elif "connect" in name.lower() or isinstance(exc, ConnectionError):
        hint = "check the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...) and the network"
    else:
        hint = "retry; if it persists, check the object store"
    return RemoteStoreError(f"{where}: cannot be {verb} ({name}: {text}); {hint}")
