#!/usr/bin/env python3
"""peftplan-gui in a real X window (Xvfb, Qt's xcb platform, not offscreen): it starts, shows the
default scenario, saves a screenshot that is not blank and has the memory chart's colours, and
exits cleanly.

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


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
