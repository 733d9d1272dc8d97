"""The recipes shipped with dppo-trl (package data, installed as ``dppo_trl/recipes``): ``dppo-trl --config
NAME`` resolves ``NAME.yaml`` here. This file only makes the folder a package for setuptools."""
