"""Trace store, format 1: the zarr v3 layout every other part of tracediff reads or writes.

Layout (documented for plain zarr + numpy readers in ``docs/format.md``)::

    STORE.zarr/                      root group; attrs: tracediff, source, meta
      <tap>/                         one group per tap (attrs empty: created race-free by any writer)
        <writer>/                    one group per writing process; attrs: see WriterAttrs
          values      [row, feature]  bf16 kept as raw uint16 bits, else the tensor's dtype
          seq, position, token_id, next_token_id, step   [row] int64 (-1 = unknown)
          phase       [row] int8 (index into PHASES)
          valid       [row] bool

Every array carries zarr v3 ``dimension_names`` (VALUES_DIMS, LABEL_DIMS) and ``values`` the CF
``coordinates`` attribute naming the label arrays, so xarray opens a writer group as a Dataset with
the labels as coordinates.

Commit protocol: a batch's chunks are written first, past the arrays' recorded shapes (each chunk
file is replaced atomically: temporary file, then rename, by zarr's LocalStore or, for uncompressed
stores, by the writer itself, byte for byte what zarr writes), then every array's shape is set to the new row
count, then the writer group's ``commit`` attribute is rewritten (also atomically) with it. tracediff
only trusts ``commit.rows``: rows past it (a batch killed halfway) are invisible. A SIGKILL
therefore loses at most the batch in flight, never a torn one; and since no shape ever covers a row
before its data is on disk, a reader that trusts the shapes (xarray) sees no unwritten rows either.
Several processes write one store without locks because each owns its ``<tap>/<writer>`` group.

This package never imports torch: the recorder converts tensors to numpy before calling it.

Modules, along the data's path: :mod:`~tracediff.store.format` (layout, dtypes, codecs),
:mod:`~tracediff.store.location` (a path or an fsspec URL), :mod:`~tracediff.store.batches` (what
every writer shares), :mod:`~tracediff.store.writer` (creating stores, :class:`TraceWriter`),
:mod:`~tracediff.store.remote_writer` (writing to object storage), :mod:`~tracediff.store.validate`
(metadata checks), :mod:`~tracediff.store.files` (safe, direct file reads),
:mod:`~tracediff.store.stream` (one writer group's rows), :mod:`~tracediff.store.reader`
(:class:`TraceStore`), :mod:`~tracediff.store.pack` (``.zarr.zip``), :mod:`~tracediff.store.push`
(uploading a local store).
"""

from tracediff.store.batches import WriterCounts
from tracediff.store.files import ChunkFiles
from tracediff.store.format import (
    ALLOWED_CODECS,
    COMPRESSORS,
    DEFAULT_CHUNK_ROWS,
    DEFAULT_COMPRESSOR,
    DEFAULT_LABEL_CHUNK_ROWS,
    FORMAT,
    LABEL_DTYPES,
    LABEL_FIELDS,
    LABEL_FILL,
    PHASES,
    VALUE_DTYPES,
    decode_values,
    default_source,
    encode_bfloat16,
    phase_code,
)
from tracediff.store.location import Location
from tracediff.store.pack import pack_store
from tracediff.store.push import PushResult, push_store
from tracediff.store.reader import TraceStore, open_store
from tracediff.store.stream import TraceStream
from tracediff.store.writer import (
    TraceWriter,
    check_replaceable,
    create_store,
    remove_store,
    replace_store,
    update_store_meta,
)

__all__ = [
    "ALLOWED_CODECS",
    "COMPRESSORS",
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_COMPRESSOR",
    "DEFAULT_LABEL_CHUNK_ROWS",
    "FORMAT",
    "LABEL_DTYPES",
    "LABEL_FIELDS",
    "LABEL_FILL",
    "PHASES",
    "VALUE_DTYPES",
    "ChunkFiles",
    "Location",
    "PushResult",
    "TraceStore",
    "TraceStream",
    "TraceWriter",
    "WriterCounts",
    "check_replaceable",
    "create_store",
    "decode_values",
    "default_source",
    "encode_bfloat16",
    "open_store",
    "pack_store",
    "push_store",
    "phase_code",
    "remove_store",
    "replace_store",
    "update_store_meta",
]
