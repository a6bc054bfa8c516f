"""The repository's scripts (benchmarks/*.py, tools/*.py) as modules, for tests that call their main() or helpers."""
from __future__ import annotations

import importlib.util
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(relpath: str) -> types.ModuleType:
    """The script at `relpath` (from the repository root, e.g. "benchmarks/loop.py") as a fresh module: registered
    in sys.modules (dataclasses look their module up while a class is made) and with the script's folder on
    sys.path while it loads (benchmarks import their `common` module by name)."""
    name = "script_" + os.path.splitext(relpath)[0].replace("/", "_").replace("-", "_")
    path = os.path.join(ROOT, relpath)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no script {relpath} under {ROOT}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(os.path.dirname(path))
    return module
