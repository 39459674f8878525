"""Check zeroio's ownership rules (docs/internals.md, "Ownership") over the source tree.

    python tools/check_layers.py [--json]

Each rule is an AST walk, not a text grep, so docstrings and comments that name
``torch.distributed`` or ``open`` do not count. Names are resolved through the file's
imports and plain assignments (``from torch import distributed as dist``, ``from os import
environ``, ``env = os.environ``), and ``importlib.import_module`` / ``__import__`` of a
constant name (or an f-string's constant prefix) count as imports; a computed name below the
package root is reported, since no rule could follow it. Exit 0 when every rule holds, 1 with
one line per violation otherwise. ``tests/test_layers.py`` runs it.

One data path: in ``shard/``, ``partition/`` and ``optim/`` (the layers that hold and move
the step's training state: gradients, masters, moments, 16-bit shards) a tensor crosses
between host and device only through a copy handle (``zeroio.tiering.copies.Copies``),
which counts the bytes. A raw ``.cpu()``, ``.cuda()``, or ``.to(...)`` with an argument that
names a device (a ``device=`` keyword; a device string; ``torch.device(...)``; a name
assigned one; a name or attribute ending in ``device``) is refused there with its file and
line. ``.to(dtype)`` casts and ``.to(other_tensor)`` pass (the rule cannot see a device
there), as does ``dst.copy_(src)``, whose devices are known only at run time: those are
kept to handles by review. The handle's own ``to`` (on ``Copies(...)``, a name assigned one,
or a name ending in ``copies``) is the fix. Out of scope: ``tiering/`` issues the copies;
``checkpoint/`` reads state to the host once per save or load, outside the step; the
engine, ``deepspeed/``, ``integrations/`` and ``cli/`` hold no training state of their own
(the engine moves the model to its device once and the norm to the collective's device).
No exemption marker exists: a move that has no stats to count into (zero.Init, before any
engine) goes through ``Copies(None)``.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Bottom-up; a module may import only from its own layer or the ones before it.
LAYERS = ["errors", "dtypes", "jsonlimits", "config", "io", "tiering", "shard", "partition", "optim",
          "checkpoint", "estimate_nvme", "estimate", "placement", "plan_machine", "plan", "preflight", "data",
          "engine_state", "step_guard", "step_protocol", "preemption", "shutdown", "engine_build",
          "engine", "deepspeed", "integrations", "cli", "testing"]
#: Layers that must not import each other in either direction.
APART = [("partition", "optim")]

COLLECTIVES = {"zeroio/partition/collectives.py"}
#: The launcher may start torch's elastic runner (it is a process launcher, not a collective).
LAUNCHER_TORCH_RUN = {"zeroio/cli/launch_cmd.py"}
STREAM_OWNER = {"zeroio/tiering/streams.py"}
ENV_READERS_PREFIX = ("zeroio/config/",)
ENV_READERS = {"zeroio/cli/launch_cmd.py", "zeroio/cli/train_cmd.py",
               "zeroio/testing/multirank.py"}
#: testing/ holds conformance suites that read raw file bytes as their independent reference.
FILE_IO_PREFIX = ("zeroio/io/", "zeroio/testing/")
FILE_CALLS = {("os", "open"), ("os", "pwrite"), ("os", "pread"), ("os", "preadv"),
              ("os", "pwritev"), ("os", "fdopen"), ("io", "open"), ("os", "rename"),
              ("os", "replace"), ("os", "remove"), ("os", "unlink"), ("os", "fsync"),
              ("os", "truncate"), ("os", "ftruncate"), ("builtins", "open")}
#: Methods that open, write or move a file whatever the receiver (``Path.open`` included).
WRITE_METHODS = {"write_text", "write_bytes", "open"}
ENV_NAMES = {"os.environ", "os.getenv", "os.putenv", "os.environb"}
DYNAMIC_IMPORTS = {"importlib.import_module", "__import__", "importlib.__import__"}
#: Only tiering/ counts the bytes of a host <-> device copy; elsewhere copies go through its
#: copy handles (``zeroio.tiering.copies.Copies``), which make the copy and count it.
COPY_COUNTERS = {"zeroio.tiering.stats.count_copy"}
COUNT_METHODS = {"moved"}  # TierStats.moved: bytes counted by hand
COPY_OWNER_PREFIX = ("zeroio/tiering/",)
COPY_HANDLE = "zeroio.tiering.copies.Copies"
COPY_FIX = "copy through zeroio.tiering.copies.Copies, which counts the bytes"
#: Layers on the step's data path (gradients, masters, moments, 16-bit shards): a raw
#: host <-> device move there (``.cpu()``, ``.cuda()``, ``.to(<device>)``) would go uncounted
#: in engine.stats(), so it goes through a copy handle (``Copies.host`` / ``Copies.to``).
#: checkpoint/ reads state to the host once per save or load, outside the step; cli/,
#: deepspeed/ and integrations/ hold no training state of their own.
RAW_MOVE_PREFIX = ("zeroio/shard/", "zeroio/partition/", "zeroio/optim/")
RAW_MOVE_FIX = ("move through zeroio.tiering.copies.Copies, which counts the bytes: "
                "Copies(stats).host(t) for .cpu(), Copies(stats).to(t, device) for .to/.cuda")


def _module(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _layer(mod: str | None) -> str | None:
    parts = (mod or "").split(".")
    return parts[1] if parts[0] == "zeroio" and len(parts) > 1 else None


def _base(node: ast.ImportFrom, mod: str, is_pkg: bool) -> str:
    """The absolute module of ``from <base> import ...``."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


class Names:
    """The file's bindings of imported names (and plain aliases of them): local name ->
    the dotted name it stands for."""

    def __init__(self, tree: ast.AST, mod: str, is_pkg: bool):
        self.map: dict[str, str] = {}
        assigns = []
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    local = a.asname or a.name.split(".")[0]
                    self.map[local] = a.name if a.asname else local
            elif isinstance(n, ast.ImportFrom):
                base = _base(n, mod, is_pkg)
                for a in n.names:
                    if a.name != "*":
                        self.map[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(n, ast.Assign) and len(n.targets) == 1 and \
                    isinstance(n.targets[0], ast.Name) and _dotted(n.value):
                assigns.append((n.targets[0].id, _dotted(n.value)))
        for _ in range(2):  # an alias of an alias
            for local, value in assigns:
                full = self.resolve(value)
                if full != value or value.split(".")[0] in self.map:
                    self.map[local] = full

    def resolve(self, dotted: str) -> str:
        head, _, rest = dotted.partition(".")
        full = self.map.get(head)
        if full is None:
            return dotted
        return f"{full}.{rest}" if rest else full


def _dynamic_name(call: ast.Call, mod: str, is_pkg: bool) -> str | None:
    """The module a dynamic import names: a constant, or an f-string's constant prefix up to
    its last dot; None when the name is computed."""
    if not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        name = arg.value
    elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        name = str(arg.values[0].value).rpartition(".")[0]
        if not name:
            return None
    else:
        return None
    if name.startswith("."):  # relative to the package= argument: this file's package
        level = len(name) - len(name.lstrip("."))
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        name = ".".join(base[: len(base) - (level - 1)] + [name.lstrip(".")]).rstrip(".")
    return name


def _imports(tree: ast.AST, mod: str, is_pkg: bool, names: Names):
    """(line, module) for every import, ``from`` imports also as each imported name's
    module path, and dynamic imports of a known name; (line, None) for a computed one."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                yield n.lineno, a.name
        elif isinstance(n, ast.ImportFrom):
            base = _base(n, mod, is_pkg)
            yield n.lineno, base
            for a in n.names:
                if a.name != "*":
                    yield n.lineno, f"{base}.{a.name}"
        elif isinstance(n, ast.Call) and names.resolve(_dotted(n.func)) in DYNAMIC_IMPORTS:
            yield n.lineno, _dynamic_name(n, mod, is_pkg)


def _import_rules(rel: str, me: str | None, line: int, name: str | None) -> list[str]:
    if name is None:
        if me is None:  # the package root (zeroio/__init__.py) may load any layer lazily
            return []
        return [f"{rel}:{line}: imports a computed module name (no layer rule can follow it; "
                "name the module)"]
    out = []
    if name in COPY_COUNTERS and not rel.startswith(COPY_OWNER_PREFIX):
        out.append(f"{rel}:{line}: imports {name} (only zeroio/tiering/ counts copies; {COPY_FIX})")
    other = _layer(name)
    if me in LAYERS and other in LAYERS and LAYERS.index(other) > LAYERS.index(me):
        out.append(f"{rel}:{line}: layer {me} imports the higher layer {other} ({name})")
    for a, b in APART:
        if {me, other} == {a, b}:
            out.append(f"{rel}:{line}: {me} imports {other} ({name}); they share only lower layers")
    if name == "torch.distributed" or name.startswith("torch.distributed."):
        if rel in COLLECTIVES or rel in LAUNCHER_TORCH_RUN and name.startswith(
                ("torch.distributed.run", "torch.distributed.elastic")):
            return out
        out.append(f"{rel}:{line}: imports {name} (only the collectives module may)")
    return out


def _is_device(node: ast.AST, devices: set[str], names: Names) -> bool:
    """Whether an argument of ``.to(...)`` names a device: a device string ("cpu", "cuda:0"),
    ``torch.device(...)``, a name bound to one, or a name or attribute called ``*device``."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.split(":")[0] in (
            "cpu", "cuda", "meta", "mps", "xpu")
    if isinstance(node, (ast.BoolOp, ast.IfExp)):
        parts = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
        return any(_is_device(v, devices, names) for v in parts)
    if isinstance(node, ast.Call):
        return names.resolve(_dotted(node.func)) == "torch.device" or (
            isinstance(node.func, ast.Attribute) and node.func.attr.endswith("device"))
    dotted = _dotted(node)
    return dotted in devices or dotted.rsplit(".", 1)[-1].lower().endswith("device")


def _raw_move(n: ast.Call, bound: dict[str, set[str]], names: Names) -> str | None:
    """The raw host <-> device move a call makes (``.cpu()``, ``.cuda()``, ``.to(<device>)``),
    or None. A copy handle's own ``to`` is the fix, not a move: on ``Copies(...)``, on a name
    bound to one (``moves = Copies(stats)``), or on a name ending in ``copies``."""
    if not isinstance(n.func, ast.Attribute) or names.resolve(_dotted(n.func)).startswith(
            "torch."):
        return None
    recv, devices = n.func.value, bound["device"]
    if isinstance(recv, ast.Call) and names.resolve(_dotted(recv.func)) == COPY_HANDLE or \
            _dotted(recv) in bound["copies"] or \
            _dotted(recv).rsplit(".", 1)[-1].lower().endswith("copies"):
        return None
    attr = n.func.attr
    if attr == "cpu" and not n.args:
        return ".cpu()"
    if attr == "cuda":
        return ".cuda()"
    if attr == "to" and (any(k.arg == "device" for k in n.keywords) or any(
            _is_device(a, devices, names) for a in n.args)):
        return ".to(<device>)"
    return None


def _bound_names(tree: ast.AST, names: Names) -> dict[str, set[str]]:
    """Names (``x``, ``self.x``) assigned anywhere in the file a ``torch.device(...)``
    ("device") or a copy handle, ``Copies(...)`` ("copies")."""
    kinds = {"torch.device": "device", COPY_HANDLE: "copies"}
    out: dict[str, set[str]] = {"device": set(), "copies": set()}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            kind = kinds.get(names.resolve(_dotted(n.value.func)))
            if kind:
                out[kind].update(_dotted(t) for t in n.targets if _dotted(t))
    return out


def _call_rules(rel: str, n: ast.Call, f: str) -> list[str]:
    out = []
    if f.startswith("torch.distributed.") and rel not in COLLECTIVES and not (
            rel in LAUNCHER_TORCH_RUN and f.startswith(("torch.distributed.run.",
                                                        "torch.distributed.elastic."))):
        out.append(f"{rel}:{n.lineno}: calls {f} (only the collectives module may)")
    if f.endswith("cuda.Stream") and rel not in STREAM_OWNER:
        out.append(f"{rel}:{n.lineno}: creates a CUDA stream (only {sorted(STREAM_OWNER)[0]})")
    if not rel.startswith(FILE_IO_PREFIX):  # io/ owns files
        parts = tuple(f.split("."))
        if f == "open" or parts[-2:] in FILE_CALLS or (
                isinstance(n.func, ast.Attribute) and n.func.attr in WRITE_METHODS):
            out.append(f"{rel}:{n.lineno}: file access {f or n.func.attr}() outside zeroio/io/")
    if not rel.startswith(COPY_OWNER_PREFIX) and isinstance(n.func, ast.Attribute) and \
            n.func.attr in COUNT_METHODS:
        out.append(f"{rel}:{n.lineno}: counts moved bytes by hand (.{n.func.attr}(); only "
                   f"zeroio/tiering/ counts copies; {COPY_FIX})")
    return out


def check_file(rel: str, text: str) -> list[str]:
    out: list[str] = []
    tree = ast.parse(text, rel)
    mod = _module(rel)
    me = _layer(mod)
    is_pkg = rel.endswith("__init__.py")
    names = Names(tree, mod, is_pkg)
    bound = _bound_names(tree, names) if rel.startswith(RAW_MOVE_PREFIX) else {}
    for line, name in _imports(tree, mod, is_pkg, names):
        out.extend(v for v in _import_rules(rel, me, line, name) if v not in out)
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            out.extend(_call_rules(rel, n, names.resolve(_dotted(n.func))))
            move = _raw_move(n, bound, names) if rel.startswith(RAW_MOVE_PREFIX) else None
            if move:
                out.append(f"{rel}:{n.lineno}: raw host<->device move {move} outside "
                           f"zeroio/tiering/ ({RAW_MOVE_FIX})")
        if isinstance(n, (ast.Attribute, ast.Name)) and isinstance(n.ctx, ast.Load):
            full = names.resolve(_dotted(n))
            if full in ENV_NAMES and not (rel.startswith(ENV_READERS_PREFIX) or rel in ENV_READERS):
                out.append(f"{rel}:{n.lineno}: reads {full} (only the config layer and the launcher)")
            if full in COPY_COUNTERS and not rel.startswith(COPY_OWNER_PREFIX):
                out.append(f"{rel}:{n.lineno}: uses {full} (only zeroio/tiering/ counts copies; "
                           f"{COPY_FIX})")
    return out


def check_tree(root: Path = ROOT) -> list[str]:
    out: list[str] = []
    for path in sorted((root / "zeroio").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        out.extend(check_file(rel, path.read_text(encoding="utf-8")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the violations as a JSON list")
    args = ap.parse_args(argv)
    found = check_tree()
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        print("\n".join(found) if found else "ownership rules hold")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
