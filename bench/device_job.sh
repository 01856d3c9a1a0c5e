#!/usr/bin/env bash
# On the GPU machine (after the setup lines of ../shared/device/README.md): `start` launches the GPU tests
# (TESTS_CMD, default the gpu-marked tests; `true` skips them) and a benchmark (BENCH_CMD, default the
# NVMe one; it gets `--out /tmp/tt/bench`) detached (a device command lasts at most 10 minutes, the job
# longer); `wait N` follows it for up to N seconds, then packs what it wrote into $OUT/tt.tgz (the device
# hands back a few files only).
dest=/tmp/tt
case "$1" in
start)
  mkdir -p "$dest/bench"
  setsid nohup bash -c "${TESTS_CMD:-python3 -m pytest -m gpu -q -p no:cacheprovider} > $dest/gpu-tests.log 2>&1;
    ${BENCH_CMD:-python3 -m bench.nvme --nvme-dir /tmp/nvme} --out $dest/bench > $dest/bench.log 2>&1;
    echo done > $dest/done" > /dev/null 2>&1 < /dev/null &
  ;;
wait)
  end=$((SECONDS + ${2:-560}))
  while [ $SECONDS -lt $end ] && [ ! -f "$dest/done" ]; do sleep 5; done
  tail -n 3 "$dest/gpu-tests.log" 2>/dev/null; cat "$dest/bench.log" 2>/dev/null | tail -n 40
  df -h /tmp | tail -n 1; free -g | head -n 2
  [ -n "${OUT:-}" ] && tar czf "$OUT/tt.tgz" -C "$dest" . 2>/dev/null && ls -la "$OUT"
  ;;
esac
