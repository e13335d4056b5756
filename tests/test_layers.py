"""The modules form layers and import downwards only. At the root, the method: model, mars, data,
tokenizer at the bottom (they import none of ours), cli (checkpoints) on model and tokenizer, engine
on model and mars, sample on engine and cli, config (train's command line) on cli, train on all of
them but sample. extras/ sits above the root and may import any of it; the root never imports extras
at module level (a function may, on the Hugging Face path). No import cycle.
Read from the source with ast, so nothing is imported."""
import ast

from conftest import ROOT

BOTTOM = {"model", "mars", "data", "tokenizer"}
ALLOWED = {  # what each root module may import of the root, at module level or inside a function
    **{name: set() for name in BOTTOM},
    "cli": {"model", "tokenizer"},  # loading a checkpoint builds both
    "cost": set(),  # the step-cost model: the engine hands it its forward to time
    "engine": {"model", "mars", "cost"},
    "sample": BOTTOM | {"cli", "engine"},
    "config": {"cli"},  # a real model's preset and names come from extras/, inside functions
    "train": BOTTOM | {"cli", "config", "engine"},
}


def imports(source, package=None):
    """(module, at module level) for each import of ours in source: root modules by name, extras as
    "extras.x". package: "extras" for a module inside it (relative imports)."""
    found = []

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package if child.level else child.module
                if child.level and child.module:
                    base += "." + child.module
                found.extend((f"{base}.{a.name}" if base == "extras" else base, top) for a in child.names)
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    visit(ast.parse(source), True)
    ours = ALLOWED.keys() | {f"extras.{p.stem}" for p in (ROOT / "extras").glob("*.py")}
    return {(name if name in ours else name.split(".")[0], top) for name, top in found} & \
        {(name, top) for name in ours for top in (True, False)}


def modules():
    """Every module of the project: name -> its imports."""
    found = {p.stem: imports(p.read_text()) for p in ROOT.glob("*.py")}
    found.update({f"extras.{p.stem}": imports(p.read_text(), "extras") for p in (ROOT / "extras").glob("*.py")})
    return found


def problems(graph):
    """What breaks the layering in graph (name -> {(imported, at module level)}): upward imports, then cycles."""
    out = []
    for name, found in graph.items():
        for other, top in sorted(found):
            if name in ALLOWED and other in ALLOWED and other not in ALLOWED[name]:
                out.append(f"{name}.py imports {other}")
            if name in ALLOWED and other.startswith("extras") and top:
                out.append(f"{name}.py imports {other} at module level")
    edges = {name: {other for other, top in found if top} for name, found in graph.items()}

    def reaches(a, b, seen=()):  # is there a path of module-level imports from a to b?
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in edges.get(a, ()))
    return out + [f"an import cycle through {name}" for name in edges if reaches(name, name)]


def test_the_root_holds_the_method_only():
    assert {p.stem for p in ROOT.glob("*.py")} <= ALLOWED.keys()


def test_imports_point_down():
    graph = modules()
    assert {"tokenizer", "extras.checkpoints.hf", "extras.checkpoints.hf_tokenizer"} <= graph.keys()
    assert ("extras.checkpoints.hf_tokenizer", True) in graph["extras.checkpoints.hf"] and ("tokenizer", True) in graph["extras.checkpoints.hf_tokenizer"]
    assert problems(graph) == []


def test_the_check_sees_upward_imports_and_cycles():
    graph = {"model": imports("import mars\n"), "mars": set(),
             "engine": imports("import model\ndef f():\n    from extras import serve\n"),
             "tokenizer": imports("from extras.checkpoints.hf import export\n"),
             "extras.checkpoints.hf": imports("from . import serve\nimport model\n", "extras"),
             "extras.serving.serve": imports("import engine\nfrom extras.checkpoints.hf import x\n", "extras")}
    assert graph["engine"] == {("model", True), ("extras.serving.serve", False)}
    assert problems(graph) == ["model.py imports mars", "tokenizer.py imports extras.checkpoints.hf at module level",
                               "an import cycle through extras.checkpoints.hf", "an import cycle through extras.serving.serve"]
