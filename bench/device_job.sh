#!/usr/bin/env bash
# On the GPU machine (after the setup lines of ../shared/device/README.md): `start` launches the GPU tests
# and a benchmark (BENCH_CMD, default the NVMe one) detached (a device command lasts at most 10 minutes, the job longer);
# `wait N` follows it for up to N seconds, then copies what it wrote into $OUT.
dest=/tmp/tt
case "$1" in
start)
  mkdir -p "$dest"
  setsid nohup bash -c "python3 -m pytest -m gpu -q -p no:cacheprovider > $dest/gpu-tests.log 2>&1;
    ${BENCH_CMD:-python3 -m bench.nvme --nvme-dir /tmp/nvme} --out $dest/bench > $dest/bench.log 2>&1;
    echo done > $dest/done" > /dev/null 2>&1 < /dev/null &
  ;;
wait)
  end=$((SECONDS + ${2:-560}))
  while [ $SECONDS -lt $end ] && [ ! -f "$dest/done" ]; do sleep 5; done
  tail -n 3 "$dest/gpu-tests.log" 2>/dev/null; cat "$dest/bench.log" 2>/dev/null | tail -n 40
  df -h /tmp | tail -n 1; free -g | head -n 2
  [ -n "${OUT:-}" ] && cp -r "$dest"/. "$OUT"/ 2>/dev/null
  ;;
esac
