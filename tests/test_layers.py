"""The modules form layers and import downwards only, counting imports inside functions too. At the root,
the method: model, mars, data, tokenizer at the bottom (they import none of ours), common (the plumbing:
errors, shared flags, checkpoints) on model and tokenizer, sample on those, train on those and sample; off
the method's path, engine on model, mars and cost. extras/ sits above the root, in rooms (checkpoints,
serving, bench, real), each importing what its __init__.py says; the root reaches extras only through its
seams (docs/architecture.md), each one function importing one module lazily. No import cycle, lazy imports
included.
Read from the source with ast, so nothing is imported."""
import ast

from conftest import ROOT

BOTTOM = {"model", "mars", "data", "tokenizer"}
ALLOWED = {  # what each root module may import of the root, at module level or inside a function
    **{name: set() for name in BOTTOM},
    "common": {"model", "tokenizer"},  # loading a checkpoint builds both
    "cost": set(),  # the step-cost model: the engine hands it its forward to time
    "engine": {"model", "mars", "data", "cost"},
    "sample": BOTTOM | {"common"},
    "train": BOTTOM | {"common", "sample"},
}
SEAMS = {  # (root module, the function, the module of extras/ it imports): docs/architecture.md lists them
    ("common", "foreign", "extras.checkpoints.foreign"),  # a real model's checkpoint or tokenizer
    ("sample", "engine_decode", "extras.engine.engine"),  # sample.py's engine flags
    ("train", "beyond_the_paper", "extras.real.options"),  # the loop's one hook: options beyond the paper
    ("train", "real_model", "extras.checkpoints.hf_train"),  # --init_from a real model: the hf preset
    ("train", "measured_precision", "extras.bench.precision"),  # --precision auto: the probe
    ("data", "read_record", "extras.real.records"),  # --data with conversations or answers to evaluate
    ("data", "check", "extras.real.records"),  # a numeric (GSM8K-style) answer
}
ROOMS = {  # what each room of extras/ may import besides its own modules (the root: any root module)
    "extras.checkpoints": {"model", "tokenizer", "data", "common"},
    "extras.engine": {"root"},
    "extras.serving": {"root", "extras.engine", "extras.bench"},
    "extras.bench": {"root", "extras.engine", "extras.checkpoints", "extras.real.chunked_ce"},
    "extras.real": {"root", "extras.engine", "extras.bench"},
}
COMMANDS = {}  # a command line of a room that imports beyond what its room may


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
    assert graph["common"] >= {("extras.checkpoints.foreign", "foreign")}  # a seam, seen inside its function
    assert {(m, where) for m, where in graph["train"] if m.startswith("extras")} == {
        (other, function) for name, function, other in SEAMS if name == "train"}
    assert ("extras.serving.scheduler", None) in graph["extras.serving.server"]
    assert problems(graph) == []


def test_the_check_sees_upward_imports_cycles_and_imports_past_the_seam():
    known = {*ALLOWED, "extras.checkpoints", "extras.checkpoints.hf", "extras.checkpoints.foreign",
             "extras.serving", "extras.serving.serve", "extras.serving.server"}
    graph = {"model": imports("import mars\n", "model", known), "mars": set(),
             "engine": imports("import model\ndef f():\n    from extras.serving import serve\n", "engine", known),
             "common": imports("def foreign():\n    from extras.checkpoints import foreign\n", "common", known),
             "tokenizer": imports("from extras.checkpoints.hf import export\n", "tokenizer", known),
             "extras.checkpoints.foreign": imports("from . import hf\n", "extras.checkpoints.foreign", known),
             "extras.checkpoints.hf": imports("import common\nimport model\n", "extras.checkpoints.hf", known),
             "extras.serving.serve": imports("from . import server\n", "extras.serving.serve", known),
             "extras.serving.server": imports("def run():\n    from .serve import Served\n",
                                              "extras.serving.server", known)}
    assert graph["engine"] == {("model", None), ("extras.serving.serve", "f")}
    assert graph["extras.serving.server"] == {("extras.serving.serve", "run")}  # a relative, lazy import
    assert problems(graph) == [
        "engine.py imports extras.serving.serve outside a seam", "model.py imports mars",
        "tokenizer.py imports extras.checkpoints.hf outside a seam",
        "an import cycle through common", "an import cycle through extras.checkpoints.foreign",
        "an import cycle through extras.checkpoints.hf",
        "an import cycle through extras.serving.serve", "an import cycle through extras.serving.server"]
