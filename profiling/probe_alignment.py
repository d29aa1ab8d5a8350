"""Does an op's result depend on where its operands sit in memory (address modulo 64)?

    python profiling/probe_alignment.py [--threads 1 2] [--trials 20]
    python profiling/probe_alignment.py --run TREE [--processes 20]

For each op/shape/dtype, fresh random operands are placed at byte offsets 0, 4, 8, 16, 32 and
48 from a 64-byte boundary (the same values at every offset), the op runs, and the result's
bits are compared with the offset-0 result. A line per case: which offsets changed the bits
(and in how many of `--trials` random draws). torch's CPU allocator hands out 64-byte-aligned
storage, so only operands built over foreign buffers (numpy, bytes, mappings at odd offsets)
can land elsewhere; an op listed here as alignment-dependent must never see such an operand.

`--run TREE`: runs `streamrt run` (the determinism command, greedy, 8 tokens) on a converted tree
in `--processes` fresh processes, each under a dispatch mode (on every thread) that records,
for every aten op with a floating-point operand, each CPU tensor operand's address modulo 64
and its storage base's. Prints the ops whose operand alignment differed between processes
(the suspects) and every operand whose storage base is not 64-byte aligned (not torch's
allocator: a mapping, numpy, bytes), then the logits hashes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

OFFSETS = (0, 4, 8, 16, 32, 48)


def placed(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of contiguous t whose first element sits `offset` bytes past a 64-byte boundary."""
    es = t.element_size()
    if offset % es:
        raise ValueError(f"offset {offset} is not a multiple of {t.dtype}'s size")
    slab = torch.empty(t.numel() * es + 128, dtype=torch.uint8)
    start = (-slab.data_ptr()) % 64 + offset
    out = slab[start : start + t.numel() * es].view(t.dtype).view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 64 == offset
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def cases() -> list[tuple[str, callable, list]]:
    """(name, fn, operand shapes-and-dtypes). Shapes are the tiny model's and a wider one."""
    f32, bf16 = torch.float32, torch.bfloat16
    out = []
    for n, k, m in ((1, 64, 512), (1, 64, 128), (64, 64, 128), (1, 1024, 1024), (64, 1024, 1024), (7, 4099, 33)):
        out.append((f"mm f32 [{n},{k}]@[{k},{m}]", lambda a, b: a @ b, [((n, k), f32), ((k, m), f32)]))
        out.append((f"linear f32 [{n},{k}]x[{m},{k}]", F.linear, [((n, k), f32), ((m, k), f32)]))
        out.append((f"mm.T f32 [{n},{k}]@[{m},{k}].T", lambda a, b: a @ b.T, [((n, k), f32), ((m, k), f32)]))
        out.append((f"mm bf16 [{n},{k}]@[{k},{m}]", lambda a, b: a @ b, [((n, k), bf16), ((k, m), bf16)]))
        out.append((f"addmm f32 [{m}]+[{n},{k}]@[{k},{m}]", torch.addmm,
                    [((m,), f32), ((n, k), f32), ((k, m), f32)]))
    for m, k in ((128, 64), (512, 64), (1024, 1024), (33, 97), (64, 4099)):
        out.append((f"mv f32 [{m},{k}]x[{k}]", torch.mv, [((m, k), f32), ((k,), f32)]))
    for b, n, k, m in ((2, 1, 16, 32), (2, 64, 32, 16), (8, 16, 256, 64)):
        out.append((f"bmm f32 [{b},{n},{k}]@[{b},{k},{m}]", torch.bmm, [((b, n, k), f32), ((b, k, m), f32)]))
    for n, d in ((2, 37), (4, 64), (64, 1024), (3, 1027)):
        out.append((f"softmax f32 [{n},{d}]", lambda x: torch.softmax(x, -1), [((n, d), f32)]))
        out.append((f"layer_norm f32 [{n},{d}]", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
                    [((n, d), f32), ((d,), f32), ((d,), f32)]))
        out.append((f"sum f32 [{n},{d}]", lambda x: x.sum(-1), [((n, d), f32)]))
        out.append((f"mean sq f32 [{n},{d}]", lambda x: x.square().mean(-1), [((n, d), f32)]))
        out.append((f"sigmoid f32 [{n},{d}]", torch.sigmoid, [((n, d), f32)]))
        out.append((f"silu f32 [{n},{d}]", F.silu, [((n, d), f32)]))
        out.append((f"exp f32 [{n},{d}]", torch.exp, [((n, d), f32)]))
        out.append((f"tanh f32 [{n},{d}]", torch.tanh, [((n, d), f32)]))
        out.append((f"rsqrt f32 [{n},{d}]", lambda x: torch.rsqrt(x.abs() + 1e-3), [((n, d), f32)]))
        out.append((f"sum(-2) f32 [{n},{d}]", lambda x: x.sum(-2), [((n, d), f32)]))
        out.append((f"bf16->f32 [{n},{d}]", lambda x: x.float(), [((n, d), bf16)]))
    return out


def probe(trials: int, seed: int = 0) -> list[tuple[str, dict[int, int]]]:
    """Per case, {offset: trials whose bits differed from offset 0}."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name, fn, specs in cases():
        differ = {o: 0 for o in OFFSETS[1:]}
        for _ in range(trials):
            ops = [torch.randn(s, generator=gen).to(dt) for s, dt in specs]
            ref = _bits(fn(*[placed(t, 0) for t in ops]))
            for o in OFFSETS[1:]:
                # every operand shifted, then each alone (a kernel may peel on relative alignment)
                shifts = [[o] * len(ops)] + [[o if j == i else 0 for j in range(len(ops))] for i in range(len(ops))]
                if any(_bits(fn(*[placed(t, s) for t, s in zip(ops, sh)])) != ref for sh in shifts
                       if all(s % t.element_size() == 0 for t, s in zip(ops, sh))):
                    differ[o] += 1
        rows.append((name, differ))
    return rows


RUN_ARGS = ["run", "--prompt", "What's the weather in Paris?", "--greedy", "--max-new-tokens", "8", "--json",
            "--window", "65536", "--gpu-experts", "16"]


def _operand_mods(args) -> tuple[tuple[int, int], ...]:
    """(address % 64, storage base % 64) of each CPU tensor operand, in argument order."""
    flat = torch.utils._pytree.tree_leaves(args)
    return tuple((t.data_ptr() % 64, t.untyped_storage().data_ptr() % 64) for t in flat
                 if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel())


class OperandRecorder:
    """While entered, records every aten op with a floating-point operand, on every thread:
    the main thread's in order (`ops`: (op, operand mods)), other threads' as counts (`workers`)."""

    def __init__(self):
        self.ops: list = []
        self.workers: Counter = Counter()

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(isinstance(t, torch.Tensor) and t.is_floating_point()
                       for t in torch.utils._pytree.tree_leaves((args, kwargs))):
                    op = (str(func.overloadpacket), _operand_mods((args, kwargs)))
                    if threading.current_thread() is threading.main_thread():
                        rec.ops.append(op)
                    else:
                        rec.workers[repr(op)] += 1
                return func(*args, **(kwargs or {}))

        self._run, self._mode = threading.Thread.run, Record()

        def recorded_run(thread):  # worker threads (copies, mappings) record too
            with Record():
                rec._run(thread)

        threading.Thread.run = recorded_run
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        threading.Thread.run = self._run


def child(tree: str, out: str) -> None:
    """One recorded `streamrt run`."""
    from streamrt.cli.main import main as cli

    with OperandRecorder() as rec:
        rc = cli([*RUN_ARGS[:1], "--model", tree, *RUN_ARGS[1:]])
    Path(out).write_text(json.dumps({"rc": rc, "main": rec.ops, "workers": rec.workers}))


def compare_runs(tree: str, processes: int) -> None:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            out = Path(tmp) / f"{i}.json"
            res = subprocess.run([sys.executable, __file__, "--child", tree, str(out)], capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"process {i} failed:\n{res.stderr[-2000:]}")
            rec = json.loads(out.read_text())
            rec["hash"] = json.loads(res.stdout.strip().splitlines()[-1])["stats"]["logits_hash"]
            runs.append(rec)
    lengths = {len(r["main"]) for r in runs}
    print(f"{processes} processes; main-thread float ops per run: {sorted(lengths)}; "
          f"worker-thread float ops per run: {sorted({sum(r['workers'].values()) for r in runs})}")
    n = min(lengths)
    varying = [i for i in range(n) if len({json.dumps(r["main"][i]) for r in runs}) > 1]
    foreign = Counter((op, tuple(m)) for r in runs for op, mods in r["main"] for m in mods if m[1] % 64)
    print(f"ops whose operand alignment differs between processes: {len(varying)} of {n}")
    for i in varying[:20]:
        print(f"  #{i} {runs[0]['main'][i][0]}: {sorted({json.dumps(r['main'][i][1]) for r in runs})}")
    print(f"operands on storage not 64-byte aligned: {sum(foreign.values())}")
    for (op, m), c in foreign.most_common(20):
        print(f"  {op}: address % 64 = {m[0]}, storage base % 64 = {m[1]}  ({c}x)")
    mods = Counter(m[0] for r in runs for _, ms in r["main"] for m in ms)
    print(f"operand address % 64 over all main-thread operands: {dict(sorted(mods.items()))}")
    print(f"logits hashes: {dict(Counter(r['hash'] for r in runs))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--run", metavar="TREE", help="record operand alignment across fresh `streamrt run`s")
    ap.add_argument("--processes", type=int, default=20)
    ap.add_argument("--child", nargs=2, metavar=("TREE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    if args.run:
        return compare_runs(args.run, args.processes)
    cfg = torch.__config__.show()
    print(f"torch {torch.__version__}; mkldnn {torch.backends.mkldnn.is_available()}; "
          f"BLAS {'MKL' if 'USE_MKL=ON' in cfg else 'OpenBLAS' if 'OpenBLAS' in cfg else 'other'}; "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    for th in args.threads:
        torch.set_num_threads(th)
        print(f"\n## threads {th} (offsets {OFFSETS[1:]} vs 0, {args.trials} random draws each)")
        for name, differ in probe(args.trials):
            bad = {o: n for o, n in differ.items() if n}
            print(f"{'DEPENDS' if bad else 'same   '}  {name}" + (f"  differs at {bad}" if bad else ""))


if __name__ == "__main__":
    main()
