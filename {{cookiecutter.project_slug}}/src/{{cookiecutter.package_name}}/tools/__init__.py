"""The commands: launcher, smoke check, evaluate, diagnose, report, export, pack.

They sit above the loop and import it; the loop never imports them (pyproject.toml's layers).
Nothing here needs editing for a new task: every command reaches the task through the seam
(model.py, data.py, task.py) and trains through the loop (train.py).
"""
