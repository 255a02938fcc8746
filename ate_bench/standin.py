"""A scripted stand-in agent for testing the harness: it makes fixed edits, runs fixed commands,
then replays a fixed transcript on stdout. No model is involved.

  python -m ate_bench.standin SCRIPT.json        (run in the directory to edit)

SCRIPT: {"format": "claude-stream-json" | "codex-json" | "generic-jsonl",
         "actions": [{"write": REL, "text": STR} | {"copy": ABS, "to": REL} | {"delete": REL}
                     | {"run": SHELL, "capture": NAME} | {"sleep": SECONDS}],
         "turns": [[context_tokens, output_tokens], ...],
         "answer": "text; {NAME} is replaced by a captured command's stdout",
         "exit": 0}
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def transcript(fmt: str, turns: list, answer: str) -> list[dict]:
    if fmt == "claude-stream-json":
        events = [{"type": "system", "subtype": "init", "session_id": "standin"}]
        for i, (ctx, out) in enumerate(turns):
            usage = {"input_tokens": 3, "cache_creation_input_tokens": ctx // 4, "cache_read_input_tokens": ctx - 3 - ctx // 4,
                     "output_tokens": out}
            text = answer if i == len(turns) - 1 else f"step {i}"
            # a call split over two events with the same message id, as the CLI does
            events.append({"type": "assistant", "message": {"id": f"msg_{i}", "content": [{"type": "text", "text": text}], "usage": usage}})
            events.append({"type": "assistant", "message": {"id": f"msg_{i}", "content": [{"type": "tool_use", "name": "Bash"}], "usage": usage}})
        events.append({"type": "result", "subtype": "success", "is_error": False, "num_turns": len(turns), "result": answer,
                       "duration_ms": 1234, "usage": {"output_tokens": sum(o for _, o in turns)}})
        return events
    if fmt == "codex-json":
        events = [{"type": "thread.started", "thread_id": "standin"}, {"type": "turn.started"}]
        events += [{"type": "item.completed", "item": {"id": f"item_{i}", "type": "command_execution", "command": "ls"}}
                   for i in range(len(turns) - 1)]
        events.append({"type": "item.completed", "item": {"id": "item_last", "type": "agent_message", "text": answer}})
        events.append({"type": "turn.completed", "usage": {"input_tokens": sum(c for c, _ in turns), "cached_input_tokens": 0,
                                                           "output_tokens": sum(o for _, o in turns)}})
        return events
    return [{"type": "turn", "context_tokens": c, "output_tokens": o} for c, o in turns] + [{"type": "answer", "text": answer}]


def main(script_path: str) -> int:
    script = json.loads(Path(script_path).read_text())
    captured = {}
    for action in script.get("actions", []):
        if "write" in action:
            Path(action["write"]).parent.mkdir(parents=True, exist_ok=True)
            Path(action["write"]).write_text(action["text"])
        elif "copy" in action:
            Path(action["to"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(action["copy"], action["to"])
        elif "delete" in action:
            target = Path(action["delete"])
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        elif "run" in action:
            p = subprocess.run(["bash", "-c", action["run"]], capture_output=True, text=True)
            sys.stderr.write(p.stderr)
            captured[action.get("capture", "_")] = p.stdout.strip()
        elif "sleep" in action:
            time.sleep(action["sleep"])
    answer = script.get("answer", "")
    for name, value in captured.items():
        answer = answer.replace("{" + name + "}", value)
    for event in transcript(script.get("format", "claude-stream-json"), script.get("turns", [[1000, 100]]), answer):
        print(json.dumps(event), flush=True)
    return int(script.get("exit", 0))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
