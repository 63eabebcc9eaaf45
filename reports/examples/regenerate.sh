#!/bin/sh
# Regenerates the example reports in this folder from the built peftplan (default
# build/release/cli/peftplan; give another as $1). Run from anywhere; paths are the repository's.
# The last one runs the executor (the `make run` job, a few minutes with calibration on a new
# machine) and keeps its report: predicted beside measured on this machine.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
peftplan=${1:-$root/build/release/cli/peftplan}
cd "$root"
ex=reports/examples
"$peftplan" report --model llama-2-7b --lora-r 16 --lora-alpha 32 --seq-len 4096 --micro-batch 2 --cluster 8xA100-80GB \
  --out $ex/llama-2-7b-lora-8xa100
"$peftplan" report --model llama-2-70b --lora-r 16 --lora-alpha 32 --seq-len 4096 --checkpointing full --strategy zero3 \
  --cluster 2x8xH100-SXM-NDR --out $ex/llama-2-70b-lora-2x8xh100
"$peftplan" report --profile hf --model llama-2-13b --quant nf4 --double-quant --lora-r 16 --lora-alpha 16 --lora-targets all-linear \
  --precision bf16 --seq-len 2048 --checkpointing full --strategy fsdp-full-shard --cluster 4xRTX4090-PCIe --out $ex/llama-2-13b-qlora-4xrtx4090
run=$(mktemp -d)
"$peftplan" run --out "$run/run" > "$run/log" 2>&1 || true   # a time figure outside tolerance exits 1; the report is written either way
rm -rf $ex/cpu-validation-run
cp -r "$run/run/report" $ex/cpu-validation-run
rm -rf "$run"
echo "regenerated: $(ls $ex | grep -v regenerate.sh | tr '\n' ' ')"
