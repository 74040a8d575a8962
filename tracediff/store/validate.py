"""Checks of a store's metadata documents (groups, arrays, codecs) against what the writer writes,
each failing with one error naming the file and field."""

from __future__ import annotations

import math
from typing import Any, TypeGuard

import numpy as np

from tracediff.errors import (
    CorruptStoreError,
    StoreError,
)
from tracediff.store.format import ALLOWED_CODECS, MAX_CHUNK_BYTES


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def group_attributes(doc: dict[str, Any], where: str, error: type[StoreError] = CorruptStoreError) -> dict[str, Any]:
    if doc["node_type"] != "group":
        raise error(f"{where}: field node_type is 'array', expected a group")
    attrs = doc.get("attributes", {})
    if not isinstance(attrs, dict):
        raise error(f"{where}: field attributes is {json_type(attrs)}, expected an object")
    return attrs


def check_array_doc(doc: dict[str, Any], where: str, *, ndim: int, data_type: str, rows: int) -> None:
    """An array's zarr.json must be what TraceWriter writes: ``ndim`` dimensions of ``data_type``,
    regular chunks of at most MAX_CHUNK_BYTES, default chunk keys, ALLOWED_CODECS only, at least
    ``rows`` rows, ``dimension_names`` (when present) one string or null per dimension."""
    if doc["node_type"] != "array":
        raise CorruptStoreError(f"{where}: field node_type is 'group', expected an array")
    shape = doc.get("shape")
    if not isinstance(shape, list) or len(shape) != ndim or not all(is_int(n) and n >= 0 for n in shape):
        raise CorruptStoreError(
            f"{where}: field shape is {short_repr(shape)}, expected {ndim} dimension(s) of size >= 0"
        )
    if shape[0] < rows:
        raise CorruptStoreError(
            f"{where}: field shape {shape} holds fewer than the {rows} committed rows (field commit.rows)"
        )
    if doc.get("data_type") != data_type:
        raise CorruptStoreError(
            f"{where}: field data_type is {short_repr(doc.get('data_type'))}, expected {data_type!r}"
        )
    grid = doc.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    chunks = config.get("chunk_shape") if isinstance(config, dict) else None
    if (
        not isinstance(grid, dict)
        or grid.get("name") != "regular"
        or not isinstance(chunks, list)
        or len(chunks) != ndim
        or not all(is_int(n) and n > 0 for n in chunks)
    ):
        raise CorruptStoreError(
            f"{where}: field chunk_grid is {short_repr(grid)}, expected regular chunks of {ndim} sizes > 0"
        )
    if math.prod(chunks) * np.dtype(data_type).itemsize > MAX_CHUNK_BYTES:
        raise CorruptStoreError(
            f"{where}: field chunk_grid: chunks of {chunks} {data_type} are larger than any chunk "
            f"tracediff writes ({MAX_CHUNK_BYTES} bytes)"
        )
    encoding = doc.get("chunk_key_encoding")
    config = encoding.get("configuration") if isinstance(encoding, dict) else None
    separator = (config or {}).get("separator", "/") if isinstance(config, (dict, type(None))) else None
    if not isinstance(encoding, dict) or encoding.get("name") != "default" or separator != "/":
        raise CorruptStoreError(
            f"{where}: field chunk_key_encoding is {short_repr(encoding)}, expected default with '/'"
        )
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        raise CorruptStoreError(f"{where}: field codecs is {short_repr(codecs)}, expected a list of codecs")
    for codec in codecs:
        if not isinstance(codec.get("name"), str) or codec["name"] not in ALLOWED_CODECS:
            raise CorruptStoreError(
                f"{where}: field codecs names codec {short_repr(codec.get('name'))}, which tracediff never writes "
                f"(allowed: {', '.join(sorted(ALLOWED_CODECS))}); refusing to decode it"
            )
        if not isinstance(codec.get("configuration", {}), dict):
            raise CorruptStoreError(
                f"{where}: field codecs: codec {codec['name']!r} has a configuration that is not an object"
            )
    if codecs[0]["name"] != "bytes" or any(c["name"] == "bytes" for c in codecs[1:]):
        raise CorruptStoreError(
            f"{where}: field codecs must start with the one 'bytes' codec, got {[c['name'] for c in codecs]}"
        )
    # Optional: stores written before the writer named its dimensions have none. zarr itself takes
    # any iterable of strings (a string, an object's keys) and checks the length only later.
    names = doc.get("dimension_names")
    if names is not None and (
        not isinstance(names, list) or len(names) != ndim or not all(n is None or isinstance(n, str) for n in names)
    ):
        raise CorruptStoreError(
            f"{where}: field dimension_names is {short_repr(names)}, expected a list of {ndim} name(s) "
            "(strings or null), one per dimension"
        )
    if doc.get("storage_transformers") not in (None, []):
        raise CorruptStoreError(
            f"{where}: field storage_transformers is {short_repr(doc['storage_transformers'])}, expected none"
        )
    if not isinstance(doc.get("attributes", {}), dict):
        raise CorruptStoreError(f"{where}: field attributes is {json_type(doc['attributes'])}, expected an object")
