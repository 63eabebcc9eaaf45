#!/usr/bin/env python3
"""Fits RuntimeRules::fsdp_unit_pass_host_s (planner/runtime.cpp): the host time per FSDP1 unit
pass that the GPU waits for, on every published FSDP row (tests/data/published, gpus > 1).

A step takes max(device critical path, passes x c): FSDP1's Python hooks run per unit per pass
(the root, each decoder layer and each PEFT adapter Linear; forward, backward, and a
checkpointed layer's recompute), and limit_all_gathers lets the CPU run at most two unit
reshards ahead of the GPU, so the hooks' time is not hidden when a unit's GPU work is short.
The fit minimises the squared log error of tokens/s per GPU over the rows, c on a 1 us grid.

usage: tools/fit_fsdp_host.py [PEFTPLAN]   (default build/release/cli/peftplan)
"""
import glob
import json
import math
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
data = os.path.join(here, "..", "tests", "data", "published")
peftplan = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "build", "release", "cli", "peftplan")

rows = []
for path in sorted(glob.glob(os.path.join(data, "A*.json"))):
    row = json.load(open(path))
    s = row["settings"]
    if s["gpus"] < 2 or row["expect"] != "fits":
        continue
    args = [os.path.join(data, a) if a.startswith("models/") else a for a in row["plan_args"]]
    j = json.loads(subprocess.run([peftplan, "plan", "--json"] + args, capture_output=True, text=True).stdout)
    tokens = s["micro_batch"] * s["seq_len"]
    measured = tokens / row["measured"]["tokens_per_s_per_gpu"]
    rows.append((row["id"], j["time"]["device_step_s"], j["params"]["fsdp_unit_passes"], measured))

def loss(c):
    return sum(math.log(max(dev, n * c) / m) ** 2 for _, dev, n, m in rows)

best = min(range(0, 20001), key=lambda us: loss(us * 1e-6))
c = best * 1e-6
print(f"fsdp_unit_pass_host_s = {c:.6f}  (fitted on {', '.join(r[0] for r in rows)}; rms log error {math.sqrt(loss(c) / len(rows)):.4f})")
for rid, dev, n, m in rows:
    pred = max(dev, n * c)
    print(f"  {rid}: device {dev:.3f} s, {n} unit passes -> floor {n * c:.3f} s; step {pred:.3f} s vs measured {m:.3f} s ({100 * (m / pred - 1):+.1f}% tokens/s)")
