"""`make mutmut`'s summary, from mutmut's own verdicts (run in .mutmut/): the score on machines/,
counts by verdict and by module, and with --survivors the names of the mutants nothing caught.

Caught: killed by a test, a timeout (the mutant made a test hang, which a run notices), or
rejected by mypy --strict (make test's typecheck). Not caught: survived, or no test covers it."""

import collections
import json
import sys
from pathlib import Path

from mutmut.stats import status_by_exit_code

CAUGHT = {"killed", "timeout", "caught by type check"}

verdicts: dict[str, str] = {}
for meta in sorted(Path("mutants").rglob("*.py.meta")):
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        verdicts[name] = status_by_exit_code[code]

counts = collections.Counter(verdicts.values())
checked = len(verdicts) - counts["not checked"]
caught = sum(counts[s] for s in CAUGHT)
print(f"mutmut on machines/: {len(verdicts)} mutants, {checked} checked: " + ", ".join(
    f"{n} {status}" for status, n in counts.most_common()))
print(f"score: {caught} of {checked} checked mutants caught = {100 * caught / max(1, checked):.1f}%"
      + (f" ({counts['not checked']} not checked yet)" if counts["not checked"] else ""))
by_module = collections.defaultdict(collections.Counter)
for name, status in verdicts.items():
    by_module[name.split(".")[2]]["caught" if status in CAUGHT else status] += 1
for module, c in sorted(by_module.items()):
    done = sum(c.values()) - c["not checked"]
    print(f"  {module:9} {c['caught']:5} of {done:5} caught ({100 * c['caught'] / max(1, done):5.1f}%)"
          + "".join(f", {n} {s}" for s, n in c.items() if s not in ("caught",)))
if "--survivors" in sys.argv:
    for name, status in sorted(verdicts.items()):
        if status in ("survived", "no tests"):
            print(status, name)
