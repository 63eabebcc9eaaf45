#!/usr/bin/env python3
"""`peftplan report`: the HTML is well-formed XML (expat), references nothing outside itself, its
numbers are `plan --json`'s field by field, and headless Chromium renders it (a PNG that is not
blank, with the charts' colours in it, nothing wider than the page's content box) and prints it
to PDF on A4 and on Letter. Bad input is one line with exit code 2 and leaves no report behind.

usage: test_report.py PEFTPLAN [CHROMIUM]   (no CHROMIUM: the rendering checks are skipped)
"""
import json
import re
import os
import shlex
import struct
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pngcheck import read_png  # noqa: E402

PEFTPLAN = sys.argv[1] if len(sys.argv) > 1 else "build/release/cli/peftplan"
CHROMIUM = sys.argv[2] if len(sys.argv) > 2 else ""
INPUTS = ["--model", "llama-2-7b", "--lora-r", "16", "--lora-alpha", "32", "--seq-len", "4096", "--micro-batch", "2",
          "--cluster", "8xA100-80GB"]
# The category colours (reports/colours.h) that every memory chart of a LoRA model shows.
CHART_COLOURS = {"base_weights": (0x4e, 0x79, 0xa7), "activations": (0x59, 0xa1, 0x4f), "workspace": (0xed, 0xc9, 0x48),
                 "compute": (0x4e, 0x79, 0xa7)}


def run(args, **kw):
    return subprocess.run([PEFTPLAN] + args, capture_output=True, text=True, **kw)


class Report(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.out = os.path.join(cls.tmp.name, "report")
        r = run(["report"] + INPUTS + ["--out", cls.out])
        assert r.returncode == 0, r.stdout + r.stderr
        with open(os.path.join(cls.out, "report.html"), encoding="utf-8") as f:
            cls.html = f.read()
        cls.tree = ET.fromstring(cls.html)  # well-formed, or this raises

    def test_files(self):
        self.assertEqual(sorted(os.listdir(self.out)), ["memory.svg", "report.html", "report.md", "time.svg"])
        for svg in ("memory.svg", "time.svg"):
            ET.parse(os.path.join(self.out, svg))
        with open(os.path.join(self.out, "report.md"), encoding="utf-8") as f:
            md = f.read()
        self.assertIn("![memory per GPU by category](memory.svg)", md)
        self.assertNotIn(".tmp.", " ".join(os.listdir(self.tmp.name)))

    def test_self_contained(self):
        for el in self.tree.iter():
            tag = el.tag.split("}")[-1]
            self.assertNotIn(tag, ("script", "link", "img", "iframe", "object"), tag)
            for k, v in el.attrib.items():
                if k == "xmlns" or k.endswith("}xmlns"):
                    continue
                self.assertNotIn("http", v.lower(), (tag, k, v))
        self.assertNotIn("url(", self.html)
        self.assertNotIn("@import", self.html)
        # the only URL: the SVG namespace, which nothing fetches
        self.assertEqual(self.html.count("http"), self.html.count('xmlns="http://www.w3.org/2000/svg"'))

    def test_provenance_and_labels(self):
        self.assertRegex(self.html, r"peftplan \d+\.\d+\.\d+ \(git [0-9a-f]+")
        self.assertIn("peftplan report --model llama-2-7b", self.html)
        for fig in ("memory-chart", "time-chart"):
            self.assertIsNotNone(self.tree.find(f".//*[@id='{fig}']"), fig)
        self.assertGreaterEqual(self.html.count("predicted"), 3)

    def test_numbers_are_plan_json(self):
        ns = ""
        headers = [th for th in self.tree.iter(ns + "th") if "data-plan-args" in th.attrib]
        self.assertEqual(len(headers), 7)
        plans = []
        for th in headers:
            args = shlex.split(th.attrib["data-plan-args"])
            inputs = INPUTS
            if "--full-finetune" in args:  # full fine-tuning of the same model: no adapter flags
                inputs = [a for i, a in enumerate(INPUTS) if not a.startswith("--lora") and not INPUTS[i - 1].startswith("--lora")]
            r = run(["plan"] + inputs + args + ["--json"])
            self.assertIn(r.returncode, (0, 1), r.stderr)
            plans.append(json.loads(r.stdout))
        checked = 0
        for table in self.tree.iter("table"):
            if table.attrib.get("id") not in ("memory-table", "time-table", "comm-table"):
                continue
            for tr in table.iter("tr"):
                cells = [c for c in tr if c.tag == "td"]
                if not cells or "data-field" not in cells[0].attrib:
                    continue
                self.assertEqual(len(cells), len(plans))
                for cell, plan in zip(cells, plans):
                    field, value = cell.attrib["data-field"], cell.attrib["data-value"]
                    if field == "time.tokens_per_s_per_gpu":
                        want = plan["time"]["tokens_per_s_per_gpu"]
                    else:
                        want = plan
                        for key in field.split("."):
                            want = want[key]
                    if isinstance(want, bool):
                        self.assertEqual(value, "true" if want else "false", field)
                    elif isinstance(want, int):
                        self.assertEqual(int(value), want, field)
                    else:
                        self.assertAlmostEqual(float(value), want, delta=abs(want) * 1e-12, msg=field)
                    checked += 1
        self.assertGreaterEqual(checked, 7 * 30)

    @unittest.skipUnless(CHROMIUM, "no Chromium")
    def test_renders_in_chromium(self):
        png = os.path.join(self.tmp.name, "report.png")
        # A window wider than the page: anything wider than the content box (190 mm) would show
        # outside it.
        r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={png}",
                            "--window-size=1200,5200", "file://" + os.path.join(self.out, "report.html")],
                           capture_output=True, text=True, timeout=120)
        self.assertTrue(os.path.exists(png), r.stderr[-2000:])
        width, height, rows = read_png(png)
        inked = sum(1 for row in rows[::4] for p in row[::4] if p != (255, 255, 255))
        self.assertGreater(inked, 2000, "blank page")
        seen = {p for row in rows[::2] for p in row[::2]}
        for name, rgb in CHART_COLOURS.items():
            self.assertIn(rgb, seen, f"{name}'s colour is not on the page: a chart is missing")
        # body: max-width 190 mm (718 px at 96 px/in) + 2 x 8 mm padding, centred
        content = 190 / 25.4 * 96 + 2 * 8 / 25.4 * 96
        left, right = (width - content) / 2 - 2, (width + content) / 2 + 2
        outside = [x for row in rows[::3] for x, p in enumerate(row) if p != (255, 255, 255) and not left <= x <= right]
        self.assertEqual(outside[:5], [], "something is wider than the page's content box")

    @unittest.skipUnless(CHROMIUM, "no Chromium")
    def test_prints_to_pdf(self):
        for size in ("A4", "letter"):
            page = os.path.join(self.tmp.name, f"print-{size}.html")
            with open(page, "w", encoding="utf-8") as f:
                f.write(self.html.replace("@page{margin:12mm}", "@page{size:%s;margin:12mm}" % size))
            pdf = os.path.join(self.tmp.name, f"report-{size}.pdf")
            subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-pdf-header-footer", f"--print-to-pdf={pdf}",
                            "file://" + page], capture_output=True, timeout=120)
            with open(pdf, "rb") as f:
                data = f.read()
            self.assertTrue(data.startswith(b"%PDF"), size)
            pages = data.count(b"/Type /Page") - data.count(b"/Type /Pages")
            self.assertGreaterEqual(pages, 2, size)
            # the page size Chromium laid out: A4 595 x 842 pt, Letter 612 x 792 pt
            boxes = re.findall(rb"/MediaBox\s*\[\s*0\s+0\s+([\d.]+)\s+([\d.]+)", data)
            self.assertTrue(boxes, f"{size}: no page box in the PDF")
            want = (595, 842) if size == "A4" else (612, 792)
            self.assertEqual({(round(float(w)), round(float(h))) for w, h in boxes}, {want}, size)


class BadInput(unittest.TestCase):
    def test_one_line_exit_two_nothing_left(self):
        with tempfile.TemporaryDirectory() as tmp:
            truncated = os.path.join(tmp, "plan.json")
            with open(truncated, "w") as f:
                f.write('{"schema": "peftplan.plan/1", "model": ')
            wrong = os.path.join(tmp, "ds_config.json")
            with open(wrong, "w") as f:
                json.dump({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, f)
            cases = [
                (["report"] + INPUTS + ["--out", os.path.join(tmp, "no", "such", "folder")], "does not exist"),
                (["report", "--plan", truncated, "--out", os.path.join(tmp, "r1")], "plan.json"),
                (["report", "--plan", wrong, "--out", os.path.join(tmp, "r2")], "ds_config.json"),
                (["report", "--out", os.path.join(tmp, "r3"), "--model", "llama-2-7b", "--micro-batch", "0"], "--micro-batch"),
            ]
            for args, needle in cases:
                r = run(args)
                self.assertEqual(r.returncode, 2, (args, r.stdout, r.stderr))
                self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
                self.assertIn(needle, r.stderr)
            self.assertEqual(sorted(os.listdir(tmp)), ["ds_config.json", "plan.json"])

    def test_from_a_run_folder(self):
        """report --run remakes the report a run wrote: the same measured figures, cell by cell."""
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = os.path.join(tmp, "run")
            r = run(["run", "--strategy", "ddp,zero3", "--gpus", "2", "--steps", "2", "--rounds", "1", "--seq-len", "32",
                     "--cluster", "8xA100-80GB", "--out", run_dir], env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                                                                                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
            self.assertIn(r.returncode, (0, 1), r.stdout[-3000:] + r.stderr[-3000:])  # 1: a time figure outside tolerance
            again = os.path.join(tmp, "again")
            r = run(["report", "--run", run_dir, "--out", again])
            self.assertEqual(r.returncode, 0, r.stderr)

            def measured(path):
                with open(os.path.join(path, "report.html"), encoding="utf-8") as f:
                    root = ET.fromstring(f.read())
                return [(c.attrib["data-field"], c.attrib["data-value"]) for c in root.iter("td")
                        if c.attrib.get("data-field", "").startswith("validation.")]
            cells = measured(os.path.join(run_dir, "report"))
            self.assertGreater(len(cells), 40)
            self.assertEqual(measured(again), cells)
            with open(os.path.join(run_dir, "ddp", "validation.json")) as f:
                v = json.load(f)
            self.assertIn(("validation.memory.peak.measured", str(v["memory"]["peak"]["measured_bytes"])), cells)
            r = run(["report", "--run", tmp, "--out", os.path.join(tmp, "nothing")])
            self.assertEqual(r.returncode, 2)
            self.assertIn("no validation.json or summary.json here", r.stderr)

    def test_from_a_saved_plan(self):
        with tempfile.TemporaryDirectory() as tmp:
            plan = os.path.join(tmp, "plan.json")
            r = run(["plan"] + INPUTS + ["--strategy", "zero2", "--write-plan", plan])
            self.assertEqual(r.returncode, 0, r.stderr)
            r = run(["report", "--plan", plan, "--no-recommend", "--out", os.path.join(tmp, "rep")])
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(tmp, "rep", "report.html"), encoding="utf-8") as f:
                html = f.read()
            ET.fromstring(html)
            self.assertIn("zero2 at micro-batch 2", html)
            self.assertIn("No recommendation", html)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
