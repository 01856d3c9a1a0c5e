#!/usr/bin/env bash
# On the GPU machine (after the setup lines of ../shared/device/README.md): the GPU tests, then the
# side-by-side benchmark, detached so that the run can outlast one device command. Writes into $1 and
# touches $1/done at the end; collect with: tar the logs, copy the .md/.json.
set -u
dest=${1:-/tmp/tt}
mkdir -p "$dest"
( [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider > "$dest/gpu-tests.log" 2>&1
  python3 -m bench.pipeline --batches 4 8 16 32 --out "$dest/bench" > "$dest/bench.log" 2>&1
  echo done > "$dest/done" ) < /dev/null > /dev/null 2>&1 &
