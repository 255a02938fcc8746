"""op_profile_stage (PithTrain): a trace of one step is in ate_out/profile_run/profile/rank0.json, and the
answer's EXPERT_MS is within 30% of the forward time of stage 3 (experts) that the capture-profile
skill's analysis of that trace reports (rerun here on the unmodified checkout)."""

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
measured = float(m.group(1))
if abs(claimed - measured) > 0.3 * measured:
    fail(f"EXPERT_MS={claimed} but the trace's stage 3 forward time is {measured:.2f} ms")
ok(f"EXPERT_MS={claimed}, trace {measured:.2f} ms")
