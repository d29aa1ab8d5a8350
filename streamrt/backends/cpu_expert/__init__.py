"""The host CPU expert kernel: `nvfp4_expert.c` (one routed expert in NVFP4, read where its bytes
lie), `build.py` (compiled on first use by the system compiler, cached per CPU), `kernel.py`
(the checked Python entry point). Import `kernel`; nothing is imported here."""
