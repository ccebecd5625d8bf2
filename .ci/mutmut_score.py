"""`make mutmut`'s summary: the score on machines/ from mutmut's own counts (run in .mutmut/).
Timeouts count as caught (the mutant made a test hang, which a test run notices)."""

import json

s = json.load(open("mutants/mutmut-cicd-stats.json"))
caught = s["killed"] + s["timeout"]
print(f"mutmut on machines/: {caught} of {s['total']} mutants caught ({s['killed']} killed, "
      f"{s['timeout']} timeouts); {s['survived']} survived, {s['no_tests']} without a covering test, "
      f"{s['suspicious']} suspicious: score {100 * caught / max(1, s['total']):.1f}%")
