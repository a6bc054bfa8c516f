"""Regenerate BUILD (Bazel targets mirroring the package and tests): `python tools/gen_build.py`.

One py_library per package directory of areal_jax (its modules as srcs, depending on the packages it
imports), one py_test per tests/test_*.py. tests/test_build_file.py fails when BUILD falls out of date.
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIP_DEPS = ["jax", "flax", "optax", "numpy"]


def package_dirs() -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "areal_jax")):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("__"))
        if any(f.endswith(".py") for f in filenames):
            out.append(os.path.relpath(dirpath, ROOT))
    return sorted(out)


def target_name(pkg: str) -> str:
    return pkg.replace("/", "_")


def imports_of(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def owning_package(module: str, pkgs: list[str]) -> str | None:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        cand = "/".join(parts[:i])
        if cand in pkgs:
            return cand
    return None


def render() -> str:
    pkgs = package_dirs()
    lines = ['# Bazel targets mirroring the package and tests; regenerate with `python tools/gen_build.py`.',
             'load("@rules_python//python:defs.bzl", "py_library", "py_test")', ""]
    for pkg in pkgs:
        srcs = sorted(f for f in os.listdir(os.path.join(ROOT, pkg)) if f.endswith(".py"))
        deps = set()
        for f in srcs:
            for mod in imports_of(os.path.join(ROOT, pkg, f)):
                owner = owning_package(mod, pkgs)
                if owner and owner != pkg:
                    deps.add(":" + target_name(owner))
        lines.append("py_library(")
        lines.append(f'    name = "{target_name(pkg)}",')
        lines.append("    srcs = [" + ", ".join(f'"{pkg}/{f}"' for f in srcs) + "],")
        lines.append("    deps = [" + ", ".join(f'"{d}"' for d in sorted(deps)) + "],")
        lines.append(")")
        lines.append("")
    tests = sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py"))
    for t in tests:
        lines.append("py_test(")
        lines.append(f'    name = "{t[:-3]}",')
        lines.append(f'    srcs = ["tests/{t}", "tests/conftest.py"],')
        lines.append(f'    main = "tests/{t}",')
        lines.append("    deps = [" + ", ".join(f'":{target_name(p)}"' for p in pkgs) + "],")
        lines.append(")")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    out = render()
    if "--check" in sys.argv:
        sys.exit(0 if open(os.path.join(ROOT, "BUILD")).read() == out else 1)
    with open(os.path.join(ROOT, "BUILD"), "w") as f:
        f.write(out)
