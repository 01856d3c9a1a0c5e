#!/usr/bin/env bash
# The long-context runs as command lines: issue 23's on one H200 (bench/results/2026-11-24-issue23-long-context.md)
# and issue 34's llama3.1-8b on the machines' real RAM and disk (bench/results/2026-11-25-issue34-long-8b.md).
# Usage (on the GPU machine, after ../shared/device/README.md's setup): [HW=probe.json] bash bench/long.sh OUT_DIR [RUN...]
# RUN: 7b-256k 3b-512k 1b-1m 3b-32k baselines (H200), 8b-128k 8b-256k (H100), 8b-360k 8b-128k-keep 8b-128k-bf16
# (H200);
# default: issue 23's.
# HW: a `tiertrain probe --nvme-dir` file tiertrain plans with (and the all-in-GPU baseline takes its attention
# kernel from); default: the reference figures. Issue 42's runs: 8b-128k and 8b-256k on an H100, 8b-360k on an H200,
# 3b-32k on either, each with HW from that machine.
out=${1:-bench/results}; shift
mk() {  # a config at one length, one sequence per step
  sed "s/^seq_len = .*/seq_len = $2/; s/^max_position_embeddings = .*/max_position_embeddings = $2/;
       s/^batch_size = .*/batch_size = 1/; s/^micro_batch_size = .*/micro_batch_size = 1/" \
    tiertrain/configs/$1.toml > /tmp/$1-$2.toml
}
python3 -c "import numpy as np; np.save('/tmp/long.npy', np.random.default_rng(0).integers(0, 32000, 3_000_000).astype(np.uint32))"
budgets=(tiers.host_gb=115 tiers.nvme_gb=55 'tiers.nvme_dir="/tmp/nvme"' 'data.path="/tmp/long.npy"')
long() {  # config length steps [more --set...]
  mk "$1" "$2"
  python3 -m bench.pipeline --config "/tmp/$1-$2.toml" --systems long --define long "${budgets[@]}" "${@:4}" ${HW:+--hardware-file "$HW"} \
    --batches 1 --micro 1 --warmup $(($3 > 2 ? 1 : $3 - 1)) --steps $(($3 > 2 ? $3 - 1 : 1)) --timeout 3600 \
    --tag="-long-$2" --out "$out"
  local rc=$?
  rm -rf /tmp/nvme
  return $rc  # the run's status, not the clean-up's: a detached job's caller reads it
}
for run in ${@:-7b-256k 3b-512k 1b-1m 3b-32k baselines}; do
  case $run in
    7b-256k) long llama-7b 262144 2 ;;
    3b-512k) long llama-3b 524288 2 ;;
    1b-1m) long llama-1b 1048576 2 ;;
    3b-32k) mk llama-3b 32768
      python3 -m bench.pipeline --config /tmp/llama-3b-32768.toml --systems tiertrain,gpu,deepspeed --batches 1 ${HW:+--hardware-file "$HW"} \
        --micro 1 --warmup 1 --steps 2 --tag=-32k-batch1 --out "$out" ;;
    8b-128k) budgets[0]=tiers.host_gb=120; budgets[1]=tiers.nvme_gb=0; long llama3.1-8b 131072 3 ;;
    8b-256k) budgets[0]=tiers.host_gb=120; budgets[1]=tiers.nvme_gb=0
      long llama3.1-8b 262144 4 'tiers.activation_dtype="bfloat16"' ;;
    8b-360k) long llama3.1-8b 364544 3 'tiers.activation_dtype="bfloat16"' ;;
    8b-128k-keep) mk llama3.1-8b 131072  # the attention outputs kept for the recompute, or not, side by side
      python3 -m bench.pipeline --config /tmp/llama3.1-8b-131072.toml --systems recompute,kept \
        --define recompute "${budgets[@]}" train.keep_attention=0 --define kept "${budgets[@]}" \
        ${HW:+--hardware-file "$HW"} --batches 1 --micro 1 --warmup 1 --steps 2 --timeout 3600 --tag=-keep-131072 \
        --out "$out"; rm -rf /tmp/nvme ;;
    8b-128k-bf16) long llama3.1-8b 131072 3 'tiers.activation_dtype="bfloat16"' ;;  # kept outputs beside bf16 ones
    baselines) for S in 65536 131072 262144; do mk llama-3b $S
      python3 -m bench.pipeline --config /tmp/llama-3b-$S.toml --systems gpu,deepspeed --batches 1 --micro 1 \
        --warmup 0 --steps 1 --tag=-$S-baselines --out "$out"; done ;;
  esac
done
