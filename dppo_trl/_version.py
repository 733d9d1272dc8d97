"""The package's version, in a module of its own: the model card reads it without importing the package."""

__version__ = "0.1.0"
