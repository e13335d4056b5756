"""Which modules a command loads, each run in a fresh interpreter so that nothing imported by
other tests counts. The method (model, mars, data, tokenizer, common, sample, train) imports and
runs with jinja2, safetensors, gguf and transformers unimportable: they serve the Hugging Face path
in extras/ alone. `python sample.py` and `python train.py` import nothing from extras/; rustbpe
loads only when a tokenizer is trained. extras' own commands may import what they need."""
import os
import subprocess
import sys

import pytest

from conftest import ONE_THREAD, ROOT

SPINE = {"model", "mars", "train", "sample", "data", "tokenizer", "common", "stats"}
BLOCKED = ("jinja2", "safetensors", "gguf", "transformers")
BLOCK = """
import sys

import pytest

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
"""
METHOD = """
import importlib
for name in ROOT_MODULES:
    importlib.import_module(name)
assert "rustbpe" not in sys.modules and "matplotlib" not in sys.modules, "imported before needed"
import data, tokenizer
splits = data.build_instruction_set(0, n_train=300, n_val=20, n_test=20)
texts = (e["prompt"] + "\\n" + e["response"] for e in splits["train"])
tok = tokenizer.Tokenizer.train(texts, 300)
assert "rustbpe" in sys.modules
ids = tok.prompt_ids("What is 2 + 3?")
assert ids[:2] == [tok.eot, tok.user] and ids[-1] == tok.assistant
again = tokenizer.Tokenizer.from_state(tok.state())
assert again.prompt_ids("What is 2 + 3?") == ids
assert again.example_ids("Hi", "Yo") == tok.example_ids("Hi", "Yo")
assert not {m.split(".")[0] for m in sys.modules} & set(BLOCKED)
print(sorted(m for m in sys.modules if m == "extras" or m.startswith("extras.")))
"""
COMMAND = """
import os, runpy
sys.argv = ARGV
try:
    runpy.run_path(ARGV[0], run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
files = {getattr(mod, "__file__", None) or "" for mod in list(sys.modules.values())}
ours = [os.path.relpath(f, ROOT)[:-3] for f in files if f.startswith(ROOT + os.sep)]  # train
extras = [m for m in sys.modules if m == "extras" or m.startswith("extras.")]
print(sorted(set(ours + extras)))
"""


def run(code, cwd=ROOT):
    """What code prints last, run in a fresh interpreter with the Hugging Face stack blocked."""
    code = f"BLOCKED = {BLOCKED!r}\n" + BLOCK + code
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])


def test_the_method_imports_without_the_hugging_face_stack_and_without_extras():
    names = sorted(p.stem for p in ROOT.glob("*.py"))
    assert set(names) == SPINE
    assert run(f"ROOT_MODULES = {names!r}\n" + METHOD) == []


def loaded(cwd, *argv):
    """The project's modules (by file: train, extras/engine/engine) and the extras modules a
    command run in cwd has imported when it ends."""
    return set(run(f"ARGV = {[str(a) for a in argv]!r}\nROOT = {str(ROOT)!r}\n" + COMMAND, cwd))


@pytest.mark.slow
def test_the_papers_commands_import_nothing_from_extras(tiny_run, tmp_path):
    """train.py's --help, the tiny preset and the precision rule (--precision auto), and
    sample.py on a toy checkpoint run on the root's modules alone."""
    train, sample = ROOT / "train.py", ROOT / "sample.py"
    assert loaded(tmp_path, train, "--help") <= SPINE
    small = ["--preset", "tiny", "--n_train", "300", "--summary_limit", "2", "--device", "cpu"]
    ran = loaded(tmp_path, train, *small, "--ar_iters", "2", "--mars_iters", "2",
                 "--out_dir", tmp_path / "t")
    assert ran <= SPINE and {"mars", "model"} <= ran and list((tmp_path / "t").glob("*.pt"))
    rule = loaded(tmp_path, train, *small, "--stage", "ar", "--ar_iters", "1",
                  "--precision", "auto", "--out_dir", tmp_path / "p")
    assert rule <= SPINE
    decoded = loaded(tmp_path, sample, "--ckpt", tiny_run / "mars.pt", "--num_prompts", "2")
    assert "mars" in decoded and decoded <= SPINE - {"train"}
