"""DPPO's math: plain functions on tensors, no TRL import (the designs, the cube, the estimator and its loss-type
table, packing, prompt pruning's cut, the audit's math, weighted statistics, TRL's mirrored formulas, seeds)."""
