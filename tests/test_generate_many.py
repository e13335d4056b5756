"""sample.generate on a batch, training's scoring path: for every prompt, the tokens and the forwards it commits
alone (a batch of one), at the paper's tau, at a tau low enough for several tokens a forward, at 1.0 (AR), with
answers cut by the budget and prompts of different lengths (ragged rows, rows leaving the batch)."""
import pytest

import data
import sample
from common import load_checkpoint, model_from_checkpoint


@pytest.mark.parametrize("name,tau,max_new", [("mars", 0.9, 64), ("mars", 0.01, 7), ("mars", 1.0, 64), ("ar", 1.0, 5)])
def test_a_batch_commits_what_each_prompt_commits_alone(tiny_run, name, tau, max_new):
    ckpt = load_checkpoint(tiny_run / f"{name}.pt")
    model, tok = model_from_checkpoint(ckpt)
    model.eval()
    B = ckpt.get("mars", {}).get("B", 1)
    examples = data.build_instruction_set()["test"][::80]
    prompts = [tok.prompt_ids(e["prompt"]) for e in examples]
    assert len({len(p) for p in prompts}) > 3  # ragged rows
    alone = [sample.generate(model, [p], tok.eot, tok.mask, B, tau, max_new, n_vocab=tok.n_vocab)[0] for p in prompts]
    batch = sample.generate(model, prompts, tok.eot, tok.mask, B, tau, max_new, n_vocab=tok.n_vocab)
    assert batch == alone
    assert len({len(out) for out, _ in batch}) > 1  # rows left the batch at different forwards
    for p, (out, chunks) in zip(prompts, batch):  # a row stops at its budget or its first <|endoftext|>
        assert len(out) == min(max_new, model.config.max_seq_len - len(p)) or out[-1] == tok.eot
        assert tok.eot not in out[:-1] and sum(chunks, []) == out
        assert all(1 <= len(c) <= (1 if tau == 1.0 else B) for c in chunks)  # a forward commits 1 to B
