#!/usr/bin/env bash
# Before / after a change to the runtime or the kernels, in one GPU run: the same checks on two source trees.
#
#   bash benchmarks/compare_trees.sh OLD_SRC NEW_SRC OUT [kascade bench arguments...]
#
# OLD_SRC / NEW_SRC: folders holding a `kascade` package (e.g. `git archive REV src | tar -x -C old`). For each tree:
#   1. benchmarks/runtime_equivalence.py on the default model (the installed one, or the GGUF file KASCADE_MODEL
#      names): logits of every plan and case, fp32 and bf16, Triton backend, greedy tokens of
#      generate and of the CUDA-graph decoder;
#   2. `kascade bench --device cuda` with the given arguments (default: Llama-3.1-8B shapes, 32K and 128K, B 1 and 8).
# Then OUT/equivalence.md compares the trees' logits and tokens, and OUT/bench_{old,new}/bench.md hold the timings
# (each bench times dense itself in the same process: compare the ratios, and the absolute times of the two runs,
# which ran back to back on one GPU).
#
# Time: on an H200 each plan takes about 20 s per dtype (Triton compilations included), so the full recording is
# about 10 minutes per tree, more than one 10-minute device call. Split it across calls on a warm machine:
#   EQ_DTYPES="bf16"            the dtypes recorded (default: "fp32 bf16")
#   EQ_ONLY="default uniform"   only these plans (names as runtime_equivalence.py lists them; default: all)
#   STEPS="eq"                  only the equivalence ("bench": only the benchmark; default: "eq bench")
# A plan a tree's backend refuses (e.g. the shared-selection baseline, which the Triton backend does not serve) is
# recorded as refused; the comparison accepts it when both trees refuse it.
set -euo pipefail
old=$(realpath "$1") new=$(realpath "$2") out=$3
shift 3
bench_args=("$@")
[[ ${#bench_args[@]} -gt 0 ]] || bench_args=(--models llama8b --lengths 32768 131072 --batches 1 8)
mkdir -p "$out"
here=$(dirname "$0")
steps=${STEPS:-eq bench}
read -r -a dtypes <<< "${EQ_DTYPES:-fp32 bf16}"
only=()
[[ -z ${EQ_ONLY:-} ]] || { read -r -a names <<< "$EQ_ONLY"; only=(--only "${names[@]}"); }
for tree in old new; do
  [[ " $steps " == *" eq "* ]] || break
  src=${!tree}
  echo "== $tree: equivalence recording ($src)"
  PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" python3 "$here/runtime_equivalence.py" record --device cuda \
    --backend triton --dtypes "${dtypes[@]}" "${only[@]}" ${KASCADE_MODEL:+--model "$KASCADE_MODEL"} \
    --out "$out/eq_$tree.pt"
done
if [[ " $steps " == *" eq "* ]]; then
  python3 "$here/runtime_equivalence.py" compare "$out/eq_old.pt" "$out/eq_new.pt" --atol 1e9 --verbose \
    > "$out/equivalence.md" || true
  tail -n 3 "$out/equivalence.md"
fi
for tree in old new; do
  [[ " $steps " == *" bench "* ]] || break
  src=${!tree}
  echo "== $tree: kascade bench ${bench_args[*]}"
  PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" python3 -m kascade.cli bench --device cuda "${bench_args[@]}" \
    --out "$out/bench_$tree"
done
