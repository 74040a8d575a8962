#!/usr/bin/env bash
# gpu_check.sh: what tracediff records from live servers with CUDA graphs ON, on a machine with one NVIDIA GPU.
#
# Run by hand (not by CI), from the repository root, in an environment that has tracediff and CUDA builds
# of torch, SGLang and vLLM (this script installs nothing):
#
#     bash benchmarks/gpu_check.sh                      # every check, a few minutes
#     TRACEDIFF_PYTHON=.venv/bin/python TRACEDIFF_VLLM_PYTHON=/opt/vllm/bin/python bash benchmarks/gpu_check.sh
#     bash benchmarks/gpu_check.sh --build-only         # only the tiny models and the trace (runs on CPU too)
#     PYTHONPATH=tests/sglang_stubs bash benchmarks/gpu_check.sh --cpu-smoke
#                                                       # this script's own plumbing on CPU: build, one capture-only
#                                                       # SGLang server (graphs off on CPU), send, stop by pid, inspect
#
# What it checks, each a PASS/FAIL line with one reason, then a summary; exit 0 only if every check passed:
#   gpu              nvidia-smi sees a GPU and torch.cuda is available (else exit 2 before anything else).
#   build            the tiny target (tracediff.testing.tiny_llama), its EAGLE-3 draft (tracediff.testing.eagle3)
#                    and a trace of token sequences to send, as tests/sglang_harness.py / tests/vllm_harness.py do.
#   sglang-graphs    SGLang with an EAGLE-3 draft and CUDA graphs ON (the default) under `tracediff record
#                    --adapter sglang`: after `tracediff send`, `tracediff inspect --json` shows aux_hidden rows of
#                    prefill and verify (verify is replayed from a graph), fc_in draft_extend rows beyond the
#                    prefills' (the DRAFT_EXTEND_V2 forwards replayed from a graph), no row lost, and the server
#                    log shows that graphs were captured (else the check proves nothing and fails).
#   sglang-async     the same with `--commit background` (the device-to-host copy done asynchronously on GPU).
#   sglang-decode    SGLang in capture-only mode (--enable-return-aux-hidden-states, no draft): aux_hidden rows of
#                    prefill and decode (decode replayed from a graph), no row lost.
#   vllm-graphs      vLLM with the EAGLE-3 draft and its default cudagraph mode under `tracediff record --adapter
#                    vllm`: aux_hidden rows of prefill and verify, fc_in rows, no row lost.
#   cost             the same load sent to SGLang (graphs on) without and with recording: both complete; the
#                    wall-time ratio is printed (a number to read, not a pass threshold). benchmarks/
#                    bench_serve_record.py is not run: it serves vLLM's CPU build with --enforce-eager.
#
# What it cannot check without a GPU (and CI never runs): graph capture and replay themselves, the async copy
# on a CUDA stream, the cost on a GPU. On CPU the replay-path code is tested with SGLang's real runner classes
# and a stand-in for the replay (tests/test_sglang_graphs.py); this script is the check on the real thing.
#
# Everything goes under a temporary folder that is deleted at the end (GPU_CHECK_KEEP=1 keeps it); servers
# listen on 127.0.0.1; each is stopped by the pid this script started (SIGTERM, forwarded by tracediff record;
# SIGKILL to its own process group after GPU_CHECK_STOP_TIMEOUT seconds).
set -u

PY=${TRACEDIFF_PYTHON:-python}
VLLM_PY=${TRACEDIFF_VLLM_PYTHON:-$PY}
START_TIMEOUT=${GPU_CHECK_START_TIMEOUT:-420}
STOP_TIMEOUT=${GPU_CHECK_STOP_TIMEOUT:-120}
MAX_NEW=${GPU_CHECK_MAX_NEW_TOKENS:-24}
BUILD_ONLY=0
CPU_SMOKE=0
for arg in "$@"; do
    case "$arg" in
        --build-only) BUILD_ONLY=1 ;;
        --cpu-smoke) CPU_SMOKE=1 ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tracediff-gpu-check.XXXXXX")
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null
        sleep 5
        kill -KILL -- "-$SERVER_PID" 2>/dev/null
    fi
    if [ "${GPU_CHECK_KEEP:-0}" = 1 ]; then echo "gpu_check: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

RESULTS=()
FAILED=0
pass() { echo "PASS $1: $2"; RESULTS+=("PASS $1: $2"); }
fail() { echo "FAIL $1: $2"; RESULTS+=("FAIL $1: $2"); FAILED=1; }
summary() {
    echo
    echo "gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(git -C "$(dirname "$0")/.." rev-parse --short HEAD 2>/dev/null || echo '?')):"
    for line in "${RESULTS[@]}"; do echo "  $line"; done
    [ "$FAILED" = 0 ] && echo "gpu_check: all checks passed" || echo "gpu_check: some checks FAILED"
}

td() { "$PY" -m tracediff "$@"; }

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# ------------------------------------------------------------------------------------------------ gpu
check_gpu() {
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or sees none): these checks need one GPU and CUDA"
        echo "  builds of torch, sglang and vllm. On a CPU machine run the tests instead (tests/test_sglang_graphs.py),"
        echo "  or 'bash benchmarks/gpu_check.sh --build-only' to check the model building."
        exit 2
    fi
    local why
    if ! why=$("$PY" -c 'import torch; assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"; print(torch.cuda.get_device_name(0))' 2>&1); then
        echo "gpu_check: $PY: ${why##*$'\n'}: install a CUDA build of torch (with sglang) or set TRACEDIFF_PYTHON"
        exit 2
    fi
    pass gpu "$(nvidia-smi -L | head -1); torch sees $why"
    for mod in sglang:"$PY" vllm:"$VLLM_PY"; do
        if ! "${mod#*:}" -c "import ${mod%%:*}" >/dev/null 2>&1; then
            echo "gpu_check: note: ${mod#*:} cannot import ${mod%%:*}: its checks will fail (needs: pip install ${mod%%:*} with a CUDA build; set TRACEDIFF_PYTHON / TRACEDIFF_VLLM_PYTHON)"
        fi
    done
}

# ---------------------------------------------------------------------------------------------- build
build() {
    if ! "$PY" - "$WORK" > "$WORK/build.log" 2>&1 <<'EOF'
import sys
from pathlib import Path

import tracediff as td
from tracediff.testing.eagle3 import write_eagle3_draft
from tracediff.testing.pipelines import run_trainer
from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences

root = Path(sys.argv[1])
# head_dim 64 (4 heads): the size GPU attention kernels (FlashInfer, FA3) are built for.
tl = build_tiny_llama(hidden_size=256, num_layers=4, vocab_size=512, seed=0)
tl.model.save_pretrained(root / "target")
ids = [0, 1, 2]  # in the draft config at top level (vLLM) and in eagle_config (SGLang)
write_eagle3_draft(root / "draft", tl.config, ids, where="both", seed=3)
layers = ["hs1", "hs2", "hs3"]
seqs = make_sequences(n_seqs=8, min_len=12, max_len=40, vocab_size=512, seed=1)
head = DraftHead(256, 3)
with td.record(root / "trace.zarr", role="trainer") as rec:
    rec.tap(head.fc, "fc_in", segment_size=256, segment_labels=layers)
    run_trainer(tl, head, seqs, layers, on_batch=lambda labels: rec.labels(**labels))
print(sum(len(s) for s in seqs))
EOF
    then
        fail build "building the tiny models failed: $(tail -1 "$WORK/build.log")"
        return 1
    fi
    PROMPT_TOKENS=$(tail -1 "$WORK/build.log")
    pass build "target, draft and an 8-sequence trace ($PROMPT_TOKENS prompt tokens) in $WORK"
}

# ----------------------------------------------------------------------------------------- servers
wait_healthy() {  # url pid log
    local deadline=$((SECONDS + START_TIMEOUT))
    while [ $SECONDS -lt $deadline ]; do
        kill -0 "$2" 2>/dev/null || return 1
        "$PY" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$1/health', timeout=5).status != 200)" \
            >/dev/null 2>&1 && return 0
        sleep 2
    done
    return 1
}

stop_server() {  # stop the server this script started, by its pid (tracediff record forwards SIGTERM)
    local pid=$SERVER_PID waited=0
    [ -z "$pid" ] && return
    kill -TERM "$pid" 2>/dev/null
    while kill -0 "$pid" 2>/dev/null && [ $waited -lt "$STOP_TIMEOUT" ]; do sleep 1; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null; fi
    wait "$pid" 2>/dev/null
    SERVER_PID=""
}

# serve NAME ENGINE -- COMMAND...: start COMMAND (its own process group), wait for /health, send the trace.
# Sets SEND_SECONDS; returns 1 (with REASON) when the server did not come up or the requests failed.
serve() {
    local name=$1 engine=$2 url="http://127.0.0.1:$PORT"
    shift 3
    setsid "$@" > "$WORK/$name.log" 2>&1 &
    SERVER_PID=$!
    if ! wait_healthy "$url" "$SERVER_PID"; then
        REASON="the server did not become healthy within ${START_TIMEOUT}s: $(grep -m1 -iE 'error|exception' "$WORK/$name.log" || tail -1 "$WORK/$name.log")"
        stop_server
        return 1
    fi
    local t0=$SECONDS
    if ! td send "$WORK/trace.zarr" --url "$url" --engine "$engine" --max-new-tokens "$MAX_NEW" --concurrency 4 \
            > "$WORK/$name.send.log" 2>&1; then
        REASON="tracediff send failed: $(tail -1 "$WORK/$name.send.log")"
        stop_server
        return 1
    fi
    SEND_SECONDS=$((SECONDS - t0))
    stop_server
}

# expect NAME STORE SPEC: `tracediff inspect --json` of STORE against SPEC, e.g.
# "aux_hidden:prefill,verify:cover fc_in:draft_extend:cover": each tap has rows of those phases and no tap lost
# a row; ":cover": for every sequence sent, the tap has a valid row at each of its prompt positions (the eager
# prefill or its draft extend) and one past its prompt (decode / verify / draft extend: replayed from a graph).
# Prints PASS/FAIL.
expect() {
    local name=$1 store=$2 spec=$3 why
    if ! td inspect --json "$WORK/$name.inspect.json" "$store" > /dev/null 2>&1; then
        fail "$name" "tracediff inspect could not read $store: $(tail -1 "$WORK/$name.log")"
        return
    fi
    if why=$("$PY" - "$WORK/$name.inspect.json" "$spec" "$store" "$WORK/trace.zarr" <<'EOF'
import json
import sys


from tracediff.store import open_store


def positions(path: str, tap: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    with open_store(path) as st:
        for stream in st.tap_streams(tap):
            labels = stream.labels(("seq", "position", "valid"))
            for s, p in zip(labels["seq"][labels["valid"]], labels["position"][labels["valid"]], strict=True):
                out.setdefault(stream.seq_names.get(int(s), str(int(s))), set()).add(int(p))
    return out


desc = json.load(open(sys.argv[1]))
sent = {key: max(ps) + 1 for key, ps in positions(sys.argv[4], "fc_in").items()}  # prompt lengths
found, problems = [], []
for item in sys.argv[2].split():
    tap, _, wanted = item.partition(":")
    wanted, _, cover = wanted.partition(":")
    writers = desc["taps"].get(tap, {}).get("writers", [])
    phases: dict[str, int] = {}
    for w in writers:
        for phase, n in (w.get("phases") or {}).items():
            phases[phase] = phases.get(phase, 0) + int(n)
        if w.get("dropped_rows"):
            problems.append(f"{tap}/{w['writer']} lost {w['dropped_rows']} rows: {w.get('drop_reason')}")
    for phase in wanted.split(","):
        if not phases.get(phase):
            problems.append(f"{tap} has no {phase} rows (phases {phases or 'none'})")
    if cover and tap in desc["taps"]:
        got = positions(sys.argv[3], tap)
        short = [k for k, n in sent.items() if not set(range(n)) <= got.get(k, set())]
        beyond = [k for k, n in sent.items() if not any(p >= n for p in got.get(k, ()))]
        if short:
            problems.append(f"{tap}: {len(short)} of {len(sent)} sequences miss rows of their prompt (e.g. {short[0]})")
        if beyond:
            problems.append(f"{tap}: {len(beyond)} of {len(sent)} sequences have no row past their prompt "
                            f"(replayed forwards not recorded; e.g. {beyond[0]})")
    found.append(f"{tap} {phases}" + (f", {len(sent)} sequences covered" if cover else ""))
print("; ".join(problems) if problems else "; ".join(found))
sys.exit(1 if problems else 0)
EOF
    ); then pass "$name" "$why"; else fail "$name" "$why"; fi
}

graphs_captured() {  # NAME: SGLang logged "Capture ... CUDA graph end" (else the check would prove nothing)
    grep -qiE 'capture .*cuda graph (begin|end)' "$WORK/$1.log"
}

SGLANG_BASE=()
sglang_command() {  # PORT EXTRA...: the SGLang server command
    local port=$1
    shift
    local device=(--dtype bfloat16 --mem-fraction-static 0.5 --cuda-graph-max-bs 8)
    [ "$CPU_SMOKE" = 1 ] && device=(--device cpu --dtype float32 --max-total-tokens 4096)
    SGLANG_BASE=("$PY" -m sglang.launch_server --model-path "$WORK/target" --skip-tokenizer-init "${device[@]}"
        --host 127.0.0.1 --port "$port" --disable-radix-cache "$@")
}
EAGLE=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$WORK/draft" --speculative-num-steps 2
       --speculative-eagle-topk 1 --speculative-num-draft-tokens 3)

check_sglang() {  # NAME RECORD_OPTIONS... -- SERVER_EXTRA...
    local name=$1 store
    shift
    local record=() extra=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do record+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    extra=("$@")
    store="$WORK/$name.zarr"
    PORT=$(free_port)
    sglang_command "$PORT" "${extra[@]}"
    if ! serve "$name" sglang -- "$PY" -m tracediff record --adapter sglang -o "$store" "${record[@]}" -- "${SGLANG_BASE[@]}"; then
        fail "$name" "$REASON"
        return 1
    fi
    if [ "$CPU_SMOKE" = 0 ] && ! graphs_captured "$name"; then
        fail "$name" "the server log shows no CUDA-graph capture: graphs were off, nothing replayed was checked"
        return 1
    fi
    return 0
}

# ------------------------------------------------------------------------------------------------ main
echo "gpu_check: working in $WORK"
if [ "$BUILD_ONLY" = 1 ]; then
    build
    summary
    exit "$FAILED"
fi
if [ "$CPU_SMOKE" = 1 ]; then  # the plumbing only: no graph is captured or replayed on CPU
    build || { summary; exit 1; }
    if check_sglang sglang-decode -- --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 \
            --return-aux-hidden-state-layer-ids 0 1 2; then
        expect sglang-decode "$WORK/sglang-decode.zarr" "aux_hidden:prefill,decode:cover"
    fi
    summary
    exit "$FAILED"
fi
check_gpu
build || { summary; exit 1; }

if check_sglang sglang-graphs -- "${EAGLE[@]}"; then
    ON_SECONDS=$SEND_SECONDS
    expect sglang-graphs "$WORK/sglang-graphs.zarr" "aux_hidden:prefill,verify:cover fc_in:draft_extend:cover"
fi
if check_sglang sglang-async --commit background -- "${EAGLE[@]}"; then
    expect sglang-async "$WORK/sglang-async.zarr" "aux_hidden:prefill,verify:cover fc_in:draft_extend:cover"
fi
if check_sglang sglang-decode -- --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 \
        --return-aux-hidden-state-layer-ids 0 1 2; then
    expect sglang-decode "$WORK/sglang-decode.zarr" "aux_hidden:prefill,decode:cover"
fi

PORT=$(free_port)
VLLM_CMD=("$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$WORK/target" --skip-tokenizer-init
    --dtype bfloat16 --max-model-len 512 --max-num-seqs 8 --gpu-memory-utilization 0.3 --no-enable-prefix-caching
    --seed 0 --host 127.0.0.1 --port "$PORT"
    --speculative-config "{\"method\": \"eagle3\", \"model\": \"$WORK/draft\", \"num_speculative_tokens\": 3}")
if serve vllm-graphs vllm -- "$VLLM_PY" -m tracediff record --adapter vllm -o "$WORK/vllm-graphs.zarr" -- "${VLLM_CMD[@]}"; then
    if ! grep -qE 'Graph capturing finished|Capturing CUDA graphs' "$WORK/vllm-graphs.log"; then
        fail vllm-graphs "vLLM's log shows no CUDA-graph capture: graphs were off, nothing replayed was checked"
    else
        expect vllm-graphs "$WORK/vllm-graphs.zarr" "aux_hidden:prefill,verify fc_in:draft_extend"
    fi
else
    fail vllm-graphs "$REASON"
fi

if [ -n "${ON_SECONDS:-}" ]; then
    PORT=$(free_port)
    sglang_command "$PORT" "${EAGLE[@]}"
    if serve sglang-off sglang -- "${SGLANG_BASE[@]}"; then
        ratio=$("$PY" -c "print(f'{$ON_SECONDS / max($SEND_SECONDS, 1):.2f}')")
        pass cost "tracediff send of the trace (max $MAX_NEW new tokens): ${SEND_SECONDS}s without recording, ${ON_SECONDS}s with (ratio $ratio; whole seconds, one run each)"
    else
        fail cost "$REASON"
    fi
else
    fail cost "no recorded SGLang run to compare with"
fi

summary
exit "$FAILED"
