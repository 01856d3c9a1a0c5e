set -x
python3 -m pytest -q -p no:cacheprovider tests/test_ranks.py -m gpu 2>&1 | tail -15
python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -5
