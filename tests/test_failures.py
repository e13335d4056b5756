"""python -m extras.bench.failures: its groups come from the prompts as the generators made them,
cover each family's prompts once, and its accuracies are train.evaluate's."""
import json
import random

import data
import train
from common import load_checkpoint, model_from_checkpoint
from extras.bench import failures

ADD, COUNT = failures.FEATURES["add"], failures.FEATURES["count"]


def test_groups_of_known_prompts():
    assert ADD["ones carry"]({"prompt": "What is 27 + 15?", "answer": "42"}) == "1"
    assert ADD["ones carry"]({"prompt": "Hi! Add 23 and 15.", "answer": "38"}) == "0"
    assert ADD["sum >= 100"]({"prompt": "Compute 57 plus 48.", "answer": "105"}) == "yes"
    absent = {"prompt": "How many times does the letter z appear in apple?", "answer": "0"}
    assert [COUNT[f](absent) for f in COUNT] == ["absent", "0", "5"]
    thrice = {"prompt": "One more: Count the letter p in the word pepper.", "answer": "3"}
    assert [COUNT[f](thrice) for f in COUNT] == ["present", "3+", "6"]


def test_carries_agree_with_the_worked_answers():
    rng = random.Random(0)
    for _ in range(200):
        prompt, response, answer = data.task_add(rng)
        assert ADD["ones carry"]({"prompt": prompt, "answer": answer}) == str(int(", carry 1" in response))


def test_first_wrong_token(tiny_run):
    tok = model_from_checkpoint(load_checkpoint(tiny_run / "mars.pt"))[1]
    e = {"prompt": "What is 27 + 15?", "response": "The answer is 42."}
    ids, n = tok.example_ids(e["prompt"], e["response"])
    ref, bad = ids[n:], tok.mask  # any token the answer lacks
    assert failures.first_wrong(tok, e, ref[:1] + [bad], [ref[:1], [bad]]) == "single"
    assert failures.first_wrong(tok, e, [bad, *ref[1:3]], [[bad, *ref[1:3]]]) == "multi (AR token)"
    assert failures.first_wrong(tok, e, [ref[0], bad], [[ref[0], bad]]) == "multi (mask token)"
    assert failures.first_wrong(tok, e, ref[:2], [ref[:2]]) == "cut off"


def test_report_on_the_tiny_run(tiny_run, tmp_path, capsys):
    out, limit = tmp_path / "failures.json", 6
    failures.main(["--ar_ckpt", str(tiny_run / "ar.pt"), "--ckpt", str(tiny_run / "mars.pt"),
                   "--split", "val", "--limit", str(limit), "--out", str(out)])
    assert "| ones carry: 1 |" in capsys.readouterr().out
    result = json.load(open(out))
    assert result["checkpoints"]["mars"]["preset"] == "tiny" and result["commit"]
    mars = load_checkpoint(tiny_run / "mars.pt")
    val = data.splits_of(mars["train_config"])["val"]
    models = {"ar": model_from_checkpoint(load_checkpoint(tiny_run / "ar.pt")),
              "mars": model_from_checkpoint(mars)}
    for family, r in result["families"].items():
        examples = [e for e in val if e["task"] == family][:limit]
        assert r["n"] == len(examples) == limit
        for groups in r["groups"].values():
            assert sum(g["n"] for g in groups.values()) == r["n"]
        for name, d in result["decoders"].items():
            model, tok = models["ar" if d["B"] == 1 else "mars"]
            evaluated = train.evaluate(model, tok, examples, B=d["B"], tau=d["tau"])
            assert r["accuracy"][name] == evaluated["per_task"][family]
            for groups in r["groups"].values():  # the groups' right answers add up to the family's
                assert round(sum(g["n"] * g["accuracy"][name] for g in groups.values())) == \
                    round(r["n"] * r["accuracy"][name])
        assert len(r["wrong"]["stage 1"]) == min(3, round(r["n"] * (1 - r["accuracy"]["stage 1"])))
