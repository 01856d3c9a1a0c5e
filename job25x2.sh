set -x
export BENCH_COMMIT=$(cat .bench_commit) BENCH_DIRTY=0
nvidia-smi topo -m
python3 -m pytest -q -p no:cacheprovider tests/test_ranks.py -m gpu 2>&1 | tail -5
python3 -m bench.ranks --config configs/llama-3b.toml --batches 8 32 --gpus 2 --out /tmp/tt/bench
