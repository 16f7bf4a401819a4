#!/usr/bin/env bash
# The Llama-2-7B shape (6.74B parameters: 32 layers, hidden 4096, 32 heads, SwiGLU 11008,
# RMSNorm, RoPE, vocabulary 32000, untied output layer, sequence 4096) trained on ONE
# 80 GB GPU with exact fp32-master Adam updates:
#
#   bf16 parameters (2 B) + bf16 gradients (2 B) + int16 master remainders (2 B)
#   + bf16 Adam moments with one fp32 scale per tensor piece (2 + 2 B) = 10 B a parameter,
#   67 GB of model and optimizer state; full activation recompute keeps the rest small.
#
# OFFLOAD=1 keeps the remainders and moments in pinned host memory and runs the update on
# the CPU (--optimizer-cpu-offload): 4 B a parameter on the GPU.
#
#   bash examples/gpt/recipes/llama2-7b-1gpu.sh [more train.py flags]
#
# Environment: DATA_DIR (a prepared data directory; default: the Python standard library
# tokenized with a 32000-token BPE, prepared on first use), GLOBAL_BATCH (sequences per
# step, micro-batch 1: the gradient-accumulation steps; default 16), ITERS (default 100),
# RECOMPUTE_LAYERS (full recompute of the first N blocks only; default all 32).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DATA_DIR=${DATA_DIR:-/tmp/mpzero-llama-data}
if [ ! -f "$DATA_DIR/meta.json" ]; then
  python -m examples.gpt.data --vocab-size 32000 --max-mb 16 --output "$DATA_DIR"
fi
extra=()
[ "${OFFLOAD:-0}" = 1 ] && extra+=(--optimizer-cpu-offload)
[ -n "${RECOMPUTE_LAYERS:-}" ] && extra+=(--recompute-num-layers "$RECOMPUTE_LAYERS")
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
exec torchrun --standalone --nproc-per-node 1 -m examples.gpt.train \
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \
  --seq-length 4096 --swiglu --normalization RMSNorm --position-embedding-type rope \
  --untie-embeddings-and-output-weights --disable-bias-linear \
  --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH:-16}" \
  --bf16 --store-param-remainders --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 \
  --grad-sync-dtype bf16 --no-gradient-accumulation-fusion \
  --recompute-granularity full --compile \
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 \
  --train-iters "${ITERS:-100}" --log-interval 1 --eval-interval 0 --eval-iters 1 \
  --data-dir "$DATA_DIR" --no-progress "${extra[@]}" "$@"
