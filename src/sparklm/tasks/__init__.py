"""Tasks: what is trained. Each task is one module of this package (``INFO``: its registry.TaskInfo) and one line of
registry.TASKS.

A task module holds everything that depends on what is trained, torch-free at import (torch is imported where a
model is built): its model class or the model/ building blocks it assembles, its dataset's kind and checks, the
figures its evaluation reports, its report's sections and pictures, and its CLI choices. Nothing outside a task's
module names it: the data pipeline, the memory plan, the launcher, the report and the CLI ask registry.py for the
capability the task declares.
"""
