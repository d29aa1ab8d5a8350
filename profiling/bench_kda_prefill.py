"""KDA's chunked prefill form alone: wall time and op count against the sub-chunk group size.

    python profiling/bench_kda_prefill.py --device cuda --heads 8,96 --tokens 4096,32768
    python profiling/bench_kda_prefill.py --baseline /tmp/kda_before.py   # + an older kda.py, side by side

Random q, k, v, g, beta of the deep (8 heads) and real (96 heads) KDA width, K = V = 128,
one sequence; `kda_chunked` timed (synchronised, best of --reps) with every --groups value,
the model's default group first. Ops are the aten calls one run dispatches (torch.profiler),
the host cost that a long loop of small ops adds. --baseline FILE times the `kda_chunked` of
another kda.py (e.g. `git show REV:streamrt/model/kda.py > FILE`) on the same inputs and
prints the largest relative difference of its outputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from streamrt.model.kda import chunks_per_group, kda_chunked


def inputs(T: int, H: int, K: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(r(1, T, H, K), dim=-1) * K**-0.5
    k = torch.nn.functional.normalize(r(1, T, H, K), dim=-1)
    v, g, beta, S0 = r(1, T, H, K), -5.0 * torch.sigmoid(r(1, T, H, K)), torch.sigmoid(r(1, T, H)), 0.1 * r(1, H, K, K)
    return [t.to(device) for t in (q, k, v, g, beta, S0)]


def timed(fn, args, reps: int, device: str) -> tuple[float, tuple]:
    best, out = float("inf"), None
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def op_count(fn, args) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn(*args)
    return sum(e.count for e in p.key_averages() if e.key.startswith("aten::"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--heads", default="8,96", help="comma-separated KDA head counts")
    ap.add_argument("--tokens", default="4096", help="comma-separated sequence lengths")
    ap.add_argument("--groups", default="1,4,16", help="comma-separated sub-chunk group sizes beside the default")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline", help="another kda.py whose kda_chunked is timed beside")
    args = ap.parse_args()
    base = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("kda_baseline", args.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(
        f"# bench_kda_prefill: {dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print("| heads | tokens | form | group | ms | aten ops | vs default | max rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    K = 128
    for H in (int(x) for x in args.heads.split(",")):
        for T in (int(x) for x in args.tokens.split(",")):
            x = inputs(T, H, K, args.device)
            default = chunks_per_group(H, K, device=torch.device(args.device).type)
            groups = [default] + [int(g) for g in args.groups.split(",") if int(g) != default]
            rows = [("grouped", g, lambda *a, g=g: kda_chunked(*a, group=g)) for g in groups]
            if base is not None:
                rows.append(("baseline", "-", base.kda_chunked))
            ref_ms, ref_out = None, None
            for form, g, fn in rows:
                fn(*x)  # warm-up: kernels, allocator
                ms, out = timed(fn, x, args.reps, args.device)
                ms *= 1e3
                ops = op_count(fn, x)
                if ref_ms is None:
                    ref_ms, ref_out = ms, out
                diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(out, ref_out))
                print(f"| {H} | {T} | {form} | {g} | {ms:.1f} | {ops} | {ms / ref_ms:.2f}x | {diff:.1e} |", flush=True)
            del x


if __name__ == "__main__":
    main()
