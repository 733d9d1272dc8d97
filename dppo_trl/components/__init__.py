"""DPPO's components: each owns its state, gets what it depends on at construction and sees the trainer only
through a ``TrainerView`` (``components.view``); none imports TRL or calls another through ``self``."""
