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
from tracediff.store.reader import TraceStore


def pack_store(src: str | os.PathLike[str], dest: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Copy a store folder into one uncompressed ``.zarr.zip`` file (to attach to a bug report).

    Only committed rows are meaningful; the zip keeps files as they are (STORED: chunks are already
    compressed or incompressible). Written to a temporary name first, so a failure leaves nothing.
    """
    src, dest = Path(src), Path(dest)
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
    return dest
