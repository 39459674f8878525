"""The ownership rules (tools/check_layers.py) hold over the source tree, and the checker
catches each kind of violation it names (so an empty report means something)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
    # no line count: a file is split where it holds two jobs, never squeezed to a number
    assert _found("zeroio/x.py", "x = 1\n" * 1000) == []
    # docstrings and comments naming the things do not count
    assert _found("zeroio/engine.py", '"""torch.distributed, open(), os.environ"""\n# open(x)\n') == []


# ---- names the checker follows: each tree below passed the text-level check before -----------

MISSES = {
    "from torch import distributed": (
        {"zeroio/checkpoint/comm2.py": "from torch import distributed as dist\n"
                                       "dist.all_reduce(t)\n"},
        ["imports torch.distributed", "calls torch.distributed.all_reduce"]),
    "Path.open": (
        {"zeroio/checkpoint/w.py": "from pathlib import Path\n"
                                   "with Path('a').open('wb') as f:\n    f.write(b'')\n"},
        ["file access open()"]),
    "os.rename": (
        {"zeroio/checkpoint/t.py": "import os\nos.rename('a', 'b')\n",
         "zeroio/cli/t.py": "from os import replace as mv\nmv('a', 'b')\n"},
        ["t.py:2: file access os.rename()", "t.py:2: file access os.replace()"]),
    "from os import environ": (
        {"zeroio/partition/e.py": "from os import environ\nx = environ.get('A')\n",
         "zeroio/optim/e.py": "import os as o\nenv = o.environ\n"},
        ["partition/e.py:2: reads os.environ", "optim/e.py:2: reads os.environ"]),
    "importlib": (
        {"zeroio/partition/d.py": "import importlib\nm = importlib.import_module('zeroio.optim.adam')\n",
         "zeroio/shard/d.py": "__import__('torch.distributed')\n",
         "zeroio/tiering/d.py": "from importlib import import_module as load\nm = load(name)\n",
         "zeroio/io/d.py": "import importlib\nm = importlib.import_module(f'zeroio.cli.{n}_cmd')\n"},
        ["partition/d.py:2: layer partition imports the higher layer optim",
         "partition/d.py:2: partition imports optim", "shard/d.py:1: imports torch.distributed",
         "tiering/d.py:2: imports a computed module name",
         "io/d.py:2: layer io imports the higher layer cli"]),
}


@pytest.mark.parametrize("miss", sorted(MISSES))
def test_aliases_and_dynamic_imports_are_followed(tmp_path, miss):
    files, expected = MISSES[miss]
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = check_layers.check_tree(tmp_path)
    for want in expected:
        assert any(want in v for v in found), (want, found)
    assert len(found) == len(expected), found


def test_what_the_rules_allow_stays_allowed(tmp_path):
    files = {"zeroio/__init__.py": "import importlib\nm = importlib.import_module(name)\n",
             "zeroio/cli/main.py": "import importlib\nm = importlib.import_module(f'zeroio.cli.{n}')\n",
             "zeroio/cli/launch_cmd.py": "from torch.distributed.run import run as go\ngo(a)\n",
             "zeroio/config/env.py": "from os import environ\nx = environ.get('A')\n",
             "zeroio/io/f.py": "import os\nos.rename('a', 'b')\nopen('a')\n",
             "zeroio/engine.py": "import os\nx = os.path.join('a', 'b')\ns = 'a'.replace('a', 'b')\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert check_layers.check_tree(tmp_path) == []


def test_only_tiering_counts_copies():
    """A host <-> device copy is counted by tiering/'s copy handles; code elsewhere that
    imports ``count_copy`` (by any name) or counts bytes with ``.moved()`` is refused."""
    fix = "zeroio.tiering.copies.Copies"
    found = _found("zeroio/partition/x.py",
                   "from zeroio.tiering.stats import count_copy\ncount_copy(s, a, b)\n")
    assert [v.split(":")[1] for v in found] == ["1", "2"], found
    assert all("only zeroio/tiering/ counts copies" in v and fix in v for v in found)
    found = _found("zeroio/shard/x.py", "import zeroio.tiering.stats as st\nst.count_copy(s, a, b)\n")
    assert len(found) == 1 and "x.py:2: uses zeroio.tiering.stats.count_copy" in found[0], found
    found = _found("zeroio/partition/stage3/x.py", "self.transfers.moved('cpu->gpu', 8)\n")
    assert len(found) == 1 and "counts moved bytes by hand" in found[0], found
    # tiering/ owns the counting; the handles are what everyone else uses
    assert _found("zeroio/tiering/x.py", "from zeroio.tiering.stats import count_copy\n"
                                         "count_copy(s, a, b)\ns.moved('cpu->gpu', 8)\n") == []
    assert _found("zeroio/partition/x.py", "from zeroio.tiering.copies import Copies\n"
                                           "Copies(s).into(b, a, non_blocking=True)\n") == []


RAW_MOVES = [  # (source line, what the check names)
    ("g = t.cpu()", ".cpu()"),
    ("g = t.detach().cuda()", ".cuda()"),
    ("g = t.cuda(non_blocking=True)", ".cuda()"),
    ("g = t.to(device)", ".to(<device>)"),
    ("g = t.to(self.device, non_blocking=True)", ".to(<device>)"),
    ("g = t.to(master.device)", ".to(<device>)"),
    ("g = t.to(comm_device)", ".to(<device>)"),
    ("g = t.to('cpu', torch.float32)", ".to(<device>)"),
    ("g = t.to('cuda:1')", ".to(<device>)"),
    ("g = t.to(torch.device('cuda', 0))", ".to(<device>)"),
    ("g = t.to(dtype=torch.bfloat16, device=d)", ".to(<device>)"),
    ("g = t.to(d or 'cpu')", ".to(<device>)"),
    ("_HOST = torch.device('cpu')\ng = t.to(_HOST)", ".to(<device>)"),
]


@pytest.mark.parametrize("line,move", RAW_MOVES)
@pytest.mark.parametrize("rel", ["zeroio/partition/x.py", "zeroio/partition/stage3/x.py",
                                 "zeroio/shard/x.py", "zeroio/optim/x.py"])
def test_a_raw_host_device_move_is_refused_on_the_data_path(rel, line, move):
    """``.cpu()``, ``.cuda()`` and ``.to(<device>)`` in the layers of the step's data path are
    refused with the file, the line and the fix (a copy handle); the handle's own forms pass."""
    text = "import torch\n" + line + "\n"
    found = _found(rel, text)
    at = text.count("\n")  # the move is on the last line
    assert found == [f"{rel}:{at}: raw host<->device move {move} outside zeroio/tiering/ "
                     f"({check_layers.RAW_MOVE_FIX})"], found
    assert "zeroio.tiering.copies.Copies" in found[0]


@pytest.mark.parametrize("rel", ["zeroio/partition/x.py", "zeroio/optim/x.py"])
def test_the_copy_handle_forms_and_casts_are_allowed(rel):
    text = ("import torch\nfrom zeroio.tiering.copies import Copies\n"
            "a = Copies(self.transfers).host(t)\n"
            "b = Copies(self.transfers).to(t, device, dtype=torch.bfloat16)\n"
            "moves = Copies(stats)\nc = moves.to(t, self.device)\n"
            "self._copies = Copies(None)\nd = self._copies.to(t, 'cuda')\n"
            "def f(copies):\n    return copies.to(t, comm_device)\n"
            "e = t.to(torch.float64)\nf = t.to(dtype=torch.bfloat16)\n"
            "g = t.to(other_tensor)\nh = t.float().to(dt, copy=True)\n"
            "i = torch.cuda.current_device()\nj = t.pin_memory()\n")
    assert _found(rel, text) == []


@pytest.mark.parametrize("rel", ["zeroio/tiering/x.py", "zeroio/checkpoint/x.py",
                                 "zeroio/engine.py", "zeroio/cli/x.py"])
def test_raw_moves_outside_the_data_path_layers_are_not_refused(rel):
    """tiering/ issues the copies; checkpoint/ (once per save or load), the engine and the
    command line are outside the rule's scope (tools/check_layers.py, RAW_MOVE_PREFIX)."""
    assert _found(rel, "x = t.cpu()\ny = t.to(device)\nz = t.cuda()\n") == []
