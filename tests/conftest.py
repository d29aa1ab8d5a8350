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


import shutil  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def default_model_copy(tmp_path, monkeypatch):
    """A private copy of the embedded default model, its verification records and caches under
    tmp_path (so a test may corrupt it)."""
    from streamrt.checkpoint.reader import VERIFIED
    from streamrt.default_model import packaged_model_dir

    monkeypatch.setenv("STREAMRT_CACHE", str(tmp_path / "cache"))
    src = packaged_model_dir()
    if src is None:
        pytest.skip("no packaged default model in this build")
    dst = tmp_path / "model"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(VERIFIED))
    return dst
