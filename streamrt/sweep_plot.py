"""The sweep's figure: s/token, GB/s and hit rates against the host window and the device
slots, and every point's s/token with its spread over repeats."""

from __future__ import annotations

import io
from pathlib import Path

from streamrt.fileio import atomic_write


def num(v, default: float | None = None) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _line(ax, rows: list[dict], xkey: str, ykey: str, label: str | None = None, scale: float = 1.0) -> None:
    """Median against x; where the row has a spread (min / max over repeats), error bars."""
    pts = sorted((num(r[xkey]), num(r[ykey]), num(r.get(f"{ykey}_min")), num(r.get(f"{ykey}_max")))
                 for r in rows if num(r[ykey]) is not None and r[ykey] != "")
    if not pts:
        return
    x, y = [p[0] for p in pts], [scale * p[1] for p in pts]
    if all(p[2] is not None and p[3] is not None for p in pts):
        err = [[scale * (p[1] - p[2]) for p in pts], [scale * (p[3] - p[1]) for p in pts]]
        ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, label=label)
    else:
        ax.plot(x, y, "o-", label=label)


def plot(path: Path, rows: list[dict], title: str) -> None:
    """Top: s/token, effective GB/s and hit rates against the host window. Bottom: device hit
    rate and s/token against --gpu-experts per policy, and every point's s/token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["rc"] == 0]
    win = [r for r in ok if r["group"] == "window"]
    dev = [r for r in ok if r["group"] == "device"]
    fig, ax = plt.subplots(2, 3, figsize=(16, 8.5))
    fig.suptitle(title)
    _line(ax[0, 0], win, "window", "s_per_token")
    _line(ax[0, 1], win, "window", "effective_gbps")
    _line(ax[0, 2], win, "window", "host_hit_rate", "host", 100)
    _line(ax[0, 2], win, "window", "device_hit_rate", "device", 100)
    for a, ylabel in zip(ax[0], ("s / token", "effective GB/s", "hit rate %")):
        a.set(xscale="log", xlabel="host window (experts)", ylabel=ylabel)
    for policy in dict.fromkeys(r["gpu_policy"] for r in dev):
        mine = [r for r in dev if r["gpu_policy"] == policy]
        _line(ax[1, 0], mine, "gpu_experts", "device_hit_rate", policy, 100)
        _line(ax[1, 1], mine, "gpu_experts", "s_per_token", policy)
    ax[1, 0].set(xlabel="device slots (--gpu-experts)", ylabel="device hit rate %")
    ax[1, 1].set(xlabel="device slots (--gpu-experts)", ylabel="s / token")
    for a in (ax[0, 2], ax[1, 0]):
        a.set_ylim(-5, 105)
    for a in (*ax[0], ax[1, 0], ax[1, 1]):
        a.grid(True, which="both", alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    bars = [r for r in ok if num(r["s_per_token"]) is not None and r["s_per_token"] != ""]
    med = [num(r["s_per_token"]) for r in bars]
    lo = [m - num(r.get("s_per_token_min"), m) for m, r in zip(med, bars)]
    hi = [num(r.get("s_per_token_max"), m) - m for m, r in zip(med, bars)]
    ax[1, 2].barh([r["label"] for r in bars], med, xerr=[lo, hi], capsize=2)
    ax[1, 2].invert_yaxis()
    n = max((int(num(r.get("repeats")) or 1) for r in bars), default=1)
    ax[1, 2].set(xlabel="s / token", title=f"every point: median of {n} runs, bars min-max")
    ax[1, 2].tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
