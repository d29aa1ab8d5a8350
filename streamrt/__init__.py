"""streamrt: run KimiLinear MoE models (Kimi K3, K3.1 Pro) on one GPU by streaming routed experts."""

__version__ = "0.1.0"
