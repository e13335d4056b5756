"""Targets that keep the model itself (beyond the paper): python -m extras.real.train --targets
soft (extras/real/teacher.py) and --clean_padding drop (extras/real/options.py), against the
paper's hard-label loss."""
import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import data
import mars
from conftest import run_cli
from extras.real import chunked_ce
from extras.real.options import Options
from extras.real.teacher import Teacher


@pytest.fixture(scope="module")
def batch(tok, splits):
    """Six examples padded to a multiple of 4 with end-of-turn tokens (stage 2's batches), and a
    float64 model."""
    rows = [tok.example_ids(e["prompt"], e["response"]) for e in splits["train"][:6]]
    x, y = data.make_batch(rows, tok.eot, 4)
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.n_vocab, max_seq_len=64, n_layer=2, n_head=2, n_embd=32)
    return x, y, GPT(config).double()


def options(tok, name="mars", teacher=None, **changes):
    cfg = dict(B=4, ar_weight=0.5, no_sft=False, block_offset="fixed", targets="hard",
               clean_padding="keep", from_hf=False, device="cpu")
    return Options(name, SimpleNamespace(**{**cfg, **changes}), tok, teacher)


def drop_padding(tok, y):
    return options(tok, clean_padding="drop").clean_targets(y)


def test_drop_keeps_each_answer_through_its_own_end_of_turn(tok, batch):
    x, y, _ = batch
    clean_y = drop_padding(tok, y)
    padded = (y == tok.eot).sum(1) > 1
    assert padded.any() and not padded.all()  # some rows padded to B's multiple, some not
    for b in range(len(y)):
        kept = y[b][clean_y[b] != -1].tolist()
        assert kept == y[b][y[b] != -1].tolist()[:len(kept)]  # a prefix of the targets
        # through the answer's end of turn, no further
        assert kept[-1] == tok.eot and kept.count(tok.eot) == 1


@pytest.mark.parametrize("drop", [False, True])
def test_one_hot_soft_targets_are_the_hard_loss(tok, batch, drop):
    """soft is read in the order of [y | clean_y]'s targets, row by row: one-hot targets in that
    order give the hard loss exactly, for MARS (both streams, with idle noisy positions left
    out) and for the control. A plain GPT takes no soft targets: the stage makes its model a
    ChunkedGPT (extras/real/chunked_ce.py), here a copy."""
    x, y, m = batch
    clean_y = drop_padding(tok, y) if drop else y
    both = torch.cat([y, clean_y], 1)

    def one_hot(x, y, clean_y, noisy=True):  # a teacher whose targets are the data's tokens
        targets = both if noisy else clean_y
        return F.one_hot(targets[targets != -1], tok.n_vocab).float()
    padding, teacher = "drop" if drop else "keep", SimpleNamespace(targets=one_hot)
    hard = options(tok, clean_padding=padding).loss(m, x, y)[1]
    chunked = chunked_ce.chunked(copy.deepcopy(m))
    soft = options(tok, teacher=teacher, clean_padding=padding).loss(chunked, x, y)[1]
    for k in hard:
        torch.testing.assert_close(hard[k], soft[k], atol=1e-6, rtol=0)
    control = options(tok, "control", teacher, clean_padding=padding).loss(chunked, x, y)
    torch.testing.assert_close(control[0], hard["clean"], atol=1e-6, rtol=0)
    assert drop == (abs(hard["clean"] - mars.mars_loss(m, x, y, tok.mask, 4, 0.5)[2]) > 1e-6)


@pytest.mark.parametrize("drop", [False, True])
def test_teacher_targets_are_the_base_distribution_at_each_target(tok, batch, drop):
    """Each stream's target at position q is the base's next-token distribution after x[:q+1]
    (one-hot end of turn on the padding), and the training model is a copy: training it leaves
    the targets unchanged."""
    x, y, m = batch
    clean_y = drop_padding(tok, y) if drop else y
    teacher = Teacher(m, tok)
    probs = m(x).float().softmax(-1)
    probs[..., tok.mask] = 0
    probs = probs / probs.sum(-1, keepdim=True)
    eot = y == tok.eot
    probs[eot & (eot.cumsum(1) > 1)] = F.one_hot(torch.tensor(tok.eot), tok.n_vocab).float()
    want = torch.cat([torch.cat([probs[b][y[b] != -1], probs[b][clean_y[b] != -1]])
                      for b in range(len(y))])
    got = teacher.targets(x, y, clean_y)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    clean_only = teacher.targets(x, y, clean_y, noisy=False)
    torch.testing.assert_close(clean_only, probs[clean_y != -1], atol=1e-6, rtol=0)
    with torch.no_grad():
        m.wte.weight.add_(1.0)
    torch.testing.assert_close(teacher.targets(x, y, clean_y), got, atol=0, rtol=0)
    with torch.no_grad():
        m.wte.weight.sub_(1.0)


@pytest.mark.slow
def test_soft_targets_and_dropped_padding_train_and_are_recorded(tiny_run, tmp_path):
    """Both options run stage 2 and the control from a stage-1 checkpoint, and the checkpoint
    records them (a MARS checkpoint among its stage-2 flags, which --resume checks)."""
    flags = ["--preset", "tiny", "--init_from", tiny_run / "ar.pt", "--mars_iters", "4",
             "--eval_every", "2", "--summary_limit", "4", "--targets", "soft",
             "--clean_padding", "drop", "--device", "cpu"]
    for stage in ("mars", "control"):
        out = tmp_path / stage
        proc = run_cli(["extras/real/train.py", *flags, "--stage", stage, "--out_dir", out])
        assert proc.returncode == 0, proc.stderr
        ckpt = torch.load(out / f"{stage}.pt", weights_only=True)
        assert ckpt["train_config"]["targets"] == "soft"
        assert ckpt["train_config"]["clean_padding"] == "drop"
        log = json.loads((out / f"{stage}_log.json").read_text())
        assert all(torch.isfinite(torch.tensor(h["loss"])) for h in log)
        assert "val_loss" in log[-1]
    assert {"targets": "soft", "clean_padding": "drop"}.items() <= ckpt_mars(tmp_path).items()


def ckpt_mars(tmp_path):
    return torch.load(tmp_path / "mars" / "mars.pt", weights_only=True)["mars"]
