#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the device machine (H200, no network, repo not
# installed). Logs go to $OUT; the tables at the end are what profiling/RESULTS.md quotes.
#   bash profiling/device_session.sh [stages...]
#   stages: tests kernels variants access profile decode trace sweep convert kda mla
#           slice graphs-slice deep graphs-deep profile-deep serve dense parts prefill experts drop-slice
#           fanout (synthesise fanout-k3.1-pro, ~50 GB, then bench_stationary_prefill on it)
#           prefix-conv prefix-fanout (bench_prefix_cache.py on deep)
#           (slice / deep: synthesise slice-k3.1-pro, ~30 s, / deep-k3.1-pro, ~2 min; serve 1/4/16
#           clients, dense streaming and prefill run on whichever of the two is present; the disk
#           holds one of them beside the other only just, so `drop-slice` removes the slice tree)
#   env: T_<STAGE> timeouts, DECODE_ARGS, CONVERT_ARGS, PROFILE_BACKENDS, TRACE_SLOTS, TRACE_BACKEND,
#        KDA_BASELINE (an older kda.py for bench_kda_prefill), MLA_BASELINE (an older torch_backend.py
#        for bench_mla_prefill), DEEP_LENGTHS, DEEP_SLOTS, SLICE_LENGTHS,
#        SLICE_SLOTS (bench_prefill rows)
#   wheels: the image lacks pydantic (which `python -m streamrt` needs) and the serve packages;
#   `bash profiling/device_wheels.sh` here puts them in .whl/, and a call that carries .whl
#   installs them below
set -uo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # the tree first, the wheels after it
python3 -c 'import pydantic' 2>/dev/null || echo "device_session: no pydantic: run profiling/device_wheels.sh and carry .whl"
OUT=${OUT:-/tmp/streamrt-out}; mkdir -p "$OUT"
L=/tmp/streamrt-logs; mkdir -p "$L"   # full logs stay on the machine; the device returns only a few files
exec > >(tee -a "$OUT/session.log") 2>&1
W=${STREAMRT_BENCH_DIR:-/tmp/streamrt-bench}; TREE=${STREAMRT_TREE:-$W/slice-k3.1-pro}
STAGES=${*:-tests kernels decode trace sweep}
stage() { echo; echo "=== $1 $(date -u +%T)"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

stage env
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
git rev-parse --short HEAD 2>/dev/null || true

if has tests; then
  stage "gpu tests"
  timeout ${T_TESTS:-120} python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$L/gpu_tests.log" | tail -15
fi
if has kernels; then
  stage "bench kernels"
  timeout ${T_KERNELS:-60} python3 profiling/bench_kernels.py --torch --markdown "$L/bench_kernels.md" 2>&1 | tee "$L/bench_kernels.log" | tail -40
fi
if has variants; then
  stage "bench kernels: the expert FFN without programmatic launch, and where its time goes"
  timeout ${T_VARIANTS:-150} python3 profiling/bench_kernels.py --variants --markdown "$L/bench_variants.md" 2>&1 | tee "$L/bench_variants.log" | tail -45
fi
if has access; then
  stage "bench access patterns"
  timeout ${T_ACCESS:-90} python3 profiling/bench_access.py 2>&1 | tee "$L/bench_access.log" | tail -25
fi
if has profile; then
  stage "profile one decode step (slice, all experts resident)"
  for b in ${PROFILE_BACKENDS:-nvrtc torch}; do
    timeout ${T_PROFILE:-120} python3 profiling/profile_step.py --workdir "$W" --backend $b --steps 4 2>&1 | grep -v USDT | tee "$L/profile_$b.log" | head -70
  done
fi
if has decode; then
  stage "bench decode (slice)"
  timeout ${T_DECODE:-180} python3 profiling/bench_decode.py --workdir "$W" --nvrtc ${DECODE_ARGS:-} 2>&1 | tee "$L/bench_decode.log" | tail -45
fi
if has trace; then
  stage "trace (slice, small device tier)"
  timeout ${T_TRACE:-50} python3 -m streamrt run --model "$TREE" --prompt "What's the weather in Paris?" --greedy --max-new-tokens 6 \
    --gpu-experts ${TRACE_SLOTS:-32} --backend ${TRACE_BACKEND:-nvrtc} --trace "$OUT/trace_slice.json" --stats-json "$L/trace_stats.json" > "$L/trace_run.log" 2>&1
  tail -2 "$L/trace_run.log"; cat "$L/trace_stats.json"; echo
  python3 -m streamrt trace summarize "$OUT/trace_slice.json" 2>&1 | tee "$L/trace_summary.txt" | head -16
  python3 profiling/trace_overlap.py "$OUT/trace_slice.json" 2>&1 | tee "$L/trace_overlap.txt" | tail -10
fi
if has sweep; then
  stage "sweep (slice)"
  timeout ${T_SWEEP:-140} python3 -m streamrt sweep --model "$TREE" --groups ${SWEEP_GROUPS:-window,copies} --tokens 4 --out "$L/sweep" 2>&1 \
    | tee "$L/sweep.log" | tail -24
  cp "$L/sweep/sweep.csv" "$L/sweep/sweep.png" "$OUT/" 2>/dev/null
fi
DEEP=$W/deep-k3.1-pro
if has slice; then
  stage "synthesise slice-k3.1-pro (streamrt format)"
  (cd profiling && python3 -c "import sys; from pathlib import Path; from bench_decode import ensure_tree; ensure_tree(Path(sys.argv[1]), 'slice-k3.1-pro')" "$W") 2>&1 | tail -1
fi
if has graphs-slice; then
  stage "bench CUDA-graph decode (slice: graphs vs op by op vs torch, B 1/4/16, a third streaming)"
  [ -f "$TREE/manifest.json" ] && timeout ${T_GRAPHS_SLICE:-240} python3 profiling/bench_graphs.py --workdir "$W" --config slice-k3.1-pro \
    --torch --json "$OUT/graphs_slice.json" 2>&1 | grep -v USDT | tee "$L/graphs_slice.log" | tail -30
fi
if has deep; then
  stage "synthesise deep-k3.1-pro (streamrt format)"
  [ -f "$DEEP/manifest.json" ] || python3 -m streamrt synth --config deep-k3.1-pro --format streamrt --out "$DEEP" 2>&1 | tail -1
fi
if has graphs-deep; then
  stage "bench CUDA-graph decode (deep: graphs vs op by op, B 1/4/16, a third streaming)"
  [ -f "$DEEP/manifest.json" ] && timeout ${T_GRAPHS_DEEP:-420} python3 profiling/bench_graphs.py --workdir "$W" --config deep-k3.1-pro \
    --tokens 16 --repeats 2 --stream-repeats 3 --json "$OUT/graphs_deep.json" 2>&1 | grep -v USDT | tee "$L/graphs_deep.log" | tail -30
fi
if has profile-deep; then
  stage "profile a deep decode step: op by op (cProfile: the host's functions), then streamed segment graphs"
  [ -f "$DEEP/manifest.json" ] && timeout ${T_PROFILE_DEEP:-150} python3 profiling/profile_step.py --workdir "$W" --config deep-k3.1-pro \
    --backend nvrtc --cuda-graphs off --steps 3 2>&1 | grep -v USDT | tee "$L/profile_deep_off.log" | tail -60
  [ -f "$DEEP/manifest.json" ] && timeout ${T_PROFILE_DEEP:-150} python3 profiling/profile_step.py --workdir "$W" --config deep-k3.1-pro \
    --backend nvrtc --cuda-graphs auto --gpu-experts 736 --steps 3 2>&1 | grep -v USDT | tee "$L/profile_deep_streamed.log" | tail -60
fi
if has serve; then  # needs the fastapi / uvicorn / pydantic / opentelemetry-api wheels on PYTHONPATH
  stage "bench serve (deep, a third of the experts in slots; slice)"
  [ -f "$DEEP/manifest.json" ] && timeout ${T_SERVE:-330} python3 profiling/bench_serve.py --model "$DEEP" --backend nvrtc \
    --gpu-experts 736 --clients 1,4,16 --max-tokens 32 --json "$OUT/serve_deep.json" 2>&1 | tee "$L/serve_deep.log" | tail -8
  [ -f "$TREE/manifest.json" ] && timeout ${T_SERVE_SLICE:-200} python3 profiling/bench_serve.py --model "$TREE" --backend nvrtc \
    --gpu-experts 341 --clients 1,4,16 --max-tokens 32 --json "$OUT/serve_slice.json" 2>&1 | tee "$L/serve_slice.log" | tail -8
fi
if has prefix-conv; then
  stage "bench prefix cache: a three-turn conversation, 16k-token first turn (deep, a third in slots)"
  [ -f "$DEEP/manifest.json" ] && timeout ${T_PREFIX_CONV:-420} python3 profiling/bench_prefix_cache.py --model "$DEEP" \
    --part conversation --first 16384 --reply 64 --new 512 --prefill-chunk 4096 --device cuda --backend nvrtc \
    --gpu-experts 736 --json "$OUT/prefix_conv_deep.json" 2>&1 | grep -v USDT | tee "$L/prefix_conv_deep.log" | tail -12
fi
if has prefix-fanout; then  # needs the serve wheels, as `serve`
  stage "bench prefix cache: 16 clients sharing a 4k system prompt, cache on and off (deep, a third in slots)"
  [ -f "$DEEP/manifest.json" ] && timeout ${T_PREFIX_FANOUT:-450} python3 profiling/bench_prefix_cache.py --model "$DEEP" \
    --part fanout --system 4096 --suffix 64 --clients 16 --max-tokens 16 --prefill-chunk 1024 --backend nvrtc \
    --gpu-experts 736 --json "$OUT/prefix_fanout_deep.json" 2>&1 | grep -v USDT | tee "$L/prefix_fanout_deep.log" | tail -8
fi
if has dense; then
  stage "bench dense streaming (deep; slice)"
  for c in deep-k3.1-pro slice-k3.1-pro; do
    [ -f "$W/$c/manifest.json" ] && timeout ${T_DENSE:-200} python3 profiling/bench_dense_stream.py --config $c --workdir "$W" 2>&1 \
      | tee "$L/dense_$c.log" | tail -14
  done
fi
if has kda; then
  stage "bench KDA chunked prefill form (deep and real head counts)"
  timeout ${T_KDA:-120} python3 profiling/bench_kda_prefill.py --device cuda --heads 8,96 --tokens 4096,32768 --reps 2 \
    ${KDA_BASELINE:+--baseline "$KDA_BASELINE"} 2>&1 | grep -v USDT | tee "$L/bench_kda.log"
fi
if has mla; then
  stage "bench MLA prefill attention with the indexer (deep and real head counts)"
  timeout ${T_MLA:-150} python3 profiling/bench_mla_prefill.py --device cuda --heads 8,96 --context ${MLA_CONTEXT:-8192,32768,131072} \
    ${MLA_BASELINE:+--baseline "$MLA_BASELINE"} 2>&1 | tee "$L/bench_mla.log"
fi
if has parts; then
  stage "profile one 4k prefill by model part (deep, all experts resident)"
  [ -f "$DEEP/manifest.json" ] && timeout ${T_PARTS:-150} python3 profiling/profile_step.py --workdir "$W" --config deep-k3.1-pro \
    --backend nvrtc --prefill ${PARTS_TOKENS:-4096} --no-cprofile --json "$OUT/prefill_parts.json" 2>&1 | grep -v USDT | tee "$L/parts.log" | tail -40
fi
if has prefill; then
  stage "bench prefill (deep and slice: a third of the slots and all)"
  for g in ${DEEP_SLOTS:-736 2208}; do
    [ -f "$DEEP/manifest.json" ] && timeout ${T_PREFILL:-300} python3 profiling/bench_prefill.py --model "$DEEP" --lengths ${DEEP_LENGTHS:-512,4096,32768} \
      --device cuda --backend nvrtc --gpu-experts $g --warmup ${PREFILL_WARMUP:-512} --no-refusal --json "$OUT/prefill_deep_$g.json" 2>&1 | tail -6
  done
  for g in ${SLICE_SLOTS:-341 1024}; do
    [ -f "$TREE/manifest.json" ] && timeout ${T_PREFILL_SLICE:-400} python3 profiling/bench_prefill.py --model "$TREE" --lengths ${SLICE_LENGTHS:-512,4096,32768,131072} \
      --device cuda --backend nvrtc --gpu-experts $g --warmup ${PREFILL_WARMUP:-512} --no-refusal --json "$OUT/prefill_slice_$g.json" 2>&1 | tail -7
  done
fi
if has experts; then
  stage "bench grouped prefill expert GEMM"
  timeout ${T_EXPERTS:-60} python3 profiling/bench_prefill_experts.py --tokens 512,4096 2>&1 | tail -6
fi
if has fanout; then  # the real fan-out, ~50 GB on disk: the 64 GiB disk holds it beside no other big tree (rm deep first)
  stage "synthesise fanout-k3.1-pro (896 experts x 3 MoE layers, even router popularity)"
  (cd profiling && timeout ${T_FANOUT_SYNTH:-470} python3 -c "import sys; from pathlib import Path; from bench_stationary_prefill import ensure_tree; ensure_tree(Path(sys.argv[1]), 'fanout-k3.1-pro', 0.0)" "$W") 2>&1 | tail -2
  FAN=$W/fanout-k3.1-pro-skew0
  stage "bench stationary prefill (fanout: 512 and 4k tokens, chunk 512; 32k, chunk 4096)"
  [ -f "$FAN/manifest.json" ] && timeout ${T_FANOUT:-470} python3 profiling/bench_stationary_prefill.py --tree "$FAN" \
    --backend ${FANOUT_BACKEND:-nvrtc} --lengths 512,4096 --prefill-chunk 512 --json "$OUT/stationary_fanout.json" 2>&1 | tail -14
  [ -f "$FAN/manifest.json" ] && timeout ${T_FANOUT:-470} python3 profiling/bench_stationary_prefill.py --tree "$FAN" \
    --backend ${FANOUT_BACKEND:-nvrtc} --lengths 32768 --prefill-chunk 4096 --json "$OUT/stationary_fanout_32k.json" 2>&1 | tail -8
fi
if has drop-slice; then
  rm -rf "$TREE"
fi
if has convert; then
  stage "bench convert (slice)"
  rm -rf "$TREE"  # disk: the release tree and its conversion need the room
  python3 profiling/bench_convert.py --workdir "$W/convert" ${CONVERT_ARGS:-} 2>&1 | tee "$L/bench_convert.log" | tail -30
fi
stage done
