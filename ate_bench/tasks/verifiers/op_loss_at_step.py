"""op_loss_at_step (PithTrain): the run in ate_out/loss has step 3, the answer's LOSS_AT_STEP_3 is its
loss, and rerunning the agent's command (ate_out/loss_command.sh, into a fresh ATE_RUN_DIR) gives it again."""

import os
import subprocess
import tempfile
from pathlib import Path

from common import answer_number, args, close, fail, losses, ok

a = args()
claimed = answer_number(a.answer.read_text(), "LOSS_AT_STEP_3")
logged = losses(a.workdir / "ate_out" / "loss")
if 3 not in logged:
    fail(f"ate_out/loss/metrics.jsonl has no step 3 (steps {sorted(logged)})")
if not close(claimed, logged[3], 1e-3):
    fail(f"LOSS_AT_STEP_3={claimed} but the run logged {logged[3]:.6f}")
command = a.workdir / "ate_out" / "loss_command.sh"
if not command.is_file():
    fail("ate_out/loss_command.sh does not exist")
with tempfile.TemporaryDirectory() as tmp:
    rerun_dir = Path(tmp) / "rerun"
    p = subprocess.run(["bash", str(command)], cwd=a.workdir, env={**os.environ, "ATE_RUN_DIR": str(rerun_dir)},
                       capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        fail(f"rerunning ate_out/loss_command.sh failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-200:]}")
    rerun = losses(rerun_dir)
if 3 not in rerun or not close(rerun[3], claimed, 1e-3):
    fail(f"the rerun's loss at step 3 is {rerun.get(3)}, the answer says {claimed}")
ok(f"loss at step 3 = {claimed} (logged {logged[3]:.6f}, rerun {rerun[3]:.6f})")
