"""``DPPOTrainer``'s mixins, one idea each, wired into TRL's hooks; each names in its docstring what it reads of
the host trainer."""
