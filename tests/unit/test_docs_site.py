"""The docs site works offline: mkdocs.yml loads Mermaid from the vendored copy under docs/, and names no CDN.

Cheap checks of mkdocs.yml and the files it names, without building the site (`make docs` builds it).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.support import ROOT

MERMAID_VERSION = "11.17.2"  # docs/assets/vendor/mermaid/README.md says how it was fetched
MERMAID_JS = "assets/vendor/mermaid/mermaid.min.js"  # under docs/
CDN = re.compile(r"https?://|unpkg|jsdelivr|cdnjs|googleapis", re.IGNORECASE)


class _Loader(yaml.SafeLoader):
    """A safe loader that reads mkdocs.yml's `!!python/name:` tags as the names they hold."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/name:", lambda loader, suffix, node: suffix)


def _config() -> dict[str, Any]:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)  # a SafeLoader
    assert isinstance(config, dict)
    return config


def test_mermaid_is_loaded_from_the_vendored_copy() -> None:
    config = _config()
    docs = ROOT / config["docs_dir"]
    scripts = config.get("extra_javascript", [])
    assert MERMAID_JS in scripts, scripts
    for script in scripts:
        path = script if isinstance(script, str) else script["path"]
        assert not CDN.search(path), f"{path}: a script from the network; the site must work offline"
        assert (docs / path).is_file(), f"mkdocs.yml loads {path}, which is not under {docs}"
    vendored = docs / MERMAID_JS
    assert (vendored.parent / "LICENSE").is_file()
    assert f'version:"{MERMAID_VERSION}"' in vendored.read_text(encoding="utf-8"), "not the version the README names"
    assert MERMAID_VERSION in (vendored.parent / "README.md").read_text()


def test_mermaid_fences_become_diagrams_and_no_cdn_is_configured() -> None:
    config = _config()
    fences = [
        fence
        for extension in config["markdown_extensions"]
        if isinstance(extension, dict) and "pymdownx.superfences" in extension
        for fence in extension["pymdownx.superfences"]["custom_fences"]
    ]
    assert {"name": "mermaid", "class": "mermaid", "format": "pymdownx.superfences.fence_code_format"} in fences
    for line in (ROOT / "mkdocs.yml").read_text().splitlines():
        assert not CDN.search(line.split("#", 1)[0]), f"mkdocs.yml names the network: {line}"
    assert "```mermaid" in (ROOT / "docs" / "architecture.md").read_text()
