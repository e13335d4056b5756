"""MARS fine-tuning of a real (Hugging Face) model, offline: python -m extras.real.train
--init_from DIR on a tiny random Qwen2 built with transformers (tests/test_hf.py's builders):
the chat template's targets, the checkpoint it writes, its export, two data-parallel processes
against one, and extras.bench.eval --data with the GSM8K-style checker."""
import json
import math
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
import transformers

import data
import model
import train
from conftest import ONE_THREAD, ROOT, V, assert_one_line_error, run_cli, tiny_config
from extras.bench import eval as evaluate
from extras.checkpoints import export, foreign
from extras.engine import __main__ as engine_cli
from extras.real import chunked_ce, records
from extras.real import train as real_train
from extras.real.records import final_number
from test_hf import build, hf_greedy

SYSTEM = "You are a terse assistant."
PROMPT = "Hello café 日本 😀 12345"


def conversations():
    """Messages-form training data: a lone user turn, a system turn, and multi-turn history."""
    out = []
    for i in range(24):
        user = {"role": "user", "content": f"What is {i} plus {i}?"}
        answer = {"role": "assistant", "content": f"{i} + {i} = {2 * i}. The answer is {2 * i}."}
        if i % 3 == 0:
            msgs = [user, answer]
        elif i % 3 == 1:
            msgs = [{"role": "system", "content": SYSTEM}, user, answer]
        else:
            msgs = [{"role": "user", "content": f"Say {i}."},
                    {"role": "assistant", "content": f"{i}"}, user, answer]
        out.append({"messages": msgs})
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    path = build("qwen2", root / "qwen", tie=True, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2)
    jsonl = root / "my.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    return path, jsonl, root


def run_train(*argv):
    handler = signal.getsignal(signal.SIGINT)  # the loop installs its own Ctrl-C handler
    try:
        real_train.main([str(a) for a in argv])
    finally:
        signal.signal(signal.SIGINT, handler)


def run_engine(capsys, *flags):
    """python -m extras.engine --json in this process: its one answer."""
    capsys.readouterr()
    engine_cli.main(["--json", "--max_new_tokens", "12", "--device", "cpu", *map(str, flags)])
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def mars_run(qwen):
    """Three MARS steps on the Hugging Face directory with the recipe's defaults."""
    path, jsonl, root = qwen
    out = root / "out"
    run_train("--stage", "mars", "--init_from", path, "--data", jsonl, "--out_dir", out,
              "--device", "cpu", "--mars_iters", 3, "--batch_size", 4, "--micro_batch", 2)
    return out / "mars.pt"


def test_only_the_last_assistant_turn_is_trained(qwen):
    """The targets of a multi-turn conversation with a system turn are the official data map's
    labels: everything after apply_chat_template(messages[:-1], add_generation_prompt=True),
    here without the newline Qwen's template writes after <|im_end|>, then <|im_end|> padding
    up to a multiple of B."""
    path, _, _ = qwen
    _, _, tok = foreign.load(path)
    hftok = transformers.AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say 3."},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "What is 3 plus 3?"},
            {"role": "assistant", "content": "3 + 3 = 6. The answer is 6."}]
    e = records.read_record({"messages": msgs})
    assert e["prompt"] == msgs[:-1] and e["response"] == msgs[-1]["content"]
    full = hftok.apply_chat_template(msgs, tokenize=True)["input_ids"]
    head = hftok.apply_chat_template(msgs[:-1], add_generation_prompt=True,
                                     tokenize=True)["input_ids"]
    assert full[:len(head)] == head
    labels = full[len(head):]
    assert hftok.decode(labels[-2:]) == "<|im_end|>\n"
    ids, n_prompt = data.tokenize([e], tok, 512, multiple=4)[0]
    assert ids[:n_prompt] == head
    x, y = data.make_batch([(ids, n_prompt)], tok.eot, 4)
    targets = y[y != -1].tolist()
    pad = -(len(ids)) % 4
    assert targets == labels[:-1] + [tok.eot] * pad
    assert (y[0, :n_prompt - 1] == -1).all() and (y[0, n_prompt - 1:] != -1).all()
    assert tok.decode(targets) == msgs[-1]["content"] + "<|im_end|>" * (1 + pad)
    assert "Say 3." not in tok.decode(targets) and len(x[0]) == len(ids) + pad - 1


def test_mars_on_a_hugging_face_directory_checkpoint_samples_and_exports(qwen, mars_run, tmp_path,
                                                                        capsys):
    path, _, _ = qwen
    ckpt = torch.load(mars_run, weights_only=True)
    cfg = ckpt["train_config"]
    # the recipe is the default for a Hugging Face directory, and flags override single values;
    # the given batch and steps win over the schedule, whose lr follows the batch: 5e-6 at 384,
    # times sqrt(4 / 384) at 4; the stage trains with what the schedule says
    assert cfg["preset"] == "hf" and cfg["warmup"] == 0.03 and cfg["from_hf"]
    fitted = cfg["hf_schedule"]["mars"]
    assert fitted["lr"] == pytest.approx(5e-6 / math.sqrt(96)) == cfg["mars_lr"]
    assert fitted["batch_size"] == cfg["batch_size"] == 4
    assert fitted["why"].startswith("batch given; steps given; lr: 5e-06 x sqrt(4 / 384)")
    assert cfg["weight_decay"] == 0.0 and cfg["betas"] == [0.9, 0.999]
    assert (cfg["optimizer"], cfg["schedule"]) == ("adamw", "cosine")
    assert cfg["precision"] == cfg["precision_why"]["dtype"] == train.precision_rule("cpu")[0]
    # rows of at most 512 tokens (the recipe), within the model's context (256 here)
    assert cfg["max_seq_len"] == 256 and cfg["mars_iters"] == 3 and cfg["micro_batch"] == 2
    assert ckpt["mars"] == {"B": 4, "ar_weight": 1.0, "no_sft": False, "block_offset": "fixed",
                            "targets": "hard", "clean_padding": "keep"}
    assert ckpt["stage"] == "mars" and ckpt["done"] and ckpt["hf"]["model_type"] == "qwen2"
    source = foreign.read_checkpoint(path)
    assert ckpt["model_config"] == source["model_config"]  # the shape comes from config.json
    assert ckpt["tokenizer"] == source["tokenizer"]  # self-contained: vocabulary, template
    moved = [k for k in source["model"] if not torch.equal(source["model"][k], ckpt["model"][k])]
    assert len(moved) == len(source["model"])  # three steps moved every tensor
    assert max((source["model"][k] - ckpt["model"][k]).abs().max() for k in moved) < 1e-3
    assert all(len(h) and torch.isfinite(torch.tensor(h["loss"])) for h in ckpt["history"])
    # it decodes (AR and MARS), and its export generates in transformers what --ar decodes
    _, _, tok = foreign.load(mars_run)
    want = []
    for flags in (["--ar"], ["--threshold", "0.5"]):
        want.append(run_engine(capsys, "--ckpt", mars_run, "--prompt", PROMPT, *flags)["ids"])
        assert len(want[-1]) == 12 or want[-1][-1] == tok.eot
    export.main([str(mars_run), str(tmp_path / "export")])
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["mars_block_size"] == 4
    assert hf_greedy(tmp_path / "export", tok, prompt=PROMPT) == want[0]


def test_continued_ar_sft_on_a_hugging_face_directory(qwen):
    path, jsonl, root = qwen
    run_train("--stage", "ar", "--init_from", path, "--data", jsonl, "--out_dir", root / "ar",
              "--device", "cpu", "--ar_iters", 2, "--batch_size", 2, "--micro_batch", 1,
              "--precision", "float32")
    ar = root / "ar" / "ar.pt"
    ckpt = torch.load(ar, weights_only=True)
    assert ckpt["stage"] == "ar" and "mars" not in ckpt and ckpt["hf"]["model_type"] == "qwen2"
    assert ckpt["train_config"]["ar_iters"] == 2
    # stage 2 from an ar.pt trained from a real model takes the recipe by default too
    cfg = real_train.get_config(["--stage", "mars", "--init_from", str(ar), "--device", "cpu"])
    assert cfg.preset == "hf" and cfg.from_hf


def test_a_real_model_needs_data_the_recipe_a_real_model_and_train_py_names_the_command(qwen,
                                                                                      tmp_path):
    path, _, _ = qwen
    proc = run_cli(["extras/real/train.py", "--stage", "mars", "--init_from", path, "--out_dir",
                    tmp_path, "--device", "cpu"])
    assert_one_line_error(proc)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: --init_from {path} needs --data: your JSONL of")
    proc = run_cli(["extras/real/train.py", "--preset", "hf", "--device", "cpu"])
    assert_one_line_error(proc)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --preset hf fine-tunes a real model: --init_from a "
                                  "Hugging Face directory")
    proc = run_cli(["train.py", "--init_from", path, "--device", "cpu"])
    assert_one_line_error(proc)
    assert f"python -m extras.real.train --init_from {path} --data my.jsonl" in proc.stderr


@pytest.mark.parametrize("rows, multiple, batch, steps", [
    (2000, 1, 40, 250),  # rows // 50 = 40: 50 steps an epoch, 5 epochs
    (1072, 4, 20, 268),  # 21, down to a multiple of the micro-batch
    (24, 4, 16, 200),  # the smallest batch, and the floor of 200 steps
    (100000, 4, 384, 1303),  # the paper's batch at most
])
def test_hf_schedule_follows_the_data(rows, multiple, batch, steps):
    got = real_train.hf_schedule(rows, 5, {}, multiple)
    assert got[:2] == (batch, steps) and got[2] == pytest.approx(5e-6 * math.sqrt(batch / 384))
    of = ", a multiple of 4" if multiple > 1 else ""
    assert got[3] == (f"batch: rows // 50 = {rows // 50}, within [16, 384]{of}; steps: 5 epochs "
                      f"of {rows} rows, at least 200; lr: 5e-06 x sqrt({batch} / 384)")


def test_hf_schedule_gives_way_to_the_flags_and_the_run_records_it():
    """What the command line sets wins, stage by stage; the rest follows the data. smollm2 is
    only named: nothing is loaded."""
    base = ["--stage", "all", "--init_from", "smollm2", "--device", "cpu"]
    cfg = real_train.get_config(base + ["--batch_size", "64", "--mars_lr", "1e-5",
                                        "--ar_iters", "7"])
    assert cfg.preset == "hf" and cfg.from_hf
    assert cfg.given == ["batch_size", "ar_iters", "mars_lr"]
    ar = real_train.fit_hf_schedule(cfg, "ar", 1072, world=2)
    assert ar == {"rows": 1072, "batch_size": 64, "steps": 7,
                  "lr": pytest.approx(5e-6 / math.sqrt(6)),
                  "why": "batch given; steps given; lr: 5e-06 x sqrt(64 / 384)"}
    mars = real_train.fit_hf_schedule(cfg, "mars", 1072, world=2)
    assert mars == {"rows": 1072, "batch_size": 64, "steps": 200, "lr": 1e-5,
                    "why": "batch given; steps: 5 epochs of 1072 rows, at least 200; lr given"}
    cfg = real_train.get_config(base)  # no flags: micro-batch 4 x 2 processes: 16, not 21
    mars = real_train.fit_hf_schedule(cfg, "mars", 1072, world=2)
    assert (mars["batch_size"], mars["steps"]) == (16, 335)
    assert mars["lr"] == pytest.approx(5e-6 / math.sqrt(24))
    assert real_train.get_config(base + ["--preset", "tiny"]).preset == "tiny"  # the last wins
    with pytest.raises(AttributeError, match="read-only"):  # nothing edits the resolved config
        cfg.batch_size = 16


@pytest.mark.parametrize("soft", [False, True])
def test_the_chunked_loss_is_the_whole_ones_loss_and_gradients(monkeypatch, soft):
    """Past CE_CHUNK logit elements ChunkedGPT takes the loss's rows a chunk at a time (a real
    vocabulary's logits on many rows would not fit): the same cross-entropy and gradients as
    all rows at once, for token and for distribution targets; and the chunks really ran (with
    checkpoint: their logits recomputed in the backward). Below CE_CHUNK, for token targets,
    it is GPT's own loss."""
    torch.manual_seed(0)
    m = chunked_ce.chunked(model.GPT(tiny_config()))
    x = torch.randint(V, (3, 20))
    targets = torch.randint(V, (3, 20))
    targets[torch.rand(3, 20) >= 0.7] = -1
    n = int((targets != -1).sum())
    soft_targets = torch.randn(n, V).softmax(-1) if soft else None

    def loss_and_grads():
        m.zero_grad(set_to_none=True)
        ce = m(x, targets, soft=soft_targets)
        ce.sum().backward()
        return ce.detach(), [p.grad.clone() for p in m.parameters()]
    whole, whole_grads = loss_and_grads()
    if not soft:
        plain = model.GPT.forward(m, x, targets).detach()
        torch.testing.assert_close(whole, plain, rtol=0, atol=0)
    calls = []
    monkeypatch.setattr(chunked_ce, "CE_CHUNK", 7 * V)  # 7 rows a chunk
    monkeypatch.setattr(chunked_ce, "checkpoint", lambda f, *a, **k: calls.append(1) or
                        torch.utils.checkpoint.checkpoint(f, *a, **k))
    chunked, chunked_grads = loss_and_grads()
    assert len(calls) == -(-n // 7) > 1
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_processes_train_as_one_on_the_same_global_batch(qwen, tmp_path, monkeypatch):
    """Data parallel on a real model (torchrun's environment, gloo on the CPU): two processes of
    two rows each end with the weights one process reaches accumulating both halves of the same
    global batch of four. The loss runs inside the forward DDP wraps (chunked_ce.ChunkedGPT),
    its logits in chunks of three rows; gradients that skipped the sync, or ranks that took the
    same rows, would move the weights otherwise."""
    path, jsonl, _ = qwen
    chunk = 3 * json.loads((path / "config.json").read_text())["vocab_size"]
    flags = [str(a) for a in ("--stage", "mars", "--init_from", path, "--data", jsonl,
                              "--device", "cpu", "--mars_iters", 2, "--batch_size", 4,
                              "--micro_batch", 2, "--mars_lr", 1e-3, "--precision", "float32",
                              "--eval_every", 2, "--summary_limit", 0)]
    script = ("import sys; from extras.real import chunked_ce, train; "
              f"chunked_ce.CE_CHUNK = {chunk}; train.main(sys.argv[1:])")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **ONE_THREAD, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, "-c", script, *flags, "--out_dir",
                               str(tmp_path / "two")], cwd=ROOT, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    calls = []
    monkeypatch.setattr(chunked_ce, "CE_CHUNK", chunk)
    monkeypatch.setattr(chunked_ce, "checkpoint", lambda f, *a, **k: calls.append(1) or
                        torch.utils.checkpoint.checkpoint(f, *a, **k))
    run_train(*flags, "--out_dir", tmp_path / "one")
    assert calls  # the logits were taken in chunks
    one, two = (torch.load(tmp_path / d / "mars.pt", weights_only=True) for d in ("one", "two"))
    assert [h["iter"] for h in two["history"]] == [1, 2]
    start = foreign.read_checkpoint(path)["model"]
    assert max(float((one["model"][k] - start[k]).abs().max()) for k in start) > 1e-4
    for k, w in one["model"].items():
        torch.testing.assert_close(two["model"][k], w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("text, answer", [
    ("The answer is 1,234.", "1234"),
    ("... so 5 apples. Then 7", "7"),
    ("The answer is 12. Later we add 3 and get 15.", "12"),  # strict match first, as gsm8k_cot
    ("She pays $1,000.50 in total", "1000.5"),
    ("That makes 18.0 dollars.", "18"),
    ("The answer is $42.", "42"),
    ("It drops to -3 degrees.", "-3"),
    ("no number here", None),
    ("", None),
])
def test_final_number(text, answer):
    assert final_number(text) == answer


def test_number_checker_and_eval_records(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        # GSM8K's own format
        {"question": "Q1", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,234"},
        {"prompt": "Q2", "answer": 72},
        {"prompt": "Q3", "answer": "Paris"},
        {"prompt": "Q4", "response": "r", "answer": "5"},
    ]) + "\n")
    e = data.read_jsonl(str(path), read=records.read_record)
    assert [x["task"] for x in e] == ["number", "number", "custom", "number"]
    assert [x["answer"] for x in e] == ["1,234", "72", "Paris", "5"] and "response" not in e[0]
    assert records.check(e[0], "First 1000 + 234 = 1234. The answer is 1234.")
    assert not records.check(e[0], "The answer is 1235. Or 1234")
    assert records.check(e[1], "so she has 72.0") and not records.check(e[1], "no idea")
    assert records.check(e[2], " Paris ") and not records.check(e[2], "The answer is Paris.")
    with pytest.raises(ValueError, match=r"gsm.jsonl:1: no response to train on"):
        data.load_jsonl(str(path), read=records.read_record)


def test_eval_data_scores_a_users_jsonl(qwen, mars_run, tmp_path, capsys):
    """extras.bench.eval --data on our MARS checkpoint and on the Hugging Face directory: records
    whose answers are the model's own greedy output (exact, then its final number) are right,
    another is wrong."""
    path, _, _ = qwen
    text = run_engine(capsys, "--ckpt", mars_run, "--ar", "--prompt", PROMPT)["text"]
    number = final_number(text)
    assert records.read_record({"prompt": "p", "answer": text})["task"] == "custom"
    jsonl = tmp_path / "eval.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": PROMPT, "answer": text}, {"prompt": PROMPT, "answer": number or "7"},
        {"prompt": PROMPT, "answer": text + " and more"}]))
    for ckpt, n_rows in ((mars_run, 3), (path, 1)):
        evaluate.main(["--ckpt", str(ckpt), "--data", str(jsonl), "--max_new_tokens", "12",
                       "--device", "cpu", "--out_dir", str(tmp_path)])
        result = json.loads((tmp_path / "eval_data.json").read_text())
        assert result["n"] == 3
        assert [r["threshold"] for r in result["rows"]] == [1.0, 0.95, 0.9][:n_rows]
        first = result["rows"][0]
        if ckpt == mars_run:
            assert first["correct"] == [1, int(number is not None), 0]
            assert first["tokens_per_forward"] == 1.0
        assert all(0 < r["tokens_per_forward"] for r in result["rows"])
