"""This project's top-level packages (refengine, kernels, conformance) are its own in the environment: no
other installed distribution ships a module of the same name, which one install would overwrite in
site-packages and which would shadow the other on import (transformers 5.25 requires the hub's `kernels`
distribution, whence the pin in pyproject.toml)."""

from __future__ import annotations

from importlib import metadata

OURS = ("refengine", "kernels", "conformance")


def clashes(owners: dict[str, list[str]]) -> dict[str, list[str]]:
    """Top-level names of ours that a distribution other than this project's ships too."""
    return {name: sorted(set(owners.get(name, [])) - {"refengine"}) for name in OURS
            if set(owners.get(name, [])) - {"refengine"}}


def test_no_other_installed_distribution_ships_a_package_named_like_ours():
    found = clashes(metadata.packages_distributions())
    assert not found, (f"installed distributions ship top-level packages named like this project's: {found} "
                       "(one overwrites the other in site-packages and shadows it on import)")


def test_a_clash_is_found():
    assert clashes({"kernels": ["refengine", "kernels"], "numpy": ["numpy"]}) == {"kernels": ["kernels"]}
    assert clashes({"kernels": ["refengine"], "conformance": ["refengine"]}) == {}
