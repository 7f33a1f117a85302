"""Import-level checks: the public names resolve and importing has no side effects."""

import importlib


def test_all_names_resolve():
    """Every public name is a class or function of this package that the README's API section
    documents, and every name that section lists in backticks at a line's start is public."""
    import inspect
    import pathlib
    import re

    module = importlib.import_module("ejk_config")
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    api = readme[readme.index("## API") :]
    for name in module.__all__:
        obj = getattr(module, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__module__.startswith("ejk_config."), (name, obj.__module__)
        assert f"`{name}" in api, f"{name} is not in the README's API section"
    listed = set(re.findall(r"^(?:- |\| )`([A-Za-z_]+)[`(]", api, flags=re.M))
    assert listed <= set(module.__all__), listed - set(module.__all__)
