"""Never confidently wrong: a compare whose evidence is incomplete says "cannot tell: record X" in
its first lines instead of naming a root cause (tracediff/compare/findings/evidence.py).

Each case is recorded as a new user records it: `tracediff record -- python script.py` subprocesses
on real transformers models (a shallow Llama, a deep Qwen2), scripts that do not import tracediff,
the server running its requests in another order than the trainer.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_tracediff

pytestmark = pytest.mark.slow

COMMON = textwrap.dedent(
    """
    import sys

    import torch
    import transformers

    ARCH, H, LAYERS, ORDER, FEED = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], sys.argv[4], sys.argv[5]
    DEPTH = {"llama": 8, "qwen2": 24}[ARCH]
    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=DEPTH, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    config = (transformers.LlamaConfig(**kw) if ARCH == "llama" else transformers.Qwen2Config(**kw))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    SEQS = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(24, 56, (10,), generator=g)]


    class Draft(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(len(LAYERS) * H, H, bias=False)

        def forward(self, x):
            return self.fc(x)


    class TrainerDraft(Draft):
        pass


    class ServerDraft(Draft):
        pass


    def run(draft):
        # partly: the first six in the same order, the last four each moved one place on
        order = {"same": SEQS, "reversed": SEQS[::-1], "partly": SEQS[:6] + SEQS[7:] + SEQS[6:7]}[ORDER]
        with torch.no_grad():
            for ids in order:
                t = torch.tensor([ids])
                # FEED=embeds: the server computes its embeddings itself (no forward gets input_ids)
                kw = {"inputs_embeds": model.get_input_embeddings()(t)} if FEED == "embeds" else {"input_ids": t}
                out = model(**kw, output_hidden_states=True)
                draft(torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1))
    """
)

TRAINER = "from common import TrainerDraft, run\nrun(TrainerDraft())\n"
SERVER = "from common import ServerDraft, run\nrun(ServerDraft())\n"
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("evidence")
    (d / "common.py").write_text(COMMON)
    (d / "trainer.py").write_text(TRAINER)
    (d / "server.py").write_text(SERVER)
    return d


def _record(workdir: Path, store: str, script: str, arch: str, hidden: int, layers: str, order: str, feed: str,
            *options: str) -> Path:
    tap = "TrainerDraft.fc:input" if script == "trainer.py" else "ServerDraft.fc:input"
    result = run_tracediff("record", "--tap", tap, *options, "-o", workdir / store, "--",
                           sys.executable, script, arch, hidden, layers, order, feed, cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr
    return workdir / store


def _compare(workdir: Path, ref: Path, cand: Path, *extra: str) -> tuple[int, list[str], dict]:
    out = workdir / f"{ref.stem}-{cand.stem}.json"
    result = run_tracediff("compare", ref, cand, "--json", out, *extra, cwd=workdir, timeout=300)
    assert result.returncode in (0, 1, 2), result.stderr
    return result.returncode, result.stdout.splitlines(), json.loads(out.read_text())


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trainer(request: pytest.FixtureRequest, workdir: Path) -> tuple[str, Path]:
    arch = request.param
    store = _record(workdir, f"train-{arch}.zarr", "trainer.py", arch, "64", "0,3,6", "same", "ids",
                    "--segment-size", "64", "--labels-from", CAUSAL_LM[arch])
    return arch, store


def test_a_candidate_without_token_ids_in_another_order_cannot_tell_and_says_what_to_record(trainer, workdir):
    arch, train = trainer
    server = _record(workdir, f"server-reversed-{arch}.zarr", "server.py", arch, "64", "0,3,6", "reversed",
                     "embeds", "--segment-size", "64")
    code, lines, report = _compare(workdir, train, server)
    assert code == 2
    assert lines[0].startswith("tracediff compare: CANNOT TELL")
    head = " ".join(lines[:4])
    assert "carry no token ids" in head and "record the candidate with its token ids" in head
    assert report["verdict"] == "cannot_tell"
    gate = {p["name"]: p for p in report["preconditions"]}
    assert gate["token_ids"]["status"] == "unmet"
    assert gate["token_ids"]["evidence"]["sides_without_token_ids"] == ["candidate"]
    # No root cause it has no evidence for: no wiring finding, no Fix box, one answer per segment.
    kinds = [f["kind"] for f in report["findings"] if f["severity"] == "error"]
    assert kinds == ["cannot_tell"]
    assert report["fix"] is None and report["record_next"]["reasons"]
    assert {m["status"] for m in report["segment_map"]} == {"undecided"}
    assert not any("is missing from the candidate" in line or "no counterpart" in line for line in lines)


def test_the_same_pair_recorded_with_token_ids_names_the_single_root_cause(trainer, workdir):
    arch, train = trainer
    server = _record(workdir, f"server-labelled-{arch}.zarr", "server.py", arch, "64", "0,3,7", "reversed", "ids",
                     "--segment-size", "64", "--labels-from", CAUSAL_LM[arch])
    code, lines, report = _compare(workdir, train, server)
    assert code == 1, "\n".join(lines)
    assert report["preconditions"][0] == {**report["preconditions"][0], "name": "token_ids", "status": "met"}
    assert [c["kind"] for c in report["causes"]] == ["segment_value"]
    assert report["causes"][0]["summary"].startswith("candidate segment 2")


@pytest.mark.parametrize("layers", ["0,3,6", "0,3,7"])
def test_rows_without_token_ids_paired_right_for_some_sequences_only_cannot_tell_and_name_the_others(
        trainer, workdir, layers):
    arch, train = trainer
    server = _record(workdir, f"server-partly-{arch}-{layers}.zarr", "server.py", arch, "64", layers, "partly",
                     "embeds", "--segment-size", "64")
    code, lines, report = _compare(workdir, train, server)
    assert code == 2 and lines[0].startswith("tracediff compare: CANNOT TELL"), "\n".join(lines)
    gate = {p["name"]: p for p in report["preconditions"]}["token_ids"]
    assert gate["status"] == "unmet"
    per_sequence = gate["evidence"]["pairing"]["sequences"]
    assert gate["evidence"]["pairing"]["holds"]  # overall, the pairing looks right: six of ten sequences are
    assert per_sequence["paired_right"] == 6 and len(per_sequence["mispaired"]) == 4, per_sequence
    head, text = " ".join(" ".join(lines[:4]).split()), " ".join(" ".join(lines).split())
    assert "4 sequences were paired with other inputs' rows" in head
    assert "record the candidate with its token ids" in head
    assert "for 6 of 10 sequences checked" in text and "candidate sequence keys 6, 7, 8, 9" in text
    assert [f["kind"] for f in report["findings"] if f["severity"] == "error"] == ["cannot_tell"]
    assert report["fix"] is None and {m["status"] for m in report["segment_map"]} == {"undecided"}


@pytest.mark.parametrize("layers, verdict", [("0,3,6", "match"), ("0,3,7", "mismatch")])
def test_rows_without_token_ids_in_the_same_order_are_decided_and_the_first_lines_say_it_was_assumed(
        trainer, workdir, layers, verdict):
    arch, train = trainer
    server = _record(workdir, f"server-same-{arch}-{layers.replace(',', '')}.zarr", "server.py", arch, "64", layers,
                     "same", "embeds", "--segment-size", "64")
    code, lines, report = _compare(workdir, train, server)
    assert report["verdict"] == verdict and code == (0 if verdict == "match" else 1)
    gate = {p["name"]: p for p in report["preconditions"]}
    assert gate["token_ids"]["status"] == "supported"
    assert any(line.strip().startswith("Assumed, not recorded: the candidate rows carry no token ids")
               for line in lines[:8])
    if verdict == "mismatch":
        assert [c["summary"] for c in report["causes"]][0].startswith("candidate segment 2")


def test_a_guessed_segment_size_against_another_hidden_size_cannot_tell(workdir):
    """A trainer of hidden size 96 (recorded) against a candidate of 64 that recorded no size: its
    192 channels would be cut into 2 segments of 96, and the wiring story would be wrong."""
    train = _record(workdir, "train-96.zarr", "trainer.py", "llama", "96", "0,3,6", "same", "ids",
                    "--segment-size", "96", "--labels-from", "LlamaForCausalLM")
    server = _record(workdir, "server-64-nosize.zarr", "server.py", "llama", "64", "0,3,6", "reversed", "ids",
                     "--labels-from", "LlamaForCausalLM")
    code, lines, report = _compare(workdir, train, server)
    assert code == 2 and lines[0].startswith("tracediff compare: CANNOT TELL")
    assert "--segment-size" in " ".join(lines[:4])
    gate = {p["name"]: p for p in report["preconditions"]}
    assert gate["segment_sizes"]["status"] == "unmet"
    assert gate["segment_sizes"]["evidence"]["not_recorded"] == ["candidate"]
    assert [f["kind"] for f in report["findings"] if f["severity"] == "error"] == ["cannot_tell"]
    assert not any("the candidate concatenates" in f["message"] for f in report["findings"])
    # Recorded with its size, compare decides: two hidden sizes, said as such.
    sized = _record(workdir, "server-64-size.zarr", "server.py", "llama", "64", "0,3,6", "reversed", "ids",
                    "--segment-size", "64", "--labels-from", "LlamaForCausalLM")
    code, _, report = _compare(workdir, train, sized)
    assert code == 1 and [c["kind"] for c in report["causes"]] == ["shape"]
    assert "different hidden sizes (96 vs 64)" in report["causes"][0]["summary"]


def test_every_renderer_says_cannot_tell_first(trainer, workdir):
    arch, train = trainer
    server = workdir / f"server-reversed-{arch}.zarr"
    if not server.exists():
        server = _record(workdir, f"server-reversed-{arch}.zarr", "server.py", arch, "64", "0,3,6", "reversed",
                         "embeds", "--segment-size", "64")
    md, html = workdir / f"r-{arch}.md", workdir / f"r-{arch}.html"
    result = run_tracediff("compare", train, server, "--markdown", md, "--html", html, "--quiet", cwd=workdir,
                           timeout=300)
    assert result.returncode == 2
    assert result.stdout.startswith("cannot_tell: 1 root cause")
    first = md.read_text().splitlines()[:6]
    assert first[0] == "## tracediff compare: **CANNOT TELL**"
    assert any("record the candidate with its token ids" in line for line in first)
    page = html.read_text()
    header = page[page.index('<header class="verdict cannot_tell">'):page.index("</header>")]
    assert "CANNOT TELL" in header and "record the candidate with its token ids" in header
