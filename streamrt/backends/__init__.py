"""Ops backends: `torch_backend` (the reference, CPU and GPU) and `nvrtc` (CUDA kernels compiled
by NVRTC, launched with cuda-python). Import the module you need; nothing is imported here."""
