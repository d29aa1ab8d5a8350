"""Chrome-trace / Perfetto recorder for the decode step, and the tools that read its output.

Where every millisecond and every byte goes: spans on named tracks, counters, instants,
written as Chrome trace JSON (`{"traceEvents": [...]}`, microseconds) that opens in
Perfetto (ui.perfetto.dev) or chrome://tracing.

Recording (the runtime calls this)::

    tracer = Tracer() if args.trace else NullTracer()
    tracer.begin_step()
    with tracer.span("compute", "experts", stream=compute_stream, layer=l):
        ...
    with tracer.span("copy", "expert", stream=copy_stream, layer=l + 1, expert=e, bytes=n):
        copy_stream-side work
    tracer.instant("store", "evict", layer=l, expert=e)
    tracer.counter("bytes_in_flight", n)
    tracer.end_step()            # resolves GPU timestamps, closes the step span
    tracer.write("decode.json")  # atomic (temp file + rename)

Tracks and span names (the convention `summarize` and `overlap_fraction` read):

    track     what                                       name               args
    compute   compute stream, one span per layer and/or  "L{l}", op name    layer
              per op (nesting is fine)                   ("attn", "router",
                                                          "experts", ...)
    copy      one H2D transfer on the copy stream        "expert", "plane"  layer, expert, bytes
    host-io   host reads / maps / registers              "read", "map", ... layer, expert, bytes
    disk      pool tier: one file read from the drive    "read"             layer, expert, bytes,
              on a reader thread (Tracer.record)                            direct, guess
    stall     compute waiting on an event (on GPU: a     "wait"             layer, expert
              span around stream.wait_event, recorded
              on the compute stream)
    store     evictions, retirements, releases           "evict", "retire"  layer, expert
    asyncio   task wakeups of the scheduler              task name          anything
    step      owned by the tracer: one span per step     "step {n}"         step

Counters: `bytes_in_flight`, `device_slots_used`, `retire_fifo_depth` (any name works).

Timing. `stream=None`: host time (time.perf_counter). `stream=<torch.cuda.Stream>` on a
CUDA machine: two CUDA events (enable_timing=True) recorded on that stream, so the span
is the stream's execution, not the host's issue; they are resolved in `flush_step()`,
which `end_step()` calls. `flush_step` is the only place that synchronizes, and only a
real `Tracer` has one. Spans on one track that overlap without nesting (e.g. parallel
host reads) are laid out on extra lanes (Perfetto threads "host-io #1", ...) when written.

Tracing off is `NullTracer`: the same API, `enabled = False`, every method a no-op and
`span()` returns one shared no-op context manager. Hot paths that build costly args should
guard with `if tracer.enabled:`.

Each event carries `cat` = its track, so readers never parse names.

    recorder.py  `Tracer`, `NullTracer`, `make_tracer`
    chrome.py    the Chrome trace format: pids and lanes, write, load, check
    overlap.py   merged intervals; copy time hidden under the previous layer's compute
    summary.py   `streamrt trace summarize`: the per-layer table and the critical path
"""

from streamrt.trace.chrome import COUNTER_PID, TRACKS, check_trace, load_trace, to_chrome, write_trace
from streamrt.trace.overlap import overall_overlap, overlap_by_layer, overlap_fraction
from streamrt.trace.recorder import NullTracer, Tracer, make_tracer
from streamrt.trace.summary import critical_path, format_summary, layer_table, register

__all__ = [
    "COUNTER_PID", "TRACKS", "NullTracer", "Tracer", "check_trace", "critical_path", "format_summary",
    "layer_table", "load_trace", "make_tracer", "overall_overlap", "overlap_by_layer", "overlap_fraction",
    "register", "to_chrome", "write_trace",
]
