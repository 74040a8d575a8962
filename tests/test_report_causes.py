"""Reports grouped by cause, with the fix first (issue #25), on real compares.

The shipped broken pair is one misconfiguration: the server's aux-layer ids are one slot late, so its
segments are shifted, the slot the shift empties is missing, the slot it fills is extra, and its
recorded config differs. The report must say so: one root cause with its consequences under it, the
fix (the config field, the value in the engine's numbering, the commands to record again and compare)
in a box at the top of the text, Markdown and HTML reports, and the config difference as a readable
diff. A report that cannot decide says what to record next instead. Severities, counts and exit codes
do not change: the JSON keeps every finding.

Compares of the shipped samples, and of a tiny real Llama recorded here without any aux-layer
metadata (a shift no config value can be named for), about 10 s on two cores.
"""

from __future__ import annotations

import html
import json
import re
import shlex
import shutil

import pytest

from tracediff.compare import compare_stores
from tracediff.demo import default_samples_dir
from tracediff.report import render_html, render_markdown, render_text
from tracediff.report.text import render_verdict_line

SAMPLES = default_samples_dir()
TRAIN, BROKEN, FIXED = SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr", SAMPLES / "server_fixed.zarr"
FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.fixture(scope="module")
def broken():
    return compare_stores(TRAIN, BROKEN)


@pytest.fixture(scope="module")
def fixed():
    return compare_stores(TRAIN, FIXED)


def _by_kind(report, kind: str, severity: str | None = None):
    return next(f for f in report.findings if f.kind == kind and severity in (None, f.severity))


# ------------------------------------------------------------------------------- grouping by cause
def test_the_broken_pair_is_one_root_cause_with_two_consequences(broken):
    causes = broken.causes()
    assert [(c.kind, c.summary) for c in causes] == [("segment_order", "the candidate's segments are shifted by one slot")]
    kinds = [broken.findings[i].kind for i in causes[0].consequences]
    assert kinds == ["segment_missing", "segment_extra"]
    config = [broken.findings[i] for i in causes[0].config]
    assert [(f.kind, f.severity) for f in config] == [("config", "warning")]
    for i in (*causes[0].consequences, *causes[0].config):
        assert broken.findings[i].evidence["explained_by"] == "segment_order"
    sentence = "1 root cause: the candidate's segments are shifted by one slot; 2 consequences."
    assert sentence in _flat(render_text(broken))
    assert sentence in render_markdown(broken)
    assert html.escape(sentence) in render_html(broken)
    assert render_verdict_line(broken) == "mismatch: 1 root cause, 2 consequences; 3 errors, 1 warning, 1 info"


def test_grouping_changes_no_severity_count_or_exit_code_and_the_json_keeps_every_finding(broken):
    assert broken.counts() == {"error": 3, "warning": 1, "info": 1}
    assert broken.exit_code() == 1 and broken.exit_code(fail_on="warning") == 1
    data = json.loads(broken.to_json())
    assert len(data["findings"]) == len(broken.findings) == 5
    assert data["causes"] == [{"finding": 0, "kind": "segment_order", "summary": broken.findings[0].summary,
                               "consequences": [1, 2], "config": [3]}]
    assert [f["evidence"].get("explained_by") for f in data["findings"]] == [
        None, "segment_order", "segment_order", "segment_order", None]


def test_a_shift_explains_only_the_slots_it_empties_and_fills(broken):
    order = _by_kind(broken, "segment_order")
    assert order.evidence["pattern"] == "shift" and order.evidence["shift"] == 1
    # Shift +1: candidate slot i carries reference slot i + 1; reference slot 0 is emptied, candidate
    # slot 2 is filled with something else.
    assert _by_kind(broken, "segment_missing").evidence["reference_segment"] == 0
    assert _by_kind(broken, "segment_extra").evidence["candidate_segment"] == 2


def test_every_renderer_shows_the_cause_with_its_consequences_under_it(broken):
    text = render_text(broken)
    findings = text[text.index("\nFindings"):text.index("\nSegment map")]
    lines = findings.splitlines()
    root = next(k for k, line in enumerate(lines) if line.startswith("  ERROR segment_order:"))
    under = [line for line in lines[root + 1:] if line.startswith("    -> ")]
    assert [re.match(r"    -> (\w+ \w+):", line).group(1) for line in under] == [
        "ERROR segment_missing", "ERROR segment_extra", "WARN config"]
    assert "  INFO config:" in findings  # the other config difference stands on its own

    md = render_markdown(broken)
    part = md[md.index("#### Root cause 1: the candidate's segments are shifted by one slot"):md.index("#### Info")]
    assert part.index("`segment_order`") < part.index("Follows from it (2):") < part.index("`segment_missing`")
    assert part.index("`segment_extra`") < part.index("The recorded config says the same:") < part.index("`config`")

    page = render_html(broken)
    cause = page[page.index('<li class="error cause">'):page.index("<h3>Info (1)</h3>")]
    assert cause.index("segment_order") < cause.index("Follows from it (2)")
    nested = cause[cause.index('<ul class="findings consequences">'):]
    assert re.findall(r'<span class="kind">(\w+)</span>', nested) == ["segment_missing", "segment_extra", "config"]
    # The error cards appear once: the summary no longer repeats them.
    assert page.count('<span class="kind">segment_missing</span>') == 1


# ------------------------------------------------------------------------------------- the Fix box
def test_the_fix_box_comes_first_with_the_value_and_the_commands(broken):
    fix = broken.fix
    assert (fix["finding"], fix["engine"], fix["field"], fix["value"]) == ("segment_order", "sglang", FIELD, [-1, 2, 5])
    assert fix["target_layers"] == [0, 3, 6] and fix["config_can_fix"]
    commands = [c for step in fix["steps"] for c in step["commands"]]
    assert commands == [
        f"tracediff record --adapter sglang -o {BROKEN} --overwrite -- python -m sglang.launch_server ...",
        f"tracediff send {TRAIN} --url http://127.0.0.1:30000",
        f"tracediff compare {TRAIN} {BROKEN}",
    ]
    assignment = f"{FIELD} = [-1, 2, 5]"

    text = render_text(broken)
    box = text[text.index(".- Fix on the candidate (sglang), nested in the draft config"):]
    box = box[:box.index("\n  '")]
    assert text.index(".- Fix") < text.index("\nFindings")
    assert f"|     {assignment}\n" in box
    for command in commands:
        assert command in _flat(box.replace("\\\n  |        ", "").replace("|", ""))

    md = render_markdown(broken)
    alert = md[md.index("> [!IMPORTANT]"):md.index("\n\n|")]
    assert md.index("> [!IMPORTANT]") < md.index("### Findings")
    assert f"> `{assignment}`" in alert
    assert "> ```sh\n" + "".join(f"> {c}\n" for c in commands) + "> ```" in alert

    page = render_html(broken)
    section = page[page.index('<section class="box fix" id="fix">'):]
    section = section[:section.index("</section>")]
    assert page.index('id="fix"') < page.index('id="summary"') < page.index('id="findings"')
    assert f'<p class="assignment"><code>{assignment}</code></p>' in section
    assert '<pre class="commands">' + "\n".join(commands) + "</pre>" in section


def test_a_match_has_no_cause_no_fix_box_and_nothing_to_record(fixed):
    assert fixed.verdict == "match" and fixed.causes() == [] and fixed.fix is None and fixed.record_next is None
    assert render_verdict_line(fixed) == "match: 0 errors, 0 warnings, 2 info"
    for text in (render_text(fixed), render_markdown(fixed), render_html(fixed)):
        assert "root cause" not in text and "[!IMPORTANT]" not in text and 'id="fix"' not in text


# -------------------------------------------------------------------------- the config as a diff
def test_the_config_difference_reads_as_a_diff_physical_layers_first(broken):
    warning = _by_kind(broken, "config", "warning")
    changes = warning.evidence["changes"]
    assert changes[0] == {"field": "physical layers (HF hidden_states numbering)", "reference": [0, 3, 6],
                          "candidate": [3, 6, 8]}
    assert {"field": "store.aux_layers.ids", "reference": [0, 3, 6], "candidate": [2, 5, 7]} in changes
    assert {"field": "store.aux_layers.convention", "reference": "hf", "candidate": "sglang"} in changes
    assert all(not isinstance(c["reference"], dict) and not isinstance(c["candidate"], dict) for c in changes)
    text = render_text(broken)
    block = text[text.index("WARN config:"):text.index("INFO config:")]
    assert "physical layers (HF hidden_states numbering): [0, 3, 6] -> [3, 6, 8]\n" in block
    assert "store.aux_layers.ids: [0, 3, 6] -> [2, 5, 7]\n" in block
    assert "store.aux_layers.framework: (none) -> sglang\n" in block
    # Never a dict dump, in the default report or in --verbose.
    for rendered in (text, render_text(broken, verbose=True)):
        assert "{'ids'" not in rendered and '{"ids"' not in rendered.split("\nFindings")[1]
    other = _by_kind(broken, "config", "info")
    assert {"field": "store.server_args.speculative_algorithm", "reference": None, "candidate": "EAGLE3"} in (
        other.evidence["changes"])


# ------------------------------------------------------------------------- what to record next
@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama's trainer and an engine fed one slot late, recorded with no aux-layer metadata
    and generic segment labels: the shift is found, the layers to feed are not known."""
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415
    from tracediff.testing.pipelines import run_engine, run_trainer  # noqa: PLC0415
    from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences  # noqa: PLC0415

    root = tmp_path_factory.mktemp("unlabelled")
    tl = build_tiny_llama(hidden_size=32, num_layers=6, seed=0)
    seqs = make_sequences(n_seqs=3, min_len=10, max_len=20, seed=2)
    for name, runner, layers in (("train", run_trainer, ["hs0", "hs2", "hs4"]),
                                 ("server", run_engine, ["hs2", "hs4", "hs5"])):
        draft = DraftHead(32, 3)
        with tracediff.record(root / f"{name}.zarr", role=name, on_full="block") as rec:
            rec.tap(draft.fc, "fc_in", segment_size=32)
            runner(tl, draft, seqs, layers, dtype=torch.float32, on_batch=lambda lab, r=rec: r.labels(**lab))
        assert rec.error is None
    return compare_stores(root / "train.zarr", root / "server.zarr")


def test_a_shift_with_no_recorded_layers_says_what_to_record_next(unlabelled):
    assert [c.kind for c in unlabelled.causes()] == ["segment_order"]
    assert unlabelled.fix is None  # no value to set: the layers the reference fed are not known
    box = unlabelled.record_next
    assert box is not None and box["reasons"][0].startswith("segment_order has no fix value: ")
    assert "is not known" in box["reasons"][0]
    commands = [c for step in box["steps"] for c in step["commands"]]
    assert any(c.startswith("tracediff record --adapter hf -o bank.zarr") for c in commands)
    assert any(c.endswith("--bank bank.zarr") and c.startswith("tracediff compare ") for c in commands)
    text = render_text(unlabelled)
    assert text.index(".- What to record next") < text.index("\nFindings")
    assert "> [!NOTE]" in render_markdown(unlabelled)
    assert '<section class="box record-next" id="record-next">' in render_html(unlabelled)


def test_one_recording_on_both_sides_says_what_to_record_next():
    report = compare_stores(TRAIN, TRAIN)
    assert report.fix is None and report.record_next is not None
    assert "one recording" in report.record_next["reasons"][0]
    commands = report.record_next["steps"][0]["commands"]
    assert commands[0].startswith("tracediff record --adapter sglang -o server.zarr")
    assert commands[-1] == f"tracediff compare {TRAIN} server.zarr"


# ----------------------------------------------------------------------------------- store text
def test_store_paths_in_the_boxes_are_quoted_for_the_shell_and_escaped_in_every_report(tmp_path):
    odd = tmp_path / "run ```1``` <script>x | it's"  # no slash: one folder
    odd.mkdir()
    ref, cand = odd / "train.zarr", odd / "server.zarr"
    shutil.copytree(TRAIN, ref)
    shutil.copytree(BROKEN, cand)
    report = compare_stores(ref, cand)
    commands = [c for s in report.fix["steps"] for c in s["commands"]]
    assert shlex.split(commands[-1]) == ["tracediff", "compare", str(ref), str(cand)]
    page = render_html(report)
    assert "<script" not in page and "&lt;script&gt;x" in page
    md = render_markdown(report)
    # A fence longer than the backtick run in the path: it cannot close early.
    assert "> ````sh\n" + "".join(f"> {c}\n" for c in commands) + "> ````\n" in md
    text = render_text(report)
    assert shlex.quote(str(cand)) in text
