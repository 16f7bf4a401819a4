#!/usr/bin/env bash
# Old and new side by side in one run: the optimizer step of every mode (bench_step.py) and
# the GPT peers' dfa setups (bench_gpt_peers.py), each benchmark alternating between this
# checkout and an older tree, ROUNDS times, logs and JSON in $OUT. A change that must keep
# the speed (a redesign) is proven with it.
#
#   bash bench/old_vs_new.sh prepare REV DIR    # here: DIR = `git archive REV` (+ this _C
#                                               # when its sources are unchanged since REV)
#   bash bench/old_vs_new.sh run DIR [step] [peers]   # on the GPU (after building this
#                                               # checkout's _C); both stages by default
#
# Environment: OUT (default runs/old-vs-new), ROUNDS (2), PEERS_SETUPS (dfa,dfa-remainders),
# STEP_ARGS (--reps 40), PEERS_ARGS (--compile --warmup 3 --iters 8); e.g. a CPU smoke run:
# STEP_ARGS="--cpu --layers 2 --hidden 256 --reps 2" PEERS_ARGS="--cpu --iters 1 --warmup 1".
set -u -o pipefail
cmd=${1:?prepare or run}; shift
case $cmd in
  prepare)
    rev=${1:?REV}; dir=${2:?DIR}
    rm -rf "$dir" && mkdir -p "$dir"
    git archive "$rev" mpzero bench examples csrc setup.py pyproject.toml | tar -x -C "$dir"
    # mpzero._C's sources (csrc/cpu_adam.cpp is the separate CPU extension, mpzero._cpu)
    if git diff --quiet "$rev" HEAD -- csrc ':!csrc/cpu_adam.cpp'; then
      echo "mpzero._C's sources unchanged since $rev: run copies this checkout's _C into $dir"
      touch "$dir/.same_csrc"
    fi
    echo "prepared $dir from $(git rev-parse --short "$rev")" ;;
  run)
    dir=$(cd "${1:?DIR}" && pwd); shift
    OUT=${OUT:-runs/old-vs-new}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
    export PYTHONUNBUFFERED=1
    if [ -f "$dir/.same_csrc" ]; then
      cp mpzero/_C*.so "$dir/mpzero/"
    elif ! ls "$dir"/mpzero/_C*.so >/dev/null 2>&1; then
      (cd "$dir" && MPZERO_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
        python3 setup.py build_ext --inplace) > "$OUT/build-old.log" 2>&1
    fi
    for tree in new old; do  # which mpzero each tree imports, and its kernels
      src=$PWD; [ $tree = old ] && src=$dir
      (cd "$src" && PYTHONPATH=$src python3 -c "import mpzero, mpzero.kernels as k; \
print('$tree', mpzero.__file__, 'mpzero._C' if k.extension_available() else 'reference')")
    done | tee "$OUT/trees.txt"
    stages=${*:-step peers}
    for ((i = 1; i <= ${ROUNDS:-2}; i++)); do
      for tree in new old; do
        src=$PWD; [ $tree = old ] && src=$dir
        for s in $stages; do
          case $s in
            step) (cd "$src" && PYTHONPATH=$src python3 bench/bench_step.py ${STEP_ARGS:---reps 40} \
                    --json "$OUT/step_${tree}_$i.json") 2>&1 | tee "$OUT/step_${tree}_$i.log" ;;
            peers) (cd "$src" && PYTHONPATH=$src python3 bench/bench_gpt_peers.py \
                     ${PEERS_ARGS:---compile --warmup 3 --iters 8} \
                     --setups "${PEERS_SETUPS:-dfa,dfa-remainders}" \
                     --json "$OUT/peers_${tree}_$i.json") 2>&1 | tee "$OUT/peers_${tree}_$i.log" ;;
            *) echo "unknown stage $s" ;;
          esac
        done
      done
    done ;;
  *) echo "usage: $0 prepare REV DIR | run DIR [step] [peers]"; exit 2 ;;
esac
