#!/usr/bin/env bash
# Issue 44 on one H100 machine (128 GB of RAM, 64 GB of disk), as command lines: llama3.1-8b at 131,072 tokens with
# --host-gb 120 --nvme-dir and --out on the same disk is refused before training with full checkpoints; with
# checkpoint.state = "weights" it trains, writes its final checkpoint, `export` writes a Hugging Face model and
# transformers loads it (its weights compared with the checkpoint's master).
# Usage (on the GPU machine, after ../shared/device/README.md's setup): bash bench/rundir.sh OUT_DIR
out=${1:-/tmp/tt}
mkdir -p "$out"
sed "s/^seq_len = .*/seq_len = 131072/; s/^max_position_embeddings = .*/max_position_embeddings = 131072/;
     s/^batch_size = .*/batch_size = 1/; s/^micro_batch_size = .*/micro_batch_size = 1/" \
  tiertrain/configs/llama3.1-8b.toml > /tmp/8b-128k.toml
python3 -c "import numpy as np; np.save('/tmp/long.npy', np.random.default_rng(0).integers(0, 32000, 3_000_000).astype(np.uint32))"
run=(python3 -m tiertrain run --config /tmp/8b-128k.toml --host-gb 120 --nvme-dir /tmp/nvme --set data.path=/tmp/long.npy
     --set train.steps=1)
{ df -h /tmp; free -g; } > "$out/machine.txt"
"${run[@]}" --out /tmp/run-full > "$out/full.log" 2>&1; echo "exit $?" >> "$out/full.log"
ls -la /tmp/run-full >> "$out/full.log" 2>&1
"${run[@]}" --set checkpoint.state=weights --out /tmp/run-weights > "$out/weights.log" 2>&1
echo "exit $?" >> "$out/weights.log"
{ du -sh /tmp/run-weights/checkpoints/*; df -h /tmp; } >> "$out/weights.log" 2>&1
/usr/bin/time -v python3 -m tiertrain export /tmp/run-weights --to /tmp/hf-8b --dtype bfloat16 > "$out/export.log" 2>&1
echo "exit $?" >> "$out/export.log"
python3 - > "$out/load.log" 2>&1 <<'EOF'
import glob, time
import torch, zarr
from transformers import AutoModelForCausalLM
t0 = time.time()
m = AutoModelForCausalLM.from_pretrained("/tmp/hf-8b", dtype=torch.bfloat16)
print(f"loaded {type(m).__name__} in {time.time() - t0:.0f} s, {sum(p.numel() for p in m.parameters()) / 1e9:.2f} B parameters")
ck = zarr.open_group(sorted(glob.glob("/tmp/run-weights/checkpoints/step_*"))[-1], mode="r")
print("checkpoint kinds", ck.attrs["kinds"], "step", ck.attrs["step"])
emb = torch.from_numpy(ck["master"]["0"][:m.model.embed_tokens.weight.numel()]).view_as(m.model.embed_tokens.weight)
print("embedding equal to the master in bf16:", torch.equal(emb.to(torch.bfloat16), m.model.embed_tokens.weight))
m = m.cuda().eval()
with torch.no_grad():
    logits = m(torch.arange(16, device="cuda")[None]).logits
print("logits", tuple(logits.shape), "finite:", bool(torch.isfinite(logits).all()), "mean", float(logits.float().mean()))
EOF
rm -rf /tmp/hf-8b /tmp/run-weights/checkpoints /tmp/nvme
