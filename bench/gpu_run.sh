#!/usr/bin/env bash
# memfit's GPU check in one call of the device tool, on the lent machine as it is (kind nvidia-h200: Python 3.12,
# torch 2.11.0+cu130, no bitsandbytes, torchao, datatrove or memfit, nothing can be fetched; the device tool's
# KINDS.md). memfit runs from src/; bitsandbytes and torchao come from .gpu_carry/, packed here beforehand.
#
# 1. Here, in the checkout the session was started in (the device tool sends that checkout, also when a helper
#    calls it from another worktree):
#        .venv/bin/python bench/gpu_pack.py      # writes .gpu_carry/ (about 9 MiB; git-ignored) and sums the tree
# 2. The one call (about 9 minutes of the task's 15 minutes of device time):
#        run(command="bash bench/gpu_run.sh", carry=[".gpu_carry"], timeout_s=600)
# 3. Here, from the files that come back (files_at):
#        .venv/bin/python bench/gpu_estimate_check.py --compare FILES_AT/gpu_estimate.json.gz   # docs/benchmarks.md
#        cp FILES_AT/gpu_seed_table.md docs/gpu_seed_table.md
#
# Steps, in order of value, each under its own time limit (a failure or a timeout costs only that step), all
# within GPU_RUN_SECONDS (540 s: the tool's 600 s less the start and the copies); time an earlier step leaves
# unused goes to the later ones:
#   env       bench/gpu_env_check.py: versions, where each package comes from, bitsandbytes' CUDA library, two
#             train_steps of the tiny model per bitsandbytes optimizer, in backward, QLoRA          (60 s)
#   pretrain  `memfit pretrain` (the main job: Tiny Shakespeare, BPE) on CUDA with track_memory; its step
#             records (metrics.jsonl), memory_timeline.png and loss.png come back                 (90 s)
#   estimate  bench/gpu_estimate_check.py --measure: the estimator's configurations, measured      (270 s)
#   seed      bench/gpu_seed_table.py: Llama-3-8B, the bitsandbytes optimizers in backward          (120 s)
# What comes back under $OUT (the tool returns at most 8 files): run.log (everything, with timestamps), env.json,
# metrics.jsonl, memory_timeline.png, loss.png, gpu_estimate.json.gz, gpu_seed_table.md.
#
# GPU_RUN_DRY=1 runs every step on CPU with the tiny model (tests/test_gpu_run.py, about a minute here);
# PYTHON (python3), OUT (the tool sets it), GPU_RUN_CARRY (.gpu_carry) and GPU_RUN_STEPS ("env pretrain estimate
# seed") may be set.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
DRY="${GPU_RUN_DRY:-0}"
OUT="${OUT:-/tmp/gpu_run_out}"
WORK="$(mktemp -d /tmp/gpu_run.XXXXXX)"
CARRY="${GPU_RUN_CARRY:-$ROOT/.gpu_carry}"
STEPS="${GPU_RUN_STEPS:-env pretrain estimate seed}"
TOTAL="${GPU_RUN_SECONDS:-540}"
declare -A BUDGET=([env]=60 [pretrain]=90 [estimate]=270 [seed]=120)
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
START=$(date +%s)

export PYTHONPATH="$CARRY:$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

say() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    PRETRAIN=(--config configs/tiny_test.yaml max_steps=6 log_every=2 eval_every=3 eval_batches=1
        checkpoint_every=6 sample.max_new_tokens=8)
    ESTIMATE=(--dry-run)
    SEED=(--dry-run)
else
    DEVICE=cuda
    PRETRAIN=()
    ESTIMATE=()
    SEED=()
fi

# run NAME CMD...: CMD under the step's time limit (its budget plus what earlier steps left, less the budgets of
# the steps after it), its output into run.log and stdout
RESULTS=()
run() {
    local name=$1
    shift
    local now later=0 seen=0 step limit status
    now=$(date +%s)
    for step in $STEPS; do
        [ "$seen" = 1 ] && later=$((later + ${BUDGET[$step]}))
        [ "$step" = "$name" ] && seen=1
    done
    limit=$((TOTAL - (now - START) - later))
    if [ "$limit" -lt 10 ]; then
        say "step $name: skipped (${limit}s left for it)"
        RESULTS+=("$name: skipped")
        return
    fi
    say "step $name: start (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    case $status in
        0) RESULTS+=("$name: ok") ;;
        124 | 137) RESULTS+=("$name: TIMED OUT after ${limit}s") ;;
        *) RESULTS+=("$name: FAILED (exit $status)") ;;
    esac
    say "step $name: ${RESULTS[-1]#*: } ($(($(date +%s) - now))s)"
}

say "memfit GPU check: dry=$DRY device=$DEVICE python=$(command -v "$PY") root=$ROOT work=$WORK"
[ -d "$CARRY" ] || say "WARNING: no carried packages at $CARRY (run bench/gpu_pack.py here and carry .gpu_carry)"
[ -f "$CARRY/MANIFEST.json" ] && say "carried: $(tr -d '\n ' <"$CARRY/MANIFEST.json")"
command -v nvidia-smi >/dev/null && nvidia-smi 2>&1 | tee -a "$LOG" >/dev/null

for step in $STEPS; do
    case $step in
        env) run env "$PY" bench/gpu_env_check.py --device "$DEVICE" --out "$OUT/env.json" ;;
        pretrain)
            run pretrain "$PY" -m memfit pretrain "${PRETRAIN[@]}" device="$DEVICE" track_memory=true \
                output_dir="$WORK/pretrain" tensorboard=false progress_bar=false
            for f in metrics.jsonl memory_timeline.png loss.png; do
                [ -f "$WORK/pretrain/$f" ] && cp "$WORK/pretrain/$f" "$OUT/$f"
            done
            ;;
        estimate) run estimate "$PY" bench/gpu_estimate_check.py "${ESTIMATE[@]}" --measure "$OUT/gpu_estimate.json.gz" ;;
        seed) run seed "$PY" bench/gpu_seed_table.py "${SEED[@]}" --out "$OUT/gpu_seed_table.md" ;;
        *) say "unknown step '$step' in GPU_RUN_STEPS (known: env pretrain estimate seed)" && exit 2 ;;
    esac
done

# --- the summary, last: the tool's reply carries the end of the output ----------------------------------------
"$PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import gzip, json, sys
from pathlib import Path

out = Path(sys.argv[1])
GIB = 1024**3
env = out / "env.json"
if env.is_file():
    e = json.loads(env.read_text())
    print(f"env: python {e['python']}, torch {e['torch']} (CUDA {e['torch_cuda']}), {e['device']}")
    print(f"  missing: {', '.join(e['missing']) or 'none'}")
    for name, c in e["checks"].items():
        print(f"  {name}: {'ok' if c.get('ok') else 'FAILED ' + c.get('error', '')[:200]}")
metrics = out / "metrics.jsonl"
if metrics.is_file():
    train = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    if train:
        last = train[-1]
        print(
            f"pretrain: {len(train)} records, step {last['step']} loss {last['loss']:.4f}, "
            f"{last['tokens_per_second_per_gpu']:,.0f} tok/s, peak_memory_reserved {last.get('peak_memory_reserved')} GiB"
        )
estimate = out / "gpu_estimate.json.gz"
if estimate.is_file():
    data = json.loads(gzip.decompress(estimate.read_bytes()))
    print(f"estimate check ({len(data['results'])} configurations measured):")
    for name, m in data["results"].items():
        if "error" in m:
            print(f"  {name}: FAILED {m['error'][:200]}")
        else:
            print(
                f"  {name}: alloc {m['peak_alloc_bytes'] / GIB:.2f} GiB, reserved {m['peak_reserved_bytes'] / GIB:.2f} "
                f"GiB, {m['tokens_per_second']:,.0f} tok/s, {len(m['allocator_events'])} events"
            )
seed = out / "gpu_seed_table.md"
if seed.is_file():
    print(seed.read_text())
for f in sorted(out.iterdir()):
    print(f"  $OUT/{f.name}: {f.stat().st_size:,} bytes")
EOF
say "steps: ${RESULTS[*]/%/;}"
say "done in $(($(date +%s) - START))s"
rm -rf "$WORK" "$OUT"/*.tmp
for r in "${RESULTS[@]}"; do [ "${r#*: }" = ok ] || exit 1; done
exit 0
