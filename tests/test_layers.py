"""The modules form layers and import downwards only (the README's layout):
model, mars, data, tokenizer, cli and stats at the bottom; hf (Hugging Face directories)
on model, tokenizer and cli;
sample above them; train, eval, serve on top.
Read from the source with ast, so a cycle is caught without importing anything."""
import ast

from conftest import ROOT

BOTTOM = {"model", "mars", "data", "tokenizer", "cli"}
# what each module of ours may import: downwards, and on top only the two uses that
# exist (train's end-of-run summary and serve's machine line come from eval); nothing
# imports train, and eval imports no other top module, so no circle can form
ALLOWED = {
    "model": set(), "mars": set(), "data": set(), "tokenizer": set(), "cli": set(), "stats": set(),
    "hf": {"model", "tokenizer", "cli"},  # Hugging Face directories in and out: never mars, never the decoders
    "sample": BOTTOM | {"hf"},
    "train": BOTTOM | {"sample", "eval"},
    "eval_report": set(),  # eval's tables and figures
    "eval": BOTTOM | {"sample", "stats", "eval_report"},
    "serve_report": set(),  # the load experiment's table and figure
    "serve": BOTTOM | {"sample", "eval", "serve_report"},
    "server": BOTTOM | {"sample", "eval", "serve", "serve_report"},  # HTTP on serve's engine; nothing imports it
}


def project_imports(name):
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & ALLOWED.keys()


def test_imports_point_down():
    graph = {name: project_imports(name) for name in ALLOWED if (ROOT / f"{name}.py").exists()}
    for name, imports in graph.items():
        assert imports <= ALLOWED[name], f"{name}.py imports {sorted(imports - ALLOWED[name])}"

    def reaches(a, b, seen=()):  # is there a path of imports from a to b?
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))
    for name in graph:
        assert not reaches(name, name), f"an import cycle through {name}.py"
