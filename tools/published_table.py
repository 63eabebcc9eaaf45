#!/usr/bin/env python3
"""Prints the README's published-measurement table: every tests/data/published/*.json planned with
`peftplan plan --json` (the row's plan_args), predicted against measured.

usage: tools/published_table.py [PEFTPLAN]   (default build/release/cli/peftplan)
"""
import glob
import json
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
data = os.path.join(here, "..", "tests", "data", "published")
peftplan = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "build", "release", "cli", "peftplan")
MiB, GiB = 2**20, 2**30


def plan(row):
    args = list(row["plan_args"])
    for i in range(1, len(args)):
        if args[i - 1] == "--model" and "/" in args[i]:
            args[i] = os.path.join(data, args[i])
    out = subprocess.run([peftplan, "plan", "--json"] + args, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        sys.exit(f"{row['id']}: peftplan plan failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def err(p, m):
    return f"{100 * (p - m) / m:+.1f}%"


def key(path):
    name = os.path.basename(path)[:-5]
    return (name.startswith("oom"), int("".join(c for c in name if c.isdigit()) or 0))


rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(data, "*.json")), key=key)]
print("| row | CSV line | model, method | GPUs × µb | peak alloc: measured, predicted | smi (MiB): measured, predicted used | tok/s per GPU: measured, predicted | verdict |")
print("|---|---|---|---|---|---|---|---|")
for row in rows:
    j = plan(row)
    s, m = row["settings"], row["measured"]
    d = j["memory"]["device"]
    method = s["method"].split(":")[0].split(",")[0]
    size = f"{s['gpus']} × {s['micro_batch']}"
    note = "" if row["modelled"] else " (not modelled yet: FSDP)"
    verdict = "fits" if j["fits"] else "does not fit"
    if row["expect"] == "does_not_fit":
        print(f"| {row['id']} | {row['source']['csv_line']} | {s['model']}, {method} | {size} | out of memory | | | "
              f"{verdict}{note} |")
        continue
    tps = j["time"]["tokens_per_s_per_gpu"]
    print(f"| {row['id']} | {row['source']['csv_line']} | {s['model']}, {method} | {size} | "
          f"{m['allocated_peak_bytes'] / GiB:.2f} GiB, {d['allocated_peak_bytes'] / GiB:.2f} ({err(d['allocated_peak_bytes'], m['allocated_peak_bytes'])}) | "
          f"{m['used_peak_mib']:,}, {d['used_peak_bytes'] / MiB:,.0f} ({err(d['used_peak_bytes'], m['used_peak_mib'] * MiB)}) | "
          f"{m['tokens_per_s_per_gpu']:,.0f}, {tps:,.0f} ({err(tps, m['tokens_per_s_per_gpu'])}) | {verdict}{note} |")
