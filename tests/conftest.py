"""Suite-wide settings.

The tiny models are far below the size where intra-op threads pay: on a 2-core machine two
threads run these ops several times slower than one. Subprocesses (the CLI tests) inherit
the environment variable; the numbers do not change (logits hashes match at 1 and 2 threads).
This is the only place tests set the thread count.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
