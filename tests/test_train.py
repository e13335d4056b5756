"""train.py end to end: the two stages, checkpoints, logs, Ctrl-C and --resume, the
non-finite guard, and data-parallel training with torchrun (conftest.run_cli; real
processes where a process matters: Ctrl-C, torchrun, --compile)."""
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import common
import data
import mars
import model
from extras.bench import precision
import train
from conftest import MASK, ONE_THREAD, ROOT, V, assert_one_line_error, run_cli, tiny_config

SHORT = ["--preset", "tiny", "--ar_iters", "10", "--mars_iters", "10", "--eval_every", "5", "--save_every", "5"]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_checkpoint(path, stage, done=True):
    ckpt = load(path)
    assert {"model", "model_config", "tokenizer", "train_config"} <= ckpt.keys()
    assert ckpt["stage"] == stage and ckpt["done"] is done
    model, tok = common.model_from_checkpoint(ckpt)  # weights, config and tokenizer fit together
    assert model.config.vocab_size == tok.n_vocab
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    return ckpt


def test_tiny_run_all_stages(tiny_run):
    """The shared session run (train.main in-process, --stage all) wrote everything."""
    for stage in ("ar", "mars"):
        ckpt = assert_checkpoint(tiny_run / f"{stage}.pt", stage)
        assert ckpt["iter"] == train.PRESETS["tiny"][f"{stage}_iters"]
        log = json.loads((tiny_run / f"{stage}_log.json").read_text())
        assert [r["iter"] for r in log] == list(range(1, ckpt["iter"] + 1))
        assert (tiny_run / f"{stage}_loss.png").stat().st_size > 1000
        assert log[-1]["stage_seconds"] >= log[-1]["elapsed_s"] > 0  # the stage's wall time: setup and validation too
        # the tiny preset pins float32, so its losses are the same on every machine (no probe)
        assert log[-1]["precision"] == ckpt["train_config"]["precision_why"] == {"dtype": "float32",
                                                                                 "reason": "the tiny preset's"}
    assert load(tiny_run / "mars.pt")["mars"]["B"] == 4
    # one config, resolved once: both stages save the command line's, which the tiny preset leaves nothing to derive
    argv = ["--preset", "tiny", "--out_dir", str(tiny_run), "--stage", "all", "--device", "cpu"]
    assert load(tiny_run / "ar.pt")["train_config"] == load(tiny_run / "mars.pt")["train_config"] \
        == vars(train.get_args(argv))
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert [r["threshold"] for r in summary] == [None, 1.0, 0.9]
    # MARS at tau = 1.0 is one token per forward
    assert summary[1]["tokens_per_forward"] == 1.0


def test_each_stage_logs_its_validation_accuracy(tiny_run):
    """The last log record of a stage holds the greedy accuracy on the validation prompts (what a data
    mix is chosen on): the same figures eval.score gives for the saved checkpoint on those prompts."""
    from extras.bench.eval import score
    tiny = train.PRESETS["tiny"]
    val = data.build_instruction_set(0, tiny["n_train"])["val"][:tiny["summary_limit"]]
    for stage, B in (("ar", 1), ("mars", 4)):
        last = json.loads((tiny_run / f"{stage}_log.json").read_text())[-1]
        model, tok = common.model_from_checkpoint(load(tiny_run / f"{stage}.pt"))
        r = score(model.eval(), tok, val, B=B, tau=1.0)
        assert last["val_accuracy"] == r["accuracy"]
        assert last["val_per_task"] == {k: round(v["accuracy"], 4) for k, v in r["per_task"].items()}
        assert set(last["val_per_task"]) == set(data.TASKS)


# The tiny preset's losses with seed 0: steps 1 to 20, the last step and the last validation loss, as
# `python train.py --preset tiny` trained them (and, from its ar.pt, --stage control and --stage mars --no_sft
# --block_offset random). What the loop trains must not change with how it is written; the tolerance
# leaves room for other CPU kernels (AVX2, AVX-512) and thread counts.
RECORDED = {
    "ar": [6.243201, 6.162933, 5.939023, 5.993511, 5.814417, 5.741972, 5.52785, 5.403128, 5.325809, 5.048731,
           5.217499, 4.775753, 4.684491, 4.88992, 4.8042, 4.774744, 4.581063, 4.288896, 4.637951, 4.252309,
           3.266894, 3.951051],
    "mars": [8.305395, 7.873238, 7.530859, 6.978845, 8.017904, 7.837166, 8.722902, 7.757631, 9.214622, 8.245268,
             7.63775, 6.993662, 7.20224, 7.471941, 6.692234, 6.625882, 6.686236, 6.862088, 7.457521, 5.807171,
             6.212432, 6.500416],
    "control": [3.61644, 3.694952, 3.381108, 3.120434, 3.694993, 3.606918, 4.063271, 3.536238, 3.88839, 3.177651,
                3.248993, 2.886333, 3.227591, 3.1856, 2.746214, 2.865573, 2.87925, 2.934155, 3.568245, 2.324401,
                2.534563, 2.762205],
    "no_sft": [10.88731, 36.22842, 16.09932, 9.156023, 17.41296, 9.469558, 29.85783, 58.19818, 44.19955, 14.06161,
               12.91224, 10.34294, 54.92441, 16.6311, 10.49489, 107.2169, 15.45365, 8.266948, 8.540608, 7.481094,
               14.43618, 3.660956],
}


def recorded_part(log_path):
    log = json.loads(log_path.read_text())
    return [r["loss"] for r in log[:20]] + [log[-1]["loss"], log[-1]["val_loss"]]


def test_tiny_preset_trains_the_recorded_losses(tiny_run, tmp_path):
    """Same seed, same losses: stage 1 and MARS (the shared run), the control and the no_sft ablation with
    random block offsets (their per-step random draws), each against the numbers recorded above."""
    for stage in ("ar", "mars"):
        assert recorded_part(tiny_run / f"{stage}_log.json") == pytest.approx(RECORDED[stage], rel=1e-4), stage
    for key, stage, flags in (("control", "control", []), ("no_sft", "mars", ["--no_sft", "--block_offset", "random"])):
        d = tmp_path / key
        proc = run_cli(["train.py", "--preset", "tiny", "--stage", stage, *flags, "--init_from", tiny_run / "ar.pt",
                        "--summary_limit", "0", "--device", "cpu", "--out_dir", d])
        assert proc.returncode == 0, proc.stderr
        assert recorded_part(d / f"{stage}_log.json") == pytest.approx(RECORDED[key], rel=1e-4), key


def test_stage_ar_then_mars(tmp_path):
    d = tmp_path / "run"
    proc = run_cli(["train.py", *SHORT, "--stage", "ar", "--out_dir", d], fresh=True)
    assert proc.returncode == 0, proc.stderr
    ar = assert_checkpoint(d / "ar.pt", "ar")
    assert "mars" not in ar
    assert ar["train_config"]["n_layer"] == 2 and ar["model_config"]["max_seq_len"] == 64
    assert not (d / "mars.pt").exists()

    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--init_from", d / "ar.pt", "--B", "3",
                    "--ar_weight", "0.5", "--out_dir", d])
    assert proc.returncode == 0, proc.stderr
    ckpt = assert_checkpoint(d / "mars.pt", "mars")
    assert ckpt["mars"] == {"B": 3, "ar_weight": 0.5, "no_sft": False, "block_offset": "fixed",
                            "targets": "hard", "clean_padding": "keep"}
    log = json.loads((d / "mars_log.json").read_text())
    assert {"loss", "noisy", "clean"} <= log[0].keys()
    for r in log:
        assert abs(r["loss"] - (r["noisy"] + 0.5 * r["clean"])) < 1e-4
    assert "val_loss" in log[-1]
    for stage in ("ar", "mars"):
        assert (d / f"{stage}_log.json").exists() and (d / f"{stage}_loss.png").exists()
    # stage 2 starts from the stage-1 weights: its first clean (AR) loss is the end of stage 1's
    ar_log = json.loads((d / "ar_log.json").read_text())
    assert log[0]["clean"] < ar_log[0]["loss"]
    assert abs(log[0]["clean"] - ar_log[-1]["loss"]) < 1.0

    # stage 2 must start from a stage-1 checkpoint
    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--init_from", d / "mars.pt", "--out_dir", tmp_path / "x"])
    assert_one_line_error(proc)
    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--init_from", tmp_path / "nope.pt", "--out_dir", tmp_path / "x"])
    assert_one_line_error(proc)


def untimed(log_path):
    """A training log without its wall-clock fields, which no two runs share."""
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "stage_seconds")}
            for r in json.loads(log_path.read_text())]


RESUME_CMD = ["train.py", "--preset", "tiny", "--stage", "ar", "--ar_iters", "80", "--save_every", "5",
              "--eval_every", "40"]


def popen(args):
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env={**os.environ, **ONE_THREAD},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_interrupt_and_resume_reproduce_an_uninterrupted_run(tmp_path):
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    procs = [popen(RESUME_CMD + ["--out_dir", d2])]  # the reference runs alongside
    try:
        p = popen(RESUME_CMD + ["--out_dir", d1])
        procs.append(p)
        deadline = time.time() + 240
        while not (d1 / "ar.pt").exists():
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=240)
        reference = procs[0]
    except BaseException:
        for q in procs:
            q.kill()
        raise
    assert p.returncode == 130, out + err
    assert "Traceback" not in out + err
    assert "--resume" in out and "resume with" in out
    ckpt = assert_checkpoint(d1 / "ar.pt", "ar", done=False)
    step = ckpt["iter"]
    assert 5 <= step < 80

    proc = run_cli(RESUME_CMD + ["--out_dir", d1, "--resume"])
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert "resum" in first and "ar" in first and str(step) in first, first

    try:
        out, err = reference.communicate(timeout=300)
    finally:
        reference.kill()
    assert reference.returncode == 0, err
    a, b = assert_checkpoint(d1 / "ar.pt", "ar"), assert_checkpoint(d2 / "ar.pt", "ar")
    assert a["iter"] == b["iter"] == 80
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert untimed(d1 / "ar_log.json") == untimed(d2 / "ar_log.json")

    # resuming a finished run does nothing, successfully
    proc = run_cli(RESUME_CMD + ["--out_dir", d1, "--resume"])
    assert proc.returncode == 0 and "complete" in proc.stdout.splitlines()[0], proc.stdout + proc.stderr
    assert torch.equal(load(d1 / "ar.pt")["model"]["wte.weight"], a["model"]["wte.weight"])


def test_non_finite_gradient_stops_with_one_line_and_keeps_checkpoint(tmp_path):
    d = tmp_path / "nan"
    proc = run_cli(["train.py", "--preset", "tiny", "--stage", "ar", "--ar_iters", "6", "--lr", "1e30",
                    "--save_every", "1", "--out_dir", d])
    assert_one_line_error(proc)
    assert proc.stderr.startswith("error: non-finite"), proc.stderr
    ckpt = assert_checkpoint(d / "ar.pt", "ar", done=False)  # loads, every weight finite
    assert ckpt["iter"] < 6


def torchrun():
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def ddp_failure(proc):
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line.lower()]
    return "\n".join(errors) + "\n...\n" + proc.stderr[-1500:]


def run_ddp(args, timeout=300):
    return subprocess.run([*torchrun(), "--standalone", "--nproc_per_node=2", "train.py", *map(str, args)],
                          cwd=ROOT, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=timeout)


def test_ddp_two_processes(tmp_path):
    """Both stages and the summary on two processes. Each stage is shorter than --save_every, so ar.pt
    is written only at its end (by rank 0), and the other rank must wait for it before stage 2 loads it."""
    d = tmp_path / "ddp"
    proc = run_ddp(["--preset", "tiny", "--ar_iters", "10", "--mars_iters", "10", "--summary_limit", "4",
                    "--out_dir", d])
    assert proc.returncode == 0, ddp_failure(proc)
    assert train.PRESETS["tiny"]["save_every"] > 10
    ar = assert_checkpoint(d / "ar.pt", "ar")
    assert_checkpoint(d / "mars.pt", "mars")
    assert ar["train_config"]["batch_size"] == train.PRESETS["tiny"]["batch_size"]
    assert (d / "summary.json").exists()
    # only rank 0 prints
    assert proc.stdout.count("instruction set:") == 1


def test_own_jsonl_data_end_to_end(tmp_path):
    """Training on a user's small JSONL file, both stages and the summary. Its
    records all hash to the train split, so val and test are empty."""
    import data
    records, i = [], 0
    while len(records) < 24:
        prompt = f"Say the number {i}."
        if data.split_of(prompt) == "train":
            records.append({"prompt": prompt, "response": f"The number is {i}."} if i % 2 else
                           {"messages": [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": f"The number is {i}."}]})
        i += 1
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    d = tmp_path / "out"
    proc = run_cli(["train.py", "--preset", "tiny", "--data", path, "--ar_iters", "3", "--mars_iters", "3",
                    "--out_dir", d])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr
    ckpt = assert_checkpoint(d / "mars.pt", "mars")
    assert ckpt["train_config"]["data"] == str(path)


def test_control_and_ablation_stages(tmp_path):
    """--stage control is stage 2 without its noisy stream (the clean term alone, same batches and schedule);
    --no_sft is the paper's ablation (no clean loss, noisy loss weighted 1/t);
    --block_offset random shifts the blocks. All start from the same stage-1 checkpoint."""
    d = tmp_path / "run"
    assert run_cli(["train.py", *SHORT, "--stage", "ar", "--out_dir", d]).returncode == 0
    proc = run_cli(["train.py", *SHORT, "--stage", "control", "--mars_iters", "7", "--out_dir", d])
    assert proc.returncode == 0, proc.stderr
    control = assert_checkpoint(d / "control.pt", "control")
    assert "mars" not in control and control["iter"] == 7 and control["control"] == {"B": 4}
    log = json.loads((d / "control_log.json").read_text())
    assert set(log[0]) == {"iter", "lr", "loss", "elapsed_s"}
    assert log[0]["loss"] < json.loads((d / "ar_log.json").read_text())[0]["loss"]  # it starts from stage 1
    # like for like: from the same weights, on the same first batch, padded to a multiple of B and averaged
    # per sequence, the control's loss is exactly MARS's clean term (a token mean would not be)
    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--mars_iters", "7", "--out_dir", d / "m",
                    "--init_from", d / "ar.pt"])
    assert proc.returncode == 0, proc.stderr
    clean = json.loads((d / "m" / "mars_log.json").read_text())[0]["clean"]
    assert abs(log[0]["loss"] - clean) < 1e-5 * clean
    # --resume of an unfinished stage refuses changed stage-2 flags in one line
    ckpt = torch.load(d / "m" / "mars.pt", weights_only=True)
    torch.save({**ckpt, "done": False}, d / "m" / "mars.pt")
    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--mars_iters", "7", "--out_dir", d / "m",
                    "--resume", "--B", "8"])
    assert_one_line_error(proc)
    assert "B 4 -> 8" in proc.stderr

    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--no_sft", "--block_offset", "random",
                    "--out_dir", d / "nosft", "--init_from", d / "ar.pt"])
    assert proc.returncode == 0, proc.stderr
    ckpt = assert_checkpoint(d / "nosft" / "mars.pt", "mars")
    assert ckpt["mars"] == {"B": 4, "ar_weight": 0.0, "no_sft": True, "block_offset": "random",
                            "targets": "hard", "clean_padding": "keep"}
    log = json.loads((d / "nosft" / "mars_log.json").read_text())
    # the loss is the reweighted noisy loss alone: not the plain noisy mean, and no clean part
    assert any(abs(r["loss"] - r["noisy"]) > 1e-3 for r in log)


def test_bf16_autocast_on_cpu_both_stages(tmp_path):
    """The mixed-precision path runs on any device: a few steps of each stage under bf16 autocast."""
    proc = run_cli(["train.py", *SHORT, "--ar_iters", "3", "--mars_iters", "3", "--precision", "bfloat16",
                    "--summary_limit", "2", "--out_dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    for stage in ("ar", "mars"):
        ckpt = assert_checkpoint(tmp_path / f"{stage}.pt", stage)
        assert ckpt["train_config"]["precision"] == "bfloat16"
        assert ckpt["train_config"]["precision_why"] == {"dtype": "bfloat16", "reason": "--precision bfloat16"}
        assert all(v.dtype == torch.float32 for v in ckpt["model"].values())  # autocast keeps fp32 weights
    start = proc.stdout.index("config:")  # the config, printed once, before the first step
    assert proc.stdout.count("config:") == 1 and start < proc.stdout.index("ar 3/3")
    assert "precision=bfloat16" in proc.stdout[start:proc.stdout.index("ar 3/3")]


def test_cpu_bf16_attention_takes_the_math_path_at_the_flash_kernels_loss_and_gradients():
    """Training's context on the CPU under bf16 (train.autocast) runs short attention on the math path, faster to
    train there; the MARS loss and its gradients match plain bf16 autocast's (the flash kernel) to bf16's
    precision. Long sequences keep the flash kernel; float32 turns nothing on."""
    torch.manual_seed(0)
    net = model.GPT(tiny_config())
    x = torch.randint(V - 2, (4, 24))
    y = torch.cat([torch.full((4, 6), -1), x[:, 7:], torch.full((4, 1), -1)], dim=1)  # a 6-token prompt

    def loss_and_grads(context):
        net.zero_grad(set_to_none=True)
        with context:
            flash_on = torch.backends.cuda.flash_sdp_enabled()  # sdpa_kernel's switches serve the CPU too
            loss = mars.mars_loss(net, x, y, MASK, B=4)[0]
        loss.backward()
        return flash_on, loss.item(), torch.cat([p.grad.flatten() for p in net.parameters()])
    flash_on, flash_loss, flash_grads = loss_and_grads(torch.autocast("cpu", torch.bfloat16))
    math_flash_on, math_loss, math_grads = loss_and_grads(train.autocast("cpu", "bfloat16", 24))
    assert flash_on and not math_flash_on
    assert math_loss == pytest.approx(flash_loss, rel=1e-2) and torch.isfinite(math_grads).all()
    assert torch.nn.functional.cosine_similarity(math_grads, flash_grads, dim=0) > 0.999
    with train.autocast("cpu", "bfloat16", 256):  # 512 positions: the flash kernel is the faster there
        assert torch.is_autocast_enabled("cpu") and torch.backends.cuda.flash_sdp_enabled()
    with train.autocast("cpu", "float32", 24):
        assert not torch.is_autocast_enabled("cpu") and torch.backends.cuda.flash_sdp_enabled()


def test_gpu_preset_takes_a_step_on_cpu(tmp_path):
    """The gpu preset's model (8 x 512) builds and takes a stage-1 step without CUDA; a small batch keeps it quick."""
    proc = run_cli(["train.py", "--preset", "gpu", "--device", "cpu", "--n_train", "2000", "--batch_size", "2",
                    "--stage", "ar", "--ar_iters", "1", "--summary_limit", "1", "--out_dir", tmp_path], timeout=600)
    assert proc.returncode == 0, proc.stderr
    ckpt = assert_checkpoint(tmp_path / "ar.pt", "ar")
    assert ckpt["model_config"]["n_layer"] == 8 and ckpt["model_config"]["n_embd"] == 512
    why = ckpt["train_config"]["precision_why"]  # the preset leaves it to the probe
    assert ckpt["train_config"]["precision"] == why["dtype"] and why["float32_ms"] > 0


# A CPU without native bf16, emulated on one with it: torch's, oneDNN's and MKL's kernels limited to AVX2
# (there a bf16 matmul runs 10-30x slower than in float32). torch reads these when it is imported.
NO_NATIVE_BF16 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AVX2 is an x86 instruction set")
def test_precision_probe_picks_float32_without_native_bf16_and_the_flag_forces(tmp_path):
    """--precision auto times both precisions on the model's shapes and, where bf16 is slow, trains in float32:
    the log says so with the timings and the CPU's capability, and the checkpoint and the stage log record
    them. --precision bfloat16 still trains in bf16 there."""
    cmd = ["train.py", "--preset", "tiny", "--stage", "ar", "--ar_iters", "2", "--summary_limit", "0"]
    proc = run_cli(cmd + ["--precision", "auto", "--out_dir", tmp_path / "auto"], env=NO_NATIVE_BF16)
    assert proc.returncode == 0, proc.stderr
    cfg = load(tmp_path / "auto" / "ar.pt")["train_config"]
    assert cfg["precision"] == cfg["precision_why"]["dtype"] == "float32"
    assert cfg["precision_why"]["device"] == "CPU capability AVX2"
    assert cfg["precision_why"]["bfloat16_ms"] > cfg["precision_why"]["float32_ms"] > 0
    line = next(line for line in proc.stdout.splitlines() if line.startswith("precision:"))
    assert line.startswith("precision: float32") and "AVX2" in line and " ms" in line
    assert json.loads((tmp_path / "auto" / "ar_log.json").read_text())[-1]["precision"] == cfg["precision_why"]
    proc = run_cli(cmd + ["--precision", "bfloat16", "--out_dir", tmp_path / "forced"], env=NO_NATIVE_BF16)
    assert proc.returncode == 0, proc.stderr
    assert load(tmp_path / "forced" / "ar.pt")["train_config"]["precision"] == "bfloat16"
    assert "precision:" not in proc.stdout  # nothing measured


def simulated(per_row, bf16_ratio, fixed=0.0):
    """A time_run for precision.probe: float32 takes `fixed` seconds plus per_row a row, bf16 the same fixed part
    plus bf16_ratio times float32's per row; and the list of (rows, bf16, seconds) it was asked for."""
    runs = []

    def time_run(rows, bf16):
        runs.append((rows, bf16, fixed + rows * per_row * (bf16_ratio if bf16 else 1)))
        return runs[-1][2]
    return time_run, runs


@pytest.mark.parametrize("bf16_ratio, want", [(0.3, "bfloat16"), (0.9, "bfloat16"), (0.95, "float32"),
                                              (1.5, "float32"), (30, "float32"), (300, "float32")])
def test_precision_probe_decides_on_a_clear_margin_within_its_budget(bf16_ratio, want):
    """On simulated timings: bf16 only where it takes at most 90% of float32's time on a step's tokens; the
    runs after the warm-up take about the probe's budget in all, however slow bf16 is, as the rows shrink
    until the slower precision's run takes a tenth of it (16 rows at least, for a cost per token to show)."""
    time_run, runs = simulated(1e-4, bf16_ratio)
    fp32, bf16, rows = precision.probe(time_run, tokens=8192, budget=2.0)
    assert precision.decide(fp32, bf16) == want
    assert (fp32, bf16) == pytest.approx((8192 * 1e-4, 8192 * 1e-4 * bf16_ratio))
    timed = runs[8:]  # after two warm-up runs of each precision on 1 and on 16 tokens
    assert {r for r, _, _ in timed} == {1, rows} and max(t for _, _, t in timed) <= max(0.2, 16e-4 * bf16_ratio)
    assert sum(t for _, _, t in timed) <= 2.0 + 2 * 0.2
    time_run, _ = simulated(1e-9, bf16_ratio)  # a fast device: the whole step's tokens
    assert precision.probe(time_run, tokens=8192, budget=2.0)[2] == 8192


def test_the_probe_sees_through_a_big_models_fixed_cost():
    """A big model on a CPU: half a second a run whatever the tokens (every weight's gradient), then bf16 at
    0.4x float32's cost per token. A run on a few tokens shows the two alike; the prediction for a step of
    2,048 tokens shows bf16's gain, and the probe chooses it."""
    time_run, runs = simulated(6e-3, 0.4, fixed=0.5)
    fp32, bf16, rows = precision.probe(time_run, tokens=2048, budget=2.0)
    assert runs[4][2] / runs[0][2] > 0.95  # one token: the precisions look the same
    assert (fp32, bf16) == pytest.approx((0.5 + 2048 * 6e-3, 0.5 + 2048 * 6e-3 * 0.4))
    assert precision.decide(fp32, bf16) == "bfloat16" and 16 <= rows < 2048


def test_a_gpu_without_bf16_trains_in_float32_unprobed(monkeypatch):
    """A GPU without native bf16 (a T4) trains in float32, not probed, and the log and the record say why and
    name the GPU. The check asks for native bf16: by default torch counts a T4's emulation as support. On a CPU
    the probe still decides, whatever CUDA would say."""
    asked = []
    monkeypatch.setattr(precision.torch.cuda, "is_bf16_supported", lambda **kw: asked.append(kw) or False)
    monkeypatch.setattr(precision.torch.cuda, "get_device_name", lambda device=None: f"Tesla T4 ({device})")
    monkeypatch.setattr(precision, "probe", lambda *a, **k: pytest.fail("a GPU without bf16 was probed"))
    why = precision.choose_dtype(SimpleNamespace(device="cuda:1"), None, 1)
    assert asked == [{"including_emulation": False}]
    assert why == {"dtype": "float32", "device": "Tesla T4 (cuda:1)", "reason": "Tesla T4 (cuda:1) has no native "
                   "bf16 (not probed), and fp16 would need loss scaling, which this project does not do"}
    monkeypatch.setattr(precision, "probe", lambda *a, **k: (1.0, 0.5, 16))  # bf16 twice as fast
    cpu = SimpleNamespace(device="cpu", micro_batch=None, batch_size=16, max_seq_len=64)
    why = precision.choose_dtype(cpu, None, 1)
    assert why["dtype"] == "bfloat16" and why["bfloat16_ms"] == 500 and len(asked) == 1


def test_progress_prints_30_s_after_its_last_line(monkeypatch, capsys):
    """A slow machine learns its ETA within the first minute: between the lines every 2% of the stage, a
    line comes once 30 s have passed since the last one."""
    clock = [1000.0]
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: clock[0]))
    progress = train.Progress(SimpleNamespace(name="ar", rank=0, iters=5000, first_step=0, seconds_before=0.0), 0)
    for step, seconds, prints in ((1, 29, False), (2, 2, True), (3, 10, False), (4, 25, True)):
        clock[0] += seconds
        progress.report({"iter": step, "lr": 1e-3, "loss": 2.0, "elapsed_s": 0.0}, 1000)
        out = capsys.readouterr().out
        assert (out.startswith(f"ar {step}/5000 ") and "ETA stage" in out) if prints else out == "", (step, out)


MARS_RESUME = ["train.py", "--preset", "tiny", "--stage", "mars", "--mars_iters", "60", "--save_every", "5",
               "--eval_every", "30"]


def test_interrupted_mars_stage_resumes_to_the_uninterrupted_run(tiny_run, tmp_path):
    """Stage 2 interrupted (Ctrl-C) and resumed continues from its step with its optimizer, batch order and
    MARS settings: the same weights and log as a run never interrupted."""
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    cmd = MARS_RESUME + ["--init_from", tiny_run / "ar.pt"]
    reference = popen(cmd + ["--out_dir", d2])
    try:
        p = popen(cmd + ["--out_dir", d1])
        deadline = time.time() + 240
        while not (d1 / "mars.pt").exists():
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=240)
        assert p.returncode == 130, out + err
        step = assert_checkpoint(d1 / "mars.pt", "mars", done=False)["iter"]
        assert 5 <= step < 60
        proc = run_cli(cmd + ["--out_dir", d1, "--resume"])
        assert proc.returncode == 0, proc.stderr
        assert "resuming stage mars" in proc.stdout and str(step) in proc.stdout.splitlines()[0], proc.stdout
        out, err = reference.communicate(timeout=300)
        assert reference.returncode == 0, err
    finally:
        reference.kill()
    a, b = assert_checkpoint(d1 / "mars.pt", "mars"), assert_checkpoint(d2 / "mars.pt", "mars")
    assert a["iter"] == b["iter"] == 60 and a["mars"] == b["mars"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert untimed(d1 / "mars_log.json") == untimed(d2 / "mars_log.json")


def test_compile_one_mars_step_matches_eager(tiny_run, tmp_path):
    """--compile trains (here one MARS step: the [noisy | clean] forward with its mask, compiled), writes a
    checkpoint that loads, and its loss is the eager one."""
    if not shutil.which(os.environ.get("CXX", "g++")):  # inductor's CPU backend builds its kernels with g++
        pytest.skip("torch.compile's CPU backend needs a C++ compiler: no g++ (or $CXX) on PATH")
    cmd = ["train.py", "--preset", "tiny", "--stage", "mars", "--mars_iters", "1", "--init_from", tiny_run / "ar.pt"]
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        proc = run_cli(cmd + extra + ["--out_dir", tmp_path / name], timeout=600,
                       fresh=True)  # a process of its own: compiled state would outlive the test
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert_checkpoint(tmp_path / name / "mars.pt", "mars")
    eager, compiled = (json.loads((tmp_path / n / "mars_log.json").read_text())[0] for n in ("eager", "compiled"))
    for k in ("loss", "noisy", "clean", "val_loss"):
        assert abs(compiled[k] - eager[k]) < 1e-4 * abs(eager[k]), (k, compiled[k], eager[k])


# ---------------------------------------------------------------------------
# Length-bucketed batches


def padded_length(row, multiple):
    return len(row[0]) + (-len(row[0]) % multiple)


def padding_fraction(rows, batch, multiple):
    lengths = [padded_length(rows[i], multiple) - 1 for i in batch]
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


@pytest.mark.parametrize("multiple", [1, 4])
def test_length_buckets_reach_every_row_and_cut_padding(tok, splits, multiple):
    """Every row lies in exactly one bucket, buckets follow (padded) length, a batch comes from one bucket
    picked in proportion to its size (so every row is as likely as in uniform draws), the seed fixes the
    draws, and a bucketed batch carries a fraction of a uniform batch's padding."""
    rows = data.tokenize(splits["train"], tok, 64, multiple)
    buckets = data.length_buckets(rows, 16, multiple, min_seqs=8 * 16)
    assert len(buckets) == 16 and sorted(i for b in buckets for i in b) == list(range(len(rows)))
    assert max(map(len, buckets)) - min(map(len, buckets)) <= 1
    for shorter, longer in zip(buckets, buckets[1:]):
        assert max(padded_length(rows[i], multiple) for i in shorter) <= min(padded_length(rows[i], multiple)
                                                                               for i in longer)
    bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
    draws = [data.draw_batch(buckets, 16, g) for g in [torch.Generator().manual_seed(0)] for _ in range(800)]
    again = torch.Generator().manual_seed(0)
    assert [data.draw_batch(buckets, 16, again) for _ in range(5)] == draws[:5]
    assert all(len({bucket_of[i] for i in d}) == 1 for d in draws)
    picked = [sum(bucket_of[d[0]] == k for d in draws) for k in range(16)]
    assert min(picked) > 20 and max(picked) < 90  # 50 each on average
    # one bucket: the plain uniform draws over all rows
    uniform = data.length_buckets(rows, 1, multiple)
    g = torch.Generator().manual_seed(3)
    assert data.draw_batch(uniform, 16, g) == torch.randint(len(rows), (16,),
                                                            generator=torch.Generator().manual_seed(3)).tolist()
    before = sum(padding_fraction(rows, data.draw_batch(uniform, 16, g), multiple) for _ in range(400)) / 400
    after = sum(padding_fraction(rows, d, multiple) for d in draws[:400]) / 400
    assert before > 0.2 and after < 0.3 * before
    assert len(data.length_buckets(rows[:100], 16, multiple, min_seqs=128)) == 1  # too few rows to split


def test_bucketed_batch_loss_is_the_mean_of_per_example_losses(tok, splits):
    """Bucketing keeps the per-sequence normalisation: on a bucketed batch whose rows differ in length and
    in prompt length (so the batch is padded, and its noisy stream starts where its earliest answer's block
    does), the MARS loss, both its terms and the control's loss are each the mean over rows of that row's
    loss alone (with a block offset and --no_sft weights: tests/test_options.py)."""
    from model import GPT, GPTConfig
    rows = data.tokenize(splits["train"], tok, 64, 4)
    buckets = data.length_buckets(rows, 16, 4, min_seqs=128)
    mixed = next(b for b in buckets if len({padded_length(rows[i], 4) for i in b}) > 1)
    batch = [rows[i] for i in data.draw_batch([mixed], 12, torch.Generator().manual_seed(0))]
    assert len({padded_length(r, 4) for r in batch}) > 1 and len({n for _, n in batch}) > 1
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=tok.n_vocab, max_seq_len=64, n_layer=2, n_head=2, n_embd=32)).double()
    x, y = data.make_batch(batch, tok.eot, 4)
    terms = mars.mars_loss(m, x, y, tok.mask, 4, 0.5)
    alone = [mars.mars_loss(m, *data.make_batch([r], tok.eot, 4), tok.mask, 4, 0.5) for r in batch]
    for k, term in enumerate(terms):
        torch.testing.assert_close(term, torch.stack([a[k] for a in alone]).mean(), atol=0, rtol=1e-6)
    control = mars.ar_loss(m, x, y, per_sequence=True)
    alone = torch.stack([mars.ar_loss(m, *data.make_batch([r], tok.eot, 4), per_sequence=True) for r in batch])
    torch.testing.assert_close(control, alone.mean(), atol=0, rtol=1e-6)  # CE runs in float32


def test_run_eta_counts_what_follows_each_stage(splits):
    """The ETA of the whole run: after stage 1 come stage 2, the validation accuracies and the summary;
    after stage 2, its validation accuracy and the summary; a lone stage has no summary after it."""
    args = train.get_args(["--preset", "tiny", "--device", "cpu"])
    after_ar = train.work_after("ar", ["ar", "mars"], args, splits)
    after_mars = train.work_after("mars", ["ar", "mars"], args, splits)
    assert after_ar > train.STEP_TIME["mars"] * args.mars_iters > after_mars > 0
    assert 0 < train.work_after("mars", ["mars"], args.replace(stage="mars"), splits) < after_mars


def test_profile_train_writes_padding_and_profile(tmp_path):
    """extras/bench/profile_train (docs/padding_cpu.json, docs/profile_cpu.json), on the tiny preset: bucketed
    batches carry less padding and more positions with a loss, stage 2 leaves out noisy prompt blocks,
    and every step's phases are timed."""
    proc = run_cli(["extras/bench/profile_train.py", "--preset", "tiny", "--steps", "1", "--batches", "20", "--threads",
                    "1", "--dtypes", "float32", "--out_dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    pad = {(r["stage"], r["buckets"]): r for r in json.loads((tmp_path / "padding_tiny.json").read_text())["rows"]}
    for stage in ("ar", "mars"):
        before, after = pad[stage, 1], pad[stage, 16]
        assert after["padding"] < before["padding"] and after["loss"] > before["loss"]
        assert after["positions_per_batch"] < before["positions_per_batch"]
    assert pad["mars", 16]["in_full"]["positions_per_batch"] > pad["mars", 16]["positions_per_batch"]
    prof = json.loads((tmp_path / "profile_tiny.json").read_text())
    assert prof["command"].startswith("python -m extras.bench.profile_train --preset tiny")
    assert {(r["stage"], r["buckets"]) for r in prof["rows"]} == set(pad)
    assert all(r["ms"][k] > 0 for r in prof["rows"] for k in ("forward", "backward", "optimizer", "step"))
