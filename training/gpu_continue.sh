#!/usr/bin/env bash
# Stage 6 of the small default model (training/NOTES.md): a continuation run that
# teaches the final weather answer to copy the tool result (temperature digits, condition).
#
# Run from the repository root on the device machine (no install, no network):
#     PYTHONPATH=. bash training/gpu_continue.sh [MINUTES]        (MINUTES: training wall budget, default 5)
# Reads:  .carry/init_state.pt  (the stage-5 state, /tmp/cpu7/ckpt.pt; git-ignored via .git/info/exclude,
#         so the device call must carry ".carry")
# Writes: "$OUT/state.pt" (final fp32 model state), "$OUT/train_log.txt", "$OUT/train_info.json"; nothing else.
# Export / install / evaluate happen locally afterwards (`train_small.py --from-state`, see NOTES.md).
#
# Local smoke test (CPU): DEVICE=cpu THREADS=1 BATCH_TOKENS=4096 OUT=/tmp/s6 bash training/gpu_continue.sh 1
set -euo pipefail

cd "$(dirname "$0")/.."
MINUTES="${1:-5}"
OUT="${OUT:-out/stage6}"
DEVICE="${DEVICE:-cuda}"
THREADS="${THREADS:-4}"
BATCH_TOKENS="${BATCH_TOKENS:-32768}"
INIT=".carry/init_state.pt"
PY="$(command -v python || command -v python3)"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

[ -f "$INIT" ] || { echo "missing $INIT (copy /tmp/cpu7/ckpt.pt there and carry .carry)" >&2; exit 2; }
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/stage6.XXXXXX")"  # ckpt.pt (model + optimiser) lands here, not in $OUT
trap 'rm -rf "$WORK"' EXIT

{
  "$PY" -c 'import torch; c = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", c, torch.cuda.get_device_name(0) if c else "")'
  echo "init state: $INIT ($(sha256sum "$INIT" | cut -c1-16)), minutes $MINUTES, device $DEVICE, batch tokens $BATCH_TOKENS"
} 2>&1 | tee "$OUT/train_log.txt"

"$PY" training/train_small.py --out "$WORK" --init-state "$INIT" --no-export --state-out "$OUT/state.pt" \
  --minutes "$MINUTES" --device "$DEVICE" --threads "$THREADS" --batch-tokens "$BATCH_TOKENS" \
  --lr 1e-3 --warmup-frac 0.2 --qat-frac 0.3 \
  --p-long 0.5 --synth-frac 0.3 --tool-random-frac 0.4 --copy-frac 0.3 --copy-numbers 0.3 \
  --answer-weight 5 --answer-scope values --probe 24 --log-every 10 --seed 0 \
  2>&1 | tee -a "$OUT/train_log.txt"

cp "$WORK/train_info.json" "$OUT/train_info.json"
ls -l "$OUT"
