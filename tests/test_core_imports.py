"""The core imports only what it needs: every root module loads, and the toy tokenizer trains,
renders prompts and round-trips through a checkpoint's state, with jinja2, safetensors and
transformers unimportable (they serve the Hugging Face path in extras/ alone); rustbpe loads only
when a tokenizer is trained. Run in a fresh interpreter, so nothing imported by other tests counts."""
import os
import subprocess
import sys

from conftest import ONE_THREAD, ROOT

BLOCKED = ("jinja2", "safetensors", "transformers")
SCRIPT = """
import importlib, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked by this test")

sys.meta_path.insert(0, Blocked())
try:
    import jinja2
    sys.exit("the blocker let jinja2 through")
except ImportError:
    pass
for name in ROOT_MODULES:
    importlib.import_module(name)
assert "rustbpe" not in sys.modules and "matplotlib" not in sys.modules, "imported before it was needed"
import data, tokenizer
splits = data.build_instruction_set(0, n_train=300, n_val=20, n_test=20)
tok = tokenizer.Tokenizer.train((e["prompt"] + "\\n" + e["response"] for e in splits["train"]), 300)
assert "rustbpe" in sys.modules
ids = tok.prompt_ids("What is 2 + 3?")
assert ids[:2] == [tok.eot, tok.user] and ids[-1] == tok.assistant
again = tokenizer.Tokenizer.from_state(tok.state())
assert again.prompt_ids("What is 2 + 3?") == ids and again.example_ids("Hi", "Yo") == tok.example_ids("Hi", "Yo")
assert not {m.split(".")[0] for m in sys.modules} & set(BLOCKED)
print("imported", len(ROOT_MODULES), "root modules")
"""


def test_root_modules_import_without_the_hugging_face_stack():
    names = sorted(p.stem for p in ROOT.glob("*.py"))
    assert SPINE <= set(names)
    code = f"BLOCKED = {BLOCKED!r}\nROOT_MODULES = {names!r}\n" + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ONE_THREAD})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"imported {len(names)} root modules"


SPINE = {"model", "mars", "train", "sample", "data", "tokenizer", "common"}
PROBE = {"extras/__init__", "extras/bench/__init__", "extras/bench/precision"}  # train.measured_precision
LOADED = """
import os, runpy, sys
sys.argv = ARGV
try:
    runpy.run_path(ARGV[0], run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
files = {getattr(mod, "__file__", None) or "" for mod in list(sys.modules.values())}
print(sorted(os.path.relpath(f, ROOT)[:-3] for f in files if f.startswith(ROOT + os.sep)))  # train.py -> train
"""


def project_modules(argv, cwd):
    """The project's modules a command has imported when it ends, run in a fresh interpreter."""
    code = f"ARGV = {[str(a) for a in argv]!r}\nROOT = {str(ROOT)!r}\n" + LOADED
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(eval(proc.stdout.strip().splitlines()[-1]))


def test_the_papers_path_imports_the_spine_alone(tiny_run, tmp_path):
    """python train.py and python sample.py run on the method's files; the engine comes in only for a flag that
    needs it, cost.py only for --masks auto, and the precision probe (extras/bench/precision.py) only for
    --precision auto, through train.measured_precision: the default cpu preset's precision is auto, so a
    plain `python train.py` on a CPU reaches extras/ there and nowhere else."""
    train, sample, mars_pt = ROOT / "train.py", ROOT / "sample.py", tiny_run / "mars.pt"
    ran = project_modules([train, "--preset", "tiny", "--ar_iters", "2", "--mars_iters", "2", "--n_train", "300",
                           "--summary_limit", "4", "--out_dir", tmp_path, "--device", "cpu"], tmp_path)
    assert ran == SPINE
    assert project_modules([sample, "--ckpt", mars_pt, "--num_prompts", "2"], tmp_path) == SPINE - {"train"}
    batched = project_modules([sample, "--ckpt", mars_pt, "--num_prompts", "2", "--batch_size", "2"], tmp_path)
    engine = {"extras/__init__", "extras/engine/__init__", "extras/engine/engine", "extras/engine/static_cache"}
    assert batched == SPINE - {"train"} | engine
    auto = project_modules([sample, "--ckpt", mars_pt, "--num_prompts", "2", "--masks", "auto"], tmp_path)
    assert auto == SPINE - {"train"} | engine | {"extras/engine/cost"}
    probed = project_modules([train, "--preset", "tiny", "--stage", "ar", "--ar_iters", "1", "--n_train", "300",
                              "--summary_limit", "2", "--precision", "auto", "--out_dir", tmp_path / "p"], tmp_path)
    assert probed == SPINE | PROBE
