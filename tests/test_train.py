"""train.py end to end: the two stages, checkpoints, logs, Ctrl-C and --resume, the
non-finite guard, data-parallel training with torchrun, the command line made from the
presets, its one-line errors, the precision rule, Muon and the wsd schedule (conftest.run_cli;
real processes where a process matters: Ctrl-C, torchrun, --compile)."""
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
        # the tiny preset pins float32, so its losses are the same on every machine
        assert log[-1]["precision"] == ckpt["train_config"]["precision_why"] == {"dtype": "float32",
                                                                                 "reason": "the tiny preset's"}
    assert load(tiny_run / "mars.pt")["mars"] == {"B": 4, "ar_weight": 1.0}
    # one config, resolved once: both stages save the command line's
    argv = ["--preset", "tiny", "--out_dir", str(tiny_run), "--stage", "all", "--device", "cpu"]
    assert load(tiny_run / "ar.pt")["train_config"] == load(tiny_run / "mars.pt")["train_config"] \
        == vars(train.get_config(argv))
    summary = json.loads((tiny_run / "summary.json").read_text())
    table, pair = summary["table"], summary["mars_tau1_minus_ar"]
    assert [r["threshold"] for r in table] == [None, 1.0, 0.95, 0.9]
    # MARS at tau = 1.0 is one token per forward
    assert table[1]["tokens_per_forward"] == 1.0
    # each accuracy inside its interval; the paired difference is the two accuracies' difference
    n = train.get_config(argv).summary_limit
    for r in table:
        lo, hi = r["ci95"]
        assert r["n"] == n and lo - 1e-12 <= r["accuracy"] <= hi + 1e-12  # Wilson's bounds, in floating point
    assert pair["n"] == n and pair["diff"] == pytest.approx(table[1]["accuracy"] - table[0]["accuracy"])
    assert pair["a_only"] - pair["b_only"] == round(n * pair["diff"])


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
# `python train.py --preset tiny` trained them (and, from its ar.pt, --stage control, and the ablation
# `python -m extras.real.train --stage mars --no_sft --block_offset random`, which runs this loop with its
# Stage). What the loop trains must not change with how it is written; the tolerance leaves room for
# other CPU kernels (AVX2, AVX-512) and thread counts.
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
    for key, stage, cmd in (("control", "control", ["train.py"]),
                            ("no_sft", "mars", ["extras/real/train.py", "--no_sft", "--block_offset", "random"])):
        d = tmp_path / key
        proc = run_cli([*cmd, "--preset", "tiny", "--stage", stage, "--init_from", tiny_run / "ar.pt",
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
    assert ckpt["mars"] == {"B": 3, "ar_weight": 0.5}
    log = json.loads((d / "mars_log.json").read_text())
    assert {"loss", "noisy", "clean"} <= log[0].keys()
    for r in log:
        assert abs(r["loss"] - (r["noisy"] + 0.5 * r["clean"])) < 1e-4
    assert "val_loss" in log[-1]
    for stage in ("ar", "mars"):
        assert (d / f"{stage}_log.json").exists() and (d / f"{stage}_loss.png").exists()
    # stage 2 starts from the stage-1 weights: its first clean term is ar.pt's per-sequence AR loss on the
    # first batch stage 2 draws
    cfg = train.get_config([*SHORT, "--stage", "mars", "--init_from", str(d / "ar.pt"), "--B", "3", "--ar_weight",
                            "0.5", "--out_dir", str(d)])
    net, tok, splits, fixed = train.start_stage("mars", None, cfg, None, print)
    stage = train.Stage("mars", net, tok, splits, cfg.replace(**fixed))
    (x, y), = stage.micro_batches(stage.next_batch())
    assert log[0]["clean"] == pytest.approx(mars.ar_loss(net, x, y, per_sequence=True).item(), rel=1e-5)

    # stage 2 must start from a stage-1 checkpoint
    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--init_from", d / "mars.pt", "--out_dir", tmp_path / "x"])
    assert_one_line_error(proc)
    assert proc.returncode == 1 and "--init_from must be a stage-1 (ar) checkpoint" in proc.stderr
    proc = run_cli(["train.py", *SHORT, "--stage", "mars", "--init_from", tmp_path / "nope.pt", "--out_dir", tmp_path / "x"])
    assert_one_line_error(proc)
    assert proc.returncode == 1 and f"checkpoint not found: {tmp_path / 'nope.pt'}" in proc.stderr


def untimed(log_path):
    """A training log without its wall-clock fields, which no two runs share."""
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "stage_seconds")}
            for r in json.loads(log_path.read_text())]


RESUME_CMD = ["train.py", "--preset", "tiny", "--stage", "ar", "--ar_iters", "80", "--save_every", "5",
              "--eval_every", "40"]


def popen(args):
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env={**os.environ, **ONE_THREAD},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
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


@pytest.mark.slow
def test_ddp_two_processes_equal_one_on_the_same_global_batch(tmp_path):
    """Both stages and the summary on two gloo processes. Each stage is shorter than --save_every, so ar.pt
    is written only at its end (by rank 0), and the other rank must wait for it before stage 2 loads it.
    Two processes of 8 rows each, each in two micro-batches of 4 (gradients averaged across the processes
    after the second only), train what one process trains on the same global batch of 16 in four
    micro-batches of 4: the same weights and validation losses, which they would not be if the ranks saw
    the same rows, or synced after another micro-batch. Rank 0 logs the loss of its own 8 rows."""
    d, one = tmp_path / "ddp", tmp_path / "one"
    flags = ["--preset", "tiny", "--ar_iters", "10", "--mars_iters", "10", "--summary_limit", "4", "--device", "cpu"]
    proc = run_ddp([*flags, "--micro_batch", "4", "--out_dir", d])
    assert proc.returncode == 0, ddp_failure(proc)
    assert train.PRESETS["tiny"]["save_every"] > 10
    ar = assert_checkpoint(d / "ar.pt", "ar")
    assert_checkpoint(d / "mars.pt", "mars")
    assert ar["train_config"]["batch_size"] == train.PRESETS["tiny"]["batch_size"] == 16
    assert ar["train_config"]["micro_batch"] == 4
    assert (d / "summary.json").exists()
    assert proc.stdout.count("instruction set:") == 1  # only rank 0 prints
    ref = run_cli(["train.py", *flags, "--micro_batch", "4", "--out_dir", one])  # stage 1's token means: alike
    assert ref.returncode == 0, ref.stderr
    for stage in ("ar", "mars"):  # float32 sums in another order: up to 2.1e-5 apart after the 20 steps, measured
        a, b = load(d / f"{stage}.pt")["model"], load(one / f"{stage}.pt")["model"]
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=f"{stage} {k}")
        two, single = (json.loads((p / f"{stage}_log.json").read_text()) for p in (d, one))
        assert two[-1]["val_loss"] == pytest.approx(single[-1]["val_loss"], rel=1e-4)
        assert two[0]["loss"] != pytest.approx(single[0]["loss"], rel=1e-6)  # rank 0's half of the rows


def test_each_process_takes_its_own_rows_of_the_global_batch():
    """Stage.share: under DDP, process r's micro-batch a is rows (r * accum + a) * micro onwards; the
    processes' micro-batches cover the global batch once."""
    for world, accum, micro in ((2, 1, 8), (2, 2, 4), (4, 2, 2)):
        rows = [i for rank in range(world) for a in range(accum)
                for i in range(16)[train.Stage.share(SimpleNamespace(rank=rank, accum=accum, micro=micro), a)]]
        assert sorted(rows) == list(range(16)) and len(rows) == 16


def test_ddp_syncs_the_gradients_after_the_last_micro_batch_only():
    """Stage.micro_batches under DDP (world > 1): every micro-batch's forward and backward but the last's runs with
    DDP's require_backward_grad_sync off (what no_sync turns off), so the gradients are averaged across the
    processes once, over all the micro-batches; in one process the model is left alone. (A fake DDP model: the
    flag as each micro-batch's forward finds it.)"""
    for world, accum, want in ((2, 3, [False, False, True]), (2, 1, [True]), (1, 2, [None, None])):
        stage = SimpleNamespace(world=world, accum=accum, rank=1, micro=2, model=SimpleNamespace(),
                                batch=lambda seqs: seqs)
        stage.share = lambda a, stage=stage: train.Stage.share(stage, a)
        flags, rows = [], []
        for seqs in train.Stage.micro_batches(stage, list(range(16))):
            flags.append(getattr(stage.model, "require_backward_grad_sync", None))
            rows.append(seqs)
        assert flags == want
        assert rows == [list(range(16))[stage.share(a)] for a in range(accum)]


def test_accumulated_micro_batches_step_as_the_whole_batch(tok, splits, tmp_path, monkeypatch):
    """The loop divides each micro-batch's loss by their number: one MARS step on 16 rows in two micro-batches of
    8 has the gradients (before clipping), the logged losses (the whole batch's before the step) and the weights
    after the step of one micro-batch of 16 (the loss is a mean over sequences; a float64 model)."""
    grads, clip = [], torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm):
        params = list(params)
        grads.append(torch.cat([p.grad.flatten() for p in params]))
        return clip(params, max_norm)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    monkeypatch.setattr(train, "finish", lambda stage, before: None)  # no accuracy, log file or plot
    small = {"train": splits["train"][:200], "val": splits["val"][:8]}
    runs = []
    for micro in (16, 8):
        cfg = train.get_config(["--preset", "tiny", "--stage", "mars", "--mars_iters", "1", "--micro_batch",
                                str(micro), "--out_dir", str(tmp_path / str(micro)), "--device", "cpu"])
        os.makedirs(cfg.out_dir)
        torch.manual_seed(0)
        net = model.GPT(model.GPTConfig(vocab_size=tok.n_vocab, max_seq_len=64, n_layer=2, n_head=2,
                                        n_embd=32)).double()
        stage = train.Stage("mars", net, tok, small, cfg)
        assert stage.accum == 16 // micro
        if micro == 16:  # the step's batch (a Stage like it draws the same) and its losses before the step
            probe = train.Stage("mars", net, tok, small, cfg)
            (x, y), = probe.micro_batches(probe.next_batch())
            before = [t.item() for t in mars.mars_loss(net, x, y, tok.mask, cfg.B, cfg.ar_weight)]
        train.train(stage)
        runs.append((stage.history[-1], net.state_dict()))
    (whole, whole_weights), (accumulated, accumulated_weights) = runs
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)
    for k, want in zip(("loss", "noisy", "clean"), before):
        assert accumulated[k] == pytest.approx(whole[k], rel=1e-6) and whole[k] == pytest.approx(want, rel=1e-6), k
    for k in whole_weights:
        torch.testing.assert_close(accumulated_weights[k], whole_weights[k], msg=k)


def test_own_jsonl_data_end_to_end(tmp_path):
    """Training on a user's small JSONL file of {prompt, response}, both stages and the summary. Its
    records all hash to the train split, so val and test are empty. A conversation ({messages}) is
    extras.real.train's to read: one line says so."""
    records, i = [], 0
    while len(records) < 24:
        prompt = f"Say the number {i}."
        if data.split_of(prompt) == "train":
            records.append({"prompt": prompt, "response": f"The number is {i}."})
        i += 1
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi."},
                                             {"role": "assistant", "content": "Hello."}]}) + "\n")
    proc = run_cli(["train.py", "--preset", "tiny", "--data", chat, "--out_dir", tmp_path / "chat"])
    assert_one_line_error(proc)
    assert f"{chat}:1: malformed record" in proc.stderr and "python -m extras.real.train --data" in proc.stderr
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    d = tmp_path / "out"
    proc = run_cli(["train.py", "--preset", "tiny", "--data", path, "--ar_iters", "3", "--mars_iters", "3",
                    "--out_dir", d])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr
    ckpt = assert_checkpoint(d / "mars.pt", "mars")
    assert ckpt["train_config"]["data"] == str(path)


def test_control_stage_and_resume_holds_stage_2_flags(tmp_path):
    """--stage control is stage 2 without its noisy stream (the clean term alone, same batches and schedule),
    from the same stage-1 checkpoint as MARS. (The ablations beyond the paper, --no_sft and --block_offset,
    are python -m extras.real.train's: tests/test_options.py.)"""
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
    assert "--resume with changed stage-2 flags (B 4 -> 8)" in proc.stderr


def test_a_checkpoint_of_the_old_format_resumes(tiny_run, tmp_path):
    """A MARS checkpoint written before the options moved to extras/ (six stage-2 flags under "mars", the
    settings the old command line resolved) resumes: --resume holds a run to the flags it still has."""
    ckpt = load(tiny_run / "mars.pt")
    old = dict(no_sft=False, block_offset="fixed", targets="hard", clean_padding="keep")
    config = {**ckpt["train_config"], "from_hf": False, "given": [], "schedule": {}, "epochs": None}
    torch.save({**ckpt, "done": False, "iter": 59, "history": ckpt["history"][:59], "train_config": config,
                "mars": {**ckpt["mars"], **old}}, tmp_path / "mars.pt")
    proc = run_cli(["train.py", "--preset", "tiny", "--stage", "mars", "--resume", "--summary_limit", "0",
                    "--init_from", tiny_run / "ar.pt", "--out_dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    assert "resuming stage mars at step 59" in proc.stdout
    again = assert_checkpoint(tmp_path / "mars.pt", "mars")
    assert again["iter"] == 60 and again["mars"] == {"B": 4, "ar_weight": 1.0}


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
    assert "precision='bfloat16'" in proc.stdout[start:proc.stdout.index("ar 3/3")]


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


@pytest.mark.slow
def test_gpu_preset_takes_a_step_on_cpu(tmp_path):
    """The gpu preset's model (8 x 512) builds and takes a stage-1 step without CUDA; a small batch keeps it quick.
    Its precision is the rule's for this CPU, recorded with the reason."""
    proc = run_cli(["train.py", "--preset", "gpu", "--device", "cpu", "--n_train", "2000", "--batch_size", "2",
                    "--stage", "ar", "--ar_iters", "1", "--summary_limit", "1", "--out_dir", tmp_path], timeout=600)
    assert proc.returncode == 0, proc.stderr
    ckpt = assert_checkpoint(tmp_path / "ar.pt", "ar")
    assert ckpt["model_config"]["n_layer"] == 8 and ckpt["model_config"]["n_embd"] == 512
    dtype, reason = train.precision_rule("cpu")
    assert ckpt["train_config"]["precision"] == dtype
    assert ckpt["train_config"]["precision_why"] == {"dtype": dtype, "reason": reason}
    assert f"precision: {dtype}: {reason}" in proc.stdout


# A CPU without native bf16, emulated on one with it: torch's, oneDNN's and MKL's kernels limited to AVX2
# (there a bf16 matmul runs 10-30x slower than in float32). torch reads these when it is imported.
NO_NATIVE_BF16 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AVX2 is an x86 instruction set")
def test_the_rule_picks_float32_with_avx2_kernels_forced_and_the_flag_forces(tmp_path):
    """--precision auto follows the rule, untimed: with AVX2 kernels forced, float32, even on a CPU with native
    bf16 (the capability reads AVX2); the start says so, and the checkpoint and the stage log record it.
    --precision bfloat16 still trains in bf16 there."""
    cmd = ["train.py", "--preset", "tiny", "--stage", "ar", "--ar_iters", "2", "--summary_limit", "0"]
    proc = run_cli(cmd + ["--precision", "auto", "--out_dir", tmp_path / "auto"], env=NO_NATIVE_BF16)
    assert proc.returncode == 0, proc.stderr
    cfg = load(tmp_path / "auto" / "ar.pt")["train_config"]
    assert cfg["precision_why"] == {"dtype": "float32", "reason": "no native bf16 on cpu (CPU capability AVX2)"}
    assert cfg["precision"] == "float32"
    assert "precision: float32: no native bf16 on cpu (CPU capability AVX2)" in proc.stdout.splitlines()
    assert json.loads((tmp_path / "auto" / "ar_log.json").read_text())[-1]["precision"] == cfg["precision_why"]
    proc = run_cli(cmd + ["--precision", "bfloat16", "--out_dir", tmp_path / "forced"], env=NO_NATIVE_BF16)
    assert proc.returncode == 0, proc.stderr
    cfg = load(tmp_path / "forced" / "ar.pt")["train_config"]
    assert cfg["precision_why"] == {"dtype": "bfloat16", "reason": "--precision bfloat16"}


@pytest.mark.parametrize("capability, avx512_bf16, amx, want", [
    ("AVX512", True, False, "bfloat16"), ("AVX512", False, True, "bfloat16"),
    ("AVX512", False, False, "float32"),  # AVX-512 without bf16 (e.g. Skylake)
    ("AVX2", True, True, "float32"),  # ATEN_CPU_CAPABILITY=avx2: the bf16 checks ignore it
    ("DEFAULT", False, False, "float32")])
def test_precision_rule_on_a_cpu(monkeypatch, capability, avx512_bf16, amx, want):
    """bf16 on a CPU only where both say so: the capability torch's kernels use, and native bf16 (AVX512-BF16
    or AMX). No timing."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    dtype, reason = train.precision_rule("cpu")
    assert dtype == want and f"CPU capability {capability}" in reason


def test_precision_rule_on_a_gpu_asks_for_native_bf16(monkeypatch):
    """A T4 emulates bf16, which torch counts as support by default: the rule asks for native bf16, so a T4
    trains in float32 and an H200 in bf16; the reason names the GPU."""
    asked = []
    for native, name in ((False, "Tesla T4"), (True, "NVIDIA H200")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda native=native, **kw: asked.append(kw) or native)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: f"{name} ({device})")
        dtype, reason = train.precision_rule("cuda:1")
        assert dtype == ("bfloat16" if native else "float32")
        assert reason == f"{name} (cuda:1) has {'' if native else 'no '}native bf16"
    assert asked == [{"including_emulation": False}] * 2


def simulated(per_row, bf16_ratio, fixed=0.0):
    """A time_run for precision.probe (python -m extras.bench.precision): float32 takes `fixed` seconds plus per_row
    a row, bf16 the same fixed part plus bf16_ratio times float32's per row; and the list of (rows, bf16, seconds)
    it was asked for."""
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
    2,048 tokens shows bf16's gain, and the probe finds it faster."""
    time_run, runs = simulated(6e-3, 0.4, fixed=0.5)
    fp32, bf16, rows = precision.probe(time_run, tokens=2048, budget=2.0)
    assert runs[4][2] / runs[0][2] > 0.95  # one token: the precisions look the same
    assert (fp32, bf16) == pytest.approx((0.5 + 2048 * 6e-3, 0.5 + 2048 * 6e-3 * 0.4))
    assert precision.decide(fp32, bf16) == "bfloat16" and 16 <= rows < 2048


def test_precision_command_times_both_and_names_the_rule(monkeypatch, capsys):
    """python -m extras.bench.precision: both precisions timed on a preset's model (here simulated, bf16 twice
    as fast), which one is faster, and what train.py's rule picks, and whether they agree."""
    monkeypatch.setattr(precision, "probe", lambda *a, **k: (0.010, 0.005, 16))
    monkeypatch.setattr(train, "precision_rule", lambda device: ("float32", "no native bf16 (test)"))
    precision.main(["--preset", "tiny", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "float32       10.00 ms" in out and "bfloat16       5.00 ms (0.50x" in out
    assert "faster here: bfloat16" in out
    assert "rule picks float32 (no native bf16 (test)): they disagree: train.py --precision bfloat16" in out
    precision.main(["--preset", "tiny", "--device", "cpu", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert (r["faster"], r["rule"], r["tokens"]) == ("bfloat16", "float32", 16 * 64)


def test_progress_prints_30_s_after_its_last_line_with_the_runs_eta(monkeypatch, tmp_path):
    """A slow machine learns its ETA within the first minute: between the lines every 2% of the stage (here
    every 10 steps), a line comes once 30 s have passed since the last one. The run's ETA adds the later
    stages' steps at this stage's pace; the last stage's is its own. (train.py's clock: 31 s a step.)"""
    clock = [1000.0]

    def tick():
        clock[0] += 31
        return clock[0]
    monkeypatch.setattr(train, "time", SimpleNamespace(time=tick))
    proc = run_cli(["train.py", "--preset", "tiny", "--ar_iters", "12", "--mars_iters", "2", "--eval_every", "12",
                    "--summary_limit", "1", "--device", "cpu", "--out_dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ar ", "mars "))]
    assert [line.split(" | ")[0] for line in lines] == [f"ar {i}/12" for i in range(1, 13)] + ["mars 1/2", "mars 2/2"]
    minutes = 31 / 60  # a step
    assert lines[0].endswith(f"ETA stage {11 * minutes:.1f} min, run {(11 + 2) * minutes:.1f} min")
    assert lines[-2].endswith(f"ETA stage {minutes:.1f} min, run {minutes:.1f} min")


MARS_RESUME = ["train.py", "--preset", "tiny", "--stage", "mars", "--mars_iters", "60", "--save_every", "5",
               "--eval_every", "30"]


def ctrl_c_in_step(monkeypatch, n):
    """Ctrl-C, in this process, while step n draws its batch (the real signal: tested once, as a process, in
    test_interrupt_and_resume_reproduce_an_uninterrupted_run)."""
    next_batch, drawn = train.Stage.next_batch, []

    def draw(self):
        drawn.append(1)
        if len(drawn) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return next_batch(self)
    monkeypatch.setattr(train.Stage, "next_batch", draw)


def test_interrupted_mars_stage_resumes_to_the_uninterrupted_run(tiny_run, tmp_path, monkeypatch):
    """Stage 2 interrupted (Ctrl-C) and resumed continues from its step with its optimizer, batch order and
    MARS settings: the same weights and log as a run never interrupted."""
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    cmd = MARS_RESUME + ["--init_from", tiny_run / "ar.pt"]
    assert run_cli(cmd + ["--out_dir", d2]).returncode == 0
    ctrl_c_in_step(monkeypatch, 7)
    proc = run_cli(cmd + ["--out_dir", d1])
    assert proc.returncode == 130 and "resume with:" in proc.stdout, proc.stdout + proc.stderr
    assert assert_checkpoint(d1 / "mars.pt", "mars", done=False)["iter"] == 7
    monkeypatch.undo()
    proc = run_cli(cmd + ["--out_dir", d1, "--resume"])
    assert proc.returncode == 0, proc.stderr
    assert "resuming stage mars at step 7" in proc.stdout.splitlines()[0], proc.stdout
    a, b = assert_checkpoint(d1 / "mars.pt", "mars"), assert_checkpoint(d2 / "mars.pt", "mars")
    assert a["iter"] == b["iter"] == 60 and a["mars"] == b["mars"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert untimed(d1 / "mars_log.json") == untimed(d2 / "mars_log.json")


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------
# The command line: one flag per key of the presets, one-line errors, moved flags


def test_every_preset_key_is_a_flag_with_help(capsys):
    """The flags come from the presets table: one --key per key, with help and each preset's value, typed from
    the value (lists comma-separated); a flag beats the preset."""
    keys = {k for row in train.PRESETS.values() for k in row}
    assert all(row.keys() == keys for row in train.PRESETS.values())
    proc = run_cli(["train.py", "--help"])
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for k in keys:
        assert f"--{k} " in text, k
    assert "--n_layer N_LAYER (tiny 2, course 4, cpu 4, gpu 8)" in text and "--B B the paper's block" in text
    assert "--optimizer {adamw,muon}" in text and "--schedule {cosine,wsd}" in text
    cfg = train.get_config(["--preset", "course", "--tasks", "spell,copy", "--betas", "0.8,0.9", "--decay", "0.2",
                            "--micro_batch", "8", "--device", "cpu"])
    assert (cfg.tasks, cfg.betas, cfg.decay, cfg.micro_batch) == (["spell", "copy"], [0.8, 0.9], 0.2, 8)
    assert cfg.n_embd == train.PRESETS["course"]["n_embd"] and cfg.preset == "course"
    assert keys <= vars(cfg).keys()
    with pytest.raises(AttributeError, match="read-only"):
        cfg.lr = 1.0
    assert cfg.replace(lr=1.0).lr == 1.0 and cfg.lr == train.PRESETS["course"]["lr"]


def test_a_tool_adds_its_presets_and_flags():
    """get_config(argv, presets, extra): a tool's own table (its flags made from it) and its own flags; a
    flag it defines is its own, not a moved one."""
    presets = {"big": dict(train.PRESETS["cpu"], n_layer=12, epochs=3)}

    def extra(p):
        p.add_argument("--no_sft", action="store_true")
    cfg = train.get_config(["--epochs", "5", "--no_sft", "--device", "cpu"], presets, extra)
    assert (cfg.preset, cfg.n_layer, cfg.epochs, cfg.no_sft) == ("big", 12, 5, True)


@pytest.mark.parametrize("flags, code, message", [
    (["--B", "0"], 2, "error: --B must be >= 1, got 0"),
    (["--batch_size", "-4"], 2, "error: --batch_size must be >= 1, got -4"),
    (["--tasks", "spell,nope"], 2, "error: --tasks: unknown families ['nope']; they are add,"),
    (["--n_embd", "100", "--n_head", "3"], 2, "error: --n_embd 100 does not split into --n_head 3 heads"),
    (["--n_embd", "66", "--n_head", "2"], 2, "error: --n_embd 66 does not split into --n_head 2 heads of even"),
    (["--ar_weight", "-1"], 2, "error: --ar_weight must be >= 0"),
    (["--decay", "0"], 2, "error: --ar_weight must be >= 0, --decay in (0, 1] and --warmup in [0, 1)"),
    (["--betas", "0.9,x"], 2, "error: argument --betas: invalid comma-separated float value: '0.9,x'"),
    (["--optimizer", "sgd"], 2, "error: argument --optimizer: invalid choice: 'sgd'"),
    (["--preset", "nope"], 2, "error: --preset nope: choose from tiny, course, cpu, gpu"),
    (["--lr", "fast"], 2, "error: argument --lr: invalid float value: 'fast'"),
    (["--epochs", "3"], 2, "error: unrecognized arguments: --epochs 3"),
    (["--batch_size", "16", "--micro_batch", "5", "--ar_iters", "1"], 1,
     "error: --batch_size 16 is not a multiple of --micro_batch 5 x 1 processes"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flags, code, message):
    proc = run_cli(["train.py", "--preset", "tiny", "--stage", "ar", "--out_dir", tmp_path, *flags])
    assert_one_line_error(proc)
    assert proc.returncode == code and proc.stderr.startswith(message), proc.stderr


@pytest.mark.parametrize("flags", [["--no_sft"], ["--block_offset", "random"], ["--targets=soft"],
                                   ["--clean_padding", "drop"], ["--mask_row", "mean"]])
def test_flags_beyond_the_paper_name_their_command(tmp_path, flags):
    proc = run_cli(["train.py", "--preset", "tiny", *flags, "--out_dir", tmp_path])
    flag = flags[0].split("=")[0]
    assert_one_line_error(proc)
    assert proc.returncode == 2
    assert proc.stderr == f"error: {flag} is beyond the paper: python -m extras.real.train {flag} ...\n"


@pytest.mark.parametrize("how", ["directory", "gguf", "short name", "preset hf"])
def test_a_real_model_names_its_command(tmp_path, how):
    """A real model (a directory, a .gguf file, an installed one's short name, the hf preset) trains with
    python -m extras.real.train: one line says so, before anything is read."""
    where = {"directory": str(tmp_path), "gguf": str(tmp_path / "m.gguf"), "short name": "smollm2"}.get(how)
    flags = ["--preset", "hf"] if how == "preset hf" else ["--stage", "mars", "--init_from", where]
    proc = run_cli(["train.py", *flags, "--out_dir", tmp_path / "out"])
    assert_one_line_error(proc)
    if how == "preset hf":
        assert proc.returncode == 2 and proc.stderr.startswith(
            "error: --preset hf: choose from tiny, course, cpu, gpu (a real model: python -m extras.real.train)")
    else:
        assert proc.returncode == 1 and proc.stderr == (
            f"error: a real model trains with python -m extras.real.train --init_from {where} --data my.jsonl\n")
    assert not (tmp_path / "out").exists()


class Pickled:
    """Anything but tensors and plain types: a checkpoint holding it is refused (weights_only=True)."""


def test_load_checkpoint_refuses_a_file_that_pickles_an_object(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "model_config": {}, "tokenizer": {}, "x": Pickled()}, path)
    assert isinstance(torch.load(path, weights_only=False)["x"], Pickled)  # readable, were it trusted
    with pytest.raises(common.UserError, match="not a readable checkpoint of this project"):
        common.load_checkpoint(path)
    proc = run_cli(["train.py", "--preset", "tiny", "--stage", "mars", "--init_from", path,
                    "--out_dir", tmp_path / "out"])
    assert_one_line_error(proc)
    assert f"not a readable checkpoint of this project: {path}" in proc.stderr


# ---------------------------------------------------------------------------
# The optimizer: Muon on the hidden matrices, the wsd schedule


def test_wsd_schedule_warms_up_holds_then_decays_linearly():
    lrs = [train.lr_at(i, 1.0, 0.1, 100, "wsd", 0.4) for i in range(100)]
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert lrs[10:60] == [1.0] * 50
    assert lrs[60:] == pytest.approx([(100 - i) / 40 for i in range(60, 100)])
    assert [train.lr_at(i, 1.0, 0.1, 100, "wsd") for i in range(100)] == lrs  # decay 0.4 by default, as the presets'
    cosine = [train.lr_at(i, 1.0, 0.1, 100) for i in range(100)]
    assert cosine[10] == 1.0 and cosine[55] == pytest.approx(0.5) and cosine[99] < 1e-3
    # the shortest warm-up is one step at the peak; a decay of one step starts from the peak
    assert train.lr_at(0, 1.0, 0.05, 20) == 1.0 and train.lr_at(9, 1.0, 0.0, 10, "wsd", 0.1) == 1.0


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    net = model.GPT(tiny_config())
    cfg = SimpleNamespace(optimizer="muon", weight_decay=0.1, betas=[0.9, 0.95])
    muon, adamw = train.optimizers(net, cfg, 1e-3)
    def ids(params):
        return [id(p) for p in params]
    hidden = [p for n, p in net.named_parameters() if p.dim() == 2 and n != "wte.weight"]
    assert isinstance(muon, train.Muon) and ids(muon.param_groups[0]["params"]) == ids(hidden)
    assert net.lm_head.weight is net.wte.weight  # tied: AdamW's, with the embedding
    decayed, plain = adamw.param_groups
    assert ids(decayed["params"]) == [id(net.wte.weight)] and decayed["weight_decay"] == 0.1
    assert plain["weight_decay"] == 0 and all(p.dim() == 1 for p in plain["params"])
    assert len(hidden) + 1 + len(plain["params"]) == len(list(net.parameters()))
    [only] = train.optimizers(net, SimpleNamespace(**{**vars(cfg), "optimizer": "adamw"}), 1e-3)
    assert isinstance(only, torch.optim.AdamW) and only.defaults["fused"]
    assert ids(only.param_groups[0]["params"]) == ids(p for p in net.parameters() if p.dim() == 2)


def test_muon_steps_each_matrix_as_if_alone():
    """Muon's update of a matrix: Nesterov momentum, orthogonalised (about U V^T: its singular values near
    1), scaled by 0.2 sqrt(max(shape)), with decoupled weight decay; matrices of one shape share a batched
    product, which changes nothing."""
    torch.manual_seed(0)
    shapes = [(8, 16), (8, 16), (16, 8), (12, 12)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    want = [p.detach().clone() for p in params]
    bufs = [torch.zeros(s) for s in shapes]
    opt = train.Muon(params, lr=0.02, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            bufs[i] = 0.95 * bufs[i] + 0.05 * g
            update = train.orthogonalise((0.05 * g + 0.95 * bufs[i])[None])[0]
            want[i] = want[i] * (1 - 0.02 * 0.1) - 0.02 * 0.2 * max(shapes[i]) ** 0.5 * update
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-4, atol=1e-5)
    still = torch.nn.Parameter(torch.randn(8, 16))  # no weight decay unless asked: a zero gradient moves nothing
    still.grad, before = torch.zeros(8, 16), still.detach().clone()
    train.Muon([still], lr=0.02).step()
    assert torch.equal(still.detach(), before)
    G = torch.randn(3, 8, 16)
    X = train.orthogonalise(G)
    assert ((torch.linalg.svdvals(X) > 0.5) & (torch.linalg.svdvals(X) < 1.5)).all()
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(X.flatten(1), (U @ Vh).flatten(1)).min() > 0.9


def test_orthogonalise_is_the_polar_factor_up_to_its_quintics_tolerance():
    """orthogonalise(G), against an SVD G = U S V^T: U q(S) V^T, where q is five steps of Jordan's quintic
    s -> 3.4445 s - 4.7750 s^3 + 2.0315 s^5 on S over G's Frobenius norm, for wide, tall and square matrices
    (float64: to rounding; float32: to its precision). The quintic does not converge to 1: it pushes singular
    values that are not tiny into about [0.68, 1.14], so X lies within 0.32 of U V^T in spectral norm."""
    torch.manual_seed(0)
    for shape in ((3, 8, 16), (3, 16, 8), (2, 12, 12)):
        G = torch.randn(shape, dtype=torch.float64)
        U, S, Vh = torch.linalg.svd(G, full_matrices=False)
        s = S / (torch.linalg.matrix_norm(G)[:, None] + 1e-7)
        for _ in range(5):
            s = 3.4445 * s - 4.7750 * s ** 3 + 2.0315 * s ** 5
        want = U @ torch.diag_embed(s) @ Vh
        torch.testing.assert_close(train.orthogonalise(G), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(train.orthogonalise(G.float()), want.float(), rtol=0, atol=1e-5)
        X = train.orthogonalise(G)
        assert ((0.68 < torch.linalg.svdvals(X)) & (torch.linalg.svdvals(X) < 1.14)).all()
        assert (torch.linalg.matrix_norm(X - U @ Vh, ord=2) < 0.32).all()


def test_muon_and_wsd_interrupted_and_resumed_reproduce_the_run(tmp_path, monkeypatch):
    """Ctrl-C after step 2 of 6 (in this process), then --resume: the checkpoint holds Muon's and AdamW's
    states, and the resumed run ends with the weights and log of a run never interrupted."""
    cmd = ["train.py", "--preset", "tiny", "--stage", "ar", "--ar_iters", "6", "--optimizer", "muon",
           "--schedule", "wsd", "--eval_every", "3", "--save_every", "100", "--summary_limit", "0"]
    assert run_cli(cmd + ["--out_dir", tmp_path / "ref"]).returncode == 0
    ctrl_c_in_step(monkeypatch, 2)
    proc = run_cli(cmd + ["--out_dir", tmp_path / "cut"])
    assert proc.returncode == 130 and "resume with:" in proc.stdout, proc.stdout + proc.stderr
    ckpt = assert_checkpoint(tmp_path / "cut" / "ar.pt", "ar", done=False)
    assert ckpt["iter"] == 2
    muon, adamw = ckpt["optimizer"]
    # q, k, v, o, gate, up and down in each layer
    assert len(muon["state"]) == 7 * train.PRESETS["tiny"]["n_layer"]
    assert all("momentum" in s for s in muon["state"].values())
    assert all("exp_avg" in s for s in adamw["state"].values())
    monkeypatch.undo()
    proc = run_cli(cmd + ["--out_dir", tmp_path / "cut", "--resume"])
    assert proc.returncode == 0 and "resuming stage ar at step 2" in proc.stdout, proc.stderr
    a, b = load(tmp_path / "cut" / "ar.pt"), load(tmp_path / "ref" / "ar.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert untimed(tmp_path / "cut" / "ar_log.json") == untimed(tmp_path / "ref" / "ar_log.json")
