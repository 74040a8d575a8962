"""No code execution from data: nothing in tracediff unpickles what a user hands it.

A trace store or a trainer's feature file is data from somewhere else (a bug report, a colleague's
server, a download). Each hostile file below carries a pickle whose unpickling would create a marker
file (the test first proves the payload is live). Every command that reads such a file must refuse
it with one line naming the file and the offending codec or field (or read it without unpickling),
and the marker must never appear. A static check over the source keeps it that way.
"""

from __future__ import annotations

import ast
import gzip
import io
import json
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, CliResult, invoke_tracediff

from tracediff.errors import ImportFormatError, StoreError
from tracediff.importers import import_specforge, import_speculators
from tracediff.store import ALLOWED_CODECS, open_store
from tracediff.testing.stores import HIDDEN, write_small_store


class Payload:
    """Unpickling this runs a shell command: what a booby-trapped file does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


_COUNTS: dict[str, Any] = {"store_cases": 0, "import_cases": 0, "commands_run": 0, "payloads_run": 0}


@pytest.fixture(scope="module", autouse=True)
def _report_counts(reliability_report: dict[str, Any]) -> Any:
    yield
    reliability_report["no_pickle"] = dict(_COUNTS, source_files_checked=len(SOURCES))


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker), protocol=2)


def test_the_payload_is_live(tmp_path: Path) -> None:
    """The control: unpickling these bytes does run the command, so a missing marker below means
    tracediff never unpickled them."""
    marker = tmp_path / "pwned"
    pickle.loads(payload_bytes(marker))  # noqa: S301  (the point of the test)
    assert marker.exists()


def _one_line(result: CliResult, *names: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# -------------------------------------------------------------------------------- (a) trace stores
def _edit(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _codec(array: str, codec: dict[str, Any], chunk: str) -> Callable[[Path, Path], None]:
    """Append ``codec`` to an array's codec chain and put the payload in its chunk ``chunk``."""

    def craft(store: Path, marker: Path) -> None:
        folder = store / "fc_in" / "pid1" / array
        _edit(folder / "zarr.json", lambda d: d["codecs"].append(codec))
        (folder / chunk).write_bytes(payload_bytes(marker))

    return craft


def _object_dtype(array: str, data_type: str, codec: str) -> Callable[[Path, Path], None]:
    """An object (variable-length) array: zarr decodes such chunks into Python objects."""

    def craft(store: Path, marker: Path) -> None:
        folder = store / "fc_in" / "pid1" / array
        _edit(folder / "zarr.json", lambda d: d.update(data_type=data_type, codecs=[{"name": codec}], fill_value=""))
        (folder / "c" / "0").write_bytes(payload_bytes(marker))

    return craft


def _v2_array(store: Path, marker: Path) -> None:
    """A zarr v2 object array with numcodecs' pickle filter where a label array should be."""
    folder = store / "fc_in" / "pid1" / "seq"
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [60], "chunks": [60], "dtype": "|O", "compressor": None,
        "filters": [{"id": "pickle", "protocol": 2}], "fill_value": None, "order": "C",
    }))
    (folder / "0").write_bytes(payload_bytes(marker))


def _v2_store(store: Path, marker: Path) -> Path:
    """A whole zarr v2 store in a zip, with tracediff's attributes and a pickled array."""
    zipped = store.with_name("v2.zarr.zip")
    shutil.rmtree(store)
    with zipfile.ZipFile(zipped, "w") as zf:
        zf.writestr(".zgroup", json.dumps({"zarr_format": 2}))
        zf.writestr(".zattrs", json.dumps({"tracediff": {"format": 1}}))
        for group in ("fc_in", "fc_in/pid1"):
            zf.writestr(f"{group}/.zgroup", json.dumps({"zarr_format": 2}))
        zf.writestr("fc_in/pid1/.zattrs", json.dumps({"dtype": "float32", "width": 4, "commit": {"rows": 1}}))
        zf.writestr("fc_in/pid1/seq/.zarray", json.dumps({
            "zarr_format": 2, "shape": [1], "chunks": [1], "dtype": "|O", "compressor": None,
            "filters": [{"id": "pickle", "protocol": 2}], "fill_value": None, "order": "C"}))
        zf.writestr("fc_in/pid1/seq/0", payload_bytes(marker))
    return zipped


def _zipped(craft: Callable[[Path, Path], None]) -> Callable[[Path, Path], Path]:
    """The same hostile store, packed into a .zarr.zip as a bug report would carry it."""

    def make(store: Path, marker: Path) -> Path:
        craft(store, marker)
        zipped = store.with_name("hostile.zarr.zip")
        with zipfile.ZipFile(zipped, "w", compression=zipfile.ZIP_STORED) as zf:
            for path in sorted(store.rglob("*")):
                if path.is_file():
                    zf.write(path, path.relative_to(store).as_posix())
        shutil.rmtree(store)
        return zipped

    return make


STORE_CASES: dict[str, tuple[Callable[[Path, Path], Path | None], list[str]]] = {
    # name: (crafts the store from an intact copy, what the one line names)
    "label codec numcodecs.pickle": (_codec("seq", {"name": "numcodecs.pickle", "configuration": {"protocol": 2}}, "c/0"),
                                     ["fc_in/pid1/seq/zarr.json", "codecs", "numcodecs.pickle"]),
    "values codec pickle": (_codec("values", {"name": "pickle"}, "c/0/0"), ["fc_in/pid1/values/zarr.json", "codecs", "'pickle'"]),
    "label of object dtype (vlen-utf8)": (_object_dtype("token_id", "string", "vlen-utf8"),
                                          ["fc_in/pid1/token_id/zarr.json", "data_type", "'string'"]),
    "label of object dtype (vlen-bytes)": (_object_dtype("position", "variable_length_bytes", "vlen-bytes"),
                                           ["fc_in/pid1/position/zarr.json", "data_type"]),
    "zarr v2 array with a pickle filter": (_v2_array, ["fc_in/pid1/seq", "no zarr.json"]),
    "zarr v2 store with a pickle filter": (_v2_store, ["v2.zarr.zip", "no zarr.json"]),
    "zip store, label codec pickle": (_zipped(_codec("step", {"name": "pickle"}, "c/0")),
                                      ["hostile.zarr.zip/fc_in/pid1/step/zarr.json", "codecs", "'pickle'"]),
}


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_store(tmp_path_factory.mktemp("intact") / "good.zarr")


@pytest.mark.parametrize("name", list(STORE_CASES))
def test_a_store_with_pickled_data_is_refused_by_every_command_without_running_it(
    intact: Path, tmp_path: Path, name: str
) -> None:
    craft, names = STORE_CASES[name]
    marker = tmp_path / "pwned"
    store = tmp_path / "hostile.zarr"
    shutil.copytree(intact, store)
    hostile = craft(store, marker) or store
    out = tmp_path / "out"
    out.mkdir()
    _COUNTS["store_cases"] += 1
    for args in (
        ["inspect", hostile],
        ["inspect", "--json", "-", hostile],
        ["compare", hostile, intact, "--json", out / "r.json", "--html", out / "r.html"],
        ["compare", intact, hostile, "--json", out / "r.json", "--html", out / "r.html"],
        ["identify", hostile, "--bank", intact, "--json", out / "i.json"],
        ["identify", intact, "--bank", hostile, "--json", out / "i.json"],
    ):
        result = invoke_tracediff(*args)
        _COUNTS["commands_run"] += 1
        _COUNTS["payloads_run"] += int(marker.exists())
        _one_line(result, *names)
        assert not marker.exists(), f"{args}: the pickle ran"
        assert list(out.iterdir()) == []
    with pytest.raises(StoreError):
        open_store(hostile)
    assert not marker.exists()


def test_the_reader_allows_only_the_codecs_the_writer_uses(intact: Path) -> None:
    used = set()
    for meta in intact.rglob("zarr.json"):
        doc = json.loads(meta.read_text())
        used |= {c["name"] for c in doc.get("codecs", [])}
    lz4 = write_small_store(intact.parent / "lz4.zarr", compressor="lz4")
    for meta in lz4.rglob("zarr.json"):
        used |= {c["name"] for c in json.loads(meta.read_text()).get("codecs", [])}
    assert used == set(ALLOWED_CODECS) == {"bytes", "blosc", "zstd"}


# ----------------------------------------------------------------------------- (b) imported files
def _torch_payload(path: Path, marker: Path) -> None:
    torch.save({"input_ids": torch.arange(4), "aux_hidden_state": torch.zeros(1, 4, 3 * HIDDEN),
                "x": Payload(marker)}, path)


def _raw_payload(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"input_ids": torch.arange(4), "x": Payload(marker)}, protocol=2))


def _gzipped_payload(path: Path, marker: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"input_ids": torch.arange(4), "x": Payload(marker)}, buffer)
    path.write_bytes(gzip.compress(buffer.getvalue()))


IMPORT_CASES: dict[str, tuple[str, str, Callable[[Path, Path], None], bool, str]] = {
    # name: (importer, file name, writes it, give the file itself (not its folder), what the line names)
    "specforge .ckpt from torch.save": ("specforge", "data_0.ckpt", _torch_payload, False, "weights_only=True"),
    "specforge .ckpt from pickle.dump": ("specforge", "data_0.ckpt", _raw_payload, False, "weights_only=True"),
    "specforge .ckpt.gz": ("specforge", "data_0.ckpt.gz", _gzipped_payload, False, "weights_only=True"),
    "a .pt file given directly": ("specforge", "features.pt", _torch_payload, True, "weights_only=True"),
    "a .bin file given directly": ("specforge", "pytorch_model.bin", _raw_payload, True, "weights_only=True"),
    "speculators file holding torch.save": ("speculators", "hs_0.safetensors", _torch_payload, False, "safetensors"),
    "speculators file holding a pickle": ("speculators", "hs_0.safetensors", _raw_payload, False, "safetensors"),
}


@pytest.mark.parametrize("name", list(IMPORT_CASES))
def test_an_imported_file_with_a_pickle_payload_is_refused_without_running_it(tmp_path: Path, name: str) -> None:
    importer, filename, write, direct, word = IMPORT_CASES[name]
    marker = tmp_path / "pwned"
    src = tmp_path / "features"
    src.mkdir()
    write(src / filename, marker)
    out = tmp_path / "imported.zarr"
    result = invoke_tracediff("import", importer, src / filename if direct else src, "-o", out)
    _COUNTS["import_cases"] += 1
    _COUNTS["commands_run"] += 1
    _COUNTS["payloads_run"] += int(marker.exists())
    _one_line(result, filename, word)
    assert not marker.exists(), "the pickle ran"
    assert not out.exists()
    library = import_specforge if importer == "specforge" else import_speculators
    with pytest.raises(ImportFormatError):
        library(src / filename if direct else src, out)
    assert not marker.exists() and not out.exists()


# ------------------------------------------------------------------------------ (c) the source code
SOURCES = sorted([*(REPO / "tracediff").rglob("*.py"), *(REPO / "hooks").rglob("*.py")])
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def unsafe_calls(tree: ast.AST) -> list[str]:
    """Every construct that can run code from data: pickle-family imports, torch.load without a
    literal weights_only=True, numpy.load with allow_pickle set, eval/exec, yaml.load."""
    found = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("eval", "exec", "builtins.eval", "builtins.exec", "compile", "__import__"):
                found.append(f"{where}: {name}()")
            elif name in ("torch.load", "torch.serialization.load"):
                weights_only = _keyword(node, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where}: {name}() without weights_only=True")
            elif name in ("np.load", "numpy.load"):
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    found.append(f"{where}: {name}(allow_pickle=...)")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                found.append(f"{where}: {name}()")
    return found


def test_the_checker_finds_each_unsafe_construct() -> None:
    hostile = "\n".join([
        "import pickle", "from dill import loads", "import torch", "import numpy as np",
        "torch.load(f)", "torch.load(f, weights_only=False)", "torch.load(f, weights_only=flag)",
        "np.load(f, allow_pickle=True)", "eval(text)", "exec(code)", "yaml.load(s)",
    ])
    assert len(unsafe_calls(ast.parse(hostile))) == 9
    safe = "import torch\nimport numpy as np\ntorch.load(f, map_location='cpu', weights_only=True)\nnp.load(f)\nmodel.eval()"
    assert unsafe_calls(ast.parse(safe)) == []


def test_nothing_in_tracediff_can_unpickle_or_evaluate_data() -> None:
    assert len(SOURCES) > 20
    found = {str(path.relative_to(REPO)): unsafe_calls(ast.parse(path.read_text(), str(path))) for path in SOURCES}
    assert {k: v for k, v in found.items() if v} == {}
