"""Packing a store folder into one ``.zarr.zip`` file."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from tracediff.errors import (
    StoreExistsError,
    StoreWriteError,
    UsageError,
)
from tracediff.store.location import Location, remote_error
from tracediff.store.reader import TraceStore


def pack_store(
    src: str | os.PathLike[str] | Location, dest: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Copy a store folder (local, or at a URL) into one uncompressed local ``.zarr.zip`` file (to
    attach to a bug report).

    Only committed rows are meaningful; the zip keeps files as they are (STORED: chunks are already
    compressed or incompressible). Written to a temporary name first, so a failure leaves nothing.
    """
    location = Location.of(src)
    if location.remote:
        return _pack_remote(location, Path(dest), overwrite)
    src, dest = Path(location.local), Path(dest)
    TraceStore(src).close()  # validate first
    if not src.is_dir():
        raise UsageError(f"{src}: pack takes a store folder")
    if dest.exists() and not overwrite:
        raise StoreExistsError(f"{dest}: already exists; pass --overwrite to replace it")
    tmp = dest.with_name(dest.name + ".partial")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for root, _dirs, files in os.walk(src):
                for name in sorted(files):
                    if name.endswith(".partial"):
                        continue
                    full = Path(root) / name
                    zf.write(full, full.relative_to(src).as_posix())
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreWriteError(f"{dest}: cannot write the zip: {exc.strerror or exc}") from exc
    except BaseException:  # Ctrl-C, SIGTERM (tracediff.cli): no half zip left beside DEST either
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _pack_remote(src: Location, dest: Path, overwrite: bool) -> Path:
    """:func:`pack_store` of a store at a URL: its objects, fetched in batches; each must arrive
    with the size the listing gave (a response cut short fails instead of packing a torn chunk)."""
    TraceStore(src).close()  # validate first, as for a folder
    if dest.exists() and not overwrite:
        raise StoreExistsError(f"{dest}: already exists; pass --overwrite to replace it")
    sizes = src.list_sizes("")
    keys = sorted(k for k in sizes if not k.endswith(".partial"))
    tmp = dest.with_name(dest.name + ".partial")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for lo in range(0, len(keys), 64):
                batch = keys[lo : lo + 64]
                for key, blob in zip(batch, src.read_objects(batch), strict=True):
                    if isinstance(blob, BaseException):
                        raise remote_error(src.where(key), blob) from blob
                    if len(blob) != sizes[key]:
                        raise StoreWriteError(
                            f"{src.where(key)}: {len(blob)} bytes arrived, the listing says {sizes[key]}; pack again"
                        )
                    zf.writestr(key, blob)
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreWriteError(f"{dest}: cannot write the zip: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest
