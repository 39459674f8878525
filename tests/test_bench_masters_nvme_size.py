"""benchmarks/masters_nvme_size.py: the masters-nvme suite sizes its model to a made-up machine.

Hand computation: the suite's Llama (hidden 4096, intermediate 11008, vocab 32000) has
202,383,360 parameters a layer and 262,148,096 beside them; the paged run keeps 14 bytes a
parameter on the disk and 2 for each 16-bit parameter not resident in host memory
(configs/zero3-nvme.json's max_in_cpu, 1e9 elements, within half the budget of 3 bytes a
parameter less one layer's shard; 90% of it counted), the resident run 14 bytes a parameter
and 3 GB in host memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import masters_nvme_size as ms  # noqa: E402

LAYER, REST = 202_383_360, 262_148_096
GIB = 2**30


def _disk(params: int) -> int:
    resident = min(10**9, (3 * params // 2 - 2 * LAYER) // 2, params)
    return 14 * params + 2 * (params - int(0.9 * resident))


def test_the_h100_machine_trains_12_layers_bound_by_its_disk():
    """44.5 GB free, 128 GiB host: 12 layers (2.69B) need 41.3 GB of the 42.6 usable; 13 would
    need 44.5."""
    room = (44_500_000_000 - GIB) * 0.98
    assert _disk(12 * LAYER + REST) <= room < _disk(13 * LAYER + REST)
    r = ms.size(44_500_000_000, 128 * GIB)
    assert r["layers"] == 12 and r["params"] == 12 * LAYER + REST == 2_690_748_416
    assert r["budget_paged"] == 3 * r["params"]  # a quarter of 12 bytes a parameter
    assert "--layers 12" in r["args"] and "disk bound" in r["why"][-1], r["why"]


def test_a_smaller_disk_trains_fewer_layers_and_a_small_host_binds_instead():
    room = (20_000_000_000 - GIB) * 0.98
    layers = max(k for k in range(1, 40) if _disk(k * LAYER + REST) <= room)
    assert ms.size(20_000_000_000, 128 * GIB)["layers"] == layers == 4
    # 40 GB of host: (0.9 x 40e9 - 3e9) / 14 = 2.36e9 parameters at most: 10 layers
    r = ms.size(10**12, 40 * 10**9)
    assert r["layers"] == 10 and "host bound" in r["why"][-1], r["why"]


def test_no_layer_fits_is_exit_status_1_and_the_json_feeds_the_suite(tmp_path, capsys):
    assert ms.main(["--nvme", str(tmp_path / "n"), "--disk-bytes", str(5 * 10**9),
                    "--host-bytes", str(64 * GIB), "--out", str(tmp_path / "s.json")]) == 1
    assert "no layer fits" in capsys.readouterr().out
    assert ms.main(["--nvme", str(tmp_path / "n"), "--disk-bytes", str(44_500_000_000),
                    "--host-bytes", str(128 * GIB), "--out", str(tmp_path / "s.json")]) == 0
    choice = json.loads((tmp_path / "s.json").read_text())
    import device_batch

    suite = device_batch.SUITES["masters-nvme"]
    steps = {s.name: s.shell for s in suite.steps}
    assert "masters_nvme_size.py" in steps["size"]
    for name, key in (("resident", "budget_resident"), ("paged", "budget_paged")):
        assert f"['{key}']" in steps[name] and "['args']" in steps[name]  # read at run time
    assert choice["args"].split() == ["--hidden", "4096", "--layers", "12", "--intermediate",
                                      "11008", "--heads", "32", "--vocab", "32000"]
