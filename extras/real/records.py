"""A user's JSONL beyond the toy's {"prompt", "response"}: conversations ({"messages": [...]},
rendered by the model's chat template) and records to evaluate ({"prompt", "answer"}, GSM8K's
"... #### 72"), with the checker of a numeric answer (GSM8K chain-of-thought style). The tools
of extras/ hand read_record and check to data's functions:

    data.load_splits(path, seed, n_train, read=records.read_record)
    train.evaluate(model, tok, examples, check=records.check)
"""
import decimal
import re

import data

# A number as GSM8K chain-of-thought answers write it: sign, optional $, digits with commas, decimals
NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"


def final_number(text):
    """The final answer of a chain of thought, scored as lm-eval's gsm8k_cot does (the paper's
    evaluation): the number after the first "The answer is" (strict match), else the last
    number in the text (flexible extract); None when there is none. Commas and $ are dropped, and
    the number is normalised (1,234.0 -> 1234)."""
    strict = re.search(f"The answer is ({NUMBER})", text)
    numbers = [strict.group(1)] if strict else re.findall(NUMBER, text)
    if not numbers:
        return None
    return format(decimal.Decimal(numbers[-1].replace(",", "").replace("$", "")).normalize(), "f")


def same_number(response, answer):
    """Whether the response's final number (final_number) is the answer's."""
    return final_number(response) is not None and final_number(response) == final_number(answer)


def check(example, response):
    """data.check, and task "number" (a numeric answer to evaluate): the final number."""
    if example["task"] == "number":
        return same_number(response, example["answer"])
    return data.check(example, response)


ROLES = ("system", "user", "assistant")


def read_record(rec):
    """One line of a user's JSONL, in any form data.read_record reads and these, as an example
    {"task", "prompt", "response" (if any), "answer"}.

    {"prompt", "response"}: one user turn and its answer. {"messages": [...]}: an optional system
    turn, then user and assistant turns, the last an assistant's; only that last turn is trained
    (as the official data map does), everything before it is the prompt, rendered by the model's
    chat template (a lone user turn becomes a plain prompt string). {"prompt", "answer"} without a
    response is for evaluation only ("question" is accepted for "prompt", and GSM8K's "... #### 72"
    answers keep what follows ####). The checker: an answer that is a number is scored by its final
    number (task "number", GSM8K chain-of-thought style: `final_number`), any other text exactly
    (task "custom"); without an "answer" the expected answer is the response."""
    if not isinstance(rec, dict):
        raise ValueError('expected a JSON object: {"prompt", "response"}, {"messages": [...]} '
                         'or {"prompt", "answer"}')
    if "messages" in rec:
        msgs = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
        roles = [m["role"] for m in msgs]
        if (len(msgs) < 2 or roles[-2:] != ["user", "assistant"] or "system" in roles[1:]
                or not set(roles) <= set(ROLES) or not all(isinstance(m["content"], str) for m in msgs)):
            raise ValueError("messages must be an optional system turn, then user and assistant turns with text "
                             "content, ending with a user turn and the assistant's answer")
        prompt, response = (msgs[0]["content"] if len(msgs) == 2 else msgs[:-1]), msgs[-1]["content"]
    else:
        if "prompt" not in rec and "question" not in rec:
            raise ValueError('no "prompt" (or "messages", or "question")')
        prompt, response = rec["prompt"] if "prompt" in rec else rec["question"], rec.get("response")
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string (a conversation goes in messages)")
    if response is None and "answer" not in rec:
        raise ValueError("a record needs a response (to train on) or an answer (to evaluate)")
    answer = response if "answer" not in rec else str(rec["answer"]) if type(rec["answer"]) in (int, float) \
        else rec["answer"]
    if not (isinstance(answer, str) and isinstance(response, (str, type(None)))):
        raise ValueError("response and answer must be strings")
    answer = answer.rsplit("####", 1)[-1].strip() if "answer" in rec else answer.strip()
    task = "number" if "answer" in rec and re.fullmatch(NUMBER, answer) else "custom"
    return dict(task=task, prompt=prompt, answer=answer, **({} if response is None else {"response": response}))
