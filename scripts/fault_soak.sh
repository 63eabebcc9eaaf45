#!/usr/bin/env bash
# Many short two-rank training runs back to back, each with a fault or none (issue 18, "under
# load"): run i is
#   clean   — must exit 0;
#   kill    — a random rank SIGKILLed at a random moment of a random step;
#   throw   — a random rank throws at a random op (PEFTPLAN_FAULT=rank:step:op);
#   stall   — a random rank stops at a random op and never returns (PEFTPLAN_FAULT=...:stall);
# over shared memory and TCP in turn (--mpi-args "--mca pml ob1 --mca btl tcp,self"), with a
# random strategy, checkpointing every step (every 25th in the longer runs a kill lands in). Each run must end within 30 s of its fault, leave
# no rank behind, and say which rank failed; then training resumes from the checkpoint folder's
# latest-good checkpoint and must finish (exit 0). One line per run, a summary at the end, exit
# 1 when any run broke a rule.
#
# usage: scripts/fault_soak.sh BUILD_DIR [RUNS (50)] [SEED]
set -uo pipefail
if [[ $# -lt 1 ]]; then echo "usage: $0 BUILD_DIR [RUNS] [SEED]" >&2; exit 2; fi
build="$(cd "$1" && pwd)"
runs="${2:-50}"
RANDOM="${3:-$$}"
cli="$build/cli/peftplan"
[[ -x "$cli" ]] || { echo "fault_soak.sh: no $cli (build first)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work="$(mktemp -d /tmp/peftplan_soak.XXXXXX)"
trap '((failures == 0)) && rm -rf "$work"' EXIT  # kept, with every log, when a run failed
corpus="$(cd "$(dirname "$0")/.." && pwd)/data/corpus.txt"
common=(--model tiny-llama-2l --seq-len 8 --micro-batch 1 --grad-accum 2 --lora-targets q_proj,v_proj
        --lora-dropout 0.1 --cluster 2xA100-80GB --tolerance-time 1e9 --rounds 1 --gpus 2
        --data "$corpus")
strategies=(ddp zero1 zero2 zero3)
modes=(clean kill throw stall)
declare -A count=() bad=()
failures=0

# The pids of a run's processes (their environment carries PEFTPLAN_SOAK_TAG=$1: mpirun and its
# ranks); with a second argument, only that rank's (Open MPI puts OMPI_COMM_WORLD_RANK in every
# rank's environment).
pids_of() {
  local p env
  for p in /proc/[0-9]*; do
    env=$(tr "\\0" "\\n" 2> /dev/null < "$p/environ") || continue
    grep -qx "PEFTPLAN_SOAK_TAG=$1" <<< "$env" || continue
    [[ $# -lt 2 ]] || grep -qx "OMPI_COMM_WORLD_RANK=$2" <<< "$env" || continue
    echo "${p#/proc/}"
  done
}

for ((i = 1; i <= runs; i++)); do
  mode="${modes[$((RANDOM % 4))]}"
  strategy="${strategies[$((RANDOM % 4))]}"
  transport=shm
  mpi=()
  if ((i % 2 == 0)); then transport=tcp; mpi=(--mpi-args "--mca pml ob1 --mca btl tcp,self"); fi
  # ops 40..139: past every strategy's setup ops and within every strategy's step (peftplan-exec
  # refuses a fault at an op no step runs)
  rank=$((RANDOM % 2)) step=$((RANDOM % 3)) op=$((40 + RANDOM % 100))
  tag="soak$$-$i"
  out="$work/run$i"
  env=(PEFTPLAN_SOAK_TAG="$tag" PEFTPLAN_WATCHDOG_S=5)
  steps=6 every=1
  case "$mode" in
    throw) env+=(PEFTPLAN_FAULT="$rank:$step:$op") ;;
    stall) env+=(PEFTPLAN_FAULT="$rank:$step:$op:stall") ;;
    kill) steps=2000 every=25 ;;  # long enough that the kill lands mid-run
  esac
  t0=$(date +%s.%N)
  env "${env[@]}" "$cli" run "${common[@]}" "${mpi[@]}" --strategy "$strategy" --steps "$steps" --checkpoint-every "$every" --out "$out" > "$work/log$i" 2>&1 &
  pid=$!
  fault_at=$t0
  if [[ "$mode" == kill ]]; then
    for ((w = 0; w < 600; w++)); do  # up to 30 s for step 2
      grep -q 'step 2/' "$work/log$i" 2> /dev/null && break
      sleep 0.05
    done
    sleep "0.$((RANDOM % 10))$((RANDOM % 10))"
    victim=$(pids_of "$tag" "$rank")
    fault_at=$(date +%s.%N)
    if [[ -n "$victim" ]]; then kill -9 "$victim"; else echo "run $i: rank $rank not found to kill" >> "$work/log$i"; fi
  fi
  code=0
  for ((w = 0; w < 1200; w++)); do  # 60 s at most, then it is a hang
    kill -0 "$pid" 2> /dev/null || break
    sleep 0.05
  done
  if kill -0 "$pid" 2> /dev/null; then
    kill -9 "$pid"; code=hang
  fi
  wait "$pid" 2> /dev/null
  rc=$?
  [[ "$code" == hang ]] || code=$rc
  took=$(awk -v a="$(date +%s.%N)" -v b="$fault_at" 'BEGIN { printf "%.1f", a - b }')
  sleep 0.5
  left=$(pids_of "$tag" | wc -l)
  problem=""
  case "$mode" in
    clean) [[ "$code" == 0 ]] || problem="exit $code" ;;
    *) [[ "$code" != 0 && "$code" != hang ]] || problem="exit $code"
       awk -v t="$took" 'BEGIN { exit !(t < 30) }' || problem+=" took ${took}s"
       grep -q "rank $rank" "$work/log$i" || problem+=" rank $rank not named" ;;
  esac
  ((left == 0)) || { problem+=" $left process(es) left"; pids_of "$tag" | xargs -r kill -9; }
  # The checkpoints survive: resume from the newest good one and finish.
  resumed="-"
  if compgen -G "$out/checkpoints/step-*" > /dev/null; then
    if env PEFTPLAN_SOAK_TAG="$tag-r" "$cli" run "${common[@]}" --strategy "$strategy" --steps $((steps + 1)) \
         --resume "$out/checkpoints/latest-good" --out "$out/resumed" > "$work/resume$i" 2>&1; then
      resumed=ok
    else
      resumed="exit $?"; problem+=" resume failed"
    fi
  fi
  count[$mode]=$((${count[$mode]:-0} + 1))
  line=$(printf 'run %2d %-5s %-5s %-3s rank %d step %d op %3d: exit %-4s %5.1f s, processes left %d, resume %s' \
         "$i" "$mode" "$strategy" "$transport" "$rank" "$step" "$op" "$code" "$took" "$left" "$resumed")
  if [[ -n "$problem" ]]; then
    failures=$((failures + 1)); bad[$mode]=$((${bad[$mode]:-0} + 1))
    echo "$line  FAILED:$problem (log: $work/log$i)"; grep -m3 -E 'error|outside|FAILED' "$work/log$i" | sed 's/^/    /'
  else
    echo "$line"
  fi
done
summary="fault_soak: $runs runs"
for m in "${modes[@]}"; do summary+=", $m ${count[$m]:-0} (${bad[$m]:-0} failed)"; done
echo "$summary"
((failures == 0)) || echo "logs kept in $work"
((failures == 0))
