"""The kernels' compile-time geometry, stated once.

The host sizes grids, blocks, shared memory and pointer tables with these numbers, and
`cuda_compile` passes them to NVRTC as `-D` defines, so a kernel and its launch cannot drift:
each `kernels/*.cu` refuses to compile without them (`#ifndef X` / `#error`). No torch here:
CI compiles every kernel on a CPU machine.
"""

from __future__ import annotations

# nvfp4_moe.cu
MOE_MAXP = 64  # (row, expert) pairs per launch: the length of the by-value pointer tables
MOE_MAXP_DT = 1024  # ... and of the device-memory tables (srt_moe_tables; a batch of 64 rows x 16)
MOE_WARPS = 8  # warps per block of the CUDA-core NVFP4 kernels
EXPERT_COLS = 9  # u64 columns per expert of a device pointer table (ExpertPointers' nine sections)
TC_WBYTES = 32 * 64  # tensor-core NVFP4 kernels: one 128-column block of 32 rows, weights ...
TC_SBYTES = 32 * 8  # ... and its E4M3 scales
TC_TOKENS = 8  # the most (row, expert) pairs of one expert one tensor-core block takes
TC_XSTRIDE = 20  # u32 words of one staged 32-element activation chunk (16 fp16 pairs + 4 of padding)
TC_STAGED_THREADS = 384  # the most threads of a gate+up block reading staged rows (its registers: 65536 / it)
TC_STAGED_DOWN_THREADS = 256  # ... and of a down block reading them (four row slots a warp: more registers)
# kda.cu: the largest head dim (a state column lives in registers)
KDA_MAXK = 128
KDA_WARPS = 4  # warps per block of srt_kda_step, each a quarter of a state column's rows
# norms.cu: the most AttnRes sources (completed blocks + the partial prefix)
ATTNRES_MAXS = 64
ATTNRES_SLICE = 256  # ... and the elements of a row one AttnRes block takes (its threads; a multiple of 32)
# attention.cu
MLA_CHUNK = 64  # positions per split of the MLA decode
MLA_HG = 8  # heads per block
MLA_THREADS = 256  # threads per block of srt_mla_partial
IDX_WARPS = 8  # warps per block of srt_indexer_scores, one position each ...
IDX_PPW = 4  # ... IDX_PPW times
# gemv.cu
GEMV_WARPS = 4  # warps per block of the CUDA-core kernels
GEMV_TC_ROWS = 32  # rows of W per block of the tensor-core kernel
GEMV_TC_COLS = 128  # columns of one stage of the tensor-core kernel's ring
GEMV_TC_MATS = 8  # matrices (sharing x) of one tensor-core launch: its by-value table's length
GEMV_TC_PREFETCH = 4  # stages of W per warp pulled into L2 before the programmatic wait
# topk.cu
TOPK_THREADS = 1024  # threads per block (one row) of srt_select_topk
ROUTER_THREADS = 256  # threads per block (one token) of srt_router_topk

# program -> the constants it is compiled with, each passed as -D<NAME>=<value> under the
# name it has here (one name across Python and CUDA)
PROGRAM_CONSTANTS: dict[str, tuple[str, ...]] = {
    "attention": ("MLA_CHUNK", "MLA_HG", "MLA_THREADS", "IDX_WARPS", "IDX_PPW"),
    "gemv": ("GEMV_WARPS", "GEMV_TC_COLS", "GEMV_TC_ROWS", "GEMV_TC_MATS", "GEMV_TC_PREFETCH"),
    "kda": ("KDA_MAXK", "KDA_WARPS"),
    "norms": ("ATTNRES_MAXS", "ATTNRES_SLICE"),
    "nvfp4_moe": ("MOE_MAXP", "MOE_MAXP_DT", "MOE_WARPS", "EXPERT_COLS", "TC_WBYTES", "TC_SBYTES", "TC_TOKENS",
                  "TC_XSTRIDE", "TC_STAGED_THREADS", "TC_STAGED_DOWN_THREADS"),
    "topk": ("TOPK_THREADS", "ROUTER_THREADS"),
}

# program -> macro -> value
DEFINES: dict[str, dict[str, int]] = {
    program: {name: globals()[name] for name in names} for program, names in PROGRAM_CONSTANTS.items()
}


def defines(program: str | None) -> tuple[str, ...]:
    """The `-D` options of one kernel program (none for a source that is not in kernels/)."""
    return tuple(f"-D{k}={v}" for k, v in DEFINES.get(program or "", {}).items())
