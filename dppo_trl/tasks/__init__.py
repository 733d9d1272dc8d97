"""Tasks: prompt datasets and reward functions, apart from the trainer's machinery.

- ``toy``: two-digit addition with a tiny character model built offline (``make demo-tiny``, the unit tests);
- ``countdown``: a reasoning-shaped chain task for tiny models (``make bench-reasoning``);
- ``reasoning_gym``: any reasoning-gym task by name, scored with the task's own ``score_answer``
  (the ``reasoning-gym`` extra: ``pip install ".[reasoning-gym]"`` in a checkout, README "Install").
"""
