"""benchmarks/peaks.py: the peaks of a child that holds known host memory and writes a known file.

The child allocates and touches 300 MB, writes a 64 MB file under --path, holds both
for a second and deletes the file; the report must show at least those bytes (sampling
misses nothing held that long), its exit status, and nothing of the deleted file left.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import os, sys, time
buf = bytearray(300 * 10**6)
for i in range(0, len(buf), 4096):
    buf[i] = 1
p = os.path.join(sys.argv[1], 'blob')
with open(p, 'wb') as f:
    f.write(os.urandom(64 << 20))
    f.flush(); os.fsync(f.fileno())
time.sleep(1.5)
os.remove(p)
sys.exit(3)
"""


def test_peaks_of_a_child_with_known_memory_and_file(tmp_path):
    out = tmp_path / "peaks.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peaks.py"), "--path",
                           str(tmp_path), "--every", "0.1", "--json", str(out), "--",
                           sys.executable, "-c", CHILD, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    r = json.loads(out.read_text())
    assert r["exit"] == 3
    assert 300e6 <= r["host_rss_bytes"] < 1e9
    assert r["disk_used_bytes"] >= 64 << 20
    assert not (tmp_path / "blob").exists()
    assert "peaks: host RSS" in proc.stderr


def test_peaks_refuses_a_missing_path(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peaks.py"), "--path",
                           str(tmp_path / "nope"), "--", "true"], capture_output=True, text=True)
    assert proc.returncode == 2 and "nope" in proc.stderr
    assert shutil.which("true")
