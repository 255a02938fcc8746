"""ATE-Bench: what a coding agent pays to understand, operate and extend a training framework.

The agent and the task suite stay fixed while the framework varies. `tasks/` holds one TOML file
per task; `runner.py` runs an agent CLI on a fresh copy of a framework per (task, framework,
repeat) and records its metrics; `grading.py` grades the result; `report.py` compares frameworks.
"""
