#!/usr/bin/env bash
# One device call, in priority order: build mpzero._C, run the GPU tests, time the kernels,
# measure memory per rank (bench_memory.py), run the GPT example on the GPU with both optimizers.
# Logs and JSON go to $OUT (default runs/gpu, ignored by git). A result set worth keeping is
# written up as bench/results/<theme>_<gpu>_<yyyymmdd>.md (what, GPU, torch, commit, command,
# table; see bench/results/README.md) and the tables of docs/performance.md are updated from it.
#
#   bash bench/gpu_session.sh [build] [tests] [kernels] [memory] [gpt] [step] [ckpt] [recompute]
#                             [profile] [peers] [peers-ga] [peers-eager] [gelu] [mlp]
#                             [heads] [layernorm] [sweep] [llama7b] [peers-7b] [old-vs-new]
#   (no argument: build tests kernels memory gpt)
#
#   step:      bench/bench_step.py (every optimizer mode vs torch fused AdamW and the copy floor)
#   ckpt:      1.3B GPT (24 x 2048, seq 2048): save after 2 iterations and resume, per
#              --ckpt-format; the example's own "saved/loaded checkpoint ... in X s" lines + size
#   recompute: bench/bench_options.py at the 1.3B shape, micro-batch 8 (peak memory and
#              time of no recompute / selective / full)
#   profile:   bench/profile_gpt.py, the 1.3B dfa setup compiled (blocks, then the whole model):
#              device time per kernel class
#   peers:     bench/bench_gpt_peers.py --compile, dfa setups against torch, FSDP2, DDP, ZeRO-1
#              (1.3B; ~40 s a setup on an H200)
#   peers-ga:  the same with --openai-gelu and 4 micro-batches per step (global batch 32)
#   peers-eager: the same without --compile, every setup (DDP and ZeRO-1 too)
#   gelu:      bench/bench_gelu.py (exact vs tanh GELU, fwd + bwd, compiled, 1.3B MLP shape)
#   mlp:       bench/bench_mlp.py (the 1.3B MLP unfused vs GELU in the GEMMs' epilogues)
#   heads:     bench/bench_heads_grad.py (the QKV gradient in one pass vs inductor's kernels)
#   layernorm: the fused LayerNorm's and RMSNorm's GPU tests, bench/bench_layer_norm.py (both
#              norms), and the 1.3B GA4 dfa iteration with and without --layernorm-fusion
#   llama7b:   examples/gpt/recipes/llama2-7b-1gpu.sh, on-device state and then OFFLOAD=1
#              (8 micro-batches a step, 6 iterations; peak memory and MFU in its log)
#   peers-7b:  bench/bench_gpt_peers.py --llama7b: the one-GPU memory modes side by side
#              (dfa-scaled, dfa-offload, FSDP2 with CPUOffloadPolicy, bf16 AdamW without
#              master, and the fp32-master setups that run out of memory)
#   old-vs-new: bench/old_vs_new.sh run "$OLD_TREE" (a tree made here with
#              `bash bench/old_vs_new.sh prepare REV DIR`, carried to the GPU machine):
#              bench_step and the GPT peers' dfa setups of both trees, alternating
#   sweep:     bench/sweep_launch.py (also as "prefetch"): the Adam kernels built with other
#              launch constants (threads, chunk size, loads ahead off/on), each variant's bits
#              checked against the default build and its time next to it
#
# Each stage prints its wall time; a failing stage does not stop the later ones.
set -u -o pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=${*:-build tests kernels memory gpt}
status=0

stage() {  # stage NAME CMD...: run, tee to $OUT/NAME.log, report time and exit code
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
}

gpt() {  # gpt TAG: a GPT-2-small-shaped model, bf16, one GPU
  torchrun --standalone --nproc-per-node 1 -m examples.gpt.train \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
    --micro-batch-size 16 --global-batch-size 64 --train-iters 60 --bf16 \
    --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 10 --clip-grad 1.0 --log-interval 10 \
    --eval-interval 60 --eval-iters 2 --no-progress \
    --data-dir "${GPT_DATA:-/tmp/mpzero-gpt-data}" --log-file "$OUT/gpt-$1.jsonl"
}

ckpt() {  # ckpt FORMAT: save at iteration 2, then resume for one more iteration
  local d=/tmp/mpzero-ckpt-$1 a
  rm -rf "$d"
  a=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
     --micro-batch-size 4 --global-batch-size 4 --bf16 --lr 1e-4 --log-interval 1
     --eval-interval 1000 --eval-iters 1 --no-progress --ckpt-format "$1"
     --data-dir "${GPT_DATA:-/tmp/mpzero-gpt-data}")
  torchrun --standalone --nproc-per-node 1 -m examples.gpt.train "${a[@]}" \
    --train-iters 2 --save "$d" --save-interval 2
  echo "checkpoint size ($1): $(du -sb "$d/iter_0000002" | cut -f1) bytes"
  torchrun --standalone --nproc-per-node 1 -m examples.gpt.train "${a[@]}" \
    --train-iters 3 --load "$d"
  rm -rf "$d"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv \
  | tee "$OUT/nvidia-smi.txt"
for s in $stages; do
  case $s in
    build) MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0 MPZERO_BUILD_CUDA=1 \
             stage build python3 -m pip install --no-build-isolation --no-deps -e . ;;
    tests) stage tests python3 -m pytest -q tests/gpu tests/tensor_parallel/test_tp_cuda.py \
             --timeout 300 -rs -p no:cacheprovider --junitxml "$OUT/tests.xml" ;;
    kernels) stage kernels python3 bench/bench_adam_kernel.py --repeat 3 --placements 6 \
               --json "$OUT/bench_adam_kernel.json" ;;
    memory) stage memory python3 bench/bench_memory.py --bf16 --json "$OUT/bench_memory.json" ;;
    gpt) stage gpt-dfa gpt dfa ;;  # the adamw baseline: the peers stage (bench/dp_adamw.py)
    step) stage step python3 bench/bench_step.py --json "$OUT/bench_step.json" ;;
    ckpt) stage ckpt-torch_dist ckpt torch_dist
          stage ckpt-torch ckpt torch ;;
    recompute) stage recompute python3 bench/bench_options.py --micro-batch 8 \
                 --warmup 2 --iters 5 --variants default selective full ;;
    profile) stage profile-block python3 bench/profile_gpt.py --setup dfa --compile \
               --compile-mode block --warmup 3 --profile-iters 3
             stage profile-model python3 bench/profile_gpt.py --setup dfa --compile \
               --compile-mode model --warmup 3 --profile-iters 3 ;;
    peers) stage peers python3 bench/bench_gpt_peers.py --compile \
             --setups dfa,dfa-remainders,adamw,torch,fsdp2,ddp,zero1 --warmup 5 --iters 12 \
             --json "$OUT/peers_compiled.json" ;;
    peers-ga) stage peers-ga python3 bench/bench_gpt_peers.py --compile --openai-gelu \
             --grad-acc 4 --setups dfa,torch,ddp,zero1,fsdp2,dfa-remainders --warmup 3 \
             --iters 5 --json "$OUT/peers_ga4_tanh.json" ;;
    peers-eager) stage peers-eager python3 bench/bench_gpt_peers.py \
                   --setups torch,ddp,zero1,fsdp2,dfa,dfa-remainders,adamw --warmup 3 --iters 12 \
                   --json "$OUT/peers_eager.json" ;;
    gelu) stage gelu python3 bench/bench_gelu.py ;;
    mlp) stage mlp python3 bench/bench_mlp.py --iters 30 ;;
    heads) stage heads python3 bench/bench_heads_grad.py --iters 30 ;;
    sweep|prefetch) stage sweep python3 bench/sweep_launch.py --threads 256,512 \
                      --chunks 8192,16384,32768,65536 --prefetch 0,1 --reps 25 --rounds 3 \
                      --build-dir "${SWEEP_BUILD:-/tmp/mpzero-sweep-build}" \
                      --json "$OUT/sweep_launch.json" ;;
    layernorm) stage layernorm-tests python3 -m pytest -q tests/gpu/test_layer_norm_cuda.py \
                 --timeout 120 -p no:cacheprovider
               stage layernorm python3 bench/bench_layer_norm.py --iters 30
               stage rmsnorm python3 bench/bench_layer_norm.py --iters 30 --rms
               for ln in --layernorm-fusion --no-layernorm-fusion; do
                 stage "peers$ln" python3 bench/bench_gpt_peers.py --compile --openai-gelu \
                   --grad-acc 4 --setups dfa --warmup 3 --iters 5 $ln \
                   --json "$OUT/peers$ln.json"
               done ;;
    llama7b) GLOBAL_BATCH=8 ITERS=6 stage llama7b bash examples/gpt/recipes/llama2-7b-1gpu.sh \
               --log-file "$OUT/llama7b.jsonl"
             OFFLOAD=1 GLOBAL_BATCH=8 ITERS=6 stage llama7b-offload \
               bash examples/gpt/recipes/llama2-7b-1gpu.sh --log-file "$OUT/llama7b-offload.jsonl" ;;
    peers-7b) stage peers-7b python3 bench/bench_gpt_peers.py --llama7b --compile --grad-acc 8 \
                --setups dfa-scaled,dfa-offload,fsdp2-offload,torch-bf16,dfa-remainders,torch \
                --warmup 2 --iters 4 --json "$OUT/peers_7b.json" ;;
    old-vs-new) stage old-vs-new env OUT="$OUT/old-vs-new" bash bench/old_vs_new.sh run \
                  "${OLD_TREE:?set OLD_TREE to a tree from bench/old_vs_new.sh prepare}" ;;
    *) echo "unknown stage $s"; status=1 ;;
  esac
done
exit $status
