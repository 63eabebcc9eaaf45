#!/usr/bin/env bash
# Is calibration repeatable? Calibrates this machine K times in a row (`peftplan calibrate
# --ranks N --quick`, each a fresh measurement) and predicts the main job's step (`peftplan run`'s
# default: tiny-llama-4l, PEFT's default LoRA, B 4 x S 128, the executor profile) for DDP, ZeRO-2
# and ZeRO-3 on every profile, then prints each profile's predictions, the calibration programs'
# own spread (the interquartile range of their rounds, from each profile's measurements file), its
# machine-speed probe as calibration began and ended and, per strategy, how far the predictions
# of the K profiles lie apart (max/min - 1), beside how far the probes do: on an idle machine the
# predictions should land within a few percent of each other, and when they do not the probes
# tell whether the machine's speed moved. Each profile's predictions are also shown scaled to the
# first profile's machine speed (step x reference_k / reference_1, reference_step_GFLOPs being
# the reference step program's rate as each calibration measured it), and how far those lie
# apart: what is left when the machine's own drift between calibrations is taken out. Not a ctest: a benchmark (about 40 s per calibration on 2 cores).
#
# usage: bench/calibration_repeat.sh [--times K] [--ranks N] [--build DIR] [--out DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$here/build/release"
times=3
ranks=2
out="$(mktemp -d /tmp/peftplan-calibration-repeat.XXXXXX)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --times) times="$2"; shift ;;
    --ranks) ranks="$2"; shift ;;
    --build) build="$2"; shift ;;
    --out) out="$2"; shift ;;
    *) echo "usage: $0 [--times K] [--ranks N] [--build DIR] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
peftplan="$build/cli/peftplan"
[[ -x "$peftplan" ]] || { echo "no $peftplan (build first)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$out"
for k in $(seq 1 "$times"); do
  "$peftplan" calibrate --ranks "$ranks" --quick --out "$out/cal.$k.json" > "$out/cal.$k.log" 2>&1
  for s in ddp zero2 zero3; do
    "$peftplan" plan --model tiny-llama-4l --gpus "$ranks" --strategy "$s" --profile executor --precision fp32 --attention eager \
      --micro-batch 4 --seq-len 128 --cluster "$out/cal.$k.json" --json > "$out/plan.$k.$s.json" || true
  done
done
/usr/bin/env python3 - "$out" "$times" <<'PY'
import json, sys
out, times = sys.argv[1], int(sys.argv[2])
strategies = ["ddp", "zero2", "zero3"]
pred = {s: [] for s in strategies}
scaled = {s: [] for s in strategies}
probes, refs = [], []
print(f'{"calibration":12} ' + " ".join(f"{s + ' step (ms)':>16}" for s in strategies) + "   at cal. 1's speed (ms)      "
      + "reference GFLOP/s   probe GFLOP/s (begin/end)   programs' spread (IQR of 5 rounds / median)")
for k in range(1, times + 1):
    row = []
    m = json.load(open(f"{out}/cal.{k}.measurements.json"))
    ref = m["speed_probe"]["reference_step_GFLOPs_per_rank"]
    refs.append(ref)
    at = []
    for s in strategies:
        t = json.load(open(f"{out}/plan.{k}.{s}.json"))["time"]["step_s"]
        pred[s].append(t)
        scaled[s].append(t * ref / refs[0])
        row.append(f"{1e3 * t:16.3f}")
        at.append(f"{1e3 * t * ref / refs[0]:7.3f}")
    spreads = [p["spread_ms"] / p["step_ms"] for p in m["programs"] if p["step_ms"] > 0]
    b, e = m["speed_probe"]["before_GFLOPs_per_rank"], m["speed_probe"]["after_GFLOPs_per_rank"]
    probes.append((b + e) / 2)
    print(f"{k:<12} " + " ".join(row) + "   " + " ".join(at) + f"   {ref:17.2f}   {b:12.2f} / {e:6.2f}        median "
          + f"{100 * sorted(spreads)[len(spreads) // 2]:.1f}%, worst {100 * max(spreads):.1f}%")
print("apart (max/min - 1): " + ", ".join(f"{s} {100 * (max(v) / min(v) - 1):.1f}%" for s, v in pred.items())
      + f"; at one speed: " + ", ".join(f"{s} {100 * (max(v) / min(v) - 1):.1f}%" for s, v in scaled.items())
      + f"; the reference rates {100 * (max(refs) / min(refs) - 1):.1f}%, the probes (mean of begin and end) "
      + f"{100 * (max(probes) / min(probes) - 1):.1f}%")
PY
echo "profiles and logs in $out"
