#!/usr/bin/env python3
"""`peftplan report`: the HTML is well-formed XML (expat), references nothing outside itself, its
numbers are `plan --json`'s field by field, and headless Chromium renders it (a PNG that is not
blank, with the charts' colours in it, nothing wider than the page's content box) and prints it
to PDF on A4 and on Letter (each page rasterised by poppler's pdftoppm: nothing in the page's
right or left margin, so no chart or table is cut at the page width). Reports from a sweep table
and a recommend --json hold the file's numbers cell by cell; a run's report draws each strategy's
step, predicted above measured. Bad input is one line with exit code 2 and leaves no report behind.

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
import shutil
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pngcheck import read_png  # noqa: E402

PEFTPLAN = sys.argv[1] if len(sys.argv) > 1 else "build/release/cli/peftplan"
CHROMIUM = sys.argv[2] if len(sys.argv) > 2 else ""
PDFTOPPM = shutil.which("pdftoppm") or ""
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
            self.assert_margins_blank(pdf, size, want)

    def assert_margins_blank(self, pdf, size, page_pt):
        """Every printed page, rasterised at 50 dpi: the 12 mm margins at its left and right hold no
        ink, so nothing (a chart, a table) ran past the page's content width and was cut."""
        if not PDFTOPPM:
            self.skipTest("no pdftoppm (poppler-utils)")
        prefix = os.path.join(self.tmp.name, f"page-{size}")
        subprocess.run([PDFTOPPM, "-r", "50", "-png", pdf, prefix], check=True, capture_output=True, timeout=120)
        pages = sorted(f for f in os.listdir(self.tmp.name) if f.startswith(f"page-{size}") and f.endswith(".png"))
        self.assertGreaterEqual(len(pages), 2, size)
        margin = int(12 / 25.4 * 50) - 2  # 12 mm at 50 dpi, less a pixel of anti-aliasing either side
        for name in pages:
            width, height, rows = read_png(os.path.join(self.tmp.name, name))
            self.assertLessEqual(abs(width - page_pt[0] / 72 * 50), 1, name)
            inked = sum(1 for row in rows for x in list(range(margin)) + list(range(width - margin, width)) if row[x] != (255, 255, 255))
            self.assertEqual(inked, 0, f"{name}: ink in the side margins: something is wider than the page")


def cells_of(tree, table_id):
    """{(row label, data-field): data-value} of a table's cells, the row label its first cell."""
    out = {}
    for table in tree.iter("table"):
        if table.attrib.get("id") != table_id:
            continue
        for tr in table.iter("tr"):
            tds = [c for c in tr if c.tag == "td"]
            for td in tds[1:]:
                if "data-field" in td.attrib:
                    out[(tds[0].text, td.attrib["data-field"])] = td.attrib["data-value"]
    return out


class SavedTables(unittest.TestCase):
    """report --sweep and --recommendation: every figure is the file's own, cell by cell."""

    def check_report(self, out, files=("memory.svg", "report.html", "report.md", "time.svg")):
        self.assertEqual(sorted(os.listdir(out)), sorted(files))
        with open(os.path.join(out, "report.html"), encoding="utf-8") as f:
            html = f.read()
        tree = ET.fromstring(html)
        self.assertNotIn("<script", html)
        self.assertEqual(html.count("http"), html.count('xmlns="http://www.w3.org/2000/svg"'))
        for fig in ("memory-chart", "time-chart"):
            self.assertIsNotNone(tree.find(f".//*[@id='{fig}']"), fig)
        return html, tree

    def test_sweep_csv_and_jsonl(self):
        with tempfile.TemporaryDirectory() as tmp:
            grid = ["--model", "llama-2-7b", "--lora-r", "16", "--cluster", "8xA100-80GB", "--strategy", "ddp,zero3",
                    "--micro-batch", "1..16:x2", "--offload-param", "none,cpu"]
            for fmt in ("csv", "jsonl"):
                table = os.path.join(tmp, f"grid.{fmt}")
                r = run(["sweep"] + grid + ["--format", fmt, "--out", table])
                self.assertEqual(r.returncode, 0, r.stderr)
                out = os.path.join(tmp, f"rep-{fmt}")
                r = run(["report", "--sweep", table, "--out", out])
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertIn("report of 20 configurations", r.stdout)
                html, tree = self.check_report(out)
                rows = [json.loads(line) for line in
                        run(["sweep"] + grid + ["--format", "jsonl"]).stdout.splitlines()]
                self.assertEqual(len(rows), 20)
                every = cells_of(tree, "every-table")
                checked = refused = 0
                for row in rows:
                    label = f"{row['--strategy']} · {row['--micro-batch']} · {row['--offload-param']}"
                    if row["error"] is not None:  # ddp with parameter offload: refused, shown as such
                        refused += 1
                        self.assertEqual(every[(label, "fits")], "false")
                        self.assertIn("refused: ", html)
                        continue
                    for field, key in (("memory.device.allocated_peak_bytes", "allocated_peak_bytes"),
                                       ("memory.device.reserved_peak_bytes", "reserved_peak_bytes"),
                                       ("memory.device.used_peak_bytes", "used_peak_bytes"), ("fits", "fits")):
                        want = row[key]
                        self.assertEqual(every[(label, field)], ("true" if want else "false") if isinstance(want, bool) else str(want),
                                         (fmt, label, field))
                        checked += 1
                    for field, key in (("time.step_s", "step_s"), ("time.tokens_per_s_per_gpu", "tokens_per_s_per_gpu"), ("time.mfu", "mfu")):
                        # CSV keeps 9 significant digits (csv_field), JSON lines every digit
                        self.assertAlmostEqual(float(every[(label, field)]), row[key], delta=abs(row[key]) * (1e-8 if fmt == "csv" else 1e-15),
                                               msg=(fmt, label, field))
                        checked += 1
                self.assertEqual(refused, 5)
                self.assertEqual(checked, 15 * 7)
                # the charts draw the first 12 and say so; the memory table's columns are those 12
                self.assertIn("the first 12 of 20 configurations", html)
                headers = [th for table in tree.iter("table") if table.attrib.get("id") == "memory-table" for th in table.iter("th")
                           if "data-strategy" in th.attrib]
                self.assertEqual(len(headers), 12)

    def test_recommendation(self):
        with tempfile.TemporaryDirectory() as tmp:
            rec_file = os.path.join(tmp, "rec.json")
            searched = [a for i, a in enumerate(INPUTS) if a != "--micro-batch" and INPUTS[i - 1] != "--micro-batch"]  # the search's own
            r = run(["recommend"] + searched + ["--top", "4", "--json"])
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(rec_file, "w") as f:
                f.write(r.stdout)
            rec = json.loads(r.stdout)
            out = os.path.join(tmp, "rep")
            r = run(["report", "--recommendation", rec_file, "--out", out])
            self.assertEqual(r.returncode, 0, r.stderr)
            html, tree = self.check_report(out)
            self.assertIn(rec["summary"].replace("×", "×"), html)
            every = cells_of(tree, "every-table")
            for i, row in enumerate(rec["ranked"]):
                label = f"#{i + 1} {row['family']}"
                for key in ("allocated_peak_bytes", "reserved_peak_bytes", "used_peak_bytes"):
                    self.assertEqual(every[(label, "memory.device." + key)], str(row[key]), (label, key))
                self.assertAlmostEqual(float(every[(label, "time.step_s")]), row["step_s"], delta=row["step_s"] * 1e-15)
            for x in rec["rejected"]:
                self.assertIn(x["family"], html)
            # per category, the at-peak bytes of the top row (memory-table's first column)
            cats = [c for t in tree.iter("table") if t.attrib.get("id") == "memory-table" for c in t.iter("td")
                    if c.attrib.get("data-field", "").startswith("memory.device.at_peak.")]
            n = len([th for t in tree.iter("table") if t.attrib.get("id") == "memory-table" for th in t.iter("th") if "data-strategy" in th.attrib])
            first = {c.attrib["data-field"].split(".")[-1]: int(c.attrib["data-value"]) for c in cats[::n]}
            self.assertEqual(first, {k: v for k, v in rec["ranked"][0]["at_peak"].items() if not k.startswith("host_")})


class BadInput(unittest.TestCase):
    def test_one_line_exit_two_nothing_left(self):
        with tempfile.TemporaryDirectory() as tmp:
            truncated = os.path.join(tmp, "plan.json")
            with open(truncated, "w") as f:
                f.write('{"schema": "peftplan.plan/1", "model": ')
            wrong = os.path.join(tmp, "ds_config.json")
            with open(wrong, "w") as f:
                json.dump({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, f)
            # a sweep cut in the middle of its third row; a JSON-lines row with a text where a time belongs
            lines = run(["sweep", "--model", "llama-2-7b", "--micro-batch", "1..4"]).stdout.splitlines(keepends=True)
            cut_csv = os.path.join(tmp, "grid.csv")
            with open(cut_csv, "w") as f:
                f.write("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
            rows = run(["sweep", "--model", "llama-2-7b", "--micro-batch", "1..2", "--format", "jsonl"]).stdout.splitlines()
            row = json.loads(rows[1])
            row["step_s"] = "fast"
            bad_jsonl = os.path.join(tmp, "grid.jsonl")
            with open(bad_jsonl, "w") as f:
                f.write(rows[0] + "\n" + json.dumps(row) + "\n")
            # a plan.json whose program another build made (compare and peftplan-exec refuse it too)
            foreign = os.path.join(tmp, "foreign.json")
            run(["plan", "--model", "tiny-llama-2l", "--seq-len", "64", "--write-plan", foreign])
            with open(foreign) as f:
                pj = json.load(f)
            pj["program"]["hash"] = "0123456789abcdef"
            with open(foreign, "w") as f:
                json.dump(pj, f)
            binary = os.path.join(tmp, "blob.bin")
            with open(binary, "wb") as f:
                f.write(b"#\xff\x00\x01")
            cases = [
                (["report"] + INPUTS + ["--out", os.path.join(tmp, "no", "such", "folder")], "does not exist"),
                (["report", "--plan", truncated, "--out", os.path.join(tmp, "r1")], "plan.json"),
                (["report", "--plan", wrong, "--out", os.path.join(tmp, "r2")], "ds_config.json"),
                (["report", "--out", os.path.join(tmp, "r3"), "--model", "llama-2-7b", "--micro-batch", "0"], "--micro-batch"),
                (["report", "--sweep", truncated, "--out", os.path.join(tmp, "r4")], "plan.json line 1: is not valid JSON"),
                (["report", "--sweep", cut_csv, "--out", os.path.join(tmp, "r5")], "grid.csv line 5: has"),
                (["report", "--sweep", bad_jsonl, "--out", os.path.join(tmp, "r6")], "grid.jsonl line 2: step_s must be a non-negative number"),
                (["report", "--sweep", binary, "--out", os.path.join(tmp, "r7")], "blob.bin: holds a byte that is not UTF-8 text at offset 1"),
                (["report", "--recommendation", wrong, "--out", os.path.join(tmp, "r8")], "ds_config.json: schema must be \"peftplan.recommendation/3\""),
                (["report", "--recommendation", truncated, "--out", os.path.join(tmp, "r9")], "plan.json: is not valid JSON"),
                (["report", "--sweep", cut_csv, "--plan", truncated, "--out", os.path.join(tmp, "r10")], "give one source"),
                (["report", "--plan", foreign, "--out", os.path.join(tmp, "r11")], "foreign.json: program.hash names the program the writer built"),
                # the folder is replaced as a whole: never one that holds more than a report
                (["report"] + INPUTS + ["--out", tmp], "holds "),
                (["report"] + INPUTS + ["--out", ""], "the name is empty"),
            ]
            for args, needle in cases:
                r = run(args)
                self.assertEqual(r.returncode, 2, (args, r.stdout, r.stderr))
                self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
                self.assertIn(needle, r.stderr)
            self.assertEqual(sorted(os.listdir(tmp)), ["blob.bin", "ds_config.json", "foreign.json", "grid.csv", "grid.jsonl", "plan.json"])
            # a report's own folder is replaced
            out = os.path.join(tmp, "report")
            for _ in range(2):
                self.assertEqual(run(["report"] + INPUTS + ["--no-recommend", "--out", out]).returncode, 0)
            self.assertIn("report.html", os.listdir(out))

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
            # each strategy's step, predicted (a lane per stream) above measured (the executor's ops)
            for folder in (os.path.join(run_dir, "report"), again):
                self.assertIn("timeline-ddp.svg", os.listdir(folder))
                self.assertIn("timeline-zero3.svg", os.listdir(folder))
                with open(os.path.join(folder, "report.html"), encoding="utf-8") as f:
                    root = ET.fromstring(f.read())
                figs = [f for f in root.iter("figure") if f.attrib.get("class") == "timeline-chart"]
                self.assertEqual([f.attrib["data-strategy"] for f in figs], ["ddp", "zero3"])
                for fig in figs:
                    texts = " ".join(t.text or "" for t in fig.iter("{http://www.w3.org/2000/svg}text"))
                    self.assertIn("predicted: compute stream", texts)
                    self.assertIn("measured: round ", texts)
                    bars = [r for r in fig.iter("{http://www.w3.org/2000/svg}rect") if r.attrib.get("class") == "seg"]
                    self.assertGreater(len(bars), 20)
                    self.assertTrue(all(r.find("{http://www.w3.org/2000/svg}title") is not None for r in bars))
                zero3 = [f for f in figs if f.attrib["data-strategy"] == "zero3"][0]
                self.assertIn("predicted: comm stream", " ".join(t.text or "" for t in zero3.iter("{http://www.w3.org/2000/svg}text")))
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
