"""op_profile_stage (PithTrain): a trace of one step is in ate_out/profile_run/profile/rank0.json, and the
answer's EXPERT_MS is within 30% of either measure of the forward stage 3 (experts) in it: the time the
capture-profile skill's analysis reports (rerun here on the unmodified checkout; GPU kernel time on GPUs,
host op time on the CPU), or the host wall time of the `pithtrain::stage3` ranges."""

import json
import re
import subprocess
import sys

from common import answer_number, args, fail, ok

a = args()
claimed = answer_number(a.answer.read_text(), "EXPERT_MS")
trace = a.workdir / "ate_out" / "profile_run" / "profile" / "rank0.json"
if not trace.is_file():
    fail(f"{trace} does not exist")
script = a.checkout / ".agents" / "skills" / "capture-profile" / "profile_step.py"
p = subprocess.run([sys.executable, str(script), "--trace", str(trace)], capture_output=True, text=True, timeout=600)
m = re.search(r"stage 3 experts\s+forward\s+([0-9.]+)", p.stdout)
if not m:
    fail(f"the profile analysis found no stage 3 time: {(p.stdout + p.stderr).strip()[-200:]}")
events = json.loads(trace.read_text())
events = events.get("traceEvents", []) if isinstance(events, dict) else events
ranges = sum(e.get("dur", 0) for e in events if e.get("name") == "pithtrain::stage3") / 1000
measures = f"analysis {float(m.group(1)):.2f} ms, stage 3 ranges {ranges:.2f} ms"
if not any(abs(claimed - x) <= 0.3 * x for x in (float(m.group(1)), ranges)):
    fail(f"EXPERT_MS={claimed} but the trace gives {measures}")
ok(f"EXPERT_MS={claimed}; trace: {measures}")
