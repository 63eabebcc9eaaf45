#!/usr/bin/env bash
# Plans the job tools/device/hf_train.py ran and compares it with what it measured:
#   python3 tools/device/hf_train.py --out DIR        (writes DIR/<model>/config.json, measurement.json, plan-args.txt)
#   tools/device/hf_compare.sh DIR                    (PEFTPLAN=path/to/peftplan, default build/release/cli/peftplan)
# which runs
#   peftplan plan $(cat DIR/plan-args.txt) --write-plan DIR/plan.json --json > DIR/plan-output.json
#   peftplan plan $(cat DIR/plan-args.txt) > DIR/plan.txt            (the same plan, as text)
#   peftplan compare DIR/plan.json DIR/measurement.json --out DIR/compare
# `compare` needs plan.json as --write-plan (or `peftplan run`) writes it (schema peftplan.plan):
# the configuration and the cluster; `plan --json`'s output is the prediction, kept beside it.
# compare's exit status is printed, not passed on: 1 (a figure outside the hf profile's
# tolerances) is a finding on a machine whose torch/transformers/peft are not the ones the profile
# models. Exit 0 when both commands ran (compare 0 or 1), 2 when the plan failed, compare refused
# its input (2: another model, a field missing) or a file is missing.
set -uo pipefail
dir=${1:?usage: tools/device/hf_compare.sh DIR (the --out folder of tools/device/hf_train.py)}
root=$(cd "$(dirname "$0")/../.." && pwd)
peftplan=${PEFTPLAN:-$root/build/release/cli/peftplan}
if [[ ! -x $peftplan ]]; then
  echo "hf_compare: no peftplan at $peftplan (set PEFTPLAN)" >&2
  exit 2
fi
for f in plan-args.txt measurement.json; do
  if [[ ! -f $dir/$f ]]; then
    echo "hf_compare: $dir/$f is missing (run tools/device/hf_train.py --out $dir first)" >&2
    exit 2
  fi
done
mapfile -t args <"$dir/plan-args.txt"

echo "\$ peftplan plan ${args[*]} --write-plan $dir/plan.json --json > $dir/plan-output.json"
"$peftplan" plan "${args[@]}" --write-plan "$dir/plan.json" --json >"$dir/plan-output.json"
plan_rc=$?
"$peftplan" plan "${args[@]}" >"$dir/plan.txt" 2>&1
sed -n '1,3p' "$dir/plan.txt"
grep -E '^  (allocated|reserved|used) peak|^  step  |^verdict' "$dir/plan.txt"
# plan exits 1 when the plan does not fit; plan.json is written either way.
if [[ $plan_rc -gt 1 || ! -f $dir/plan.json ]]; then
  echo "hf_compare: peftplan plan failed (exit $plan_rc)" >&2
  exit 2
fi

echo "\$ peftplan compare $dir/plan.json $dir/measurement.json --out $dir/compare"
"$peftplan" compare "$dir/plan.json" "$dir/measurement.json" --out "$dir/compare" 2>&1
rc=$?
case $rc in
  0) echo "hf_compare: compare exit 0 (every conclusive figure within the hf profile's tolerances)" ;;
  1) echo "hf_compare: compare exit 1 (a figure outside the hf profile's tolerances; not fatal: this machine's libraries are not the profile's)" ;;
  *) echo "hf_compare: compare exit $rc (refused its input)" >&2
     exit 2 ;;
esac

# The library versions the profile models against those that ran, and the parameter counts.
python3 - "$dir" <<'EOF' || true
import json, os, sys
d = sys.argv[1]
plan = json.load(open(os.path.join(d, "plan-output.json")))
meas = json.load(open(os.path.join(d, "measurement.json")))
print("profile hf models:  " + str(plan.get("runtime_versions")))
v = meas.get("versions") or {}
print("this machine ran:   " + ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "peft", "accelerate", "cuda") if v.get(k)))
p = plan.get("params") or {}
run_path = os.path.join(d, "run.json")
if os.path.isfile(run_path):
    r = (json.load(open(run_path)).get("params") or {})
    print(f"parameters: planned {p.get('base_params'):,} base + {p.get('trainable_params'):,} trainable; "
          f"PEFT counted {r.get('base'):,} base + {r.get('trainable'):,} trainable")
EOF
exit 0
