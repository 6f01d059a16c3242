"""Zero-shot evaluation with lm-eval 0.4: the `switchhead` model class and the shipped tasks.

Importing this package registers the model with lm-eval, after which lm-eval's own entry points work::

    import lm_eval, switchhead.evals
    lm_eval.simple_evaluate(model="switchhead", model_args="ckpt=DIR", tasks=["switchhead_blimp"],
                            task_manager=switchhead.evals.task_manager(data_dir="DIR"))
"""

from switchhead.evals.lm import SwitchheadLM
from switchhead.evals.run import TASKS, TASKS_DIR, evaluate, format_table, parse_tasks, task_manager

__all__ = ["TASKS", "TASKS_DIR", "SwitchheadLM", "evaluate", "format_table", "parse_tasks", "task_manager"]
