"""How much of the method the fast tier of tests checks: mutmut's mutants of the listed functions (issue 60),
killed or not, per file -> docs/mutation.json. mutmut's settings (mutmut >= 3.8): setup.cfg [mutmut].

    python -m extras.bench.mutation_report --run    # mutmut run on the listed functions (hours), then the report
    python -m extras.bench.mutation_report          # the report from the last run's results in mutants/

Both from the repository's root, where mutmut writes mutants/.

A timeout counts as killed; a mutant a run cut short left unrun is counted apart. A survivor shown to be equivalent (EQUIVALENT, or a change of a tensor's device
alone: the fast tier runs on a CPU) is left out of the count and listed with its reason; every other survivor
is listed, to be killed by a test or explained. mutmut 3 makes no mutants of a decorated function: the report
names those it could not test."""
import ast
import fnmatch
import json
import os
import re
import subprocess
import time
from pathlib import Path

from common import Parser, UserError, run_cli

# the method's functions, in mutmut's names (x_function, xǁClassǁmethod); of train.py's loop, its gradient
# accumulation: the mutants of its lines from ACCUMULATION[0] to ACCUMULATION[1]
LISTED = {
    "mars.py": ["x_*"],
    "sample.py": ["x_generate", "x_predictions", "x_check_room"],
    "model.py": ["xǁAttentionǁforward", "xǁGPTǁhidden", "xǁGPTǁforward", "xǁGPTǁnew_cache", "xǁKVCacheǁ*"],
    "train.py": ["x_lr_at", "xǁMuonǁ__init__", "xǁMuonǁstep", "x_orthogonalise", "xǁStageǁmicro_batches",
                 "xǁStageǁshare", "x_train"],
}
ACCUMULATION = ("seqs, logged = stage.next_batch(), {}", "logged[k] = logged.get(k, 0.0) + v.item() / stage.accum")
KILLED = ("killed", "timeout")
# (file, the mutant's line): why it changes nothing
EQUIVALENT = {
    ("mars.py", 'logits[..., mask_id] = float("-INF")'): 'float() reads "-INF" as -inf',
    ("mars.py", 'logits[..., n_vocab:] = float("-INF")'): 'float() reads "-INF" as -inf',
    ("train.py", 'def lr_at(it, peak, warmup_frac, iters, schedule="XXcosineXX", decay=0.4):'):
        "every schedule but wsd is the cosine: the default's name is compared with nothing else",
    ("train.py", 'def lr_at(it, peak, warmup_frac, iters, schedule="COSINE", decay=0.4):'):
        "every schedule but wsd is the cosine: the default's name is compared with nothing else",
    ("model.py", "visible = None if (t == 1) and False else visible"):
        "a one-token window's mask, tril(lo) of one row over lo + 1 keys, is all True: the attention of None",
    ("mars.py", "return torch.cat([top, bottom], )"): "torch.cat's default dim is 0",
    ("mars.py", "skip = None  # only a saving"):
        "ids[:, None:] keeps every noisy position: the same losses, only slower (a test checks it)",
    ("mars.py", "noisy, clean = ce[:, :+T].sum(1) / n, ce[:, -T:].sum(1) / n  # clean: the last T positions"):
        "the first T positions add the clean stream's first `skip`, all before every row's first target: 0 loss",
    ("mars.py", "noisy, clean = ce[:, :-T].sum(1) / n, ce[:, +T:].sum(1) / n  # clean: the last T positions"):
        "the clean stream less its first `skip` positions, all before every row's first target: 0 loss",
    ("sample.py", "longest = max([len(prompts[i]) + budgets[i] for i in rows], default=2)"):
        "the default sizes the cache of a batch with no row answering, which nothing reads",
    ("train.py", "return peak if it <= start else peak * (iters - it) / max(1, iters - start)"):
        "at it == start the decay's first value is peak * (iters - start) / (iters - start): the peak",
}
DEVICE_ONLY = "a tensor's device alone: the same tensor on the CPU the fast tier runs on (CUDA is left to a GPU run)"


def changed_lines(name, path):
    """(the original line, the mutant's line) of a mutant, from mutmut's diff of its function."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant  # mutmut only here: --help runs without it
    diff = get_diff_for_mutant(name, path=path).splitlines()[2:]  # past the --- and +++ headers
    old = next(line[1:].strip() for line in diff if line.startswith("-"))
    new = next(line[1:].strip() for line in diff if line.startswith("+"))
    return old, new


def why_equivalent(path, old, new):
    if (path, new) in EQUIVALENT:
        return EQUIVALENT[(path, new)]
    without_device = lambda s: re.sub(r",\)", ")", re.sub(r",?(device=)?([\w.]*device|None)(?=\))", "", s.replace(" ", "")))
    return DEVICE_ONLY if without_device(old) == without_device(new) else None


def accumulation_lines():
    lines = [line.strip() for line in Path("train.py").read_text().splitlines()]
    first, last = (lines.index(anchor) for anchor in ACCUMULATION)
    return set(lines[first:last + 1])


def listed_mutants(path):
    """{function pattern: its mutants' names} of one file, from mutmut's meta file."""
    module, meta = Path(path).stem, Path(f"mutants/{path}.meta")
    if not meta.exists():
        raise UserError(f"no mutmut results in {meta}: run python -m extras.bench.mutation_report --run")
    keys = json.loads(meta.read_text())["exit_code_by_key"]
    mutants = {p: [k for k in keys if fnmatch.fnmatch(k, f"{module}.{p}__mutmut_*")] for p in LISTED[path]}
    if "x_train" in mutants:
        inside = accumulation_lines()
        mutants["x_train"] = [k for k in mutants["x_train"] if changed_lines(k, path)[0] in inside]
    return mutants


def decorated(path):
    """mutmut's names of a file's decorated functions and methods: mutmut 3 makes no mutants of them."""
    body = ast.parse(Path(path).read_text()).body
    methods = [(f"xǁ{c.name}ǁ", f) for c in body if isinstance(c, ast.ClassDef) for f in c.body]
    return [prefix + f.name for prefix, f in [("x_", f) for f in body] + methods
            if isinstance(f, ast.FunctionDef) and f.decorator_list]


def report():
    from mutmut.stats import status_by_exit_code
    files, equivalent, survivors, untested = {}, [], [], []
    for path in LISTED:
        listed, counts = listed_mutants(path), {}
        data = json.loads(Path(f"mutants/{path}.meta").read_text())["exit_code_by_key"]
        for pattern, names in listed.items():
            skipped = [f for f in decorated(path) if fnmatch.fnmatch(f, pattern)]
            if not names and not skipped:
                raise UserError(f"{path}: no mutants of {pattern}: is it still there, under that name?")
            untested += [{"file": path, "function": f, "why": "decorated: mutmut 3 makes no mutants of it"}
                         for f in skipped]
            for name in names:
                status = status_by_exit_code[data[name]]
                if status not in KILLED and status != "not checked":  # a run cut short leaves some unrun
                    old, new = changed_lines(name, path)
                    row = {"mutant": name, "line": old, "mutant_line": new, "status": status}
                    why = why_equivalent(path, old, new) if status == "survived" else None
                    if why:
                        equivalent.append({**row, "why": why})
                        status = "equivalent"
                    else:
                        survivors.append(row)
                counts[status] = counts.get(status, 0) + 1
        killed = sum(counts.get(s, 0) for s in KILLED)
        counted = sum(counts.values()) - counts.get("equivalent", 0) - counts.get("not checked", 0)
        files[path] = {"functions": LISTED[path], "mutants": sum(counts.values()), **counts,
                       "kill_rate": round(killed / counted, 4) if counted else None}
    return files, equivalent, survivors, untested


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("--run", action="store_true", help="run mutmut on the listed functions first")
    p.add_argument("--out", default="docs/mutation.json", help="default docs/mutation.json")
    args = p.parse_args(argv)
    if args.run:  # all but train's loop, whose accumulation mutants are known once mutants/ is written
        subprocess.run(["mutmut", "run", *[f"{Path(f).stem}.{fn}__mutmut_*" for f, fns in LISTED.items()
                                           for fn in fns if fn != "x_train"]], check=True)
        subprocess.run(["mutmut", "run", *listed_mutants("train.py")["x_train"]], check=True)
    files, equivalent, survivors, untested = report()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               None) if os.path.exists("/proc/cpuinfo") else None
    result = {"what": "mutmut's mutants of the method's functions against the fast tier (python -m pytest), "
                      "per file: kill rate = (killed + timeout) / (mutants - equivalent)",
              "command": "python -m extras.bench.mutation_report --run", "settings": "setup.cfg [mutmut]",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "machine": {"cpu": cpu, "cores": os.cpu_count()}, "date": time.strftime("%Y-%m-%d"),
              "files": files, "untested": untested, "equivalent": equivalent, "survivors": survivors}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
    for path, r in files.items():
        print(f"{path:10s} {r['mutants']:5d} mutants, kill rate {r['kill_rate']}"
              + (f", {r['not checked']} not checked: the run is incomplete" if "not checked" in r else ""))
    print(f"{len(equivalent)} equivalent, {len(survivors)} survivors, {len(untested)} functions untested: {args.out}")


if __name__ == "__main__":
    run_cli(main)
