#!/usr/bin/env bash
# Builds libgpushm_alloc.so and its tests on a GPU machine and runs them:
# test_alloc (C: sharing across processes and devices, failures, threads, the
# benchmark) and test_torch.py (the pluggable allocator and LD_PRELOAD).
# Needs gcc, make, the NVIDIA driver, and python3 with torch for test_torch.
# Logs go to $OUT (default native/gpu-out). Exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-native/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
status=0
step() { echo; echo "=== $*"; }

step "machine"
{
	date -u +%Y-%m-%dT%H:%M:%SZ
	nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv
	nvidia-smi topo -m
} 2>&1 | tee "$OUT/machine.txt"

step "build"
if command -v make >/dev/null; then
	make -C native clean test 2>&1 | tee "$OUT/build.log"
else # the Makefile's two commands
	(cd native &&
		cc -std=c11 -Wall -Wextra -Werror -O2 -shared -fPIC -o libgpushm_alloc.so gpushm_alloc.c -ldl -lpthread &&
		cc -std=c11 -Wall -Wextra -Werror -O2 -o test_alloc test_alloc.c -ldl -lpthread) 2>&1 | tee "$OUT/build.log"
fi
[ "${PIPESTATUS[0]}" = 0 ] || { echo "FAIL: build"; exit 1; }

step "declarations against the toolkit's headers"
nvcc=$(command -v nvcc || true)
CUDA_HOME=${CUDA_HOME:-${nvcc:+$(dirname "$(dirname "$nvcc")")}}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ -f "$CUDA_HOME/include/cuda.h" ]; then
	grep -m1 '#define CUDA_VERSION' "$CUDA_HOME/include/cuda.h"
	(cd native && cc -std=c11 -Wall -Wextra -Werror -fsyntax-only -DGPUSHM_CHECK_CUDA_H -I"$CUDA_HOME/include" gpushm_alloc.c) 2>&1 | tee "$OUT/check-cuda-h.log"
	if [ "${PIPESTATUS[0]}" = 0 ]; then echo "declarations match $CUDA_HOME/include"; else status=1; fi
else
	echo "SKIP: no cuda.h under $CUDA_HOME"
fi

step "how this torch reaches cudaMalloc"
python3 - <<'PY' 2>&1 | tee "$OUT/torch-linkage.txt"
import os, subprocess, torch
d = os.path.join(os.path.dirname(torch.__file__), "lib")
print("torch", torch.__version__, "built for CUDA", torch.version.cuda, "in", d)
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout
    except FileNotFoundError:
        return f"({cmd[0]} not installed)"
for name in ("libc10_cuda.so", "libtorch_cuda.so"):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        print(name, "absent")
        continue
    print(name, "NEEDED:", [l.split()[-1] for l in run("readelf", "-d", p).splitlines() if "NEEDED" in l and "cuda" in l])
    print(name, "resolves to:", [l.strip() for l in run("ldd", p).splitlines() if "cudart" in l])
    syms = [l.split()[-1] for l in run("nm", "-D", "--undefined-only", p).splitlines() if l.strip()]
    print(name, "imports:", [s for s in syms if s.split("@")[0] in ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cuMemCreate")])
PY

step "test_alloc"
timeout 300 native/test_alloc 2>&1 | tee "$OUT/test_alloc.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

step "test_torch.py"
timeout 400 python3 native/test_torch.py 2>&1 | tee "$OUT/test_torch.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

step "GPU memory at the end"
nvidia-smi --query-gpu=index,memory.used --format=csv
echo "gpu_test.sh: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
