"""The dashboard's static files: every color from :root, every referenced file present."""
from __future__ import annotations

import re
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent / "webui" / "static"
COLOR = re.compile(r"#[0-9a-fA-F]{3,8}\b|\b(?:rgba?|hsla?|hwb|lab|lch|oklch|color)\(|"
                   r"(?<![\w-])(?:white|black|red|green|blue|gray|grey|yellow|orange|purple)(?![\w-])")


def _root_block(css: str) -> tuple[str, str]:
    """(the :root block, the rest of the stylesheet)."""
    start = css.index(":root {")
    end = css.index("}", start)
    return css[start:end], css[:start] + css[end:]


def test_every_color_is_a_custom_property_in_root():
    css = (STATIC / "dashboard.css").read_text()
    root, rest = _root_block(css)
    assert COLOR.search(root), "the palette should be in :root"
    rest = re.sub(r"/\*.*?\*/", "", rest, flags=re.S)
    assert not COLOR.search(rest), COLOR.search(rest)
    for path in [STATIC / "index.html", *STATIC.glob("*.js")]:
        text = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
        text = re.sub(r'"data:,"', "", text)
        found = re.findall(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b(?![\w-])|\brgba?\(", text)
        assert not found, f"{path.name} hard-codes colors: {found}"


def test_the_page_references_only_files_that_exist():
    html = (STATIC / "index.html").read_text()
    refs = re.findall(r'(?:href|src)="/static/([^"]+)"', html)
    assert set(refs) == {"dashboard.css", "dashboard.js"}
    imports = {m for path in STATIC.glob("*.js") for m in re.findall(r'from "\./([^"]+)"', path.read_text())}
    for name in [*refs, *imports]:
        assert (STATIC / name).is_file(), name


def test_ids_the_scripts_use_exist_in_the_page():
    html = (STATIC / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', html))
    used = {m for path in STATIC.glob("*.js") for m in re.findall(r'\$\("([^"]+)"\)', path.read_text())}
    assert used and used <= ids, used - ids
