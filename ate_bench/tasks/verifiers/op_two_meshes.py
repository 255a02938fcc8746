"""op_two_meshes (PithTrain): ate_out/mesh_a and ate_out/mesh_b are runs of at least 3 steps on different
meshes whose losses agree to 1e-4 (relative), and the answer reports that (SAME=yes, MAX_REL_DIFF)."""

import json
from pathlib import Path

from common import answer_number, answer_value, args, fail, losses, ok

a = args()
answer = a.answer.read_text()
runs = [a.workdir / "ate_out" / name for name in ("mesh_a", "mesh_b")]
curves = [losses(r) for r in runs]
steps = sorted(set(curves[0]) & set(curves[1]))
if len(steps) < 3:
    fail(f"the runs share {len(steps)} steps; need at least 3")


def mesh(run: Path):
    """(parallel config, number of DCP rank files of the newest checkpoint): the latter is the world size."""
    cfg = json.loads((run / "run_config.json").read_text()).get("parallel", {}) if (run / "run_config.json").is_file() else {}
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    return cfg, len(list(ckpts[-1].glob("*.distcp"))) if ckpts else None


if mesh(runs[0]) == mesh(runs[1]):
    fail(f"both runs used the same mesh {mesh(runs[0])}")
diff = max(abs(curves[0][s] - curves[1][s]) / abs(curves[0][s]) for s in steps)
if diff > 1e-4:
    fail(f"the losses differ by {diff:.2e} (relative) > 1e-4")
if answer_value(answer, "SAME").lower() not in ("yes", "true"):
    fail("the answer does not say SAME=yes")
claimed = answer_number(answer, "MAX_REL_DIFF")
if abs(claimed - diff) > 1e-6 + 0.5 * diff:
    fail(f"MAX_REL_DIFF={claimed} but the runs differ by {diff:.3e}")
ok(f"{len(steps)} steps, meshes {mesh(runs[0])} vs {mesh(runs[1])}, max relative loss difference {diff:.2e}")
