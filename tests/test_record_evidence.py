"""`tracediff record -- python server.py` on the path a new user takes first records the evidence
compare needs: token ids on every row (the outermost forward that gets ``input_ids`` labels them,
without ``--labels-from``), which class gave them, and the aux layers a generic tap concatenates
(``--aux-layers``/``--convention``, or ``hsN`` segment labels).

The "server" is a real script in a real ``tracediff record`` subprocess that does not import
tracediff: a tiny transformers ``LlamaForCausalLM`` target and an EAGLE-3-like draft whose forward
gets the target's hidden states and its own input tokens (the next tokens), serving its requests in
another order than the trainer. The trainer records in-process as README's first example does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import CliResult, invoke_tracediff, run_tracediff

import tracediff
from tracediff.store import open_store

MODEL = textwrap.dedent(
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    HIDDEN, VOCAB = 32, 128


    class Eagle3Draft(torch.nn.Module):
        # The draft's own input tokens (x_{p+1}) come with the target's states at p.
        def __init__(self, slots):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
            self.fc = torch.nn.Linear(slots * HIDDEN, HIDDEN, bias=False)

        def forward(self, hidden_states, input_ids=None):
            out = self.fc(hidden_states)
            return out if input_ids is None else out + self.embed_tokens(input_ids)


    def build(slots):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2)
        config._attn_implementation = "sdpa"
        target = LlamaForCausalLM(config).eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # non-unit norm weights, as in a trained model
            for module in target.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    module.weight.copy_(torch.empty(module.weight.shape).uniform_(0.5, 2.0, generator=gen))
        rng = torch.Generator().manual_seed(7)
        seqs = [torch.randint(0, VOCAB, (n,), generator=rng) for n in (9, 14, 11, 17)]
        return target, Eagle3Draft(slots).eval(), seqs
    """
)

SERVER = textwrap.dedent(
    """
    import json
    import sys

    import torch

    from model import build

    layers = [int(x) for x in sys.argv[1].split(",")]
    target, draft, seqs = build(len(layers))
    seqs = seqs[::-1]  # requests served in another order than the trainer's
    with torch.no_grad():
        for ids in seqs:
            ids = ids.unsqueeze(0)
            if sys.argv[2] == "input_ids":
                out = target(input_ids=ids, output_hidden_states=True)
            else:  # the target's forward gets no token ids
                out = target(inputs_embeds=target.model.embed_tokens(ids), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
            if sys.argv[2] == "inputs_embeds":  # no forward of this process gets token ids
                draft(aux)
            else:
                draft(aux, torch.roll(ids, -1, dims=1))
    with open("served.json", "w") as fh:
        json.dump([s.tolist() for s in seqs], fh)
    """
)

TRAINER = textwrap.dedent(
    """
    import torch

    import tracediff
    from model import build

    LAYERS = [0, 3, 6]
    target, draft, seqs = build(len(LAYERS))
    with tracediff.record("train.zarr", role="trainer",
                          meta={"aux_layers": {"ids": LAYERS, "convention": "hf"}}) as rec:
        rec.tap(draft.fc, name="fc_in", capture="input", segment_size=32,
                segment_labels=[f"hs{i}" for i in LAYERS])
        with torch.no_grad():
            for i, ids in enumerate(seqs):
                out = target(input_ids=ids[None], output_hidden_states=True)
                aux = torch.cat([out.hidden_states[k] for k in LAYERS], dim=-1)
                rec.labels(seq=i, position=torch.arange(len(ids)), token_id=ids, phase="train")
                draft(aux, torch.roll(ids[None], -1, dims=1))
    """
)


HOOKS = textwrap.dedent(
    """
    import json
    import sys

    import torch

    from model import build

    target, draft, seqs = build(3)
    with torch.no_grad():
        out = target(input_ids=seqs[0][None], output_hidden_states=True)
        draft(torch.cat([out.hidden_states[i] for i in (0, 3, 6)], dim=-1))
    modules = [*target.named_modules(prefix="target"), *draft.named_modules(prefix="draft")]
    hooked = [name for name, m in modules if m._forward_pre_hooks or m._forward_hooks]
    with open(sys.argv[1], "w") as fh:
        json.dump(hooked, fh)
    """
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripts, and the trainer's store on HF hidden_states [0, 3, 6]."""
    root = tmp_path_factory.mktemp("evidence")
    for name, text in (("model.py", MODEL), ("server.py", SERVER), ("trainer.py", TRAINER), ("hooks.py", HOOKS)):
        (root / name).write_text(text)
    proc = subprocess.run([sys.executable, "trainer.py"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return root


def _record_server(workdir: Path, name: str, *options: str, layers: str = "0,3,6",
                   forward: str = "input_ids") -> tuple[Path, CliResult]:
    store = workdir / f"{name}.zarr"
    result = run_tracediff("record", "--tap", "Eagle3Draft.fc:input", *options, "-o", store, "--",
                           sys.executable, "server.py", layers, forward, cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr
    return store, result


def _compare(workdir: Path, candidate: Path, *options: str) -> tuple[CliResult, dict]:
    report = candidate.with_suffix(".json")
    result = run_tracediff("compare", workdir / "train.zarr", candidate, "--json", report, *options,
                           cwd=workdir, timeout=300)
    return result, json.loads(report.read_text())


# ------------------------------------------------------------------------------- labels by themselves
def test_rows_recorded_without_labels_from_carry_the_target_models_token_ids(workdir: Path) -> None:
    store, result = _record_server(workdir, "auto")
    served = json.loads((workdir / "served.json").read_text())
    labels = tracediff.open_labels(store, "fc_in")
    # The rows of each request carry its tokens x_p at positions 0..n-1, in the order served: the
    # target's input_ids, not the draft's own (the next tokens, one position ahead).
    assert labels["token_id"].tolist() == [t for seq in served for t in seq]
    assert labels["position"].tolist() == [p for seq in served for p in range(len(seq))]
    assert labels["next_token_id"].tolist() == [t for seq in served for t in [*seq[1:], -1]]
    with open_store(store) as opened:
        (stream,) = opened.tap_streams("fc_in")
        by = stream.attrs["labelled_by"]
    assert by["class"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM" and by["how"] == "automatic"
    summary = [line for line in result.stderr.splitlines() if "rows labelled by" in line]
    assert summary == ["tracediff:   fc_in: rows labelled by transformers.models.llama.modeling_llama.LlamaForCausalLM "
                       "(its forward's input_ids; found automatically: the outermost forward that gets input_ids)"]
    assert "no token ids" not in result.stderr


@pytest.mark.slow  # a plain run and a recorded one of the same script: ~20 s on two busy cores
def test_only_modules_whose_forward_gets_input_ids_and_the_tapped_one_are_hooked(workdir: Path) -> None:
    # The forward path of every other module (decoder layers, attention, norms, embeddings) is left
    # as it is without tracediff (transformers hooks some of them itself).
    plain = subprocess.run([sys.executable, "hooks.py", "plain.json"], cwd=workdir, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr
    result = run_tracediff("record", "--tap", "Eagle3Draft.fc:input", "-o", workdir / "hooks.zarr", "--",
                           sys.executable, "hooks.py", "recorded.json", cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr
    before = json.loads((workdir / "plain.json").read_text())
    after = json.loads((workdir / "recorded.json").read_text())
    assert [name for name in after if name not in before] == ["target", "target.model", "draft", "draft.fc"]
    assert set(before) <= set(after)


def test_record_says_loudly_when_no_forward_gave_token_ids(workdir: Path) -> None:
    store, result = _record_server(workdir, "no_ids", forward="inputs_embeds")
    assert (tracediff.open_labels(store, "fc_in")["token_id"] == -1).all()
    warnings = [line for line in result.stderr.splitlines() if "no token ids" in line]
    assert len(warnings) == 1, result.stderr
    line = warnings[0]
    assert line.startswith("tracediff: warning: fc_in: the rows carry no token ids")
    for part in ("compare cannot align them by content", "--labels-from CLASS", "tracediff.labels("):
        assert part in line, line
    assert "rows labelled by" not in result.stderr


def test_the_draft_labels_only_when_no_other_forward_gets_token_ids_and_the_summary_says_so(workdir: Path) -> None:
    # Its input_ids are its own input tokens (x_{p+1}): the rows are labelled, one position ahead,
    # and the summary says what to pass instead.
    store, result = _record_server(workdir, "draft_only", forward="draft_only")
    served = json.loads((workdir / "served.json").read_text())
    assert tracediff.open_labels(store, "fc_in")["token_id"].tolist() == [t for s in served for t in [*s[1:], s[0]]]
    (line,) = [line for line in result.stderr.splitlines() if "rows labelled by" in line]
    assert line.startswith("tracediff:   fc_in: rows labelled by model.Eagle3Draft (its forward's input_ids; found "
                           "automatically")
    assert "it holds the tapped module" in line and "--labels-from with the target model's class" in line


def test_labels_from_names_the_class_that_labels(workdir: Path) -> None:
    store, result = _record_server(workdir, "named", "--labels-from", "LlamaModel")
    served = json.loads((workdir / "served.json").read_text())
    assert tracediff.open_labels(store, "fc_in")["token_id"].tolist() == [t for seq in served for t in seq]
    assert ("tracediff:   fc_in: rows labelled by transformers.models.llama.modeling_llama.LlamaModel "
            "(its forward's input_ids; --labels-from)") in result.stderr.splitlines()


# ------------------------------------------------------------------------------- aux layers of a generic tap
@pytest.mark.slow  # a recorded run and a compare each: 10-20 s on two busy cores
@pytest.mark.parametrize("options", [
    ("--aux-layers", "0,3,6"),
    ("--segment-labels", "hs0,hs3,hs6"),
    ("--aux-layers", "-1,2,5", "--convention", "sglang"),  # SGLang's numbering of the same layers
], ids=["aux-layers", "hs-labels", "sglang-numbering"])
def test_a_generic_candidate_on_the_right_layers_is_a_match_with_no_warning(workdir: Path, options: tuple) -> None:
    store, _ = _record_server(workdir, "right-" + "-".join(options).strip("-").replace(",", "_"), *options)
    result, report = _compare(workdir, store, "--fail-on", "warning")
    assert result.returncode == 0, result.stdout
    assert report["verdict"] == "match"
    assert [f["message"] for f in report["findings"] if f["severity"] != "info"] == []
    assert report["candidate"]["aux_layers"]["physical"] == [0, 3, 6]
    assert report["candidate"]["segment_labels"] == ["hs0", "hs3", "hs6"]


@pytest.mark.slow  # a recorded run and a compare: 10-20 s on two busy cores
def test_a_generic_candidate_on_wrong_layers_is_a_mismatch_naming_them(workdir: Path) -> None:
    store, _ = _record_server(workdir, "wrong", "--aux-layers", "0,2,6", layers="0,2,6")
    result, report = _compare(workdir, store)
    assert result.returncode == 1, result.stdout
    assert report["verdict"] == "mismatch"
    config = [f for f in report["findings"] if f["kind"] == "config" and f["severity"] == "warning"]
    assert len(config) == 1 and "physical layers [0, 3, 6] -> [0, 2, 6]" in config[0]["message"]
    wiring = [f for f in report["findings"] if f["severity"] == "error"]
    assert wiring and "candidate segment 1 (hs2)" in wiring[0]["message"]
    assert "reference segment 1 (hs3)" in wiring[0]["message"]


@pytest.mark.parametrize(("options", "names"), [
    (["--convention", "hf"], ["--convention hf", "--aux-layers"]),
    (["--aux-layers", "0,x,6"], ["--aux-layers", "'0,x,6'", "integer"]),
    (["--aux-layers", "0,3", "--segment-labels", "a,b,c"], ["3 segments", "2 layers"]),
    (["--aux-layers", "0,3,6", "--segment-labels", "hs0,hs2,hs6"], ["hs0,hs2,hs6", "[0, 3, 6]"]),
    (["--aux-layers", "-2,3", "--convention", "sglang"], ["-2", "sglang numbering"]),
], ids=["convention-alone", "not-integers", "count", "hs-labels-disagree", "negative-id"])
def test_record_refuses_aux_layers_that_cannot_be_meant_with_one_line(tmp_path: Path, options: list[str],
                                                                      names: list[str]) -> None:
    output = tmp_path / "s.zarr"
    result = invoke_tracediff("record", "--tap", "Eagle3Draft.fc:input", *options, "-o", output, "--",
                              sys.executable, "-c", "print('ran')")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert "ran" not in result.stdout
    assert list(tmp_path.iterdir()) == []
