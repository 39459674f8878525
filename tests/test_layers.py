"""The ownership rules (tools/check_layers.py) hold over the source tree, and the checker
catches each kind of violation it names (so an empty report means something)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import check_layers  # noqa: E402


def test_the_tree_keeps_every_ownership_rule():
    assert check_layers.check_tree(REPO) == []


def _found(rel: str, text: str) -> list[str]:
    return check_layers.check_file(rel, text)


def test_each_rule_reports_its_violation():
    assert any("higher layer optim" in v for v in
               _found("zeroio/partition/x.py", "from zeroio.optim import adam\n"))
    assert any("share only lower layers" in v for v in
               _found("zeroio/optim/x.py", "def f():\n    from zeroio.partition import base\n"))
    assert any("only the collectives" in v for v in
               _found("zeroio/checkpoint/x.py", "import torch.distributed as dist\n"))
    assert _found("zeroio/partition/collectives.py", "import torch.distributed as dist\n") == []
    assert _found("zeroio/cli/launch_cmd.py", "from torch.distributed.run import run\n") == []
    assert any("file access" in v for v in _found("zeroio/checkpoint/x.py", "open('a')\n"))
    assert any("file access" in v for v in
               _found("zeroio/cli/x.py", "import os\nos.pwrite(3, b'', 0)\n"))
    assert any("file access" in v for v in _found("zeroio/engine.py", "p.write_text('x')\n"))
    assert _found("zeroio/io/files.py", "open('a')\n") == []
    assert any("CUDA stream" in v for v in _found("zeroio/shard/x.py", "torch.cuda.Stream(d)\n"))
    assert _found("zeroio/tiering/streams.py", "torch.cuda.Stream(d)\n") == []
    assert any("os.environ" in v for v in
               _found("zeroio/partition/x.py", "import os\nos.environ.get('A')\n"))
    assert _found("zeroio/config/x.py", "import os\nos.environ.get('A')\n") == []
    assert any("lines" in v for v in _found("zeroio/x.py", "x = 1\n" * 601))
    # docstrings and comments naming the things do not count
    assert _found("zeroio/engine.py", '"""torch.distributed, open(), os.environ"""\n# open(x)\n') == []
