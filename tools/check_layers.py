"""Check zeroio's ownership rules (docs/internals.md, "Ownership") over the source tree.

    python tools/check_layers.py [--json]

Each rule is an AST walk, not a text grep, so docstrings and comments that name
``torch.distributed`` or ``open`` do not count. Exit 0 when every rule holds,
1 with one line per violation otherwise. ``tests/test_layers.py`` runs it.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Bottom-up; a module may import only from its own layer or the ones before it.
LAYERS = ["errors", "dtypes", "config", "io", "tiering", "shard", "partition", "optim",
          "checkpoint", "estimate", "plan", "preflight", "data", "engine", "integrations", "cli", "testing"]
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
              ("os", "pwritev"), ("os", "fdopen"), ("io", "open")}
WRITE_METHODS = {"write_text", "write_bytes"}
MAX_LINES = 600


def _module(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _layer(mod: str | None) -> str | None:
    parts = (mod or "").split(".")
    return parts[1] if parts[0] == "zeroio" and len(parts) > 1 else None


def _imports(tree: ast.AST, mod: str, is_pkg: bool):
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                yield n.lineno, a.name
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (n.level - 1)]
                yield n.lineno, ".".join(base + ([n.module] if n.module else []))
            else:
                yield n.lineno, n.module or ""


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def check_file(rel: str, text: str) -> list[str]:
    out: list[str] = []
    n_lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    if n_lines > MAX_LINES:
        out.append(f"{rel}: {n_lines} lines (at most {MAX_LINES})")
    tree = ast.parse(text, rel)
    mod = _module(rel)
    me = _layer(mod)
    is_pkg = rel.endswith("__init__.py")
    for line, name in _imports(tree, mod, is_pkg):
        other = _layer(name)
        if me in LAYERS and other in LAYERS and LAYERS.index(other) > LAYERS.index(me):
            out.append(f"{rel}:{line}: layer {me} imports the higher layer {other} ({name})")
        for a, b in APART:
            if {me, other} == {a, b}:
                out.append(f"{rel}:{line}: {me} imports {other} ({name}); they share only lower layers")
        if name == "torch.distributed" or name.startswith("torch.distributed."):
            if rel in COLLECTIVES:
                continue
            if rel in LAUNCHER_TORCH_RUN and name.startswith(("torch.distributed.run",
                                                               "torch.distributed.elastic")):
                continue
            out.append(f"{rel}:{line}: imports {name} (only the collectives module may)")
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = _dotted(n.func)
            if f.startswith("torch.distributed.") and rel not in COLLECTIVES:
                out.append(f"{rel}:{n.lineno}: calls {f} (only the collectives module may)")
            if f.endswith("cuda.Stream") and rel not in STREAM_OWNER:
                out.append(f"{rel}:{n.lineno}: creates a CUDA stream (only {sorted(STREAM_OWNER)[0]})")
            if not rel.startswith(FILE_IO_PREFIX):  # io/ owns files
                parts = tuple(f.split("."))
                if f == "open" or parts[-2:] in FILE_CALLS or (
                        isinstance(n.func, ast.Attribute) and n.func.attr in WRITE_METHODS):
                    out.append(f"{rel}:{n.lineno}: file access {f or n.func.attr}() outside zeroio/io/")
        if isinstance(n, ast.Attribute) and _dotted(n) in ("os.environ", "os.getenv", "os.putenv"):
            if not (rel.startswith(ENV_READERS_PREFIX) or rel in ENV_READERS):
                out.append(f"{rel}:{n.lineno}: reads {_dotted(n)} (only the config layer and the launcher)")
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
