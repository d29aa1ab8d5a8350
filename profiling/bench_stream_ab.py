"""The streaming decode row alone, on whichever streamrt is first on sys.path: an A/B of two codes.

    # the older code exported to .old (git archive <rev> | tar -x -C .old), this tree in .:
    (cd .old && PYTHONPATH=$PWD python3 ../profiling/bench_stream_ab.py old /tmp/streamrt-bench/deep-k3.1-pro 15)
    PYTHONPATH=$PWD python3 profiling/bench_stream_ab.py new /tmp/streamrt-bench/deep-k3.1-pro 15

NVRTC, bf16 dense, a third of the experts in device slots, the rest mapped in host RAM
(`warm_host`, checksums off: setup), B=1: an 8-token prompt, 3 untimed decode steps, then `steps`
timed; twice per process. Prints ms/token, H2D GB/token, the main thread's CPU ms/token and the
stall per token. Only APIs both codes have.
"""

import sys
import time
from pathlib import Path

import torch

from streamrt.backends.nvrtc import NvrtcBackend
from streamrt.checkpoint.reader import open_tree
from streamrt.loader import load_model
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.runtime.streams import make_device

tag, root, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
tree = open_tree(root)
cfg = tree.config
device = make_device("cuda")
model = load_model(tree, device.torch_device, dtype=torch.bfloat16, backend=NvrtcBackend(device.torch_device))
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, cfg.vocab_size - 256, (8,), generator=g)
toks = torch.randint(0, cfg.vocab_size - 256, (steps + 3,), generator=g)
opts = RuntimeOptions(device="cuda", gpu_experts=cfg.expert_files // 3, verify_experts="off")
for rep in range(2):
    with StreamingRuntime(tree, model, opts, device=device) as rt, torch.no_grad():
        rt.warm_host()
        cache = model.new_cache()
        rt.run(model.forward_steps(prompt, cache, last_only=True))
        for t in range(3):
            rt.run(model.forward_steps(toks[t : t + 1, None], cache), tokens=1)
        rt.reset_stats()
        c0 = time.thread_time()
        for t in range(3, steps + 3):
            rt.run(model.forward_steps(toks[t : t + 1, None], cache), tokens=1)
        p, cpu = rt.payload(), (time.thread_time() - c0) / steps
        print(
            f"AB {tag} rep {rep}: {p['s_per_token'] * 1e3:.1f} ms/token, {rt.stats.decode_bytes_h2d / steps / 1e9:.2f} "
                f"GB/token, "
            f"host CPU {cpu * 1e3:.1f} ms/token, stall {p['stall_s'] / steps * 1e3:.1f} ms/token",
            flush=True,
        )
