"""The one error hierarchy of tracediff.

Every error a user can cause (a missing store, a bad tap spec, a corrupt array) is a subclass of
:class:`TracediffError`. Each message names the file and the field at fault and, where there is one,
what to do instead. The CLI turns these into a one-line message and exit code 2; any other exception
escaping the CLI is a bug in tracediff.

Classes also subclass the matching built-in, so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations


class TracediffError(Exception):
    """Base of every error tracediff raises on purpose."""


class UsageError(TracediffError, ValueError):
    """A command-line option or API argument is wrong (unknown tap spec, adapter, limit...)."""


class StoreError(TracediffError):
    """Something is wrong with a trace store on disk."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The path does not exist."""


class StoreExistsError(StoreError, FileExistsError):
    """Refusing to overwrite an existing store without ``overwrite=True`` / ``--overwrite``."""


class NotATraceStoreError(StoreError, ValueError):
    """The path exists but is not a tracediff trace store (or not zarr at all)."""


class FormatVersionError(StoreError, ValueError):
    """The store was written by a newer, incompatible tracediff format."""


class IncompleteStoreError(StoreError, ValueError):
    """The store was not finished being written: a ``tracediff push`` that stopped before its end
    (killed, a lost connection). The message names the command to rerun."""


class CorruptStoreError(StoreError, ValueError):
    """The store's metadata or arrays are inconsistent, truncated or unreadable."""


class StoreWriteError(StoreError, OSError):
    """Writing to the store failed (full disk, permissions...)."""


class RemoteStoreError(StoreError, ConnectionError):
    """A store on object storage (an fsspec URL) cannot be reached or refuses the request: refused
    connection, timeout, missing or rejected credentials, a dropped connection that retries did not
    get past. The message names the URL (never its credentials) and the object."""


class CompareError(TracediffError, ValueError):
    """Two stores cannot be compared (no common tap, zero aligned rows, bad segment size...)."""


class AdapterError(TracediffError, ImportError):
    """A framework adapter cannot be used (unknown name, framework not installed, internals moved)."""


class ReportWriteError(TracediffError, OSError):
    """A report file could not be written (missing or read-only folder, full disk...)."""


class SendError(TracediffError, ConnectionError):
    """A server to replay a trace to cannot be reached, stopped answering, or refuses the trace."""


class ImportFormatError(TracediffError, ValueError):
    """A trainer's offline files cannot be imported: missing, refused (not plain tensors), or not in
    the layout that framework writes (keys, shapes, files of two different models)."""


class ControlError(TracediffError, ConnectionError):
    """A recording's control endpoint cannot be reached or answered nonsense (`tracediff control`)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), or its type's name: what
    a one-line error quotes of a library's exception."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
