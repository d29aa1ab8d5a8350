#!/usr/bin/env bash
# The Python packages streamrt needs that the device image lacks (pydantic: `python -m streamrt`
# imports the server's request model; fastapi, uvicorn, openai and anthropic: the serve tests), as x86-64
# CPython 3.12 wheels in .whl/ (git-ignored), at the versions installed here. Run here, then name
# .whl in the device call's carry; device_session.sh installs them.
#   bash profiling/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PKGS="pydantic pydantic_core annotated-types typing-inspection typing_extensions fastapi starlette uvicorn h11 click
      anyio sniffio idna annotated-doc opentelemetry-api openai anthropic docstring-parser httpx2 httpcore2 truststore distro
      jiter tqdm"
# each at the version installed here, else the newest
pins=$(python3 - $PKGS <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
ls .whl | wc -l | xargs echo "wheels in .whl:"; du -sh .whl
