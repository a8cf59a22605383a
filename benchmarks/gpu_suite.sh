#!/usr/bin/env bash
# Real-GPU benchmark suite (issue 20, item 6): the RMSNorm kernel benchmark and the
# folded-vs-original forward at the paper's grid, written with the device, versions and
# date to benchmarks/results/gpu/<UTC date>/.
#
#   benchmarks/gpu_suite.sh                 # on a machine with an NVIDIA GPU and jax[cuda12]
#   benchmarks/gpu_suite.sh --quick         # a few minutes: small kernel sweep, two forward sizes
#   benchmarks/gpu_suite.sh --dry-run       # anywhere: checks the setup, prints what would run
#
# Options:
#   --out DIR        results root (default benchmarks/results/gpu); files go to DIR/<date>/
#   --models LIST    forward models (default gpt2,bert-base,opt-125m: the paper's text models)
#   --max-gib N      skip forward sizes estimated above N GiB (default: 60% of the GPU's memory)
#   --rounds N       forward timing rounds (default 7)
#   --quick          kernel benchmark at 4096 rows, hidden 768/4096, bf16; forward at 2x256, 8x1024
#   --dry-run        no benchmark runs: checks the GPU (reports its absence instead of exiting),
#                    writes nothing, prints the commands
#   --python EXE     interpreter (default: $PYTHON or python)
#   --cpu-smoke      check this script end to end without a GPU: every step on the CPU at toy
#                    sizes (Pallas interpret mode, gpt2-tiny); the files are NOT GPU results
#
# Exit status: 0 all steps passed; 2 no GPU (or no jax); 1 a step failed (the others still
# run; see suite.log in the results directory).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_ROOT="$ROOT/benchmarks/results/gpu"
MODELS="gpt2,bert-base,opt-125m"
MAX_GIB=""
ROUNDS=7
QUICK=0
DRY_RUN=0
SMOKE=0
PY="${PYTHON:-python}"
ORIG_ARGS="$*"

die() { echo "gpu_suite: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_ROOT="${2:?--out needs a directory}"; shift 2 ;;
    --models) MODELS="${2:?--models needs a list}"; shift 2 ;;
    --max-gib) MAX_GIB="${2:?--max-gib needs a number}"; shift 2 ;;
    --rounds) ROUNDS="${2:?--rounds needs a number}"; shift 2 ;;
    --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --cpu-smoke) SMOKE=1; shift ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

cd "$ROOT" || die "cannot cd to $ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's jaxfold, models, pallas_kernels

command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found (--python EXE)"
"$PY" -c "import jax" >/dev/null 2>&1 || die "jax is not importable with $PY (pip install -e '.[test]' 'jax[cuda12]')"

# ---- the GPU check: jax must see a CUDA device (not just a driver on the host) -----------------
GPU_INFO="$("$PY" - 2>/dev/null <<'EOF'
import jax
try:
  devs = jax.devices("gpu")
except RuntimeError:
  devs = []
if devs:
  d = devs[0]
  stats = {}
  try:
    stats = d.memory_stats() or {}
  except Exception:  # noqa: BLE001 - not every backend reports memory
    pass
  gib = stats.get("bytes_limit", 0) / 2**30
  print(f"{d.device_kind}|{len(devs)}|{gib:.1f}|{getattr(d, 'compute_capability', '')}")
EOF
)"
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  GPU_INFO="cpu-smoke (not a GPU)|0|0|"
  OUT_ROOT="${OUT_ROOT%/}-cpu-smoke"
elif [ -z "$GPU_INFO" ]; then
  if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_suite: no GPU visible to jax ($PY): a real run would exit here with status 2" >&2
    GPU_INFO="(no GPU)|0|80.0|"
  else
    die "no GPU visible to jax ($PY; jax.devices('gpu') is empty). This suite measures on a real NVIDIA GPU: \
install jax[cuda12] on a GPU machine, or use benchmarks/gpu_model.py / tokamax_compare.py for the deviceless model."
  fi
fi
IFS='|' read -r DEVICE NDEV GPU_GIB CC <<<"$GPU_INFO"
if [ -z "$MAX_GIB" ]; then
  MAX_GIB="$(awk -v g="$GPU_GIB" 'BEGIN { m = (g > 0 ? 0.6 * g : 40); printf "%.0f", m }')"
fi

DATE="$(date -u +%Y-%m-%d)"
DIR="$OUT_ROOT/$DATE"
if [ -e "$DIR" ] && [ "$DRY_RUN" = 0 ]; then
  DIR="$OUT_ROOT/${DATE}_$(date -u +%H%M%S)"   # never overwrite an earlier run of the day
fi

if [ "$SMOKE" = 1 ]; then
  KERNEL_ARGS=(--interpret --small --dtypes float32)
  FORWARD_ARGS=(--sizes 1x8 --warmup 1)
  MODELS="gpt2-tiny"; ROUNDS=2
elif [ "$QUICK" = 1 ]; then
  KERNEL_ARGS=(--rows 4096 --hidden 768 4096 --dtypes bfloat16 --reps 10)
  FORWARD_ARGS=(--sizes 2x256,8x1024)
else
  KERNEL_ARGS=()   # bench_rms_norm.py's sweep: 16384 rows x hidden 768/1024/4096/8192, f32 and bf16
  FORWARD_ARGS=(--grid paper)
fi

STEPS=(
  "kernel|$PY benchmarks/bench_rms_norm.py ${KERNEL_ARGS[*]} --update-table --out $DIR/rms_norm.md"
  "forward|$PY benchmarks/bench_forward.py ${FORWARD_ARGS[*]} --models $MODELS --max-gib $MAX_GIB --rounds $ROUNDS --out $DIR/forward.md"
)

echo "gpu_suite: device $DEVICE (x$NDEV, ${GPU_GIB} GiB, cc $CC); results -> $DIR"
if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_suite: --dry-run, would run:"
  for s in "${STEPS[@]}"; do echo "  [${s%%|*}] ${s#*|}"; done
  exit 0
fi

mkdir -p "$DIR" || die "cannot create $DIR"
LOG="$DIR/suite.log"
{
  echo "# GPU suite"
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "device: $DEVICE"
  echo "devices: $NDEV"
  echo "device_memory_gib: $GPU_GIB"
  echo "compute_capability: $CC"
  echo "host: $(hostname)"
  echo "command: $0 $ORIG_ARGS"
  echo "git_commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (dirty)')"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | sed 's/^/nvidia-smi: /'
  "$PY" - <<'EOF'
import importlib.metadata as md, platform
print(f"python: {platform.python_version()}")
for d in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax", "jaxfold"):
  try:
    print(f"{d}: {md.version(d)}")
  except md.PackageNotFoundError:
    print(f"{d}: not installed")
EOF
} >"$DIR/env.txt"
cat "$DIR/env.txt"

FAILED=0
for s in "${STEPS[@]}"; do
  name="${s%%|*}"; cmd="${s#*|}"
  echo "== [$name] $cmd" | tee -a "$LOG"
  t0=$(date +%s)
  # shellcheck disable=SC2086 # the command line is word-split on purpose
  $cmd 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s)
  echo "== [$name] exit $rc, $((t1 - t0)) s" | tee -a "$LOG"
  [ "$rc" = 0 ] || FAILED=1
done
echo "gpu_suite: results in $DIR (env.txt, rms_norm.md, forward.md, forward.png, suite.log)"
exit "$FAILED"
