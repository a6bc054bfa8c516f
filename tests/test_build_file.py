"""BUILD must name every module of the package and every test file (parsed as Starlark = Python syntax)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _targets():
    tree = ast.parse(open(os.path.join(ROOT, "BUILD")).read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            kw = {k.arg: k.value for k in node.keywords}
            srcs = [e.value for e in kw["srcs"].elts] if "srcs" in kw else []
            deps = [e.value for e in kw["deps"].elts] if "deps" in kw else []
            out.append((node.func.id, kw["name"].value if "name" in kw else None, srcs, deps))
    return out


def test_every_module_is_in_a_py_library():
    listed = {s for kind, _, srcs, _ in _targets() if kind == "py_library" for s in srcs}
    missing = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "areal_jax")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if rel not in listed:
                    missing.append(rel)
    assert not missing, f"modules missing from BUILD (run python tools/gen_build.py): {missing}"


def test_every_test_file_has_a_py_test():
    tests = {s for kind, _, srcs, _ in _targets() if kind == "py_test" for s in srcs}
    files = [f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py")]
    missing = [f for f in files if f not in tests]
    assert not missing, f"tests missing from BUILD (run python tools/gen_build.py): {missing}"


def test_listed_files_exist_and_deps_resolve():
    targets = _targets()
    names = {name for _, name, _, _ in targets}
    for kind, name, srcs, deps in targets:
        for s in srcs:
            assert os.path.exists(os.path.join(ROOT, s)), f"{kind} {name} lists {s}, which does not exist"
        for d in deps:
            assert d.lstrip(":") in names, f"{kind} {name} depends on {d}, which BUILD does not define"
