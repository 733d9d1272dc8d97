"""Where DPPO meets TRL's trainer: the only code that reads TRL's private names or sets TRL's attributes. It
builds the components (``dppo_trl.components``) and gives them a view of the trainer (``host.view``)."""
