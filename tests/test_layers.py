"""The modules form layers and import downwards only, counting imports inside functions too. At the root,
the method: model, mars, data, tokenizer at the bottom (they import none of ours), checkpoint on model and
tokenizer, config (the command lines) on checkpoint, sample on those, train on those and sample; off the
method's path, precision (the probe) on config. extras/ sits above the root, in rooms (engine, checkpoints,
serving, bench, real), each importing what its __init__.py says; the root reaches extras only at its seams
(SEAMS: one function each, behind the flag that asks for it). No import cycle, lazy imports included.
Read from the source with ast, so nothing is imported."""
import ast

from conftest import ROOT

BOTTOM = {"model", "mars", "data", "tokenizer"}
ALLOWED = {  # what each root module may import of the root, at module level or inside a function
    **{name: set() for name in BOTTOM},
    "checkpoint": {"model", "tokenizer"},  # loading a checkpoint builds both
    "config": {"checkpoint"},  # UserError, and whether a run starts from a real model
    "precision": {"config"},  # the probe times a step under config.autocast
    "sample": BOTTOM | {"checkpoint", "config"},
    "train": BOTTOM | {"checkpoint", "config", "precision", "sample"},
}
SEAMS = {  # the root functions that import extras (each behind the flag that asks for it), and what they import
    ("checkpoint", "foreign", "extras.checkpoints.foreign"),
    ("sample", "engine_decode", "extras.engine.engine"),  # sample.py's engine flags
}
ROOMS = {  # what each room of extras/ may import besides its own modules (the root: any root module)
    "extras.checkpoints": {"model", "tokenizer", "data",  # not checkpoint: it imports foreign.py
                           "extras.real.teacher"},  # foreign.py hands train.py --targets soft's Teacher (torch only)
    "extras.engine": {"root"},
    "extras.serving": {"root", "extras.engine", "extras.bench"},
    "extras.bench": {"root", "extras.engine", "extras.real.chunked_ce"},  # memory.py measures the chunked loss
    "extras.real": {"root", "extras.engine", "extras.bench"},
}
COMMANDS = {"extras.checkpoints.export": {"checkpoint", "config"}}  # a command line in a room checkpoint imports


def module_name(path):
    """extras/serving/server.py -> extras.serving.server; extras/bench/__init__.py -> extras.bench."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source, name, known):
    """{(module, where)} for each import of ours in source (where: None at module level, else the name of the
    top-level function or class it sits in); `from package import module` names the module. name: the
    importing module (for relative imports); known: every module name of the project."""
    found = set()
    package = name if (ROOT / name.replace(".", "/") / "__init__.py").exists() else name.rpartition(".")[0]

    def ours(dotted):
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update((ours(a.name), where) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                found.update((ours(f"{base}.{a.name}") or ours(base), where) for a in child.names)
            inner = where or (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                ast.ClassDef)) else None)
            visit(child, inner)
    visit(ast.parse(source), None)
    return {(m, where) for m, where in found if m}


def modules():
    """Every module of the project: name -> its imports of ours."""
    paths = [*ROOT.glob("*.py"), *(ROOT / "extras").rglob("*.py")]
    known = {module_name(p) for p in paths}
    return {module_name(p): imports(p.read_text(), module_name(p), known) for p in paths}


def room(name):
    return ".".join(name.split(".")[:2]) if name.startswith("extras.") else None


def problems(graph):
    """What breaks the layering in graph (name -> {(imported, where)}): root modules importing up, the root
    reaching extras anywhere but the seam, rooms importing what they may not, then cycles (lazy imports too)."""
    out = []
    for name, found in sorted(graph.items()):
        for other, where in sorted(found, key=str):
            if name in ALLOWED and other in ALLOWED and other not in ALLOWED[name]:
                out.append(f"{name}.py imports {other}")
            if name in ALLOWED and other.startswith("extras") and (name, where, other) not in SEAMS:
                out.append(f"{name}.py imports {other} outside a seam")
            if room(name) and room(other) != room(name) and other not in COMMANDS.get(name, ()):
                may = ROOMS.get(room(name), set())
                if not (other in may or room(other) in may or ("root" in may and other in ALLOWED)):
                    out.append(f"{name} imports {other}, which its room may not")
    edges = {name: {other for other, _ in found} for name, found in graph.items()}

    def reaches(a, b, seen=()):  # is there a path of imports from a to b?
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in edges.get(a, ()))
    return out + [f"an import cycle through {name}" for name in sorted(edges) if reaches(name, name)]


def test_the_root_holds_the_method_only():
    assert {p.stem for p in ROOT.glob("*.py")} <= ALLOWED.keys()


def test_extras_is_rooms_each_saying_what_it_holds():
    """No flat module in extras/, and each room's __init__.py is a docstring alone: what it holds and may import."""
    assert [p.name for p in (ROOT / "extras").glob("*.py")] == ["__init__.py"]
    rooms = {p.parent.name for p in (ROOT / "extras").glob("*/*.py")}
    assert {f"extras.{r}" for r in rooms} == ROOMS.keys()
    for r in rooms:
        body = ast.parse((ROOT / "extras" / r / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0].value, ast.Constant) and "import" in body[0].value.value, r


def test_imports_point_down_and_the_root_reaches_extras_at_the_seam():
    graph = modules()
    assert {"tokenizer", "extras.checkpoints.hf", "extras.serving.server", "extras.checkpoints.foreign"} <= graph.keys()
    assert ("extras.checkpoints.hf_tokenizer", None) in graph["extras.checkpoints.hf"]
    assert graph["checkpoint"] >= {("extras.checkpoints.foreign", "foreign")}  # the seam, seen inside its function
    assert ("extras.serving.scheduler", None) in graph["extras.serving.server"]
    assert problems(graph) == []


def test_the_check_sees_upward_imports_cycles_and_imports_past_the_seam():
    known = {*ALLOWED, "extras.checkpoints", "extras.checkpoints.hf", "extras.checkpoints.foreign",
             "extras.serving", "extras.serving.serve", "extras.serving.server"}
    graph = {"model": imports("import mars\n", "model", known), "mars": set(),
             "sample": imports("import model\ndef f():\n    from extras.serving import serve\n", "sample", known),
             "checkpoint": imports("def foreign():\n    from extras.checkpoints import foreign\n", "checkpoint", known),
             "tokenizer": imports("from extras.checkpoints.hf import export\n", "tokenizer", known),
             "extras.checkpoints.foreign": imports("from . import hf\n", "extras.checkpoints.foreign", known),
             "extras.checkpoints.hf": imports("import checkpoint\nimport model\n", "extras.checkpoints.hf", known),
             "extras.serving.serve": imports("from . import server\n", "extras.serving.serve", known),
             "extras.serving.server": imports("def run():\n    from .serve import Served\n",
                                              "extras.serving.server", known)}
    assert graph["sample"] == {("model", None), ("extras.serving.serve", "f")}
    assert graph["extras.serving.server"] == {("extras.serving.serve", "run")}  # a relative, lazy import
    assert problems(graph) == [
        "extras.checkpoints.hf imports checkpoint, which its room may not", "model.py imports mars",
        "sample.py imports extras.serving.serve outside a seam",
        "tokenizer.py imports extras.checkpoints.hf outside a seam",
        "an import cycle through checkpoint", "an import cycle through extras.checkpoints.foreign",
        "an import cycle through extras.checkpoints.hf",
        "an import cycle through extras.serving.serve", "an import cycle through extras.serving.server"]
