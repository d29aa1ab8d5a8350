"""`GET /metrics`: Prometheus text from one registry per server.

Server counters (requests by endpoint and status, prompt / completion tokens, decode steps,
rows per step, time to first token) are kept here; queue depth, batch size and the
runtime's expert traffic (bytes over the link, device / host hits and misses) are read live
from the engine and `RuntimeStats` at scrape time, so they can never drift from the source.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("streamrt_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("streamrt_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.completion_tokens = Counter("streamrt_completion_tokens", "tokens generated", registry=r)
        self.decode_steps = Counter("streamrt_decode_steps", "batched decode steps", registry=r)
        self.rows_per_step = Histogram("streamrt_decode_batch_rows", "rows in each decode step", registry=r,
                                       buckets=BATCH_BUCKETS)
        self.ttft = Histogram("streamrt_time_to_first_token_seconds", "submit to first token (queue + prefill)",
                              registry=r)
        self.cached_tokens = Counter("streamrt_prompt_cached_tokens", "prompt tokens resumed from the prefix cache "
                                     "(not prefilled)", registry=r)
        self.prefill_s = Counter("streamrt_prefill_seconds", "time spent in prefills", registry=r)
        self.prefix_followers = Counter("streamrt_prefix_followers", "requests that waited in the queue for a "
                                        "prefill ahead of them to leave the prefix they share", registry=r)
        self.tool_choice_unmet = Counter("streamrt_tool_choice_unmet",
                                         "replies without the call tool_choice required", registry=r)

    def attach(self, engine, stats, cpu_experts=None) -> None:
        """Live gauges of the engine (queue, batch), the runtime's counters, and the CPU expert
        kernel's (`--cpu-experts`: a `CpuExpertCounts`, None when off)."""
        self.registry.register(_LiveCollector(engine, stats, cpu_experts))

    # engine hooks
    def prefill(self, prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.prefill_s.inc(seconds)

    def cached(self, tokens: int) -> None:
        self.cached_tokens.inc(tokens)

    def follower(self) -> None:
        self.prefix_followers.inc()

    def first_token(self, since_submit: float) -> None:
        self.ttft.observe(since_submit)

    def step(self, rows: int) -> None:
        self.decode_steps.inc()
        self.rows_per_step.observe(rows)

    def tokens(self, n: int) -> None:
        self.completion_tokens.inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    def __init__(self, engine, stats, cpu_experts=None) -> None:
        self.engine, self.stats, self.cpu = engine, stats, cpu_experts

    def collect(self):
        e, st = self.engine, self.stats
        yield GaugeMetricFamily("streamrt_queue_depth", "requests waiting for a batch row", value=e.queue_depth)
        yield GaugeMetricFamily("streamrt_batch_size", "rows in the running decode batch", value=e.batch_size)
        yield CounterMetricFamily("streamrt_expert_bytes_h2d", "expert bytes copied host -> device",
                                  value=st.bytes_h2d)
        yield CounterMetricFamily("streamrt_expert_bytes_read", "expert file bytes newly mapped or read",
                                  value=st.bytes_read)
        pc = getattr(e, "prefix", None)
        if pc is not None:
            yield GaugeMetricFamily("streamrt_prefix_cache_bytes", "prefix-cache snapshot bytes held", value=pc.nbytes)
            yield GaugeMetricFamily("streamrt_prefix_cache_snapshots", "prefix-cache snapshots held", value=len(pc))
            yield CounterMetricFamily("streamrt_prefix_cache_hits", "requests resumed from a snapshot",
                                      value=pc.stats.hits)
            yield CounterMetricFamily("streamrt_prefix_cache_evictions", "snapshots evicted (LRU)",
                                      value=pc.stats.evicted)
        for tier in ("device", "host"):
            hits, misses = getattr(st, f"{tier}_hits"), getattr(st, f"{tier}_misses")
            yield CounterMetricFamily(f"streamrt_{tier}_hits", f"{tier}-tier expert hits", value=hits)
            yield CounterMetricFamily(f"streamrt_{tier}_misses", f"{tier}-tier expert misses", value=misses)
            yield GaugeMetricFamily(f"streamrt_{tier}_hit_rate", f"{tier}-tier hit rate since start",
                                    value=hits / (hits + misses) if hits + misses else 0.0)
        if self.cpu is not None:
            yield CounterMetricFamily("streamrt_cpu_experts", "routed experts computed by the host CPU kernel",
                                      value=self.cpu.experts)
            yield CounterMetricFamily("streamrt_cpu_expert_rows", "rows of the CPU-computed experts",
                                      value=self.cpu.rows)
            yield CounterMetricFamily("streamrt_cpu_expert_seconds", "wall time inside the CPU expert kernel",
                                      value=self.cpu.seconds)
