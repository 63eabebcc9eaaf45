#!/usr/bin/env bash
# The GPU checks of issue 17 in one run, for a GPU machine that has CUDA, CMake, ninja and
# PyTorch with transformers and PEFT but none of our Debian packages and no network:
#   scripts/device-prepare.sh            # on the build machine: .device/deps, carried with the tree
#   scripts/device-check.sh DIR          # on the GPU machine, from the repository root
# It builds what the checks need from the carried tree (build/device, the `device` preset),
# runs the backend-ops tests and the NCCL communicator's on the GPU (ctest -L device), the cuBLAS GEMM throughput at the 1B
# model's shapes, plan-and-run on the GPU at one rank (no mpirun) for DDP and ZeRO-3 (and DDP with flash attention, in fp32 and
# in bf16 mixed precision, and ZeRO-2 with the optimizer offloaded in bf16), and a
# transformers + PEFT run of the same model captured by tools/peftplan_callback.py and compared
# with `plan --profile hf`, and PEFT's PeftModel.from_pretrained on the adapter our executor
# trained, its loss against ours. Logs and figures go to DIR; the summary to stdout. Exit code 0 when
# every check passed, 1 when one failed (the others still run), 2 on a missing prerequisite.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/device-check.sh DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$SECONDS
status=0
step() { echo "== [$((SECONDS - t0)) s] $*"; }
failed() { echo "FAILED: $*"; status=1; }
jobs=$(nproc)

step "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  cmake --version | head -1
  python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
} 2>&1 | tee "$out/env.txt"

if [[ ! -d .device/deps ]]; then
  echo "device-check: .device/deps is missing: run scripts/device-prepare.sh on the build machine and carry .device" >&2
  exit 2
fi

# NCCL for the NCCL communicator: the system's where CMake finds it (CUDA's or /usr's include
# folder), else the one PyTorch's wheels carry (nvidia-nccl-cu*: include/nccl.h, lib/libnccl.so.2).
nccl=()
if ! ls "${CUDA_HOME:-/usr/local/cuda}/include/nccl.h" /usr/include/nccl.h >/dev/null 2>&1; then
  wheel=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
  if [[ -n "$wheel" && -f "$wheel/include/nccl.h" && -f "$wheel/lib/libnccl.so.2" ]]; then
    nccl=(-DNCCL_INCLUDE_DIR="$wheel/include" -DNCCL_LIBRARY="$wheel/lib/libnccl.so.2")
  fi
fi

step "configure and build (build/device, $jobs jobs)"
if ! cmake --preset device "${nccl[@]}" >"$out/configure.log" 2>&1; then
  tail -40 "$out/configure.log"
  exit 2
fi
grep -E "peftplan: (CUDA|NCCL)" "$out/configure.log"
if ! cmake --build --preset device -j "$jobs" --target test_backend_ops test_executor test_comm_nccl peftplan peftplan-exec peftplan-cuda-gemm \
    >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40
  exit 2
fi
bin=build/device

step "device tests: backend-ops on the GPU, a training step against the CPU backend's, the NCCL communicator at one rank (ctest -L '^device$')"
if (cd "$bin" && ctest -L '^device$' --output-on-failure) >"$out/device-tests.log" 2>&1; then
  grep -E "tests passed|Total Test time" "$out/device-tests.log"
else
  grep -E "Failed|failed|Error" "$out/device-tests.log" | head -40
  failed "device tests"
fi
if grep -q "Skipped" "$out/device-tests.log"; then grep -B2 "Skipped" "$out/device-tests.log" | head -20; failed "device tests skipped on a GPU machine"; fi

step "cuBLAS GEMM throughput at tinyllama-1.1b's shapes (M = 4 x 1024 tokens)"
"$bin/executor/peftplan-cuda-gemm" --model tinyllama-1.1b --tokens 4096 --json "$out/gemm.json" 2>&1 | tee "$out/gemm.txt" ||
  failed "GEMM probe"

# One plan-and-run of the 1B job on the GPU at one rank: its folder under DIR, what to call it
# when it fails, then the flags that differ between the jobs.
gpu_run() {
  local dir=$1 what=$2
  shift 2
  if "$bin/cli/peftplan" run --model tinyllama-1.1b --gpus 1 --lora-r 16 --lora-alpha 16 \
      --lora-targets q_proj,k_proj,v_proj,o_proj --lora-dropout 0.1 --micro-batch 4 --seq-len 1024 --steps 8 --rounds 2 \
      "$@" --out "$out/$dir" >"$out/$dir.log" 2>&1; then
    tail -60 "$out/$dir.log"
  else
    tail -80 "$out/$dir.log"
    failed "$what"
  fi
}
step "plan-and-run on the GPU: tinyllama-1.1b, LoRA r 16 on q,k,v,o, one rank, DDP and ZeRO-3"
export XDG_CACHE_HOME="$out/cache" PEFTPLAN_BACKEND=cuda
gpu_run run "plan-and-run on the GPU" --strategy ddp,zero3
step "plan-and-run on the GPU with flash attention (the fused CUDA kernels): the same job, DDP"
gpu_run run-flash "plan-and-run on the GPU with flash attention" --strategy ddp --attention flash
step "plan-and-run on the GPU in bf16 mixed precision with flash attention (what users run: bf16 GEMMs, the fused kernels on bf16, fp32 masters): the same job, DDP"
gpu_run run-bf16 "plan-and-run on the GPU in bf16 with flash attention" --strategy ddp --precision bf16 --attention flash
step "plan-and-run on the GPU with the optimizer offloaded (gradients out and weights back on the copy stream, AdamW on the host), bf16, flash: the same job, ZeRO-2"
gpu_run run-offload "plan-and-run on the GPU with the optimizer offloaded" --strategy zero2 --offload-optimizer cpu --precision bf16 --attention flash
# The memory kinds beyond allocated, measured on the device (measurement.json), and the losses.
python3 - "$out/run" "$out/run-flash" "$out/run-bf16" "$out/run-offload" <<'PY' || failed "reading the GPU run's measurements"
import json, pathlib, sys
for m in sorted(p for d in sys.argv[1:] for p in [*pathlib.Path(d).glob("*/measurement.json"), *pathlib.Path(d).glob("measurement.json")]):
    j = json.loads(m.read_text()); d = j["memory"]["device"]; g = 2.0 ** 30
    losses = j.get("losses", [])
    print(f"{m.parent.relative_to(m.parents[1])}: allocated peak {d['peak_bytes'] / g:.3f} GiB, reserved peak {d.get('reserved_peak_bytes', 0) / g:.3f} GiB, "
          f"in use {d.get('in_use_bytes', 0) / g:.3f} GiB of {d.get('total_bytes', 0) / g:.1f}; "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no losses")
PY
unset PEFTPLAN_BACKEND

step "transformers + PEFT, captured by tools/peftplan_callback.py, compared with plan --profile hf"
if [[ -f tools/device/hf_train.py ]]; then
  if PYTHONUNBUFFERED=1 python3 tools/device/hf_train.py --out "$out/hf" --steps 12 >"$out/hf.log" 2>&1; then
    tail -20 "$out/hf.log"
    if [[ -x tools/device/hf_compare.sh ]]; then
      PEFTPLAN="$bin/cli/peftplan" tools/device/hf_compare.sh "$out/hf" 2>&1 | tee "$out/hf-compare.txt"
    fi
  else
    tail -40 "$out/hf.log"
    failed "transformers + PEFT run"
  fi
else
  echo "tools/device/hf_train.py not in this tree: skipped"
fi

step "PEFT loads the adapter our executor trained on the GPU, and computes our loss with it (tools/device/peft_adapter_check.py)"
if PEFTPLAN_BACKEND=cuda python3 tools/device/peft_adapter_check.py --out "$out/peft" --peftplan "$bin/cli/peftplan" --device cuda \
    >"$out/peft.log" 2>&1; then
  tail -5 "$out/peft.log"
else
  tail -30 "$out/peft.log"
  failed "PEFT adapter check"
fi

step "done: exit $status"
exit $status
