"""Who imports whom, read from the sources with ast, imports inside functions included.

The root (model, mars, data, tokenizer, common, sample, train) is the paper and its toy, complete
on its own: it imports nothing from extras/, by any means. Within the root, model, mars, data and
tokenizer import none of ours, common (the plumbing) builds on model and tokenizer, sample on
those, train on those and sample. extras/ stand above every root module, in rooms, each importing
the root and the rooms its line in ROOMS names (a room's command line may import more: COMMANDS).
No import cycle, lazy imports included.

Every import written in the root, in extras/ and in notebooks/course.py resolves: the module
exists and so does each name taken from it. A module name that is neither ours, nor the standard
library's, nor in requirements.txt fails: nothing is dropped because the test does not know it."""
import ast
import functools
import importlib
import importlib.util
import re
import sys

import pytest

from conftest import ROOT

LAYERS = {  # what each root module may import of the root, at module level or inside a function
    "model": set(), "mars": set(), "data": set(), "tokenizer": set(), "stats": set(),
    "common": {"model", "tokenizer"},  # loading a checkpoint builds both
    "sample": {"model", "mars", "data", "tokenizer", "common"},
    "train": {"model", "mars", "data", "tokenizer", "common", "sample", "stats"},
}
ROOMS = {  # what each room of extras/ may import besides the root (any module) and itself
    "extras.checkpoints": set(),  # formats in and out, turned into the root's objects
    "extras.engine": set(),  # batched decoding on the root's model and mars.py's rules
    "extras.bench": {"extras.engine", "extras.checkpoints", "extras.real"},
    "extras.real": {"extras.engine", "extras.checkpoints", "extras.bench"},
    "extras.serving": {"extras.engine", "extras.checkpoints", "extras.bench", "extras.real"},
}
COMMANDS = {  # a room's command line, which may import beyond what its room may
    "extras.engine.__main__": {"extras.checkpoints", "extras.real"},  # real models, records
}
INDIRECT = {  # outside modules imported though requirements.txt does not name them, and why
    "regex": "tiktoken's own dependency, installed with it (extras/checkpoints/hf_tokenizer.py)",
}
# the functions that import a module named by a string
IMPORTERS = {"import_module", "__import__", "find_spec", "run_module", "run_path",
             "spec_from_file_location", "SourceFileLoader"}
EXTRAS_NAME = re.compile(r"extras(\.\w+)*|extras/[\w/]*(\.py)?")


def root_files():
    return sorted(ROOT.glob("*.py"))


def sources():
    """Every file whose imports must resolve: the root, extras/ and the course's modules."""
    course = sorted((ROOT / "notebooks").glob("*.py"))
    return [*root_files(), *sorted((ROOT / "extras").rglob("*.py")), *course]


def where(path, node):
    return f"{path.relative_to(ROOT) if path.is_absolute() else path}:{node.lineno}"


# (a) the root imports nothing from extras/

def reaches_extras(tree, path):
    """'file:line what' for each way tree imports extras/: import statements anywhere, the
    import functions given a string naming extras or a computed name, and a string that is
    itself an extras module's name or path (a module kept in a string to be imported)."""
    found = set()

    def is_extras(name):
        return name == "extras" or name.startswith(("extras.", "extras/"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node, f"import {a.name}") for a in node.names if is_extras(a.name)}
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.module else [a.name for a in node.names]
            if any(is_extras(n) for n in names):
                found.add((node, f"from {node.module or '.'} import ..."))
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
            first = [*node.args, *(k.value for k in node.keywords)][:1]
            if name in IMPORTERS and first and not isinstance(first[0], ast.Constant):
                found.add((node, f"{name}() of a computed name"))
            elif name in IMPORTERS and first and is_extras(str(first[0].value)):
                found.add((node, f"{name}({first[0].value!r})"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if EXTRAS_NAME.fullmatch(node.value):
                found.add((node, f"the string {node.value!r} names a module of extras/"))
    found = sorted(found, key=lambda f: f[0].lineno)
    return [f"{where(path, node)} {what}" for node, what in found]


def test_the_root_imports_nothing_from_extras():
    """Comments, help texts and error messages may name extras' commands ('python -m
    extras.engine ...'); nothing may import them, lazily or not."""
    assert {p.stem for p in root_files()} == LAYERS.keys()
    found = [line for p in root_files() for line in reaches_extras(ast.parse(p.read_text()), p)]
    assert found == [], "the root reaches into extras/:\n" + "\n".join(found)


def test_the_check_sees_every_way_of_importing_extras():
    from pathlib import Path
    source = "\n".join([
        "import extras.engine.engine as e",  # 1
        "from extras.real import options",  # 2
        "def f():",  # 3
        "    from extras import bench",  # 4
        "    import importlib",  # 5
        "    importlib.import_module('extras.bench.precision')",  # 6
        "    __import__('extras.engine')",  # 7
        "    return importlib.import_module(name)",  # 8
        "SEAM = 'extras.checkpoints.foreign'",  # 9
        "runpy.run_path('extras/bench/precision.py')",  # 10
        "from . import extras",  # 11
        "import json, extras",  # 12
        "print('python -m extras.engine --lossless: the engine runs it')",  # 13: a message
        "import extrasensory, data",  # 14: not extras
    ])
    found = reaches_extras(ast.parse(source), Path("x.py"))
    assert all(line.startswith("x.py:") for line in found)
    lines = sorted({int(line.split(" ")[0][5:]) for line in found})
    assert lines == [1, 2, 4, 6, 7, 8, 9, 10, 11, 12]


# (b) every import written resolves

def requirements():
    """The import names of requirements.txt (here a package's name is its import name)."""
    text = (ROOT / "requirements.txt").read_text()
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return {re.split(r"[<>=!~\[; ]", line)[0].lower().replace("-", "_") for line in lines if line}


def package_of(path):
    """The package a file's relative imports start from (extras/bench/eval.py -> extras.bench)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1])


def written_imports(tree, package):
    """[(node, module, name)] for every import in tree, at any depth: name is None for `import M`,
    else the name taken by `from M import name`; relative imports made absolute."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out += [(node, base, a.name) for a in node.names]
    return out


def our_file(module):
    """The file of one of our modules (model, extras.engine.engine, extras.bench), or None."""
    path = ROOT.joinpath(*module.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def is_ours(module):
    top = module.split(".")[0]
    return top == "extras" or (ROOT / f"{top}.py").is_file()


@functools.lru_cache(maxsize=None)
def defined(path):
    """The names a module defines at its top level (None: any name: a star import, __getattr__)."""
    tree, names = ast.parse(path.read_text()), set()
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp,
              ast.SetComp, ast.DictComp, ast.GeneratorExp)

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names.update(a.asname or a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                names.add(child.id)
            if isinstance(child, scopes):
                names.update([child.name] if hasattr(child, "name") else [])
            else:
                visit(child)
    visit(tree)
    names.update(n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names)
    return None if {"*", "__getattr__"} & names else names


def resolves(module):
    """Whether an outside module is importable (found without running it, but for its packages)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def unresolved(path, known, source=None):
    """'file:line why' for each import in path (or in source, as if at path) that does not
    resolve; known: the outside modules the project may import (top-level names)."""
    out = []
    tree = ast.parse(path.read_text() if source is None else source)
    for node, module, name in written_imports(tree, package_of(path)):
        at, top = where(path, node), module.split(".")[0]
        if is_ours(module):
            file = our_file(module)
            if file is None:
                out.append(f"{at} {module}: no such module of ours")
            elif name and name != "*" and our_file(f"{module}.{name}") is None:
                names = defined(file)
                if names is not None and name not in names:
                    out.append(f"{at} {module} has no {name}")
        elif top not in known:
            out.append(f"{at} {module}: not ours, the standard library's or requirements.txt's")
        elif not resolves(module):
            out.append(f"{at} {module} is not installed")
        elif name and name != "*" and not resolves(f"{module}.{name}"):
            if not hasattr(importlib.import_module(module), name):
                out.append(f"{at} {module} has no {name}")
    return list(dict.fromkeys(out))  # one line for a module that fails, however many names


def outside_modules():
    return set(sys.stdlib_module_names) | requirements() | INDIRECT.keys()


def test_every_import_written_resolves():
    known = outside_modules()
    assert {"torch", "tiktoken", "jinja2", "gguf", "os"} <= known
    found = [line for p in sources() for line in unresolved(p, known)]
    assert found == [], "imports that do not resolve:\n" + "\n".join(found)


def test_the_resolution_check_sees_missing_modules_and_names():
    """A removed module imported inside a function, a name a module lacks, a package nobody
    listed: each fails, with file:line."""
    source = "\n".join([
        "import json",  # 1
        "from common import UserError",  # 2: a name common defines
        "def f():",  # 3
        "    from checkpoint import load_checkpoint",  # 4: a module that is gone
        "    from model import no_such_name",  # 5
        "    import extras.engine.no_such_module",  # 6
        "    from . import no_such_sibling",  # 7
        "    from extras.engine import engine",  # 8: a submodule
        "    from json import no_such_function",  # 9
        "    import left_pad",  # 10: not in requirements.txt
        "    from torch.nn import functional, Module",  # 11
    ])
    probe = ROOT / "extras" / "bench" / "probe.py"
    found = [s.split(" ")[0] for s in unresolved(probe, outside_modules(), source)]
    assert found == [f"extras/bench/probe.py:{n}" for n in (4, 5, 6, 7, 9, 10)]


# (c) layers: the root's among themselves, extras/ above the root in rooms, no cycle

def module_name(path):
    """extras/bench/eval.py -> extras.bench.eval; extras/bench/__init__.py -> extras.bench"""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ours_imported(tree, path):
    """The modules of ours that the source of path imports, anywhere in it; `from package import
    module` names the module. Other names are the resolution test's to check, not dropped."""
    found = set()
    for node, module, name in written_imports(tree, package_of(path)):
        if is_ours(module):
            sub = f"{module}.{name}" if name else None
            found.add(sub if sub and our_file(sub) else module)
    return found


def graph():
    """Every module of the project: name -> the modules of ours it imports."""
    paths = [*root_files(), *(ROOT / "extras").rglob("*.py")]
    return {module_name(p): ours_imported(ast.parse(p.read_text()), p) for p in paths}


def room(name):
    return ".".join(name.split(".")[:2]) if name.startswith("extras.") else None


def problems(imports):
    """What breaks the layers in imports (name -> the modules of ours it imports), then cycles."""
    out = []
    for name, found in sorted(imports.items()):
        may = (room(name), *ROOMS.get(room(name), ()), *COMMANDS.get(name, ()))
        for other in sorted(found - {name}):
            if name in LAYERS and other not in LAYERS[name]:
                out.append(f"{name}.py imports {other}")
            if room(name) and other not in LAYERS and room(other) not in may:
                out.append(f"{name} imports {other}, which its room may not")
    edges = {name: found - {name} for name, found in imports.items()}
    for name in sorted(edges):
        seen, todo = set(), list(edges[name])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += edges.get(n, ())
        if name in seen:
            out.append(f"an import cycle through {name}")
    return out


def test_extras_is_rooms_each_saying_what_it_holds():
    """No flat module in extras/; each room's __init__.py is a docstring alone: what it holds and
    what it may import."""
    assert [p.name for p in (ROOT / "extras").glob("*.py")] == ["__init__.py"]
    rooms = {p.parent.name for p in (ROOT / "extras").glob("*/*.py")}
    assert {f"extras.{r}" for r in rooms} == ROOMS.keys()
    for r in rooms:
        body = ast.parse((ROOT / "extras" / r / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0].value, ast.Constant), r
        assert "import" in body[0].value.value, r


def test_imports_point_down_and_extras_stand_above_the_root():
    imports = graph()
    assert {"sample", "train", "extras.checkpoints.hf", "extras.serving.server"} <= imports.keys()
    assert "extras.checkpoints.hf_tokenizer" in imports["extras.checkpoints.hf"]
    assert "extras.serving.scheduler" in imports["extras.serving.server"]
    assert "mars" in imports["sample"]
    assert problems(imports) == []


@pytest.mark.parametrize("source, name, expected", [
    ("import mars\n", "model", ["model.py imports mars"]),
    ("import train\n", "sample", ["sample.py imports train"]),
    ("def f():\n    from extras.engine import engine\n", "common",
     ["common.py imports extras.engine.engine"]),
    ("import serving_cost\n", "train", []),  # not ours: the resolution test's to refuse
    ("def f():\n    from extras.serving import scheduler\n", "extras.engine.engine",
     ["extras.engine.engine imports extras.serving.scheduler, which its room may not"]),
    ("from extras.checkpoints import foreign\n", "extras.engine.engine",
     ["extras.engine.engine imports extras.checkpoints.foreign, which its room may not"]),
    ("from extras.checkpoints import foreign\n", "extras.engine.__main__", []),
    ("import train\nfrom extras.checkpoints import hf\n", "extras.real.options", []),
])
def test_the_layer_check_sees_upward_imports(source, name, expected):
    path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
    assert problems({name: ours_imported(ast.parse(source), path)}) == expected


def test_the_layer_check_sees_cycles():
    imports = {"extras.real.a": {"extras.real.b"}, "extras.real.b": {"extras.real.a"},
               "extras.real.c": {"extras.real.a", "extras.real.c"},  # itself: no cycle
               "train": {"sample"}, "sample": set()}
    assert problems(imports) == ["an import cycle through extras.real.a",
                                 "an import cycle through extras.real.b"]
