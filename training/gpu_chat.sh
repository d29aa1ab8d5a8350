#!/usr/bin/env bash
# Stage 7 of the small default model (training/NOTES.md): the chat continuation. Starts from the
# shipped tree (streamrt/assets/default_model: BF16 dense, NVFP4 experts decoded) and mixes the
# chat corpus (training/corpus_chat.py) with the earlier data, so the model keeps what it knew.
#
# Run from the repository root (no install, no network):
#     bash training/gpu_chat.sh [MINUTES]        (MINUTES: training wall budget, default 7.3)
# Writes: "$OUT/state.pt" (fp32 model state; also every 1.5 min while training), "$OUT/train_log.txt",
#         "$OUT/train_info.json". Export / install / evaluate happen afterwards (NOTES.md).
#
# Local smoke test (CPU): DEVICE=cpu THREADS=2 BATCH_TOKENS=4096 OUT=/tmp/s7 bash training/gpu_chat.sh 1
set -euo pipefail

cd "$(dirname "$0")/.."
MINUTES="${1:-7.3}"
OUT="${OUT:-out/stage7}"
DEVICE="${DEVICE:-cuda}"
THREADS="${THREADS:-4}"
BATCH_TOKENS="${BATCH_TOKENS:-32768}"
PY="$(command -v python || command -v python3)"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/stage7.XXXXXX")"  # ckpt.pt (model + optimiser) lands here, not in $OUT
trap 'rm -rf "$WORK"' EXIT

{
  "$PY" -c 'import torch; c = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", c, torch.cuda.get_device_name(0) if c else "")'
  echo "init: streamrt/assets/default_model, minutes $MINUTES, device $DEVICE, batch tokens $BATCH_TOKENS"
} 2>&1 | tee "$OUT/train_log.txt"

"$PY" training/train_small.py --out "$WORK" --init-state streamrt/assets/default_model --no-export \
  --state-out "$OUT/state.pt" --ckpt-minutes 1.5 \
  --minutes "$MINUTES" --device "$DEVICE" --threads "$THREADS" --batch-tokens "$BATCH_TOKENS" \
  --lr 1e-3 --warmup-frac 0.15 --qat-frac 0.3 \
  --chat-frac 0.7 --client-view 0.3 --p-system 0.6 \
  --p-long 0.5 --synth-frac 0.3 --tool-random-frac 0.4 --copy-frac 0.3 --copy-numbers 0.3 \
  --answer-weight 5 --answer-scope values --probe 24 --log-every 10 --seed 0 \
  2>&1 | tee -a "$OUT/train_log.txt"

cp "$WORK/train_info.json" "$OUT/train_info.json"
ls -l "$OUT"
