#!/bin/bash
# One call on a lent GPU machine (the tool library's `device`): the GPU tests, then bench_gpu.py.
# Wheels travel in .whl (kvikio-cu13, libkvikio-cu13, rapids-logger, and our pure deps the image
# lacks: crc32c, blake3, pytest-asyncio, trio...); results land in $OUT (or ./device-out).
#   device run: bash bench/device_gpu.sh [budget seconds, default 450] [pytest args...]
set -u
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
BUDGET=${1:-450}
shift || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
left() { echo $((BUDGET - SECONDS)); }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  uname -r; nproc; free -g | head -2; df -h /tmp | tail -1; mount | grep -E " /tmp | / " | head -3
  python3 -c "import torch, kvikio, kvikio.defaults as d; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'kvikio', kvikio.__version__, 'compat_mode', d.get('compat_mode'))"
  python3 -c "import aiotensor; from aiotensor.engines import KvikioEngine, kvikio_usable; print('kvikio_usable', kvikio_usable()); print('mode', KvikioEngine().mode)"
  # the disk's limit without fio (not in the image): 2 GiB O_DIRECT write, then read
  dd if=/dev/zero of=/tmp/dd.bin bs=1M count=2048 oflag=direct conv=fsync 2>&1 | tail -1
  dd if=/tmp/dd.bin of=/dev/null bs=1M iflag=direct 2>&1 | tail -1
  rm -f /tmp/dd.bin
} 2>&1 | tee "$OUT/env.txt"
TESTS=${*:-tests/test_gpu.py tests/test_cuda.py tests/test_kvikio.py}
timeout $(( $(left) * 45 / 100 )) python3 -m pytest -m gpu -q -rfEs --durations=12 --junitxml="$OUT/gpu-junit.xml" $TESTS 2>&1 | tee "$OUT/pytest-gpu.log"
timeout 60 python3 -m pytest -q -rfEs tests/test_kvikio_real.py 2>&1 | tail -15 | tee -a "$OUT/pytest-gpu.log"
# every test of the files that branch on CUDA, GPU and CPU tests in one process as a plain
# `pytest` runs them (CPU tests then meet CUDA already initialized), and the loop test, which found
# a 0.18 s hold here that CPU machines cannot show
timeout 150 python3 -m pytest -q -rfE -p no:benchmark tests/test_cuda.py tests/test_kvikio.py tests/test_loop_blocking.py 2>&1 | tail -12 | tee "$OUT/pytest-cuda-branches.log"
echo "bench: $(left) s left"
timeout $(( $(left) - 10 )) python3 bench/bench_gpu.py --reps ${REPS:-4} --out "$OUT" 2>&1 | tee "$OUT/bench.log"
# the disk's limit at queue depths dd cannot reach (fio is not in the image): plain preadv patterns
if [ "$(left)" -gt 90 ]; then
  timeout 80 python3 bench/bench_read_patterns.py --reps 2 --out "$OUT" 2>&1 | tail -16 | tee "$OUT/read-patterns.log"
fi
# the rest of the suite on a machine where CUDA is there (tests that branch on it), as time allows
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 5 )) python3 -m pytest -q -rfE -p no:benchmark -n 12 -m "not slow and not s3 and not root and not gpu" tests 2>&1 | tail -25 | tee "$OUT/pytest-rest.log"
fi
echo "done at ${SECONDS}s"
