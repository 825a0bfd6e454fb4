"""Pytest at the project root: the Python examples of README.md and docs/*.md run as tests (tests/doc_examples.py)."""

from tests.doc_examples import (
    docs_env,
    docs_fleet,
    pytest_collect_file,
    pytest_collection_modifyitems,
    pytest_configure,
)

__all__ = [
    "docs_env",
    "docs_fleet",
    "pytest_collect_file",
    "pytest_collection_modifyitems",
    "pytest_configure",
]
