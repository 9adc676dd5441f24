"""The user commands that are not a package's ``__main__``: each module's ``main`` is a console script
(pyproject.toml), and ``tools/<name>.py`` in a checkout runs the same ``main``."""
