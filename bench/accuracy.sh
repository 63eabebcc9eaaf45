#!/usr/bin/env bash
# Accuracy of the simulator against the CPU executor on this machine: runs the matrix end to end
# with `peftplan run` (strategies DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-2 + optimizer offload,
# ZeRO-3 + optimizer offload × 1, 2, 4 ranks × checkpointing none/full × base fp32/bf16 ×
# tiny-llama-2l/tiny-llama-4l, eager attention; and DDP, ZeRO-2 and ZeRO-3 with flash attention,
# without checkpointing, fp32), one calibration per rank count (`peftplan calibrate --ranks N`),
# with every configuration's rounds interleaved over the whole matrix (pass k runs each once; then
# `peftplan compare` combines the rounds), and prints one row per configuration — the worst
# memory category's error, the peak's error,
# the step-time error with its spread (the interquartile range of the rounds, as a share of the
# measured step), the machine's speed against calibration (the speed probe's drift, median of the
# rounds) and verdict, and the op that differs most — then the median and worst |step-time
# error|, over every configuration and over the conclusive ones.
# Not a ctest: it is a benchmark (about 25 minutes with 5 rounds; --quick: a subset in about two).
#
# --judge DIR judges the rounds recorded in DIR by an earlier run again (peftplan compare only: no
# calibration, no run), as the build given judges them — how a change to the verdict reads on the
# same measurements.
#
# usage: bench/accuracy.sh [--quick] [--build DIR] [--steps K] [--rounds R] [--out DIR | --judge DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$here/build/acc"
quick=0
steps=10  # 4 ranks on 2 cores settle over several steps; the median of the steps after the first is compared
rounds=5  # peftplan run's default: the median of 5 interleaved rounds
out=""
judge=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) quick=1 ;;
    --build) build="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    --out) out="$2"; shift ;;
    --judge) out="$2"; judge=1; shift ;;
    *) echo "usage: $0 [--quick] [--build DIR] [--steps K] [--rounds R] [--out DIR | --judge DIR]" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$out" ]] || out="$(mktemp -d /tmp/peftplan-accuracy.XXXXXX)"
if [[ $judge == 1 && ! -f "$out/configs.txt" ]]; then echo "--judge $out: no configs.txt there (not an accuracy run's folder)" >&2; exit 2; fi
peftplan="$build/cli/peftplan"
[[ -x "$peftplan" ]] || { echo "no $peftplan (build first)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
data="$here/README.md"

if [[ $quick == 1 ]]; then
  ranks_list=(2); strategies=(ddp zero2 zero3+off); ckpts=(none); bases=(fp32); models=(tiny-llama-2l tiny-llama-4l)
  flash_strategies=(ddp zero3+off)
else
  ranks_list=(2 4 1); strategies=(ddp zero1 zero2 zero3 zero2+off zero3+off); ckpts=(none full); bases=(fp32 bf16)
  models=(tiny-llama-2l tiny-llama-4l); flash_strategies=(ddp zero2 zero3)
fi

# Sizes with a step of tens of milliseconds on 2 cores (timing resolution and noise).
size_flags() {
  case "$1" in
    tiny-llama-2l) echo "--micro-batch 8 --seq-len 256" ;;
    tiny-llama-4l) echo "--micro-batch 4 --seq-len 256" ;;
  esac
}

mkdir -p "$out"
rows="$out/rows.tsv"
: > "$rows"
# The configurations, one per line: name, rank count, then peftplan run's flags.
configs="$out/configs.txt"
if [[ $judge == 0 ]]; then
  : > "$configs"
  for n in "${ranks_list[@]}"; do
    for model in "${models[@]}"; do
      for strat in "${strategies[@]}"; do
        flags="--strategy ${strat%+off}"
        [[ "$strat" == *+off ]] && flags="$flags --offload-optimizer cpu"
        for ck in "${ckpts[@]}"; do
          for base in "${bases[@]}"; do
            echo "$model.n$n.$strat.ckpt-$ck.$base $n --model $model --lora-r 8 --lora-alpha 16 --lora-targets all-linear --gpus $n $flags --checkpointing $ck --base-dtype $base $(size_flags "$model")" >> "$configs"
          done
        done
        # flash attention (the fused kernels) beside eager, without checkpointing, fp32 base
        [[ " ${flash_strategies[*]} " == *" $strat "* ]] &&
          echo "$model.n$n.$strat.ckpt-none.fp32.flash $n --model $model --lora-r 8 --lora-alpha 16 --lora-targets all-linear --gpus $n $flags --checkpointing none --base-dtype fp32 --attention flash $(size_flags "$model")" >> "$configs"
      done
    done
  done
  # one profile per rank count: a profile's rates are per rank with that many ranks sharing the cores
  for n in "${ranks_list[@]}"; do
    cal="$out/calibration.$n.json"
    [[ -f "$cal" ]] || "$peftplan" calibrate --ranks "$n" --quick --out "$cal" > "$out/calibrate.$n.log" 2>&1
  done
  # Rounds interleaved over the whole matrix: pass k runs every configuration once (one round), so a
  # slow spell of the machine lands on one round of many configurations, not on every round of one;
  # then `peftplan compare` combines each configuration's rounds (the median, the spread) as
  # `peftplan run --rounds` does.
  for k in $(seq 1 "$rounds"); do
    while read -r name n args; do
      dir="$out/$name"
      # shellcheck disable=SC2086
      "$peftplan" run $args --steps "$steps" --rounds 1 --data "$data" --calibration "$out/calibration.$n.json" \
        --out "$dir/round-$k" < /dev/null > "$dir.round-$k.log" 2>&1 || true  # mpirun would read the list
    done < "$configs"
  done
fi
while read -r name n args; do
  dir="$out/$name"
  measurements=()
  for k in $(seq 1 "$rounds"); do
    [[ -f "$dir/round-$k/measurement.json" ]] && measurements+=("$dir/round-$k/measurement.json")
  done
  if [[ ${#measurements[@]} -gt 0 ]]; then
    "$peftplan" compare "$dir/round-1/plan.json" "${measurements[@]}" --out "$dir" < /dev/null > "$dir.log" 2>&1 || true
  fi
  if [[ -f "$dir/validation.json" ]]; then
    python3 - "$dir/validation.json" "$name" >> "$rows" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
mem = {k: x["relative_error"] for k, x in v["memory"].items() if k != "peak"}
worst = max(mem, key=lambda k: abs(mem[k])) if mem else "-"
st = v["time"]["step_s"]
op = v.get("most_different_op") or {}
what = f'{op.get("kernel","?")} {op.get("label","")}'.strip()
if "op" in op: what = f'op {op["op"]} {what} ({op["phase"]}, L{op["layer"]})'
what += f' {1e3*op.get("predicted_s",0):.2f}/{1e3*op.get("measured_s",0):.2f} ms'
spread = st.get("spread_s")
spread = f'{100*spread/st["measured"]:.1f}%' if spread is not None and st["measured"] > 0 else "-"
drift = (v.get("speed_probe") or {}).get("drift")
drift = f'{100*drift:+.1f}%' if drift is not None else "-"
print(f'{sys.argv[2]}\t{worst} {100*mem.get(worst,0):+.2f}%\t{100*v["memory"]["peak"]["relative_error"]:+.2f}%\t'
      f'{1e3*st["predicted"]:.1f}\t{1e3*st["measured"]:.1f}\t{100*st["relative_error"]:+.1f}%\t{spread}\t{drift}\t{st.get("verdict","?")}\t{what}')
PY
  else
    echo -e "$name\tFAILED (see $dir.log)\t-\t-\t-\t-\t-\t-\t-\t-" >> "$rows"
  fi
done < "$configs"

python3 - "$rows" <<'PY'
import sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
print(f'{"configuration":48} {"worst memory category":28} {"peak":>8} {"pred ms":>8} {"meas ms":>8} {"step err":>9} {"spread":>7} {"drift":>7} {"verdict":>12}  op that differs most (pred/meas)')
errs, conclusive, drifts = [], [], []
for r in rows:
    print(f'{r[0]:48} {r[1]:28} {r[2]:>8} {r[3]:>8} {r[4]:>8} {r[5]:>9} {r[6]:>7} {r[7]:>7} {r[8]:>12}  {r[9]}')
    if r[7].endswith("%"): drifts.append(abs(float(r[7][:-1])))
    if r[5].endswith("%"):
        errs.append(abs(float(r[5][:-1])))
        if r[8] != "inconclusive": conclusive.append(abs(float(r[5][:-1])))
failed = sum(1 for r in rows if not r[5].endswith("%"))
if errs:
    print(f"\n{len(errs)} configurations ({failed} failed): step-time |error| median {statistics.median(errs):.1f}%, worst {max(errs):.1f}%")
    if conclusive:
        print(f"{len(conclusive)} conclusive ({len(errs) - len(conclusive)} inconclusive): median {statistics.median(conclusive):.1f}%, worst {max(conclusive):.1f}%")
    if drifts:
        print(f"machine speed against calibration (the speed probe, |drift|): median {statistics.median(drifts):.1f}%, worst {max(drifts):.1f}%")
else:
    print(f"\nno configuration ran ({failed} failed)")
PY
echo "runs in $out"
