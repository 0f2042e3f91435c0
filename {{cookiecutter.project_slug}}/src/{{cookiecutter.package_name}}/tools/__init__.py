"""The tools around the loop: launcher, smoke check, diagnostics, evaluation, reports.

Nothing here needs editing for a new task: every tool reaches the task through the seam
(model.py, data.py, task.py) and trains through the loop (train.py).
"""
