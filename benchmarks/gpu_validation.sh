#!/usr/bin/env bash
# The GPU checks of a change to the runtime or the kernels: the kernel tests in GPU mode, and a before / after of two
# source trees (logits and generated tokens, then `kascade bench`), resumable over several device calls on one warm
# machine (a call may run 10 minutes; all of this takes longer):
#
#   OLD_SRC=/tmp/old/src KASCADE_MODEL=MODEL.gguf bash benchmarks/gpu_validation.sh OUT [STEP ...]
#
# OLD_SRC / NEW_SRC (default: this checkout's src): folders holding a `kascade` package, e.g.
# `git archive REV src | tar -x -C old`. Each bench times dense itself in the same process: compare the ratios, and
# the absolute times of the two runs, which ran back to back on one GPU.
#
# Steps, in this order by default (a finished step is skipped on the next call, one that ended with status 2 -- a
# usage error -- is not; logs stay in $STATE):
#   kernels-decode kernels-prefill kernels-dispatch kernels-fuzz kernels-hf kernels-jax
#                       the GPU mode of the kernel tests, one file per step (KASCADE_TEST_DEVICE=cuda, size scale
#                       KASCADE_TEST_SCALE, default 4), failures summarised (-rfE), each cut after KERNEL_TIMEOUT
#                       seconds (default 240; the summary then counts the tests that had passed)
#   eq-old eq-new eq-compare
#                       benchmarks.runtime_equivalence on the default model, Triton backend, EQ_DTYPES (default bf16), of the
#                       tree in OLD_SRC and of src/, then their comparison (about 20 s per plan and dtype per tree)
#   bench-old bench-new `kascade bench --device cuda` of both trees with BENCH_ARGS (default: llama8b shapes, 32K and
#                       128K, B 1 and 8)
# Benchmarks, only when named (each writes into $STATE/STEP/, packed with the logs):
#   bench-prefill       benchmarks.prefill at PREFILL_NS (default 32768,131072) and PREFILL_BATCHES (default 1), no
#                       sweep, no FlexAttention:
#                       the per-layer table, torch.topk and the radix top-k side by side
#   sweep-prefill       benchmarks.prefill --ns 32768 --no-flex: the launch / option sweep (prefill.json's
#                       "sweep_32k", printed), then the 32K rows (56 entries and the rows: about 200 s on an H200)
#   bench-decode        benchmarks.decode --no-tune (DECODE_ARGS, e.g. --only llama-3.1-8b:1:131072,...)
#   bench-jax           benchmarks.jax_bench: op-at-a-time and planned (kascade.jax.Attention) JAX paths
# Each step prints one line into OUT/summary.txt (and the call's output); the logs of every step so far are packed
# into OUT/logs.tar.gz (a device call returns only a few files). STATE (default $TMPDIR/kascade-gpu-validation, /tmp
# without TMPDIR) keeps the finished steps while the machine stays warm. The Python steps run from the repository
# root (python -m benchmarks.NAME), with the tree under test first on PYTHONPATH.
set -uo pipefail
out=${1:?usage: gpu_validation.sh OUT [STEP ...]}
shift
state=${STATE:-${TMPDIR:-/tmp}/kascade-gpu-validation}
mkdir -p "$out" "$state"
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
new=${NEW_SRC:-$root/src}
old=${OLD_SRC:-}
scale=${KASCADE_TEST_SCALE:-4}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
all=(kernels-decode kernels-prefill kernels-dispatch kernels-fuzz kernels-hf kernels-jax eq-old eq-new eq-compare
     bench-old bench-new)
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=("${all[@]}")

kernel_tests() {  # files -> pytest on the GPU
  (cd "$root" && PYTHONPATH="$new${PYTHONPATH:+:$PYTHONPATH}" KASCADE_TEST_DEVICE=cuda KASCADE_TEST_SCALE=$scale \
    timeout -k 10 "${KERNEL_TIMEOUT:-240}" python3 -m pytest "$@" -n "${PYTEST_WORKERS:-8}" -q -rfE -p no:cacheprovider)
  local rc=$?
  if [[ $rc == 124 ]]; then  # cut: how far it got (pytest -q prints one character per finished test)
    local progress
    progress=$(grep -E '^[.FEsxX]+( *\[ *[0-9]+%\])?$' "$state/$step.log" | tr -cd '.FE')
    echo "timed out after ${KERNEL_TIMEOUT:-240} s: $(tr -cd '.' <<< "$progress" | wc -c) passed," \
      "$(tr -cd 'FE' <<< "$progress" | wc -c) failed so far"
  fi
  return $rc
}
record() {  # tree src -> equivalence recording
  [[ -n $2 ]] || { echo "OLD_SRC is not set (e.g. git archive ee1568f src | tar -x -C /tmp/old)"; return 2; }
  (cd "$root" && PYTHONPATH="$2:$root${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.runtime_equivalence record --device cuda \
    --backend triton --dtypes ${EQ_DTYPES:-bf16} ${KASCADE_MODEL:+--model "$KASCADE_MODEL"} --out "$state/eq_$1.pt")
}
bench() {  # tree src
  [[ -n $2 ]] || { echo "OLD_SRC is not set"; return 2; }
  PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" python3 -m kascade.cli bench --device cuda \
    ${BENCH_ARGS:---models llama8b --lengths 32768 131072 --batches 1 8 --time-budget 420} --out "$state/bench_$1"
}
script() {  # NAME ARGS... -> python -m benchmarks.NAME on the tree under test
  (cd "$root" && PYTHONPATH="$new:$root" python3 -m "benchmarks.$1" "${@:2}")
}
run_step() {
  case $1 in
    kernels-decode) kernel_tests tests/ops/test_triton_decode.py ;;
    kernels-prefill) kernel_tests tests/ops/test_triton_prefill.py ;;
    kernels-dispatch) kernel_tests tests/ops/test_triton_dispatch.py ;;
    kernels-fuzz) kernel_tests tests/ops/test_triton_fuzz.py ;;
    kernels-hf) kernel_tests tests/integration/test_hf_triton.py ;;
    kernels-jax) kernel_tests tests/jax/test_jax_bridge.py tests/jax/test_jax_attention.py ;;
    eq-old) record old "$old" ;;
    eq-new) record new "$new" ;;
    eq-compare) (cd "$root" && python3 -m benchmarks.runtime_equivalence compare "$state/eq_old.pt" "$state/eq_new.pt" \
                  --atol 1e9 --verbose) | tee "$state/equivalence.md" ;;
    bench-old) bench old "$old" ;;
    bench-new) bench new "$new" ;;
    bench-prefill) script prefill --out "$state/$1" --ns "${PREFILL_NS:-32768,131072}" \
                     --batches "${PREFILL_BATCHES:-1}" --no-sweep --no-flex ;;
    sweep-prefill) script prefill --out "$state/$1" --ns 32768 --no-flex ;;
    bench-decode) script decode --out "$state/$1" --no-tune ${DECODE_ARGS:-} ;;
    bench-jax) script jax_bench --out "$state/$1" ;;
    *) echo "unknown step $1; steps: ${all[*]}"; return 2 ;;
  esac
}
for s in "${steps[@]}"; do
  if [[ -f $state/$s.rc ]]; then
    echo "$s: done before (rc $(cat "$state/$s.rc"))"
    continue
  fi
  t0=$SECONDS
  step=$s
  run_step "$s" > "$state/$s.log" 2>&1
  rc=$?
  [[ $rc == 2 ]] || echo $rc > "$state/$s.rc"  # 2: a usage error (or an interrupted pytest): run it again next time
  last=$(grep -E "timed out|passed|failed|error|largest difference|wrote|Error|not set" "$state/$s.log" | tail -n 1 | cut -c1-300)
  echo "$s: rc $rc in $((SECONDS - t0)) s: $last" | tee -a "$out/summary.txt"
  grep -E "^(FAILED|ERROR) " "$state/$s.log" | head -n 20 | tee -a "$out/summary.txt"
  tar -czf "$out/logs.tar.gz" -C "$state" --exclude='*.pt' . 2>/dev/null
done
