#!/usr/bin/env bash
# Runs the Python client's tests (GPU ones included) and the torch benchmark
# on a GPU machine, writing everything under $OUT:
#   env.txt      GPU, driver and library versions
#   pytest.txt   python -m pytest -v python/tests (host and cuda daemons)
#   bench.txt    python/bench/bench_torch.py's table (bench.json: raw times)
#   go-bench-open.txt  'gpushm bench open', the Go client's figures
# Needs the gpushm binary: build it on any machine with Go
# (go build -o .gpu/gpushm ./cmd/gpushm) and pass its path as GPUSHM_BIN, or
# leave it at .gpu/gpushm. Every step has a time limit, and a failing step
# does not stop the next.
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/gpushm-gpu-run}
mkdir -p "$OUT"
export GPUSHM_BIN=${GPUSHM_BIN:-$PWD/.gpu/gpushm}
export PYTHONPATH=$PWD/python
PY=${PYTHON:-python3}

{
	date -u
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
	"$PY" -c 'import sys; print("python", sys.version.split()[0])'
	for m in numpy torch cupy jax pytest; do
		"$PY" -c "import $m; print('$m', $m.__version__)" 2>&1 | tail -1
	done
} >"$OUT/env.txt" 2>&1

timeout 200 "$PY" -u -m pytest -v -rs --durations=10 python/tests >"$OUT/pytest.txt" 2>&1
echo "pytest exit status $?" >>"$OUT/pytest.txt"

dir=$(mktemp -d /tmp/gpushm-bench-XXXXXX)
setsid "$GPUSHM_BIN" daemon --socket "$dir/g.sock" >"$OUT/bench-daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do
	[ -S "$dir/g.sock" ] && break
	sleep 0.1
done
GPUSHM_SOCKET="$dir/g.sock" OUT="$OUT" timeout 240 "$PY" -u python/bench/bench_torch.py >"$OUT/bench.txt" 2>&1
echo "bench exit status $?" >>"$OUT/bench.txt"
kill "$daemon"
wait "$daemon" 2>/dev/null
rm -rf "$dir"
# The Go client's open-to-mapped on the same machine, for reference.
timeout 120 "$GPUSHM_BIN" bench open --iters 50 >"$OUT/go-bench-open.txt" 2>&1
echo "go bench exit status $?" >>"$OUT/go-bench-open.txt"
tail -n 3 "$OUT/pytest.txt"
cat "$OUT/bench.txt" "$OUT/go-bench-open.txt"
