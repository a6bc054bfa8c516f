"""BUILD is what tools/gen_build.py writes, its deps cover the real imports, and its targets form no cycle.

The coverage and cycle checks read BUILD's text (Starlark parses as Python) and the sources with their own
import reader, not the generator's data structures: a generator bug that drops a dep fails them. They
require the import statements' modules; the generator also adds modules a source runs by name (`-m
areal_jax.main` in a subprocess command), which the toy-package tests check.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from areal_jax.testing.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "areal_jax"


def _gen_build():
    return load_script("tools/gen_build.py")


def _rules(text: str) -> list[dict]:
    """Every rule in a BUILD text: {"kind", "name", "srcs", "deps", "main"}."""
    out = []
    for stmt in ast.parse(text).body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name):
            kw = {k.arg: ast.literal_eval(k.value) for k in stmt.value.keywords}
            if "name" not in kw:  # load(...)
                continue
            out.append({"kind": stmt.value.func.id, "name": kw["name"], "srcs": kw.get("srcs", []),
                        "deps": kw.get("deps", []), "main": kw.get("main")})
    return out


def _build_rules() -> list[dict]:
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
        return _rules(f.read())


class _ImportReader(ast.NodeVisitor):
    """Module names a source imports when it runs: import statements anywhere but under `if TYPE_CHECKING:`."""

    def __init__(self, package_parts: list[str]):
        self.package_parts = package_parts  # the package a relative import starts from
        self.found: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
        for child in (node.orelse if name == "TYPE_CHECKING" else node.body + node.orelse):
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [alias.name for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package_parts[:len(self.package_parts) + 1 - node.level]
            stem = ".".join(base + node.module.split(".") if node.module else base)
        else:
            stem = node.module
        self.found.append(stem)
        self.found += [f"{stem}.{alias.name}" for alias in node.names]


def _file_of(module: str) -> str | None:
    """The repository file a module name stands for (tests/ modules by their bare name too), or None."""
    rel = module.replace(".", "/")
    for cand in (rel + ".py", rel + "/__init__.py", "tests/" + rel + ".py"):
        if os.path.isfile(os.path.join(ROOT, cand)):
            return cand
    return None


def _needed_files(src: str) -> set[str]:
    """Repository files that must be importable for `src` to run: each module it imports, the packages above
    those, and the packages above `src` itself."""
    parts = src[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
        package_parts = parts
    else:
        package_parts = parts[:-1]
    reader = _ImportReader(package_parts)
    with open(os.path.join(ROOT, src), encoding="utf-8") as f:
        reader.visit(ast.parse(f.read()))
    needed = set()
    for module in reader.found + [".".join(parts)]:
        if not module.startswith(PACKAGE) and not src.startswith("tests/"):
            continue
        pieces = module.split(".")
        for i in range(1, len(pieces) + 1):
            path = _file_of(".".join(pieces[:i]))
            if path is not None and (path.startswith(PACKAGE + "/") or path.startswith("tests/")):
                needed.add(path)
    needed.discard(src)
    return needed


def test_build_is_what_the_generator_writes():
    gen = _gen_build()
    try:
        expected = gen.render(ROOT)
    except gen.BuildError as e:
        pytest.fail(str(e))
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
        assert f.read() == expected, "BUILD is stale: run python tools/gen_build.py"


def test_every_module_is_in_exactly_one_py_library():
    counts: dict[str, int] = {}
    for rule in _build_rules():
        if rule["kind"] == "py_library":
            for s in rule["srcs"]:
                counts[s] = counts.get(s, 0) + 1
    on_disk = []
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        on_disk += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if f.endswith(".py")]
    missing = [p for p in on_disk if p not in counts]
    assert not missing, f"modules missing from BUILD (run python tools/gen_build.py): {missing}"
    twice = [p for p, n in counts.items() if n > 1]
    assert not twice, f"modules in more than one py_library: {twice}"


def test_every_test_file_has_a_py_test():
    tests = {s for rule in _build_rules() if rule["kind"] == "py_test" for s in rule["srcs"]}
    files = [f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py")]
    missing = [f for f in files if f not in tests]
    assert not missing, f"tests missing from BUILD (run python tools/gen_build.py): {missing}"


def test_listed_files_exist_and_deps_resolve():
    rules = _build_rules()
    names = {rule["name"] for rule in rules}
    assert len(names) == len(rules), "two BUILD rules share a name"
    for rule in rules:
        for s in rule["srcs"] + ([rule["main"]] if rule["main"] else []):
            assert os.path.exists(os.path.join(ROOT, s)), f"{rule['name']} lists {s}, which does not exist"
        if rule["main"]:
            assert rule["main"] in rule["srcs"], f"{rule['name']}'s main is not among its srcs"
        for d in rule["deps"]:
            assert d.startswith(":") and d[1:] in names, f"{rule['name']} depends on {d}, which BUILD does not define"


def test_deps_cover_every_import_of_every_source():
    rules = _build_rules()
    holder = {s: r["name"] for r in rules if r["kind"] == "py_library" for s in r["srcs"]}
    gaps = []
    for rule in rules:
        reachable = {":" + rule["name"]} | set(rule["deps"])
        for src in rule["srcs"]:
            if not src.startswith((PACKAGE + "/", "tests/")):
                continue
            if holder.get(src, rule["name"]) != rule["name"]:  # a program's file: its library brings the imports
                if ":" + holder[src] not in rule["deps"]:
                    gaps.append(f"{rule['name']}: lists {src} without depending on {holder[src]}, which holds it")
                continue
            for needed in sorted(_needed_files(src)):
                if needed in rule["srcs"]:
                    continue
                if needed.startswith("tests/"):
                    gaps.append(f"{rule['name']}: {src} imports {needed}, which is not in its srcs")
                elif ":" + holder.get(needed, "?") not in reachable:
                    gaps.append(f"{rule['name']}: {src} imports {needed} (in {holder.get(needed)}), not in its deps")
    assert not gaps, "BUILD misses deps (run python tools/gen_build.py):\n" + "\n".join(gaps)


def test_targets_form_no_cycle():
    deps = {r["name"]: [d[1:] for d in r["deps"]] for r in _build_rules()}
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "open":
            pytest.fail("BUILD has a cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if state.get(name) == "done":
            return
        state[name] = "open"
        for d in deps[name]:
            visit(d, path + [name])
        state[name] = "done"

    for name in deps:
        visit(name, [])


def test_programs_are_binaries_of_their_library():
    rules = {r["name"]: r for r in _build_rules()}
    assert rules["main"]["kind"] == "py_binary" and rules["main"]["main"] == f"{PACKAGE}/main.py"
    for f in sorted(os.listdir(os.path.join(ROOT, PACKAGE, "programs"))):
        with open(os.path.join(ROOT, PACKAGE, "programs", f), encoding="utf-8") as fh:
            if f.endswith(".py") and 'if __name__ == "__main__":' in fh.read():
                rule = rules.get(f[:-3])
                assert rule and rule["kind"] == "py_binary", f"program programs/{f} has no py_binary"
                assert rule["deps"] == [f":{PACKAGE}_programs"]


def _write(root, files: dict[str, str]) -> None:
    for rel, body in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))


_TOY = {
    "areal_jax/__init__.py": "",
    "areal_jax/config.py": "import os\n",
    "areal_jax/main.py": "from areal_jax.alpha import run\n\nif __name__ == \"__main__\":\n    run.go()\n",
    "areal_jax/alpha/__init__.py": "",
    "areal_jax/alpha/run.py": "from areal_jax import config\n\n\ndef go():\n    pass\n",
    "areal_jax/beta/__init__.py": "",
    "areal_jax/beta/x.py": "def f():\n    from ..alpha import run\n    return run\n",
    "tests/conftest.py": "",
    "tests/helper.py": "from areal_jax.beta import x\n",
    "tests/test_toy.py": "import helper\nimport subprocess\nCMD = ['python', '-m', 'areal_jax.main']\n",
}


def test_toy_package_gets_one_target_per_package_and_per_root_module(tmp_path):
    _write(tmp_path, _TOY)
    rules = {r["name"]: r for r in _rules(_gen_build().render(str(tmp_path)))}
    assert rules["areal_jax_main"]["deps"] == [":areal_jax_alpha", ":areal_jax_init"]
    assert rules["areal_jax_alpha"]["deps"] == [":areal_jax_config", ":areal_jax_init"]
    assert rules["areal_jax_beta"]["deps"] == [":areal_jax_alpha", ":areal_jax_init"]  # relative, in a function
    assert rules["main"]["kind"] == "py_binary" and rules["main"]["deps"] == [":areal_jax_main"]
    toy = rules["test_toy"]
    assert toy["srcs"][:3] == ["tests/test_toy.py", "tests/conftest.py", "tests/helper.py"]
    assert toy["deps"] == [":areal_jax_beta", ":areal_jax_init", ":areal_jax_main"]  # `-m areal_jax.main` counts
    # a module added to a package lands in its target with no edit to the generator
    _write(tmp_path, {"areal_jax/alpha/extra.py": "from areal_jax.alpha import run\n"})
    rules = {r["name"]: r for r in _rules(_gen_build().render(str(tmp_path)))}
    assert "areal_jax/alpha/extra.py" in rules["areal_jax_alpha"]["srcs"]


def test_a_cycle_between_packages_is_an_error_naming_the_imports(tmp_path):
    _write(tmp_path, _TOY)
    _write(tmp_path, {"areal_jax/alpha/late.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                                 "    from areal_jax.beta import x\n"})
    gen = _gen_build()
    gen.render(str(tmp_path))  # an import only for type checkers makes no cycle
    _write(tmp_path, {"areal_jax/alpha/late.py": "def g():\n    from areal_jax.beta import x\n    return x\n"})
    with pytest.raises(gen.BuildCycleError) as err:
        gen.render(str(tmp_path))
    message = str(err.value)
    assert "areal_jax_alpha -> areal_jax_beta -> areal_jax_alpha" in message
    assert "areal_jax.alpha.late imports areal_jax.beta.x" in message
    assert "areal_jax.beta.x imports areal_jax.alpha.run" in message
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_build.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "areal_jax.alpha.late imports areal_jax.beta.x" in proc.stderr
    assert not (tmp_path / "BUILD").exists()


def test_a_cycle_through_root_modules_is_named_link_by_link(tmp_path):
    _write(tmp_path, _TOY)  # main -> alpha -> config is fine as long as config does not come back
    _write(tmp_path, {"areal_jax/config.py": "from areal_jax.gamma.g import G\n",
                      "areal_jax/gamma/__init__.py": "",
                      "areal_jax/gamma/g.py": "G = 1\n\n\ndef run():\n    import areal_jax.main\n"})
    gen = _gen_build()
    with pytest.raises(gen.BuildCycleError) as err:
        gen.render(str(tmp_path))
    message = str(err.value)
    assert "areal_jax_alpha -> areal_jax_config -> areal_jax_gamma -> areal_jax_main -> areal_jax_alpha" in message
    for link in ("areal_jax.alpha.run imports areal_jax.config", "areal_jax.config imports areal_jax.gamma.g",
                 "areal_jax.gamma.g imports areal_jax.main", "areal_jax.main imports areal_jax.alpha.run"):
        assert link in message
