"""MLA's prefill attention on a cache alone (`Backend.mla_prefill` with the Lightning Indexer):
wall time against the context length, beside an older torch_backend.py.

    python profiling/bench_mla_prefill.py --device cuda --heads 8,96 --context 8192,32768,131072
    python profiling/bench_mla_prefill.py --baseline /tmp/torch_backend_before.py   # side by side

One chunk of --chunk queries at the end of a context of n positions, random inputs of K3.1
Pro's MLA shape (R 512, rope 64, nope / value 128, indexer 64 heads of 128, top-k 2048) at the
given head counts; the torch backend's prefill view, synchronised, best of --reps. --baseline
FILE: the `TorchBackend` of another torch_backend.py (e.g. `git show REV:streamrt/backends/
torch_backend.py > FILE`) on the same inputs, and the largest relative difference of outputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from streamrt.backends.torch_backend import TorchBackend


def inputs(H: int, n: int, T: int, device: str, topk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    R, dr, dn, dv, Hi, Di = 512, 64, 128, 128, 64, 128
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    q_nope, q_rot, w_uk, w_uv = dev(r(T, H, dn), r(T, H, dr), 0.05 * r(H, dn, R), 0.05 * r(H, dv, R))
    c, kr = dev(r(n, R).bfloat16(), r(n, dr).bfloat16())
    qi, wi, ki = dev(r(T, Hi, Di), r(T, Hi), r(n, Di).bfloat16())
    return (q_nope, q_rot, w_uk, w_uv, c, kr, n - T, (dn + dr) ** -0.5, (qi, wi, ki, topk))


def timed(be, args, reps: int, cuda: bool):
    best, out = float("inf"), None
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = be.mla_prefill(*args)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--heads", default="8,96", help="comma-separated MLA head counts")
    ap.add_argument("--context", default="8192,32768", help="comma-separated context lengths n")
    ap.add_argument("--chunk", type=int, default=4096, help="queries in the chunk (the last ones of the context)")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline", help="another torch_backend.py whose TorchBackend is timed beside")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    rows = [("current", TorchBackend().for_prefill())]
    if args.baseline:
        spec = importlib.util.spec_from_file_location("torch_backend_baseline", args.baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        rows.append(("baseline", mod.TorchBackend().for_prefill()))
    dev = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"# bench_mla_prefill: {dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"chunk {args.chunk}, top-k {args.topk}"
    )
    print("| heads | context | form | ms | vs current | max rel diff |")
    print("|---|---|---|---|---|---|")
    for H in (int(x) for x in args.heads.split(",")):
        for n in (int(x) for x in args.context.split(",")):
            x = inputs(H, n, min(args.chunk, n), args.device, args.topk)
            ref_ms, ref_out = None, None
            for form, be in rows:
                be.mla_prefill(*x)  # warm-up
                s, out = timed(be, x, args.reps, cuda)
                if ref_ms is None:
                    ref_ms, ref_out = s * 1e3, out
                diff = float((out - ref_out).abs().max() / ref_out.abs().max())
                print(f"| {H} | {n} | {form} | {s * 1e3:.1f} | {s * 1e3 / ref_ms:.2f}x | {diff:.1e} |", flush=True)
            del x


if __name__ == "__main__":
    main()
