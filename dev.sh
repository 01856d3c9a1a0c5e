#!/usr/bin/env bash
# session script (not committed): GPU tests, then the auto bench, then the llama-1b least-budget stage
set -u
d=/tmp/tt; mkdir -p $d/bench $d/nvme /tmp/nvme
( python3 -m pytest -m gpu -q -p no:cacheprovider > $d/gpu-tests.log 2>&1; echo tests-done > $d/tests-done
  python3 -m bench.pipeline --batches 4 16 --systems probe,tiertrain,tiertrain-auto --out $d/bench > $d/bench.log 2>&1; echo done > $d/bench-done
  python3 -m bench.nvme --stages probe,least --config configs/llama-1b.toml --least-layers 16 --batches 4 --nvme-dir /tmp/nvme --out $d/nvme > $d/nvme.log 2>&1; echo done > $d/nvme-done
) < /dev/null > /dev/null 2>&1 &
