"""op_memory_fit (PithTrain): the answer's PEAK_GIB is within 15% of the estimate-memory skill's
per-GPU total for examples/qwen3_30b_a3b.py on 8 GPUs with ep 8 and 80 GiB GPUs (rerun on the unmodified
checkout), and FITS matches its verdict."""

import re
import subprocess
import sys

from common import answer_number, answer_value, args, fail, ok

a = args()
answer = a.answer.read_text()
claimed = answer_number(answer, "PEAK_GIB")
fits = answer_value(answer, "FITS").lower()
script = a.checkout / ".agents" / "skills" / "estimate-memory" / "estimate_memory.py"
p = subprocess.run([sys.executable, str(script), "examples/qwen3_30b_a3b.py", "--nproc", "8", "--ep", "8", "--gpu-mem", "80"],
                   capture_output=True, text=True, timeout=600, cwd=a.checkout)
m = re.search(r"([0-9.]+) GiB\s+total", p.stdout)
if not m:
    fail(f"the estimate gave no total: {(p.stdout + p.stderr).strip()[-200:]}")
total, verdict = float(m.group(1)), "yes" if "PASS:" in p.stdout else "no"
if fits not in ("yes", "no"):
    fail(f"FITS={fits}: answer yes or no")
if fits != verdict:
    fail(f"FITS={fits} but the estimate says {verdict} ({total} GiB)")
if abs(claimed - total) > 0.15 * total:
    fail(f"PEAK_GIB={claimed} but the estimate is {total} GiB")
ok(f"PEAK_GIB={claimed} (estimate {total} GiB), FITS={fits}")
