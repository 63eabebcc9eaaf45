#!/usr/bin/env python3
"""peftplan-gui in a real X window (Xvfb, Qt's xcb platform, not offscreen): it starts, shows the
default scenario, saves a screenshot that is not blank and has the memory chart's colours, and
exits cleanly. Then its scripted use offscreen (inputs from files, a view, a screenshot; bad
files exit 2).

usage: test_gui_window.py PEFTPLAN_GUI XVFB_RUN
"""
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pngcheck import read_png  # noqa: E402

GUI, XVFB_RUN = sys.argv[1], sys.argv[2]


class Window(unittest.TestCase):
    def test_starts_shows_and_closes(self):
        with tempfile.TemporaryDirectory() as tmp:
            png = os.path.join(tmp, "window.png")
            env = {k: v for k, v in os.environ.items() if k != "QT_QPA_PLATFORM"}
            r = subprocess.run([XVFB_RUN, "-a", "-s", "-screen 0 1400x900x24", GUI, "--screenshot", png], env=env,
                               capture_output=True, text=True, timeout=180)
            self.assertEqual(r.returncode, 0, r.stdout[-2000:] + r.stderr[-2000:])
            width, height, rows = read_png(png)
            self.assertGreaterEqual((width, height), (1000, 600))
            colours = {p for row in rows[::3] for p in row[::3]}
            self.assertGreater(len(colours), 50, "a blank window")
            for rgb in ((0x4e, 0x79, 0xa7), (0x59, 0xa1, 0x4f)):  # base_weights, activations (reports/colours.h)
                self.assertIn(rgb, colours, "the memory chart is not drawn")


class Scripted(unittest.TestCase):
    """The command line, offscreen: inputs from a scenario, a ds_config.json and a view, then a
    screenshot; a bad file exits 2 naming it."""

    def run_gui(self, *args):
        env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
        return subprocess.run([GUI, *args], env=env, capture_output=True, text=True, timeout=300)

    def test_scenario_launcher_config_and_view(self):
        with tempfile.TemporaryDirectory() as tmp:
            scenario = os.path.join(tmp, "s.json")
            with open(scenario, "w") as f:
                f.write('{"schema": "peftplan.scenario/1", "model": "llama-2-13b", "micro_batch": 1, "seq_len": 4096}')
            ds = os.path.join(tmp, "ds_config.json")
            with open(ds, "w") as f:
                f.write('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}')
            png = os.path.join(tmp, "timeline.png")
            r = self.run_gui("--scenario", scenario, "--ds-config", ds, "--view", "timeline", "--screenshot", png)
            self.assertEqual(r.returncode, 0, r.stdout[-2000:] + r.stderr[-2000:])
            width, height, rows = read_png(png)
            colours = {p for row in rows[::3] for p in row[::3]}
            self.assertIn((0xe1, 0x57, 0x59), colours, "the timeline's collectives are not drawn")  # kCommColour

    def test_bad_files_exit_2(self):
        with tempfile.TemporaryDirectory() as tmp:
            bad = os.path.join(tmp, "bad_ds.json")
            with open(bad, "w") as f:
                f.write('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 7}}')
            r = self.run_gui("--ds-config", bad, "--screenshot", os.path.join(tmp, "x.png"))
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("bad_ds.json", r.stderr)
            self.assertIn("zero_optimization.stage", r.stderr)
            r = self.run_gui("--view", "nowhere")
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("--view nowhere", r.stderr)
            # A bad value planned (an unknown model) ends a screenshot run with its line, not a hang.
            r = self.run_gui("--model", "no-such-model", "--screenshot", os.path.join(tmp, "y.png"))
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("no-such-model", r.stderr)
            # A flag beside a launcher config that sets it otherwise is refused, as plan refuses it.
            ds = os.path.join(tmp, "zero3.json")
            with open(ds, "w") as f:
                f.write('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}')
            for flag, value, said in (("--micro-batch", "4", "the micro-batch it sets is 2"),
                                      ("--strategy", "ddp", "the strategy it sets is zero3")):
                r = self.run_gui("--ds-config", ds, flag, value, "--screenshot", os.path.join(tmp, "w.png"))
                self.assertEqual(r.returncode, 2, flag + ": " + r.stderr)
                self.assertIn(flag + " " + value + " contradicts --ds-config " + ds + " (" + said + ")", r.stderr)
            for flag, value in (("--gpus", "0"), ("--micro-batch", "0"), ("--strategy", "zero9")):
                r = self.run_gui(flag, value, "--screenshot", os.path.join(tmp, "z.png"))
                self.assertEqual(r.returncode, 2, flag + ": " + r.stderr)
                self.assertIn(flag, r.stderr)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
