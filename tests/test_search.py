"""The preset search (python -m extras.bench.course_search) imports, and every candidate's flags are
ones train.py takes: a search that crashes after its first candidate is found here, not an hour in."""
import shlex

import pytest

import train
from extras.bench import course_search


@pytest.mark.parametrize("name", list(course_search.CANDIDATES))
def test_every_candidate_is_a_train_py_command(name, tmp_path):
    flags = shlex.split(course_search.CANDIDATES[name])
    cfg = train.get_config(flags + ["--out_dir", str(tmp_path), "--precision", "float32"])
    assert cfg.out_dir == str(tmp_path) and cfg.precision == "float32"


def test_the_committed_search_names_its_choice_and_why():
    import json
    from pathlib import Path
    d = json.loads((Path(__file__).resolve().parent.parent / "docs" / "preset_search_cpu.json").read_text())
    names = {r["name"] for r in d["candidates"]}
    assert d["chosen"]["cpu"] in names and d["chosen"]["course"] in names
    assert d["chosen_why"]["cpu"] and d["chosen_why"]["course"]
