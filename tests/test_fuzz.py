"""Fuzzing: damaged stores and wild labels end in a result or a tracediff error, nothing else.

(a) The store reader. A small valid store (written by the real writer) is copied and damaged at
random: chunk files truncated, extended, bit-flipped, deleted or replaced by a FIFO or a symlink
loop; fields of random ``zarr.json`` files set to random JSON values or removed. Then the store is
opened, described (``inspect``), every stream's labels and values are read by every read path, and
one of compare / identify runs against the intact copy. Each step must succeed or raise a
:class:`tracediff.errors.TracediffError`; any other exception, or a hang, is a bug.

(b) The aligner. Random label columns (sequence ids, positions and token ids with duplicates,
negatives, values near the int64 limits, unsorted, empty, all invalid, columns of different
lengths) go through the row index, sequence alignment and row pairing at every label offset: they
return pairs that satisfy the pairing rules, or raise a tracediff error.

Bounded and reproducible: a fixed number of derandomized examples, no example database.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import no_hang
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracediff.compare import CompareOptions, compare_stores
from tracediff.compare.align.pairing import check_token_pairing
from tracediff.compare.align.rowpairs import pair_rows
from tracediff.compare.align.sequences import align_sequences
from tracediff.compare.plan.identify import identify_segments
from tracediff.compare.rows.index import COMPACT_BOUND, RowIndex
from tracediff.describe import describe_store
from tracediff.errors import TracediffError
from tracediff.store import ChunkFiles, TraceStore, fused_reads, open_store
from tracediff.testing.stores import write_small_store

STORE_EXAMPLES = 100
ALIGN_EXAMPLES = 100
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_COUNTS = {"store_reader": 0, "aligner": 0}


@pytest.fixture(scope="module", autouse=True)
def _report_counts(reliability_report: dict[str, Any]) -> Iterator[None]:
    yield
    reliability_report["fuzz"] = dict(_COUNTS)


# ---------------------------------------------------------------------------------- (a) the reader
@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The intact stores (uncompressed float32, lz4 bfloat16) and the files mutations pick from."""
    root = tmp_path_factory.mktemp("fuzz")
    stores = {"raw": write_small_store(root / "raw.zarr"),
              "lz4": write_small_store(root / "lz4.zarr", dtype="bfloat16", compressor="lz4")}
    files = {k: sorted(str(p.relative_to(v)) for p in v.rglob("*") if p.is_file()) for k, v in stores.items()}
    return {
        "root": root,
        "stores": stores,
        "jsons": {k: [f for f in v if f.endswith("zarr.json")] for k, v in files.items()},
        "chunks": {k: [f for f in v if not f.endswith("zarr.json")] for k, v in files.items()},
        "values": {k: [f for f in v if "/values/c/" in f] for k, v in files.items()},
        "groups": {k: [f for f in v if f.endswith("zarr.json") and f.count("/") <= 2] for k, v in files.items()},
    }


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64)
    | st.sampled_from([0, -1, 1, 16, 60, 10**15, 2**63 - 1]) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)

mutations = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.floats(0, 1)),
    st.tuples(st.just("extend"), st.integers(0, 10**6), st.integers(1, 64)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10**6)),
    st.tuples(st.just("special"), st.integers(0, 10**6), st.sampled_from(["fifo", "loop", "folder"])),
    st.tuples(st.just("json_set"), st.integers(0, 10**6), st.integers(0, 10**6), json_values),
    st.tuples(st.just("json_delete"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("json_replace"), st.integers(0, 10**6), json_values),
    # Damage a reader must survive, so that the read paths after open get fuzzed too: values bytes
    # (an uncompressed chunk stays readable) and attributes (most are free-form metadata).
    st.tuples(st.just("values_flip"), st.integers(0, 10**6), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("attrs_set"), st.integers(0, 10**6), st.integers(0, 10**6), json_values),
)


_TARGETS = {"truncate": "chunks", "extend": "chunks", "flip": "chunks", "delete": "chunks", "special": "chunks",
            "json_set": "jsons", "json_delete": "jsons", "json_replace": "jsons", "values_flip": "values",
            "attrs_set": "groups"}


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path inside a JSON document."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


def _mutate(store: Path, files: list[str], mutation: tuple[Any, ...]) -> None:
    kind = mutation[0]
    rel = files[mutation[1] % len(files)]
    path = store / rel
    if not os.path.lexists(path) or (path.is_dir() and not path.is_symlink()) or not path.is_file():
        return  # an earlier mutation removed or replaced it
    if kind == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * mutation[2])])
    elif kind == "extend":
        path.write_bytes(path.read_bytes() + bytes(range(mutation[2])))
    elif kind in ("flip", "values_flip"):
        data = bytearray(path.read_bytes())
        if data:
            data[min(int(len(data) * mutation[2]), len(data) - 1)] ^= mutation[3]
            path.write_bytes(bytes(data))
    elif kind == "delete":
        path.unlink()
    elif kind == "special":
        path.unlink()
        if mutation[2] == "fifo":
            os.mkfifo(path)
        elif mutation[2] == "loop":
            os.symlink(path.name, path)
        else:
            path.mkdir()
    elif kind == "json_replace":
        path.write_text(json.dumps(mutation[2]))
    else:
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            return
        paths = _paths(doc)
        if kind == "attrs_set":
            paths = [q for q in paths if q[0] == "attributes" and len(q) > 1]
            kind = "json_set"
        if not paths:
            return
        where = paths[mutation[2] % len(paths)]
        parent = doc
        for key in where[:-1]:
            parent = parent[key]
        if kind == "json_set":
            parent[where[-1]] = mutation[3]
        else:
            del parent[where[-1]]
        path.write_text(json.dumps(doc))


def _read_everything(store: TraceStore) -> None:
    """Every read path of every stream: labels, read, iter_chunks, read_chunk (whole and rows), take,
    read_rows through a ChunkFiles cache (run by run in Python, and by the compiled loop)."""
    describe_store(store)
    for tap in store.taps:
        for s in store.tap_streams(tap):
            s.labels()
            s.read()
            for _start, _chunk in s.iter_chunks():
                pass
            for c in range(s.chunks):
                s.read_chunk(c)
                committed = min(s.chunk_rows, s.rows - c * s.chunk_rows)
                s.read_chunk(c, np.arange(committed)[::-1].copy())
            if s.rows:
                rows = np.unique(np.linspace(0, s.rows - 1, 7).astype(np.int64))
                s.take(rows)
                if s.reads_rows_directly:
                    for reader in (None, fused_reads.read_runs):  # run by run in Python; the compiled loop
                        with ChunkFiles(limit=2) as files:
                            files.runs_reader = reader
                            s.read_rows(rows[::-1].copy(), files=files)


@settings(FUZZ, max_examples=STORE_EXAMPLES)
@given(
    base=st.sampled_from(["raw", "lz4"]),
    damage=st.lists(mutations, min_size=1, max_size=3),
    command=st.sampled_from(["compare_reference", "compare_candidate", "identify_store", "identify_bank"]),
)
def test_a_randomly_damaged_store_reads_or_fails_with_a_tracediff_error(
    intact: dict[str, Any], base: str, damage: list[tuple[Any, ...]], command: str
) -> None:
    _COUNTS["store_reader"] += 1
    work = Path(tempfile.mkdtemp(prefix="case-", dir=intact["root"]))
    try:
        store = work / "s.zarr"
        shutil.copytree(intact["stores"][base], store, symlinks=True)
        for mutation in damage:
            _mutate(store, intact[_TARGETS[mutation[0]]][base], mutation)
        good = intact["stores"]["raw"]
        with no_hang():
            try:
                with open_store(store) as opened:
                    _read_everything(opened)
            except TracediffError:
                pass
            try:
                if command == "compare_reference":
                    compare_stores(store, good, CompareOptions(sample_rows=64))
                elif command == "compare_candidate":
                    compare_stores(good, store, CompareOptions(sample_rows=64))
                elif command == "identify_store":
                    identify_segments(store, good, sample_rows=64)
                else:
                    identify_segments(good, store, sample_rows=64)
            except TracediffError:
                pass
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_the_store_fuzzer_damages_every_kind_of_file(intact: dict[str, Any]) -> None:
    """The files the mutations pick from: every metadata document and every chunk of both layouts."""
    for base in ("raw", "lz4"):
        assert len(intact["jsons"][base]) == 1 + 2 * (1 + 1 + 8)  # root; per tap: tap, writer, 8 arrays
        assert {Path(f).parts[2] for f in intact["chunks"][base]} == {"values", "seq", "position", "token_id",
                                                            "next_token_id", "step", "phase", "valid"}


# --------------------------------------------------------------------------------- (b) the aligner
class _Streams(tuple):
    """(store, its fc_in streams), printed briefly in a falsifying example."""

    def __repr__(self) -> str:
        return "<fc_in streams of the intact store>"


@pytest.fixture(scope="module")
def streams(intact: dict[str, Any]) -> Iterator[tuple[TraceStore, list[Any]]]:
    """A real opened store and its fc_in stream: the row index names sequences through them."""
    with open_store(intact["stores"]["raw"]) as store:
        yield _Streams((store, store.tap_streams("fc_in")))


WILD = st.sampled_from([-(2**63), -(2**40), -(2**39) - 1, -2, -1, 0, 1, 2, 3, 2**39, 2**40, 2**62, 2**63 - 1])


@st.composite
def label_columns(draw: st.DrawFn) -> dict[str, np.ndarray]:
    n = draw(st.integers(0, 40))
    small = st.integers(-1, 4)
    pick = draw(st.sampled_from(["tame", "wild", "mixed"]))
    values = {"tame": small, "wild": WILD, "mixed": small | WILD}[pick]
    seq = draw(st.lists(st.integers(0, 2) if pick == "tame" else values, min_size=n, max_size=n))
    if draw(st.booleans()):
        position = list(range(n))  # counting up, possibly shuffled below
        if draw(st.booleans()):
            position = draw(st.permutations(position))
    else:
        position = draw(st.lists(values, min_size=n, max_size=n))
    token = draw(st.lists(values, min_size=n, max_size=n))
    valid = draw(st.sampled_from(["all", "none", "random"]))
    valid_col = ([True] * n if valid == "all" else [False] * n if valid == "none"
                 else draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    columns = {
        "seq": np.array(seq, dtype=np.int64),
        "position": np.array(position, dtype=np.int64),
        "token_id": np.array(token, dtype=np.int64),
        "next_token_id": np.array(draw(st.lists(values, min_size=n, max_size=n)), dtype=np.int64),
        "phase": np.ones(n, dtype=np.int8),
        "valid": np.array(valid_col, dtype=bool),
    }
    if n and draw(st.integers(0, 9)) == 0:  # now and then a column of another length
        name = draw(st.sampled_from(sorted(columns)))
        columns[name] = columns[name][: draw(st.integers(0, n - 1))]
    return columns


@settings(FUZZ, max_examples=ALIGN_EXAMPLES)
@given(reference=label_columns(), candidate=label_columns(), same=st.booleans())
def test_wild_labels_align_or_fail_with_a_tracediff_error(
    streams: tuple[TraceStore, list[Any]], reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], same: bool
) -> None:
    _COUNTS["aligner"] += 1
    if same:  # the candidate re-records the reference's sequences: alignments must be found
        candidate = {k: v.copy() for k, v in reference.items()}
    try:
        ref = RowIndex.from_labels(streams[0], "fc_in", streams[1], [reference])
        cand = RowIndex.from_labels(streams[0], "fc_in", streams[1], [candidate])
        alignment = align_sequences(ref, cand)
    except TracediffError:
        return
    for offset in (-2, -1, 0, 1, 2):
        pairs = pair_rows(alignment, offset)
        c, r = pairs.candidate, pairs.reference
        assert c.shape == r.shape and c.dtype.kind == r.dtype.kind == "i"
        if c.size:
            assert c.min() >= 0 and c.max() < len(cand) and r.min() >= 0 and r.max() < len(ref)
        assert np.unique(r).size == r.size, "one candidate row per reference row"
        assert cand.valid[c].all() and ref.valid[r].all(), "only valid rows are paired"
        if offset == 0 and alignment.by_tokens:
            agree = (cand.token_id[c] == ref.token_id[r]) | (cand.token_id[c] < 0)
            assert agree.all(), "paired rows carry the same token"
        assert pairs.unaligned >= 0 and pairs.duplicates >= 0


EDGES = st.sampled_from([0, 1, COMPACT_BOUND - 40, COMPACT_BOUND - 20, COMPACT_BOUND, -COMPACT_BOUND,
                         -COMPACT_BOUND - 1, -COMPACT_BOUND + 3, 2**31 - 20, -(2**31), 2**40])


def _wide(index: RowIndex) -> RowIndex:
    """The same index with every integer column int64, as it was before the columns were compacted."""
    aside = index.column
    return dataclasses.replace(index, **{k: getattr(index, k).astype(np.int64) for k in ("group", "position", "token_id")},
                               _aside=lambda k: aside(k).astype(np.int64))


@settings(FUZZ, max_examples=ALIGN_EXAMPLES)
@given(n=st.integers(4, 30), ref_base=EDGES, cand_base=EDGES, token_base=EDGES, skip=st.integers(0, 3),
       seq=EDGES, step=EDGES, tokens=st.lists(st.integers(0, 3), min_size=30, max_size=30), shuffle=st.randoms())
def test_labels_near_the_compact_bound_pair_as_int64_labels_do(
    streams: tuple[TraceStore, list[Any]], n: int, ref_base: int, cand_base: int, token_base: int, skip: int,
    seq: int, step: int, tokens: list[int], shuffle: Any
) -> None:
    """Label columns within +-COMPACT_BOUND are held as int32; positions, deltas and offsets at the
    bound (and past it, int64 then) must pair exactly the rows the int64 columns pair."""
    tok = token_base + np.array(tokens[:n], dtype=np.int64)

    def columns(base: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        m = rows.size
        return {"seq": np.full(m, seq, dtype=np.int64), "position": base + rows, "token_id": tok[rows],
                "next_token_id": np.r_[tok[rows][1:], [-1]], "step": step + rows // 3,
                "phase": np.ones(m, dtype=np.int8), "valid": np.ones(m, dtype=bool)}

    cand_rows = np.arange(skip, n)
    shuffle.shuffle(cand_rows)  # engine order
    ref = RowIndex.from_labels(streams[0], "fc_in", streams[1], [columns(ref_base, np.arange(n))])
    cand = RowIndex.from_labels(streams[0], "fc_in", streams[1], [columns(cand_base, cand_rows)])
    assert ref.position.dtype == (np.int32 if ref_base >= -COMPACT_BOUND and ref_base + n <= COMPACT_BOUND else np.int64)
    compact_al, wide_al = align_sequences(ref, cand), align_sequences(_wide(ref), _wide(cand))
    assert [s.hypotheses for s in compact_al.sequences] == [s.hypotheses for s in wide_al.sequences]
    for offset in (-2, -1, 0, 1, 2):
        got, want = pair_rows(compact_al, offset), pair_rows(wide_al, offset)
        assert got.candidate.tolist() == want.candidate.tolist() and got.reference.tolist() == want.reference.tolist()
        assert (got.unaligned, got.duplicates, got.trailing, got.insertions, got.effective_delta) == (
            want.unaligned, want.duplicates, want.trailing, want.insertions, want.effective_delta)
        assert check_token_pairing(got, ref, cand) == check_token_pairing(want, _wide(ref), _wide(cand))


def test_distinct_huge_sequence_ids_stay_distinct_sequences(streams: tuple[TraceStore, list[Any]]) -> None:
    """2**40 and 0 share their low 40 bits; they are still two sequences."""
    n = 6
    columns = {"seq": np.array([0, 0, 0, 2**40, 2**40, 2**40]), "position": np.array([0, 1, 2, 0, 1, 2]),
               "token_id": np.array([5, 6, 7, 8, 9, 10]), "next_token_id": np.full(n, -1),
               "phase": np.ones(n, dtype=np.int8), "valid": np.ones(n, dtype=bool)}
    index = RowIndex.from_labels(streams[0], "fc_in", streams[1], [columns])
    assert index.group_keys == ["0", str(2**40)]
    assert index.group.tolist() == [0, 0, 0, 1, 1, 1]


def test_a_position_delta_at_the_int64_limit_pairs_rows(streams: tuple[TraceStore, list[Any]]) -> None:
    """Found by the fuzzer: a delta of -2**63 slipped past the packed-key bound (np.abs(-2**63) < 0)
    and named a reference sequence that does not exist (KeyError)."""
    n = 4

    def columns(start: int) -> dict[str, np.ndarray]:
        return {"seq": np.zeros(n, dtype=np.int64), "position": start + np.arange(n, dtype=np.int64),
                "token_id": np.array([7, 8, 9, 10]), "next_token_id": np.full(n, -1),
                "phase": np.ones(n, dtype=np.int8), "valid": np.ones(n, dtype=bool)}

    ref = RowIndex.from_labels(streams[0], "fc_in", streams[1], [columns(0)])
    cand = RowIndex.from_labels(streams[0], "fc_in", streams[1], [columns(-(2**63))])
    alignment = align_sequences(ref, cand)
    assert [s.best for s in alignment.sequences] == [(0, -(2**63), 1)]
    pairs = pair_rows(alignment, 0)
    assert pairs.candidate.tolist() == pairs.reference.tolist() == [0, 1, 2, 3]
