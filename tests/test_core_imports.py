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
    assert {"model", "mars", "data", "tokenizer", "cli", "sample", "train"} <= set(names)
    code = f"BLOCKED = {BLOCKED!r}\nROOT_MODULES = {names!r}\n" + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ONE_THREAD})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"imported {len(names)} root modules"
