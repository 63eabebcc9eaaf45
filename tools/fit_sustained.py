#!/usr/bin/env python3
"""Fits the model side's sustained fraction (planner/runtime.cpp, RuntimeRules::sustained): the
share of the GPU roofline's rates (GEMMs at the MAMF plateau, elementwise kernels at the
streaming bandwidth) that eager PyTorch's kernels sustain over a whole training step.

It is fitted on the published rows that isolate the dense eager step: one GPU, a bf16 model, no
bitsandbytes, no experts, no FSDP (A1, A3, A4 of tests/data/published/). Each row is planned
with the fraction given in a cluster file (efficiency.sustained, which overrides the profile's),
and the fraction that minimises the squared log error of tokens/s per GPU over those rows is
found by golden-section search. The other rows (FSDP, QLoRA, Mixtral, Llama-2-70B) are then
predictions, printed as a check, not fitted.

usage: tools/fit_sustained.py [PEFTPLAN]   (default build/release/cli/peftplan)
"""
import json
import math
import os
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
data = os.path.join(here, "..", "tests", "data", "published")
peftplan = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "build", "release", "cli", "peftplan")
FIT = ["A1", "A3", "A4"]
CHECK = ["A2", "A5", "A6", "A7", "A8", "A9", "A10"]


def load(rid):
    with open(os.path.join(data, rid + ".json")) as f:
        return json.load(f)


def tokens_per_s(row, sustained, tmp):
    """The row's plan with the row's cluster preset written out as a file plus efficiency.sustained."""
    args = list(row["plan_args"])
    for i in range(1, len(args)):
        if args[i - 1] == "--model" and "/" in args[i]:
            args[i] = os.path.join(data, args[i])
    i = args.index("--cluster") + 1
    gpus = row["settings"]["gpus"]
    cluster = {"version": 1, "name": f"1x{gpus}xA100-80GB", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": gpus,
               "intra_node_link": "NVLink3"}
    if sustained is not None:
        cluster["efficiency"] = {"sustained": sustained}
    path = os.path.join(tmp, f"cluster-{gpus}.json")
    with open(path, "w") as f:
        json.dump(cluster, f)
    args[i] = path
    out = subprocess.run([peftplan, "plan", "--json"] + args, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        sys.exit(f"{row['id']}: peftplan plan failed: {out.stderr.strip()}")
    return json.loads(out.stdout)["time"]["tokens_per_s_per_gpu"]


def main():
    rows = {rid: load(rid) for rid in FIT + CHECK}
    with tempfile.TemporaryDirectory() as tmp:
        def loss(s):
            return sum(math.log(tokens_per_s(rows[r], s, tmp) / rows[r]["measured"]["tokens_per_s_per_gpu"]) ** 2
                       for r in FIT)

        lo, hi = 0.5, 1.0
        g = (math.sqrt(5) - 1) / 2
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        fa, fb = loss(a), loss(b)
        while hi - lo > 1e-4:
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - g * (hi - lo)
                fa = loss(a)
            else:
                lo, a, fa = a, b, fb
                b = lo + g * (hi - lo)
                fb = loss(b)
        s = round((lo + hi) / 2, 3)
        print(f"sustained = {s:.3f}  (fitted on {', '.join(FIT)}; rms log error {math.sqrt(loss(s) / len(FIT)):.4f})")
        print("row  measured tok/s  at 1.0         at the fit")
        for r in FIT + CHECK:
            m = rows[r]["measured"]["tokens_per_s_per_gpu"]
            one, fit = tokens_per_s(rows[r], 1.0, tmp), tokens_per_s(rows[r], s, tmp)
            tag = "fit" if r in FIT else "check"
            print(f"{r:4s} {m:10,.0f}  {one:7,.0f} ({100 * (one - m) / m:+5.1f}%)  {fit:7,.0f} ({100 * (fit - m) / m:+5.1f}%)  {tag}")


if __name__ == "__main__":
    main()
