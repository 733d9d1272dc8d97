"""One module per TRL trainer DPPO plugs into: what DPPO repeats of it (its formulas, key names and loss form),
each copy held against TRL's own tensors by a contract test (``tests/test_adapter_contract.py``)."""
