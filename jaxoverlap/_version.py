"""The package's version (pyproject.toml has the same), in a module of its own: the modules
that report it need not import the package they are part of."""

__version__ = "0.1.0"
