"""MARS fine-tuning of a real (Hugging Face) model, offline: train.py --init_from DIR on a
tiny random Qwen2 built with transformers (tests/test_hf.py's builders), the chat template's
targets, the checkpoint it writes, its export, eval.py --data with the GSM8K-style checker."""
import json
import math
import signal

import pytest
import torch
import transformers

import common
import data
import sample
import train
from extras.bench import eval as evaluate
from extras.checkpoints import export, hf_train
from extras.real.records import final_number
from test_hf import build, hf_greedy

SYSTEM = "You are a terse assistant."
PROMPT = "Hello café 日本 😀 12345"


def records():
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
            msgs = [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"}, user, answer]
        out.append({"messages": msgs})
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    path = build("qwen2", root / "qwen", tie=True, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2)
    jsonl = root / "my.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return path, jsonl, root


def run_train(*argv):
    handler = signal.getsignal(signal.SIGINT)  # train installs its own Ctrl-C handler
    try:
        train.main([str(a) for a in argv])
    finally:
        signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="module")
def mars_run(qwen):
    """Three MARS steps on the Hugging Face directory with the recipe's defaults (the precision measured)."""
    path, jsonl, root = qwen
    out = root / "out"
    run_train("--stage", "mars", "--init_from", path, "--data", jsonl, "--out_dir", out, "--device", "cpu",
              "--mars_iters", 3, "--batch_size", 4, "--micro_batch", 2)
    return out / "mars.pt"


def test_only_the_last_assistant_turn_is_trained(qwen):
    """The targets of a multi-turn conversation with a system turn are the official data map's labels:
    everything after apply_chat_template(messages[:-1], add_generation_prompt=True), here without the
    newline Qwen's template writes after <|im_end|>, then <|im_end|> padding up to a multiple of B."""
    path, _, _ = qwen
    _, tok = common.model_from_checkpoint(common.load_checkpoint(str(path)))
    hftok = transformers.AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say 3."},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "What is 3 plus 3?"},
            {"role": "assistant", "content": "3 + 3 = 6. The answer is 6."}]
    e = data.read_record({"messages": msgs})
    assert e["prompt"] == msgs[:-1] and e["response"] == msgs[-1]["content"]
    full = hftok.apply_chat_template(msgs, tokenize=True)["input_ids"]
    head = hftok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)["input_ids"]
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


def test_mars_on_a_hugging_face_directory_checkpoint_samples_and_exports(qwen, mars_run, tmp_path, capsys):
    path, _, _ = qwen
    ckpt = common.load_checkpoint(str(mars_run))
    cfg = ckpt["train_config"]
    # the recipe is the default for a Hugging Face directory, and flags override single values; the given batch
    # and steps win over the schedule, whose lr follows the batch: 5e-6 at 384, times sqrt(4 / 384) at 4
    assert cfg["preset"] == "hf" and cfg["lr"] == 5e-6 and cfg["warmup"] == 0.03
    assert cfg["schedule"]["mars"]["lr"] == pytest.approx(5e-6 / math.sqrt(96))
    assert cfg["schedule"]["mars"]["batch_size"] == cfg["batch_size"] == 4
    assert cfg["schedule"]["mars"]["why"].startswith("batch given; steps given; lr: 5e-06 x sqrt(4 / 384)")
    assert cfg["weight_decay"] == 0.0 and cfg["betas"] == [0.9, 0.999]
    # the recipe leaves the precision to the probe (--precision auto), which recorded its timings
    assert cfg["precision"] == cfg["precision_why"]["dtype"] and cfg["precision_why"]["float32_ms"] > 0
    # rows of at most 512 tokens (the recipe), within the model's context (256 here)
    assert cfg["max_seq_len"] == 256 and cfg["mars_iters"] == 3 and cfg["micro_batch"] == 2
    assert ckpt["mars"]["B"] == 4 and ckpt["stage"] == "mars" and ckpt["done"] and ckpt["hf"]["model_type"] == "qwen2"
    source = common.load_checkpoint(str(path))
    assert ckpt["model_config"] == source["model_config"]  # the shape comes from config.json
    assert ckpt["tokenizer"] == source["tokenizer"]  # self-contained: vocabulary, specials, chat template
    moved = [k for k in source["model"] if not torch.equal(source["model"][k], ckpt["model"][k])]
    assert len(moved) == len(source["model"])  # three steps moved every tensor
    assert max((source["model"][k] - ckpt["model"][k]).abs().max() for k in moved) < 1e-3  # at lr 5.1e-7
    assert all(len(h) and torch.isfinite(torch.tensor(h["loss"])) for h in ckpt["history"])
    # it samples (AR and MARS), and its export generates in transformers what sample.py --ar generates
    _, tok = common.model_from_checkpoint(ckpt)
    want = []
    for flags in (["--ar"], ["--threshold", "0.5"]):
        capsys.readouterr()
        sample.main(["--ckpt", str(mars_run), "--json", "--max_new_tokens", "12", "--device", "cpu", "--prompt",
                     PROMPT, *flags])
        want.append(json.loads(capsys.readouterr().out)["ids"])
        assert len(want[-1]) == 12 or want[-1][-1] == tok.eot
    export.main([str(mars_run), str(tmp_path / "export")])
    assert json.loads((tmp_path / "export" / "config.json").read_text())["mars_block_size"] == 4
    assert hf_greedy(tmp_path / "export", tok, prompt=PROMPT) == want[0]


def test_continued_ar_sft_on_a_hugging_face_directory(qwen):
    path, jsonl, root = qwen
    run_train("--stage", "ar", "--init_from", path, "--data", jsonl, "--out_dir", root / "ar", "--device", "cpu",
              "--ar_iters", 2, "--batch_size", 2, "--micro_batch", 1, "--precision", "float32")
    ckpt = common.load_checkpoint(str(root / "ar" / "ar.pt"))
    assert ckpt["stage"] == "ar" and "mars" not in ckpt and "hf" in ckpt and ckpt["train_config"]["ar_iters"] == 2
    assert trained_from_hf_is_recipe(root / "ar" / "ar.pt")


def trained_from_hf_is_recipe(path):
    """Stage 2 from an ar.pt trained from a Hugging Face model takes the recipe by default too."""
    return train.get_args(["--stage", "mars", "--init_from", str(path)]).preset == "hf"


def test_hugging_face_directory_needs_data_and_the_recipe_needs_a_model(qwen, tmp_path):
    path, _, _ = qwen
    with pytest.raises(ValueError, match="needs --data"):  # one line under common.run_cli, as a UserError is
        run_train("--stage", "mars", "--init_from", path, "--out_dir", tmp_path, "--device", "cpu")
    with pytest.raises(SystemExit):
        train.get_args(["--preset", "hf"])


@pytest.mark.parametrize("rows, multiple, batch, steps", [
    (2000, 1, 40, 250),  # rows // 50 = 40: 50 steps an epoch, 5 epochs
    (1072, 4, 20, 268),  # 21, down to a multiple of the micro-batch
    (24, 4, 16, 200),  # the smallest batch, and the floor of 200 steps
    (100000, 4, 384, 1303),  # the paper's batch at most
])
def test_hf_schedule_follows_the_data(rows, multiple, batch, steps):
    got = hf_train.hf_schedule(rows, 5, {}, multiple)
    assert got[:2] == (batch, steps) and got[2] == pytest.approx(5e-6 * math.sqrt(batch / 384))
    assert got[3] == (f"batch: rows // 50 = {rows // 50}, within [16, 384]" + (", a multiple of 4" if multiple > 1
                      else "") + f"; steps: 5 epochs of {rows} rows, at least 200; lr: 5e-06 x sqrt({batch} / 384)")


def test_hf_schedule_gives_way_to_the_flags_and_the_run_records_it():
    """What the command line sets wins, stage by stage; the rest follows the data, and cfg.schedule (the
    checkpoint's train_config) records the choice, which the stage reads. smollm2 is only named: nothing is loaded."""
    base = ["--stage", "all", "--init_from", "smollm2", "--device", "cpu"]
    cfg = train.get_args(base + ["--batch_size", "64", "--mars_lr", "1e-5", "--ar_iters", "7"])
    assert cfg.preset == "hf" and {"batch_size", "mars_lr", "ar_iters"} <= set(cfg.given)
    ar = hf_train.fit_hf_schedule(cfg, "ar", 1072, world=2)
    assert ar == {"rows": 1072, "batch_size": 64, "steps": 7, "lr": pytest.approx(5e-6 / math.sqrt(6)),
                  "why": "batch given; steps given; lr: 5e-06 x sqrt(64 / 384)"}
    mars = hf_train.fit_hf_schedule(cfg, "mars", 1072, world=2)
    assert mars == {"rows": 1072, "batch_size": 64, "steps": 200, "lr": 1e-5,
                    "why": "batch given; steps: 5 epochs of 1072 rows, at least 200; lr given"}
    fitted = cfg.replace(schedule={"ar": ar, "mars": mars})
    assert train.schedule_of(fitted, "ar") == (64, 7, ar["lr"]) and train.schedule_of(fitted, "mars") == (64, 200, 1e-5)
    cfg = train.get_args(base)  # no flags: micro-batch 4 x 2 processes, so batch 16 rather than 21
    mars = hf_train.fit_hf_schedule(cfg, "mars", 1072, world=2)
    assert (mars["batch_size"], mars["steps"]) == (16, 335) and mars["lr"] == pytest.approx(5e-6 / math.sqrt(24))
    with pytest.raises(AttributeError, match="read-only"):  # nothing edits the resolved config
        cfg.batch_size = 16


@pytest.mark.parametrize("text, answer", [
    ("The answer is 1,234.", "1234"),
    ("... so 5 apples. Then 7", "7"),
    ("The answer is 12. Later we add 3 and get 15.", "12"),  # strict match first, as lm-eval's gsm8k_cot
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
        {"question": "Q1", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,234"},  # GSM8K's own format
        {"prompt": "Q2", "answer": 72},
        {"prompt": "Q3", "answer": "Paris"},
        {"prompt": "Q4", "response": "r", "answer": "5"},
    ]) + "\n")
    e = data.read_jsonl(str(path))
    assert [x["task"] for x in e] == ["number", "number", "custom", "number"]
    assert [x["answer"] for x in e] == ["1,234", "72", "Paris", "5"] and "response" not in e[0]
    assert data.check(e[0], "First 1000 + 234 = 1234. The answer is 1234.")
    assert not data.check(e[0], "The answer is 1235. Or 1234")
    assert data.check(e[1], "so she has 72.0") and not data.check(e[1], "no idea")
    assert data.check(e[2], " Paris ") and not data.check(e[2], "The answer is Paris.")
    with pytest.raises(ValueError, match=r"gsm.jsonl:1: no response to train on"):
        data.load_jsonl(str(path))


def test_eval_data_scores_a_users_jsonl(qwen, mars_run, tmp_path, capsys):
    """eval.py --data on our MARS checkpoint and on the Hugging Face directory: records whose answers are
    the model's own greedy output (exact, then its final number) are right, another is wrong."""
    path, _, _ = qwen
    capsys.readouterr()
    sample.main(["--ckpt", str(mars_run), "--json", "--ar", "--max_new_tokens", "12", "--device", "cpu",
                 "--prompt", PROMPT])
    text = json.loads(capsys.readouterr().out)["text"]
    number = final_number(text)
    assert data.read_record({"prompt": "p", "answer": text})["task"] == "custom"
    jsonl = tmp_path / "eval.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": PROMPT, "answer": text}, {"prompt": PROMPT, "answer": number or "7"},
        {"prompt": PROMPT, "answer": text + " and more"}]))
    for ckpt, n_rows in ((mars_run, 3), (path, 1)):
        evaluate.main(["--ckpt", str(ckpt), "--data", str(jsonl), "--max_new_tokens", "12", "--device", "cpu",
                       "--out_dir", str(tmp_path)])
        result = json.loads((tmp_path / "eval_data.json").read_text())
        assert result["n"] == 3 and [r["threshold"] for r in result["rows"]] == [1.0, 0.95, 0.9][:n_rows]
        first = result["rows"][0]
        if ckpt == mars_run:
            assert first["correct"] == [1, int(number is not None), 0] and first["tokens_per_forward"] == 1.0
        assert all(0 < r["tokens_per_forward"] for r in result["rows"])
