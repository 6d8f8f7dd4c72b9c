#!/usr/bin/env bash
# The device checks of issues 59-61 on a lent GPU, as one bounded run (docs/nccl.md says what ran).
#
#   bash benchmarks/gpu_session.sh OUT_DIR [STAGE ...]     (stages: check drills tests snapshot finite pinned;
#                                                           default: all, in that order;
#                                                           NCCLGUARD_DRILLS="ddp-slow ..." picks the drills)
#
# Expects ncclguard's dependencies that the machine's image lacks as wheels in .whl/ (pydantic,
# pydantic-core, pydantic-settings, python-dotenv, annotated-types, typing-inspection); installs them
# and ncclguard itself (from this tree) into the machine's python, then runs, each under its own bound:
#   1. benchmarks/nccl_device_check.py: two NCCL ranks on one GPU (NCCL_HOSTID), the release by abort,
#      a new communicator, the heal's transports, a heal;
#   2. benchmarks/nccl_drill.py --backend nccl: the kill and stuck drills (DDP, FSDP2) on real NCCL,
#      only if 1 found two ranks on one GPU working;
#   3. the test files that skip without CUDA; 4. benchmarks/cuda_snapshot_step.py (snapshots through
#   pinned memory, the caching host allocator's reservation); 5. benchmarks/finite_check_cuda.py (a
#   short and a longer step); 6. benchmarks/pinned_hold.py (pinned by torch's caching allocator, or
#   registered in place).
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [STAGE ...]}
shift
stages=" ${*:-check drills tests snapshot finite pinned} "
on() { [[ "$stages" == *" $1 "* ]]; }
mkdir -p "$out"
py=python3
log="$out/session.log"
say() { echo "== $* ($(date -u +%T))" | tee -a "$log"; }

say install
$py -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >>"$log" 2>&1
$py -m pip install -q --no-index --no-deps --no-build-isolation . >>"$log" 2>&1 || { tail -30 "$log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
$py -c 'import torch, ncclguard, ncclguard.recording.flight as f; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())' 2>&1 | tee -a "$log"

two=0
if on check; then
  say "1. two NCCL ranks on one GPU"
  NCCL_DEBUG=WARN timeout -k 5 120 $py benchmarks/nccl_device_check.py --json "$out/nccl_device_check.json" 2>&1 | tail -n 60 | tee -a "$log"
  two=${PIPESTATUS[0]}
  grep -q '"ok": true' "$out/nccl_device_check.json" 2>/dev/null && two=0
fi

if ! on drills; then
  :
elif [ "$two" = 0 ]; then
  say "2. the drills on real NCCL"
  # NCCLGUARD_DRILLS picks and orders the drills (default: all three, the one never run on a GPU second)
  # shellcheck disable=SC2086
  NCCL_DEBUG=WARN timeout -k 5 330 $py benchmarks/nccl_drill.py --backend nccl --drills ${NCCLGUARD_DRILLS:-ddp-kill fsdp2-kill ddp-stuck} \
    --json "$out/nccl_drill.json" --logs /tmp/drill-logs 2>&1 | tee -a "$log"
  tar czf "$out/drill-logs.tgz" -C /tmp drill-logs 2>/dev/null
else
  say "2. skipped: two NCCL ranks did not run on one GPU (step 1 says what NCCL said)"
fi

if on tests; then
  say "3. the tests that skip without CUDA"
  timeout -k 5 90 $py -m pytest -q -p no:cacheprovider -o addopts="" tests/watching/test_watching_nccl.py tests/recovery/test_host_memory.py 2>&1 | tail -n 30 | tee -a "$log"
fi
if on snapshot; then
  say "4. snapshots of CUDA state through pinned memory"
  timeout -k 5 90 $py benchmarks/cuda_snapshot_step.py --width 4096 --layers 8 --json "$out/cuda_snapshot_step.json" 2>&1 | tail -n 40 | tee -a "$log"
fi
if on finite; then
  say "5. the NaN check's cost on the GPU (batch 64, then 2048)"
  timeout -k 5 90 $py benchmarks/finite_check_cuda.py --json "$out/finite_check_cuda.json" 2>&1 | tail -n 5 | tee -a "$log"
  timeout -k 5 90 $py benchmarks/finite_check_cuda.py --batch 2048 --json "$out/finite_check_cuda_b2048.json" 2>&1 | tail -n 5 | tee -a "$log"
fi
if on pinned; then
  say "6. pinned host memory held, by the way it is pinned"
  timeout -k 5 90 $py benchmarks/pinned_hold.py --json "$out/pinned_hold.json" 2>&1 | tail -n 5 | tee -a "$log"
fi
say end
