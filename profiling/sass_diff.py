"""Compare the SASS of every kernel entry point between a git ref and the working tree.

Each tree's kernels (`kernels/*.cu`) are compiled with NVRTC for one arch (default sm_90) with
the options and `-D` defines that tree's own backend passes (its `cuda_compile` option builder,
imported in a subprocess with that tree on the path), disassembled with nvdisasm, and compared
entry point by entry point (the function's section: its instructions and register count).
Needs no GPU: NVRTC and nvdisasm run on the CPU.

    python profiling/sass_diff.py cfdf160            # every program
    python profiling/sass_diff.py cfdf160 nvfp4_moe  # one program

Exit status 0 when every entry point of the working tree exists in the ref with the same SASS;
entry points only in the ref (removed) are listed, not counted as a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# run with a tree first on sys.path: print {program: [nvrtc options]} for that tree's kernels
_OPTIONS_SCRIPT = """
import json, sys
from pathlib import Path
from streamrt.backends import cuda_compile as cc
kdir, arch = Path(sys.argv[1]), sys.argv[2]
build = getattr(cc, "compile_options", None)
out = {}
for prog in cc.programs(kdir):  # older trees named the builder _options(arch, extra, program, kdir)
    out[prog] = build(prog, arch, (), kdir) if build else cc._options(arch, (), prog, kdir)
print(json.dumps(out))
"""


def tree_options(tree: Path, arch: str) -> dict[str, list[str]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run([sys.executable, "-c", _OPTIONS_SCRIPT, str(tree / "kernels"), arch], env=env, cwd=tree,
                         capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"sass_diff: cannot build the compile options of {tree}:\n{res.stderr.strip()}")
    return json.loads(res.stdout)


def nvdisasm_path() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for base in getattr(nvidia, "__path__", []):
        for p in sorted(Path(base).glob("*/bin/nvdisasm")):
            return str(p)
    sys.exit("sass_diff: no nvdisasm (pip install nvidia-cuda-nvdisasm-cu12, or put it on PATH)")


def entry_sass(cubin: bytes, nvdisasm: str) -> dict[str, str]:
    """Entry point -> its disassembled section (addresses relative to the function)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\w+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur is not None and re.match(r"\s*\.section\s", line):
            cur = None
        if cur is not None and not line.startswith("//----"):  # the next section's banner
            out[cur].append(line.rstrip())
    return {k: _local_labels("\n".join(v)) for k, v in out.items()}


def _local_labels(text: str) -> str:
    """Labels (.L_x_N) and internal helper functions ($__internal_N_$...) numbered from the
    function's first: the compiler numbers them across the whole cubin, so removing another
    kernel would renumber this one's."""
    names: dict[str, str] = {}
    text = re.sub(r"\.L_x_\d+", lambda m: names.setdefault(m.group(0), f".L_{len(names)}"), text)
    return re.sub(r"\$__internal_\d+_\$", lambda m: names.setdefault(m.group(0), f"$__internal_{len(names)}_$"), text)


def cached_cubin(tree: Path, prog: str, src: str, opts: list[str], compile_fn) -> bytes:
    """The cubin, from a cache keyed on the source, the headers and the options (not include
    paths): comparing against one ref again compiles only what changed."""
    h = hashlib.sha256(src.encode())
    for p in sorted((tree / "kernels").glob("*.cuh")):
        h.update(p.read_bytes())
    h.update("\0".join(o for o in opts if not o.startswith("-I")).encode())
    path = Path(tempfile.gettempdir()) / "sass_diff_cache" / f"{prog}-{h.hexdigest()[:24]}.cubin"
    if path.is_file():
        return path.read_bytes()
    data = compile_fn(src, f"{prog}.cu", opts)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return data


def compile_tree(tree: Path, arch: str, only: list[str]) -> dict[str, dict[str, str]]:
    from streamrt.backends.cuda_compile import nvrtc_compile

    nvdisasm = nvdisasm_path()
    result = {}
    for prog, opts in tree_options(tree, arch).items():
        if only and prog not in only:
            continue
        # include paths point at this tree's kernels (the option builder was given its kdir)
        src = (tree / "kernels" / f"{prog}.cu").read_text()
        result[prog] = entry_sass(cached_cubin(tree, prog, src, opts, nvrtc_compile), nvdisasm)
    return result


def export_ref(ref: str, dest: Path) -> None:
    archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, capture_output=True, check=True).stdout
    tar = dest / "tree.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest / "tree", filter="data")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="git ref to compare the working tree against")
    ap.add_argument("programs", nargs="*", help="kernel programs (default: all)")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        export_ref(args.ref, Path(tmp))
        old = compile_tree(Path(tmp) / "tree", args.arch, args.programs)
    new = compile_tree(ROOT, args.arch, args.programs)
    same = differ = added = removed = 0
    for prog in sorted(set(old) | set(new)):
        o, n = old.get(prog, {}), new.get(prog, {})
        for name in sorted(set(o) | set(n)):
            if name not in n:
                removed += 1
                print(f"removed    {prog}:{name}")
            elif name not in o:
                added += 1
                print(f"new        {prog}:{name}")
            elif o[name] == n[name]:
                same += 1
                print(f"identical  {prog}:{name}")
            else:
                differ += 1
                print(f"DIFFERS    {prog}:{name}")
    print(f"{same} identical, {differ} differ, {added} new, {removed} removed vs {args.ref} ({args.arch})")
    return 1 if differ or added else 0


if __name__ == "__main__":
    sys.exit(main())
